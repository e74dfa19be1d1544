"""LayerNorm and RMSNorm, forward and backward, through torchfuse vs stock and a float64
reference (docs/testing.md ("Correctness")): ours must be within max(2 x stock's error, floor)."""
import random
import tomllib

import pytest
import torch

from conftest import ROOT, requires_cuda
from gpu_util import (FLOOR, enabled, fresh_seed, fused_count, load_torchfuse, poison_allocator,
                      rel_err, stats, stock_reasons)

pytestmark = requires_cuda

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOGGLE = {"layer": "layer_norm", "rms": "rms_norm"}
ATEN_FWD = {"layer": "native_layer_norm", "rms": "_fused_rms_norm"}
ATEN_BWD = {"layer": "native_layer_norm_backward", "rms": "_fused_rms_norm_backward"}
REGISTRY = tomllib.loads((ROOT / "registry" / "norm.toml").read_text())["variant"]
DTYPE_NAME = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def has_variant(kind, direction, dtype, hidden, narrowed=False):
    """Whether the registry has a variant for these rows; `narrowed`: for norm_cast's call, which
    the narrowed_only variants serve too."""
    op = f"{'layer_norm' if kind == 'layer' else 'rms_norm'}_{direction}"
    major, minor = torch.cuda.get_device_capability()
    sm = 10 * major + minor
    return any(v["op"] == op and DTYPE_NAME[dtype] in v["dtypes"] and v["hidden"][0] <= hidden <= v["hidden"][1]
               and v["sm"][0] <= sm <= v["sm"][1] and (narrowed or not v.get("narrowed_only"))
               for v in REGISTRY)


@pytest.fixture(scope="module", autouse=True)
def torchfuse_loaded():
    load_torchfuse()


@pytest.fixture
def all_shapes():
    """Kernels serve small shapes too (where the registry would send them to stock)."""
    torch.ops.torchfuse._serve_below_thresholds(True)
    yield
    torch.ops.torchfuse._serve_below_thresholds(False)


# ---------------------------------------------------------------- references (float64)

def ref_forward(kind, x, shape, w, b, eps):
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    x64 = x.double()
    if kind == "layer":
        mean = x64.mean(dim=dims, keepdim=True)
        rstd = (x64.var(dim=dims, unbiased=False, keepdim=True) + eps).rsqrt()
        y = (x64 - mean) * rstd
    else:
        mean = None
        rstd = (x64.square().mean(dim=dims, keepdim=True) + eps).rsqrt()
        y = x64 * rstd
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y, mean, rstd


def ref_backward(kind, dy, x, shape, w, b, eps):
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_() if w is not None else None
    b64 = b.double().requires_grad_() if b is not None else None
    y, _, _ = ref_forward(kind, x64, shape, w64, b64, eps)
    inputs = [t for t in (x64, w64, b64) if t is not None]
    grads = torch.autograd.grad(y, inputs, dy.double())
    it = iter(grads)
    return next(it), (next(it) if w is not None else None), (next(it) if b is not None else None)


# ---------------------------------------------------------------- calls through the dispatcher

def call_fwd(kind, x, shape, w, b, eps, on):
    with enabled(TOGGLE[kind], on):
        poison_allocator(x.numel() * 4 + 4096)
        if kind == "layer":
            return torch.ops.aten.native_layer_norm(x, list(shape), w, b, eps)
        y, rstd = torch.ops.aten._fused_rms_norm(x, list(shape), w, eps)
        return y, None, rstd


def call_bwd(kind, dy, x, shape, mean, rstd, w, b, mask, on):
    with enabled(TOGGLE[kind], on):
        poison_allocator(x.numel() * 4 + 4096)
        if kind == "layer":
            return torch.ops.aten.native_layer_norm_backward(dy, x, list(shape), mean, rstd, w, b, mask)
        dx, dw = torch.ops.aten._fused_rms_norm_backward(dy, x, list(shape), rstd, w, mask[:2])
        return dx, dw, None


