"""The rewrite layer (python/torchfuse/rewrites.py) and torchfuse's own ops without a GPU: which
HF classes get a rewritten forward after `torchfuse.enable()` and which are left alone, that
the toggles decide it, that a rewritten forward runs the original code for CPU tensors, and
that the ops run on CPU, on meta tensors and under torch.compile (their stock kernels)."""
import json

import pytest

from conftest import LIB_DIR, ROOT, check, run_python

pytest.importorskip("transformers", reason="scripts/setup installs transformers")

ENABLE = f"""
import json, torch, torchfuse
torchfuse.enable({str(LIB_DIR)!r})
"""


# A rotary rewrite's CUDA path run on CPU against its original (the scripts below): outputs
# bitwise with dtypes and strides, gradients' dtypes, and the gradients within two of their
# roundings of the original's.
ROTARY_CHECKS = """
def rotary_checks(rewritten, original, q, k, cos, sin, dim):
    runs = []
    for fn in (rewritten, original):
        qi, ki = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        qe, ke = fn(qi, ki, cos, sin, dim)
        (qe.float().square().sum() + ke.float().square().sum()).backward()
        runs.append(((qe.detach(), ke.detach()), (qi.grad, ki.grad)))
    (ours, g_ours), (theirs, g_theirs) = runs
    same = all(torch.equal(a, b) and a.dtype == b.dtype and a.stride() == b.stride() for a, b in zip(ours, theirs))
    rel = max(((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(g_ours, g_theirs))
    return [same, all(a.dtype == b.dtype for a, b in zip(g_ours, g_theirs)),
            rel <= (1e-5 if q.dtype == torch.float32 else 1.6e-2)]
"""

# Runs a rotary rewrite's own code past its guard on CPU (the path a CUDA call takes): rotary
# rewrites made after it find `_rotary_call` passing every call, and torchfuse::rotary's CPU
# kernel is HF's composition.
ROTARY_GUARD_PASSED = """
import torchfuse.rewrites as R
R._rotary_call = lambda torch, original, dependencies=None: (lambda *args: True)
"""

# The names of the nodes a backward runs from a grad_fn (a node met twice, twice): which ops an
# output came from (the torchfuse ops' autograd nodes are CppFunction).
GRAPH_NODES = """
def graph_nodes(root):
    pending, names = [root], []
    while pending:
        node = pending.pop()
        if node is not None:
            names.append(type(node).__name__)
            pending.extend(n for n, _ in node.next_functions)
    return names
"""

# Runs a one-tensor rotary's rewrite and its original on x (with the tables after it) and
# backward: [the empty k sends no gradient back (a narrow's backward would add full-size zeros
# to x's), the output bitwise with its dtype and strides, x's gradient in x's dtype within two
# of its roundings of the original's (which rounds each branch's, then their sum)].
ONE_TENSOR_CHECKS = """
def one_tensor_checks(rewritten, original, x, *tables):
    runs = []
    for fn in (rewritten, original):
        xi = x.detach().requires_grad_(True)
        y = fn(xi, *tables)
        y.float().square().sum().backward()
        runs.append((y.detach(), xi.grad))
    (ours, g_ours), (theirs, g_theirs) = runs
    node = rewritten(x.detach().requires_grad_(True), *tables).grad_fn
    no_zeros = node is None or all(n[0] is None or type(n[0]).__name__ == "AccumulateGrad" for n in node.next_functions)
    rel = ((g_ours.double() - g_theirs.double()).norm() / g_theirs.double().norm()).item()
    return [no_zeros, torch.equal(ours, theirs), ours.dtype == theirs.dtype, ours.stride() == theirs.stride(),
            g_ours.dtype == g_theirs.dtype and rel <= (1e-5 if x.dtype == torch.float32 else 1.6e-2)]

def size_error(fn, *args, **kwargs):  # [fn raises the original's error for tables of another size]
    try:
        fn(*args, **kwargs)
        return [False]
    except RuntimeError as error:
        return ["must match the size" in str(error)]
"""


def run(code, **env):
    proc = check(run_python(ENABLE + code, PYTHONPATH=ROOT / "python", TORCHFUSE_LOG="debug", **env))
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


REWRITTEN = """
import transformers.activations as A
import transformers.models.llama.modeling_llama as L
import transformers.models.qwen2.modeling_qwen2 as Q
import transformers.models.gemma.modeling_gemma as G
import transformers.loss.loss_utils as LU
import transformers.models.gpt2.modeling_gpt2 as GPT2
import transformers.models.gpt_bigcode.modeling_gpt_bigcode as BIGCODE
def rewritten(cls):
    forward = cls.forward
    if forward.__code__.co_name == "shared_cast":  # the input's cast (its own toggle) around the forward
        forward = forward.__wrapped__
    return hasattr(forward, "__wrapped__")
found = {name: rewritten(cls) for name, cls in [
    ("NewGELUActivation", A.NewGELUActivation), ("FastGELUActivation", A.FastGELUActivation),
    ("GELUActivation", A.GELUActivation), ("LlamaRMSNorm", L.LlamaRMSNorm),
    ("Qwen2RMSNorm", Q.Qwen2RMSNorm), ("GemmaRMSNorm", G.GemmaRMSNorm), ("LlamaMLP", L.LlamaMLP),
    ("Qwen2MLP", Q.Qwen2MLP), ("GPT2MLP", GPT2.GPT2MLP), ("GPTBigCodeMLP", BIGCODE.GPTBigCodeMLP)]}
found["ForCausalLMLoss"] = (hasattr(LU.ForCausalLMLoss, "__wrapped__")
                            and LU.LOSS_MAPPING["ForCausalLM"] is LU.ForCausalLMLoss)
found["ForMaskedLMLoss"] = hasattr(LU.ForMaskedLMLoss, "__wrapped__")
found["apply_rotary_pos_emb"] = hasattr(L.apply_rotary_pos_emb, "__wrapped__")
print(json.dumps(found))
"""


def test_known_forms_are_rewritten_and_others_left_alone():
    out, log = run(REWRITTEN)
    assert out == {"NewGELUActivation": True, "FastGELUActivation": True, "GELUActivation": False,
                   "LlamaRMSNorm": True, "Qwen2RMSNorm": True, "GemmaRMSNorm": True,
                   "ForCausalLMLoss": True, "ForMaskedLMLoss": False, "LlamaMLP": True,
                   "Qwen2MLP": True, "apply_rotary_pos_emb": True, "GPT2MLP": True, "GPTBigCodeMLP": True}
    assert ("rewrite gelu_tanh: transformers.models.gpt2.modeling_gpt2.GPT2MLP.forward (hf_conv1d_mlp) -> "
            "torch.ops.torchfuse.gelu_tanh") in log
    assert ("rewrite swiglu: transformers.models.llama.modeling_llama.LlamaMLP.forward (hf_gated_mlp) -> "
            "torch.ops.torchfuse.silu_mul") in log
    assert ("rewrite cross_entropy: transformers.loss.loss_utils.ForCausalLMLoss (hf_causal_lm_loss) -> "
            "torch.ops.torchfuse.cross_entropy") in log
    assert ("rewrite gelu_tanh: transformers.activations.NewGELUActivation.forward (new_gelu) -> "
            "torch.ops.torchfuse.gelu_tanh") in log
    assert "rewrite hf_rms_norm: transformers.models.llama.modeling_llama.LlamaRMSNorm.forward" in log
    assert ("rewrite hf_rms_norm: transformers.models.gemma.modeling_gemma.GemmaRMSNorm.forward "
            "(gemma_rms_norm) -> aten::rms_norm in fp32") in log
    assert log.count("rewrite gelu_tanh: transformers.activations.NewGELUActivation") == 1


def test_a_toggled_off_rewrite_is_not_made():
    out, log = run(REWRITTEN, TORCHFUSE_OPS="-hf_rms_norm,-cross_entropy,-swiglu,-rotary")
    assert out["NewGELUActivation"] and not out["LlamaRMSNorm"] and not out["Qwen2RMSNorm"]
    assert not out["ForCausalLMLoss"] and not out["LlamaMLP"] and not out["apply_rotary_pos_emb"]
    assert "rewrite hf_rms_norm off" in log and "rewrite cross_entropy off" in log
    out, log = run(REWRITTEN, TORCHFUSE_OPS="-gelu_tanh")
    assert not out["NewGELUActivation"] and not out["GPT2MLP"] and out["LlamaMLP"]
    assert "rewrite gelu_tanh off: transformers.models.gpt2.modeling_gpt2.GPT2MLP.forward" in log


def test_without_the_library_nothing_is_rewritten(tmp_path):
    proc = check(run_python(f"""
import json, torch, torchfuse
torchfuse.enable({str(tmp_path)!r})
import transformers.activations as A
print(json.dumps(hasattr(A.NewGELUActivation.forward, "__wrapped__")))
""", PYTHONPATH=ROOT / "python"))
    assert proc.stdout.strip().splitlines()[-1] == "false"


def test_hooks_installed_before_the_library_rewrite_once_enable_loads_it():
    """Modules imported while the hooks ran without the library (start-up hook without the
    preload, hooks installed before enable()) are not marked done: enable() rewrites them."""
    proc = check(run_python(f"""
import json, torch, torchfuse
torchfuse.install_hooks()
import transformers.models.llama.modeling_llama as L
before = hasattr(L.LlamaRMSNorm.forward, "__wrapped__"), hasattr(L.apply_rotary_pos_emb, "__wrapped__")
ok = torchfuse.enable({str(LIB_DIR)!r})
after = hasattr(L.LlamaRMSNorm.forward, "__wrapped__"), hasattr(L.apply_rotary_pos_emb, "__wrapped__")
torchfuse.enable({str(LIB_DIR)!r})  # once only
print(json.dumps({{"before": before, "ok": ok, "after": after,
                  "twice": hasattr(L.LlamaRMSNorm.forward.__wrapped__, "__wrapped__")}}))
""", PYTHONPATH=ROOT / "python"))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"before": [False, False], "ok": True, "after": [True, True], "twice": False}, out


def test_another_object_under_a_known_function_name_is_said_at_info():
    """The `kernels` package, where installed, wraps HF's apply_rotary_pos_emb in a module: the
    rewrite is skipped, and an info line says why."""
    proc = check(run_python(f"""
import sys, types, torch, torchfuse
torchfuse.enable({str(LIB_DIR)!r})
from torchfuse import rewrites
class Kernelized(torch.nn.Module):
    pass
module = types.ModuleType("transformers.models.fake.modeling_fake")
module.apply_rotary_pos_emb = Kernelized()
rewrites.patch_module(module)
print(type(module.apply_rotary_pos_emb).__name__)
""", PYTHONPATH=ROOT / "python", TORCHFUSE_LOG="info"))
    assert proc.stdout.strip().splitlines()[-1] == "Kernelized"
    assert ("rewrite rotary: transformers.models.fake.modeling_fake.apply_rotary_pos_emb is not the known "
            "hf_rotary function (a __main__.Kernelized); left alone") in proc.stderr, proc.stderr


def test_cpu_inputs_run_the_original_code_bitwise():
    out, _ = run("""
import inspect
import transformers.activations as A
import transformers.models.llama.modeling_llama as L
torch.manual_seed(0)
x = torch.randn(4, 33, dtype=torch.bfloat16)
gelu = A.NewGELUActivation()
norm = L.LlamaRMSNorm(33, eps=1e-6)
with torch.no_grad():
    norm.weight.normal_()
import transformers.loss.loss_utils as LU
from transformers import LlamaConfig
mlp = L.LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=40, num_attention_heads=2, num_key_value_heads=2, hidden_act="silu"))
h = torch.randn(3, 16)
import transformers.models.gpt2.modeling_gpt2 as GPT2
gpt2_mlp = GPT2.GPT2MLP(64, GPT2.GPT2Config(n_embd=16, n_head=2, resid_pdrop=0.0))
q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
logits = torch.randn(2, 9, 50, dtype=torch.bfloat16)
labels = torch.randint(0, 50, (2, 9))
print(json.dumps([torch.equal(gelu(x), A.NewGELUActivation.forward.__wrapped__(gelu, x)),
                  torch.equal(norm(x), L.LlamaRMSNorm.forward.__wrapped__(norm, x)),
                  torch.equal(LU.ForCausalLMLoss(logits, labels, 50),
                              LU.ForCausalLMLoss.__wrapped__(logits, labels, 50)),
                  torch.equal(mlp(h), inspect.unwrap(L.LlamaMLP.forward)(mlp, h)),  # past shared_cast's wrapper too
                  torch.equal(gpt2_mlp(h), GPT2.GPT2MLP.forward.__wrapped__(gpt2_mlp, h)),
                  all(torch.equal(a, b) for a, b in zip(
                      L.apply_rotary_pos_emb(q, k, cos, sin),
                      L.apply_rotary_pos_emb.__wrapped__(q, k, cos, sin)))]))
""")
    assert out == [True, True, True, True, True, True]


