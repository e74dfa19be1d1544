"""torchfuse's own ops under what compilers and transforms hand them, on CPU (every machine):
torch.library.opcheck (schema, autograd registration, fake tensors, AOT dispatch with dynamic
shapes), torch.compile with dynamic=True across two sizes, torch.export with a dynamic length,
torch.func transforms (grad, vmap of grad, jvp) against the compositions the ops stand for;
and the rewrite layer's guard that a patched function (F.cross_entropy, rotate_half,
torch.tanh) sends the call back to the original code. The checks run over two tables, SAMPLES
(opcheck's inputs, every op) and CASES (one record per forward op): a new op adds a line to
each, and a test fails where it has none."""
import json

from conftest import ROOT, check, run_python

# Sample inputs for every torchfuse op with a tensor argument; a new op without one fails
# test_every_op_passes_opcheck. Built in the child process (torch imported there).
SAMPLES = r"""
import torch
ops = torch.ops.torchfuse
g = torch.Generator().manual_seed(0)
def r(*shape, grad=False):
    return torch.randn(*shape, generator=g).requires_grad_(grad)
q, k, cos, sin = r(2, 3, 5, 8, grad=True), r(2, 1, 5, 8, grad=True), r(2, 5, 8), r(2, 5, 8)
x, w = r(5, 64, grad=True), r(64)
logits, target = r(6, 10, grad=True), torch.randint(0, 10, (6,), generator=g)
SAMPLES = {
    "rotary": [(q, k, cos, sin, 1), (q, k, cos[..., :4], sin[..., :4], 1, False, True)],
    "rotary_backward": [(q.detach(), k.detach(), cos, sin, 1, torch.float32),
                        (q.detach(), k.detach(), cos[..., :4], sin[..., :4], 1, torch.float32, False, True)],
    "gelu_tanh": [(x, None), (x, torch.float32)],
    "gelu_tanh_backward": [(x.detach(), r(5, 64))],
    "silu_mul": [(x, r(5, 64, grad=True))],
    "silu_mul_backward": [(r(5, 64), x.detach(), r(5, 64))],
    "silu_mul_packed": [(x,)],
    "gelu_tanh_mul": [(x, r(5, 64, grad=True))],
    "gelu_tanh_mul_backward": [(r(5, 64), x.detach(), r(5, 64))],
    "silu_mul_packed_backward": [(r(5, 32), x.detach())],
    "hf_rms_norm": [(x, w, 1e-6)],
    "norm_cast": [(x, w, r(64), 1e-5, False, torch.bfloat16), (x, w, None, 1e-6, True, torch.bfloat16)],
    "norm_cast_backward": [(r(5, 64).to(torch.bfloat16), x.detach(), r(5, 1), r(5, 1).abs(), w, r(64), False, 7),
                           (r(5, 64).to(torch.bfloat16), x.detach(), None, r(5, 1).abs(), w, None, True, 3)],
    "kv_copy": [(q, k, torch.float32, torch.float32),
                (q.detach().to(torch.bfloat16), k, torch.bfloat16, torch.float32)],
    "cross_entropy": [(logits, target, 1, -100, 0.0, torch.float32), (logits, target, 0, 3, 0.1, None)],
    "linear_cast": [(x.detach().to(torch.bfloat16).requires_grad_(), r(8, 64, grad=True), r(8, grad=True),
                     torch.bfloat16),
                    (r(2, 5, 64).to(torch.bfloat16).requires_grad_(), r(8, 64, grad=True), None, torch.bfloat16),
                    (x, r(8, 64, grad=True), r(8, grad=True), torch.float16),
                    (r(2, 5, 64).requires_grad_(), r(64, 8, grad=True), r(8, grad=True), torch.float32, True)],
    "linear_cast_split": [(r(2, 5, 64).to(torch.bfloat16).requires_grad_(), r(64, 24, grad=True), r(24, grad=True),
                           torch.bfloat16, True, [8, 8, 8], 4),
                          (r(2, 5, 64).requires_grad_(), r(16, 64, grad=True), None, torch.float32, False, [8, 4, 4], 4)],
    "cross_entropy_fwd": [(logits.detach(), target, 1, -100, 0.0, torch.float32),
                          (logits.detach(), target, 0, 3, 0.1, torch.float32)],
    "cross_entropy_bwd": [(torch.ones(()), logits.detach(), target, r(6), torch.tensor(6.0), 1, -100, 0.0),
                          (r(6), logits.detach(), target, r(6), torch.tensor(0.0), 0, 3, 0.1)],
}
F = torch.nn.functional
def rotate_half(t):
    return torch.cat((-t[..., 4:], t[..., :4]), dim=-1)
w8, w8x8, b8, w24x8, b24 = r(64), r(8, 8), r(8), r(24, 8), r(24)
# One record per op the rewrite layer calls (the forward ops; their backwards are reached
# through autograd), the standard checks below run on every one: `inputs(n)`, a call's
# arguments of length n in the dims `dims` names (torch.compile with dynamic sizes,
# torch.export); `call(*inputs)`, a scalar of the op's outputs; `pair`, the op and the
# composition it stands for, of one tensor of `shape` (torch.func's transforms; `vmap`: also
# per-row gradients). A new op without a record fails test_every_forward_op_has_a_case.
N = torch.export.Dim("n", min=2, max=1024)
CASES = {
    "rotary": dict(
        inputs=lambda n: [r(2, 3, n, 8, grad=True), r(2, 1, n, 8, grad=True), r(2, n, 8), r(2, n, 8)],
        dims=[{2: N}, {2: N}, {1: N}, {1: N}],
        call=lambda q, k, cos, sin: sum(t.sum() for t in ops.rotary(q, k, cos, sin, 1)),
        pair=(lambda t: ops.rotary(t, t, cos[0], sin[0], 0)[0], lambda t: t * cos[0] + rotate_half(t) * sin[0]),
        shape=(5, 8), vmap=True),
    "gelu_tanh": dict(
        inputs=lambda n: [r(n, 64, grad=True)], dims=[{0: N}],
        call=lambda x: ops.gelu_tanh(x, torch.float32).sum(),
        pair=(lambda t: ops.gelu_tanh(t, None), lambda t: F.gelu(t, approximate="tanh")), shape=(5, 8), vmap=True),
    "silu_mul": dict(
        inputs=lambda n: [r(n, 64, grad=True), r(n, 64, grad=True)], dims=[{0: N}, {0: N}],
        call=lambda gate, up: ops.silu_mul(gate, up).sum(),
        pair=(lambda t: ops.silu_mul(t, t * 2), lambda t: F.silu(t) * (t * 2)), shape=(5, 8), vmap=True),
    "gelu_tanh_mul": dict(
        inputs=lambda n: [r(n, 64, grad=True), r(n, 64, grad=True)], dims=[{0: N}, {0: N}],
        call=lambda gate, up: ops.gelu_tanh_mul(gate, up).sum(),
        pair=(lambda t: ops.gelu_tanh_mul(t, t * 2), lambda t: F.gelu(t, approximate="tanh") * (t * 2)),
        shape=(5, 8), vmap=True),
    "silu_mul_packed": dict(
        inputs=lambda n: [r(n, 64, grad=True)], dims=[{0: N}],
        call=lambda gate_up: ops.silu_mul_packed(gate_up).sum(),
        pair=(ops.silu_mul_packed, lambda t: t[..., 4:] * F.silu(t[..., :4])), shape=(5, 8), vmap=True),
    "hf_rms_norm": dict(
        inputs=lambda n: [r(n, 64, grad=True), w], dims=[{0: N}, None],
        call=lambda x, weight: ops.hf_rms_norm(x, weight, 1e-6).sum(),
        pair=(lambda t: ops.hf_rms_norm(t, w8, 1e-6),
              lambda t: w8 * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6))), shape=(5, 64), vmap=True),
    "norm_cast": dict(
        inputs=lambda n: [r(n, 64, grad=True), w], dims=[{0: N}, None],
        call=lambda x, weight: ops.norm_cast(x, weight, None, 1e-5, False, torch.bfloat16).float().sum(),
        pair=(lambda t: ops.norm_cast(t, w8, None, 1e-5, False, torch.bfloat16),
              lambda t: F.layer_norm(t, (64,), w8, None, 1e-5).to(torch.bfloat16)), shape=(5, 64), vmap=True),
    "kv_copy": dict(
        inputs=lambda n: [r(2, 3, n, 8, grad=True), r(2, 1, n, 8, grad=True)], dims=[{2: N}, {2: N}],
        call=lambda key, value: sum(t.sum() for t in ops.kv_copy(key, value, torch.float32, torch.float32)),
        pair=(lambda t: ops.kv_copy(t, t, torch.float32, torch.float32)[0],
              lambda t: torch.cat([torch.tensor([]), t], dim=-1)), shape=(5, 8), vmap=True),
    "linear_cast": dict(
        inputs=lambda n: [r(n, 64).to(torch.bfloat16).requires_grad_(), r(8, 64, grad=True)], dims=[{0: N}, None],
        call=lambda x, weight: ops.linear_cast(x, weight, b8, torch.bfloat16).float().sum(),
        pair=(lambda t: ops.linear_cast(t, w8x8, b8, torch.bfloat16),
              lambda t: F.linear(t.to(torch.bfloat16), w8x8.to(torch.bfloat16), b8.to(torch.bfloat16))),
        shape=(5, 8), vmap=True),
    "linear_cast_split": dict(
        inputs=lambda n: [r(2, n, 64, grad=True), r(24, 64, grad=True)], dims=[{1: N}, None],
        call=lambda x, weight: sum(t.sum() for t in ops.linear_cast_split(x, weight, None, torch.float32, False,
                                                                           [8, 8, 8], 4)),
        pair=(lambda t: torch.stack(ops.linear_cast_split(t, w24x8, b24, torch.float32, False, [8, 8, 8], 4)),
              lambda t: torch.stack([c.view(*c.shape[:-1], -1, 4).transpose(1, 2)
                                     for c in F.linear(t, w24x8, b24).split(8, dim=-1)])),
        shape=(2, 5, 8), vmap=True),
    "cross_entropy": dict(
        inputs=lambda n: [r(n, 10, grad=True), torch.randint(0, 10, (n,), generator=g)], dims=[{0: N}, {0: N}],
        call=lambda logits, target: ops.cross_entropy(logits, target),
        pair=(lambda t: ops.cross_entropy(t, target[:5]), lambda t: F.cross_entropy(t, target[:5])),
        shape=(5, 8), vmap=False),
}
# Every case's inputs at length n, flat, and a function of them summing every case's call.
def all_cases(n):
    inputs = {name: case["inputs"](n) for name, case in CASES.items()}
    def f(*flat):
        total, at = 0, 0
        for name, case in CASES.items():
            k = len(inputs[name])
            total = total + case["call"](*flat[at:at + k])
            at += k
        return total
    return [a for name in CASES for a in inputs[name]], f
def compute_ops():
    names = [n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("torchfuse::")]
    return sorted(n for n in names
                  if any(isinstance(a.type, torch.TensorType) for a in getattr(ops, n).default._schema.arguments))
"""