def assert_close(ours, stock, ref, floor, what, terms=None):
    """docs/testing.md ("Correctness"): ‖ours − ref‖ / ‖ref‖ ≤ max(2 × stock's, floor).

    `terms`: for a result that is a difference of larger terms (dx), their magnitude. Where
    they nearly cancel (RMSNorm of one element: dx ∝ eps / x², from terms of size 1), any
    fp32 evaluation is off by a few units of fp32 rounding of the terms, and stock's own
    relative error has reached 20-150% in such rows; there the bound is the standard one for
    a computed difference, 16 u ‖terms‖ (plus the output's rounding), instead."""
    assert ours.shape == stock.shape and ours.dtype == stock.dtype, (what, ours.shape, stock.shape, ours.dtype, stock.dtype)
    assert not ours.isnan().any(), f"{what}: unwritten or NaN outputs"
    ref = ref.reshape(ours.shape)
    e_ours, e_stock = rel_err(ours, ref), rel_err(stock, ref)
    if e_ours <= max(2 * e_stock, floor):
        return
    if terms is not None:
        diff = (ours.double() - ref).norm().item()
        bound = 16 * 2.0**-24 * terms.norm().item() + floor * ref.norm().item()
        if diff <= bound:
            return
    assert e_ours <= max(2 * e_stock, floor), f"{what}: ours {e_ours:.3g} stock {e_stock:.3g}"


def dx_terms(kind, dy, x, shape, mean, rstd, w):
    """Magnitude of the terms dx is the difference of: rstd·(|g| + |mean g| + |xhat·mean(g·xhat)|),
    g = dy·w, xhat from the op's own mean/rstd inputs (float64)."""
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    x64, g = x.double(), dy.double() * (w.double() if w is not None else 1.0)
    rstd64 = rstd.double().reshape([*x.shape[:x.dim() - len(shape)]] + [1] * len(shape))
    mean64 = 0.0 if mean is None else mean.double().reshape(rstd64.shape)
    xhat = (x64 - mean64) * rstd64
    mean_g = g.mean(dim=dims, keepdim=True) if kind == "layer" else 0.0
    mean_gx = (g * xhat).mean(dim=dims, keepdim=True)
    return rstd64.abs() * (g.abs() + abs(mean_g) + (xhat * mean_gx).abs())


def check_forward(kind, x, shape, w, b, eps, expect_fused=None):
    if expect_fused is None:
        expect_fused = has_variant(kind, "fwd", x.dtype, x.shape[-len(shape):].numel())
    before = fused_count(ATEN_FWD[kind])
    ours = call_fwd(kind, x, shape, w, b, eps, True)
    fused = fused_count(ATEN_FWD[kind]) - before
    stock = call_fwd(kind, x, shape, w, b, eps, False)
    assert fused == (1 if expect_fused else 0), stats()["ops"].get(ATEN_FWD[kind])
    y_ref, mean_ref, rstd_ref = ref_forward(kind, x, shape, w, b, eps)
    assert_close(ours[0], stock[0], y_ref, FLOOR[x.dtype], "y")
    for name, o, s, r in (("mean", ours[1], stock[1], mean_ref), ("rstd", ours[2], stock[2], rstd_ref)):
        if r is None:
            assert o is None and s is None
            continue
        assert o.shape == s.shape and o.dtype == s.dtype == torch.float32, (name, o.shape, s.shape)
        assert rel_err(o, r.reshape(o.shape)) <= max(2 * rel_err(s, r.reshape(o.shape)), 1e-5), name
    return ours


