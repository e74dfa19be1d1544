"""torchfuse::silu_mul[_backward] and silu_mul_packed[_backward] on the GPU, forced past the
registry's thresholds, against a float64 evaluation of HF's gated MLPs' pointwise part,
silu(gate) * up (LlamaMLP's; Phi3MLP's `up * silu(gate)` of one tensor's halves), with the
original's own error as the bar (docs/testing.md): within max(2 x the original's error, the
dtype's floor), same dtypes, shapes and strides; bitwise reproducible; what is not served goes
to stock; and the rewritten LlamaMLP and Phi3MLP give the originals' outputs and gradients."""
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import requires_cuda
from gpu_util import (FLOOR, fresh_seed, fused_count, original_and_rewrite, rel_err, stock_reasons,
                      torchfuse_below_thresholds)

# The kernels serve every shape here, also where the registry sends it to stock.
pytestmark = [requires_cuda, pytest.mark.usefixtures("torchfuse_below_thresholds")]

OP, OP_BWD = "torchfuse::silu_mul", "torchfuse::silu_mul_backward"
PACKED, PACKED_BWD = "torchfuse::silu_mul_packed", "torchfuse::silu_mul_packed_backward"
GELU, GELU_BWD = "torchfuse::gelu_tanh_mul", "torchfuse::gelu_tanh_mul_backward"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def original(gate, up):
    return F.silu(gate) * up


def gelu_original(gate, up):
    """GemmaMLP's pointwise part (its act_fn, HF's GELUTanh, is F.gelu with approximate="tanh")."""
    return F.gelu(gate, approximate="tanh") * up


# The dense ops, by name: (their stats names, the original composition).
DENSE = {"silu_mul": (OP, OP_BWD, original), "gelu_tanh_mul": (GELU, GELU_BWD, gelu_original)}


def grads(fn, gate, up, dy):
    g, u = gate.detach().requires_grad_(True), up.detach().requires_grad_(True)
    y = fn(g, u)
    return (y.detach(),) + torch.autograd.grad(y, (g, u), dy)


@pytest.mark.parametrize("name", sorted(DENSE))
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_op_is_the_original_composition(dtype, name):
    """silu_mul (Llama's) and gelu_tanh_mul (Gemma's) against the original composition: values
    and both gradients within the original's error to float64, dtypes, shapes, strides, bitwise
    reproducible, served forward and backward at every shape."""
    op, op_bwd, composition = DENSE[name]
    fn = getattr(torch.ops.torchfuse, name)
    seed = fresh_seed()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shapes = [(1,), (7,), (8,), (3, 5), (2, 9, 17), (4, 2816 + rng.randrange(1, 8)),
              (rng.randrange(1, 64), rng.randrange(1, 3000)), (4096, 2816)]
    for shape in shapes:
        gate = (3 * torch.randn(shape, device="cuda")).to(dtype)
        up = torch.randn(shape, device="cuda").to(dtype)
        dy = torch.randn(shape, device="cuda").to(dtype)
        before = fused_count(op), fused_count(op_bwd)
        ours = grads(fn, gate, up, dy)
        assert (fused_count(op), fused_count(op_bwd)) == (before[0] + 1, before[1] + 1), (
            shape, stock_reasons(op), stock_reasons(op_bwd))
        theirs = grads(composition, gate, up, dy)
        refs = grads(composition, gate.double(), up.double(), dy.double())
        for what, o, t, r in zip(("y", "dgate", "dup"), ours, theirs, refs):
            assert o.dtype == t.dtype and o.shape == t.shape and o.stride() == t.stride(), (what, shape)
            e_ours, e_orig = rel_err(o, r), rel_err(t, r)
            assert e_ours <= max(2 * e_orig, FLOOR[dtype]), f"seed {seed} {name} {shape} {what}: {e_ours:.3g} vs {e_orig:.3g}"
        again = grads(fn, gate, up, dy)
        assert all(torch.equal(a, b) for a, b in zip(ours, again)), f"{shape}: not reproducible"


