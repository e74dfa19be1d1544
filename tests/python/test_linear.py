"""torchfuse::linear_cast on CPU (its node runs on any device; the rewrite sends CUDA calls only):
the one autograd node gives stock's outputs and gradients bit for bit (stock: the casts, then
F.linear, as nn.Linear runs under autocast), saves what stock saves, takes its casts from
autocast's cache under autocast (a reused weight cast once), keeps a double backward and
checkpointing exact, and leaves stock's nodes where it would not be exact. The GPU half (under
autocast, models): test_gpu_linear.py."""
import json

from conftest import MAIN_LIB, ROOT, check, run_python

PRELUDE = r"""
import json, torch
import torch.nn.functional as F
op = torch.ops.torchfuse.linear_cast
BF16 = torch.bfloat16
g = torch.Generator().manual_seed(0)
def r(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)
def stock(x, w, b, dtype):
    return F.linear(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype))
def outputs_and_grads(fn, x, w, b, dtype, dy):
    leaves = [t for t in (x, w, b) if t is not None and t.requires_grad]
    y = fn(x, w, b, dtype)
    return [y, *torch.autograd.grad(y, leaves, dy)], y.grad_fn.name()
def same(a, b):
    return len(a) == len(b) and all(s.dtype == t.dtype and s.shape == t.shape and s.stride() == t.stride()
                                    and torch.equal(s, t) for s, t in zip(a, b))
"""


def run(code):
    proc = check(run_python(PRELUDE + code, load_library=True))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_node_gives_stocks_outputs_and_gradients_bit_for_bit():
    out = run(r"""
results = {}
for shape in [(4, 5, 16), (6, 16), (1, 16), (2, 3, 4, 16), (7, 1, 16)]:
    for bias in (True, False):
        for wdtype, dtype in ((torch.float32, BF16), (torch.float16, BF16), (BF16, BF16),
                              (torch.float32, torch.float16), (torch.float32, torch.float32)):
            for frozen in (False, True):
                # An fp32 input with fp16 weights: its cast is the op's too.
                xdtype = torch.float32 if wdtype == torch.float16 else dtype
                x, w = r(*shape, dtype=xdtype), r(12, 16, dtype=wdtype, grad=not frozen)
                if frozen and bias:
                    w = w * 1.5  # a computed weight (a parametrization's), not a leaf
                b = r(12, dtype=wdtype) if bias else None
                dy = torch.randn(*shape[:-1], 12, generator=g).to(dtype)
                ours, node = outputs_and_grads(op, x, w, b, dtype, dy)
                theirs, _ = outputs_and_grads(stock, x, w, b, dtype, dy)
                results[f"{shape} bias={bias} {wdtype}->{dtype} frozen={frozen}"] = (same(ours, theirs), node)
print(json.dumps(results))
""")
    assert len(out) == 5 * 2 * 5 * 2
    for case, (same, node) in out.items():
        assert same, case
        assert node == "torchfuse::LinearCastBackward", case


def test_a_one_row_input_of_odd_strides_keeps_stocks_gradient_layout():
    """mm_mat1_backward's stride test on the input as given: a [1, K] input of strides (1, 1)
    gets its gradient column-major, as from stock."""
    out = run(r"""
x, w = r(16, dtype=BF16).view(16, 1).t().detach().requires_grad_(), r(12, 16)
dy = torch.randn(1, 12, generator=g).to(BF16)
ours, node = outputs_and_grads(op, x, w, None, BF16, dy)
theirs, _ = outputs_and_grads(stock, x, w, None, BF16, dy)
print(json.dumps([same(ours, theirs), node, list(ours[1].stride())]))
""")
    assert out == [True, "torchfuse::LinearCastBackward", [1, 1]], out


