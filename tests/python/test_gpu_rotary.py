"""torchfuse::rotary[_backward] on the GPU, forced past the registry's thresholds, against a
float64 evaluation of HF's apply_rotary_pos_emb (rotate-half form), with the original's own
error as the bar (docs/testing.md): within max(2 x the original's error, the dtype's floor),
same dtypes, shapes and strides (q and k are transposed views of the projections, as in HF's
attention; GQA's k has fewer heads); bitwise reproducible; what is not served goes to stock."""
import random

import pytest
import torch

from conftest import requires_cuda
from gpu_util import (FLOOR, asked_count, fresh_seed, fused_count, original_and_rewrite, rel_err, stock_reasons,
                      torchfuse_below_thresholds)

# The kernels serve every shape here, also where the registry sends it to stock.
pytestmark = [requires_cuda, pytest.mark.usefixtures("torchfuse_below_thresholds")]

OP, OP_BWD = "torchfuse::rotary", "torchfuse::rotary_backward"


def rotate_half(x):  # transformers 5.17, modeling_llama.py
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def same_layout(a, b):
    """Equal strides wherever a dim has more than one element (a size-1 dim's stride says
    nothing about where elements are; PyTorch's own ops differ there)."""
    return all(n == 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()))


def run(fn, q, k, cos, sin, dq, dk, dim):
    q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
    qe, ke = fn(q, k, cos, sin, dim)
    grads = torch.autograd.grad((qe, ke), (q, k), (dq, dk))
    return [qe.detach(), ke.detach(), *grads]


def projected_heads(b, s, h, d, dtype):
    """[B, H, S, D] views of a [B, S, H*D] projection, as HF's attention makes them."""
    return torch.randn(b, s, h * d, device="cuda").to(dtype).view(b, s, h, d).transpose(1, 2)


def rope_tables(b, s, rotary_dim, dtype):
    """HF's cos and sin of [B, S, rotary_dim] (each angle twice: the rotate-half layout)."""
    angles = torch.rand(b, s, rotary_dim // 2, device="cuda") * 100
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def assert_like_the_original(ours, original, q, k, cos, sin, dq, dk, dim, what, grad_layouts=True):
    """`ours` (run's outputs of the fused side) against `original` on the same inputs and on
    float64 copies: the original's dtypes and shapes, its layouts (the gradients' too where
    `grad_layouts`), each within max(2 x the original's error, the dtype's floor)."""
    theirs = run(original, q, k, cos, sin, dq, dk, dim)
    refs = run(original, q.double(), k.double(), cos.double(), sin.double(), dq.double(), dk.double(), dim)
    for name, o, t, r in zip(("q_embed", "k_embed", "dq", "dk"), ours, theirs, refs):
        assert o.dtype == t.dtype and o.shape == t.shape, (what, name)
        if grad_layouts or name.endswith("embed"):  # equal strides on every dim of size > 1
            assert same_layout(o, t), (what, name, o.stride(), t.stride())
        e_ours, e_orig = rel_err(o, r), rel_err(t, r)
        assert e_ours <= max(2 * e_orig, FLOOR[o.dtype]), f"{what} {name}: {e_ours:.3g} vs {e_orig:.3g}"


def assert_served_once_like_the_original(rewritten, original, q, k, cos, sin, what):
    """A rewrite of q's and k's rotary (called as fn(q, k, cos, sin, 1)) served by
    torchfuse::rotary once, against the original (`assert_like_the_original`), with random
    gradients of the dtype q and cos promote to."""
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    dq, dk = (torch.randn(t.shape, device="cuda").to(out_dtype) for t in (q, k))
    before = fused_count(OP)
    ours = run(rewritten, q, k, cos, sin, dq, dk, 1)
    assert fused_count(OP) == before + 1, (what, stock_reasons(OP))
    assert_like_the_original(ours, original, q, k, cos, sin, dq, dk, 1, what)


def operand_cases(rng, x_dtype):
    """(b, s, hq, hk, d, q, k, unsqueeze_dim) of the layouts the op serves. Head dims 64, 128
    (16-byte chunks, 4 and 8 lanes a row), 32, 96 and 256 (2, 2 and 16 lanes), 2 and 40 (element
    by element), a 64 whose tensors start 2 elements into their memory (misaligned: element by
    element), and partial rotary: the first 32 of 80 head dims (a strided slice, as
    GPT-NeoX/Phi-style attention passes it)."""
    for b, s, hq, hk, d, dim in [(2, 9, 4, 2, 64, 1), (1, 1, 1, 1, 2, 1), (4, 1024, 16, 8, 64, 1),
                                 (2, rng.randrange(1, 300), 8, 8, 128, 1), (3, 17, 4, 4, 32, 2),
                                 (2, 5, 3, 1, 96, 1), (1, 7, 2, 2, 40, 2), (1, 3, 2, 1, 256, 1),
                                 (2, 11, 4, 2, 64, "misaligned"), (2, 13, 4, 2, 32, "partial")]:
        if dim == 1:
            q, k = projected_heads(b, s, hq, d, x_dtype), projected_heads(b, s, hk, d, x_dtype)
        elif dim == 2:  # [B, S, H, D] with unsqueeze_dim=2
            q = torch.randn(b, s, hq, d, device="cuda").to(x_dtype)
            k = torch.randn(b, s, hk, d, device="cuda").to(x_dtype)
        elif dim == "partial":  # [B, H, S, :d] slices of transposed [B, S, H, 80] projections
            dim = 1
            q = torch.randn(b, s, hq, 80, device="cuda").to(x_dtype).transpose(1, 2)[..., :d]
            k = torch.randn(b, s, hk, 80, device="cuda").to(x_dtype).transpose(1, 2)[..., :d]
        else:  # dense [B, H, S, D] tensors 2 elements into their buffers
            dim = 1
            q = torch.randn(b * hq * s * d + 2, device="cuda").to(x_dtype)[2:].view(b, hq, s, d)
            k = torch.randn(b * hk * s * d + 2, device="cuda").to(x_dtype)[2:].view(b, hk, s, d)
        yield b, s, hq, hk, d, q, k, dim


# (x dtype, cos/sin dtype): pure bf16, autocast's form (fp32 cos/sin from fp32 hidden states),
# fp32, f16.
FORMS = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32),
         (torch.float16, torch.float16)]