def test_the_ops_run_on_cpu_meta_and_under_compile():
    out, _ = run("""
x = torch.randn(5, 9, dtype=torch.bfloat16, requires_grad=True)
y = torch.ops.torchfuse.gelu_tanh(x, torch.float32)
(g,) = torch.autograd.grad(y.sum(), x)
ref = torch.nn.functional.gelu(x.detach().float(), approximate="tanh")
meta = torch.ops.torchfuse.gelu_tanh(torch.empty(3, 4, device="meta", dtype=torch.float16), torch.float32)
w = torch.randn(9)
n = torch.ops.torchfuse.hf_rms_norm(x.detach(), w, 1e-6)
t = torch.tensor([1, -100, 3, 8, 0])
ce = torch.ops.torchfuse.cross_entropy(x, t, 1, -100, 0.0, torch.float32)
(ce_grad,) = torch.autograd.grad(ce, x)
x32 = x.detach().float().requires_grad_(True)
ce_ref = torch.nn.functional.cross_entropy(x32, t)
(ce_ref_grad,) = torch.autograd.grad(ce_ref, x32)
gate, up = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
sm = torch.ops.torchfuse.silu_mul(gate, up)
sm_ref = torch.nn.functional.silu(gate) * up
sm_grads = torch.autograd.grad(sm.sum(), (gate, up))
sm_ref_grads = torch.autograd.grad(sm_ref.sum(), (gate, up))
sm_meta = torch.ops.torchfuse.silu_mul(torch.empty(2, 3, device="meta", dtype=torch.bfloat16),
                                       torch.empty(2, 3, device="meta", dtype=torch.bfloat16))
ce_meta = torch.ops.torchfuse.cross_entropy(torch.empty(4, 7, device="meta", dtype=torch.bfloat16),
                                            torch.empty(4, dtype=torch.long, device="meta"), 0)
compiled = torch.compile(lambda t: torch.ops.torchfuse.gelu_tanh(t, torch.float32) * 2, fullgraph=True)
print(json.dumps({"dtype": str(y.dtype), "close": torch.allclose(y, ref), "grad": str(g.dtype),
                  "meta": [str(meta.dtype), list(meta.shape)], "norm": str(n.dtype),
                  "compiled": torch.allclose(compiled(x.detach()), 2 * ref),
                  "ce": [str(ce.dtype), torch.equal(ce, ce_ref), str(ce_grad.dtype),
                         torch.equal(ce_grad, ce_ref_grad.bfloat16())],
                  "ce_meta": [str(ce_meta.dtype), list(ce_meta.shape)],
                  "silu_mul": [torch.equal(sm, sm_ref)] + [torch.equal(a, b) for a, b in zip(sm_grads, sm_ref_grads)],
                  "silu_mul_meta": [str(sm_meta.dtype), list(sm_meta.shape)]}))
""")
    assert out == {"dtype": "torch.float32", "close": True, "grad": "torch.bfloat16",
                   "meta": ["torch.float32", [3, 4]], "norm": "torch.float32", "compiled": True,
                   "ce": ["torch.float32", True, "torch.bfloat16", True],
                   "ce_meta": ["torch.bfloat16", [4]], "silu_mul": [True, True, True],
                   "silu_mul_meta": ["torch.bfloat16", [2, 3]]}


def test_the_ops_have_second_derivatives():
    """create_graph through the ops' C++ autograd (a gradient penalty): PyTorch's gradgradcheck
    in float64 on CPU, where the first backward takes the differentiable path."""
    out, _ = run("""
from torch.autograd import gradcheck, gradgradcheck
g, u = (torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
q, k = (torch.randn(2, n, 3, 4, dtype=torch.float64, requires_grad=True) for n in (2, 1))
cos, sin = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
rotary = lambda a, b: torch.ops.torchfuse.rotary(a, b, cos, sin, 1)
x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
silu_mul = lambda a, b: torch.ops.torchfuse.silu_mul(a, b)
gelu = lambda a: torch.ops.torchfuse.gelu_tanh(a)
print(json.dumps([gradcheck(silu_mul, (g, u)), gradgradcheck(silu_mul, (g, u)),
                  gradcheck(gelu, (x,)), gradgradcheck(gelu, (x,)),
                  gradcheck(rotary, (q, k)), gradgradcheck(rotary, (q, k))]))
""")
    assert out == [True] * 6


def test_odd_head_dims_and_forward_mode_ad_through_the_ops():
    """rotary's composed backward splits rotate_half as HF does for an odd head dim; a forward-mode
    tangent (the ops' Functions have no jvp) runs PyTorch's own ops and keeps its tangent."""
    out, _ = run("""
import torch.autograd.forward_ad as fwAD
from torch.autograd import gradcheck
q = torch.randn(1, 2, 5, 7, dtype=torch.float64, requires_grad=True)
k = torch.randn(1, 1, 5, 7, dtype=torch.float64, requires_grad=True)
cos, sin = torch.randn(1, 5, 7, dtype=torch.float64), torch.randn(1, 5, 7, dtype=torch.float64)
odd = gradcheck(lambda a, b: torch.ops.torchfuse.rotary(a, b, cos, sin, 1), (q, k))
x = torch.randn(3, 4, dtype=torch.float64)
with fwAD.dual_level():
    d = fwAD.make_dual(x, torch.ones_like(x))
    tangents = [fwAD.unpack_dual(y).tangent for y in (
        torch.ops.torchfuse.silu_mul(d, d), torch.ops.torchfuse.gelu_tanh(d),
        torch.ops.torchfuse.rotary(d.view(1, 1, 3, 4), d.view(1, 1, 3, 4), cos[:, :3, :4], sin[:, :3, :4], 1)[0])]
print(json.dumps([odd] + [t is not None for t in tangents]))
""")
    assert out == [True, True, True, True]


def test_mask_skip_takes_eagers_decision_under_compile_only():
    """HF's decisions to build no SDPA mask: under torch.compile without a padding mask they give
    what the original gives in eager (is_causal=True where q and kv lengths agree or q is one
    token; no bidirectional mask), never where a local window applies; with a padding mask, in
    eager and under torch.export the original decides (False in any trace); TORCHFUSE_OPS=-sdpa
    leaves them alone."""
    code = """
import transformers.masking_utils as M
causal, bidirectional = M._ignore_causal_mask_sdpa, M._ignore_bidirectional_mask_sdpa
def traced(decide):
    torch._dynamo.reset()  # each a new trace, not a recompile of the same lambda
    return torch.compile(lambda x: x + int(decide()), backend="eager", fullgraph=True)(torch.zeros(())).item()
class Export(torch.nn.Module):
    def forward(self, x):
        return x + int(causal(None, 8, 8, 0, 0))
exported = torch.export.export(Export(), (torch.zeros(()),)).module()(torch.zeros(())).item()
def ranged(n):
    # Lengths a ranged mark_dynamic leaves symbolic: decided only where no guard is needed (q
    # and kv the same symbol, no window), else the original's False; never a guard that breaks
    # the range (a window of 8 inside 2..64).
    torch._dynamo.reset()
    def decide(x):
        n = x.shape[0]
        return torch.stack([x.sum() * 0 + int(causal(None, n, n, 0, 0)),
                            x.sum() * 0 + int(causal(None, n, n, 0, 0, 8)),
                            x.sum() * 0 + int(bidirectional(None, n, 8))])
    x = torch.zeros(n)
    torch._dynamo.mark_dynamic(x, 0, min=2, max=64)
    return torch.compile(decide, backend="eager", fullgraph=True)(x).int().tolist()
padding = torch.ones(2, 8, dtype=torch.bool)
print(json.dumps({
    "rewritten": [hasattr(causal, "__wrapped__"), hasattr(bidirectional, "__wrapped__")],
    "eager": [causal(None, 8, 8, 0, 0), causal(None, 8, 8, 0, 0, 4), bidirectional(None, 8)],
    "compiled": [traced(lambda: causal(None, 8, 8, 0, 0)), traced(lambda: causal(None, 1, 9, 8, 0)),
                 traced(lambda: causal(None, 8, 8, 0, 0, 4)), traced(lambda: causal(None, 8, 8, 0, 0, 9)),
                 traced(lambda: causal(None, 4, 8, 0, 0)), traced(lambda: bidirectional(None, 8)),
                 traced(lambda: bidirectional(None, 8, 8)), traced(lambda: bidirectional(None, 8, 9))],
    "padding": [traced(lambda: causal(padding, 8, 8, 0, 0)), traced(lambda: bidirectional(padding, 8))],
    "exported": exported, "ranged": [ranged(n) for n in (5, 20)]}))
"""
    out, log = run(code)
    assert out == {"rewritten": [True, True], "eager": [True, False, True],
                   "compiled": [1, 1, 0, 1, 0, 1, 0, 1], "padding": [0, 0], "exported": 0,
                   "ranged": [[1, 0, 0], [1, 0, 0]]}
    assert ("rewrite sdpa: transformers.masking_utils._ignore_causal_mask_sdpa "
            "(hf_ignore_causal_mask_sdpa) -> under torch.compile") in log
    out, log = run(code, TORCHFUSE_OPS="-sdpa")
    assert out["rewritten"] == [False, False] and out["compiled"] == [0] * 8
    assert out["eager"] == [True, False, True]


def test_gemmas_rms_norm_replacement_is_its_arithmetic_on_cpu():
    """What the Gemma rewrite calls on CUDA (aten::rms_norm of x.float() with the weight
    1 + weight.float(), then x's dtype), checked on CPU against the class's original forward
    and a float64 evaluation: values and both gradients; the rewritten forward itself runs the
    original on CPU, bitwise."""
    out, _ = run("""
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
torch.manual_seed(0)
result = {}
for dtype in (torch.float32, torch.bfloat16):
    norm = GemmaRMSNorm(96, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(0, 0.1)
    x = (torch.randn(5, 7, 96) * 3).to(dtype).requires_grad_(True)
    original = GemmaRMSNorm.forward.__wrapped__(norm, x)
    replacement = torch.rms_norm(x.float(), (96,), 1.0 + norm.weight.float(), 1e-6).type_as(x)
    x64 = x.detach().double().requires_grad_(True)
    w64 = norm.weight.detach().double().requires_grad_(True)
    h = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = h * (1.0 + w64)
    g = torch.randn_like(ref)
    grads = [torch.autograd.grad(y, (x, norm.weight), g.to(y.dtype)) for y in (original, replacement)]
    ref_grads = torch.autograd.grad(ref, (x64, w64), g)
    def err(a, b):
        return ((a.double() - b).norm() / b.norm()).item()
    result[str(dtype)] = {
        "dtypes": [str(original.dtype), str(replacement.dtype)],
        "value": [err(original, ref), err(replacement, ref)],
        "dx": [err(grads[0][0], ref_grads[0]), err(grads[1][0], ref_grads[0])],
        "dw": [err(grads[0][1], ref_grads[1]), err(grads[1][1], ref_grads[1])],
        "cpu_is_original": torch.equal(norm(x), original)}
# Gemma 3's q_norm input: heads transposed out of the projection. The rewrite normalises the
# rows as they lie in memory and permutes back: the original's strides and values.
from torchfuse.rewrites import _rows_view
norm = GemmaRMSNorm(32, eps=1e-6)
with torch.no_grad():
    norm.weight.normal_(0, 0.1)
x = torch.randn(2, 9, 4, 32).to(torch.bfloat16).transpose(1, 2)
rows, back = _rows_view(x)
ours = torch.rms_norm(rows.float(), (32,), 1.0 + norm.weight.float(), 1e-6).type_as(x).permute(back)
original = GemmaRMSNorm.forward.__wrapped__(norm, x)
overlapping = torch.randn(1, 32).expand(4, 32)
result["transposed"] = [ours.stride() == original.stride() == x.stride(),
                        ((ours.float() - original.float()).abs().max() / original.float().abs().max()).item() < 8e-3,
                        _rows_view(overlapping) == (None, None), _rows_view(x.contiguous())[1] is None]
print(json.dumps(result))
""")
    assert out["transposed"] == [True, True, True, True], out["transposed"]
    for dtype, floor in (("torch.float32", 1e-5), ("torch.bfloat16", 8e-3)):
        r = out[dtype]
        assert r["dtypes"] == [dtype, dtype] and r["cpu_is_original"], r
        for key in ("value", "dx", "dw"):
            original, replacement = r[key]
            assert replacement <= max(2 * original, floor), (dtype, key, r[key])


