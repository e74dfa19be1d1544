"""torchfuse::cross_entropy on the GPU, forced past the registry's thresholds, against a float64
evaluation of what it stands for (PyTorch's cross_entropy of the logits cast to the loss
dtype; for the rewrite, HF's ForCausalLMLoss), with stock's own error as the bar
(docs/testing.md): within max(2 x stock's error, the dtype's floor), same dtypes and shapes;
bitwise reproducible; bad targets fail as stock's do; HF's causal-LM loss, rewritten, gives
the original's loss and logits gradient."""
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import LIB_DIR, ROOT, clean_env, requires_cuda
from gpu_util import (FLOOR, enabled, fresh_seed, fused_count, rel_err, stock_reasons,
                      torchfuse_below_thresholds)

# The kernels serve every shape here, also where the registry sends it to stock.
pytestmark = [requires_cuda, pytest.mark.usefixtures("torchfuse_below_thresholds")]

OP, OP_BWD = "torchfuse::cross_entropy", "torchfuse::cross_entropy (backward)"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def incoming_grad(rows, reduction, dtype):
    """The loss's gradient: one a row (none) or one value."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    if reduction == 0:
        return torch.randn(rows, device="cuda", generator=g).to(dtype)
    return torch.tensor(1.7, device="cuda", dtype=dtype)


def run(logits, target, reduction, ignore_index, dtype, on, smoothing=0.0):
    """(loss, grad of the logits, the loss's incoming grad) through the op, served (on) or
    stock (off)."""
    x = logits.detach().requires_grad_(True)
    with enabled("cross_entropy", on):
        loss = torch.ops.torchfuse.cross_entropy(x, target, reduction, ignore_index, smoothing, dtype)
        grad_loss = incoming_grad(target.numel(), reduction, loss.dtype)
        (grad,) = torch.autograd.grad(loss, x, grad_loss)
    return loss.detach(), grad, grad_loss


def reference(logits, target, reduction, ignore_index, grad_loss, smoothing=0.0):
    """The float64 loss and gradient, and the size of the terms each one cancels: the loss is
    lse - x[target] and its gradient softmax - onehot, so where the target's probability is ~1
    (large logits) both are far smaller than their terms, and any fp32 evaluation, stock's
    too, is exact only to the terms' rounding. The scale is the target-logit part alone (nll
    of the raw logits and its gradient; with label smoothing e, (1 - e) of it and e of the same
    for the row's mean logit)."""
    x = logits.detach().double().requires_grad_(True)
    options = dict(ignore_index=ignore_index, reduction=REDUCTIONS[reduction])
    loss = F.cross_entropy(x, target, label_smoothing=smoothing, **options)
    (grad,) = torch.autograd.grad(loss, x, grad_loss.double())
    term = ((1 - smoothing) * F.nll_loss(x, target, **options)
            + smoothing * F.nll_loss(x.mean(1, keepdim=True).expand_as(x), target, **options))
    (term_grad,) = torch.autograd.grad(term, x, grad_loss.double())
    return loss.detach(), grad, term.detach().norm().item(), term_grad.norm().item()


def err(out, ref, scale):
    """The error relative to the result, or to the cancelled terms' size where the result is
    smaller than them (a zero result: the error itself)."""
    diff = (out.double() - ref.double()).norm().item()
    denom = max(ref.double().norm().item(), scale)
    return diff / denom if denom > 0 else diff


def check(logits, target, reduction, ignore_index, dtype, what, smoothing=0.0):
    before = fused_count(OP), fused_count(OP_BWD)
    ours, our_grad, grad_loss = run(logits, target, reduction, ignore_index, dtype, True, smoothing)
    assert (fused_count(OP), fused_count(OP_BWD)) == (before[0] + 1, before[1] + 1), (
        what, stock_reasons(OP), stock_reasons(OP_BWD))
    stock, stock_grad, _ = run(logits, target, reduction, ignore_index, dtype, False, smoothing)
    ref, ref_grad, loss_scale, grad_scale = reference(logits, target, reduction, ignore_index, grad_loss,
                                                      smoothing)
    assert ours.dtype == stock.dtype == dtype and ours.shape == stock.shape, what
    assert our_grad.dtype == logits.dtype and our_grad.shape == logits.shape, what
    for name, o, s, r, scale, floor in (("loss", ours, stock, ref, loss_scale, FLOOR[dtype]),
                                        ("grad", our_grad, stock_grad, ref_grad, grad_scale, FLOOR[logits.dtype])):
        if r.isnan().any():
            assert torch.equal(o.isnan(), s.isnan()), f"{what} {name}: NaN where stock has none or not"
            continue
        # Where the true value is past the dtype's range (an fp16 sum past 65504), it rounds to
        # inf: ours must give that inf (stock gives inf, or NaN from smoothing's 0 * inf).
        rounded = r.to(o.dtype)
        past_range = rounded.isinf()
        assert torch.equal(o[past_range], rounded[past_range]), f"{what} {name}: not inf past the dtype's range"
        if past_range.all():
            continue
        # (scale stays the whole result's: no case here has some rows past the range, as a
        # row's loss is far below 65504.)
        o, s, r = o[~past_range], s[~past_range], r[~past_range]
        e_ours = err(o, r, scale)
        # Stock may overflow inside where the result is in range (smoothing's fp16 sums of
        # -log p): then the floor alone is the bar.
        e_stock = err(s, r, scale) if s.isfinite().all() else 0.0
        assert e_ours <= max(2 * e_stock, floor), f"{what} {name}: ours {e_ours:.3g} stock {e_stock:.3g}"
    again = run(logits, target, reduction, ignore_index, dtype, True, smoothing)
    for a, b in ((ours, again[0]), (our_grad, again[1])):  # NaN where every row is ignored
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=f"{what}: not reproducible")


