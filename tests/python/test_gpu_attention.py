"""scaled_dot_product_attention through torchfuse's flash-style kernels: forward output and
logsumexp, and all three grads, against a float64 reference and stock (docs/testing.md ("Correctness")) on fresh
random shapes; bitwise reproducible backward; routing of what we do not serve back to stock."""
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import check, requires_cuda, run_python
from gpu_util import (FLOOR, enabled, fresh_seed, fused_count, kernel_count, poison_allocator,
                      rel_err, stock_reasons, torchfuse_below_thresholds)

pytestmark = [requires_cuda, pytest.mark.usefixtures("torchfuse_below_thresholds")]

FLASH = "_scaled_dot_product_flash_attention"
FLASH_BWD = "_scaled_dot_product_flash_attention_backward"
CHOICE = "sdpa backend choice"


def make_qkv(gen, b, h, hk, lq, lk, d, dtype, layout):
    """q [b, h, lq, d], k/v [b, hk, lk, d]; `layout` "bhld" (contiguous) or "blhd" (the
    transposed view a transformer's projections give)."""
    def one(heads, length):
        if layout == "bhld":
            t = torch.randn(b, heads, length, d, generator=gen, device="cuda")
        else:
            t = torch.randn(b, length, heads, d, generator=gen, device="cuda").transpose(1, 2)
        return t.to(dtype)
    return one(h, lq), one(hk, lk), one(hk, lk)