def test_partial_rotary_replacement_is_the_original_on_cpu():
    """What the partial-rotary rewrite computes on CUDA (torchfuse::rotary of the first
    cos.shape[-1] features as views, then the original's cat), checked on CPU, where the op runs
    HF's composition, against GPT-NeoX's and Phi-3's originals: bitwise, dtypes and strides,
    for a quarter of the head dim (Pythia), all of it, bf16 q with fp32 cos; the rewritten
    function itself runs the original on CPU."""
    out, _ = run("""
import transformers.models.gpt_neox.modeling_gpt_neox as N
import transformers.models.phi3.modeling_phi3 as P
torch.manual_seed(0)
result = []
for module in (N, P):
    original = module.apply_rotary_pos_emb.__wrapped__
    for rotary_dim, q_dtype, trig_dtype, unsqueeze in ((16, torch.float32, torch.float32, 1), (64, torch.bfloat16, torch.float32, 1),
                                                       (16, torch.bfloat16, torch.bfloat16, 2)):
        shape = (2, 4, 5, 64) if unsqueeze == 1 else (2, 5, 4, 64)
        q, k = torch.randn(shape).to(q_dtype), torch.randn(shape).to(q_dtype)
        cos, sin = torch.randn(2, 5, rotary_dim).to(trig_dtype), torch.randn(2, 5, rotary_dim).to(trig_dtype)
        expected = original(q, k, cos, sin, unsqueeze)
        q_embed, k_embed = torch.ops.torchfuse.rotary(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin, unsqueeze)
        ours = (torch.cat([q_embed, q[..., rotary_dim:]], dim=-1), torch.cat([k_embed, k[..., rotary_dim:]], dim=-1))
        result.append(all(torch.equal(a, b) and a.dtype == b.dtype and a.stride() == b.stride()
                          for a, b in zip(ours, expected))
                      and all(torch.equal(a, b) for a, b in zip(module.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze), expected)))
print(json.dumps({"rewritten": [hasattr(N.apply_rotary_pos_emb, "__wrapped__"), hasattr(P.apply_rotary_pos_emb, "__wrapped__")],
                  "equal": result}))
""")
    assert out == {"rewritten": [True, True], "equal": [True] * 6}


def test_partial_rotary_takes_its_slices_by_one_split_on_cpu_with_the_guard_passed():
    """The partial rotaries' rewrites (GPT-NeoX's, Phi-3's inline form, GLM-4's interleaved one,
    Nemotron's),
    their own code past the guard on CPU (`_rotary_call` patched to pass): the original's outputs
    bitwise with their strides, and q's and k's gradients bitwise those of the original's two
    slices of each (the same op called on `q[..., :r]`, then cat with `q[..., r:]`: the same
    values, so only the graph tells them apart). A quarter of the head (k's head of another
    width) and all of it (Phi-3's, nothing passed through) are one op with `passthrough`: no
    split, cat or slice in the backward graph."""
    out, _ = run(GRAPH_NODES + ROTARY_GUARD_PASSED + """
import transformers.models.gpt_neox.modeling_gpt_neox as N
import transformers.models.phi3.modeling_phi3 as P
import transformers.models.glm4.modeling_glm4 as G
import transformers.models.nemotron.modeling_nemotron as M
torch.manual_seed(0)

result = []
for module, form, interleaved in ((N, "hf_partial_rotary", False), (P, "hf_partial_rotary_inline", False),
                                  (G, "hf_rotary_pairs_partial", True), (M, "nemotron_partial_rotary", False)):
    original = module.apply_rotary_pos_emb.__wrapped__
    rewritten = R._partial_rotary(torch, original, form)
    for rotary_dim, x_dtype in ((16, torch.bfloat16), (64, torch.float32)):
        q = torch.randn(2, 5, 4, 64).to(x_dtype).transpose(1, 2)  # a projection's view
        k = torch.randn(2, 2, 5, 64 if rotary_dim == 64 else 32).to(x_dtype)  # another head dim than q's
        cos, sin = torch.randn(2, 5, rotary_dim), torch.randn(2, 5, rotary_dim)
        qi, ki = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        ours = rewritten(qi, ki, cos, sin)
        theirs = original(q, k, cos, sin)
        graph = graph_nodes(ours[0].grad_fn) + graph_nodes(ours[1].grad_fn)
        (ours[0].float().square().sum() + ours[1].float().square().sum()).backward()
        # The slices the rewrite made before: the same op, the same tables.
        qs, ks = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        tables = R._interleaved_tables(cos, sin, 1) if interleaved else (cos, sin)
        r = tables[0].shape[-1]
        q_embed, k_embed = torch.ops.torchfuse.rotary(qs[..., :r], ks[..., :r], *tables, 1, interleaved)
        sliced = (torch.cat([q_embed, qs[..., r:]], dim=-1), torch.cat([k_embed, ks[..., r:]], dim=-1))
        (sliced[0].float().square().sum() + sliced[1].float().square().sum()).backward()
        same = all(torch.equal(a, b) and a.dtype == b.dtype and a.stride() == b.stride() for a, b in zip(ours, theirs))
        one_op = not any(n in graph for n in ("SplitWithSizesBackward0", "CatBackward0"))
        result.append([same,
                       torch.equal(qi.grad, qs.grad) and torch.equal(ki.grad, ks.grad),
                       one_op,
                       "SliceBackward0" not in graph])
print(json.dumps(result))
""")
    assert out == [[True] * 4] * 8, out


def test_optional_k_partial_rotary_runs_its_cuda_path_on_cpu_with_the_guard_passed():
    """Qwen4-exp's apply_rotary_pos_emb (GPT-NeoX's partial rotary, k optional), the rewrite's own
    code past the guard on CPU (`_rotary_call` patched to pass): with k, q's and k's results as
    the original's (bitwise with dtypes and strides, gradients within two roundings); without k
    (the model's indexer: keywords, unsqueeze_dim 2, [B, S, H, D]), q's alone, the same checks;
    tables the original cannot use get its error."""
    out, log = run(ROTARY_CHECKS + ONE_TENSOR_CHECKS + ROTARY_GUARD_PASSED + """
import transformers.models.qwen4_exp.modeling_qwen4_exp as Q
original = Q.apply_rotary_pos_emb.__wrapped__
rewritten = R._optional_k_partial_rotary(torch, original, "qwen4_exp_partial_rotary")
torch.manual_seed(0)
result = []
for rotary_dim, x_dtype, trig_dtype in ((32, torch.bfloat16, torch.float32), (64, torch.float32, torch.float32),
                                        (16, torch.bfloat16, torch.bfloat16)):
    q, k = torch.randn(2, 5, 4, 64).to(x_dtype).transpose(1, 2), torch.randn(2, 2, 5, 64).to(x_dtype)
    cos, sin = torch.randn(2, 5, rotary_dim).to(trig_dtype), torch.randn(2, 5, rotary_dim).to(trig_dtype)
    result.append(rotary_checks(rewritten, original, q, k, cos, sin, 1))
    x = torch.randn(2, 5, 4, 64).to(x_dtype)
    # Past the first check (the output's node feeds x's leaf directly: here it is the cat's).
    result.append(one_tensor_checks(lambda t, c, s: rewritten(t, cos=c, sin=s, unsqueeze_dim=2),
                                    lambda t, c, s: original(t, cos=c, sin=s, unsqueeze_dim=2), x, cos, sin)[1:])
    # The op's node (a CppFunction): with k, the output's own (one op with passthrough, of a
    # part of the head or all of it); without k, under the cat: the rewrite's path, not the
    # original's.
    with_k = rewritten(q.requires_grad_(True), k, cos, sin)[0]
    alone = rewritten(x.requires_grad_(True), cos=cos, sin=sin, unsqueeze_dim=2)
    node = lambda t, under_cat: t.grad_fn.next_functions[0][0] if under_cat else t.grad_fn
    result.append([type(node(with_k, False)).__name__ == "CppFunction",
                   type(node(alone, True)).__name__ == "CppFunction"])
table = torch.randn(2, 5, 80)  # too wide: the original runs
result.append(size_error(rewritten, torch.randn(2, 4, 5, 64), cos=table, sin=table))
table = torch.randn(2, 3, 32)  # past the guard: the op's stock path
result.append(size_error(rewritten, torch.randn(2, 5, 4, 64), cos=table, sin=table, unsqueeze_dim=2))
print(json.dumps({"checks": result}))
""")
    assert all(all(check) for check in out["checks"]), out
    assert len(out["checks"]) == 11, out
    assert ("rewrite rotary: transformers.models.qwen4_exp.modeling_qwen4_exp.apply_rotary_pos_emb "
            "(qwen4_exp_partial_rotary)") in log, log


def test_prefix_rotary_replacement_is_the_original_on_cpu():
    """What DINOv3's rewrite computes on CUDA (torchfuse::rotary of the patch tokens as the
    original's split views, tables [patches, head dim] as one batch, then the original's cats),
    checked on CPU, where the op runs HF's composition, against DINOv3's, EoMT-DINOv3's and
    Sapiens 2's originals: bitwise, dtypes and strides, with register tokens and without, bf16
    q with fp32 tables; the rewritten function itself runs the original on CPU."""
    out, _ = run("""
import transformers.models.dinov3_vit.modeling_dinov3_vit as D
import transformers.models.eomt_dinov3.modeling_eomt_dinov3 as E
import transformers.models.sapiens2.modeling_sapiens2 as S
torch.manual_seed(0)
result = []
for module in (D, E, S):
    original = module.apply_rotary_pos_emb.__wrapped__
    for prefix, q_dtype, trig_dtype in ((5, torch.float32, torch.float32), (1, torch.bfloat16, torch.float32),
                                        (0, torch.bfloat16, torch.bfloat16)):
        patches = 16
        q = torch.randn(2, 16 + prefix, 4, 32).transpose(1, 2).to(q_dtype)  # a projection's view
        k = torch.randn(2, 4, 16 + prefix, 32).to(q_dtype)
        cos, sin = torch.randn(patches, 32).to(trig_dtype), torch.randn(patches, 32).to(trig_dtype)
        expected = original(q, k, cos, sin)
        q_prefix, q_patches = q.split((prefix, patches), dim=-2)
        k_prefix, k_patches = k.split((prefix, patches), dim=-2)
        q_embed, k_embed = torch.ops.torchfuse.rotary(q_patches, k_patches, cos.unsqueeze(0), sin.unsqueeze(0), 1, False)
        ours = (torch.cat((q_prefix, q_embed), dim=-2), torch.cat((k_prefix, k_embed), dim=-2))
        result.append(all(torch.equal(a, b) and a.dtype == b.dtype and a.stride() == b.stride()
                          for a, b in zip(ours, expected))
                      and all(torch.equal(a, b) for a, b in zip(module.apply_rotary_pos_emb(q, k, cos, sin), expected)))
print(json.dumps({"rewritten": [hasattr(m.apply_rotary_pos_emb, "__wrapped__") for m in (D, E, S)],
                  "equal": result}))
""")
    assert out == {"rewritten": [True, True, True], "equal": [True] * 9}


