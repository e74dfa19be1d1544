"""Host cost per call of every op torchfuse serves, at tiny shapes (the GPU's work is smaller
than the host's, so the time per call is what the host spends issuing it: dispatch, the glue,
Rust's checks and plan, the launch). Stock runs without the library loaded; each library folder
named runs with its kernels serving every shape (`_serve_below_thresholds`), and again with its
op switched off at run time (the path a call takes to stock through torchfuse).

Each side is a fresh process; rounds are interleaved over the sides; a round's number is the
least of 15 timings of 100 calls each (no sync inside a timing: what the machine adds to the
host's work is noise, never less), the table gives the median over rounds. Own ops (the rewrites' targets) have no stock column: stock has no such op.

  python3 scripts/bench/bench_host.py --libs base=.dev/base,new=.dev/new [--rounds 3] [--out DIR]
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

CALLS = 100
TIMINGS = 15


def cases():
    """(name, toggle, own op?, make): make() gives fn and its argument sets."""
    cuda = dict(device="cuda")

    def layer_norm():
        x, w, b = torch.randn(8, 64, **cuda), torch.randn(64, **cuda), torch.randn(64, **cuda)
        return lambda: F.layer_norm(x, (64,), w, b)

    def layer_norm_fwd_bwd():
        x = torch.randn(8, 64, **cuda, requires_grad=True)
        w, b = torch.randn(64, **cuda, requires_grad=True), torch.randn(64, **cuda, requires_grad=True)
        g = torch.randn(8, 64, **cuda)
        return lambda: F.layer_norm(x, (64,), w, b).backward(g)

    def rms_norm():
        x, w = torch.randn(8, 64, **cuda).bfloat16(), torch.randn(64, **cuda).bfloat16()
        return lambda: F.rms_norm(x, (64,), w, 1e-6)

    def embedding():
        w, i = torch.randn(100, 64, **cuda), torch.randint(0, 100, (8,), **cuda)
        return lambda: F.embedding(i, w)

    def embedding_bwd():
        g, i = torch.randn(8, 64, **cuda), torch.randint(0, 100, (8,), **cuda)
        return lambda: torch.ops.aten.embedding_dense_backward(g, i, 100, -1, False)

    def cross_entropy():
        logits, target = torch.randn(8, 100, **cuda), torch.randint(0, 100, (8,), **cuda)
        return lambda: F.cross_entropy(logits, target)

    def sdpa():
        q, k, v = (torch.randn(1, 2, 16, 64, **cuda).bfloat16() for _ in range(3))
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def adamw():
        params = [torch.randn(64, **cuda) for _ in range(8)]
        grads, m, v = ([torch.randn(64, **cuda) for _ in range(8)] for _ in range(3))
        steps = [torch.zeros((), **cuda) for _ in range(8)]
        return lambda: torch._fused_adamw_(params, grads, m, v, [], steps, lr=1e-3, beta1=0.9,
                                           beta2=0.999, weight_decay=0.01, eps=1e-8,
                                           amsgrad=False, maximize=False)

    def norm_to_bf16(composed, grad):
        """LayerNorm of fp32 8x64 rows, its output in bf16: torchfuse::norm_cast, or (composed)
        the composition the rewrite replaces; with grad, forward and backward."""
        def make():
            x = torch.randn(8, 64, **cuda, requires_grad=grad)
            w, b = (torch.randn(64, **cuda, requires_grad=grad) for _ in range(2))
            g = torch.randn(8, 64, **cuda).bfloat16()
            if composed:
                fn = lambda: F.layer_norm(x, (64,), w, b).to(torch.bfloat16)  # noqa: E731
            else:
                op = torch.ops.torchfuse.norm_cast.default
                fn = lambda: op(x, w, b, 1e-5, False, torch.bfloat16)  # noqa: E731
            return (lambda: fn().backward(g)) if grad else fn
        return make

    def linear_cast():
        x, w, b = torch.randn(8, 64, **cuda), torch.randn(32, 64, **cuda), torch.randn(32, **cuda)
        return lambda: torch.ops.torchfuse.linear_cast.default(x, w, b, torch.bfloat16)

    def kv_copy():
        k, v = (torch.randn(1, 2, 16, 64, **cuda).bfloat16() for _ in range(2))
        return lambda: torch.ops.torchfuse.kv_copy.default(k, v, torch.bfloat16, torch.bfloat16)

    def own(op, *shapes, dtype=torch.bfloat16, extra=()):
        def make():
            args = [torch.randn(s, **cuda).to(dtype) for s in shapes]
            fn = getattr(torch.ops.torchfuse, op)
            return lambda: fn(*args, *extra)
        return make

    yield "layer_norm fwd f32 8x64", "layer_norm", False, layer_norm
    yield "layer_norm fwd+bwd f32 8x64 (autograd)", "layer_norm", False, layer_norm_fwd_bwd
    yield "rms_norm fwd bf16 8x64", "rms_norm", False, rms_norm
    yield "embedding fwd 8 of 100x64", "embedding", False, embedding
    yield "embedding_dense_backward 8 of 100x64", "embedding", False, embedding_bwd
    yield "cross_entropy fwd 8x100", "cross_entropy", False, cross_entropy
    yield "sdpa fwd bf16 1x2x16x64 causal", "sdpa", False, sdpa
    yield "_fused_adamw_ 8 tensors of 64", "adam", False, adamw
    yield "torchfuse::gelu_tanh bf16 8x64", "gelu_tanh", True, own("gelu_tanh", (8, 64), extra=(torch.bfloat16,))
    yield "torchfuse::silu_mul bf16 8x64", "swiglu", True, own("silu_mul", (8, 64), (8, 64))
    yield "torchfuse::rotary bf16 1x2x16x64", "rotary", True, own(
        "rotary", (1, 2, 16, 64), (1, 2, 16, 64), (1, 16, 64), (1, 16, 64), extra=(1,))
    yield "layer_norm f32 8x64, then to bf16", "layer_norm", False, norm_to_bf16(True, False)
    yield "layer_norm, then to bf16, fwd+bwd (autograd)", "layer_norm", False, norm_to_bf16(True, True)
    yield "torchfuse::norm_cast f32 8x64 to bf16", "norm_cast", True, norm_to_bf16(False, False)
    yield "torchfuse::norm_cast fwd+bwd (autograd)", "norm_cast", True, norm_to_bf16(False, True)
    yield "torchfuse::linear_cast f32 8x64 by 32x64 to bf16", "linear", True, linear_cast
    yield "torchfuse::kv_copy bf16 1x2x16x64", "kv_cache", True, kv_copy


def host_us(fn):
    """The least over timings of CALLS calls, synchronised before and after each timing."""
    samples = []
    for _ in range(TIMINGS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / CALLS)
    torch.cuda.synchronize()
    return min(samples)


def worker(lib_dir):
    """{case: µs} and, with a library, {case + ' (off)': µs} and {case + ' (below)': µs}: the
    registry's thresholds kept, so a tiny call goes to stock after the selection (where its
    variant has a minimum size): served minus below is the launch and the outputs, below minus
    off the selection."""
    if lib_dir:
        torch.ops.load_library(str(Path(lib_dir) / "libtorchfuse.so"))
        torch.ops.torchfuse._serve_below_thresholds(True)
    result = {}
    for name, toggle, own_op, make in cases():
        if own_op and not lib_dir:
            continue
        fn = make()
        for _ in range(20):  # compiles the kernels, warms the caches
            fn()
        result[name] = host_us(fn)
        if lib_dir:
            torch.ops.torchfuse.set_enabled(toggle, False)
            fn()
            result[name + " (off)"] = host_us(fn)
            torch.ops.torchfuse.set_enabled(toggle, True)
            torch.ops.torchfuse._serve_below_thresholds(False)
            fn()
            result[name + " (below)"] = host_us(fn)
            torch.ops.torchfuse._serve_below_thresholds(True)
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--libs", required=True, help="label=DIR,label=DIR")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker is not None:
        print(json.dumps(worker(a.worker)))
        return
    sides = [("stock", "")] + [tuple(s.split("=", 1)) for s in a.libs.split(",")]
    runs = {label: [] for label, _ in sides}
    for _ in range(a.rounds):
        for label, lib_dir in sides:
            out = subprocess.run([sys.executable, __file__, "--libs", a.libs, "--worker", lib_dir],
                                 check=True, capture_output=True, text=True).stdout
            runs[label].append(json.loads(out.strip().splitlines()[-1]))
    libs = [label for label, _ in sides[1:]]

    def median(label, key):
        values = [r[key] for r in runs[label] if key in r]
        return f"{statistics.median(values):.1f}" if values else "–"

    from bench_common import write_report  # beside this script
    rows = [f"# Host µs per call at tiny shapes ({torch.cuda.get_device_name()})", "",
            f"`python3 scripts/bench/bench_host.py --libs {a.libs} --rounds {a.rounds}`: median over "
            f"{a.rounds} interleaved rounds (a process per side and round) of the least of "
            f"{TIMINGS} timings of {CALLS} calls. 'off': the op switched off at run time "
            "(the call goes to stock through torchfuse); 'below': the registry's size thresholds "
            "kept (a tiny call goes to stock after the kernel selection, where its variant has "
            "a minimum size).", "",
            "| call | stock | " + " | ".join(f"{l} | {l} off | {l} below" for l in libs) + " |",
            "|---|---|" + "---|---|---|" * len(libs)]
    for name, *_ in cases():
        rows.append(f"| {name} | {median('stock', name)} | "
                    + " | ".join(f"{median(l, name)} | {median(l, name + ' (off)')} | "
                                 f"{median(l, name + ' (below)')}" for l in libs) + " |")
    write_report(rows, a.out, "bench_host.md")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