def reference(q, k, v, causal, scale, dout):
    """float64 output, logsumexp and grads."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    ke, ve = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    s = (q64 @ ke.transpose(-1, -2)) * scale
    if causal:
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ ve
    out.backward(dout.double())
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def sdpa_fwd_bwd(q, k, v, causal, scale, dout):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    o.backward(dout)
    return o.detach(), q.grad, k.grad, v.grad


def bound(stock_err, floor):
    """docs/testing.md ("Correctness"): within twice stock's error or the floor. Where stock's own result is not
    finite (seen from cuDNN on valid inputs), ours must meet the floor."""
    return max(2 * stock_err, floor) if math.isfinite(stock_err) else floor


def draw_case(rng):
    d = rng.choice([64, 128])
    dtype = rng.choice([torch.bfloat16, torch.float16])
    b = rng.randint(1, 3)
    hk = rng.choice([1, 2, 3])
    h = hk * rng.choice([1, 1, 2, 4])
    causal = rng.random() < 0.5
    lq = rng.choice([1, 7, 16, 63, 64, 65, 100, 127, 128, 129, 200, 255, 257, 384, 511, 640])
    lk = lq if causal else rng.choice([1, 9, 31, 64, 65, 130, 256, 300, 513, 700])
    scale = rng.choice([None, None, 0.05, 0.3, 0.0])
    layout = rng.choice(["bhld", "blhd"])
    return b, h, hk, lq, lk, d, dtype, causal, scale, layout


def check_random_cases(cases, family=None):
    """`cases` random calls through torchfuse against the float64 reference and stock. With
    `family` ("" for the mma.sync variants) every call is forced onto
    attn_d<D>_<causal|full><family>, else the registry routes it."""
    rng = random.Random(fresh_seed())
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    served_before = (fused_count(FLASH), fused_count(FLASH_BWD))
    for _ in range(cases):
        b, h, hk, lq, lk, d, dtype, causal, scale, layout = case = draw_case(rng)
        if family is not None:
            variant = f"attn_d{d}_{'causal' if causal else 'full'}{family}"
            torch.ops.torchfuse._force_variant(variant)
            variant_before = (kernel_count(FLASH, variant), kernel_count(FLASH_BWD, variant))
        q, k, v = make_qkv(gen, b, h, hk, lq, lk, d, dtype, layout)
        dout = torch.randn(b, h, lq, d, generator=gen, device="cuda").to(dtype)
        eff_scale = scale if scale is not None else d ** -0.5
        ref = reference(q, k, v, causal, eff_scale, dout)
        poison_allocator(q.numel() * 16)
        ours = sdpa_fwd_bwd(q, k, v, causal, scale, dout)
        with enabled("sdpa", False):
            stock = sdpa_fwd_bwd(q, k, v, causal, scale, dout)
        for name, o, s, r in zip(["out", "dq", "dk", "dv"], ours, stock, [ref[0], *ref[2:]]):
            assert o.shape == s.shape and o.dtype == s.dtype, (case, name)
            assert torch.isfinite(o).all(), (case, name)
            err, stock_err = rel_err(o, r), rel_err(s, r)
            assert err <= bound(stock_err, FLOOR[dtype]), (case, name, err, stock_err)
        # logsumexp, through the flash op itself (ours, then stock's flash).
        lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=eff_scale)[1] if h == hk else None
        if lse is not None:
            assert lse.dtype == torch.float32 and lse.shape == (b, h, lq)
            with enabled("sdpa", False):
                stock_lse = torch.ops.aten._scaled_dot_product_flash_attention(
                    q, k, v, 0.0, causal, False, scale=eff_scale)[1]
            err, stock_err = rel_err(lse, ref[1]), rel_err(stock_lse, ref[1])
            assert err <= bound(stock_err, 1e-5), (case, "lse", err, stock_err)
        if family is not None:
            assert kernel_count(FLASH, variant) > variant_before[0], case
            assert kernel_count(FLASH_BWD, variant) == variant_before[1] + 1, case
    served_after = (fused_count(FLASH), fused_count(FLASH_BWD))
    assert served_after[0] - served_before[0] >= cases
    assert served_after[1] - served_before[1] == cases


def test_forward_and_grads_match_reference_and_stock_on_random_cases():
    check_random_cases(48)


def test_mma_sync_variants_match_reference_and_stock_on_random_cases():
    """The mma.sync kernels serve sm 80-89; on sm 90 the registry prefers the warpgroup ones,
    so here they are forced by name."""
    try:
        check_random_cases(24, family="")
    finally:
        torch.ops.torchfuse._force_variant("")


@pytest.mark.parametrize("layout", ["blhd", "bhld", "packed"])
def test_outputs_and_grads_have_stock_flash_formats(layout):
    """The flash op's outputs, and SDPA's output and gradients, with the dtypes, shapes and
    strides stock's flash gives: stock lays each out as the tensor it comes from where that is
    dense (a contiguous [B, H, L, D] q gives a contiguous output), else as [B, L, H, D] storage
    (q, k and v sliced from one packed projection)."""
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    if layout == "packed":
        qkv = torch.randn(2, 130, 3, 4, 64, generator=gen, device="cuda").to(torch.bfloat16)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    else:
        q, k, v = make_qkv(gen, 2, 4, 4, 130, 130, 64, torch.bfloat16, layout)
    before = fused_count(FLASH)
    ours = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=0.125)
    assert fused_count(FLASH) == before + 1
    with enabled("sdpa", False):
        stock = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=0.125)
    assert len(ours) == len(stock) == 9
    for i, (a, s) in enumerate(zip(ours, stock)):
        if isinstance(s, torch.Tensor):
            assert isinstance(a, torch.Tensor), i
            assert (a.dtype, a.shape, a.device) == (s.dtype, s.shape, s.device), i
        else:
            assert a == s, i
    assert ours[0].stride() == stock[0].stride()
    assert ours[1].stride() == stock[1].stride()

    def output_and_grads():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]  # the layouts kept
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        return [out, *torch.autograd.grad(out, leaves, torch.randn_like(out))]

    before = fused_count(FLASH_BWD)
    ours = output_and_grads()
    assert fused_count(FLASH_BWD) == before + 1
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # stock's flash (ours serve default choices only)
        stock = output_and_grads()
    for name, a, s in zip(["out", "dq", "dk", "dv"], ours, stock):
        assert (a.dtype, a.shape, a.stride()) == (s.dtype, s.shape, s.stride()), (layout, name)


def test_backward_is_bitwise_reproducible():
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    for d, causal, hk in [(64, True, 4), (128, False, 2), (64, False, 1)]:
        q, k, v = make_qkv(gen, 2, 4, hk, 333, 333, d, torch.bfloat16, "blhd")
        dout = torch.randn(2, 4, 333, d, generator=gen, device="cuda").to(torch.bfloat16)
        before = fused_count(FLASH_BWD)
        first = sdpa_fwd_bwd(q, k, v, causal, None, dout)
        assert fused_count(FLASH_BWD) == before + 1  # ours, not stock's (whose dq is not)
        for _ in range(2):
            again = sdpa_fwd_bwd(q, k, v, causal, None, dout)
            for a, b in zip(first, again):
                assert torch.equal(a, b)


def test_a_processs_first_backward_is_served():
    """The backward runs on autograd's device thread, where no CUDA context is current before
    PyTorch's own first launch or allocation there: the first backward of a fresh process must
    be ours too (it went to stock once, its TMA descriptors refused without a context: a first
    step's gradients from another kernel than every later step's). The allocator's cache is
    filled first, so the backward's own allocations make no cudaMalloc there that would make
    the context current and hide the case (checked: no new segment)."""
    proc = check(run_python("""
