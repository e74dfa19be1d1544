"""scaled_dot_product_attention benchmark per docs/testing.md ("Benchmarks") (issue 6): torchfuse's kernels vs
stock's default choice and each of stock's backends (flash, efficient, cuDNN), forward and
forward+backward, in one process (torch.ops.torchfuse.set_enabled), CUDA events, warm-up,
medians of interleaved rounds, fresh random inputs rotated. The roofline is the bf16 matmul
peak measured in the same run. FLOPs: forward 4·B·H·S²·D (halved when causal), forward plus
backward 3.5 times that.

  --small  also the small shapes the registry's thresholds come from
  --long   instead, the long-row shapes (S 4096-16384): would a length key in the registry pay?
           (docs/bench/attention/h100-attention-long.md: no)
  --quick  the GPT-2 shape only (a smoke run)
  --fwd-only  time the forward only
  --head-dim D  only the shapes of head dim D
  --graph  time CUDA-graph replays of the calls (GPU time only) instead of the calls
  --deterministic  with torch.use_deterministic_algorithms(True): stock's default is then
           FlashAttention-2 with its deterministic backward (cuDNN's is not deterministic),
           and `kernel` is what the registry routes (every size on sm 90)
On sm 90 the persistent-forward variants (registry/attention.toml *_persistent) are timed
beside, forced by name (`persistent`).
  --sweep  also time the launch-shape candidates of SWEEP (forced by name through
           TORCHFUSE_REGISTRY_EXTRA + torch.ops.torchfuse._force_variant); the results are what
           registry/attention.toml's params come from
"""
import argparse
import contextlib
import json
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_common import capture_graph, matmul_peak, replay_times, timed_loop

# (B, H, S, D, causal) of issue 6.
SHAPES = [(8, 12, 1024, 64, True), (16, 12, 512, 64, True), (4, 16, 2048, 128, True),
          (2, 32, 4096, 128, True), (8, 16, 1024, 128, False), (1, 16, 8192, 128, True)]
SMALL = [(1, 12, 128, 64, True), (4, 12, 256, 64, True), (8, 12, 512, 64, False),
         (2, 16, 256, 128, True), (4, 16, 512, 128, False), (8, 12, 2048, 64, True),
         (4, 12, 4096, 64, True), (2, 16, 4096, 128, False),
         (1, 12, 128, 64, False), (4, 12, 256, 64, False), (2, 16, 256, 128, False),
         (1, 16, 512, 128, False)]
