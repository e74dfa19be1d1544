"""LayerNorm forward through torchfuse vs stock and a float64 reference (DESIGN.md §5)."""
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import requires_cuda
from gpu_util import FLOOR, enabled, fresh_seed, load_torchfuse, poison_allocator, rel_err, stats

pytestmark = requires_cuda

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference(x, shape, w, b, eps):
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    x64 = x.double()
    mean = x64.mean(dim=dims, keepdim=True)
    var = x64.var(dim=dims, unbiased=False, keepdim=True)
    rstd = (var + eps).rsqrt()
    y = (x64 - mean) * rstd
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y, mean, rstd


def run(x, shape, w, b, eps, on):
    with enabled("layer_norm", on):
        poison_allocator(x.numel() * 4 + 4096)
        return torch.ops.aten.native_layer_norm(x, list(shape), w, b, eps)


def kernel_calls():
    s = stats()["ops"].get("native_layer_norm", {})
    return s.get("fused", 0)


def check_case(x, shape, w, b, eps, expect_fused=True):
    before = kernel_calls()
    ours = run(x, shape, w, b, eps, True)
    fused = kernel_calls() - before
    stock = run(x, shape, w, b, eps, False)
    torch.cuda.synchronize()
    assert fused == (1 if expect_fused else 0), stats()
    y_ref, mean_ref, rstd_ref = reference(x, shape, w, b, eps)
    for o, s in zip(ours, stock):
        assert o.shape == s.shape and o.dtype == s.dtype, (o.shape, s.shape, o.dtype, s.dtype)
    floor = FLOOR[x.dtype]
    err_ours, err_stock = rel_err(ours[0], y_ref), rel_err(stock[0], y_ref)
    assert not ours[0].isnan().any(), "unwritten or NaN outputs"
    assert err_ours <= max(2 * err_stock, floor), (err_ours, err_stock)
    for o, s, r in ((ours[1], stock[1], mean_ref), (ours[2], stock[2], rstd_ref)):
        r = r.reshape(o.shape)
        assert rel_err(o, r) <= max(2 * rel_err(s, r), 1e-5), (rel_err(o, r), rel_err(s, r))
    return err_ours, err_stock


@pytest.fixture(scope="module", autouse=True)
def torchfuse_loaded():
    load_torchfuse()


@pytest.fixture
def all_shapes():
    """Kernels serve small shapes too (where the registry would send them to stock)."""
    torch.ops.torchfuse._serve_below_thresholds(True)
    yield
    torch.ops.torchfuse._serve_below_thresholds(False)


def has_variant(dtype, hidden):
    # registry/layer_norm.toml: no 16-bit variant for 1025..2048 (stock is faster), none past 32768.
    if hidden > 32768:
        return False
    return not (dtype != torch.float32 and 1025 <= hidden <= 2048)


HIDDEN = [1, 3, 17, 64, 127, 768, 1000, 1023, 1024, 1025, 2047, 3072, 4096, 5000, 8192, 12288, 16384, 20000, 32768]