def run(code):
    proc = check(run_python(SAMPLES + code, load_library=True))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_op_passes_opcheck():
    out = run(r"""
import json
results = {}
for name in compute_ops():
    for args in SAMPLES.get(name, [None]):
        if args is None:
            results[name] = "no sample inputs"
            continue
        report = torch.library.opcheck(getattr(ops, name).default, args)
        results.setdefault(name, []).append({k: v for k, v in report.items() if v != "SUCCESS"})
print(json.dumps(results))
""")
    assert set(out) >= {"rotary", "gelu_tanh", "silu_mul", "hf_rms_norm", "cross_entropy"}, out
    for name, reports in out.items():
        assert reports != "no sample inputs", f"torchfuse::{name} has no sample in SAMPLES"
        assert all(report == {} for report in reports), (name, reports)


def test_dynamic_compile_of_every_op_matches_eager():
    """torch.compile(dynamic=True) (the AOT pipeline with symbolic sizes), two sizes, so the
    second call runs the graph compiled for symbolic ones; forward and gradients."""
    out = run(r"""
import json
_, f = all_cases(5)
compiled = torch.compile(f, dynamic=True, backend="aot_eager")
diffs = []
for n in (5, 7):
    args, _ = all_cases(n)
    leaves = [a for a in args if a.requires_grad]
    got = torch.autograd.grad(compiled(*args), leaves)
    want = torch.autograd.grad(f(*args), leaves)
    diffs.append(max((a - b).abs().max().item() for a, b in zip(got, want)))
print(json.dumps({"diffs": diffs, "frames": torch._dynamo.utils.counters["stats"]["unique_graphs"]}))
""")
    assert all(d < 1e-5 for d in out["diffs"]), out