# Long rows (whether the call's length, not only its size, decides who is faster).
LONG = [(2, 16, 8192, 128, True), (1, 32, 8192, 128, True), (1, 16, 16384, 128, True),
        (1, 16, 8192, 128, False), (1, 12, 8192, 64, True), (2, 12, 8192, 64, True),
        (1, 12, 16384, 64, True), (1, 16, 12288, 128, True), (4, 16, 4096, 128, True)]
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}
ATEN_FWD = "_scaled_dot_product_flash_attention"
# Launch-shape candidates per head dim (kernels/attention.cu parameters).
SWEEP = {
    64: [dict(FWD_M_TILES=1, FWD_BLOCK_N=64, BWD_BLOCK_Q=64, DQ_BLOCK_N=64),
         dict(FWD_M_TILES=2, FWD_BLOCK_N=64, BWD_BLOCK_Q=64, DQ_BLOCK_N=64, FWD_MIN_BLOCKS=2),
         dict(FWD_M_TILES=1, FWD_BLOCK_N=64, FWD_MIN_BLOCKS=3, BWD_BLOCK_Q=64, DQ_BLOCK_N=64,
              BWD_MIN_BLOCKS=2),
         dict(FWD_WARPS=8, FWD_BLOCK_N=64, BWD_WARPS=8, BWD_BLOCK_Q=64, DQ_BLOCK_N=64),
         dict(FWD_BLOCK_N=128, BWD_BLOCK_Q=32, DQ_BLOCK_N=32, BWD_MIN_BLOCKS=3),
         dict(FWD_M_TILES=2, FWD_BLOCK_N=32, FWD_MIN_BLOCKS=2, BWD_M_TILES=2, BWD_BLOCK_Q=32,
              DQ_BLOCK_N=32, BWD_MIN_BLOCKS=2),
         dict(FWD_M_TILES=2, FWD_BLOCK_N=64, FWD_MIN_BLOCKS=2, BWD_WARPS=8, BWD_BLOCK_Q=32,
              DQ_BLOCK_N=32),
         # Warpgroup MMA forward (sm_90a), the backward as the registry's.
         dict(FWD_WGMMA=1, FWD_WARPS=4, FWD_BLOCK_N=128, FWD_MIN_BLOCKS=2),
         dict(FWD_WGMMA=1, FWD_WARPS=4, FWD_BLOCK_N=128, FWD_MIN_BLOCKS=2, FWD_STAGES=3),
         dict(FWD_WGMMA=1, FWD_WARPS=4, FWD_BLOCK_N=64, FWD_MIN_BLOCKS=3, FWD_STAGES=4),
         dict(FWD_WGMMA=1, FWD_WARPS=8, FWD_BLOCK_N=64, FWD_MIN_BLOCKS=2, FWD_STAGES=3),
         dict(FWD_WGMMA=1, FWD_WARPS=8, FWD_BLOCK_N=128, FWD_STAGES=3),
         # TMA loads by a producer warpgroup (FWD_TMA).
         dict(FWD_WGMMA=1, FWD_TMA=1, FWD_WARPS=8, FWD_BLOCK_N=128),
         dict(FWD_WGMMA=1, FWD_TMA=1, FWD_WARPS=8, FWD_BLOCK_N=64, FWD_STAGES=3),
         dict(FWD_WGMMA=1, FWD_TMA=1, FWD_WARPS=4, FWD_BLOCK_N=128),
         dict(FWD_WGMMA=1, FWD_TMA=1, FWD_PINGPONG=1, FWD_WARPS=8, FWD_BLOCK_N=128),
         dict(FWD_WGMMA=1, FWD_TMA=1, FWD_PINGPONG=1, FWD_WARPS=8, FWD_BLOCK_N=128, FWD_STAGES=3),
         # The warpgroup backward (BWD_WGMMA: dK/dV and dQ).
         dict(FWD_WGMMA=1, FWD_TMA=1, FWD_WARPS=8, FWD_BLOCK_N=128, BWD_WGMMA=1, BWD_BLOCK_Q=64,
              DQ_BLOCK_N=64),
         # With the mask on diagonal tiles only: ping-pong again, three computing warpgroups
         # (192 query rows), and the persistent forward of each.
         dict(FWD_WGMMA=1, FWD_TMA=1, FWD_PINGPONG=1, FWD_WARPS=8, FWD_BLOCK_N=128, BWD_WGMMA=1,
              BWD_BLOCK_Q=64, DQ_BLOCK_N=64),
         dict(FWD_WGMMA=1, FWD_TMA=1, FWD_WARPS=12, FWD_BLOCK_N=128, BWD_WGMMA=1, BWD_BLOCK_Q=64,
              DQ_BLOCK_N=64),
         dict(FWD_WGMMA=1, FWD_TMA=1, FWD_WARPS=12, FWD_BLOCK_N=64, FWD_STAGES=3, BWD_WGMMA=1,
              BWD_BLOCK_Q=64, DQ_BLOCK_N=64),
         dict(FWD_WGMMA=1, FWD_TMA=1, FWD_WARPS=8, FWD_BLOCK_N=128, FWD_PERSISTENT=1,
              BWD_WGMMA=1, BWD_BLOCK_Q=64, DQ_BLOCK_N=64),
         dict(FWD_WGMMA=1, FWD_TMA=1, FWD_WARPS=12, FWD_BLOCK_N=128, FWD_PERSISTENT=1,
              BWD_WGMMA=1, BWD_BLOCK_Q=64, DQ_BLOCK_N=64),
         dict(FWD_WGMMA=1, FWD_TMA=1, FWD_PINGPONG=1, FWD_WARPS=8, FWD_BLOCK_N=128,
              FWD_PERSISTENT=1, BWD_WGMMA=1, BWD_BLOCK_Q=64, DQ_BLOCK_N=64)],
    128: [dict(FWD_BLOCK_N=64, BWD_BLOCK_Q=32, DQ_BLOCK_N=32),
          dict(FWD_WARPS=8, FWD_BLOCK_N=64, BWD_WARPS=8, BWD_BLOCK_Q=32, DQ_BLOCK_N=32),
          dict(FWD_BLOCK_N=32, FWD_MIN_BLOCKS=2, BWD_BLOCK_Q=16, DQ_BLOCK_N=16, BWD_MIN_BLOCKS=2),
          dict(FWD_WGMMA=1, FWD_WARPS=8, FWD_BLOCK_N=64, BWD_BLOCK_Q=32, DQ_BLOCK_N=32),
          dict(FWD_WGMMA=1, FWD_WARPS=8, FWD_BLOCK_N=64, FWD_STAGES=3, BWD_BLOCK_Q=32,
               DQ_BLOCK_N=32),
          dict(FWD_WGMMA=1, FWD_WARPS=8, FWD_BLOCK_N=64, FWD_STAGES=4, BWD_BLOCK_Q=32,
               DQ_BLOCK_N=32),
          dict(FWD_WGMMA=1, FWD_WARPS=4, FWD_BLOCK_N=64, FWD_STAGES=3, BWD_BLOCK_Q=32,
               DQ_BLOCK_N=32),
          dict(FWD_WGMMA=1, FWD_WARPS=8, FWD_BLOCK_N=128, BWD_BLOCK_Q=32, DQ_BLOCK_N=32),
          # TMA loads by a producer warpgroup (FWD_TMA).
          dict(FWD_WGMMA=1, FWD_TMA=1, FWD_WARPS=8, FWD_BLOCK_N=128, BWD_BLOCK_Q=32, DQ_BLOCK_N=32),
          dict(FWD_WGMMA=1, FWD_TMA=1, FWD_WARPS=8, FWD_BLOCK_N=64, FWD_STAGES=3, BWD_BLOCK_Q=32,
               DQ_BLOCK_N=32),
          dict(FWD_WGMMA=1, FWD_TMA=1, FWD_PINGPONG=1, FWD_WARPS=8, FWD_BLOCK_N=128, BWD_BLOCK_Q=32,
               DQ_BLOCK_N=32),
          dict(FWD_WGMMA=1, FWD_TMA=1, FWD_PINGPONG=1, FWD_WARPS=8, FWD_BLOCK_N=64, FWD_STAGES=3,
               BWD_BLOCK_Q=32, DQ_BLOCK_N=32),
          # The warpgroup backward (BWD_WGMMA: dK/dV and dQ).
          dict(FWD_WGMMA=1, FWD_TMA=1, FWD_PINGPONG=1, FWD_WARPS=8, FWD_BLOCK_N=128, BWD_WGMMA=1,
               BWD_BLOCK_Q=64, DQ_BLOCK_N=64)],
}