def test_random_cases(all_shapes):
    seed = fresh_seed()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for case in range(120):
        dtype = rng.choice(DTYPES)
        hidden = rng.choice(HIDDEN)
        rows = rng.choice([1, 2, 5, 64, 333, 4096]) if hidden <= 8192 else rng.choice([1, 3, 128])
        lead = [rows] if rng.random() < 0.5 else [max(rows // 3, 1), 3]
        x = (torch.randn(*lead, hidden, device="cuda") * rng.choice([1.0, 10.0]) + rng.choice([0.0, 5.0])).to(dtype)
        w = torch.randn(hidden, device="cuda", dtype=dtype) if rng.random() < 0.7 else None
        b = torch.randn(hidden, device="cuda", dtype=dtype) if rng.random() < 0.7 else None
        eps = rng.choice([1e-5, 1e-6, 1e-2])
        try:
            check_case(x, (hidden,), w, b, eps, expect_fused=has_variant(dtype, hidden))
        except AssertionError as e:
            raise AssertionError(f"seed {seed} case {case}: {dtype} {list(x.shape)} w={w is not None} "
                                 f"b={b is not None} eps={eps}: {e}") from e


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_3d_and_multi_dim_shapes(dtype, all_shapes):
    torch.manual_seed(fresh_seed())
    base = torch.randn(8, 1030, 40, device="cuda", dtype=dtype)
    x = base.transpose(1, 2)[:, :, :1000]  # [8, 40, 1000], non-contiguous
    assert not x.is_contiguous()
    w = torch.randn(1000, device="cuda", dtype=dtype)
    check_case(x, (1000,), w, None, 1e-5)
    y = torch.randn(4, 6, 4, 64, device="cuda", dtype=dtype)
    w2 = torch.randn(4, 64, device="cuda", dtype=dtype)
    b2 = torch.randn(4, 64, device="cuda", dtype=dtype)
    check_case(y, (4, 64), w2, b2, 1e-5)
    # Misaligned rows: a storage offset of one element defeats 16-byte vectors.
    z = torch.randn(64 * 768 + 1, device="cuda", dtype=dtype)[1:].view(64, 768)
    check_case(z, (768,), None, None, 1e-5)


def test_nan_and_inf_propagate_like_stock(all_shapes):
    x = torch.randn(4, 256, device="cuda")
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    ours = run(x, (256,), None, None, 1e-5, True)
    stock = run(x, (256,), None, None, 1e-5, False)
    for row in (1, 2):
        assert ours[0][row].isnan().any() == stock[0][row].isnan().any()
    assert torch.equal(ours[0][[0, 3]].isfinite(), stock[0][[0, 3]].isfinite())


@pytest.mark.parametrize("x,shape,why", [
    (lambda: torch.randn(64, 128, device="cuda", dtype=torch.float64), (128,), "unsupported dtype"),
    (lambda: torch.randn(4, 65536, device="cuda"), (65536,), "no variant for this shape"),
    (lambda: torch.randn(0, 128, device="cuda"), (128,), "empty input"),
    (lambda: torch.randn(64, 768, device="cuda"), (768,), "stock is faster at this shape"),
    (lambda: torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16), (2048,), "no variant for this shape"),
])
def test_fallbacks_are_stock_and_logged(x, shape, why):
    x = x()
    before = stats()["ops"].get("native_layer_norm", {}).get("stock_reasons", {}).get(why, 0)
    ours = run(x, shape, None, None, 1e-5, True)
    stock = run(x, shape, None, None, 1e-5, False)
    after = stats()["ops"]["native_layer_norm"]["stock_reasons"].get(why, 0)
    assert after == before + 1, stats()
    assert torch.equal(ours[0].nan_to_num(), stock[0].nan_to_num())


def test_mixed_dtype_matches_stock_either_way():
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.float32)
    outcomes = []
    for on in (True, False):
        try:
            outcomes.append(("ok", run(x, (256,), w, None, 1e-5, on)[0]))
        except RuntimeError as e:
            outcomes.append(("error", str(e).splitlines()[0]))
    assert outcomes[0][0] == outcomes[1][0]
    if outcomes[0][0] == "ok":
        assert torch.equal(outcomes[0][1], outcomes[1][1])
    else:
        assert outcomes[0][1] == outcomes[1][1]


def test_large_shapes_are_served_without_the_hook():
    for dtype, shape in ((torch.float32, (8192, 768)), (torch.bfloat16, (16384, 768)), (torch.float32, (4096, 4096))):
        x = torch.randn(*shape, device="cuda", dtype=dtype)
        check_case(x, shape[1:], torch.randn(shape[1], device="cuda", dtype=dtype), None, 1e-5)


def test_bad_input_gets_stocks_error():
    x = torch.randn(8, 128, device="cuda")
    w = torch.randn(64, device="cuda")
    errors = []
    for on in (True, False):
        with pytest.raises(RuntimeError) as e:
            run(x, (128,), w, None, 1e-5, on)
        errors.append(str(e.value).splitlines()[0])
    assert errors[0] == errors[1]


def test_autograd_module_under_autocast_matches_stock():
    torch.manual_seed(fresh_seed())
    ln = torch.nn.LayerNorm(768).cuda()
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    x = torch.randn(8, 128, 768, device="cuda", requires_grad=True)
    results = []
    for on in (True, False):
        x.grad = None
        ln.zero_grad()
        with enabled("layer_norm", on), torch.autocast("cuda", dtype=torch.bfloat16):
            y = ln(x)
        y.float().square().sum().backward()
        results.append((y.detach().clone(), x.grad.clone(), ln.weight.grad.clone()))
    (y1, gx1, gw1), (y0, gx0, gw0) = results
    assert y1.dtype == torch.float32  # autocast runs layer_norm in fp32
    assert rel_err(y1, y0) < 1e-5
    assert rel_err(gx1, gx0) < 1e-4 and rel_err(gw1, gw0) < 1e-4
