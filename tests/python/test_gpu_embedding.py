"""Embedding forward (a gather: bitwise equal to stock) and embedding_dense_backward
(against a float64 reference and stock, docs/testing.md ("Correctness"); bitwise reproducible) through
torchfuse, over fresh random cases."""
import os
import random
import threading

import pytest
import torch
import torch.nn.functional as F

from conftest import requires_cuda, run_python
from gpu_util import (FLOOR, enabled, fresh_seed, fused_count, garbage_allocator, kernel_count,
                      poison_allocator, rel_err, stock_reasons, torchfuse_below_thresholds)

pytestmark = [requires_cuda, pytest.mark.usefixtures("torchfuse_below_thresholds")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def draw_indices(rng, gen, num_weights, shape, kind, dtype=torch.int64):
    """Indices in [0, num_weights) with the named distribution."""
    n = 1
    for s in shape:
        n *= s
    if kind == "uniform":
        flat = torch.randint(0, num_weights, (n,), generator=gen, device="cuda")
    elif kind == "zipf":  # real text: a few rows take most tokens
        ranks = torch.arange(1, num_weights + 1, device="cuda", dtype=torch.float64)
        probs = ranks.pow(-1.1)
        flat = torch.multinomial(probs / probs.sum(), n, replacement=True, generator=gen)
    elif kind == "equal":  # every token the same row: the worst case for naive schemes
        flat = torch.full((n,), rng.randrange(num_weights), device="cuda")
    elif kind == "few":  # a handful of rows, long runs of each
        rows = torch.randint(0, num_weights, (min(num_weights, 5),), generator=gen, device="cuda")
        flat = rows[torch.randint(0, rows.numel(), (n,), generator=gen, device="cuda")]
    else:
        raise ValueError(kind)
    return flat.to(dtype).view(shape)


def make_weight(gen, num_weights, dim, dtype, layout):
    w = torch.randn(num_weights, dim, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    if layout == "row_padded":  # rows further apart than their width
        big = torch.randn(num_weights, dim + 5, generator=gen, device="cuda").to(dtype)
        big[:, :dim] = w
        return big[:, :dim]
    if layout == "misaligned":  # storage offset of one element: not 16-byte aligned
        flat = torch.empty(num_weights * dim + 1, device="cuda", dtype=dtype)
        flat[1:].copy_(w.flatten())
        return flat[1:].view(num_weights, dim)
    return w


def test_forward_random_cases_equal_stock_bitwise():
    rng = random.Random(fresh_seed())
    gen = torch.Generator(device="cuda").manual_seed(rng.randrange(2**31))
    before = fused_count("embedding")
    cases = 0
    for _ in range(80):
        num_weights = rng.choice([1, 2, 7, 100, 1000, 50304, rng.randrange(1, 70000)])
        dim = rng.choice([1, 3, 8, 64, 768, 771, 1024, rng.randrange(1, 1100)])
        dtype = rng.choice(DTYPES)
        shape = rng.choice([(rng.randrange(1, 3000),), (rng.randrange(1, 9), rng.randrange(1, 600)),
                            (), (2, 3, 5)])
        idx_dtype = rng.choice([torch.int64, torch.int32])
        kind = rng.choice(["uniform", "zipf", "equal", "few"])
        layout = rng.choice(["contiguous", "contiguous", "row_padded", "misaligned"])
        weight = make_weight(gen, num_weights, dim, dtype, layout)
        idx = draw_indices(rng, gen, num_weights, shape, kind, idx_dtype)
        if rng.random() < 0.2 and idx.dim() == 2:
            idx = idx.t()  # non-contiguous indices
        poison_allocator(idx.numel() * dim * 4)
        ours = F.embedding(idx, weight)
        with enabled("embedding", False):
            ref = F.embedding(idx, weight)
        torch.cuda.synchronize()
        desc = f"V={num_weights} D={dim} {dtype} {tuple(idx.shape)} {idx_dtype} {kind} {layout}"
        assert ours.shape == ref.shape and ours.dtype == ref.dtype, desc
        assert ours.is_contiguous(), desc
        assert torch.equal(ours, ref), desc
        cases += 1
    assert fused_count("embedding") - before == cases


def reference_grad(grad, idx, num_weights, padding_idx):
    dim = grad.shape[-1]
    ref = torch.zeros(num_weights, dim, dtype=torch.float64, device="cuda")
    ref.index_add_(0, idx.reshape(-1).long(), grad.reshape(-1, dim).double())
    if 0 <= padding_idx < num_weights:
        ref[padding_idx] = 0
    return ref


def dense_backward(grad, idx, num_weights, padding_idx, on):
    with enabled("embedding", on):
        return torch.ops.aten.embedding_dense_backward(grad, idx, num_weights, padding_idx, False)


def check_backward(grad, idx, num_weights, padding_idx, desc, garbage=False):
    """Ours against stock and a float64 reference. garbage: every allocation of both calls
    starts out as random bits (else the output's starts as NaN)."""
    out_bytes = num_weights * grad.shape[-1] * 4
    if garbage:
        garbage_allocator(2 * out_bytes)
    else:
        poison_allocator(out_bytes)
    ours = dense_backward(grad, idx, num_weights, padding_idx, True)
    if garbage:
        garbage_allocator(2 * out_bytes)
    again = dense_backward(grad, idx, num_weights, padding_idx, True)
    stock = dense_backward(grad, idx, num_weights, padding_idx, False)
    torch.cuda.synchronize()
    ref = reference_grad(grad, idx, num_weights, padding_idx)
    assert ours.shape == stock.shape and ours.dtype == stock.dtype, desc
    assert torch.equal(ours, again), f"not reproducible: {desc}"
    assert not ours.isnan().any(), f"unwritten rows: {desc}"
    if 0 <= padding_idx < num_weights:
        assert not ours[padding_idx].any(), desc
    # Rows no token touches are exactly zero.
    touched = torch.zeros(num_weights, dtype=torch.bool, device="cuda")
    touched[idx.reshape(-1).long()] = True
    assert not ours[~touched].any(), desc
    err, stock_err = rel_err(ours, ref), rel_err(stock, ref)
    assert err <= max(2 * stock_err, FLOOR[grad.dtype]), (
        f"{desc}: ours {err:.3g}, stock {stock_err:.3g}; {worst_row(ours, ref, idx, num_weights)}")


def worst_row(ours, ref, idx, num_weights):
    """Where ours is furthest from the reference: the row, how many tokens it has, and its norms
    (tells an unwritten or zeroed row from a wrong sum)."""
    diff = (ours.double() - ref).norm(dim=1)
    row = int(diff.argmax())
    tokens = int((idx.reshape(-1).long() == row).sum())
    return (f"worst row {row} of {num_weights} ({tokens} tokens): |ours| {ours[row].double().norm():.4g}, "
            f"|ref| {ref[row].norm():.4g}, |diff| {diff[row]:.4g}")


def random_backward_cases(cases, garbage):
    seed = fresh_seed()
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(rng.randrange(2**31))
    before = fused_count("embedding_dense_backward")
    for _ in range(cases):
        num_weights = rng.choice([1, 2, 33, 513, 5000, 50304, 128256, rng.randrange(1, 300000)])
        dim = rng.choice([1, 5, 8, 64, 768, 770, rng.randrange(1, 1100)])
        dtype = rng.choice(DTYPES)
        tokens = rng.choice([1, 31, 32, 33, 4095, 4097, rng.randrange(1, 20000), rng.randrange(1, 70000)])
        shape = rng.choice([(tokens,), (max(tokens // 7, 1), 7)])
        kind = rng.choice(["uniform", "zipf", "equal", "few"])
        idx = draw_indices(rng, gen, num_weights, shape, kind, rng.choice([torch.int64, torch.int32]))
        padding_idx = rng.choice([-1, -1, rng.randrange(num_weights), int(idx.reshape(-1)[0])])
        grad = torch.randn(*idx.shape, dim, generator=gen, device="cuda").to(dtype)
        desc = (f"V={num_weights} D={dim} {dtype} {tuple(idx.shape)} {idx.dtype} {kind} pad={padding_idx}"
                f" (seed {seed})")
        check_backward(grad, idx, num_weights, padding_idx, desc, garbage)
    assert fused_count("embedding_dense_backward") - before == 2 * cases


def test_backward_random_cases():
    random_backward_cases(60, garbage=False)


def test_backward_reads_nothing_it_did_not_write():
    """Every allocation of the call (output, sort buffers, partials, work list) starts out as
    random bits: scratch read before it is written, or an output row left unwritten, shows up
    as a wrong or irreproducible result. TORCHFUSE_TEST_STRESS=N runs N cases (default 30)."""
    random_backward_cases(int(os.environ.get("TORCHFUSE_TEST_STRESS", "30")), garbage=True)


def test_cluster_sort_equals_launch_sort_bitwise():
    """Hopper sorts up to 32768 tokens on one thread-block cluster, other GPUs (and more tokens)
    in launches. Both sorts are stable and the reduction after them is the same, so the two
    results must be bitwise equal; each is also checked against the reference."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the cluster sort needs sm 90 (thread-block clusters)")
    seed = fresh_seed()
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(rng.randrange(2**31))
    sides = {"emb_bwd_cluster_sort": 0, "emb_bwd_sorted": 0}
    try:
        for case in range(24):
            # Every tile size (1, 2, 4 and 8 tokens per thread), the 32768 edge, 1 to 4 passes.
            tokens = [1, 4095, 4096, 4097, 8193, 16384, 32767, 32768][case % 8]
            num_weights = rng.choice([2, 511, 512, 513, 50304, 131073, rng.randrange(1, 2**25)])
            dim = rng.choice([1, 64, 768, 1000]) if num_weights <= 131073 else rng.choice([1, 8])
            if case == 23:
                num_weights, dim = 2**28 + 5, 1  # 29-bit keys: four passes
            kind = rng.choice(["uniform", "zipf", "equal", "few"])
            if kind == "zipf" and num_weights > 300_000:
                kind = "uniform"
            idx = draw_indices(rng, gen, num_weights, (tokens,), kind,
                               rng.choice([torch.int64, torch.int32]))
            grad = torch.randn(tokens, dim, generator=gen, device="cuda").to(torch.bfloat16)
            padding_idx = rng.choice([-1, int(idx[0])])
            desc = f"V={num_weights} D={dim} T={tokens} {kind} pad={padding_idx} (seed {seed})"
            outs = {}
            for name in sides:
                torch.ops.torchfuse._force_variant(name)
                before = kernel_count("embedding_dense_backward", name)
                poison_allocator(num_weights * dim * 4)
                outs[name] = dense_backward(grad, idx, num_weights, padding_idx, True)
                sides[name] += kernel_count("embedding_dense_backward", name) - before
            torch.ops.torchfuse._force_variant("")
            ref = reference_grad(grad, idx, num_weights, padding_idx)
            assert rel_err(outs["emb_bwd_sorted"], ref) <= FLOOR[torch.bfloat16], desc
            assert torch.equal(outs["emb_bwd_cluster_sort"], outs["emb_bwd_sorted"]), desc
    finally:
        torch.ops.torchfuse._force_variant("")
    assert sides == {"emb_bwd_cluster_sort": 24, "emb_bwd_sorted": 24}, sides


@pytest.mark.parametrize("kind", ["equal", "few", "zipf"])
def test_backward_long_runs_cross_many_chunks(kind):
    """A row's tokens spread over thousands of chunks: the partials path, in fixed order."""
    seed = fresh_seed()
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(rng.randrange(2**31))
    for dtype in DTYPES:
        idx = draw_indices(rng, gen, 50304, (150_000,), kind)
        grad = torch.randn(150_000, 96, generator=gen, device="cuda").to(dtype)
        check_backward(grad, idx, 50304, -1, f"{kind} {dtype} (seed {seed})")


def test_module_autograd_matches_stock():
    rng = random.Random(fresh_seed())
    for dtype, padding_idx in [(torch.float32, None), (torch.bfloat16, 3), (torch.float16, 0)]:
        seed = rng.randrange(2**31)
        results = []
        for on in (True, False):
            torch.manual_seed(seed)
            emb = torch.nn.Embedding(1000, 64, padding_idx=padding_idx, device="cuda", dtype=dtype)
            idx = torch.randint(0, 1000, (8, 333), device="cuda")
            idx[0, :5] = 3
            with enabled("embedding", on):
                y = emb(idx)
                (y.float() * torch.linspace(-1, 1, 64, device="cuda")).square().sum().backward()
            results.append((y.detach(), emb.weight.grad))
        (y_on, g_on), (y_off, g_off) = results
        assert torch.equal(y_on, y_off)
        torch.testing.assert_close(g_on, g_off, rtol=FLOOR[dtype] * 4, atol=FLOOR[dtype] * 4)
        if padding_idx is not None:
            assert not g_on[padding_idx].any()


def test_deterministic_mode_runs_our_kernel():
    torch.use_deterministic_algorithms(True)
    try:
        before = fused_count("embedding_dense_backward")
        idx = torch.randint(0, 5000, (4096,), device="cuda")
        grad = torch.randn(4096, 128, device="cuda")
        a = dense_backward(grad, idx, 5000, -1, True)
        b = dense_backward(grad, idx, 5000, -1, True)
        assert torch.equal(a, b)
        assert fused_count("embedding_dense_backward") == before + 2
    finally:
        torch.use_deterministic_algorithms(False)


def test_empty_and_scalar_indices():
    weight = torch.randn(10, 3, device="cuda")
    empty = torch.empty(0, 3, dtype=torch.long, device="cuda")
    assert F.embedding(empty, weight).shape == (0, 3, 3)
    scalar = torch.tensor(4, device="cuda")
    assert torch.equal(F.embedding(scalar, weight), weight[4])
    grad = torch.empty(0, 3, 3, device="cuda")
    g = torch.ops.aten.embedding_dense_backward(grad, empty, 10, -1, False)
    assert g.shape == (10, 3) and not g.any()
    assert stock_reasons("embedding_dense_backward").get("empty input", 0) >= 1


def test_scale_grad_by_freq_goes_to_stock():
    before = stock_reasons("embedding_dense_backward").get("scale_grad_by_freq is not served", 0)
    idx = torch.tensor([1, 1, 2], device="cuda")
    g = torch.ops.aten.embedding_dense_backward(torch.ones(3, 4, device="cuda"), idx, 5, -1, True)
    assert torch.equal(g[1], torch.ones(4, device="cuda"))  # (1 + 1) / count 2
    after = stock_reasons("embedding_dense_backward").get("scale_grad_by_freq is not served", 0)
    assert after == before + 1


def test_bad_input_gets_stocks_error():
    weight = torch.randn(10, 4, device="cuda")
    with pytest.raises(RuntimeError, match="Long, Int"):
        F.embedding(torch.tensor([1, 2], device="cuda", dtype=torch.int16), weight)
    with pytest.raises(RuntimeError, match="must be 2-D"):
        torch.embedding(torch.randn(10, device="cuda"), torch.tensor([1], device="cuda"))
    with pytest.raises(RuntimeError):
        F.embedding(torch.tensor([1, 2]), weight)  # CPU indices, CUDA table


def test_cuda_graph_capture():
    weight = torch.randn(3000, 256, device="cuda", requires_grad=True)
    idx = torch.randint(0, 3000, (4, 512), device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles the kernels) outside the capture
        F.embedding(idx, weight).sum().backward()
    torch.cuda.current_stream().wait_stream(stream)
    weight.grad = None
    graph = torch.cuda.CUDAGraph()
    before = (fused_count("embedding"), fused_count("embedding_dense_backward"))
    with torch.cuda.graph(graph):
        out = F.embedding(idx, weight)
        (grad_weight,) = torch.autograd.grad(out.square().sum(), weight)
    assert (fused_count("embedding"), fused_count("embedding_dense_backward")) == (before[0] + 1, before[1] + 1)
    for _ in range(2):
        idx.copy_(torch.randint(0, 3000, idx.shape, device="cuda"))
        weight.data.copy_(torch.randn_like(weight))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, weight[idx])
        ref = reference_grad(2 * weight[idx].detach(), idx, 3000, -1)
        assert rel_err(grad_weight, ref) <= 1e-5


def test_zero_rows_are_ordered_before_the_callers_next_op():
    """The zero rows are written on a second stream: the caller's stream must wait for them
    before its next op reads the result (here at once, on a non-default stream, over memory
    the allocator hands back full of NaN)."""
    rng = random.Random(fresh_seed())
    gen = torch.Generator(device="cuda").manual_seed(rng.randrange(2**31))
    num_weights, dim, tokens = 200_000, 1024, 4096  # 819 MB of rows, nearly all zero
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    before = fused_count("embedding_dense_backward")
    sums = []
    with torch.cuda.stream(stream):
        for _ in range(3):
            idx = torch.randint(0, num_weights, (tokens,), generator=gen, device="cuda")
            grad = torch.randn(tokens, dim, generator=gen, device="cuda")
            poison_allocator(num_weights * dim * 4)
            g = torch.ops.aten.embedding_dense_backward(grad, idx, num_weights, -1, False)
            sums.append(g.sum(1))  # queued right behind the backward on the same stream
            del g
    stream.synchronize()
    assert fused_count("embedding_dense_backward") - before == 3
    for s in sums:
        assert not s.isnan().any(), "a zero row was read before it was written"


def test_concurrent_calls_from_two_threads_on_two_streams():
    """Two threads, each on its own stream, share the device's second stream: every result
    must still be bitwise the one a lone call gives."""
    rng = random.Random(fresh_seed())
    gen = torch.Generator(device="cuda").manual_seed(rng.randrange(2**31))
    cases = []
    for num_weights, dim, tokens, kind in [(50304, 768, 16384, "uniform"), (32000, 256, 20000, "zipf")]:
        idx = draw_indices(rng, gen, num_weights, (tokens,), kind)
        grad = torch.randn(tokens, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
        cases.append((grad, idx, num_weights))
    expected = [dense_backward(grad, idx, v, -1, True) for grad, idx, v in cases]
    torch.cuda.synchronize()
    results = [[] for _ in cases]
    errors = []

    def work(i):
        try:
            grad, idx, num_weights = cases[i]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(8):
                    results[i].append(torch.ops.aten.embedding_dense_backward(grad, idx, num_weights, -1, False))
            stream.synchronize()
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)

    before = fused_count("embedding_dense_backward")
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert fused_count("embedding_dense_backward") - before == 8 * len(cases)
    for want, got in zip(expected, results):
        for g in got:
            assert torch.equal(g, want)


def test_over_2_31_elements():
    """64-bit offsets: an output and a grad of more than 2^31 elements."""
    tokens, dim = 2**21 + 3, 1030  # 2.16e9 elements, bf16: 4.3 GB each
    weight = torch.randn(70000, dim, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, 70000, (tokens,), device="cuda")
    idx[-5:] = 69999
    out = F.embedding(idx, weight)
    assert torch.equal(out[-1], weight[69999]) and torch.equal(out[12345], weight[idx[12345]])
    del out
    grad = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
    g = dense_backward(grad, idx, 70000, -1, True)
    expect = grad[idx == 69999].float().sum(0)
    torch.testing.assert_close(g[69999].float(), expect, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("case", ["forward_too_big", "forward_negative", "backward_too_big"])
def test_out_of_range_index_is_an_error_not_a_value(case):
    """Stock raises a device-side assert for an index outside the table; so must we (never
    a value read from outside it). Each case in its own process: the assert ends the CUDA
    context."""
    code = f"""
import json, torch
import torch.nn.functional as F
torch.ops.load_library({str(__import__('conftest').MAIN_LIB)!r})
w = torch.randn(100, 64, device="cuda")
idx = torch.randint(0, 100, (4096,), device="cuda")
case = {case!r}
if case == "forward_too_big":
    idx[1234] = 100
    out = F.embedding(idx, w)
elif case == "forward_negative":
    idx[17] = -1
    out = F.embedding(idx, w)
else:
    idx[4000] = 100
    out = torch.ops.aten.embedding_dense_backward(torch.randn(4096, 64, device="cuda"), idx, 100, -1, False)
try:
    torch.cuda.synchronize()
    print("NO ERROR", out.sum().item())
except RuntimeError as e:
    print("ERROR", str(e).splitlines()[0])
print(json.loads(torch.ops.torchfuse.stats())["ops"])
"""
    proc = run_python(code)
    assert "NO ERROR" not in proc.stdout, proc.stdout + proc.stderr
    assert "device-side assert" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert "torchfuse embedding" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
