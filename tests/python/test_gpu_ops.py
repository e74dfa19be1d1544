"""The standard GPU checks, run on every op torchfuse serves (the GPU half of the op template;
test_traced_ops.py is the CPU half): one record per op in CASES, at a shape our kernels serve
(forced past the registry's thresholds), and each check runs over every record:

- CUDA-graph capture: the forward and backward captured, replayed on new data, give bitwise
  what eager gives on that data, and our kernels ran inside the capture;
- deterministic mode (torch.use_deterministic_algorithms): our kernels serve, bitwise
  reproducibly, within the contract of stock's result;
- more than 2^31 elements: served, and within the contract of stock's result (64-bit offsets);
- bad input: the error stock gives (the same exception type, torchfuse on and off).

A record's `make()` gives fresh inputs (leaves needing grad, then the outputs' grads), `run`
the outputs and gradients of one call, `big()` inputs past 2^31 elements (or a string: where
that is tested instead), `bad` makers of inputs stock refuses. Every toggle of the op catalog,
and every forward op torchfuse defines, needs a record: test_every_op_has_a_record fails
otherwise (it runs on CPU too)."""
import contextlib
import re
import tomllib
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import ROOT, requires_cuda
from gpu_util import enabled, fused_count, load_torchfuse, stock_reasons

BF16 = torch.bfloat16
BIG = 2**31
# Within the contract of stock's result: a few roundings of the output's dtype apart.
TOL = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def randn(*shape, dtype=BF16, grad=False):
    return torch.randn(shape, device="cuda", dtype=dtype).requires_grad_(grad)


def grads(outs, leaves, out_grads):
    """Outputs, then the gradients of the leaves for the outputs' grads."""
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    return outs + list(torch.autograd.grad(outs, leaves, out_grads))


def with_out_grads(leaves, *others, outs):
    """A call's inputs: its leaves, other arguments, and random grads shaped as `outs`."""
    return [*leaves, *others, *(randn(*o.shape, dtype=o.dtype) for o in outs)]


@dataclass
class Case:
    toggle: str
    ops: tuple  # the stats names of the entries the call reaches (forward, backward)
    make: Callable  # () -> inputs
    run: Callable  # (*inputs) -> outputs and grads
    big: object  # () -> inputs past 2^31 elements, or where that is tested instead
    bad: list = field(default_factory=list)  # makers of inputs stock raises on
    forward: Callable = None  # (*inputs) -> outputs: the call bad inputs take (default: run)
    stock_kernel: Callable = contextlib.nullcontext  # the stock kernel ours stands for
    # A torchfuse op the call goes through that routes it to the aten op of `ops`, whose
    # override counts it (hf_rms_norm -> aten::rms_norm): a call is counted once.
    routes: str = ""