def test_forms_the_node_would_not_reproduce_keep_stocks_nodes():
    """A non-contiguous input or weight, a 1-D input, an fp64 dtype, an unbiased call matmul would
    not fold into one mm: stock's composition (its nodes), with its values."""
    out = run(r"""
w = r(12, 16)
cases = {
    "transposed input": (r(16, 4, dtype=BF16).t(), w, BF16),
    "transposed weight": (r(4, 16, dtype=BF16), r(16, 12).t(), BF16),
    "1-D input": (r(16, dtype=BF16), w, BF16),
    "fp64 dtype": (r(4, 16, dtype=torch.float64), r(12, 16, dtype=torch.float64), torch.float64),
    # Contiguous, a size-one dim's stride not its span, no bias, a frozen weight: matmul's bmm.
    "no bias, odd strides": (r(2, 3, 1, 16, dtype=BF16).transpose(1, 2), r(12, 16, grad=False), BF16),
}
results = {}
for name, (x, weight, dtype) in cases.items():
    dy = torch.randn(*x.shape[:-1], 12, generator=g).to(dtype)
    ours, node = outputs_and_grads(op, x, weight, None, dtype, dy)
    theirs, _ = outputs_and_grads(stock, x, weight, None, dtype, dy)
    results[name] = (same(ours, theirs), node)
print(json.dumps(results))
""")
    for case, (same, node) in out.items():
        assert same, case
        assert node != "torchfuse::LinearCastBackward", case


def test_tensors_of_the_dtype_are_not_cast_and_another_autocast_casts_nothing():
    """A Linear without autocast (a bf16 model, FSDP2's bf16 parameters, fp32): nothing is cast,
    the node's edges are the leaves' own accumulators. Under an autocast of another dtype the op
    still computes in its dtype, through the node and through stock's composition alike."""
    out = run(r"""
results = {}
for dtype in (BF16, torch.float32):
    x, w, b = r(4, 5, 16, dtype=dtype), r(12, 16, dtype=dtype), r(12, dtype=dtype)
    y = op(x, w, b, dtype)
    edges = [type(fn).__name__ if fn is not None else None for fn, _ in y.grad_fn.next_functions]
    results[str(dtype)] = [y.grad_fn.name(), edges, y.dtype == dtype]
x, w = r(4, 5, 16), r(12, 16)
with torch.autocast("cpu", dtype=BF16):
    node = op(x, w, None, torch.float32)
    torch.ops.torchfuse.set_enabled("linear", False)
    composition = op(x, w, None, torch.float32)
    torch.ops.torchfuse.set_enabled("linear", True)
results["other autocast"] = [node.dtype == composition.dtype == torch.float32, torch.equal(node, composition),
                             node.grad_fn.name() != composition.grad_fn.name()]
print(json.dumps(results))
""")
    accumulators = ["AccumulateGrad"] * 3
    assert out == {"torch.bfloat16": ["torchfuse::LinearCastBackward", accumulators, True],
                   "torch.float32": ["torchfuse::LinearCastBackward", accumulators, True],
                   "other autocast": [True, True, True]}, out


CONV1D = r"""
def conv1d(x, w, b, dtype, autocast):
    # HF Conv1D's forward (transformers.pytorch_utils), as it runs under CPU autocast or in dtype.
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        size_out = x.size()[:-1] + (w.shape[1],)
        return torch.addmm(b, x.view(-1, x.size(-1)), w).view(size_out)
def through_op(x, w, b, dtype, autocast):
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        return op(x, w, b, dtype, True)
"""