import json, torch
import torch.nn.functional as F
q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
grad = torch.randn_like(out)  # a dense gradient (sum()'s is expanded: stock's)
cached = [torch.empty(1 << 18, dtype=torch.uint8, device="cuda") for _ in range(32)]
del cached
torch.cuda.synchronize()
segments = torch.cuda.memory_stats()["segment.all.allocated"]
out.backward(grad)
torch.cuda.synchronize()
print(json.dumps({"new_segments": torch.cuda.memory_stats()["segment.all.allocated"] - segments,
                  "calls": json.loads(torch.ops.torchfuse.stats())["ops"]["_scaled_dot_product_flash_attention_backward"]}))
""", load_library=True))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["new_segments"] == 0, out
    calls = out["calls"]
    assert calls["fused"] == 1 and not calls["stock_reasons"], calls


def test_persistent_forward_over_one_and_many_waves_of_tiles():
    """With deterministic algorithms required, calls above the routed sizes go to sm 90's
    persistent forward (the *_persistent variants): with more query tiles than one wave of CTAs
    holds it hands them out by an atomic counter, with fewer it runs a CTA per tile. Either way
    every tile is computed once, matching the float64 reference and stock, with the same bits
    on a second call."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the persistent forward is an sm 90 variant")
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    torch.ops.torchfuse._serve_below_thresholds(False)
    try:
        torch.use_deterministic_algorithms(True)
        for b, h, hk, lq, lk, d, causal in [(4, 16, 4, 1000, 1000, 64, True),
                                            (3, 12, 12, 777, 901, 128, False),
                                            (2, 24, 8, 1100, 1100, 128, True),
                                            (1, 4, 2, 2000, 2000, 64, True),
                                            (1, 2, 2, 3000, 2500, 128, False)]:
            case = (b, h, hk, lq, lk, d, causal)
            q, k, v = make_qkv(gen, b, h, hk, lq, lk, d, torch.bfloat16, "blhd")
            variant = f"attn_d{d}_{'causal' if causal else 'full'}_wg_persistent"
            before = kernel_count(FLASH, variant)
            with torch.no_grad():
                ours = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                      enable_gqa=True)
                again = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                       enable_gqa=True)
                with enabled("sdpa", False):
                    stock = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                           enable_gqa=True)
            assert kernel_count(FLASH, variant) == before + 2, case
            assert torch.equal(ours, again), case
            ref = reference(q, k, v, causal, d ** -0.5, torch.zeros_like(q))[0]
            err, stock_err = rel_err(ours, ref), rel_err(stock, ref)
            assert err <= bound(stock_err, FLOOR[torch.bfloat16]), (case, err, stock_err)
    finally:
        torch.use_deterministic_algorithms(False)
        torch.ops.torchfuse._serve_below_thresholds(True)