@pytest.mark.parametrize("x_dtype,trig_dtype", FORMS)
def test_rotary_is_hfs_composition(x_dtype, trig_dtype):
    seed = fresh_seed()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for b, s, hq, hk, d, q, k, dim in operand_cases(rng, x_dtype):
        cos, sin = rope_tables(b, s, d, trig_dtype)
        out_dtype = torch.promote_types(x_dtype, trig_dtype)
        dq = torch.randn(q.shape, device="cuda").to(out_dtype)
        dk = torch.randn(k.shape, device="cuda").to(out_dtype)
        before = fused_count(OP), fused_count(OP_BWD)
        ours = run(torch.ops.torchfuse.rotary, q, k, cos, sin, dq, dk, dim)
        assert (fused_count(OP), fused_count(OP_BWD)) == (before[0] + 1, before[1] + 1), (
            stock_reasons(OP), stock_reasons(OP_BWD))
        what = f"seed {seed} {x_dtype}/{trig_dtype} {list(q.shape)} {list(k.shape)} dim {dim}"
        assert_like_the_original(ours, apply_rotary_pos_emb, q, k, cos, sin, dq, dk, dim, what, grad_layouts=False)
        again = run(torch.ops.torchfuse.rotary, q, k, cos, sin, dq, dk, dim)
        assert all(torch.equal(a, c) for a, c in zip(ours, again)), f"{what}: not reproducible"