def test_hf_conv1d_through_the_node_gives_its_outputs_and_gradients_bit_for_bit():
    """HF Conv1D's forward (addmm of the bias, the input's 2-D view and the [in, out] weight,
    viewed back) as the op's `weight_in_out` form: its node gives Conv1D's outputs and every
    gradient bit for bit, under autocast (its casts: the input's a plain one, as Conv1D casts a
    view autocast never caches; a leaf input two calls take is cast twice, as by Conv1D) and
    without (fp32, bf16), and saves what Conv1D's nodes save."""
    out = run(CONV1D + r"""
results = {}
for shape in [(4, 5, 16), (6, 16), (1, 16), (2, 3, 4, 16)]:
    for wdtype, dtype, autocast in ((torch.float32, BF16, True), (BF16, BF16, False),
                                    (torch.float32, torch.float32, False)):
        for frozen in (False, True):
            xdtype = torch.float32 if autocast else dtype
            x, w, b = r(*shape, dtype=xdtype), r(16, 12, dtype=wdtype, grad=not frozen), r(12, dtype=wdtype)
            dy = torch.randn(*shape[:-1], 12, generator=g).to(dtype)
            leaves = [t for t in (x, w, b) if t.requires_grad]
            y_op = through_op(x, w, b, dtype, autocast)
            ours = [y_op, *torch.autograd.grad(y_op, leaves, dy)]
            y = conv1d(x, w, b, dtype, autocast)
            theirs = [y, *torch.autograd.grad(y, leaves, dy)]
            results[f"{shape} {wdtype}->{dtype} autocast={autocast} frozen={frozen}"] = (
                same(ours, theirs), y_op.grad_fn.name())
x, w, b = r(3, 16), r(16, 12), r(12)  # a leaf input two calls take, under autocast
grads = []
for fn in (through_op, conv1d):
    y = fn(x, w, b, BF16, True) + fn(x, w, b, BF16, True)
    grads.append(list(torch.autograd.grad(y.float().sum(), [x, w, b])))
results["leaf input twice"] = (same(*grads), "-")
def saved(fn, x, w, b):
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        fn(x, w, b, BF16, True)
    return sorted(seen)
tensors = r(4, 5, 16), r(16, 12), r(12)
results["saved"] = (saved(through_op, *tensors) == saved(conv1d, *tensors), "-")
# A saved-tensor hook unpacking other strides (an offloading hook's copy): the weight's gradient
# is still Conv1D's.
restrided = (lambda t: t.transpose(0, 1).contiguous().transpose(0, 1) if t.dim() == 3 else t, lambda t: t)
x, w, b = r(4, 5, 16), r(16, 12), r(12)
grads = []
for fn in (through_op, conv1d):
    with torch.autograd.graph.saved_tensors_hooks(*restrided):
        y = fn(x, w, b, torch.float32, False)
    grads.append(list(torch.autograd.grad(y.sum(), [x, w, b])))
results["restrided saved input"] = (same(*grads), "-")
print(json.dumps(results))
""")
    assert len(out) == 4 * 3 * 2 + 3
    for case, (same, node) in out.items():
        assert same, case
        assert node in ("torchfuse::LinearCastBackward", "-"), case


def test_hf_conv1d_forms_the_node_would_not_reproduce_keep_its_code():
    """Without a bias, a 1-D or non-contiguous input: Conv1D's own code (stock's nodes), its
    values, and its error for a view it cannot take."""
    out = run(CONV1D + r"""
results = {}
w, b = r(16, 12), r(12)
x1 = r(16, dtype=BF16)
y = through_op(x1, w, b, BF16, True)
results["1-D input"] = [torch.equal(y, conv1d(x1, w, b, BF16, True)), y.grad_fn.name()]
x = r(4, 16)
y = op(x, w, None, torch.float32, True)
results["no bias"] = [torch.equal(y, F.linear(x, w.t())), y.grad_fn.name()]
errors = []
for fn in (lambda x: op(x, w, b, torch.float32, True), lambda x: conv1d(x, w, b, torch.float32, False)):
    try:
        fn(r(2, 16, 4).transpose(1, 2))
        errors.append("no error")
    except RuntimeError as error:
        errors.append(str(error))
results["strided"] = [errors[0] == errors[1] and "view" in errors[0]]
print(json.dumps(results))
""")
    assert out["1-D input"][0] and out["1-D input"][1] != "torchfuse::LinearCastBackward", out
    assert out["no bias"][0] and out["no bias"][1] != "torchfuse::LinearCastBackward", out
    assert out["strided"] == [True], out