def test_double_backward_of_the_gated_ops_is_the_originals():
    """create_graph through silu_mul and gelu_tanh_mul (their C++ autograd's differentiable
    branch): the first-order gradients finite and bitwise the original composition's under
    create_graph (the same ops in the same order), the second-order ones within rounding; in
    fp16 with gates of +-800 too, where a GELU derivative written out of small ops overflows."""
    out = run(r"""
import json
F = torch.nn.functional
pairs = {"silu_mul": (ops.silu_mul, lambda g, u: F.silu(g) * u),
         "gelu_tanh_mul": (ops.gelu_tanh_mul, lambda g, u: F.gelu(g, approximate="tanh") * u)}
result = {}
gen = torch.Generator().manual_seed(1)
for name, (op, original) in pairs.items():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        gate0 = (3 * torch.randn(64, 32, generator=gen)).to(dtype)
        gate0[0, :4] = torch.tensor([800.0, -800.0, 30.0, -30.0])
        u, dy = torch.randn(64, 32, generator=gen).to(dtype), torch.randn(64, 32, generator=gen).to(dtype)
        runs = []
        for fn in (op, original):
            gate, up = gate0.clone().requires_grad_(True), u.clone().requires_grad_(True)
            dgate, dup = torch.autograd.grad(fn(gate, up), (gate, up), dy, create_graph=True)
            second = torch.autograd.grad((dgate.float() * 2).sum() + dup.float().sum(), (gate, up))
            runs.append((dgate, dup) + second)
        first = all(torch.equal(a, b) for a, b in zip(runs[0][:2], runs[1][:2]))
        # (Stock's own second derivative of the tanh GELU overflows fp16 at +-800: NaN in both.)
        second = all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-2, equal_nan=True)
                     for a, b in zip(runs[0][2:], runs[1][2:]))
        result[f"{name}/{dtype}"] = [first, second, all(bool(t.isfinite().all()) for t in runs[0][:2])]
print(json.dumps(result))
""")
    assert out == {k: [True, True, True] for k in out} and len(out) == 6, out