def test_half_table_rotary_runs_its_cuda_path_on_cpu_with_the_guard_passed():
    """GPT-OSS's apply_rotary_pos_emb (halves of the head dim, tables of half its size), its
    rewrite's own code past the guard on CPU (`_rotary_call` patched to pass), where
    torchfuse::rotary runs Llama's composition of the tables repeated over both halves: the
    original's outputs bitwise with their dtypes and strides (fp32, bf16 q with fp32 tables,
    heads second or third, a channels-last q), gradients within two of their roundings; tables
    of another size go to the original (which broadcasts a one-wide table); the model's function
    is the rewrite."""
    out, _ = run(ROTARY_CHECKS + ROTARY_GUARD_PASSED + """
import transformers.models.gpt_oss.modeling_gpt_oss as G
original = G.apply_rotary_pos_emb.__wrapped__
rewritten = R._half_table_rotary(torch, original, "gpt_oss_rotary")
torch.manual_seed(0)
result = []
for x_dtype, trig_dtype, dim, half in ((torch.float32, torch.float32, 1, 32), (torch.bfloat16, torch.float32, 1, 32),
                                       (torch.bfloat16, torch.bfloat16, 2, 32), (torch.float32, torch.float32, 1, 1)):
    shape = (2, 4, 5, 64) if dim == 1 else (2, 5, 4, 64)
    q = torch.randn(2, 5, 4, 64).to(x_dtype).transpose(1, 2) if dim == 1 else torch.randn(shape).to(x_dtype)
    k = torch.randn(shape).to(x_dtype)
    cos, sin = torch.randn(2, 5, half).to(trig_dtype), torch.randn(2, 5, half).to(trig_dtype)
    result.append(rotary_checks(rewritten, original, q, k, cos, sin, dim))
# A q laid out channels-last ([B, D, H, S] in memory): the halves of the op's result look
# channels-last too, and the original's cat keeps that layout.
q = torch.randn(2, 5, 8, 4).permute(0, 3, 1, 2)
k = torch.randn(2, 4, 5, 8)
result.append(rotary_checks(rewritten, original, q, k, torch.randn(2, 5, 4), torch.randn(2, 5, 4), 1))
print(json.dumps({"rewritten": hasattr(G.apply_rotary_pos_emb, "__wrapped__"), "checks": result}))
""")
    assert out["rewritten"] is True and all(all(check) for check in out["checks"]), out
    assert len(out["checks"]) == 5, out


def test_single_tensor_rotary_runs_its_cuda_path_on_cpu_with_the_guard_passed():
    """Gemma 4's one-tensor apply_rotary_pos_emb (Gemma 3n's), its rewrite's own code past the
    guard on CPU (`_rotary_call` patched to pass): torchfuse::rotary of x with an empty k along
    the broadcast dim (its CPU kernel is HF's composition) gives the original's output bitwise,
    with its dtype and strides (heads first or second, a transposed view, bf16 x with fp32 cos,
    a negative dim), and x's gradient in x's dtype within two of its roundings of the
    original's; the function in the model's module is the rewrite."""
    out, _ = run(ONE_TENSOR_CHECKS + ROTARY_GUARD_PASSED + """
import transformers.models.gemma4.modeling_gemma4 as G
original = G.apply_rotary_pos_emb.__wrapped__
rewritten = R._single_rotary(torch, original, "hf_single_rotary")
torch.manual_seed(0)
result = []
for x_dtype, trig_dtype, dim, transposed in ((torch.float32, torch.float32, 1, False),
                                             (torch.bfloat16, torch.float32, 1, True),
                                             (torch.bfloat16, torch.bfloat16, 2, False),
                                             (torch.float32, torch.float32, -3, False)):
    shape = (2, 4, 5, 64) if dim in (1, -3) else (2, 5, 4, 64)
    x = torch.randn(shape).to(x_dtype)
    if transposed:
        x = torch.randn(2, 5, 4, 64).to(x_dtype).transpose(1, 2)
    cos, sin = torch.randn(2, 5, 64).to(trig_dtype), torch.randn(2, 5, 64).to(trig_dtype)
    result.append(one_tensor_checks(rewritten, original, x, cos, sin, dim))
print(json.dumps({"rewritten": hasattr(G.apply_rotary_pos_emb, "__wrapped__"), "checks": result}))
""")
    assert out["rewritten"] is True and all(all(check) for check in out["checks"]), out
    assert len(out["checks"]) == 4, out


def test_every_two_rotary_runs_its_cuda_path_on_cpu_with_the_guard_passed():
    """GPT-J's and CodeGen's apply_rotary_pos_emb (the interleaved rotary of one [B, S, H, R]
    tensor, sin and cos of R / 2 given in that order), the rewrite's own code past the guard on
    CPU (`_rotary_call` patched to pass), where torchfuse::rotary(..., interleaved=True) runs
    the interleaved composition: the original's output bitwise with its dtype and strides (the
    rotary slice of a wider head, all of the head, bf16 x with bf16 tables as the model casts
    them, fp32, tables of one batch row broadcast), x's gradient within two of its roundings;
    tables of another size get the original's error; each model's function is rewritten (the
    log says so)."""
    out, log = run(ONE_TENSOR_CHECKS + ROTARY_GUARD_PASSED + """
import transformers.models.gptj.modeling_gptj as J
import transformers.models.codegen.modeling_codegen as C
torch.manual_seed(0)
result = []
for module in (J, C):
    original = module.apply_rotary_pos_emb.__wrapped__
    rewritten = R._every_two_rotary(torch, original, "gptj_rotary")
    for x_dtype, trig_dtype, rotary_dim, batch in ((torch.bfloat16, torch.bfloat16, 16, 2),
                                                   (torch.float32, torch.float32, 64, 2),
                                                   (torch.bfloat16, torch.float32, 64, 2),
                                                   (torch.float32, torch.float32, 32, 1)):
        x = torch.randn(2, 5, 4, 64).to(x_dtype)[:, :, :, :rotary_dim]  # GPT-J's q_rot: a slice of each head
        sin, cos = (torch.randn(batch, 5, rotary_dim // 2).to(trig_dtype) for _ in range(2))
        result.append(one_tensor_checks(rewritten, original, x, sin, cos))
    # Tables of another size than x's rotary dim needs.
    x = torch.randn(2, 5, 4, 64)[:, :, :, :16]
    result.append(size_error(rewritten, x, torch.randn(2, 5, 4), torch.randn(2, 5, 4)))
print(json.dumps({"checks": result}))
""")
    assert all(all(check) for check in out["checks"]), out
    assert len(out["checks"]) == 10, out
    for model in ("gptj", "codegen"):
        assert (f"rewrite rotary: transformers.models.{model}.modeling_{model}.apply_rotary_pos_emb "
                "(gptj_rotary)") in log, log


def test_interleaved_rotary_rewrites_run_their_cuda_path_on_cpu_with_the_guard_passed():
    """The interleaved rotaries' rewrites (GLM-4's partial one, GLM-4V's with its tables as
    given, Cohere's and Ernie 4.5's in fp32, BLT's Llama code with Cohere's rotate_half, Helium's
    with GLM's tables) and NanoChat's sign-flipped one (the op of -sin),
    their own code past the guard on CPU (`_rotary_call` patched to pass), where
    torchfuse::rotary(..., interleaved=True) runs the interleaved composition: the original's
    outputs bitwise with their dtypes and strides (all of the head dim and half of it, bf16 q
    with fp32 cos, heads second or third), and q's and k's gradients within two of their
    roundings of the original's; each model's function is the rewrite."""
    out, _ = run(ROTARY_CHECKS + ROTARY_GUARD_PASSED + """
import transformers.models.glm4.modeling_glm4 as G
import transformers.models.cohere.modeling_cohere as C
import transformers.models.ernie4_5.modeling_ernie4_5 as E
import transformers.models.blt.modeling_blt as B
import transformers.models.nanochat.modeling_nanochat as N
import transformers.models.glm4v.modeling_glm4v as V
import transformers.models.helium.modeling_helium as H
torch.manual_seed(0)
result = []
cases = [(module, R._partial_rotary, form, rotary_dim, x_dtype, trig_dtype, dim)
         for module, form in ((G, "hf_rotary_pairs_partial"), (V, "glm4v_rotary_pairs_partial"))
         for rotary_dim, x_dtype, trig_dtype, dim in ((32, torch.float32, torch.float32, 1), (64, torch.bfloat16, torch.float32, 1),
                                                      (32, torch.bfloat16, torch.bfloat16, 2))]
cases += [(module, R._rotary_cast_back, form, 64, x_dtype, torch.float32, dim)
          for module, form in ((C, "cohere_rotary_pairs_upcast"), (E, "hf_rotary_pairs_upcast"))
          for x_dtype, dim in ((torch.bfloat16, 1), (torch.float32, 2))]
cases += [(module, R._rotary, form, 64, x_dtype, trig_dtype, dim)
          for module, form in ((B, "hf_rotary_pairs"), (N, "hf_rotary_flipped"), (H, "helium_rotary"))
          for x_dtype, trig_dtype, dim in ((torch.bfloat16, torch.float32, 1), (torch.bfloat16, torch.bfloat16, 2))]
for module, make, form, rotary_dim, x_dtype, trig_dtype, dim in cases:
    original = module.apply_rotary_pos_emb.__wrapped__
    rewritten = make(torch, original, form)
    shape = (2, 4, 5, 64) if dim == 1 else (2, 5, 4, 64)
    q, k = torch.randn(shape).to(x_dtype), torch.randn(shape).to(x_dtype)
    cos, sin = torch.randn(2, 5, rotary_dim).to(trig_dtype), torch.randn(2, 5, rotary_dim).to(trig_dtype)
    result.append(rotary_checks(rewritten, original, q, k, cos, sin, dim))
print(json.dumps({"rewritten": [hasattr(m.apply_rotary_pos_emb, "__wrapped__") for m in (G, C, E, B, N, V, H)],
                  "checks": result}))
""")
    assert out["rewritten"] == [True] * 7 and all(all(check) for check in out["checks"]), out
    assert len(out["checks"]) == 16, out


