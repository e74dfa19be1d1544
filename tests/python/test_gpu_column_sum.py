"""aten::sum.dim_IntList over a contiguous tensor's leading dims (torchfuse's column sums, the
bias gradient of every biased Linear) against a float64 reference and stock, docs/testing.md
("Correctness"), over fresh random cases; every other form of sum goes to stock unchanged."""
import random

import pytest
import torch

from conftest import requires_cuda
from gpu_util import (FLOOR, enabled, fresh_seed, fused_count, garbage_allocator, rel_err,
                      stock_reasons, torchfuse_below_thresholds)

pytestmark = [requires_cuda, pytest.mark.usefixtures("torchfuse_below_thresholds")]

OP = "sum.dim_IntList"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def stock(fn, *args, **kwargs):
    """fn's result with column_sum switched off: stock's."""
    with enabled("column_sum", False):
        return fn(*args, **kwargs)


def check_against_reference(x, dims, keepdim):
    """torchfuse's sum of x over `dims` is served, has stock's dtype, shape and strides, and is
    within the contract of a float64 sum of the same input."""
    before = fused_count(OP)
    garbage_allocator(x.numel() * 4)
    out = x.sum(dims, keepdim=keepdim)
    assert fused_count(OP) == before + 1, f"{tuple(x.shape)} {dims} not served"
    theirs = stock(x.sum, dims, keepdim=keepdim)
    assert (out.dtype, out.shape, out.stride()) == (theirs.dtype, theirs.shape, theirs.stride())
    ref = x.double().sum(dims, keepdim=keepdim)
    err, stock_err = rel_err(out, ref), rel_err(theirs, ref)
    assert err <= max(2 * stock_err, FLOOR[x.dtype]), (tuple(x.shape), x.dtype, err, stock_err)
    return out


def test_random_leading_dim_sums_are_within_the_contract():
    rng = random.Random(fresh_seed())
    gen = torch.Generator(device="cuda").manual_seed(rng.randrange(2**31))
    for _ in range(60):
        dtype = rng.choice(DTYPES)
        rows = rng.choice([1, 2, 3, 17, 255, 256, 257, 1000, 4097, rng.randrange(1, 20000)])
        # Columns that allow 16-byte accesses and ones that do not, below and past a tile.
        cols = rng.choice([128, 136, 768, 1000, 1001, 2304, 3072, rng.randrange(128, 5000)])
        x = (torch.randn(rows, cols, generator=gen, device="cuda") * rng.choice([1e-3, 1.0, 50.0])
             + rng.choice([0.0, 3.0])).to(dtype)
        if rng.random() < 0.3:  # storage offset of one element: no 16-byte access
            flat = torch.empty(x.numel() + 1, device="cuda", dtype=dtype)
            flat[1:].copy_(x.flatten())
            x = flat[1:].view(rows, cols)
        check_against_reference(x, 0, rng.random() < 0.5)


def test_several_leading_dims_in_any_spelling():
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    x = torch.randn(4, 300, 768, generator=gen, device="cuda").to(torch.bfloat16)
    for dims in [(0, 1), (1, 0), (-3, -2), [0], (0,)]:
        for keepdim in (False, True):
            check_against_reference(x, dims, keepdim)
    y = torch.randn(2, 3, 50, 4, 64, generator=gen, device="cuda")  # 256 columns over two dims
    check_against_reference(y, (0, 1, 2), False)


def test_the_sum_is_deterministic_and_nan_inf_propagate():
    x = torch.randn(5000, 768, device="cuda", dtype=torch.bfloat16)
    before = fused_count(OP)
    first = x.sum(0)
    assert fused_count(OP) == before + 1
    assert all(torch.equal(first, x.sum(0)) for _ in range(5))
    x[17, 3], x[4000, 5], x[10, 9], x[11, 9] = float("nan"), float("inf"), float("inf"), -float("inf")
    out, theirs = x.sum(0), stock(x.sum, 0)
    for c in (3, 5, 9):
        assert out[c].isnan() == theirs[c].isnan() and (out[c].isinf() == theirs[c].isinf()), c
    assert out[5] == theirs[5] == float("inf")