def rotate_pairs(x):  # transformers 5.17, modeling_glm.py's rotate_half
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_interleaved(q, k, cos, sin, unsqueeze_dim=1):
    """GLM's rotary of q and k with the tables as given (Cohere's: cos and sin interleaved)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_pairs(q) * sin), (k * cos) + (rotate_pairs(k) * sin)


def interleaved_op(q, k, cos, sin, unsqueeze_dim):
    return torch.ops.torchfuse.rotary(q, k, cos, sin, unsqueeze_dim, True)


@pytest.mark.parametrize("x_dtype,trig_dtype", FORMS)
def test_interleaved_rotary_is_glms_composition(x_dtype, trig_dtype):
    """torchfuse::rotary with interleaved=True (each pair of features (2p, 2p+1) rotated: GLM's,
    Cohere's, GPT-J's layout) against that composition, on the rotate-half test's layouts,
    forward and backward served, bitwise reproducible. Every table entry is its own angle (HF's
    interleaved tables repeat each twice, which would hide a kernel reading the pair's other
    entry)."""
    seed = fresh_seed()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for b, s, hq, hk, d, q, k, dim in operand_cases(rng, x_dtype):
        angles = torch.rand(b, s, d, device="cuda") * 100
        cos, sin = angles.cos().to(trig_dtype), angles.sin().to(trig_dtype)
        out_dtype = torch.promote_types(x_dtype, trig_dtype)
        dq = torch.randn(q.shape, device="cuda").to(out_dtype)
        dk = torch.randn(k.shape, device="cuda").to(out_dtype)
        before = fused_count(OP), fused_count(OP_BWD)
        ours = run(interleaved_op, q, k, cos, sin, dq, dk, dim)
        assert (fused_count(OP), fused_count(OP_BWD)) == (before[0] + 1, before[1] + 1), (
            stock_reasons(OP), stock_reasons(OP_BWD))
        what = f"seed {seed} interleaved {x_dtype}/{trig_dtype} {list(q.shape)} {list(k.shape)} dim {dim}"
        assert_like_the_original(ours, apply_interleaved, q, k, cos, sin, dq, dk, dim, what, grad_layouts=False)
        again = run(interleaved_op, q, k, cos, sin, dq, dk, dim)
        assert all(torch.equal(a, c) for a, c in zip(ours, again)), f"{what}: not reproducible"


@pytest.mark.parametrize("module_name,factory,form", [
    ("glm4", "_partial_rotary", "hf_rotary_pairs_partial"),
    ("glm4v", "_partial_rotary", "glm4v_rotary_pairs_partial"),
    ("cohere", "_rotary_cast_back", "cohere_rotary_pairs_upcast"),
    ("ernie4_5", "_rotary_cast_back", "hf_rotary_pairs_upcast"),
    ("blt", "_rotary", "hf_rotary_pairs"),
    ("helium", "_rotary", "helium_rotary"),
    ("nanochat", "_rotary", "hf_rotary_flipped")])
def test_interleaved_rotary_rewrites_are_the_original_functions(module_name, factory, form):
    """The rewrites of GLM-4's apply_rotary_pos_emb (GLM's tables, half or all of the head dim,
    then cat), Cohere's and Ernie 4.5's (in fp32, cast back to q's dtype), BLT's (Llama's code
    with Cohere's interleaved rotate_half), Helium's (GLM's tables, all of the head dim, in the
    inputs' dtypes) and NanoChat's (Llama's rotate_half negated: the op
    of -sin) against the original functions: served once a call where the rewrite takes it
    (the fp32 forms: where the arithmetic promotes to fp32 anyway), dtypes, layouts, values and
    gradients within the original's error to float64."""
    _, original, rewritten = original_and_rewrite(module_name, "apply_rotary_pos_emb", factory, form)
    seed = fresh_seed()
    torch.manual_seed(seed)
    partial = form in ("hf_rotary_pairs_partial", "glm4v_rotary_pairs_partial")
    promoted = form in ("hf_rotary_pairs_partial", "glm4v_rotary_pairs_partial", "hf_rotary_pairs", "hf_rotary_flipped",
                        "helium_rotary")
    cases = [(FORMS[1], 64), (FORMS[2], 64), (FORMS[0], 64)] + ([(FORMS[1], 32), (FORMS[3], 32)] if partial else [])
    for (x_dtype, trig_dtype), rotary_dim in cases:
        b, s, h, d = 2, 129, 8, 64
        q, k = projected_heads(b, s, h, d, x_dtype), projected_heads(b, s, h, d, x_dtype)
        cos, sin = rope_tables(b, s, rotary_dim, trig_dtype)
        if form in ("cohere_rotary_pairs_upcast", "hf_rotary_pairs"):  # tables of the interleaved layout
            angles = torch.rand(b, s, rotary_dim // 2, device="cuda") * 100
            cos, sin = (t.repeat_interleave(2, dim=-1).to(trig_dtype) for t in (angles.cos(), angles.sin()))
        out_dtype = torch.promote_types(x_dtype, trig_dtype) if promoted else x_dtype
        dq, dk = (torch.randn(t.shape, device="cuda").to(out_dtype) for t in (q, k))
        before = fused_count(OP), asked_count(OP)
        ours = run(rewritten, q, k, cos, sin, dq, dk, 1)
        served = promoted or torch.float32 in (x_dtype, trig_dtype)
        assert (fused_count(OP) - before[0], asked_count(OP) - before[1]) == (served, served), stock_reasons(OP)
        what = f"seed {seed} {module_name} {x_dtype}/{trig_dtype} rotary_dim {rotary_dim}"
        assert [o.dtype for o in ours] == [out_dtype, out_dtype, x_dtype, x_dtype], what
        assert_like_the_original(ours, original, q, k, cos, sin, dq, dk, 1, what)


def test_what_is_not_served_goes_to_stock():
    q = torch.randn(2, 8, 16, 64, device="cuda", dtype=torch.bfloat16)
    cos, sin = torch.randn(2, 16, 64, device="cuda"), torch.randn(2, 16, 64, device="cuda")
    cases = [
        ((q[:, :1].expand(2, 8, 16, 64), q, cos, sin), "non-contiguous input"),  # broadcast over heads
        ((q, q, cos.double(), sin.double()), "mixed input/parameter dtypes"),
        ((q, q, cos[:, :5], sin[:, :5]), "input stock rejects"),  # not broadcastable: stock raises
    ]
    for args, why in cases:
        before = stock_reasons(OP).get(why, 0)
        try:
            ours = torch.ops.torchfuse.rotary(*args, 1)
        except RuntimeError as e:
            with pytest.raises(RuntimeError):
                apply_rotary_pos_emb(*args)
            assert stock_reasons(OP).get(why, 0) == before + 1, (why, stock_reasons(OP), e)
            continue
        assert stock_reasons(OP).get(why, 0) == before + 1, (why, stock_reasons(OP))
        assert all(torch.equal(a, b) for a, b in zip(ours, apply_rotary_pos_emb(*args)))


def test_odd_head_dims_and_forward_ad_take_hfs_ops():
    """An odd head dim (not served: the composed backward splits rotate_half as HF does) and a
    forward-mode tangent (the op's autograd has no jvp) both give the original's results."""
    q = torch.randn(1, 2, 5, 7, device="cuda", dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 5, 7, device="cuda", dtype=torch.float64, requires_grad=True)
    cos, sin = torch.randn(1, 5, 7, device="cuda", dtype=torch.float64), torch.randn(1, 5, 7, device="cuda", dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: torch.ops.torchfuse.rotary(a, b, cos, sin, 1), (q, k))
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        dual = fwAD.make_dual(q.detach().float(), torch.ones_like(q, dtype=torch.float32))
        out = torch.ops.torchfuse.rotary(dual, k.detach().float(), cos.float(), sin.float(), 1)[0]
        tangent = fwAD.unpack_dual(out).tangent
    expected = apply_rotary_pos_emb(torch.ones_like(q, dtype=torch.float32), k.detach().float() * 0, cos.float(),
                                    sin.float())[0]
    assert torch.allclose(tangent, expected)


@pytest.mark.parametrize("module_name, factory, form", [
    ("gpt_neox", "_partial_rotary", "hf_partial_rotary"), ("phi3", "_partial_rotary", "hf_partial_rotary_inline"),
    ("nemotron", "_partial_rotary", "nemotron_partial_rotary"),
    ("qwen4_exp", "_optional_k_partial_rotary", "qwen4_exp_partial_rotary")])
def test_partial_rotary_rewrite_is_the_original_function(module_name, factory, form):
    """The rewrite of GPT-NeoX's (Phi-3's, Nemotron's, Qwen4-exp's with k) apply_rotary_pos_emb:
    the first cos.shape[-1] features rotated by torchfuse::rotary (a quarter of the head dim, as
    Pythia; Phi-2's 32 of 80; 24 of 64, a half of no whole chunk: element by element; all of
    it, as Phi-3), the rest passed through in the same call, against the original function:
    dtypes, layouts, values and gradients within the original's error to float64; the passed
    features bit for bit the original's (the cat's promotion, and its backward's cast)."""
    _, original, rewritten = original_and_rewrite(module_name, "apply_rotary_pos_emb", factory, form)
    seed = fresh_seed()
    torch.manual_seed(seed)
    for (x_dtype, trig_dtype), rotary_dim, d in [(FORMS[0], 16, 64), (FORMS[1], 16, 64), (FORMS[1], 64, 64),
                                                 (FORMS[2], 32, 64), (FORMS[1], 32, 80), (FORMS[1], 24, 64),
                                                 (FORMS[3], 16, 64)]:
        b, s, h = 2, 129, 8
        q, k = projected_heads(b, s, h, d, x_dtype), projected_heads(b, s, h, d, x_dtype)
        cos, sin = rope_tables(b, s, rotary_dim, trig_dtype)
        what = f"seed {seed} {module_name} {x_dtype}/{trig_dtype} rotary_dim {rotary_dim} of {d}"
        assert_served_once_like_the_original(rewritten, original, q, k, cos, sin, what)
        if rotary_dim < d:
            dq, dk = (torch.randn(t.shape, device="cuda").to(torch.promote_types(x_dtype, trig_dtype))
                      for t in (q, k))
            ours = run(rewritten, q, k, cos, sin, dq, dk, 1)
            theirs = run(original, q, k, cos, sin, dq, dk, 1)
            for name, o, t in zip(("q_embed", "k_embed", "dq", "dk"), ours, theirs):
                assert torch.equal(o[..., rotary_dim:], t[..., rotary_dim:]), (what, name)


def test_half_table_rotary_rewrite_is_the_original_function():
    """The rewrite of GPT-OSS's apply_rotary_pos_emb (halves of the head dim, tables of half its
    size): torchfuse::rotary of the tables repeated over both halves, laid out as the original's
    cat, against the original function: served once a call, dtypes, layouts, values and
    gradients within the original's error to float64."""
    _, original, rewritten = original_and_rewrite("gpt_oss", "apply_rotary_pos_emb", "_half_table_rotary",
                                                  "gpt_oss_rotary")
    seed = fresh_seed()
    torch.manual_seed(seed)
    for x_dtype, trig_dtype in FORMS[:3]:
        b, s, h, d = 2, 129, 8, 64
        q, k = projected_heads(b, s, h, d, x_dtype), projected_heads(b, s, 2, d, x_dtype)
        angles = torch.rand(b, s, d // 2, device="cuda") * 100
        cos, sin = angles.cos().to(trig_dtype), angles.sin().to(trig_dtype)
        what = f"seed {seed} gpt_oss {x_dtype}/{trig_dtype}"
        assert_served_once_like_the_original(rewritten, original, q, k, cos, sin, what)


def test_prefix_rotary_rewrite_is_the_original_function():
    """The rewrite of DINOv3's apply_rotary_pos_emb (the patch tokens rotated by
    torchfuse::rotary, the class and register tokens passed through, then the original's cats)
    against the original function: served once a call, dtypes, layouts, values and gradients
    within the original's error to float64, with five prefix tokens (DINOv3's class and four
    registers), one and none."""
    _, original, rewritten = original_and_rewrite("dinov3_vit", "apply_rotary_pos_emb", "_prefix_rotary",
                                                  "hf_prefix_rotary")
    seed = fresh_seed()
    torch.manual_seed(seed)

    def ours(q, k, cos, sin, _):
        return rewritten(q, k, cos, sin)

    def theirs(q, k, cos, sin, _):
        return original(q, k, cos, sin)

    for (x_dtype, trig_dtype), prefix in [(FORMS[1], 5), (FORMS[0], 1), (FORMS[2], 0)]:
        b, patches, h, d = 2, 196, 6, 64
        q, k = projected_heads(b, patches + prefix, h, d, x_dtype), projected_heads(b, patches + prefix, h, d, x_dtype)
        angles = torch.rand(patches, d // 2, device="cuda") * 100
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(trig_dtype), emb.sin().to(trig_dtype)
        what = f"seed {seed} dinov3 {x_dtype}/{trig_dtype} prefix {prefix}"
        assert_served_once_like_the_original(ours, theirs, q, k, cos, sin, what)


@pytest.mark.parametrize("module_name", ["olmo2", "modernbert"])
def test_cast_back_rotary_rewrite_is_the_original_function(module_name):
    """The rewrite of OLMo 2's apply_rotary_pos_emb (Llama's, each result cast back to its
    input's dtype) and ModernBERT's (the same of q and k upcast first): torchfuse::rotary, then
    the original's casts, against the original function: dtypes (the input's, also where cos is
    fp32 and the rotation's result was), layouts, values and gradients within the original's
    error to float64. ModernBERT's with 16-bit q and cos (arithmetic the op's fallback would
    not widen) runs the original."""
    form = {"olmo2": "hf_rotary_cast_back", "modernbert": "hf_rotary_upcast"}[module_name]
    _, original, rewritten = original_and_rewrite(module_name, "apply_rotary_pos_emb", "_rotary_cast_back", form)
    seed = fresh_seed()
    torch.manual_seed(seed)
    # The last: a bf16 q with an fp32 k (OLMo casts each back to its own dtype, ModernBERT both
    # to q's).
    for x_dtype, trig_dtype, k_dtype in [(x, t, x) for x, t in FORMS] + [(torch.bfloat16, torch.float32, torch.float32)]:
        b, s, h, d = 2, 129, 8, 64
        q, k = projected_heads(b, s, h, d, x_dtype), projected_heads(b, s, h, d, k_dtype)
        cos, sin = rope_tables(b, s, d, trig_dtype)
        k_out = x_dtype if module_name == "modernbert" else k_dtype
        dq, dk = torch.randn(q.shape, device="cuda").to(x_dtype), torch.randn(k.shape, device="cuda").to(k_out)
        before = fused_count(OP), asked_count(OP)
        ours = run(rewritten, q, k, cos, sin, dq, dk, 1)
        # The op serves where the rewrite takes the call: q and k of one dtype (mixed ones run
        # the original), and for the upcast form, arithmetic promoting to fp32.
        served = k_dtype == x_dtype and (module_name == "olmo2" or torch.float32 in (x_dtype, trig_dtype))
        assert (fused_count(OP) - before[0], asked_count(OP) - before[1]) == (served, served), stock_reasons(OP)
        what = f"seed {seed} {module_name} {x_dtype}/{trig_dtype}/k {k_dtype}"
        assert [o.dtype for o in ours] == [x_dtype, k_out, x_dtype, k_dtype], what
        assert_like_the_original(ours, original, q, k, cos, sin, dq, dk, 1, what)


def assert_one_tensor_like_the_original(rewritten, original, x, tables, what):
    """A one-tensor rotary's rewrite (called as fn(x, *tables)), its forward and backward served
    once, against the original on the same inputs and float64 copies: dtypes, shapes, the
    output's layout, values and x's gradient within max(2 x the original's error, the dtype's
    floor)."""
    served = fused_count(OP), fused_count(OP_BWD)
    xi = x.detach().requires_grad_(True)
    ours = rewritten(xi, *tables)
    dy = torch.randn_like(ours)
    (dx,) = torch.autograd.grad(ours, (xi,), dy)
    assert (fused_count(OP), fused_count(OP_BWD)) == (served[0] + 1, served[1] + 1), (what, stock_reasons(OP))
    ref_x = x.detach().double().requires_grad_(True)
    ref = original(ref_x, *(t.double() if isinstance(t, torch.Tensor) else t for t in tables))
    (ref_dx,) = torch.autograd.grad(ref, (ref_x,), dy.double())
    xo = x.detach().requires_grad_(True)
    theirs = original(xo, *tables)
    (their_dx,) = torch.autograd.grad(theirs, (xo,), dy)
    # The gradient's layout is autograd's accumulation order, not a contract (as in the op's
    # own test): checked for the output only.
    assert same_layout(ours, theirs), what
    for name, o, t, r in (("x_embed", ours, theirs, ref), ("dx", dx, their_dx, ref_dx)):
        assert o.dtype == t.dtype and o.shape == t.shape, (what, name)
        e_ours, e_orig = rel_err(o, r), rel_err(t, r)
        assert e_ours <= max(2 * e_orig, FLOOR[o.dtype]), f"{what} {name}: {e_ours:.3g} vs {e_orig:.3g}"


@pytest.mark.parametrize("x_dtype,trig_dtype", FORMS)
def test_gemma4_one_tensor_rotary_is_the_originals(x_dtype, trig_dtype):
    """Gemma 4's apply_rotary_pos_emb (one tensor; Gemma 3n's), rewritten: torchfuse::rotary of
    x with an empty k, against the original (`assert_one_tensor_like_the_original`); heads as
    HF's attention views them (unsqueeze_dim 1) and [B, S, H, D] (unsqueeze_dim 2)."""
    _, original, rewritten = original_and_rewrite("gemma4", "apply_rotary_pos_emb", "_single_rotary",
                                                  "hf_single_rotary")
    seed = fresh_seed()
    torch.manual_seed(seed)
    for b, s, h, d, dim in [(2, 1024, 8, 256, 1), (3, 77, 4, 128, 1), (2, 64, 4, 64, 2)]:
        x = projected_heads(b, s, h, d, x_dtype)
        x = x if dim == 1 else x.transpose(1, 2)
        cos, sin = rope_tables(b, s, d, trig_dtype)
        what = f"seed {seed} {x_dtype}/{trig_dtype} {(b, s, h, d)} dim {dim}"
        assert_one_tensor_like_the_original(rewritten, original, x, (cos, sin, dim), what)


@pytest.mark.parametrize("module_name", ["gptj", "codegen"])
@pytest.mark.parametrize("x_dtype,trig_dtype", FORMS)
def test_gptj_rotary_is_the_originals(module_name, x_dtype, trig_dtype):
    """GPT-J's apply_rotary_pos_emb (CodeGen's), rewritten: the interleaved torchfuse::rotary of
    x with an empty k and the half-size tables repeated pair by pair, against the original
    (`assert_one_tensor_like_the_original`). As GPT-J's attention calls it: x the rotary slice
    of each head of a [B, S, H, D] projection view (GPT-J 6B's 64 of 256, and all of a head),
    sin and cos the halves of one gathered table, a batch of one broadcast."""
    _, original, rewritten = original_and_rewrite(module_name, "apply_rotary_pos_emb", "_every_two_rotary",
                                                  "gptj_rotary")
    seed = fresh_seed()
    torch.manual_seed(seed)
    for b, s, h, d, rotary_dim, table_batch in [(2, 1024, 16, 256, 64, 2), (3, 77, 4, 64, 64, 1), (1, 9, 2, 32, 16, 1)]:
        x = torch.randn(b, s, h * d, device="cuda").to(x_dtype).view(b, s, h, d)[..., :rotary_dim]
        angles = torch.rand(table_batch, s, rotary_dim // 2, device="cuda") * 100
        sin, cos = torch.cat((angles.sin(), angles.cos()), dim=-1).to(trig_dtype).split(rotary_dim // 2, dim=-1)
        what = f"seed {seed} {module_name} {x_dtype}/{trig_dtype} {(b, s, h, d)} rotary {rotary_dim}"
        assert_one_tensor_like_the_original(rewritten, original, x, (sin, cos), what)


@pytest.mark.parametrize("x_dtype,trig_dtype", FORMS)
def test_qwen4_exp_rotary_of_q_alone_is_the_originals(x_dtype, trig_dtype):
    """Qwen4-exp's apply_rotary_pos_emb without k (its indexer's call: keywords, [B, S, H, D],
    unsqueeze_dim 2), rewritten: torchfuse::rotary of q's rotated slice alone, then the
    original's cat, against the original (`assert_one_tensor_like_the_original`); a quarter
    of the head dim and all of it."""
    _, original, rewritten = original_and_rewrite("qwen4_exp", "apply_rotary_pos_emb", "_optional_k_partial_rotary",
                                                  "qwen4_exp_partial_rotary")
    seed = fresh_seed()
    torch.manual_seed(seed)

    def ours(x, cos, sin):
        return rewritten(x, cos=cos, sin=sin, unsqueeze_dim=2)

    def theirs(x, cos, sin):
        return original(x, cos=cos, sin=sin, unsqueeze_dim=2)

    for b, s, h, d, rotary_dim in [(2, 1024, 8, 128, 32), (3, 77, 4, 64, 64)]:
        x = torch.randn(b, s, h * d, device="cuda").to(x_dtype).view(b, s, h, d)
        cos, sin = rope_tables(b, s, rotary_dim, trig_dtype)
        what = f"seed {seed} {x_dtype}/{trig_dtype} {(b, s, h, d)} rotary {rotary_dim}"
        assert_one_tensor_like_the_original(ours, theirs, x, (cos, sin), what)