def check_backward(kind, x, shape, w, b, eps, mask=(True, True, True), expect_fused=None):
    if expect_fused is None:
        expect_fused = has_variant(kind, "bwd", x.dtype, x.shape[-len(shape):].numel())
    mask = list(mask)
    dy = torch.randn_like(x)
    _, mean, rstd = call_fwd(kind, x, shape, w, b, eps, False)
    before = fused_count(ATEN_BWD[kind])
    ours = call_bwd(kind, dy, x, shape, mean, rstd, w, b, mask, True)
    fused = fused_count(ATEN_BWD[kind]) - before
    stock = call_bwd(kind, dy, x, shape, mean, rstd, w, b, mask, False)
    assert fused == (1 if expect_fused else 0), stats()["ops"].get(ATEN_BWD[kind])
    refs = ref_backward(kind, dy, x, shape, w, b, eps)
    for name, o, s, r in zip(("dx", "dweight", "dbias"), ours, stock, refs):
        if s is None:
            assert o is None, f"{name}: stock gives no tensor, ours does"
            continue
        assert o is not None, f"{name} missing"
        terms = dx_terms(kind, dy, x, shape, mean, rstd, w) if name == "dx" else None
        assert_close(o, s, r, FLOOR[x.dtype], name, terms)
    if expect_fused:  # bitwise reproducible run to run (fresh allocations, poisoned memory)
        again = call_bwd(kind, dy, x, shape, mean, rstd, w, b, mask, True)
        for name, o, a in zip(("dx", "dweight", "dbias"), ours, again):
            if o is not None:
                assert torch.equal(o, a), f"{name} differs between two runs"
    return ours


# ---------------------------------------------------------------- tests

HIDDEN = [1, 3, 17, 64, 127, 768, 1000, 1023, 1024, 1025, 2047, 2048, 3072, 4096, 5000, 8192, 12288, 16384,
          20000, 32768, 40000, 65536]


