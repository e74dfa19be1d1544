"""aten::add.Tensor of an fp32 tensor and a 16-bit one of the same shape (torchfuse's mixed_add:
an fp32 residual stream plus a layer's bf16 output under autocast) against stock, docs/testing.md
("Correctness"), over fresh random cases: the sum is one fp32 rounding of exact operands, so it
must be stock's bit for bit; every other form of add goes to stock unchanged. The same for
aten::copy_ of a 16-bit tensor into an fp32 one of one layout (autocast's casts back in the
backward): an exact widening, stock's bits; every other copy is stock's."""
import random

import pytest
import torch

from conftest import requires_cuda
from gpu_util import asked_count, enabled, fresh_seed, fused_count, garbage_allocator, stock_reasons, torchfuse_below_thresholds

pytestmark = [requires_cuda, pytest.mark.usefixtures("torchfuse_below_thresholds")]

OP = "add.Tensor"
COPY = "copy_"
HALVES = [torch.bfloat16, torch.float16]


def stock(fn, *args, **kwargs):
    """fn's result with mixed_add switched off: stock's."""
    with enabled("mixed_add", False):
        return fn(*args, **kwargs)


def bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def assert_stocks(out, theirs):
    assert (out.dtype, out.shape, out.stride()) == (theirs.dtype, theirs.shape, theirs.stride())
    assert torch.equal(bits(out), bits(theirs))


def unaligned(x):
    """x's values at a one-element storage offset: no 16-byte access."""
    flat = torch.empty(x.numel() + 1, device="cuda", dtype=x.dtype)
    flat[1:].copy_(x.flatten())
    return flat[1:].view_as(x)


def test_random_mixed_adds_are_stocks_bits_either_way_round():
    rng = random.Random(fresh_seed())
    gen = torch.Generator(device="cuda").manual_seed(rng.randrange(2**31))
    for _ in range(60):
        half = rng.choice(HALVES)
        shape = rng.choice([(1,), (7,), (8,), (4097,), (3, 5, 7), (2, 1024, 768), (4, 300, 896),
                            (rng.randrange(1, 3000), rng.randrange(1, 3000))])
        scale = rng.choice([1e-3, 1.0, 300.0])
        a = torch.randn(shape, generator=gen, device="cuda") * scale
        b = (torch.randn(shape, generator=gen, device="cuda") * scale).to(half)
        if rng.random() < 0.3:
            a = unaligned(a)
        if rng.random() < 0.3:
            b = unaligned(b)
        garbage_allocator(a.numel() * 4)
        before = fused_count(OP)
        out = a + b if rng.random() < 0.5 else b + a
        assert fused_count(OP) == before + 1, (shape, half)
        assert_stocks(out, stock(torch.add, a, b))


def test_subnormals_size_one_dims_and_0_dim_pairs_give_stocks_bits():
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    a = torch.randn(300, 257, generator=gen, device="cuda") * 1e-39  # subnormal fp32 and bf16
    b = (torch.randn(300, 257, generator=gen, device="cuda") * 1e-39).to(torch.bfloat16)
    # A size-one dim of any stride (contiguous still), and two 0-dim CUDA tensors (fp32 out).
    odd = (a.as_strided((300, 1, 257), (257, 7, 1)), b.as_strided((300, 1, 257), (257, 3, 1)))
    zero_dim = (a[0, 0].clone(), b[0, 0].clone())
    for x, y in ((a, b), odd, zero_dim):
        before = fused_count(OP)
        out = x + y
        assert fused_count(OP) == before + 1, x.shape
        assert_stocks(out, stock(torch.add, x, y))


def test_nan_inf_and_the_16_byte_and_one_by_one_paths_give_stocks_bits():
    a = torch.randn(5000, 768, device="cuda")
    b = torch.randn(5000, 768, device="cuda").to(torch.bfloat16)
    a[17, 3], b[17, 4], a[40, 5], b[40, 5], a[41, 6], b[41, 6] = (
        float("nan"), float("nan"), float("inf"), -float("inf"), float("inf"), float("inf"))
    before = fused_count(OP)
    out = a + b
    assert_stocks(out, stock(torch.add, a, b))
    assert torch.equal(bits(unaligned(a) + b), bits(out))
    assert fused_count(OP) == before + 2


def reasons_given():
    """Calls of add.Tensor torchfuse sent to stock for a reason of their own (not the toggle's
    being off, as for stock's side of a comparison)."""
    return sum(n for reason, n in stock_reasons(OP).items() if reason != "disabled at run time")