def test_random_cases():
    seed = fresh_seed()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for case in range(40):
        dtype = rng.choice(DTYPES)
        loss_dtype = rng.choice([dtype, torch.float32])
        rows = rng.choice([1, 3, 64, 1000, 4096])
        cols = rng.choice([1, 2, 7, 8, 1000, 1003, 32000, 50304])
        logits = (torch.randn(rows, cols, device="cuda") * rng.choice([1.0, 4.0, 30.0])).to(dtype)
        ignore_index = rng.choice([-100, 0, 5])
        target = torch.randint(0, cols, (rows,), device="cuda")
        if rng.random() < 0.5:
            target[torch.rand(rows, device="cuda") < 0.3] = ignore_index
        reduction = rng.choice([0, 1, 2])
        smoothing = rng.choice([0.0, 0.0, 0.1, 1.0])
        check(logits, target, reduction, ignore_index, loss_dtype,
              f"seed {seed} case {case}: {dtype}->{loss_dtype} {rows}x{cols} ignore {ignore_index} "
              f"{REDUCTIONS[reduction]} label_smoothing {smoothing}", smoothing)


def test_rows_at_every_offset_within_16_bytes():
    """Rows of odd widths (GPT-2's 50257 classes) start at a different offset within 16 bytes
    row by row, and a view into a buffer moves the first row too: the kernels take the elements
    before each row's first 16-byte boundary and after its last whole chunk one by one."""
    seed = fresh_seed()
    torch.manual_seed(seed)
    for dtype in (torch.bfloat16, torch.float32):
        for cols in (50257, 1003, 9, 17, 3):
            rows = 37
            for offset in (0, 1, 3, 5):
                flat = torch.randn(offset + rows * cols, device="cuda") * 4
                logits = flat.to(dtype)[offset:].view(rows, cols)
                target = torch.randint(0, cols, (rows,), device="cuda")
                target[::5] = -100
                for smoothing in (0.0, 0.1):
                    check(logits, target, 1, -100, torch.float32,
                          f"seed {seed}: {dtype} {rows}x{cols} at offset {offset} smoothing {smoothing}",
                          smoothing)