# Each norm rewrite's CUDA replacement, written out, checked on CPU against the class's original
# forward: (transformers model, class, constructor kwargs, (x dtype, weight dtype) pairs, the
# replacement of (norm, x), the float64 reference of (x, weight, eps)). LayerNorm's reference
# centres x first.
NORM_REPLACEMENTS = {
    "llama-16bit-x-fp32-weight": ("llama", "LlamaRMSNorm", {}, [("bfloat16", "float32"), ("float16", "float32")],
                                  "norm.weight * torch.rms_norm(x, (x.shape[-1],), None, 1e-6)", "rms"),
    "gpt_oss": ("gpt_oss", "GptOssRMSNorm", {}, [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")],
                "torch.rms_norm(x.float(), (x.shape[-1],), norm.weight.float(), 1e-6).to(x.dtype)", "rms"),
    "helium": ("helium", "HeliumRMSNorm", {}, [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")],
               "torch.rms_norm(x.float(), (x.shape[-1],), norm.weight.float(), 1e-6).to(x.dtype)", "rms"),
    "gemma4": ("gemma4", "Gemma4RMSNorm", {}, [("float32", "float32"), ("bfloat16", "float32")],
               "torch.rms_norm(x.float(), (x.shape[-1],), norm.weight.float(), 1e-6).type_as(x)", "rms"),
    "gemma4-without-scale": ("gemma4", "Gemma4RMSNorm", {"with_scale": False}, [("float32", None), ("bfloat16", None)],
                             "torch.rms_norm(x.float(), (x.shape[-1],), None, 1e-6).type_as(x)", "rms"),
    "cohere": ("cohere", "CohereLayerNorm", {}, [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")],
               "torch.layer_norm(x.float(), (x.shape[-1],), norm.weight.float(), None, 1e-6).to(x.dtype)", "layer"),
    "llama4-16bit-x-fp32-weight": ("llama4", "Llama4TextRMSNorm", {}, [("bfloat16", "float32"), ("float16", "float32")],
                                   "norm.weight * torch.rms_norm(x, (x.shape[-1],), None, 1e-6)", "rms"),
    "moshi": ("moshi", "MoshiRMSNorm", {}, [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")],
              "torch.rms_norm(x.float(), (x.shape[-1],), norm.weight.float(), 1e-6).type_as(x)", "rms"),
    "weightless": ("hrm_text", "HrmTextRMSNorm", {}, [("float32", None), ("bfloat16", None), ("float16", None)],
                   "torch.rms_norm(x.float(), (x.shape[-1],), None, 1e-6).type_as(x)", "rms"),
    "unweighted": ("deepseek_v4", "DeepseekV4UnweightedRMSNorm", {}, [("float32", None), ("bfloat16", None),
                                                                      ("float16", None)],
                   "torch.rms_norm(x, (x.shape[-1],), None, 1e-6)", "rms"),
}

# A norm class of `width` features: most take the width first, the weightless ones eps only.
MAKE_NORM = """
import inspect
def make_norm(cls, width, **kwargs):
    takes_width = list(inspect.signature(cls.__init__).parameters)[1] != "eps"
    return cls(*([width] if takes_width else []), eps=1e-6, **kwargs)
"""


@pytest.mark.parametrize("name", sorted(NORM_REPLACEMENTS))
def test_norm_replacements_are_their_arithmetic_on_cpu(name):
    """What each norm rewrite calls on CUDA (aten::rms_norm or layer_norm of x, mostly x.float()
    with the weight in fp32, then the original's cast), on CPU against the class's original
    forward and float64: the output dtype and the gradients' dtypes equal the original's, the
    value and the gradients to x and the weight within max(2 x the original's error, the
    dtype's floor); heads transposed out of a projection keep the original's strides
    (`_row_wise`)."""
    model, cls, kwargs, dtype_pairs, replacement, reference = NORM_REPLACEMENTS[name]
    out, _ = run(MAKE_NORM + f"""
from transformers.models.{model}.modeling_{model} import {cls} as Norm
from torchfuse.rewrites import _row_wise
torch.manual_seed(0)
original_forward = Norm.forward.__wrapped__
def replacement(norm, x):
    return {replacement}
def reference(x, w):
    if {reference!r} == "layer":
        x = x - x.mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
def err(a, b):
    return ((a.double() - b).norm() / b.norm()).item()
result = {{}}
for x_name, w_name in {dtype_pairs!r}:
    norm = make_norm(Norm, 96, **{kwargs!r})
    weight = getattr(norm, "weight", None)
    if weight is not None:
        with torch.no_grad():
            weight.copy_(1 + 0.1 * torch.randn(96))
        norm = norm.to(getattr(torch, w_name))
        weight = norm.weight
    x = (torch.randn(5, 7, 96) * 3 + 1).to(getattr(torch, x_name)).requires_grad_(True)
    leaves = (x,) if weight is None else (x, weight)
    original, ours = original_forward(norm, x), replacement(norm, x)
    x64 = x.detach().double().requires_grad_(True)
    w64 = (torch.ones(96) if weight is None else weight.detach()).double().requires_grad_(weight is not None)
    ref = reference(x64, w64)
    g = torch.randn_like(ref)
    grads = [torch.autograd.grad(y, leaves, g.to(y.dtype)) for y in (original, ours)]
    ref_grads = torch.autograd.grad(ref, (x64, w64)[:len(leaves)], g)
    case = {{"dtypes": [str(original.dtype), str(ours.dtype)],
            "grad_dtypes": [[str(t.dtype) for t in gs] for gs in grads],
            "value": [err(original, ref), err(ours, ref)]}}
    for i, key in enumerate(("dx", "dw")[:len(leaves)]):
        case[key] = [err(grads[0][i], ref_grads[i]), err(grads[1][i], ref_grads[i])]
    result[f"{{x_name}}/{{w_name}}"] = case
norm = make_norm(Norm, 64, **{kwargs!r}).to(torch.bfloat16)
x = torch.randn(2, 9, 4, 64).to(torch.bfloat16).transpose(1, 2)
result["transposed"] = _row_wise(x, lambda rows: replacement(norm, rows)).stride() == original_forward(norm, x).stride()
print(json.dumps(result))
""")
    assert out.pop("transposed") is True
    assert len(out) == len(dtype_pairs), out
    floors = {"torch.float32": 1e-5, "torch.bfloat16": 8e-3, "torch.float16": 1e-3}
    for case, r in out.items():
        assert r["dtypes"][0] == r["dtypes"][1] and r["grad_dtypes"][0] == r["grad_dtypes"][1], (case, r)
        floor = max(floors["torch." + case.split("/")[0]], floors[r["dtypes"][0]])
        for key in ("value", "dx", "dw"):
            if key in r:
                original, replacement = r[key]
                assert replacement <= max(2 * original, floor), (case, key, r[key])


def test_norm_rewrites_run_their_cuda_path_on_cpu_with_the_guard_passed():
    """The norm rewrites' own code past their guard (the call shape a CUDA x takes), run on CPU
    with `_norm_call` patched to pass: each calls its aten norm once (a counting wrapper) and
    returns the original's dtype and strides, and values within the dtype's rounding of it;
    the weight's and x's gradients flow. Catches what the arithmetic checks above, which write
    the replacement out, cannot: the rewrite's attribute names, branches and casts."""
    out, _ = run(MAKE_NORM + """
import functools
calls = {"rms_norm": 0, "layer_norm": 0}
def counted(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return wrapper
torch.rms_norm, torch.layer_norm = counted("rms_norm", torch.rms_norm), counted("layer_norm", torch.layer_norm)
import torchfuse.rewrites as R
R._norm_call = lambda torch, original, dependencies=None: (lambda *args, **kwargs: True)
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
from transformers.models.helium.modeling_helium import HeliumRMSNorm
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
from transformers.models.cohere.modeling_cohere import CohereLayerNorm
from transformers.models.moshi.modeling_moshi import MoshiRMSNorm
from transformers.models.llama4.modeling_llama4 import Llama4TextRMSNorm
from transformers.models.hrm_text.modeling_hrm_text import HrmTextRMSNorm
from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaWeightlessRMSNorm
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4UnweightedRMSNorm
cases = [("llama", LlamaRMSNorm, R._rms_norm_forward, "hf_rms_norm", {}, "bfloat16", "float32", "rms_norm"),
         ("gpt_oss", GptOssRMSNorm, R._gpt_oss_rms_norm_forward, "gpt_oss_rms_norm", {}, "bfloat16", "float32", "rms_norm"),
         ("helium", HeliumRMSNorm, R._gpt_oss_rms_norm_forward, "helium_rms_norm", {}, "bfloat16", "bfloat16", "rms_norm"),
         ("gemma4", Gemma4RMSNorm, R._gemma4_rms_norm_forward, "gemma4_rms_norm", {}, "bfloat16", "float32", "rms_norm"),
         ("gemma4-without-scale", Gemma4RMSNorm, R._gemma4_rms_norm_forward, "gemma4_rms_norm", {"with_scale": False},
          "bfloat16", None, "rms_norm"),
         ("cohere", CohereLayerNorm, R._cohere_layer_norm_forward, "cohere_layer_norm", {}, "bfloat16", "float32",
          "layer_norm"),
         ("llama4", Llama4TextRMSNorm, R._llama4_rms_norm_forward, "llama4_rms_norm", {}, "bfloat16", "float32",
          "rms_norm"),
         ("moshi", MoshiRMSNorm, R._fp32_own_norm_forward, "moshi_rms_norm", {}, "bfloat16", "float32", "rms_norm"),
         ("hrm_text", HrmTextRMSNorm, R._fp32_own_norm_forward, "fp32_rms_norm_weightless", {}, "bfloat16", None,
          "rms_norm"),
         # Its unused weight buffer (ones) is not read.
         ("falcon_mamba", FalconMambaWeightlessRMSNorm, R._fp32_own_norm_forward, "fp32_rms_norm_weightless", {},
          "bfloat16", None, "rms_norm"),
         ("deepseek_v4", DeepseekV4UnweightedRMSNorm, R._unweighted_rms_norm_forward, "unweighted_rms_norm", {},
          "bfloat16", None, "rms_norm")]
result = {}
torch.manual_seed(0)
for name, cls, factory, form, kwargs, x_name, w_name, op in cases:
    original_forward = cls.forward.__wrapped__
    rewritten = factory(torch, original_forward, form)
    norm = make_norm(cls, 64, **kwargs)
    if w_name is not None:
        norm = norm.to(getattr(torch, w_name))
    x = (torch.randn(2, 9, 4, 64) + 0.5).to(getattr(torch, x_name)).transpose(1, 2).detach().requires_grad_(True)
    before = calls[op]
    ours, original = rewritten(norm, x), original_forward(norm, x)
    tol = 1e-5 if ours.dtype == torch.float32 and x.dtype == torch.float32 else 2e-2
    ours.float().sum().backward()
    result[name] = {"calls": calls[op] - before, "dtype": ours.dtype == original.dtype,
                    "strides": ours.stride() == original.stride(),
                    "close": torch.allclose(ours.float(), original.float(), rtol=tol, atol=tol),
                    "grads": x.grad is not None and all(p.grad is not None for p in norm.parameters())}
print(json.dumps(result))
""")
    assert set(out) == {"llama", "gpt_oss", "helium", "gemma4", "gemma4-without-scale", "cohere", "llama4", "moshi",
                        "hrm_text", "falcon_mamba", "deepseek_v4"}, out
    for name, r in out.items():
        assert r == {"calls": 1, "dtype": True, "strides": True, "close": True, "grads": True}, (name, r)


def test_a_weighted_own_norm_without_its_weight_raises_the_originals_error():
    """Moshi's and Gemma 4's (scaled) norms with their weight set to None, past the guard: the
    rewrite runs the original, which raises its own error, rather than a weightless norm."""
    out, _ = run("""
import torchfuse.rewrites as R
R._norm_call = lambda torch, original, dependencies=None: (lambda *args, **kwargs: True)
from transformers.models.moshi.modeling_moshi import MoshiRMSNorm
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
result = {}
for cls, form, factory in ((MoshiRMSNorm, "moshi_rms_norm", R._fp32_own_norm_forward),
                           (Gemma4RMSNorm, "gemma4_rms_norm", R._gemma4_rms_norm_forward)):
    original = cls.forward.__wrapped__
    norm = cls(64)
    norm.weight = None
    errors = []
    for fn in (factory(torch, original, form), original):
        try:
            fn(norm, torch.randn(3, 64))
            errors.append(None)
        except Exception as e:
            errors.append(type(e).__name__)
    result[cls.__name__] = errors
print(json.dumps(result))
""")
    assert out == {"MoshiRMSNorm": ["AttributeError"] * 2, "Gemma4RMSNorm": ["AttributeError"] * 2}, out


@pytest.mark.parametrize("module_name, cls, config, form, act", [
    ("llama4", "Llama4TextMLP", "Llama4TextConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, "
     "num_key_value_heads=4)", "llama4_gated_mlp", "silu"),
    ("t5gemma", "T5GemmaMLP", "T5GemmaModuleConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, "
     "num_key_value_heads=4, head_dim=16, dropout_rate=0.1)", "t5gemma_gated_mlp", "gelu_tanh"),
    ("t5gemma2", "T5Gemma2MLP", "models.t5gemma2.configuration_t5gemma2.T5Gemma2TextConfig(hidden_size=64, "
     "intermediate_size=96, num_attention_heads=4, num_key_value_heads=4, head_dim=16, dropout_rate=0.1)",
     "t5gemma_gated_mlp", "gelu_tanh"),
    ("seed_oss", "SeedOssMLP", "SeedOssConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, "
     "num_key_value_heads=4, head_dim=16, residual_dropout=0.1, mlp_bias=True)", "seed_oss_gated_mlp", "silu"),
    ("gemma3n", "Gemma3nTextMLP", "Gemma3nTextConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, "
     "num_key_value_heads=4, head_dim=16, num_hidden_layers=1, activation_sparsity_pattern=[0.95])",
     "gemma3n_gated_mlp", "gelu_tanh"),
    # Gemma 3n's dense layers (sparsity 0: `_gaussian_topk` not called, which would give inf there).
    ("gemma3n", "Gemma3nTextMLP", "Gemma3nTextConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, "
     "num_key_value_heads=4, head_dim=16, num_hidden_layers=1, activation_sparsity_pattern=[0.0])",
     "gemma3n_gated_mlp", "gelu_tanh"),
    ("recurrent_gemma", "RecurrentGemmaMlp", "RecurrentGemmaConfig(hidden_size=64, intermediate_size=96, "
     "num_attention_heads=4, num_key_value_heads=4)", "recurrent_gemma_gated_mlp", "gelu_tanh"),
    ("falcon_h1", "FalconH1MLP", "FalconH1Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, "
     "num_key_value_heads=4, head_dim=16, mlp_multipliers=[0.5, 3.0])", "falcon_h1_gated_mlp", "silu"),
    # A limit the projections' outputs cross, so that the clamps change them.
    ("deepseek_v4", "DeepseekV4MLP", "DeepseekV4Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, "
     "num_key_value_heads=4, head_dim=16, swiglu_limit=0.3)", "deepseek_v4_clamped_gated_mlp", "silu"),
    ("glm5_next", "Glm5NextTextMLP", "Glm5NextTextConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, "
     "num_key_value_heads=4, head_dim=16, swiglu_limit=0.3)", "glm5_clamped_gated_mlp", "silu"),
])
def test_gated_mlp_forms_rewrites_run_their_cuda_path_on_cpu_with_the_guard_passed(module_name, cls, config, form, act):
    """Llama 4's gated MLP (its activation named activation_fn), T5Gemma's (a dropout of the
    product before down_proj), Seed-OSS's (F.dropout of its output; biases), Gemma 3n's (its
    gate's top activations kept first: sparsity 0.95, and its dense layers), RecurrentGemma's,
    Falcon-H1's (multipliers on the gate and the output) and DeepSeek-V4's and GLM-5-next's
    (gate and up clamped), the dropouts live
    here (p = 0.1 in training), the rewrite's own code past the
    guard on CPU (`_gated_mlp_call` patched to name the activation), in training and in eval:
    the original is not called, the rewrite's op is (its autograd node in the output's graph;
    its CPU kernel is the original's composition), and the output and every gradient are
    bitwise the original's, the dropout drawing the same mask from the same seed."""
    out, _ = run(GRAPH_NODES + f"""
import inspect
import transformers
import torchfuse.rewrites as R
R._gated_mlp_call = lambda torch, original, dependencies=None: (lambda x, act: {act!r})
from transformers.models.{module_name}.modeling_{module_name} import {cls} as MLP
original_forward = inspect.unwrap(MLP.forward)  # HF's code: past the rewrite and shared_cast's wrapper
original_calls = []
def counted_original(self, *args, **kwargs):
    original_calls.append(1)
    return original_forward(self, *args, **kwargs)
rewritten = R._gated_mlp_forward(torch, counted_original, {form!r})
torch.manual_seed(0)
mlp = MLP(transformers.{config})
x = torch.randn(3, 5, 64)
out = {{}}
for training in (True, False):
    mlp.train(training)
    results, ops = [], []
    for fn in (rewritten, original_forward):
        mlp.zero_grad()
        xi = x.clone().requires_grad_(True)
        torch.manual_seed(1)
        y = fn(mlp, xi)
        ops.append("CppFunction" in graph_nodes(y.grad_fn))
        y.square().sum().backward()
        results.append([y.detach(), xi.grad] + [p.grad.clone() for p in mlp.parameters()])
    out["train" if training else "eval"] = {{"equal": [torch.equal(a, b) for a, b in zip(*results)], "ops": ops}}
out["original_calls"] = len(original_calls)
out["dropout"] = getattr(getattr(mlp, "dropout", None), "p", getattr(mlp, "residual_dropout", None))
print(json.dumps(out))
""")
    dropout = 0.1 if form in ("t5gemma_gated_mlp", "seed_oss_gated_mlp") else None
    biased = form in ("seed_oss_gated_mlp", "recurrent_gemma_gated_mlp")
    parameters = 8 if biased else 5  # y, x's gradient, then each parameter's
    mode = {"equal": [True] * parameters, "ops": [True, False]}  # the op in the rewrite's graph only
    assert out == {"train": mode, "eval": mode, "original_calls": 0, "dropout": dropout}, out


def test_olmo_and_modernbert_rotary_replacements_are_their_arithmetic_on_cpu():
    """What the OLMo and ModernBERT rotary rewrites call on CUDA, checked on CPU against the
    originals: torchfuse::rotary (HF's composition on CPU) cast back, bitwise (ModernBERT's only
    where cos is fp32, as the rewrite takes it); the rewritten functions themselves run the
    originals on CPU."""
    out, _ = run("""
import transformers.models.olmo2.modeling_olmo2 as O
import transformers.models.modernbert.modeling_modernbert as MB
torch.manual_seed(0)
rotary = [hasattr(O.apply_rotary_pos_emb, "__wrapped__"), hasattr(MB.apply_rotary_pos_emb, "__wrapped__")]
original = O.apply_rotary_pos_emb.__wrapped__
for q_dtype, trig_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)):
    q, k = torch.randn(2, 4, 5, 64).to(q_dtype), torch.randn(2, 2, 5, 64).to(q_dtype)
    cos, sin = torch.randn(2, 5, 64).to(trig_dtype), torch.randn(2, 5, 64).to(trig_dtype)
    expected = original(q, k, cos, sin)
    q_embed, k_embed = torch.ops.torchfuse.rotary(q, k, cos, sin, 1)
    ours = (q_embed.to(q.dtype), k_embed.to(k.dtype))
    rotary.append(all(torch.equal(a, b) and a.dtype == b.dtype == q_dtype for a, b in zip(ours, expected))
                  and all(torch.equal(a, b) for a, b in zip(O.apply_rotary_pos_emb(q, k, cos, sin), expected)))
q, k = torch.randn(2, 4, 5, 64).to(torch.bfloat16), torch.randn(2, 2, 5, 64)
cos, sin = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
q_embed, k_embed = torch.ops.torchfuse.rotary(q, k, cos, sin, 1)
rotary.append([t.dtype for t in original(q, k, cos, sin)] == [q_embed.to(q.dtype).dtype, k_embed.to(k.dtype).dtype])
upcast = MB.apply_rotary_pos_emb.__wrapped__
rotary.append([t.dtype for t in upcast(q, k, cos, sin)] == [torch.bfloat16, torch.bfloat16])
q, k = torch.randn(2, 4, 5, 64).to(torch.bfloat16), torch.randn(2, 2, 5, 64).to(torch.bfloat16)
cos, sin = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
q_embed, k_embed = torch.ops.torchfuse.rotary(q, k, cos, sin, 1)
rotary.append(all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip((q_embed, k_embed), upcast(q, k, cos, sin)))
              and all(torch.equal(a, b) for a, b in zip(MB.apply_rotary_pos_emb(q, k, cos, sin), upcast(q, k, cos, sin))))
print(json.dumps(rotary))
""")
    assert out == [True] * 8


# What a child process runs first for a norm rewrite's CUDA path on CPU: torch.rms_norm counted
# in calls[0], and the norm rewrites' guard (_norm_call) passing.
PAST_THE_NORM_GUARD = """
import functools
calls = [0]
def counted(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        calls[0] += 1
        return fn(*args, **kwargs)
    return wrapper
torch.rms_norm = counted(torch.rms_norm)
import torchfuse.rewrites as R
R._norm_call = lambda torch, original, dependencies=None: (lambda *args, **kwargs: True)
"""


def test_mamba_gated_rms_norm_runs_its_cuda_path_on_cpu_with_the_guard_passed():
    """Mamba 2's gated RMSNorm (Bamba's, Granite 4's) rewritten, its code past the guard run on
    CPU (`_norm_call` patched to pass): one aten rms_norm call, the original's dtype and strides,
    values within rounding of the original and float64, with and without a gate, a bf16 x with
    an fp32 weight (autocast's form) and all bf16; the gradients of x, the gate and the weight
    flow. The classes are rewritten after enable()."""
    out, _ = run(PAST_THE_NORM_GUARD + """
from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated
from transformers.models.bamba.modeling_bamba import BambaRMSNormGated
import transformers.models.granitemoehybrid.modeling_granitemoehybrid as G
result = {"rewritten": all(hasattr(c.forward, "__wrapped__")
                           for c in (MambaRMSNormGated, BambaRMSNormGated, G.GraniteMoeHybridRMSNormGated))}
original = MambaRMSNormGated.forward.__wrapped__
rewritten = R._mamba_gated_rms_norm_forward(torch, original, "mamba_rms_norm_gated")
torch.manual_seed(0)
for w_name in ("float32", "bfloat16"):
    for gated in (True, False):
        norm = MambaRMSNormGated(96, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(96))
        norm = norm.to(getattr(torch, w_name))
        x = (3 * torch.randn(5, 7, 96)).to(torch.bfloat16).requires_grad_(True)
        gate = (2 * torch.randn(5, 7, 96)).to(torch.bfloat16).requires_grad_(True) if gated else None
        before = calls[0]
        ours = rewritten(norm, x, gate)
        n = calls[0] - before
        theirs = original(norm, x, gate)
        x64 = x.detach().double()
        if gated:
            x64 = x64 * torch.nn.functional.silu(gate.detach().double())
        ref = norm.weight.detach().double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6))
        err = lambda t: ((t.double() - ref).norm() / ref.norm()).item()
        leaves = [x, norm.weight] + ([gate] if gated else [])
        g_ours = torch.autograd.grad(ours.float().square().sum(), leaves)
        g_theirs = torch.autograd.grad(theirs.float().square().sum(), leaves)
        result[f"{w_name}/{gated}"] = {
            "calls": n, "dtype": ours.dtype == theirs.dtype, "strides": ours.stride() == theirs.stride(),
            "close": err(ours) <= max(2 * err(theirs), 8e-3),
            "grads": all(((a.double() - b.double()).norm() / b.double().norm()).item() < 2e-2
                         for a, b in zip(g_ours, g_theirs))}
print(json.dumps(result))
""")
    assert out.pop("rewritten") is True
    assert out == {k: {"calls": 1, "dtype": True, "strides": True, "close": True, "grads": True} for k in out}, out
    assert len(out) == 4


def test_qwen3_next_gated_rms_norm_runs_its_cuda_path_on_cpu_with_the_guard_passed():
    """Qwen3-Next's gated RMSNorm (Qwen3.5's, OLMo-Hybrid's) rewritten, its code past the guard
    run on CPU (`_norm_call` patched to pass; a bf16 x with an fp32 weight, the form aten's
    rms_norm without a weight serves there): one rms_norm call, the original's dtype and strides,
    values and the gradients of x, the gate and the weight within rounding of the original; an
    activation other than "silu", a global forward hook (which would see ACT2FN's module) and
    an ACT2FN whose "silu" is another class run the original."""
    out, _ = run(PAST_THE_NORM_GUARD + """
import transformers.activations as A
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated
result = {"rewritten": all(hasattr(c.forward, "__wrapped__") for c in (Qwen3NextRMSNormGated, Qwen3_5RMSNormGated))}
original = Qwen3NextRMSNormGated.forward.__wrapped__
rewritten = R._norm_then_gate_forward(torch, original, "qwen3_next_rms_norm_gated")
torch.manual_seed(0)
norm = Qwen3NextRMSNormGated(96, eps=1e-6)
with torch.no_grad():
    norm.weight.copy_(1 + 0.1 * torch.randn(96))
x = (3 * torch.randn(5, 7, 96)).to(torch.bfloat16).requires_grad_(True)
gate = (2 * torch.randn(5, 7, 96)).to(torch.bfloat16).requires_grad_(True)
def served():
    before = calls[0]
    ours = rewritten(norm, x, gate)
    return ours, calls[0] - before
ours, n = served()
theirs = original(norm, x, gate)
leaves = [x, gate, norm.weight]
rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
g_ours = torch.autograd.grad(ours.float().square().sum(), leaves)
g_theirs = torch.autograd.grad(theirs.float().square().sum(), leaves)
result["served"] = {"calls": n, "dtype": ours.dtype == theirs.dtype, "strides": ours.stride() == theirs.stride(),
                    "close": rel(ours, theirs) < 1e-2, "grads": all(rel(a, b) < 2e-2 for a, b in zip(g_ours, g_theirs))}
norm.activation = "sigmoid"
result["sigmoid"] = [served()[1], torch.equal(rewritten(norm, x, gate), original(norm, x, gate))]
norm.activation = "silu"
handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
result["hooked"] = served()[1]
handle.remove()
silu = A.ACT2FN.data["silu"] if hasattr(A.ACT2FN, "data") else dict.get(A.ACT2FN, "silu")
class OtherSiLU(torch.nn.Module):
    def forward(self, input):
        return torch.nn.functional.silu(input) * 2
dict.__setitem__(A.ACT2FN, "silu", OtherSiLU)
result["other_act"] = [served()[1], torch.equal(rewritten(norm, x, gate), original(norm, x, gate))]
dict.__setitem__(A.ACT2FN, "silu", silu)
result["back"] = served()[1]
print(json.dumps(result))
""")
    assert out == {"rewritten": True, "served": {"calls": 1, "dtype": True, "strides": True, "close": True,
                                                 "grads": True},
                   "sigmoid": [0, True], "hooked": 0, "other_act": [0, True], "back": 1}, out


def test_t5s_rms_norm_replacement_is_its_arithmetic_on_cpu():
    """What the T5 rewrite calls on CUDA, checked on CPU against T5LayerNorm's original forward
    and float64: with an fp32 weight, aten::rms_norm of x.float() (fp32 out, for fp32 and bf16
    x); with a bf16 weight and bf16 x, torchfuse::hf_rms_norm (Llama's composition: x rounded
    to bf16 after the fp32 norm, then times the weight). Values, dtypes, both gradients."""
    out, _ = run("""
from transformers.models.t5.modeling_t5 import T5LayerNorm
torch.manual_seed(0)
result = {}
for x_dtype, w_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)):
    norm = T5LayerNorm(96, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(96))
    norm = norm.to(w_dtype)
    x = (torch.randn(5, 7, 96) * 3).to(x_dtype).requires_grad_(True)
    original = T5LayerNorm.forward.__wrapped__(norm, x)
    if w_dtype == torch.float32:
        replacement = torch.rms_norm(x.float(), (96,), norm.weight, 1e-6)
    else:
        replacement = torch.ops.torchfuse.hf_rms_norm(x, norm.weight, 1e-6)
    x64 = x.detach().double().requires_grad_(True)
    w64 = norm.weight.detach().double().requires_grad_(True)
    ref = w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6))
    g = torch.randn_like(ref)
    grads = [torch.autograd.grad(y, (x, norm.weight), g.to(y.dtype)) for y in (original, replacement)]
    ref_grads = torch.autograd.grad(ref, (x64, w64), g)
    def err(a, b):
        return ((a.double() - b).norm() / b.norm()).item()
    result[f"{x_dtype}/{w_dtype}"] = {
        "dtypes": [str(original.dtype), str(replacement.dtype)],
        "value": [err(original, ref), err(replacement, ref)],
        "dx": [err(grads[0][0], ref_grads[0]), err(grads[1][0], ref_grads[0])],
        "dw": [err(grads[0][1], ref_grads[1]), err(grads[1][1], ref_grads[1])],
        "cpu_is_original": torch.equal(norm(x), original)}
# Idefics' q/k norms (T5's form) take heads transposed out of the projection: normalised as
# they lie in memory and permuted back, the original's strides and forward values.
from torchfuse.rewrites import _row_wise
norm = T5LayerNorm(64, eps=1e-6).to(torch.bfloat16)
x = torch.randn(2, 9, 4, 64).to(torch.bfloat16).transpose(1, 2)
ours = _row_wise(x, lambda rows: torch.ops.torchfuse.hf_rms_norm(rows, norm.weight, 1e-6))
original = T5LayerNorm.forward.__wrapped__(norm, x)
result["transposed"] = [ours.stride() == original.stride(), torch.equal(ours, original),
                        _row_wise(torch.randn(1, 64).expand(3, 64), lambda rows: rows) is None]
print(json.dumps(result))
""")
    assert out.pop("transposed") == [True, True, True]
    floors = {"torch.float32": 1e-5, "torch.bfloat16": 8e-3}
    for case, r in out.items():
        assert r["dtypes"][0] == r["dtypes"][1] and r["cpu_is_original"], (case, r)
        for key in ("value", "dx", "dw"):
            original, replacement = r[key]
            assert replacement <= max(2 * original, floors[r["dtypes"][0]]), (case, key, r[key])


def test_moe_experts_gate_rewritten_and_its_cuda_path_on_cpu():
    """HF's default MoE experts gate (transformers.integrations.moe._default_apply_gate), which
    every experts class takes as `_apply_gate`: rewritten, and taken by the experts classes
    whether their module was imported after `enable()` (Mixtral, here) or before it (the second
    process). Past its guard (`_gated_mlp_call` patched to pass, the call shape a CUDA tensor
    takes), on CPU: a SiLU act_fn goes to torchfuse::silu_mul_packed (whose CPU kernel is the
    composition: bitwise the original, values and gradient), a tanh-GELU act_fn and an odd width
    (the original's error) run the original."""
    out, _ = run("""
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
import transformers.integrations.moe as moe
import transformers.models.mixtral.modeling_mixtral as M
import torchfuse.rewrites as R
from transformers.activations import ACT2FN
result = {"rewritten": hasattr(moe._default_apply_gate, "__wrapped__"),
          "taken": M.MixtralExperts._apply_gate is moe._default_apply_gate}
class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))
R._gated_mlp_call = lambda torch, original, dependencies=None: (
    lambda x, act: {"SiLUActivation": "silu", "GELUTanh": "gelu_tanh"}.get(type(act).__name__))
original = moe._default_apply_gate.__wrapped__
gate = R._moe_apply_gate(torch, original, "hf_moe_apply_gate")
torch.manual_seed(0)
for act_name, width in (("silu", 128), ("gelu_pytorch_tanh", 128), ("silu", 127)):
    experts = torch.nn.Module()
    experts.act_fn = ACT2FN[act_name]
    x = torch.randn(5, width).to(torch.bfloat16).requires_grad_(True)
    outcome = {}
    for name, fn in (("ours", gate), ("theirs", original)):
        with Ops() as ops:
            try:
                y = fn(experts, x)
            except RuntimeError as e:  # an odd width: chunk's halves do not broadcast
                outcome[name] = ("error", str(e), False)
                continue
        (g,) = torch.autograd.grad(y.float().sum(), x)
        outcome[name] = (y, g, any("silu_mul_packed" in n for n in ops.names))
    (a, ga, op), (b, gb, _) = outcome["ours"], outcome["theirs"]
    same = (a, ga) == (b, gb) if isinstance(a, str) else (torch.equal(a, b) and a.dtype == b.dtype and a.stride() == b.stride()
                                               and torch.equal(ga, gb))
    result[f"{act_name}/{width}"] = {"op": op, "same": same}
print(json.dumps(result))
""")
    assert out.pop("rewritten") is True and out.pop("taken") is True
    assert out == {"silu/128": {"op": True, "same": True}, "gelu_pytorch_tanh/128": {"op": False, "same": True},
                   "silu/127": {"op": False, "same": True}}, out


def test_experts_imported_before_enable_take_the_rewritten_gate():
    proc = check(run_python(f"""
import json
import transformers.models.qwen3_moe.modeling_qwen3_moe as Q
import transformers.integrations.moe as moe
before = Q.Qwen3MoeExperts._apply_gate is moe._default_apply_gate
import torch, torchfuse
torchfuse.enable({str(LIB_DIR)!r})
print(json.dumps([before, hasattr(moe._default_apply_gate, "__wrapped__"),
                  Q.Qwen3MoeExperts._apply_gate is moe._default_apply_gate]))
""", PYTHONPATH=ROOT / "python"))
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True, True, True]


KV_CACHE = """
import transformers.cache_utils as C
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
torch.manual_seed(0)
sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128)
# Mistral with a window shorter than the sequence: its cache layers are sliding-window ones.
model = (LlamaForCausalLM(LlamaConfig(**sizes)) if {sliding} is None
         else MistralForCausalLM(MistralConfig(sliding_window={sliding}, **sizes)))
ids = torch.randint(0, 128, (2, 16))
out = model(input_ids=ids, labels=ids)
layer = out.past_key_values.layers[0]
cls = type(layer)
original = cls.update.__wrapped__ if hasattr(cls.update, "__wrapped__") else None
# the same forward with the original update (on CPU the rewrite runs the original's cats, and
# its own code around them)
if original is not None:
    rewritten, cls.update = cls.update, original
    again = model(input_ids=ids, labels=ids)
    cls.update = rewritten
    same = (torch.equal(out.loss, again.loss)
            and all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                    for a, b in zip(out.past_key_values.layers, again.past_key_values.layers)))
else:
    same = None
print(json.dumps({{"rewritten": original is not None, "same": same, "layer": cls.__name__,
                  "keys": list(layer.keys.shape)}}))
"""


@pytest.mark.parametrize("sliding", [None, 8], ids=["dynamic", "sliding_window"])
def test_the_kv_cache_update_is_rewritten_where_its_toggle_is_on_and_runs_the_original_on_cpu(sliding):
    layer, form = (("DynamicLayer", "hf_dynamic_layer_update") if sliding is None
                   else ("DynamicSlidingWindowLayer", "hf_dynamic_sliding_window_layer_update"))
    # The window keeps its last sliding - 1 tokens.
    keys = [2, 2, 16 if sliding is None else sliding - 1, 16]
    out, log = run(KV_CACHE.format(sliding=sliding))
    assert out == {"rewritten": True, "same": True, "layer": layer, "keys": keys}, out
    assert (f"rewrite kv_cache: transformers.cache_utils.{layer}.update ({form}) -> "
            "torch.ops.torchfuse.kv_copy on the first append") in log
    off, log = run(KV_CACHE.format(sliding=sliding), TORCHFUSE_OPS="-kv_cache")
    assert off == {"rewritten": False, "same": None, "layer": layer, "keys": keys}, off
    assert f"rewrite kv_cache off: transformers.cache_utils.{layer}.update" in log


def test_kv_copy_is_the_first_appends_cat():
    """torchfuse::kv_copy against `torch.cat([cache, x], dim=-2)` of HF's lazily made empty cache,
    in the layouts and dtypes the rewrite passes: GPT-2's K and V (strided views of one packed
    projection), an fp32 K after HF's rotary with a bf16 V (cat promotes V to the cache's fp32),
    a dense permuted V, a channels-last K and a K of one head (cat makes them row-major where
    clone would keep their strides), a frozen K with a V that needs grad (LoRA on v_proj): the same
    values, dtypes, strides and requires_grad, fresh storage, and the same gradients from both
    outputs and from each alone (None where stock gives None)."""
    out, _ = run("""
ops = torch.ops.torchfuse
def same_grads(want, got, leaves, grads):
    if not leaves:
        return True
    for outs in ((0, 1), (0,), (1,)):
        pairs = [(want[i], got[i], grads[i]) for i in outs if want[i].requires_grad]
        if not pairs:
            continue
        w, g, dy = zip(*pairs)
        dw = torch.autograd.grad(w, leaves, dy, retain_graph=True, allow_unused=True)
        dg = torch.autograd.grad(g, leaves, dy, retain_graph=True, allow_unused=True)
        if not all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                   for a, b in zip(dw, dg)):
            return False
    return True
def case(key, value):
    caches = [torch.tensor([], dtype=key.dtype), torch.tensor([], dtype=key.dtype)]
    want = [torch.cat([c, x], dim=-2) for c, x in zip(caches, (key, value))]
    got = ops.kv_copy(key, value, *[torch.promote_types(c.dtype, x.dtype) for c, x in zip(caches, (key, value))])
    grads = [torch.randn_like(w) for w in want]
    leaves = [t for t in (key, value) if t.requires_grad]
    return all(torch.equal(a, b) and a.dtype == b.dtype and a.stride() == b.stride()
               and a.requires_grad == b.requires_grad for a, b in zip(want, got)) and all(
        g.data_ptr() not in (key.data_ptr(), value.data_ptr()) for g in got) and same_grads(want, got, leaves, grads)
g = torch.Generator().manual_seed(0)
qkv = torch.randn(2, 8, 3 * 3 * 4, generator=g).to(torch.bfloat16).requires_grad_()
_, k, v = qkv.split(12, dim=2)
k, v = (t.view(2, 8, 3, 4).transpose(1, 2) for t in (k, v))
k_fp32 = (k.float() * 1.5)
dense_v = torch.randn(2, 8, 12, generator=g).view(2, 8, 3, 4).transpose(1, 2).requires_grad_()
channels_last = torch.randn(2, 3, 8, 4, generator=g).to(memory_format=torch.channels_last).requires_grad_()
one_head = torch.randn(2, 8, 1, 4, generator=g).transpose(1, 2).requires_grad_()
frozen_k = torch.randn(2, 3, 8, 4, generator=g)
print(json.dumps({"gpt2": case(k, v), "promoted": case(k_fp32, v), "dense": case(k_fp32, dense_v),
                  "channels_last": case(channels_last, channels_last * 2), "one_head": case(one_head, one_head * 2),
                  "frozen_k": case(frozen_k, dense_v)}))
""")
    assert out == {"gpt2": True, "promoted": True, "dense": True, "channels_last": True, "one_head": True,
                   "frozen_k": True}, out


SHARED_CAST = """
import transformers.models.llama.modeling_llama as L
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128)
model = LlamaForCausalLM(config)
ids = torch.randint(0, 128, (2, 16))
loss = model(input_ids=ids, labels=ids).loss
shared = {cls.__name__: cls.forward.__code__.co_name == "shared_cast" for cls in (L.LlamaAttention, L.LlamaMLP)}
# the same forward with the classes' forwards as they were before (on CPU the wrapper passes
# the input on unchanged: by position to the MLP, by keyword to the attention)
same = None
if all(shared.values()):
    wrappers = {cls: cls.forward for cls in (L.LlamaAttention, L.LlamaMLP)}
    for cls, wrapper in wrappers.items():
        cls.forward = wrapper.__wrapped__
    again = model(input_ids=ids, labels=ids).loss
    for cls, wrapper in wrappers.items():
        cls.forward = wrapper
    same = torch.equal(loss, again)
print(json.dumps({"shared": shared, "same": same}))
"""


def test_shared_cast_wraps_attention_and_gated_mlps_where_its_toggle_is_on_and_passes_the_input_on_on_cpu():
    out, log = run(SHARED_CAST)
    assert out == {"shared": {"LlamaAttention": True, "LlamaMLP": True}, "same": True}, out
    assert ("rewrite shared_cast: transformers.models.llama.modeling_llama.LlamaAttention.forward -> "
            "hidden_states cast once for q_proj, k_proj, v_proj under autocast") in log
    assert "rewrite shared_cast: transformers.models.llama.modeling_llama.LlamaMLP.forward -> x cast once" in log
    off, log = run(SHARED_CAST, TORCHFUSE_OPS="-shared_cast")
    assert off == {"shared": {"LlamaAttention": False, "LlamaMLP": False}, "same": None}, off
    assert "rewrite shared_cast off: transformers.models.llama.modeling_llama.LlamaAttention.forward" in log


NORM_CAST = """
import transformers.models.gpt2.modeling_gpt2 as G
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0))
ids = torch.randint(0, 128, (2, 16))
loss = model(input_ids=ids, labels=ids).loss
wrapped = G.GPT2Block.forward.__code__.co_name == "norm_cast"
same = None
if wrapped:  # the forward without the wrapper (on CPU it passes the call on unchanged)
    wrapper = G.GPT2Block.forward
    G.GPT2Block.forward = wrapper.__wrapped__
    again = model(input_ids=ids, labels=ids).loss
    G.GPT2Block.forward = wrapper
    same = torch.equal(loss, again)
switched = [n for n, m in model.named_modules() if "forward" in m.__dict__]
print(json.dumps({"wrapped": wrapped, "same": same, "switched_left": switched}))
"""


def test_norm_cast_wraps_layers_handing_a_norms_output_to_one_module_where_its_toggle_is_on():
    """Under the default ops the layers are wrapped (and on CPU pass the call on unchanged);
    with norm_cast left out they are not."""
    out, log = run(NORM_CAST)
    assert out == {"wrapped": True, "same": True, "switched_left": []}, out
    assert ("rewrite norm_cast: transformers.models.gpt2.modeling_gpt2.GPT2Block.forward -> ln_1 -> attn, "
            "ln_2 -> mlp: the norm writes bf16") in log
    for ops in ("-norm_cast", "all,-norm_cast"):
        off, log = run(NORM_CAST, TORCHFUSE_OPS=ops)
        assert off == {"wrapped": False, "same": None, "switched_left": []}, off
        assert "rewrite norm_cast off: transformers.models.gpt2.modeling_gpt2.GPT2Block.forward" in log


RMS_NARROWER = """
import transformers.models.llama.modeling_llama as L
from torchfuse import rewrites
narrow = rewrites._NARROWERS.get(L.LlamaRMSNorm.forward)
torch.manual_seed(0)
norm = L.LlamaRMSNorm(48, eps=1e-5)
with torch.no_grad():
    norm.weight.copy_(torch.rand(48) + 0.5)
x = torch.randn(3, 5, 48)
out = narrow(norm, x)
same = out.dtype == torch.bfloat16 and torch.equal(out, norm(x).to(torch.bfloat16))
refused = []
half = L.LlamaRMSNorm(48).to(torch.bfloat16)  # a weight not fp32: Llama's product is not fp32
refused.append(narrow(half, x))
norm.variance_epsilon = 1  # an eps not a float
refused.append(narrow(norm, x))
norm.variance_epsilon = 1e-5
refused.append(narrow(norm, torch.randn(3, 47)))  # rows not the weight's width
odd = torch.randn(3, 1, 48).as_strided((3, 1, 48), (48, 7, 1))  # contiguous, not row-major
refused.append(narrow(norm, odd))
plain_weight = L.LlamaRMSNorm(48)
plain_weight.weight = None  # the parameter's slot emptied...
plain_weight.__dict__["weight"] = torch.ones(48)  # ...and a plain tensor set on the instance
refused.append(narrow(plain_weight, x))
del norm.variance_epsilon  # no eps where the forward reads it
refused.append(narrow(norm, x))
print(json.dumps({"same": same, "refused": [r is None for r in refused]}))
"""


def test_llamas_rms_norm_narrower_is_its_output_cast_and_refuses_other_norms():
    """Llama's RMSNorm, rewritten, has a norm_cast narrower: for an fp32 x and weight it gives
    the rewritten forward's output cast to bf16 (on CPU the op composes the two: bit for bit);
    a weight of another dtype, an eps that is not a float or none at all, rows of another width,
    a contiguous x whose size-1 dim has another stride (the rewritten forward then runs HF's
    composition), or a weight that is no parameter get None, and the norm's own forward runs."""
    out, _ = run(RMS_NARROWER)
    assert out == {"same": True, "refused": [True] * 6}, out


def test_norm_cast_sites_are_plain_linears_or_conv1ds_or_absent():
    """The check of a norm's consumer's sites (`_sites_check`): plain Linear and HF Conv1D layers
    on x's device are counted, an attribute the module does not have counts as none (its call
    raises whatever x's dtype); a hooked or subclassed layer, another device, a parameter or a
    class attribute of that name refuse the switch."""
    import sys
    import torch
    sys.path.insert(0, str(ROOT / "python"))
    from torchfuse import rewrites
    from transformers.pytorch_utils import Conv1D
    sites_present = rewrites._sites_check(torch)
    cpu = torch.device("cpu")

    class Holder(torch.nn.Module):
        def __init__(self, **children):
            super().__init__()
            for name, child in children.items():
                setattr(self, name, child)

    class Sub(torch.nn.Linear):
        pass

    assert sites_present(Holder(a=torch.nn.Linear(4, 4), b=Conv1D(4, 4)), ("a", "b"), cpu) == 2
    assert sites_present(Holder(b=Conv1D(4, 4)), ("missing", "b"), cpu) == 1
    hooked = torch.nn.Linear(4, 4)
    hooked.register_forward_hook(lambda *a: None)
    with_parameter = Holder(b=Conv1D(4, 4))
    with_parameter.a = torch.nn.Parameter(torch.ones(1))

    class WithProperty(Holder):
        a = property(lambda self: None)

    refused = [(Holder(a=hooked), ("a",)), (Holder(a=Sub(4, 4)), ("a",)), (Holder(a=torch.nn.ReLU()), ("a",)),
               (with_parameter, ("a", "b")), (WithProperty(b=Conv1D(4, 4)), ("a", "b"))]
    assert [sites_present(m, sites, cpu) for m, sites in refused] == [None] * len(refused)
    assert sites_present(Holder(a=torch.nn.Linear(4, 4)), ("a",), torch.device("meta")) is None


def test_shared_cast_takes_only_plain_unobserved_linears_on_the_inputs_device():
    """shared_cast's check of each Linear its input goes to (read from the module's dicts, as
    it runs before every call): a plain nn.Linear on x's device, with or without bias, is
    taken; a subclass, another device, any hook of its own, a forward set on the instance, a
    weight replaced by a plain attribute, a non-Linear or a missing attribute are not."""
    import sys
    import torch
    sys.path.insert(0, str(ROOT / "python"))
    from torchfuse import rewrites
    plain_linear = rewrites._plain_linear_check(torch)
    cpu = torch.device("cpu")

    def made(change=None, cls=torch.nn.Linear, bias=True):
        m = cls(4, 4, bias=bias)
        if change:
            change(m)
        return m

    class Sub(torch.nn.Linear):
        pass

    def own_weight(m):
        w = m.weight.detach()
        del m.weight
        m.weight = w

    assert plain_linear(made(), cpu) and plain_linear(made(bias=False), cpu)
    assert plain_linear(made(lambda m: m.to(torch.bfloat16)), cpu)
    refused = [made(cls=Sub), made(lambda m: m.to(torch.float64)),
               made(lambda m: m.register_forward_hook(lambda *a: None)),
               made(lambda m: m.register_forward_pre_hook(lambda *a: None)),
               made(lambda m: m.register_full_backward_hook(lambda *a: None)),
               made(lambda m: setattr(m, "forward", lambda x: x)), made(own_weight),
               torch.nn.Identity(), None]
    assert not any(plain_linear(m, cpu) for m in refused)
    assert not plain_linear(made(), torch.device("meta"))


def test_hf_decoders_compile_with_fullgraph_under_the_rewrites():
    """torch.compile(fullgraph=True) of unchanged HF decoders in training (their forward builds a
    DynamicCache, whose layers are made inside the trace, so Dynamo reaches the rewritten
    `update` without a source and wraps every cell of its closure: a bound method there failed
    the trace): Llama (DynamicLayer), Mistral with a sliding window (DynamicSlidingWindowLayer)
    and GPT-J (its rotary form, shared_cast) trace whole, with eager's loss, and the KV-cache
    rewrites are in place. The same for a rewritten module made inside the compiled function (HF's
    ACT2FN makes an activation module at each lookup), as stock's compiles."""
    out, _ = run("""
import transformers
import transformers.cache_utils as CU
configs = {
    "llama": transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64),
    "mistral": transformers.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                          sliding_window=4),
    "gptj": transformers.GPTJConfig(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=16, vocab_size=64),
}
classes = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
           "gptj": transformers.GPTJForCausalLM}
result = {"rewritten": [hasattr(CU.DynamicLayer.update, "__wrapped__"),
                        hasattr(CU.DynamicSlidingWindowLayer.update, "__wrapped__")]}
for name, config in configs.items():
    torch.manual_seed(0)
    model = classes[name](config)
    ids = torch.randint(0, 64, (2, 8))
    eager = model(input_ids=ids, labels=ids).loss
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="eager", fullgraph=True)(input_ids=ids, labels=ids).loss
        result[name] = torch.equal(compiled, eager)
    except Exception as e:
        result[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
import transformers.activations as A
x = torch.randn(2, 8)
torch._dynamo.reset()
try:
    made_inside = torch.compile(lambda t: A.ACT2FN["gelu_new"](t), backend="eager", fullgraph=True)(x)
    result["made_inside"] = [hasattr(A.NewGELUActivation.forward, "__wrapped__"),
                             torch.equal(made_inside, A.NewGELUActivation()(x))]
except Exception as e:
    result["made_inside"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
print(json.dumps(result))
""")
    assert out == {"rewritten": [True, True], "llama": True, "mistral": True, "gptj": True,
                   "made_inside": [True, True]}, out
