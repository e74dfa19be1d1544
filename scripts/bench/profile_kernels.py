"""Where the time of one op call goes: the GPU kernels it launches (torch.profiler, CUDA
activity) with their mean durations, their sum, and the call's wall time per call measured with
events over back-to-back calls (sum << wall means the host or launch gaps decide, not the
kernels). Stock and torchfuse side by side, fresh random inputs rotated as in the benches.

  python3 scripts/bench/profile_kernels.py --lib-dir .dev [--only embedding,attention,norm] [--match TEXT]
"""
import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from bench_embedding import draw
from bench_common import timed_loop


def embedding_cases():
    cases = [(50304, 768, 16384, kind) for kind in ("uniform", "zipf", "equal")]
    cases += [(50304, 768, 2048, "uniform")]
    cases += [(50304, 768, 131072, kind) for kind in ("uniform", "zipf")]
    cases += [(32000, 4096, 16384, kind) for kind in ("uniform", "zipf")]
    for v, d, t, kind in cases:
        for dtype in (torch.bfloat16, torch.float32):
            def make(v=v, d=d, t=t, dtype=dtype, kind=kind):
                idx = draw(kind, v, t, None)
                grad = torch.randn(t, d, device="cuda", dtype=dtype)
                return idx, grad
            fn = lambda idx, grad, v=v: torch.ops.aten.embedding_dense_backward(grad, idx, v, -1, False)
            yield f"emb_bwd V{v} D{d} T{t} {kind} {str(dtype)[6:]}", "embedding", make, fn


def attention_cases():
    for b, h, s, d, causal in [(8, 12, 1024, 64, True), (16, 12, 512, 64, True), (4, 16, 2048, 128, True)]:
        def make(b=b, h=h, s=s, d=d):
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            return q, k, v, torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)

        def fwd(q, k, v, go, causal=causal):
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def fwd_bwd(q, k, v, go, causal=causal):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            torch.autograd.grad(out, (q, k, v), go)
        name = f"B{b} H{h} S{s} D{d}{' causal' if causal else ''}"
        yield f"attn_fwd {name}", "sdpa", make, fwd
        yield f"attn_fwd_bwd {name}", "sdpa", make, fwd_bwd


def norm_cases():
    for rows, hidden in [(16384, 768), (4096, 16384)]:
        for dtype in (torch.bfloat16,):
            def make(rows=rows, hidden=hidden, dtype=dtype):
                x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
                w = torch.randn(hidden, device="cuda", dtype=dtype)
                b = torch.randn(hidden, device="cuda", dtype=dtype)
                dy = torch.randn_like(x)
                _, mean, rstd = torch.ops.aten.native_layer_norm(x, [hidden], w, b, 1e-5)
                return x, w, b, dy, mean, rstd
            fwd = lambda x, w, b, dy, mean, rstd: torch.ops.aten.native_layer_norm(x, [x.shape[1]], w, b, 1e-5)
            bwd = lambda x, w, b, dy, mean, rstd: torch.ops.aten.native_layer_norm_backward(
                dy, x, [x.shape[1]], mean, rstd, w, b, [True, True, True])
            yield f"ln_fwd {rows}x{hidden} {str(dtype)[6:]}", "layer_norm", make, fwd
            yield f"ln_bwd {rows}x{hidden} {str(dtype)[6:]}", "layer_norm", make, bwd


def profiled(fn, inputs, calls):
    """The CUDA activity of `calls` back-to-back calls over the rotated inputs."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(*inputs[i % len(inputs)])
        torch.cuda.synchronize()
    return prof


def timeline(fn, inputs, calls=6):
    """The kernels of the last of `calls` back-to-back calls: start (µs from the first), duration
    and stream, from a chrome trace (shows whether work on two streams overlaps)."""
    prof = profiled(fn, inputs, calls)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset")), key=lambda e: e["ts"])
    per_call = len(kernels) // calls
    last = kernels[-per_call:] if per_call else []
    t0 = last[0]["ts"] if last else 0
    return [(e["ts"] - t0, e["dur"], e.get("args", {}).get("stream", "?"), e["name"]) for e in last]


def kernel_means(fn, inputs, calls):
    prof = profiled(fn, inputs, calls)
    total = defaultdict(float)
    count = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time
            count[e.name] += 1
    return {name: (total[name] / calls, count[name] / calls) for name in total}


def host_us(fn, inputs, calls=40):
    """Host time to issue one call (no sync inside: the GPU queue absorbs the kernels)."""
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(calls):
            fn(*inputs[i % len(inputs)])
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
    torch.cuda.synchronize()
    return statistics.median(samples)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib-dir", required=True)
    p.add_argument("--only", default="embedding,attention,norm")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--match", default="", help="only cases whose name contains this")
    p.add_argument("--timeline", action="store_true", help="also each kernel's start and stream, one call")
    p.add_argument("--no-lib", action="store_true", help="stock only, torchfuse not loaded")
    a = p.parse_args()
    if not a.no_lib:
        torch.ops.load_library(str(Path(a.lib_dir) / "libtorchfuse.so"))
        # Attention shapes the registry sends to stock still run our kernels here.
        torch.ops.torchfuse._serve_below_thresholds(True)
    families = dict(embedding=embedding_cases, attention=attention_cases, norm=norm_cases)
    for family in a.only.split(","):
        for name, toggle, make, fn in families[family]():
            if a.match not in name:
                continue
            inputs = [make() for _ in range(4)]
            for side in ((False,) if a.no_lib else (False, True)):
                if not a.no_lib:
                    torch.ops.torchfuse.set_enabled(toggle, side)
                for args in inputs:
                    fn(*args)
                wall = statistics.median(timed_loop(fn, inputs, 10))
                means = kernel_means(fn, inputs, a.calls)
                summed = sum(us for us, _ in means.values())
                host = host_us(fn, inputs)
                label = "torchfuse" if side else "stock, not loaded" if a.no_lib else "stock"
                print(f"{name} [{label}] wall {wall:.1f} us/call, kernels {summed:.1f} us/call, "
                      f"host {host:.1f} us/call")
                for kname, (us, per_call) in sorted(means.items(), key=lambda kv: -kv[1][0]):
                    print(f"    {us:8.1f} us  x{per_call:.0f}  {kname[:110]}")
                if a.timeline:
                    for start, dur, stream, kname in timeline(fn, inputs):
                        print(f"    at {start:8.1f} us  {dur:7.1f} us  stream {stream}  {kname[:90]}")
            if not a.no_lib:
                torch.ops.torchfuse.set_enabled(toggle, True)
            del inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