def test_every_row_ignored_gives_stocks_nan_and_zero_grads():
    logits = torch.randn(16, 100, device="cuda", dtype=torch.bfloat16)
    target = torch.full((16,), -100, device="cuda")
    ours, grad, _ = run(logits, target, 1, -100, torch.float32, True)
    stock, stock_grad, _ = run(logits, target, 1, -100, torch.float32, False)
    assert ours.isnan() and stock.isnan()
    assert torch.equal(grad, stock_grad) and not grad.any()


def test_large_vocabulary_and_many_rows():
    """Llama-3's vocabulary; 65536 rows x 128256 classes is past 2^31 elements (16 GB in bf16)."""
    torch.manual_seed(fresh_seed())
    logits = torch.randn(64, 128256, device="cuda", dtype=torch.bfloat16) * 3
    target = torch.randint(0, 128256, (64,), device="cuda")
    check(logits, target, 1, -100, torch.float32, "64x128256")
    if torch.cuda.get_device_properties(0).total_memory < 60 << 30:
        pytest.skip("the 2^31-element case needs 60 GB of GPU memory")
    rows = (1 << 31) // 128256 + 64
    big = torch.randn(rows, 128256, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, 128256, (rows,), device="cuda")
    before = fused_count(OP)
    loss = torch.ops.torchfuse.cross_entropy(big, target, 0, -100, 0.0, torch.float32)
    assert fused_count(OP) == before + 1
    last = slice(rows - 8, rows)
    expected = F.cross_entropy(big[last].float(), target[last], reduction="none")
    assert (loss[last] - expected).abs().max() < 1e-3


def test_what_is_not_served_goes_to_stock():
    logits = torch.randn(8, 50, device="cuda")
    target = torch.randint(0, 50, (8,), device="cuda")
    cases = [
        (lambda: torch.ops.torchfuse.cross_entropy(logits.t().contiguous().t(), target, 1, -100, 0.0, None), "non-contiguous input"),
        (lambda: torch.ops.torchfuse.cross_entropy(logits.double(), target, 1, -100, 0.0, None), "unsupported dtype"),
    ]
    for call, why in cases:
        before = stock_reasons(OP).get(why, 0)
        ours = call()
        assert stock_reasons(OP).get(why, 0) == before + 1, (why, stock_reasons(OP))
        with enabled("cross_entropy", False):
            assert torch.equal(ours, call())