def test_torch_func_transforms_over_the_ops_match_the_compositions():
    """grad, vmap(grad) (per-sample gradients) and jvp: torchfuse's C++ autograd Functions cannot
    run under torch.func's transforms, so the ops compute the compositions there."""
    out = run(r"""
import json
diffs = {}
for name, case in CASES.items():
    op, ref = case["pair"]
    t = r(*case["shape"])
    scalar = lambda f: (lambda u: f(u).sum())
    got = [torch.func.grad(scalar(op))(t)]
    want = [torch.func.grad(scalar(ref))(t)]
    if case["vmap"]:
        got.append(torch.func.vmap(torch.func.grad(scalar(op)))(t))
        want.append(torch.func.vmap(torch.func.grad(scalar(ref)))(t))
    tangent = r(*t.shape)
    got.append(torch.func.jvp(op, (t,), (tangent,))[1])
    want.append(torch.func.jvp(ref, (t,), (tangent,))[1])
    diffs[name] = max((a - b).abs().max().item() for a, b in zip(got, want))
print(json.dumps(diffs))
""")
    assert set(out) == {"gelu_tanh", "silu_mul", "silu_mul_packed", "gelu_tanh_mul", "hf_rms_norm", "rotary",
                        "kv_copy", "cross_entropy", "norm_cast", "linear_cast", "linear_cast_split"}, out
    assert all(d < 1e-4 for d in out.values()), out


def test_a_patched_dependency_sends_the_call_to_the_original():
    """The rewrite layer's guard: what the recognised code calls through its globals, as it was
    when recognised. A patch of F.cross_entropy (z-loss, Liger), of loss_utils'
    fixed_cross_entropy, of a model's rotate_half or of torch.tanh is seen; undoing it is too."""
    proc = check(run_python(f"""
import json, sys
sys.path.insert(0, {str(ROOT / "python")!r})
import torch
from torchfuse import compositions
import transformers.activations as activations
import transformers.loss.loss_utils as loss_utils
import transformers.models.llama.modeling_llama as llama
deps = {{"loss": compositions.Dependencies(loss_utils.ForCausalLMLoss),
        "rotary": compositions.Dependencies(llama.apply_rotary_pos_emb),
        "gelu": compositions.Dependencies(activations.NewGELUActivation.forward)}}
def seen(owner, name):
    original = getattr(owner, name)
    setattr(owner, name, lambda *a, **k: original(*a, **k))
    during = {{key: d.unchanged() for key, d in deps.items()}}
    setattr(owner, name, original)
    return {{"during": during, "after": {{key: d.unchanged() for key, d in deps.items()}}}}
print(json.dumps({{"before": {{key: d.unchanged() for key, d in deps.items()}},
                  "cross_entropy": seen(torch.nn.functional, "cross_entropy"),
                  "fixed_cross_entropy": seen(loss_utils, "fixed_cross_entropy"),
                  "rotate_half": seen(llama, "rotate_half"),
                  "tanh": seen(torch, "tanh")}}))
"""))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    every = {"loss": True, "rotary": True, "gelu": True}
    assert out["before"] == every, out
    expected_changed = {"cross_entropy": {"loss"}, "fixed_cross_entropy": {"loss"},
                        "rotate_half": {"rotary"}, "tanh": {"gelu"}}
    for patched, changed in expected_changed.items():
        assert out[patched]["after"] == every, (patched, out)
        assert {k for k, v in out[patched]["during"].items() if not v} == changed, (patched, out)