def sweep_name(d, causal, i):
    return f"sweep_attn_d{d}_{'causal' if causal else 'full'}_{i}"


def write_sweep_registry(path):
    lines = []
    for d, candidates in SWEEP.items():
        for causal in (True, False):
            for i, params in enumerate(candidates):
                body = ", ".join(f"{k} = {v}" for k, v in {"HEAD_DIM": d, **params}.items())
                lines += ["[[variant]]", f'name = "{sweep_name(d, causal, i)}"',
                          f'op = "attention_{"causal" if causal else "full"}"',
                          'source = "attention.cu"', 'dtypes = ["bf16", "f16"]',
                          "sm = [90, 90]" if params.get("FWD_WGMMA") else "sm = [80, 90]",
                          f"hidden = [{d}, {d}]", f"params = {{ {body} }}", ""]
    Path(path).write_text("\n".join(lines))


def flops(b, h, s, d, causal):
    f = 4 * b * h * s * s * d
    return f / 2 if causal else f


def make_inputs(b, h, s, d, count, gen):
    sets = []
    for _ in range(count):
        # The [B, S, H, D] -> [B, H, S, D] views a transformer's projections give.
        q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=gen, dtype=torch.bfloat16)
                   .transpose(1, 2).requires_grad_(True) for _ in range(3))
        dout = torch.randn(b, s, h, d, device="cuda", generator=gen,
                           dtype=torch.bfloat16).transpose(1, 2)
        sets.append((q, k, v, dout))
    return sets


def fused_count():
    return json.loads(torch.ops.torchfuse.stats())["ops"].get(ATEN_FWD, {}).get("fused", 0)


def graph_times(sides, usable, fn, inputs, rounds, reps):
    """GPU time per call without the host (the per-call loop is host-bound at the small and
    GPT-2 shapes, where autograd's Python and C++ work per call is about 200 µs): each side's
    calls over all input sets captured once in a CUDA graph, replays timed with events,
    interleaved rounds. Sides that cannot be captured are left out (at B8 H12 S1024 D64
    causal the forward+backward capture failed for every side, stock's too, in the runs of
    docs/bench/attention/h100-attention-graph.md)."""
    graphs = {}
    for name, (on, below, backend, forced) in sides.items():
        if not usable[name]:
            continue
        torch.ops.torchfuse.set_enabled("sdpa", on)
        torch.ops.torchfuse._serve_below_thresholds(below)
        torch.ops.torchfuse._force_variant(forced)
        try:
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                # The backward runs on autograd's device thread.
                graphs[name] = capture_graph(fn, inputs, capture_error_mode="thread_local")
        except RuntimeError as e:
            print(f"  {name}: no graph ({str(e).splitlines()[0]})", flush=True)
    return replay_times(graphs, len(inputs), rounds, reps)