def random_case(rng, kind, direction):
    dtype = rng.choice(DTYPES)
    hidden = rng.choice(HIDDEN)
    rows = rng.choice([1, 2, 5, 64, 333, 4096]) if hidden <= 8192 else rng.choice([1, 3, 100])
    lead = [rows] if rng.random() < 0.5 else [max(rows // 3, 1), 3]
    x = (torch.randn(*lead, hidden, device="cuda") * rng.choice([1.0, 10.0]) + rng.choice([0.0, 5.0])).to(dtype)
    w = torch.randn(hidden, device="cuda", dtype=dtype) if rng.random() < 0.75 else None
    b = torch.randn(hidden, device="cuda", dtype=dtype) if kind == "layer" and rng.random() < 0.75 else None
    eps = rng.choice([1e-5, 1e-6, 1e-2])
    return dtype, hidden, x, w, b, eps


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_random_cases(kind, direction, all_shapes):
    seed = fresh_seed()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for case in range(60):
        dtype, hidden, x, w, b, eps = random_case(rng, kind, direction)
        expect = has_variant(kind, direction, dtype, hidden)
        try:
            if direction == "fwd":
                check_forward(kind, x, (hidden,), w, b, eps, expect_fused=expect)
            else:
                mask = [True, w is not None, b is not None]
                check_backward(kind, x, (hidden,), w, b, eps, mask, expect_fused=expect)
        except AssertionError as e:
            raise AssertionError(f"seed {seed} case {case}: {kind} {direction} {dtype} {list(x.shape)} "
                                 f"w={w is not None} b={b is not None} eps={eps}: {e}") from e


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("hidden", [1, 2, 3, 4])
def test_short_rows_backward_within_contract(kind, hidden, all_shapes):
    """Rows of a few fp32 columns, where dx nearly cancels (two columns: dx is eps / (var + eps)
    of its terms; PyTorch's OpInfo samples found ours 3x stock's error there): the plain
    contract, max(2 x stock's error, floor), with no allowance for cancellation."""
    seed = fresh_seed()
    torch.manual_seed(seed)
    for scale, shift, eps in ((1.0, 0.0, 1e-5), (10.0, 5.0, 1e-5), (3.0, 0.0, 1e-2)):
        x = torch.randn(4096, hidden, device="cuda") * scale + shift
        w = torch.randn(hidden, device="cuda")
        b = torch.randn(hidden, device="cuda") if kind == "layer" else None
        dy = torch.randn_like(x)
        _, mean, rstd = call_fwd(kind, x, (hidden,), w, b, eps, False)
        mask = [True, True, b is not None]
        ours = call_bwd(kind, dy, x, (hidden,), mean, rstd, w, b, mask, True)
        stock = call_bwd(kind, dy, x, (hidden,), mean, rstd, w, b, mask, False)
        refs = ref_backward(kind, dy, x, (hidden,), w, b, eps)
        for name, o, s, r in zip(("dx", "dweight", "dbias"), ours, stock, refs):
            if s is not None:
                assert_close(o, s, r, FLOOR[torch.float32], f"seed {seed} x*{scale}+{shift} eps {eps}: {name}")


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_layouts_non_contiguous_multi_dim_misaligned(kind, dtype, all_shapes):
    torch.manual_seed(fresh_seed())
    base = torch.randn(8, 1030, 40, device="cuda", dtype=dtype)
    x = base.transpose(1, 2)[:, :, :1000]  # [8, 40, 1000], non-contiguous
    assert not x.is_contiguous()
    w = torch.randn(1000, device="cuda", dtype=dtype)
    check_forward(kind, x, (1000,), w, None, 1e-5)
    check_backward(kind, x, (1000,), w, None, 1e-5, (True, True, False))
    y = torch.randn(4, 6, 4, 64, device="cuda", dtype=dtype)
    w2 = torch.randn(4, 64, device="cuda", dtype=dtype)
    b2 = torch.randn(4, 64, device="cuda", dtype=dtype) if kind == "layer" else None
    check_forward(kind, y, (4, 64), w2, b2, 1e-5)
    check_backward(kind, y, (4, 64), w2, b2, 1e-5, (True, True, b2 is not None))
    # A storage offset of one element defeats 16-byte vectors.
    z = torch.randn(64 * 768 + 1, device="cuda", dtype=dtype)[1:].view(64, 768)
    check_forward(kind, z, (768,), None, None, 1e-5)
    check_backward(kind, z, (768,), None, None, 1e-5, (True, False, False))


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_every_output_mask(kind, all_shapes):
    torch.manual_seed(fresh_seed())
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16) if kind == "layer" else None
    masks = [(a, c, d) for a in (True, False) for c in (True, False) for d in ((True, False) if kind == "layer" else (False,))]
    for mask in masks:
        if not any(mask):
            continue
        check_backward(kind, x, (1024,), w, b, 1e-5, mask)
    # Nothing asked for: stock answers (with nothing), the same as ours would.
    dy = torch.randn_like(x)
    _, mean, rstd = call_fwd(kind, x, (1024,), w, b, 1e-5, False)
    out = call_bwd(kind, dy, x, (1024,), mean, rstd, w, b, [False, False, False], True)
    assert all(t is None for t in out)


def test_rms_default_eps_is_float32_epsilon(all_shapes):
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16) * 1e-4
    w = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    ours = torch.ops.aten._fused_rms_norm(x, [512], w, None)
    with enabled("rms_norm", False):
        stock = torch.ops.aten._fused_rms_norm(x, [512], w, None)
    y_ref, _, rstd_ref = ref_forward("rms", x, (512,), w, None, torch.finfo(torch.float32).eps)
    assert rel_err(ours[1], rstd_ref.reshape(ours[1].shape)) <= max(2 * rel_err(stock[1], rstd_ref.reshape(ours[1].shape)), 1e-5)
    assert rel_err(ours[0], y_ref) <= max(2 * rel_err(stock[0], y_ref), FLOOR[torch.bfloat16])


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_nan_and_inf_propagate_like_stock(kind, all_shapes):
    x = torch.randn(4, 256, device="cuda")
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    ours = call_fwd(kind, x, (256,), None, None, 1e-5, True)
    stock = call_fwd(kind, x, (256,), None, None, 1e-5, False)
    assert torch.equal(ours[0].isnan(), stock[0].isnan())
    assert torch.equal(ours[0].isfinite(), stock[0].isfinite())