def test_it_saves_what_stock_saves():
    """The bytes a saved-tensor hook sees (what offloading would move): stock's, with and without
    the weight's gradient (a frozen base layer saves no input)."""
    out = run(r"""
def saved(fn, x, w, b):
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        fn(x, w, b, BF16)
    return sorted(seen)
results = {}
for frozen in (False, True):
    for bias in (True, False):
        x, w = r(4, 5, 16, dtype=BF16), r(12, 16, grad=not frozen)
        b = r(12) if bias else None
        results[f"frozen={frozen} bias={bias}"] = (saved(op, x, w, b), saved(stock, x, w, b))
print(json.dumps(results))
""")
    for case, (ours, theirs) in out.items():
        assert ours == theirs, case


def test_under_autocast_reused_weights_and_inputs_are_cast_once_as_autocasts_cache_does():
    """A weight used twice in an autocast region is cast once (both uses save the one cast, as
    stock's do), so is an fp32 leaf input that two Linears take, and a weight is cast again in
    the next region after an in-place change. With `weight_cast` off the casts are autocast's own
    and every gradient is stock's bit for bit; with it on (the node casts the weight itself,
    sharing its cast through the region as autocast's cache does) every output and gradient is
    stock's but the reused weight's, whose two uses' gradients are cast back to fp32 before they
    add (stock adds them in bf16, then casts): that one is the fp32 sum of the two, closer to the
    exact sum than stock's."""
    out = run(r"""
def two_uses(fn, x1, x2, w, v):
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=BF16):
            y = fn(x1, w, None, BF16) + fn(x2, w, None, BF16) + fn(x1, v, None, BF16)
    return y, [t for t in seen if t.shape in ((12, 16), (16, 12))]  # stock saves the cast transposed
x1, x2, w, v = r(4, 16), r(4, 16, dtype=BF16), r(12, 16), r(12, 16)
dy = torch.randn(4, 12, generator=g).to(BF16)
def exact_w_grad():  # the two uses' weight gradients, each cast to fp32 before the sum
    per_use = [(dy.t().mm(x.to(BF16))).float() for x in (x1, x2)]
    return per_use[0] + per_use[1]
out = {}
for on in (False, True):
    torch.ops.torchfuse.set_enabled("weight_cast", on)
    results = {}
    for name, fn in (("ours", op), ("stock", lambda x, w, b, d: F.linear(x, w))):
        y, ws = two_uses(fn, x1, x2, w, v)
        results[name] = (y, ws, torch.autograd.grad(y, [x1, x2, w, v], dy))
    (y, ws, grads), (y0, ws0, grads0) = results["ours"], results["stock"]
    with torch.no_grad():
        w.mul_(2)
    _, ws2 = two_uses(op, x1, x2, w, v)
    with torch.no_grad():
        w.div_(2)
    not_w = [0, 1, 3]
    out[f"weight_cast={on}"] = {
        "shared": ws[0].data_ptr() == ws[1].data_ptr(), "stock_shared": ws0[0].data_ptr() == ws0[1].data_ptr(),
        "recast": torch.equal(ws2[0], (2 * w).detach().to(BF16)) and not torch.equal(ws2[0], ws[0]),
        "same": same([y, *(grads[i] for i in not_w)], [y0, *(grads0[i] for i in not_w)]),
        "w": "stock's" if same([grads[2]], [grads0[2]]) else
             "fp32 sum" if torch.equal(grads[2], exact_w_grad()) else "other",
        # The edges of x2's Linear with w (x2 a bf16 leaf): the weight's cast node or the weight.
        "nodes": sorted({type(f).__name__ for f, _ in y.grad_fn.next_functions[0][0].next_functions[1][0]
                         .next_functions if f})}
print(json.dumps(out))
""")
    assert out["weight_cast=False"] == {"shared": True, "stock_shared": True, "recast": True, "same": True,
                                        "w": "stock's", "nodes": ["AccumulateGrad", "ToCopyBackward0"]}, out
    assert out["weight_cast=True"] == {"shared": True, "stock_shared": True, "recast": True, "same": True,
                                       "w": "fp32 sum", "nodes": ["AccumulateGrad"]}, out