def test_16_byte_and_one_by_one_loads_give_the_same_bits():
    """The kernel's two load paths add the same elements in the same order: an input at a
    one-element storage offset (no 16-byte access) sums bit for bit as its aligned copy."""
    for dtype in DTYPES:
        x = torch.randn(3000, 1024, device="cuda").to(dtype)
        flat = torch.empty(x.numel() + 1, device="cuda", dtype=dtype)
        flat[1:].copy_(x.flatten())
        shifted = flat[1:].view_as(x)
        before = fused_count(OP)
        assert torch.equal(x.sum(0), shifted.sum(0)), dtype
        assert fused_count(OP) == before + 2


def test_other_forms_go_to_stock_unchanged():
    x = torch.randn(64, 32, 256, device="cuda", dtype=torch.bfloat16)
    before = fused_count(OP)
    reasons_before = sum(stock_reasons(OP).values())
    cases = [
        lambda t: t.sum(),                     # a full reduction
        lambda t: t.sum([]),                   # an empty dim list: a full reduction too
        lambda t: t[0, 0].sum(0),              # 1-D: a full reduction to a 0-d tensor
        lambda t: t[0, 0].sum(0, keepdim=True),
        lambda t: t.sum((0, 1, 2)),            # every dim
        lambda t: t.sum(-1),                   # the last dim
        lambda t: t.sum(1),                    # a middle dim
        lambda t: t.sum((0, 2)),               # not leading dims only
        lambda t: t.sum(0, dtype=torch.float32),  # another output dtype
        lambda t: t.transpose(0, 1).sum(0),    # not contiguous
        lambda t: t[:0].sum(0),                # empty
    ]
    for case in cases:
        out, theirs = case(x), stock(case, x)
        assert torch.equal(out, theirs) and out.dtype == theirs.dtype and out.stride() == theirs.stride()
    assert fused_count(OP) == before
    # Each reached torchfuse and went to stock with a reason (the full sum and the empty one may
    # be answered before the override: not counted on).
    assert sum(stock_reasons(OP).values()) >= reasons_before + len(cases) - 2


def test_bad_dims_give_stocks_errors():
    x = torch.randn(8, 256, device="cuda")
    for dims in [(0, 0), 2, -3]:
        with pytest.raises((RuntimeError, IndexError)) as ours:
            x.sum(dims)
        with pytest.raises(type(ours.value)) as stocks:
            stock(x.sum, dims)
        assert str(ours.value) == str(stocks.value)


def test_a_linear_under_autocast_gets_its_bias_gradient_from_the_kernel():
    """The bias gradient of a Linear under bf16 autocast (autograd's sum of the output's gradient
    over its rows) is what torchfuse serves; the other gradients do not move."""
    torch.manual_seed(fresh_seed())
    lin = torch.nn.Linear(768, 2304, device="cuda")
    x = torch.randn(4, 512, 768, device="cuda", requires_grad=True)
    dy = torch.randn(4, 512, 2304, device="cuda")

    def grads():
        lin.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = lin(x)
        y.backward(dy.to(y.dtype))
        return lin.bias.grad.clone(), lin.weight.grad.clone(), x.grad.clone()

    before = fused_count(OP)
    bias, weight, dx = grads()
    assert fused_count(OP) > before
    with enabled("column_sum", False):
        stock_bias, stock_weight, stock_dx = grads()
    assert torch.equal(weight, stock_weight) and torch.equal(dx, stock_dx)
    ref = dy.to(torch.bfloat16).double().sum((0, 1))
    assert rel_err(bias, ref) <= max(2 * rel_err(stock_bias, ref), FLOOR[torch.bfloat16])
    assert bias.dtype == torch.float32


def test_gpt2_style_conv1d_bias_gradient_matches_stock_within_the_contract():
    """HF's Conv1D is torch.addmm(bias, x, weight): its bias gradient is the same column sum."""
    torch.manual_seed(fresh_seed())
    bias = torch.randn(3072, device="cuda", requires_grad=True)
    weight = torch.randn(768, 3072, device="cuda", requires_grad=True)
    x = torch.randn(2048, 768, device="cuda")
    dy = torch.randn(2048, 3072, device="cuda")
    out = {}
    for on in (True, False):
        bias.grad = None
        with enabled("column_sum", on), torch.autocast("cuda", dtype=torch.bfloat16):
            y = torch.addmm(bias, x, weight)
        before = fused_count(OP)
        with enabled("column_sum", on):
            y.backward(dy.to(y.dtype))
        assert fused_count(OP) == before + on
        out[on] = bias.grad.clone()
    ref = dy.to(torch.bfloat16).double().sum(0)
    assert rel_err(out[True], ref) <= max(2 * rel_err(out[False], ref), FLOOR[torch.bfloat16])