def below_threshold_case(kind):
    """A shape just under some variant's measured min_rows (stock is faster there), if any (the
    narrowed_only variants serve norm_cast's calls, not these)."""
    op = f"{'layer_norm' if kind == 'layer' else 'rms_norm'}_fwd"
    for v in REGISTRY:
        if (v["op"] == op and v.get("min_rows", 1) > 1 and "f32" in v["dtypes"]
                and not v.get("narrowed_only")):
            return torch.randn(v["min_rows"] - 1, v["hidden"][1], device="cuda"), (v["hidden"][1],)
    return None


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_fallbacks_are_stock_and_logged(kind):
    cases = [
        (torch.randn(64, 128, device="cuda", dtype=torch.float64), (128,), "unsupported dtype"),
        (torch.randn(0, 128, device="cuda"), (128,), "empty input"),
        (torch.randn(4, 65536 + 8, device="cuda"), (65536 + 8,), "no variant for this shape"),
    ]
    below = below_threshold_case(kind)
    if below is not None:
        cases.append(below + ("stock is faster at this shape",))
    for x, shape, why in cases:
        before = stock_reasons(ATEN_FWD[kind]).get(why, 0)
        ours = call_fwd(kind, x, shape, None, None, 1e-5, True)
        stock = call_fwd(kind, x, shape, None, None, 1e-5, False)
        after = stats()["ops"][ATEN_FWD[kind]]["stock_reasons"].get(why, 0)
        assert after == before + 1, (why, stats()["ops"][ATEN_FWD[kind]])
        assert torch.equal(ours[0].nan_to_num(), stock[0].nan_to_num())


def stock_error(fn):
    try:
        fn()
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_bad_input_gets_stocks_error(kind, all_shapes):
    x = torch.randn(8, 128, device="cuda")
    bad = [
        lambda: call_fwd(kind, x, (128,), torch.randn(64, device="cuda"), None, 1e-5, on),  # weight shape
        lambda: call_fwd(kind, x, (64,), None, None, 1e-5, on),  # normalized_shape
        lambda: call_fwd(kind, x.bfloat16(), (128,), torch.randn(128, device="cuda"), None, 1e-5, on),  # mixed
        lambda: call_fwd(kind, x, (), None, None, 1e-5, on),  # empty normalized_shape
    ]
    _, mean, rstd = call_fwd(kind, x, (128,), None, None, 1e-5, False)
    dy = torch.randn_like(x)
    # A weight gradient asked for with no weight.
    bad.append(lambda: call_bwd(kind, dy, x, (128,), mean, rstd, None, None, [True, True, False], on))
    for fn in bad:
        errors = []
        for on in (True, False):
            errors.append(stock_error(fn))
        assert errors[0] is not None and errors[0] == errors[1], errors


def test_more_than_2_31_elements():
    """64-bit indexing: rows x hidden past 2^31 elements (bf16: 4.3 GB per tensor)."""
    if torch.cuda.get_device_properties(0).total_memory < 40 << 30:
        pytest.skip("needs 40 GB of GPU memory")
    torch.manual_seed(fresh_seed())
    rows, hidden = (1 << 31) // 4096 + 8, 4096
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    for kind in ("layer", "rms"):
        before = fused_count(ATEN_FWD[kind])
        ours = call_fwd(kind, x, (hidden,), w, None, 1e-5, True)
        assert fused_count(ATEN_FWD[kind]) == before + 1
        stock = call_fwd(kind, x, (hidden,), w, None, 1e-5, False)
        # Rows at the start, across the 2^31 boundary and at the end.
        for r in (slice(0, 64), slice(rows - 16, rows)):
            assert (ours[0][r].float() - stock[0][r].float()).abs().max() < 0.1
        assert torch.equal(ours[0][-1].isfinite(), torch.ones(hidden, dtype=torch.bool, device="cuda"))
        del ours, stock
        dy = torch.randn_like(x)
        _, mean, rstd = call_fwd(kind, x, (hidden,), w, None, 1e-5, False)
        before = fused_count(ATEN_BWD[kind])
        ours = call_bwd(kind, dy, x, (hidden,), mean, rstd, w, None, [True, True, False], True)
        assert fused_count(ATEN_BWD[kind]) == before + 1
        stock = call_bwd(kind, dy, x, (hidden,), mean, rstd, w, None, [True, True, False], False)
        for r in (slice(0, 64), slice(rows - 16, rows)):
            assert (ours[0][r].float() - stock[0][r].float()).abs().max() < 0.1
        assert rel_err(ours[1], stock[1]) < 1e-2
        del ours, stock, dy, mean, rstd