def test_the_node_casting_the_weight_itself_gives_stocks_bits_where_each_weight_has_one_use():
    """`weight_cast` on (the default): under autocast the node casts an fp32 weight and bias
    itself and its edges go to the parameters (no ToCopyBackward0 between); for weights with one
    use in the region every output and gradient is stock's bit for bit, frozen weights, a computed
    (non-leaf) weight, 16-bit weights (nothing to cast) and Conv1D's form included; a region with
    autocast's cache switched off casts at every use, as stock does."""
    out = run(CONV1D + r"""
results = {}
def under_autocast(fn, cache=True):
    def call(x, w, b, dtype):
        with torch.autocast("cpu", dtype=dtype, cache_enabled=cache):
            return fn(x, w, b, dtype)
    return call
for shape in [(4, 5, 16), (6, 16)]:
    for bias in (True, False):
        for kind in ("fp32", "frozen", "computed", "bf16"):
            wdtype = BF16 if kind == "bf16" else torch.float32
            x, w = r(*shape, dtype=BF16), r(12, 16, dtype=wdtype, grad=kind != "frozen")
            if kind == "computed":
                w = w * 1.5
            b = r(12, dtype=wdtype) if bias else None
            dy = torch.randn(*shape[:-1], 12, generator=g).to(BF16)
            ours, node = outputs_and_grads(under_autocast(op), x, w, b, BF16, dy)
            theirs, _ = outputs_and_grads(under_autocast(stock), x, w, b, BF16, dy)
            y = under_autocast(op)(x, w, b, BF16)
            edges = sorted({type(f).__name__ for f, _ in y.grad_fn.next_functions if f is not None})
            results[f"{shape} bias={bias} {kind}"] = [same(ours, theirs), node, "ToCopyBackward0" in edges]
x, w, b = r(4, 5, 16), r(16, 12), r(12)
dy = torch.randn(4, 5, 12, generator=g).to(BF16)
ours = [through_op(x, w, b, BF16, True)]
ours += torch.autograd.grad(ours[0], [x, w, b], dy)
theirs = [conv1d(x, w, b, BF16, True)]
theirs += torch.autograd.grad(theirs[0], [x, w, b], dy)
results["conv1d"] = [same(ours, theirs), "-", False]
x, w = r(4, 16, dtype=BF16), r(12, 16)
seen = []
with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
    with torch.autocast("cpu", dtype=BF16, cache_enabled=False):
        y = op(x, w, None, BF16) + op(x, w, None, BF16)
casts = [t for t in seen if t.shape == (12, 16)]
results["cache off"] = [len(casts) == 2 and casts[0].data_ptr() != casts[1].data_ptr(), "-", False]
# The casts dispatched for ten regions of one call, with the cache on and off: the node's own
# (below autograd, no node) as many as stock's, and with the cache on the region's probe (a
# one-element CPU cast, one a region); none without the cache, which shares nothing.
def casts_dispatched(fn, cache):
    with torch.profiler.profile() as prof:
        for _ in range(10):
            with torch.autocast("cpu", dtype=BF16, cache_enabled=cache):
                fn(x, w, None, BF16)
    return sum(e.name == "aten::_to_copy" for e in prof.events())
for cache in (True, False):
    ours, theirs = casts_dispatched(op, cache), casts_dispatched(lambda x, w, b, d: F.linear(x, w), cache)
    results[f"casts dispatched, cache={cache}"] = [ours == theirs + (10 if cache else 0), "-", False]
print(json.dumps(results))
""")
    assert len(out) == 2 * 2 * 4 + 4
    for case, (same, node, cast_node) in out.items():
        assert same, case
        assert node in ("torchfuse::LinearCastBackward", "-"), case
        assert not cast_node, case