def test_deterministic_mode_does_not_fill_our_outputs():
    """With deterministic algorithms on, aten's empty fills new memory
    (torch.utils.deterministic.fill_uninitialized_memory); the kernels write their outputs
    whole, and torchfuse allocates them unfilled: a served call launches no fill kernel."""
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    q, k, v = make_qkv(gen, 2, 4, 4, 300, 300, 64, torch.bfloat16, "blhd")
    try:
        torch.use_deterministic_algorithms(True)
        before = fused_count(FLASH)
        with torch.no_grad(), torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.cuda.synchronize()
        assert fused_count(FLASH) == before + 1
    finally:
        torch.use_deterministic_algorithms(False)
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any(name.startswith("attn_fwd") for name in kernels), kernels
    assert not any("fill" in name.lower() for name in kernels), kernels


def test_what_we_do_not_serve_goes_to_stock_with_its_reason():
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    q, k, v = make_qkv(gen, 1, 2, 2, 64, 64, 64, torch.bfloat16, "bhld")

    def reasons_after(fn):
        before = dict(stock_reasons(CHOICE))
        fn()
        after = stock_reasons(CHOICE)
        return {r: n - before.get(r, 0) for r, n in after.items() if n != before.get(r, 0)}

    mask = torch.ones(64, 64, dtype=torch.bool, device="cuda").tril()
    assert "attn_mask, dropout, nested inputs or a negative scale are not served" in reasons_after(
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert "attn_mask, dropout, nested inputs or a negative scale are not served" in reasons_after(
        lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1))
    # The warpgroup forward scales after its max: negative scales are stock's, through the
    # backward too.
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    before = (fused_count(FLASH), fused_count(FLASH_BWD))
    assert "attn_mask, dropout, nested inputs or a negative scale are not served" in reasons_after(
        lambda: F.scaled_dot_product_attention(qg, kg, vg, scale=-0.1).sum().backward())
    assert (fused_count(FLASH), fused_count(FLASH_BWD)) == before
    with torch.no_grad():
        F.scaled_dot_product_attention(q, k, v, scale=-0.1)
        torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=-0.1)
    assert (fused_count(FLASH), fused_count(FLASH_BWD)) == before
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        before = fused_count(FLASH)
        assert "SDPA backends restricted by the user" in reasons_after(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        assert fused_count(FLASH) == before
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert "SDPA backends restricted by the user" in reasons_after(
            lambda: F.scaled_dot_product_attention(q, k, v))
    q96, k96, v96 = make_qkv(gen, 1, 2, 2, 64, 64, 96, torch.bfloat16, "bhld")
    assert "no variant for this shape" in reasons_after(
        lambda: F.scaled_dot_product_attention(q96, k96, v96))
    with enabled("sdpa", False):
        before = fused_count(FLASH)
        F.scaled_dot_product_attention(q, k, v)
        assert fused_count(FLASH) == before
    # Causal with Lq != Lk (top-left mask): not the flash backend's, stock decides.
    qs = q[:, :, :32]
    out = F.scaled_dot_product_attention(qs, k, v, is_causal=True)
    with enabled("sdpa", False):
        ref = F.scaled_dot_product_attention(qs, k, v, is_causal=True)
    assert torch.equal(out, ref)


def test_stock_errors_are_kept():
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    q, k, v = make_qkv(gen, 1, 4, 3, 64, 64, 64, torch.bfloat16, "bhld")
    with pytest.raises(RuntimeError) as ours:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    with enabled("sdpa", False), pytest.raises(RuntimeError) as stock:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert str(ours.value).splitlines()[0] == str(stock.value).splitlines()[0]


def test_q_and_k_of_other_head_dims_get_a_clear_error_every_time():
    """q's head dim 64, k's and v's 32: stock (torch 2.11 on Hopper) picks cuDNN, which raises a
    graph error on the first call and crashes the process on the second; torchfuse refuses the
    call at the backend choice, with the dims in the message, every time, switched on or off."""
    q = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, 8, 128, 32, device="cuda", dtype=torch.bfloat16)
    for on in (True, True, False):
        with enabled("sdpa", on), pytest.raises(RuntimeError, match=r"last dimension \(64\) must equal key's \(32\)"):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True)


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, c = x.shape
        q, k, v = self.qkv(self.ln(x)).split(c, dim=2)
        q, k, v = (t.view(b, s, self.heads, c // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, s, c))


@pytest.mark.parametrize("mode", ["autocast", "bf16"])
def test_transformer_block_autograd_matches_stock(mode):
    torch.manual_seed(fresh_seed())
    dim, heads = 768, 12
    block = Block(dim, heads).cuda()
    if mode == "bf16":
        block = block.to(torch.bfloat16)
    x = torch.randn(4, 256, dim, device="cuda", dtype=next(block.parameters()).dtype)
    results = []
    before = fused_count(FLASH_BWD)
    for on in (True, False):
        block.zero_grad()
        with enabled("sdpa", on), torch.autocast("cuda", torch.bfloat16, enabled=mode == "autocast"):
            loss = block(x).float().square().mean()
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in block.parameters()]))
    assert fused_count(FLASH_BWD) == before + 1
    (loss_on, grads_on), (loss_off, grads_off) = results
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-2, atol=1e-3)
    for a, b in zip(grads_on, grads_off):
        assert rel_err(a, b) < 3e-2