def packed_original(gate_up):
    """Phi3MLP's pointwise part, as it writes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return up * F.silu(gate)


def packed_grads(fn, gate_up, dy):
    t = gate_up.detach().requires_grad_(True)
    y = fn(t)
    return (y.detach(),) + torch.autograd.grad(y, (t,), dy)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_packed_is_phi3s_composition(dtype):
    """Widths of 8k (16-byte accesses along each half-row) and not (element by element), one
    row and many, Phi-3-mini's 2 x 8192; the gradient of the packed tensor is one dense tensor
    of its shape, as chunk's backward gives."""
    seed = fresh_seed()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shapes = [(2,), (14,), (16,), (3, 10), (2, 9, 34), (5, 48), (4, 2 * (2816 + rng.randrange(1, 8))),
              (rng.randrange(1, 64), 2 * rng.randrange(1, 1500)), (2048, 2 * 8192), "misaligned"]
    for shape in shapes:
        if shape == "misaligned":  # contiguous, 16 halves of 8, at a storage offset of 2 elements
            shape = (4, 16)
            gate_up = (3 * torch.randn(66, device="cuda")).to(dtype)[2:].view(shape)
        else:
            gate_up = (3 * torch.randn(shape, device="cuda")).to(dtype)
        dy = torch.randn(shape[:-1] + (shape[-1] // 2,), device="cuda").to(dtype)
        before = fused_count(PACKED), fused_count(PACKED_BWD)
        ours = packed_grads(torch.ops.torchfuse.silu_mul_packed, gate_up, dy)
        assert (fused_count(PACKED), fused_count(PACKED_BWD)) == (before[0] + 1, before[1] + 1), (
            shape, stock_reasons(PACKED), stock_reasons(PACKED_BWD))
        theirs = packed_grads(packed_original, gate_up, dy)
        refs = packed_grads(packed_original, gate_up.double(), dy.double())
        for name, o, t, r in zip(("y", "dgate_up"), ours, theirs, refs):
            assert o.dtype == t.dtype and o.shape == t.shape and o.stride() == t.stride(), (name, shape)
            e_ours, e_orig = rel_err(o, r), rel_err(t, r)
            assert e_ours <= max(2 * e_orig, FLOOR[dtype]), f"seed {seed} {shape} {name}: {e_ours:.3g} vs {e_orig:.3g}"
        again = packed_grads(torch.ops.torchfuse.silu_mul_packed, gate_up, dy)
        assert all(torch.equal(a, b) for a, b in zip(ours, again)), f"{shape}: not reproducible"


def test_silu_mul_packed_not_served_goes_to_stock():
    """An odd last dim (chunked unevenly: the original's error), a strided tensor, a dtype the
    kernels do not take, a strided gradient to the backward: stock's composition, and its
    result or error."""
    a = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    for gate_up, why in [(a.t(), "non-contiguous input"), (a.double(), "unsupported dtype")]:
        before = stock_reasons(PACKED).get(why, 0)
        assert torch.equal(torch.ops.torchfuse.silu_mul_packed(gate_up), packed_original(gate_up))
        assert stock_reasons(PACKED).get(why, 0) == before + 1, (why, stock_reasons(PACKED))
    with pytest.raises(RuntimeError, match="must match the size"):
        torch.ops.torchfuse.silu_mul_packed(a[:, :255].contiguous())
    dy = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16).t()
    before = stock_reasons(PACKED_BWD).get("non-contiguous input", 0)
    ours = torch.ops.torchfuse.silu_mul_packed_backward(dy, a)
    assert stock_reasons(PACKED_BWD).get("non-contiguous input", 0) == before + 1, stock_reasons(PACKED_BWD)
    t = a.detach().requires_grad_(True)
    (expected,) = torch.autograd.grad(packed_original(t), (t,), dy)
    assert torch.equal(ours, expected)


def test_what_is_not_served_goes_to_stock():
    a = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    cases = [
        ((a, a[:, :1]), "input stock rejects"),  # broadcasting
        ((a.t(), a.t()), "non-contiguous input"),
        ((a, a.float()), "mixed input/parameter dtypes"),
        ((a.double(), a.double()), "unsupported dtype"),
    ]
    for (gate, up), why in cases:
        before = stock_reasons(OP).get(why, 0)
        ours = torch.ops.torchfuse.silu_mul(gate, up)
        assert stock_reasons(OP).get(why, 0) == before + 1, (why, stock_reasons(OP))
        assert torch.equal(ours, original(gate, up))


# The gated MLPs rewritten, by model: (its MLP class, its config class, the rewrite factory, the
# form, the op the rewrite calls, its backward).
MLPS = {
    "llama": ("LlamaMLP", "LlamaConfig", "_gated_mlp_forward", "hf_gated_mlp", OP, OP_BWD),
    # Phi-3's (GLM's, Dia's copies): gate_up_proj's output to silu_mul_packed, whose backward
    # writes the projection's gradient whole.
    "phi3": ("Phi3MLP", "Phi3Config", "_packed_gated_mlp_forward", "hf_packed_gated_mlp", PACKED, PACKED_BWD),
    # Llama 4's: Llama's with the activation named activation_fn and the product named first.
    "llama4": ("Llama4TextMLP", "Llama4TextConfig", "_gated_mlp_forward", "llama4_gated_mlp", OP, OP_BWD),
    # Gemma's (Gemma 2's, 3's): Llama's form with HF's GELUTanh as act_fn, to gelu_tanh_mul.
    "gemma": ("GemmaMLP", "GemmaConfig", "_gated_mlp_forward", "hf_gated_mlp", GELU, GELU_BWD),
    # T5Gemma's: Gemma's with a dropout of the product before down_proj (`CONFIGS`: live).
    "t5gemma": ("T5GemmaMLP", "T5GemmaModuleConfig", "_gated_mlp_forward", "t5gemma_gated_mlp", GELU, GELU_BWD),
    # Seed-OSS's: Llama's with F.dropout of its output (`CONFIGS`: live).
    "seed_oss": ("SeedOssMLP", "SeedOssConfig", "_gated_mlp_forward", "seed_oss_gated_mlp", OP, OP_BWD),
    # Gemma 3n's: Gemma's with the gate's top activations kept first (`CONFIGS`: sparsity 0.95).
    "gemma3n": ("Gemma3nTextMLP", "Gemma3nTextConfig", "_gated_mlp_forward", "gemma3n_gated_mlp", GELU, GELU_BWD),
    # RecurrentGemma's: Gemma's with the activation named first; biases.
    "recurrent_gemma": ("RecurrentGemmaMlp", "RecurrentGemmaConfig", "_gated_mlp_forward", "recurrent_gemma_gated_mlp",
                        GELU, GELU_BWD),
    # Falcon-H1's: Llama's with multipliers on the gate and the output (`CONFIGS`).
    "falcon_h1": ("FalconH1MLP", "FalconH1Config", "_gated_mlp_forward", "falcon_h1_gated_mlp", OP, OP_BWD),
    # DeepSeek-V4's: Llama's with gate and up clamped at its swiglu_limit (`CONFIGS`: one they cross).
    "deepseek_v4": ("DeepseekV4MLP", "DeepseekV4Config", "_gated_mlp_forward", "deepseek_v4_clamped_gated_mlp",
                    OP, OP_BWD),
}
# A model's own config fields beside the sizes (T5Gemma's module config has no dropout_rate of
# its own: its model's config sets it).
CONFIGS = {"t5gemma": {"dropout_rate": 0.1}, "seed_oss": {"residual_dropout": 0.1, "mlp_bias": True},
           "gemma3n": {"num_hidden_layers": 1, "activation_sparsity_pattern": [0.95]},
           "falcon_h1": {"mlp_multipliers": [0.5, 3.0]}, "deepseek_v4": {"swiglu_limit": 0.3}}


@pytest.mark.parametrize("model", sorted(MLPS))
def test_rewritten_mlp_gives_the_originals_output_and_grads(model):
    """The rewritten gated MLP against its original forward, plain and under bf16 autocast: the
    output and every gradient (input, each projection's weight) within twice the dtype's floor,
    the rewrite's op and its backward served once a step."""
    cls, config, factory, form, op, op_bwd = MLPS[model]
    mlp_class, forward, rewritten = original_and_rewrite(model, cls, factory, form)
    import transformers
    cfg = getattr(transformers, config)(hidden_size=256, intermediate_size=704, num_attention_heads=4,
                                        num_key_value_heads=4, **CONFIGS.get(model, {}))
    seed = fresh_seed()
    torch.manual_seed(seed)
    mlp = mlp_class(cfg).cuda()
    x = torch.randn(4, 33, 256, device="cuda")
    for autocast in (False, True):
        out = []
        for fn in (rewritten, forward):
            mlp.zero_grad()
            xi = x.detach().requires_grad_(True)
            served = fused_count(op), fused_count(op_bwd)
            torch.manual_seed(seed)  # a dropout draws the same mask on both sides
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                y = fn(mlp, xi)
            y.float().square().sum().backward()
            calls = fn is rewritten
            assert (fused_count(op), fused_count(op_bwd)) == (served[0] + calls, served[1] + calls), (
                autocast, stock_reasons(op), stock_reasons(op_bwd))
            out.append([y.detach(), xi.grad] + [p.grad.clone() for p in mlp.parameters()])
        for o, t in zip(*out):
            assert o.dtype == t.dtype and o.shape == t.shape
            assert rel_err(o, t) <= 2 * FLOOR[torch.bfloat16 if autocast else torch.float32], autocast


def test_moe_experts_with_the_rewritten_gate_give_the_originals_output_and_grads():
    """Mixtral's experts under the default grouped_mm implementation, their gate
    (`_apply_gate`, HF's `_default_apply_gate`) rewritten against the original: the output and
    the gradients of the input and both expert weights within twice bf16's floor,
    silu_mul_packed served forward and backward once per call."""
    pytest.importorskip("transformers")
    import sys

    import transformers
    import transformers.integrations.moe as moe
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "python"))
    from torchfuse import rewrites
    original = getattr(moe._default_apply_gate, "__wrapped__", moe._default_apply_gate)
    rewritten = rewrites._moe_apply_gate(torch, original, "hf_moe_apply_gate")
    cfg = transformers.MixtralConfig(hidden_size=256, intermediate_size=512, num_local_experts=4,
                                     num_experts_per_tok=2)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(fresh_seed())
    experts = MixtralExperts(cfg).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.05)
    x = torch.randn(96, 256, device="cuda", dtype=torch.bfloat16)
    top_k_index = torch.randint(0, 4, (96, 2), device="cuda")
    top_k_weights = torch.softmax(torch.randn(96, 2, device="cuda"), -1).to(torch.bfloat16)
    kept = vars(MixtralExperts).get("_apply_gate")
    out = []
    try:
        for gate in (rewritten, original):
            MixtralExperts._apply_gate = gate
            experts.zero_grad()
            xi = x.detach().requires_grad_(True)
            served = fused_count(PACKED), fused_count(PACKED_BWD)
            y = experts(xi, top_k_index, top_k_weights)
            y.float().square().sum().backward()
            calls = gate is rewritten
            assert (fused_count(PACKED), fused_count(PACKED_BWD)) == (served[0] + calls, served[1] + calls), (
                stock_reasons(PACKED), stock_reasons(PACKED_BWD))
            out.append([y.detach(), xi.grad] + [p.grad.clone() for p in experts.parameters()])
    finally:
        MixtralExperts._apply_gate = kept
    for o, t in zip(*out):
        assert o.dtype == t.dtype and o.shape == t.shape
        assert rel_err(o, t) <= 2 * FLOOR[torch.bfloat16]