def test_double_backward_and_checkpointing_give_stocks_gradients():
    out = run(r"""
results = {}
for wdtype in (torch.float32, BF16):
    x, w, b = r(4, 5, 16, dtype=BF16), r(12, 16, dtype=wdtype), r(12, dtype=wdtype)
    def penalty(fn, autocast):  # a gradient penalty: the input gradient's norm, differentiated again
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            y = fn(x, w, b, BF16)
        (gx,) = torch.autograd.grad(y.float().square().sum(), [x], create_graph=True)
        return torch.autograd.grad(gx.float().square().sum(), [x, w, b])
    results[f"double backward {wdtype}"] = same(list(penalty(op, False)), list(penalty(stock, False)))
    # Under autocast the node casts an fp32 weight itself (weight_cast): the double backward
    # reaches the weight through the cast's gradient as stock's does; the cast is used twice
    # there (the forward's GEMM, the first backward's), and its two gradients add in fp32 (stock:
    # in bf16, then cast), so the weight's gradient is within the contract, the others stock's.
    (gx, gw, gb), (sx, sw, sb) = penalty(op, True), penalty(stock, True)
    results[f"double backward {wdtype} autocast"] = same([gx, gb], [sx, sb]) and (
        torch.equal(gw, sw) if wdtype == BF16 else
        gw.dtype == sw.dtype and ((gw - sw).norm() / sw.norm()).item() < 8e-3)
from torch.utils.checkpoint import checkpoint
x0, w0, b0 = r(4, 5, 16, dtype=BF16), r(16, 16), r(16)
w1, b1 = r(16, 16), r(16)
def layer_grads(fn, checkpointed, reentrant=False, twice=True):
    x, w, b, v, c = (t.detach().clone().requires_grad_() for t in (x0, w0, b0, w1, b1))
    # The weight used twice (its cast taken once, dropped and made again by checkpoint), or once.
    def layer(t):
        with torch.autocast("cpu", dtype=BF16):
            return fn(torch.tanh(fn(t, w, b, BF16)), w if twice else v, b if twice else c, BF16)
    y = checkpoint(layer, x, use_reentrant=reentrant) if checkpointed else layer(x)
    y.float().sum().backward()  # reentrant checkpointing takes backward(), not grad()
    return [x.grad, w.grad, b.grad] + ([] if twice else [v.grad, c.grad])
autocast_stock = lambda x, w, b, dtype: F.linear(x, w, b)
for reentrant in (False, True):
    # Once each: stock's bits with the node's own casts; twice: with autocast's (weight_cast off).
    results[f"checkpoint reentrant={reentrant}, weights once"] = same(
        layer_grads(op, True, reentrant, twice=False), layer_grads(autocast_stock, False, twice=False))
    torch.ops.torchfuse.set_enabled("weight_cast", False)
    results[f"checkpoint reentrant={reentrant}, a weight twice"] = same(
        layer_grads(op, True, reentrant), layer_grads(autocast_stock, False))
    torch.ops.torchfuse.set_enabled("weight_cast", True)
print(json.dumps(results))
""")
    assert out and all(out.values()), out