def test_other_forms_go_to_stock_unchanged():
    a = torch.randn(64, 256, device="cuda")
    b = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    before = fused_count(OP)
    reasons_before = reasons_given()
    cases = [
        lambda: a + b[0],                                   # broadcasting
        lambda: torch.add(a, b, alpha=2),                   # alpha: stock's multiply-add
        lambda: torch.add(a, b, alpha=0.5),
        lambda: a.t() + b.t(),                              # not contiguous
        lambda: b + b.half(),                               # bf16 + fp16 (fp32 out)
        lambda: a.double() + b,                             # fp64
        lambda: a[:0] + b[:0],                              # empty
        lambda: torch.tensor(2.0, device="cuda") + b,       # a 0-dim fp32 tensor: bf16 out
    ]
    for case in cases:
        out, theirs = case(), stock(case)
        assert (out.dtype, out.shape, out.stride()) == (theirs.dtype, theirs.shape, theirs.stride())
        assert torch.equal(out, theirs)
    assert fused_count(OP) == before
    assert reasons_given() == reasons_before + len(cases)
    # Adds of one dtype, or with a CPU scalar, do not reach torchfuse at all.
    asked = asked_count(OP)
    for case in (lambda: a + a, lambda: b + b, lambda: b + 1, lambda: b + torch.tensor(2.0)):
        out, theirs = case(), stock(case)
        assert out.dtype == theirs.dtype and torch.equal(out, theirs)
    assert asked_count(OP) == asked


def test_bad_shapes_give_stocks_error():
    a = torch.randn(8, 64, device="cuda")
    b = torch.randn(8, 63, device="cuda").to(torch.bfloat16)
    with pytest.raises(RuntimeError) as ours:
        a + b
    with pytest.raises(RuntimeError) as stocks:
        stock(torch.add, a, b)
    assert str(ours.value) == str(stocks.value)


def test_a_residual_block_under_autocast_trains_as_stocks():
    """`residual + layer(x)` of an fp32 stream under bf16 autocast: the add is served, and the
    output and every gradient are stock's bit for bit."""
    torch.manual_seed(fresh_seed())
    lin = torch.nn.Linear(512, 512, device="cuda")
    x = torch.randn(4, 256, 512, device="cuda", requires_grad=True)
    dy = torch.randn(4, 256, 512, device="cuda")

    def step():
        lin.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = x + lin(x)
        y.backward(dy)
        return y.detach(), x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()

    before = fused_count(OP)
    ours = step()
    assert fused_count(OP) > before
    with enabled("mixed_add", False):
        theirs = step()
    for o, t in zip(ours, theirs):
        assert_stocks(o, t)


def dense_layout(rng, shape, gen):
    """A 16-bit-sized random tensor's fp32 values in a dense layout: contiguous, or a permutation
    of it (a weight gradient's transpose, a [B, H, S, D] view of [B, S, H, D] memory)."""
    x = torch.randn(shape, generator=gen, device="cuda") * rng.choice([1e-3, 1.0, 300.0])
    if x.dim() >= 2 and rng.random() < 0.5:
        order = list(range(x.dim()))
        rng.shuffle(order)
        x = x.permute(order).contiguous().permute([order.index(i) for i in range(x.dim())])
    return x


def test_random_widening_copies_are_stocks_bits():
    """copy_ of bf16/fp16 into fp32 of the same dense layout (contiguous or permuted, aligned or
    not), directly and through `.float()`/`.to()` (autocast's casts back): served, stock's bits
    and layout."""
    rng = random.Random(fresh_seed())
    gen = torch.Generator(device="cuda").manual_seed(rng.randrange(2**31))
    for _ in range(60):
        half = rng.choice(HALVES)
        shape = rng.choice([(1,), (7,), (8,), (4097,), (3, 5, 7), (768, 2304), (2, 4, 300, 64),
                            (rng.randrange(1, 3000), rng.randrange(1, 3000))])
        src = dense_layout(rng, shape, gen).to(half)  # .to keeps the dense layout
        if src.is_contiguous() and rng.random() < 0.3:
            src = unaligned(src)
        garbage_allocator(src.numel() * 4)
        before = fused_count(COPY)
        if rng.random() < 0.5:
            out = torch.empty_like(src, dtype=torch.float32)
            out.copy_(src)
        else:
            out = src.float() if rng.random() < 0.5 else src.to(torch.float32)
        assert fused_count(COPY) == before + 1, (shape, half, src.stride())
        assert_stocks(out, stock(lambda: src.to(torch.float32)))


def test_widening_keeps_nan_payloads_infinities_subnormals_and_signed_zeros():
    for half in HALVES:
        bits16 = torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda").to(torch.int16)
        src = bits16.view(half)  # every 16-bit pattern: NaNs with payloads, infs, subnormals, -0.0
        before = fused_count(COPY)
        out = src.float()
        assert fused_count(COPY) == before + 1
        assert_stocks(out, stock(lambda: src.float()))