@pytest.mark.parametrize("causal", [True, False])
def test_registry_thresholds_route_small_calls_only(causal):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    torch.ops.torchfuse._serve_below_thresholds(False)
    try:
        small = make_qkv(gen, 1, 12, 12, 128, 128, 64, torch.bfloat16, "blhd")
        before = fused_count(FLASH)
        F.scaled_dot_product_attention(*small, is_causal=causal)
        assert fused_count(FLASH) == before + 1
        served = fused_count(FLASH)
        large = make_qkv(gen, 8, 12, 12, 1024, 1024, 64, torch.bfloat16, "blhd")
        before = dict(stock_reasons(CHOICE))
        F.scaled_dot_product_attention(*large, is_causal=causal)
        after = stock_reasons(CHOICE)
        key = "stock is faster at this shape"
        assert after.get(key, 0) == before.get(key, 0) + 1
        assert fused_count(FLASH) == served
    finally:
        torch.ops.torchfuse._serve_below_thresholds(True)


def test_deterministic_mode_routes_large_calls_to_the_kernels():
    """With torch.use_deterministic_algorithms(True) stock leaves cuDNN (its backward is not
    deterministic) for FlashAttention-2's deterministic backward, which our kernels beat at every
    size measured on sm 90: a GPT-2-size call is then served, reproducibly, and matches stock.
    warn_only keeps cuDNN allowed, and the thresholds apply again."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("deterministic-mode routing is measured on sm 90 only")
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    q, k, v = make_qkv(gen, 8, 12, 12, 1024, 1024, 64, torch.bfloat16, "blhd")
    dout = torch.randn(8, 12, 1024, 64, generator=gen, device="cuda").to(torch.bfloat16)
    torch.ops.torchfuse._serve_below_thresholds(False)
    try:
        torch.use_deterministic_algorithms(True)
        before = (fused_count(FLASH), fused_count(FLASH_BWD))
        ours = sdpa_fwd_bwd(q, k, v, True, None, dout)
        assert (fused_count(FLASH), fused_count(FLASH_BWD)) == (before[0] + 1, before[1] + 1)
        again = sdpa_fwd_bwd(q, k, v, True, None, dout)
        for a, b in zip(ours, again):
            assert torch.equal(a, b)
        with enabled("sdpa", False):
            stock = sdpa_fwd_bwd(q, k, v, True, None, dout)
        ref = reference(q, k, v, True, 1 / 8, dout)
        for name, a, s, r in zip(["out", "dq", "dk", "dv"], ours, stock, (ref[0],) + ref[2:]):
            err, stock_err = rel_err(a, r), rel_err(s, r)
            assert err <= bound(stock_err, FLOOR[torch.bfloat16]), (name, err, stock_err)

        torch.use_deterministic_algorithms(True, warn_only=True)
        before = dict(stock_reasons(CHOICE))
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        key = "stock is faster at this shape"
        assert stock_reasons(CHOICE).get(key, 0) == before.get(key, 0) + 1
    finally:
        torch.use_deterministic_algorithms(False)
        torch.ops.torchfuse._serve_below_thresholds(True)