def norm_case(toggle, ops, norm, bias, routes=""):
    def make(rows=4096, width=1024):
        x, w = randn(rows, width, grad=True), randn(width, grad=True)
        leaves = [x, w] + ([randn(width, grad=True)] if bias else [])
        return with_out_grads(leaves, outs=[x])

    def run(x, w, *rest):
        leaves = [x, w, *rest[:-1]]
        return grads(norm(x, w, *rest[:-1]), leaves, rest[-1:])

    bad = [lambda: [randn(8, 64), randn(65), *([randn(64)] if bias else []), randn(8, 64)]]  # weight's size
    return Case(toggle, ops, make, run, lambda: make(BIG // 1024 + 1, 1024), bad,
                forward=lambda x, w, *rest: norm(x, w, *rest[:-1]), routes=routes)


def rotary_make(b=2, s=1024, heads=8, kv_heads=8):
    q, k = randn(b, heads, s, 64, grad=True), randn(b, kv_heads, s, 64, grad=True)
    cos, sin = randn(b, s, 64), randn(b, s, 64)
    return [q, k, cos, sin, randn(*q.shape), randn(*k.shape)]


def rotary_run(q, k, cos, sin, dq, dk, interleaved=False):
    return grads(torch.ops.torchfuse.rotary(q, k, cos, sin, 1, interleaved), (q, k), (dq, dk))


def rotary_case(interleaved):
    """torchfuse::rotary in the rotate-half layout, or the interleaved one (GLM's pairs)."""
    return Case(
        "rotary", ("torchfuse::rotary", "torchfuse::rotary_backward"), make=rotary_make,
        run=lambda *inputs: rotary_run(*inputs, interleaved=interleaved),
        # q past 2^31 elements, k of one head (GQA): 17 GiB in all.
        big=lambda: rotary_make(b=1, s=BIG // (8 * 64) + 1, kv_heads=1),
        bad=[lambda: [randn(2, 8, 16, 64), randn(2, 8, 16, 64), randn(2, 5, 64), randn(2, 5, 64), None, None]],
        forward=lambda q, k, cos, sin, *_: torch.ops.torchfuse.rotary(q, k, cos, sin, 1, interleaved))


def kv_make(b=2, s=1024, heads=8, d=64, out=BF16):
    """GPT-2's K and V: transposed views of one packed projection's output (the leaf), and the
    outputs' grads (in `out`, the cache's dtype)."""
    kv = randn(b, s, 2 * heads * d, grad=True)
    return [kv, randn(b, heads, s, d, dtype=out), randn(b, heads, s, d, dtype=out)]


def kv_views(kv, heads):
    b, s, _ = kv.shape
    return [t.view(b, s, heads, -1).transpose(1, 2) for t in kv.chunk(2, dim=-1)]


def kv_copy_case(out):
    """torchfuse::kv_copy (HF's first KV-cache append), bf16 K and V kept (`out` bf16) or widened
    to an fp32 cache."""
    def forward(kv, dk=None, dv=None, dtype=out):
        return torch.ops.torchfuse.kv_copy(*kv_views(kv, 8), dtype, dtype)

    return Case(
        "kv_cache", ("torchfuse::kv_copy",), make=lambda: kv_make(out=out),
        run=lambda kv, dk, dv: grads(forward(kv), [kv], [dk, dv]),
        # K past 2^31 elements (and V): 8.6 GB of projection.
        big=lambda: kv_make(b=1, s=BIG // (8 * 64) + 1, out=out),
        bad=[lambda: [randn(2, 16, 2 * 8 * 64), None, None, torch.qint8]],  # a dtype no copy makes
        forward=forward)


def adamw_make(sizes=(4096, 65536, 1 << 20)):
    params = [randn(n, dtype=torch.float32) for n in sizes]
    return [params, [randn(n, dtype=torch.float32) for n in sizes],
            [randn(n, dtype=torch.float32) * 0.01 for n in sizes],
            [torch.rand(n, device="cuda") * 1e-4 for n in sizes], [torch.tensor(5.0, device="cuda") for _ in sizes]]


def adamw_run(params, grads_, exp_avgs, exp_avg_sqs, steps):
    """One fused AdamW step on copies: the updated parameters and moments."""
    p, m, v = ([t.clone() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs))
    torch._fused_adamw_(p, grads_, m, v, [], steps, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01,
                        eps=1e-8, amsgrad=False, maximize=False)
    return p + m + v


def sdpa_make(b=8, heads=12, s=1024):
    q, k, v = (randn(b, heads, s, 64, grad=True) for _ in range(3))
    return [q, k, v, randn(b, heads, s, 64)]


def sdpa_run(q, k, v, dout):
    return grads(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), [dout])


def unary_case(toggle, ops, fn, make_x, bad):
    def make(rows=4096, width=4096):
        x = make_x(rows, width)
        return with_out_grads([x], outs=[fn(x.detach())])

    return Case(toggle, ops, make, lambda x, dy: grads(fn(x), [x], [dy]),
                lambda: make(BIG // 4096 + 1, 4096), bad, forward=lambda x, *_: fn(x))


def gated_case(name):
    """A gated MLP's pointwise op (silu_mul, gelu_tanh_mul): act(gate) * up."""
    def op(gate, up):
        return getattr(torch.ops.torchfuse, name)(gate, up)

    def make(rows=4096, width=4096):
        return [randn(rows, width, grad=True), randn(rows, width, grad=True), randn(rows, width)]

    return Case("swiglu", (f"torchfuse::{name}", f"torchfuse::{name}_backward"), make=make,
                run=lambda gate, up, dy: grads(op(gate, up), [gate, up], [dy]),
                big=lambda: make(BIG // 4096 + 1, 4096),
                bad=[lambda: [randn(8, 64), randn(8, 63), randn(8, 64)]],  # not broadcastable
                forward=lambda gate, up, _: op(gate, up))


def norm_cast_case():
    """torchfuse::norm_cast: LayerNorm of fp32 rows written in bf16 (its backward from bf16)."""
    def norm(x, w, b):
        return torch.ops.torchfuse.norm_cast(x, w, b, 1e-5, False, BF16)

    def make(rows=4096, width=1024):
        f32 = torch.float32
        return [randn(rows, width, dtype=f32, grad=True), randn(width, dtype=f32, grad=True),
                randn(width, dtype=f32, grad=True), randn(rows, width)]

    return Case(
        "norm_cast", ("torchfuse::norm_cast", "torchfuse::norm_cast_backward"), make=make,
        run=lambda x, w, b, dy: grads(norm(x, w, b), [x, w, b], [dy]),
        big=lambda: make(BIG // 1024 + 1, 1024),
        bad=[lambda: [randn(8, 64, dtype=torch.float32), randn(65, dtype=torch.float32),
                      randn(64, dtype=torch.float32), randn(8, 64)]],  # the weight's size
        forward=lambda x, w, b, _: norm(x, w, b))


CASES = {
    "layer_norm": norm_case("layer_norm", ("native_layer_norm", "native_layer_norm_backward"),
                            lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b), bias=True),
    "rms_norm": norm_case("rms_norm", ("_fused_rms_norm", "_fused_rms_norm_backward"),
                          lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-6), bias=False),
    "hf_rms_norm": norm_case("hf_rms_norm", ("_fused_rms_norm", "_fused_rms_norm_backward"),
                             lambda x, w: torch.ops.torchfuse.hf_rms_norm(x, w, 1e-6), bias=False,
                             routes="torchfuse::hf_rms_norm"),
    "embedding": Case(
        "embedding", ("embedding", "embedding_dense_backward"),
        make=lambda rows=16384: with_out_grads([randn(50304, 768, grad=True)],
                                               torch.randint(0, 50304, (rows,), device="cuda"),
                                               outs=[torch.empty(rows, 768, dtype=BF16)]),
        run=lambda w, idx, dy: grads(F.embedding(idx, w), [w], [dy]),
        big="test_gpu_embedding.py::test_over_2_31_elements (an output past 2^31 elements)",
        bad=[lambda: [randn(100, 64), torch.zeros(8, device="cuda"), randn(8, 64)]],  # float indices
        forward=lambda w, idx, dy: F.embedding(idx, w)),
    "adam": Case(
        "adam", ("_fused_adamw_",), make=adamw_make, run=adamw_run,
        big="test_gpu_adam.py::test_a_tensor_of_more_than_2_to_the_31_elements (compares pieces: whole "
            "copies of a parameter's four buffers would take 34 GiB)",
        bad=[lambda: (lambda p, g, m, v, s: [p, g[:1], m, v, s])(*adamw_make((64, 64)))]),  # lists' lengths differ
    "sdpa": Case(
        "sdpa", ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"),
        make=sdpa_make, run=sdpa_run, big=lambda: sdpa_make(b=BIG // (12 * 128 * 64) + 1, s=128),
        bad=[lambda: [randn(2, 8, 128, 64), randn(2, 8, 128, 64, dtype=torch.float32), randn(2, 8, 128, 64),
                      None]],  # dtypes differ (other head dims: test_gpu_attention.py, stock crashes)
        forward=lambda q, k, v, _: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        # Stock's flash, whose output formats ours keep (its default choice on Hopper, cuDNN,
        # returns another layout at some shapes, as its choice differs by GPU).
        stock_kernel=lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
    "gelu_tanh": unary_case("gelu_tanh", ("torchfuse::gelu_tanh", "torchfuse::gelu_tanh_backward"),
                            lambda x: torch.ops.torchfuse.gelu_tanh(x, None),
                            lambda rows, width: randn(rows, width, grad=True),
                            bad=[lambda: [torch.ones(8, 64, dtype=torch.long, device="cuda"), None]]),  # integers
    "cross_entropy_loss": Case(
        "cross_entropy", ("cross_entropy_loss",),
        make=lambda rows=4096, vocab=50304: with_out_grads(
            [randn(rows, vocab, grad=True)], torch.randint(0, vocab, (rows,), device="cuda"),
            outs=[torch.empty((), dtype=BF16)]),
        run=lambda logits, target, dy: grads(F.cross_entropy(logits, target), [logits], [dy]),
        big="test_gpu_cross_entropy.py::test_large_vocabulary_and_many_rows",
        bad=[lambda: [randn(8, 100), torch.zeros(9, dtype=torch.long, device="cuda"), randn()]],
        forward=lambda logits, target, _: F.cross_entropy(logits, target)),
    "cross_entropy": Case(
        "cross_entropy", ("torchfuse::cross_entropy", "torchfuse::cross_entropy (backward)"),
        make=lambda rows=4096, vocab=50304: [randn(rows, vocab, grad=True),
                                             torch.randint(0, vocab, (rows,), device="cuda"),
                                             randn(dtype=torch.float32)],
        run=lambda logits, target, dy: grads(
            torch.ops.torchfuse.cross_entropy(logits, target, 1, -100, 0.0, torch.float32), [logits], [dy]),
        big="test_gpu_cross_entropy.py::test_large_vocabulary_and_many_rows",
        bad=[lambda: [randn(8, 100), torch.zeros(9, dtype=torch.long, device="cuda"), randn()]],
        forward=lambda logits, target, _: torch.ops.torchfuse.cross_entropy(logits, target, 1, -100, 0.0,
                                                                            torch.float32)),
    "silu_mul": gated_case("silu_mul"),
    "gelu_tanh_mul": gated_case("gelu_tanh_mul"),
    "silu_mul_packed": Case(
        "swiglu", ("torchfuse::silu_mul_packed", "torchfuse::silu_mul_packed_backward"),
        make=lambda rows=4096, width=4096: [randn(rows, 2 * width, grad=True), randn(rows, width)],
        run=lambda gate_up, dy: grads(torch.ops.torchfuse.silu_mul_packed(gate_up), [gate_up], [dy]),
        big=lambda: [randn(BIG // 4096 + 1, 8192, grad=True), randn(BIG // 4096 + 1, 4096)],
        bad=[lambda: [randn(8, 63), randn(8, 31)]],  # an odd width: chunk's halves differ
        forward=lambda gate_up, _: torch.ops.torchfuse.silu_mul_packed(gate_up)),
    "rotary": rotary_case(interleaved=False),
    "rotary_interleaved": rotary_case(interleaved=True),
    "norm_cast": norm_cast_case(),
    "kv_copy": kv_copy_case(BF16),
    "column_sum": Case(
        "column_sum", ("sum.dim_IntList",),
        # GPT-2's MLP bias gradient at B8 S1024 (no backward of its own: sum's is an expand).
        make=lambda rows=8192, cols=3072: [randn(rows, cols)],
        run=lambda x: [x.sum(0, keepdim=True)],
        big=lambda: [randn(BIG // 768 + 1, 768)],
        bad=[lambda: [randn(8, 64)]],
        forward=lambda x: x.sum((0, 0))),  # a dim repeated
    "kv_copy_wide": kv_copy_case(torch.float32),
    "linear": Case(
        "linear", ("torchfuse::linear_cast",),
        # A Linear under bf16 autocast: a bf16 input, its fp32 weight and bias cast in the node.
        make=lambda rows=4096: [randn(rows, 1024, grad=True), randn(2048, 1024, dtype=torch.float32, grad=True),
                                randn(2048, dtype=torch.float32, grad=True), randn(rows, 2048)],
        run=lambda x, w, b, dy: grads(torch.ops.torchfuse.linear_cast(x, w, b, BF16), [x, w, b], [dy]),
        big=lambda: [randn(BIG // 1024 + 1, 1024, grad=True), randn(8, 1024, dtype=torch.float32, grad=True),
                     randn(8, dtype=torch.float32, grad=True), randn(BIG // 1024 + 1, 8)],
        bad=[lambda: [randn(8, 64), randn(16, 63, dtype=torch.float32), None, None]],  # in-features differ
        forward=lambda x, w, b, _: torch.ops.torchfuse.linear_cast(x, w, b, BF16)),
    "mixed_add": Case(
        "mixed_add", ("add.Tensor",),
        # GPT-2's residual add at B8 S1024: the fp32 stream plus a projection's bf16 output (no
        # backward of its own: add's gradient is the incoming one, cast for the bf16 input).
        make=lambda rows=8192, cols=768: [randn(rows, cols, dtype=torch.float32, grad=True),
                                          randn(rows, cols, grad=True), randn(rows, cols, dtype=torch.float32)],
        run=lambda stream, out, dy: grads(stream + out, [stream, out], [dy]),
        big=lambda: [randn(BIG // 768 + 1, 768, dtype=torch.float32, grad=True),
                     randn(BIG // 768 + 1, 768, grad=True), randn(BIG // 768 + 1, 768, dtype=torch.float32)],
        bad=[lambda: [randn(8, 64, dtype=torch.float32), randn(8, 63), None]],  # shapes that do not broadcast
        forward=lambda stream, out, _: stream + out),
    "mixed_copy": Case(
        "mixed_add", ("copy_",),
        # A Linear's bf16 weight gradient cast back to its fp32 parameter's dtype (GPT-2's c_fc);
        # its own backward narrows, stock's vectorized cast.
        make=lambda rows=3072, cols=768: [randn(rows, cols, grad=True), randn(rows, cols, dtype=torch.float32)],
        run=lambda x, dy: grads(x.float(), [x], [dy]),
        big=lambda: [randn(BIG // 768 + 1, 768, grad=True), randn(BIG // 768 + 1, 768, dtype=torch.float32)],
        bad=[lambda: [randn(8, 64), randn(8, 63, dtype=torch.float32)]],  # sizes that do not broadcast
        forward=lambda x, dy: torch.empty_like(dy).copy_(x)),
}


def catalog():
    return tomllib.loads((ROOT / "src" / "catalog.toml").read_text())


def test_every_op_has_a_record():
    """Every toggle of the catalog that switches an op, and every forward op of torchfuse's own,
    has a record here (shared_cast, a rewrite calling no op of its own, switches none)."""
    cat = catalog()
    toggles = {e["toggle"] for e in cat["entry"]}
    assert toggles - {c.toggle for c in CASES.values()} == set(), "toggles without a record"
    own = {e["op"] for e in cat["entry"] if re.fullmatch(r"torchfuse::\w+", e["op"])}
    forward = {op for op in own if not op.endswith("_backward")}
    recorded = {op for c in CASES.values() for op in (*c.ops, c.routes) if op}
    assert forward - recorded == set(), "torchfuse ops without a record"
    assert recorded - {e["op"] for e in cat["entry"]} == set(), "records naming no catalog entry"


@pytest.fixture(scope="module")
def served_everywhere():
    load_torchfuse()
    torch.ops.torchfuse._serve_below_thresholds(True)
    yield
    torch.ops.torchfuse._serve_below_thresholds(False)


def counts(case):
    return [fused_count(op) for op in case.ops]


def assert_served(case, before, what):
    after = counts(case)
    assert all(a > b for a, b in zip(after, before)), (
        what, case.ops, before, after, {op: stock_reasons(op) for op in case.ops})


def stock(case, inputs, kernel=True):
    """Stock's result (the kernel ours stands for, or with kernel=False stock's own choice)."""
    with enabled(case.toggle, False), case.stock_kernel() if kernel else contextlib.nullcontext():
        return case.run(*inputs)


def chunked_rel_err(out, ref, chunk=1 << 26):
    """rel_err of tensors too large for float64 copies of the whole (on the GPU, a chunk at a
    time)."""
    out, ref = out.reshape(-1), ref.reshape(-1)
    diff = norm = 0.0
    for i in range(0, out.numel(), chunk):
        a, b = out[i:i + chunk].cuda().double(), ref[i:i + chunk].cuda().double()
        diff += (a - b).square().sum().item()
        norm += b.square().sum().item()
    return (diff / norm) ** 0.5 if norm > 0 else diff ** 0.5


def assert_within_contract(ours, theirs, what):
    assert len(ours) == len(theirs), what
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), (what, i)
        err = chunked_rel_err(a, b)
        assert err <= TOL[a.dtype], (what, i, err)


@requires_cuda
@pytest.mark.usefixtures("served_everywhere")
@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_graph_capture(name):
    case = CASES[name]
    static = case.make()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles the kernels) outside the capture
        case.run(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph, before = torch.cuda.CUDAGraph(), counts(case)
    with torch.cuda.graph(graph):
        captured = case.run(*static)
    assert_served(case, before, "captured")
    for _ in range(2):
        fresh = case.make()
        with torch.no_grad():
            for s, f in zip(flat(static), flat(fresh)):
                s.copy_(f)
        graph.replay()
        eager = case.run(*fresh)
        torch.cuda.synchronize()
        assert all(torch.equal(c, e) for c, e in zip(captured, eager)), name


def flat(inputs):
    return [t for x in inputs for t in (x if isinstance(x, list) else [x]) if t is not None]


@requires_cuda
@pytest.mark.usefixtures("served_everywhere")
@pytest.mark.parametrize("name", sorted(CASES))
def test_deterministic_mode(name):
    case = CASES[name]
    inputs = case.make()
    torch.use_deterministic_algorithms(True)
    try:
        before = counts(case)
        first = case.run(*inputs)
        assert_served(case, before, "deterministic mode")
        again = case.run(*inputs)
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(first, again)), f"{name}: not reproducible"
    assert_within_contract(first, stock(case, inputs), name)


@requires_cuda
@pytest.mark.usefixtures("served_everywhere")
@pytest.mark.parametrize("name", sorted(CASES))
def test_more_than_2_31_elements(name):
    case = CASES[name]
    if isinstance(case.big, str):
        pytest.skip(f"tested in {case.big}")
    free, _ = torch.cuda.mem_get_info()
    if free < (40 << 30):
        pytest.skip(f"needs 40 GiB free on the GPU, {free / 2**30:.0f} free")
    if name == "sdpa" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("stock's default SDPA elsewhere is its flash, which faults past 2^31 elements")
    torch.cuda.empty_cache()
    inputs = case.big()
    assert max(t.numel() for t in flat(inputs)) > BIG
    before = counts(case)
    ours = [t.cpu() for t in case.run(*inputs)]  # host copies: room for stock's run
    assert_served(case, before, "past 2^31 elements")
    # Stock's own choice: its flash faults past 2^31 elements (an illegal address at B32769
    # H8 S128 D64 on an H200, torch 2.11), its default on Hopper (cuDNN) does not.
    theirs = stock(case, inputs, kernel=False)
    del inputs
    assert_within_contract(ours, [t.cpu() for t in theirs], name)


@requires_cuda
@pytest.mark.usefixtures("served_everywhere")
@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_gets_stocks_error(name):
    case = CASES[name]
    assert case.bad, f"{name}: no bad input recorded"
    call = case.forward or case.run
    for make in case.bad:
        inputs = make()
        with pytest.raises(Exception) as theirs:
            with enabled(case.toggle, False):
                call(*inputs)
        with pytest.raises(Exception) as ours:
            call(*inputs)
        assert type(ours.value) is type(theirs.value), (name, ours.value, theirs.value)