def module_grads(module, x, on, toggle, autocast):
    module.zero_grad()
    x.grad = None
    with enabled(toggle, on), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y = module(x)
    y.float().square().sum().backward()
    return [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("case", ["ln_autocast", "ln_bf16", "rms_bf16", "rms_f32"])
def test_autograd_modules_match_stock(case):
    torch.manual_seed(fresh_seed())
    dtype = torch.bfloat16 if case.endswith("bf16") else torch.float32
    if case.startswith("ln"):
        module, toggle, aten = torch.nn.LayerNorm(1024), "layer_norm", ("native_layer_norm", "native_layer_norm_backward")
    else:
        module, toggle, aten = torch.nn.RMSNorm(1024), "rms_norm", ("_fused_rms_norm", "_fused_rms_norm_backward")
    module = module.cuda().to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    x = torch.randn(16, 1024, 1024, device="cuda", dtype=dtype, requires_grad=True)
    kind = "layer" if case.startswith("ln") else "rms"
    expect = [int(has_variant(kind, d, x.dtype if case != "ln_autocast" else torch.float32, 1024)) for d in ("fwd", "bwd")]
    before = [fused_count(a) for a in aten]
    ours = module_grads(module, x, True, toggle, case == "ln_autocast")
    assert [fused_count(a) for a in aten] == [b + e for b, e in zip(before, expect)], "kernels serve what the registry has"
    assert sum(expect) >= 1
    stock = module_grads(module, x, False, toggle, case == "ln_autocast")
    floor = FLOOR[torch.float32 if case == "ln_autocast" else dtype]
    for i, (o, s) in enumerate(zip(ours, stock)):
        assert o.dtype == s.dtype and o.shape == s.shape
        assert rel_err(o, s) <= 2 * floor, (case, i, rel_err(o, s))


# ---------------------------------------------------------------- torchfuse::norm_cast

NORM_CAST_SHAPES = [(4096, 768), (2, 512, 1024), (37, 2048), (300, 2050), (64, 4096)]


def norm_then_cast(kind, x, w, b, eps):
    """What norm_cast replaces: the norm as torchfuse serves it (aten's layer_norm; HF's RMSNorm
    through torchfuse::hf_rms_norm), then autocast's cast to bf16."""
    if kind == "layer":
        y = torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps)
    else:
        y = torch.ops.torchfuse.hf_rms_norm(x, w, eps)
    return y.to(torch.bfloat16)