def test_other_copies_go_to_stock_unchanged():
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    src = torch.randn(64, 256, generator=gen, device="cuda").to(torch.bfloat16)
    src32 = torch.randn(64, 256, generator=gen, device="cuda")
    before, asked = fused_count(COPY), asked_count(COPY)
    storage = torch.empty(64 * 256, device="cuda")
    cases = [
        lambda: torch.empty(64, 256, device="cuda").copy_(src.t().contiguous().t()),  # other strides
        lambda: torch.empty(64, 512, device="cuda")[:, ::2].copy_(src),               # not dense
        lambda: torch.empty(64, 256, device="cuda").copy_(src[0].expand(64, 256)),    # broadcast
        lambda: torch.empty(64, 256, device="cuda").copy_(src32),                     # one dtype
        lambda: torch.empty(64, 256, device="cuda", dtype=torch.bfloat16).copy_(src32),  # narrowing
        lambda: torch.empty(64, 256, device="cuda").copy_(src.cpu()),                 # host to device
        lambda: torch.empty(64, 256).copy_(src),                                      # device to host
        lambda: torch.empty(64, 256, device="cuda", dtype=torch.float64).copy_(src),  # fp64
        lambda: torch.empty(64, 256, device="cuda").copy_(torch._neg_view(src)),      # a negated view
    ]
    for case in cases:
        out = case()
        theirs = stock(case)
        assert (out.dtype, out.shape, out.stride(), out.device) == (theirs.dtype, theirs.shape, theirs.stride(), theirs.device)
        assert torch.equal(out, theirs)
    assert fused_count(COPY) == before
    assert asked_count(COPY) == asked  # the glue keeps these without a call into Rust
    # Memory shared with the source: stock's error (or result) either way.
    outcomes = []
    for on in (True, False):
        with enabled("mixed_add", on):
            half_view = storage.view(torch.bfloat16)[: 64 * 256].view(64, 256)
            target = storage.view(64, 256)
            try:
                target.copy_(half_view)
                outcomes.append(("ok", target.clone()))
            except RuntimeError as error:
                outcomes.append(("error", str(error)))
    assert outcomes[0][0] == outcomes[1][0]
    if outcomes[0][0] == "error":
        assert outcomes[0][1] == outcomes[1][1]
    assert fused_count(COPY) == before


def test_a_linears_weight_gradient_cast_back_is_served():
    """Under bf16 autocast a Linear's fp32 weight gets its bf16 gradient cast back
    (ToCopyBackward0: copy_ into fp32, through the linear node or stock's nodes alike): served,
    stock's bits."""
    torch.manual_seed(fresh_seed())
    lin = torch.nn.Linear(768, 2304, device="cuda")
    x = torch.randn(8, 128, 768, device="cuda")
    dy = torch.randn(8, 128, 2304, device="cuda")

    def grads():
        lin.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = lin(x)
        y.backward(dy)
        return lin.weight.grad.clone(), lin.bias.grad.clone()

    before = fused_count(COPY)
    ours = grads()
    assert fused_count(COPY) >= before + 2  # the weight's and the bias's gradients
    theirs = stock(grads)
    for o, t in zip(ours, theirs):
        assert_stocks(o, t)


def test_widening_into_odd_destinations_is_stocks():
    """0-dim and empty tensors, an unaligned destination of an aligned source and a permuted
    unaligned pair: stock's bits (served where there is an element to copy); the destination's
    version counter moves as stock's; a copy-on-write destination gets its own memory first, so
    the tensor it was cloned from keeps its values."""
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    src = torch.randn(300, 257, generator=gen, device="cuda").to(torch.bfloat16)
    cases = {
        "0-dim": (torch.empty((), device="cuda"), src[0, 0].clone(), True),
        "empty": (torch.empty(0, 257, device="cuda"), src[:0], False),
        "unaligned destination": (torch.empty(300 * 257 + 1, device="cuda")[1:].view(300, 257), src, True),
        "permuted, unaligned": (torch.empty(300 * 257 + 3, device="cuda")[3:].view(257, 300).t(),
                                torch.empty(300 * 257 + 5, device="cuda", dtype=torch.bfloat16)[5:].view(257, 300).t(), True),
    }
    cases["permuted, unaligned"][1].copy_(src)
    for name, (out, source, served) in cases.items():
        version, before = out._version, fused_count(COPY)
        out.copy_(source)
        assert out._version == version + 1, name
        assert fused_count(COPY) == before + int(served), name
        theirs = torch.empty_like(out)
        stock(theirs.copy_, source)
        assert torch.equal(bits(out), bits(theirs)), name
    original = torch.zeros(1024, device="cuda")
    clone = torch._lazy_clone(original)
    assert torch._C._is_cow_tensor(clone)
    before = fused_count(COPY)
    clone.copy_(torch.ones(1024, device="cuda", dtype=torch.bfloat16))
    assert fused_count(COPY) == before + 1
    assert not torch._C._is_cow_tensor(clone)
    assert torch.equal(original, torch.zeros(1024, device="cuda"))
    assert torch.equal(clone, torch.ones(1024, device="cuda"))