def test_bad_targets_fail_as_stock():
    """A class index out of range: stock's nll_loss asserts on the device (the CUDA context is
    lost), so each side runs in a fresh process; both must fail, neither may return a loss."""
    code = f"""
import torch, sys
torch.ops.load_library({str(LIB_DIR / 'libtorchfuse.so')!r})
torch.ops.torchfuse._serve_below_thresholds(True)
torch.ops.torchfuse.set_enabled("cross_entropy", sys.argv[1] == "on")
x = torch.randn(4, 10, device="cuda")
t = torch.tensor([1, 2, 10, 3], device="cuda")
print(torch.ops.torchfuse.cross_entropy(x, t, 1, -100, 0.0, None).item())
"""
    for side in ("on", "off"):
        proc = subprocess.run([sys.executable, "-c", code, side], env=clean_env(), capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode != 0, (side, proc.stdout, proc.stderr[-2000:])


def test_hf_causal_lm_loss_rewritten_gives_the_originals_loss_and_grad():
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "python"))
    from torchfuse import rewrites
    import transformers.loss.loss_utils as L
    original = getattr(L.ForCausalLMLoss, "__wrapped__", L.ForCausalLMLoss)
    rewritten = rewrites._causal_lm_loss(torch, original, "hf_causal_lm_loss")
    torch.manual_seed(fresh_seed())
    logits = torch.randn(4, 257, 32000, device="cuda", dtype=torch.bfloat16) * 3
    labels = torch.randint(0, 32000, (4, 257), device="cuda")
    labels[:, :5] = -100
    for items in (None, torch.tensor(700, device="cuda")):
        before = fused_count(OP)
        out = []
        for fn in (rewritten, original):
            x = logits.detach().requires_grad_(True)
            loss = fn(x, labels, 32000, num_items_in_batch=items)
            (g,) = torch.autograd.grad(loss, x)
            out.append((loss, g))
        (ours, our_grad), (theirs, their_grad) = out
        assert fused_count(OP) == before + 1
        assert ours.dtype == theirs.dtype == torch.float32 and our_grad.dtype == torch.bfloat16
        assert rel_err(ours, theirs) < 1e-5 and rel_err(our_grad, their_grad) < FLOOR[torch.bfloat16]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_hf_causal_lm_loss_compiled_calls_torchfuses_kernels(dynamic):
    """Under torch.compile (fullgraph: no graph break in the rewrite), a trace of static sizes
    records torchfuse::cross_entropy_fwd / _bwd, whose runs are counted as the op's calls; with
    symbolic sizes the decomposition is traced (nothing counted). Both give the original's loss
    and logits gradient; torch.export keeps the original code (no torchfuse op in the program)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "python"))
    from torchfuse import rewrites
    import transformers.loss.loss_utils as L
    original = getattr(L.ForCausalLMLoss, "__wrapped__", L.ForCausalLMLoss)
    rewritten = rewrites._causal_lm_loss(torch, original, "hf_causal_lm_loss")
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, y: rewritten(x, y, 32000), fullgraph=True, dynamic=dynamic)
    torch.manual_seed(fresh_seed())
    logits = torch.randn(4, 257, 32000, device="cuda", dtype=torch.bfloat16) * 3
    labels = torch.randint(0, 32000, (4, 257), device="cuda")
    labels[:, :5] = -100
    out, counts = [], []
    for fn in (compiled, lambda x, y: original(x, y, 32000)):
        x = logits.detach().requires_grad_(True)
        before = fused_count(OP), fused_count(OP_BWD)
        loss = fn(x, labels)
        (g,) = torch.autograd.grad(loss, x)
        out.append((loss, g))
        counts.append((fused_count(OP) - before[0], fused_count(OP_BWD) - before[1]))
    (ours, our_grad), (theirs, their_grad) = out
    # Counted only for the compiled call (the original's eager F.cross_entropy is counted as
    # aten's cross_entropy_loss, its backward under the shared backward name).
    served = 0 if dynamic else 1
    assert counts[0] == (served, served), (counts, stock_reasons(OP), stock_reasons(OP_BWD))
    assert ours.dtype == theirs.dtype == torch.float32 and our_grad.dtype == torch.bfloat16
    assert rel_err(ours, theirs) < 1e-5 and rel_err(our_grad, their_grad) < FLOOR[torch.bfloat16]

    class Loss(torch.nn.Module):
        def forward(self, x, y):
            return rewritten(x, y, 32000)

    program = torch.export.export(Loss(), (logits, labels))
    assert "torchfuse" not in str(program.graph), program.graph


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
def test_aten_cross_entropy_from_any_caller(autocast):
    """F.cross_entropy itself (aten::cross_entropy_loss, taken at AutogradCUDA): stock's dtypes
    (under autocast a 16-bit logits' loss is fp32, as stock's log_softmax gives), values and
    gradients within the contract, with and without label smoothing; class weights stay
    stock's, and so does a label smoothing above 1 (stock's error)."""
    seed = fresh_seed()
    torch.manual_seed(seed)
    for dtype in DTYPES:
        for reduction, smoothing in [(r, e) for r in ("none", "mean", "sum") for e in (0.0, 0.1)]:
            logits = (torch.randn(512, 1003, device="cuda") * 4).to(dtype)
            target = torch.randint(0, 1003, (512,), device="cuda")
            target[::7] = -100

            def go(on):
                x = logits.detach().requires_grad_(True)
                with enabled("cross_entropy", on), torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                    loss = F.cross_entropy(x, target, reduction=reduction, label_smoothing=smoothing)
                grad_loss = incoming_grad(512, 0 if reduction == "none" else 1, loss.dtype)
                (grad,) = torch.autograd.grad(loss, x, grad_loss)
                return loss.detach(), grad, grad_loss

            what = f"seed {seed} {dtype} {reduction} label_smoothing {smoothing} autocast={autocast}"
            before = fused_count("cross_entropy_loss")
            ours, our_grad, grad_loss = go(True)
            assert fused_count("cross_entropy_loss") == before + 1, (what, stock_reasons("cross_entropy_loss"))
            stock, stock_grad, _ = go(False)
            assert ours.dtype == stock.dtype and our_grad.dtype == stock_grad.dtype == dtype, what
            x64 = logits.detach().double().requires_grad_(True)
            ref = F.cross_entropy(x64, target, reduction=reduction, label_smoothing=smoothing)
            (ref_grad,) = torch.autograd.grad(ref, x64, grad_loss.double())
            for name, o, s, r, floor in (("loss", ours, stock, ref, FLOOR[ours.dtype]),
                                         ("grad", our_grad, stock_grad, ref_grad, FLOOR[dtype])):
                e_ours, e_stock = rel_err(o, r), rel_err(s, r)
                assert e_ours <= max(2 * e_stock, floor), f"{what} {name}: ours {e_ours:.3g} stock {e_stock:.3g}"
    logits = torch.randn(64, 10, device="cuda")
    target = torch.randint(0, 10, (64,), device="cuda")
    before = fused_count("cross_entropy_loss")
    weighted = F.cross_entropy(logits, target, weight=torch.rand(10, device="cuda"))
    assert fused_count("cross_entropy_loss") == before and weighted.isfinite()
    with pytest.raises(RuntimeError) as ours:
        F.cross_entropy(logits, target, label_smoothing=1.5)
    with enabled("cross_entropy", False), pytest.raises(RuntimeError) as stock:
        F.cross_entropy(logits, target, label_smoothing=1.5)
    assert str(ours.value) == str(stock.value) and fused_count("cross_entropy_loss") == before
    for unsmoothed in (-0.1, float("nan")):  # stock smooths only where label_smoothing > 0
        x = logits.detach().requires_grad_(True)
        ours = F.cross_entropy(x, target, label_smoothing=unsmoothed)
        (our_grad,) = torch.autograd.grad(ours, x)
        with enabled("cross_entropy", False):
            stock = F.cross_entropy(x, target, label_smoothing=unsmoothed)
            (stock_grad,) = torch.autograd.grad(stock, x)
        assert rel_err(ours, stock) < 1e-6 and rel_err(our_grad, stock_grad) < 1e-6, unsmoothed
    assert fused_count("cross_entropy_loss") == before + 2


def test_nan_logits_inplace_loss_and_double_backward_like_stock():
    torch.manual_seed(fresh_seed())
    logits = torch.randn(6, 9, device="cuda")
    logits[1, 8] = float("nan")  # the last, partial chunk of a row (the scalar path)
    logits[2, :] = float("-inf")
    logits[2, 3] = float("nan")
    target = torch.tensor([0, 1, 2, -100, 8, 4], device="cuda")
    ours, _, _ = run(logits, target, 0, -100, torch.float32, True)
    stock, _, _ = run(logits, target, 0, -100, torch.float32, False)
    assert torch.equal(ours.isnan(), stock.isnan()), (ours, stock)

    def step(on):
        x = torch.randn(32, 1000, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).requires_grad_(True)
        t = torch.randint(0, 1000, (32,), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
        with enabled("cross_entropy", on):
            loss = F.cross_entropy(x, t)
            loss *= 3.0  # in place, as a Trainer scales a loss
            (g,) = torch.autograd.grad(loss, x, create_graph=True)
            g.square().sum().backward()  # a gradient penalty: the second derivative
        return loss.detach(), x.grad

    before = fused_count("cross_entropy_loss")
    ours, stock = step(True), step(False)
    assert fused_count("cross_entropy_loss") == before + 1
    assert rel_err(ours[0], stock[0]) < 1e-5 and rel_err(ours[1], stock[1]) < 1e-4