def norm_cast_grads(kind, x, w, b, eps, dy, cast):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    x_, w_, b_ = leaves
    y = (torch.ops.torchfuse.norm_cast(x_, w_, b_, eps, kind == "rms", torch.bfloat16) if cast
         else norm_then_cast(kind, x_, w_, b_, eps))
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("kind,affine", [("layer", "both"), ("layer", "weight"), ("layer", "none"), ("rms", "weight")])
def test_norm_cast_is_the_norm_then_the_cast_bit_for_bit(kind, affine, all_shapes):
    """torchfuse::norm_cast (the norm and autocast's cast in one op, dy read in bf16) gives the
    bits of the norm torchfuse serves followed by the cast: the bf16 output, and the input's,
    weight's and bias's gradients from the same bf16 gradient (rows whose width is a multiple of
    the vector or not, 1-D to 3-D); the fused kernels serve it where the norm's own do. Where
    only a narrowed_only variant serves (the plain norm is stock's there), the values are the
    contract's: the output within a bf16 rounding of stock's, the gradients within fp32's."""
    eps = 1e-5
    for shape in NORM_CAST_SHAPES:
        hidden = shape[-1]
        torch.manual_seed(fresh_seed())
        x = torch.randn(shape, device="cuda") * 3 + 0.5
        w = torch.randn(hidden, device="cuda") if affine != "none" else None
        b = torch.randn(hidden, device="cuda") if affine == "both" else None
        dy = torch.randn(shape, device="cuda").to(torch.bfloat16)
        before = [fused_count("torchfuse::norm_cast"), fused_count("torchfuse::norm_cast_backward")]
        ours = norm_cast_grads(kind, x, w, b, eps, dy, cast=True)
        served = [fused_count("torchfuse::norm_cast") - before[0],
                  fused_count("torchfuse::norm_cast_backward") - before[1]]
        want = norm_cast_grads(kind, x, w, b, eps, dy, cast=False)
        # The backward is norm_cast's where its forward was (otherwise the original's ops ran).
        fwd = int(has_variant(kind, "fwd", torch.float32, hidden, narrowed=True))
        expect = [fwd, fwd * int(has_variant(kind, "bwd", torch.float32, hidden))]
        assert served == expect, (shape, served, expect)
        bitwise = not fwd or has_variant(kind, "fwd", torch.float32, hidden)
        assert ours[0].dtype == torch.bfloat16 and ours[0].shape == x.shape and ours[0].is_contiguous()
        for i, (o, s) in enumerate(zip(ours, want)):
            assert o.dtype == s.dtype and o.shape == s.shape, (shape, i)
            if bitwise:
                assert torch.equal(o, s), (kind, affine, shape, i, (o.float() - s.float()).abs().max().item())
            else:
                assert rel_err(o, s) <= FLOOR[o.dtype], (kind, affine, shape, i, rel_err(o, s))


def test_norm_cast_where_the_norms_own_toggle_is_off_composes_the_original():
    """With layer_norm (rms_norm) switched off, the original's norm is stock's: norm_cast does not
    serve (its kernel would not be that norm's), it runs the norm and the cast as the original,
    autograd included; and under create_graph its fused backward gives way to a differentiable
    one, whose gradient of the gradient is stock's."""
    torch.manual_seed(fresh_seed())
    x = torch.randn(512, 1024, device="cuda")
    w, b = torch.randn(1024, device="cuda"), torch.randn(1024, device="cuda")
    dy = torch.randn(512, 1024, device="cuda").to(torch.bfloat16)
    for kind, toggle in (("layer", "layer_norm"), ("rms", "rms_norm"), ("rms", "hf_rms_norm")):
        bias = b if kind == "layer" else None
        before = fused_count("torchfuse::norm_cast")
        with enabled(toggle, False):
            ours = norm_cast_grads(kind, x, w, bias, 1e-5, dy, cast=True)
            want = norm_cast_grads(kind, x, w, bias, 1e-5, dy, cast=False)
        assert fused_count("torchfuse::norm_cast") == before
        assert all(torch.equal(o, s) for o, s in zip(ours, want)), kind
        assert "disabled at run time" in stock_reasons("torchfuse::norm_cast")
    # Double backward: d/dx of sum(dx * v), against the composition's.
    v = torch.randn(512, 1024, device="cuda")

    def second_order(cast):
        x_ = x.clone().requires_grad_()
        y = (torch.ops.torchfuse.norm_cast(x_, w, b, 1e-5, False, torch.bfloat16) if cast
             else norm_then_cast("layer", x_, w, b, 1e-5))
        dx, = torch.autograd.grad(y, x_, dy, create_graph=True)
        ddx, = torch.autograd.grad((dx * v).sum(), x_)
        return dx.detach(), ddx

    for o, s in zip(second_order(True), second_order(False)):
        assert rel_err(o, s) <= FLOOR[torch.float32], rel_err(o, s)