def test_linear_forward_is_rewritten_to_the_op_and_knows_torchs_own():
    """The launcher's hooks rewrite nn.Linear.forward (its original kept as `__wrapped__`); the
    rewrites that look at Linear submodules know either as nn.Linear's own; off the GPU it runs
    torch's code."""
    proc = check(run_python(f"""
import json, sys
sys.path.insert(0, {str(ROOT / "python")!r})
import torch, torchfuse
from torchfuse import rewrites
original = torch.nn.Linear.forward
torchfuse.enable()
rewritten = torch.nn.Linear.forward
m = torch.nn.Linear(16, 12)
x = torch.randn(3, 16)
with torch.autocast("cpu", dtype=torch.bfloat16):
    y = m(x)
scripted = torch.jit.script(m)  # compiles the original's source, its names resolved in the rewrite
print(json.dumps({{"rewritten": rewritten is not original, "wrapped": rewritten.__wrapped__ is original,
                   "scripted": torch.equal(scripted(x), m(x)),
                   "forwards": rewrites._linear_forwards(torch) == (original, rewritten),
                   "cpu": y.grad_fn.name()}}))
""", TORCHFUSE_LIB_DIR=str(MAIN_LIB.parent)))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"rewritten": True, "wrapped": True, "forwards": True, "cpu": "AddmmBackward0",
                   "scripted": True}, out


def test_hf_conv1d_forward_is_rewritten_and_still_known_as_conv1d():
    """The hooks rewrite transformers.pytorch_utils.Conv1D.forward (its original kept as
    `__wrapped__`); the rewrites that look at Conv1D submodules (norm_cast's sites, the GPT-2
    MLP's c_proj) know either as Conv1D's; off the GPU, and under torch.compile (fullgraph), it
    runs Conv1D's code; torch.jit.script compiles Conv1D's code."""
    proc = check(run_python(f"""
import json, sys
sys.path.insert(0, {str(ROOT / "python")!r})
import torch, torchfuse
torchfuse.enable()
from torchfuse import rewrites
from transformers.pytorch_utils import Conv1D
torch.manual_seed(0)
m, x = Conv1D(12, 16), torch.randn(2, 3, 16, requires_grad=True)
def run(module):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = module(x)
    return [y, *torch.autograd.grad(y.float().sum(), [x, *m.parameters()])], y.grad_fn.name()
eager, node = run(m)
compiled, _ = run(torch.compile(m, fullgraph=True, backend="aot_eager"))
scripted = torch.jit.script(m)  # compiles Conv1D's source, its names resolved in the rewrite
holder = torch.nn.Module()
holder.proj = m
print(json.dumps({{"wrapped": Conv1D.forward.__wrapped__.__code__.co_name == "forward"
                              and Conv1D.forward is not Conv1D.forward.__wrapped__,
                   "known": [rewrites._is_conv1d_forward(f) for f in (Conv1D.forward, Conv1D.forward.__wrapped__)],
                   "sites": rewrites._sites_check(torch)(holder, ("proj",), torch.device("cpu")),
                   "cpu": node, "compiled": all(torch.equal(a, b) for a, b in zip(eager, compiled)),
                   "scripted": torch.equal(scripted(x), m(x))}}))
""", TORCHFUSE_LIB_DIR=str(MAIN_LIB.parent), TORCHFUSE_LOG="info"))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "rewrite linear: transformers.pytorch_utils.Conv1D.forward (hf_conv1d)" in proc.stderr, proc.stderr[-2000:]
    assert out == {"wrapped": True, "known": [True, True], "sites": 1, "cpu": "ViewBackward0", "compiled": True,
                   "scripted": True}, out


def test_torch_compile_traces_torchs_linear_through_the_rewrite_whole():
    """Under torch.compile (fullgraph: a graph break would raise) the rewritten forward hands the
    trace torch's own code, with stock's values and gradients."""
    proc = check(run_python(f"""
import json, sys
sys.path.insert(0, {str(ROOT / "python")!r})
import torch, torchfuse
torchfuse.enable()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8, bias=False))
x = torch.randn(4, 5, 16, requires_grad=True)
compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
def run(m):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    return [y, *torch.autograd.grad(y.float().sum(), [x, *model.parameters()])]
print(json.dumps({{"same": all(torch.equal(a, b) for a, b in zip(run(compiled), run(model)))}}))
""", TORCHFUSE_LIB_DIR=str(MAIN_LIB.parent)))
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"same": True}