def phase_calls(causal):
    """The timed call of each phase, taking one set of make_inputs."""
    def fwd(q, k, v, dout):
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwd_bwd(q, k, v, dout):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(o, (q, k, v), dout)

    return {"fwd": fwd, "fwdbwd": fwd_bwd}


def measure(shape, gen, rounds, reps, sweep, phases, sweep_only=None, graph=False):
    b, h, s, d, causal = shape
    inputs = make_inputs(b, h, s, d, 2, gen)
    calls = phase_calls(causal)

    # side -> (torchfuse on, serve below thresholds, stock backend restriction, forced variant)
    # `kernel` is the variant that serves the shape (with deterministic algorithms required
    # every size is routed on sm 90: thresholds applied, so the *_persistent variants serve
    # the large shapes); `persistent` (sm 90) the persistent-forward variant at every shape.
    below = not torch.are_deterministic_algorithms_enabled()
    sides = {"kernel": (True, below, None, ""), "stock": (False, False, None, "")}
    if torch.cuda.get_device_capability() == (9, 0):
        persistent = f"attn_d{d}_{'causal' if causal else 'full'}_wg_persistent"
        sides["persistent"] = (True, True, None, persistent)
    sides.update({name: (False, False, be, "") for name, be in BACKENDS.items()})
    if sweep:
        for i in range(len(SWEEP[d])):
            if sweep_only is not None and i not in sweep_only:
                continue
            sides[f"sweep{i}"] = (True, True, None, sweep_name(d, causal, i))
    results = {}
    # A timing of a wrong kernel is worthless: every torchfuse side is checked against stock.
    q, k, v, dout = inputs[0]

    def grads():
        # Detached: a live autograd graph keeps q, k and v's AccumulateGrad nodes, made on the
        # default stream, and a backward captured on a side stream then fails.
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return (o.detach(), *torch.autograd.grad(o, (q, k, v), dout))

    torch.ops.torchfuse.set_enabled("sdpa", False)
    expected = grads()
    for name, (on, below, _, forced) in sides.items():
        if on:
            torch.ops.torchfuse.set_enabled("sdpa", True)
            torch.ops.torchfuse._serve_below_thresholds(below)
            torch.ops.torchfuse._force_variant(forced)
            got = grads()
            worst = max(((a.float() - e.float()).norm() / e.float().norm()).item()
                        for a, e in zip(got, expected))
            if not worst < 2e-2:
                print(f"  WRONG: {name} at {shape}: relative difference to stock {worst:.3g}")
    del expected
    for phase, fn in calls.items():
        if phase not in phases:
            continue
        times = {name: [] for name in sides}
        usable = dict.fromkeys(sides, True)

        def run(name, count):
            on, below, backend, forced = sides[name]
            torch.ops.torchfuse.set_enabled("sdpa", on)
            torch.ops.torchfuse._serve_below_thresholds(below)
            torch.ops.torchfuse._force_variant(forced)
            if backend is None:
                return timed_loop(fn, inputs, count)
            with sdpa_kernel(backend):
                return timed_loop(fn, inputs, count)

        for name in sides:  # warm-up (compiles our kernels); a backend may refuse the shape
            try:
                run(name, 2)
            except RuntimeError as e:
                usable[name] = False
                print(f"  {name} unavailable at {shape}: {str(e).splitlines()[0]}")
        if graph:
            times = graph_times(sides, usable, fn, inputs, rounds, reps)
        else:
            for _ in range(rounds):
                for name in sides:
                    if usable[name]:
                        times[name] += run(name, reps)
        torch.ops.torchfuse.set_enabled("sdpa", True)
        torch.ops.torchfuse._serve_below_thresholds(False)
        torch.ops.torchfuse._force_variant("")
        results[phase] = {n: statistics.median(t) for n, t in times.items() if t}
    # Does the registry (thresholds applied) route this shape to our kernel?
    before = fused_count()
    with torch.no_grad():
        q, k, v, _ = inputs[0]
        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    results["routed_to_kernel"] = fused_count() > before
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--long", action="store_true", help="the LONG shapes instead")
    parser.add_argument("--head-dim", type=int, default=None,
                        help="only the shapes of this head dim")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-only", default="",
                        help="with --sweep: only these candidates of SWEEP (comma-separated indices)")
    parser.add_argument("--fwd-only", action="store_true", help="time the forward only")
    parser.add_argument("--graph", action="store_true",
                        help="time CUDA-graph replays (GPU time only) instead of calls")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True) for the whole run")
    args = parser.parse_args()
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    phases = ("fwd",) if args.fwd_only else ("fwd", "fwdbwd")
    if args.sweep:
        extra = Path(args.out) / "attention_sweep.toml"
        extra.parent.mkdir(parents=True, exist_ok=True)
        write_sweep_registry(extra)
        os.environ["TORCHFUSE_REGISTRY_EXTRA"] = str(extra)
    torch.ops.load_library(str(Path(args.lib_dir) / "libtorchfuse.so"))
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() & 0xFFFFFFFF)
    peak = matmul_peak()
    device = torch.cuda.get_device_name()
    mode = ("; deterministic algorithms" if args.deterministic else "") + (
        "; CUDA-graph replays (GPU time only)" if args.graph else "")
    print(f"device: {device}; bf16 matmul peak {peak:.0f} TFLOP/s (8192^3, same run){mode}")
    shapes = SHAPES[:1] if args.quick else SHAPES + (SMALL if args.small else [])
    shapes = LONG if args.long else shapes
    shapes = [sh for sh in shapes if args.head_dim in (None, sh[3])]
    rows = []
    for shape in shapes:
        only = {int(i) for i in args.sweep_only.split(",")} if args.sweep_only else None
        r = measure(shape, gen, rounds=3 if args.quick else 5, reps=5, sweep=args.sweep,
                    phases=phases, sweep_only=only, graph=args.graph)
        f = flops(*shape[:4], shape[4])
        for phase, mult in (("fwd", 1.0), ("fwdbwd", 3.5)):
            if phase not in r:
                continue
            t = r[phase]
            if "kernel" not in t or "stock" not in t:
                print(f"{phase}: {shape}: no timing for ours or stock, left out", flush=True)
                continue
            routed = t["kernel"] if r["routed_to_kernel"] else t["stock"]
            row = {"shape": list(shape), "phase": phase, "us": t, "routed_us": routed,
                   "routed_to_kernel": r["routed_to_kernel"],
                   "tflops": {n: mult * f / (us * 1e-6) / 1e12 for n, us in t.items()}}
            rows.append(row)
            b, h, s, d, causal = shape
            name = f"B{b} H{h} S{s} D{d} {'causal' if causal else 'full'}"
            parts = " ".join(f"{n} {us:8.1f}us {row['tflops'][n]:4.0f}TF ({100 * row['tflops'][n] / peak:3.0f}%)"
                             for n, us in t.items())
            print(f"{phase:6s} {name:28s} x{t['stock'] / t['kernel']:.2f} vs stock, routed x{t['stock'] / routed:.2f} | {parts}",
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_attention.json").write_text(json.dumps(
        {"device": device, "matmul_peak_tflops": peak, "rows": rows}, indent=1))
    lines = [f"# scaled_dot_product_attention on {device}", "",
             f"bf16 matmul peak measured in the same run: {peak:.0f} TFLOP/s{mode}. "
             "`kernel` = torchfuse's kernel; `stock` = stock's default choice; ratio = stock / kernel; "
             "`routed` = what torchfuse runs after the registry's thresholds.", "",
             "`persistent` = the persistent-forward variant (sm 90) forced.", "",
             "| shape | phase | kernel µs (% peak) | stock µs (% peak) | kernel vs stock | routed vs stock | persistent µs (% peak) | flash µs | efficient µs | cudnn µs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        b, h, s, d, causal = row["shape"]
        t, tf = row["us"], row["tflops"]
        def cell(n):
            return f"{t[n]:.1f} ({100 * tf[n] / peak:.0f}%)" if n in t else "n/a"
        lines.append(f"| B{b} H{h} S{s} D{d} {'causal' if causal else 'full'} | {row['phase']} | "
                     f"{cell('kernel')} | {cell('stock')} | {t['stock'] / t['kernel']:.2f}x | "
                     f"{t['stock'] / row['routed_us']:.2f}x | {cell('persistent')} | {cell('flash')} | "
                     f"{cell('efficient')} | {cell('cudnn')} |")
    (out / "bench_attention.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