def test_export_with_a_dynamic_dim_keeps_the_ops():
    """torch.export with a dynamic length: the exported program calls torchfuse's ops (not
    their compositions) and, run at another length, equals eager."""
    out = run(r"""
import json
args, f = all_cases(5)
class Model(torch.nn.Module):
    def forward(self, *flat):
        return f(*flat)
dims = [d for case in CASES.values() for d in case["dims"]]
program = torch.export.export(Model(), tuple(a.detach() for a in args), dynamic_shapes=(tuple(dims),))
args, _ = all_cases(7)
args = [a.detach() for a in args]
print(json.dumps({"diff": (program.module()(*args) - Model()(*args)).abs().item(),
                  "ops": sorted(str(node.target) for node in program.graph.nodes if "torchfuse" in str(node.target)),
                  "cases": sorted(CASES)}))
""")
    assert out["diff"] < 1e-4, out
    assert out["ops"] == [f"torchfuse.{name}.default" for name in out["cases"]], out


def test_every_forward_op_has_a_case():
    """The template's table covers every op the rewrite layer can call: each torchfuse op with a
    tensor argument is a case of CASES, or a backward (or a forward/backward half) reached
    through a case's autograd."""
    out = run(r"""
import json
print(json.dumps({"ops": compute_ops(), "cases": sorted(CASES)}))
""")
    halves = ("_backward", "_fwd", "_bwd")
    forward = sorted(name for name in out["ops"] if not name.endswith(halves))
    assert forward == out["cases"], out


def test_interleaved_rotary_of_an_odd_head_dim_raises_on_meta_as_on_cpu():
    """The interleaved rotation pairs the head dim's elements: for an odd one the composition
    (stock's path, run on CPU) raises, and the Meta kernel (what torch.compile traces) raises too
    instead of describing outputs the real op never makes; an even one passes both."""
    proc = check(run_python(r"""
import json, torch
ops = torch.ops.torchfuse
def raises(device, d, backward=False):
    q, k = torch.randn(1, 2, 3, d, device=device), torch.randn(1, 1, 3, d, device=device)
    cos, sin = torch.randn(1, 3, d, device=device), torch.randn(1, 3, d, device=device)
    try:
        if backward:
            ops.rotary_backward(q, k, cos, sin, 1, torch.float32, True)
        else:
            ops.rotary(q, k, cos, sin, 1, True)
        return None
    except RuntimeError as e:
        return str(e)
print(json.dumps({f"{dev} {d} {bwd}": raises(dev, d, bwd) for dev in ("cpu", "meta") for d in (5, 6)
                  for bwd in (False, True)}))
""", load_library=True))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for bwd in ("False", "True"):
        assert out[f"cpu 6 {bwd}"] is None and out[f"meta 6 {bwd}"] is None, out
        assert out[f"cpu 5 {bwd}"] is not None, out
        assert "must be even; got 5" in out[f"meta 5 {bwd}"], out


def test_partial_rotary_on_meta_describes_what_cpu_makes():
    """With `passthrough` the Meta kernels give the composition's (stock's path, on CPU) dtypes,
    sizes and row-major strides, each of q and k in its own promoted dtype; an odd head dim
    with an even count of rotated features passes (only those pair up), an odd count raises on
    both."""
    proc = check(run_python(r"""
import json, torch
ops = torch.ops.torchfuse
def outputs(device, d, r, interleaved, backward=False):
    q = torch.randn(1, 2, 3, d, device=device)
    k = torch.randn(1, 1, 3, d, device=device, dtype=torch.bfloat16)
    cos, sin = (torch.randn(1, 3, r, device=device, dtype=torch.bfloat16) for _ in range(2))
    try:
        if backward:
            out = ops.rotary_backward(q, k, cos, sin, 1, torch.float16, interleaved, True)
        else:
            out = ops.rotary(q, k, cos, sin, 1, interleaved, True)
        return [[str(t.dtype), list(t.shape), list(t.stride())] for t in out]
    except RuntimeError as e:
        return "raises"
print(json.dumps({f"{d} {r} {i} {b}": [outputs(dev, d, r, i, b) for dev in ("cpu", "meta")]
                  for d, r in ((8, 4), (9, 4), (9, 3)) for i in (False, True) for b in (False, True)}))
""", load_library=True))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key, (cpu, meta) in out.items():
        assert cpu == meta, (key, cpu, meta)
    assert out["8 4 False False"][0][0][0] == "torch.float32" and out["8 4 False False"][0][1][0] == "torch.bfloat16"
    assert out["9 4 True False"][0] != "raises" and out["9 3 True False"][0] == "raises", out
