"""torchfuse::norm_cast's RMSNorm (fp32 rows written in bf16; its backward reads the bf16
gradient) against what it replaces: the norm, then autocast's cast to bf16 (in the backward, the
cast back to fp32, then the norm's backward). Every candidate launch shape of the forward is
timed narrowed, forced by name (bench_norm.py's sweep candidates), and the registry's own
choice (where the plain fp32 forward is stock's, up to 1024 columns or below a variant's
min_rows, a narrowed_only variant or none). CUDA-graph replays over input sets larger than L2,
interleaved rounds, medians; copy bandwidth of this run beside them.

  python3 scripts/bench/bench_norm_cast.py --lib-dir DIR [--out DIR]
"""
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from bench_common import capture_graph, copy_bandwidth, replay_times, write_report
from bench_norm import candidates, variant_name, write_sweep_registry

SHAPES = [(4096, 896), (4096, 1024), (8192, 1024), (16384, 1024), (16384, 768), (4096, 2048), (8192, 2048)]
EPS, BF16 = 1e-6, torch.bfloat16
L2_BYTES = 64 << 20


def input_sets(n, h):
    sets = max(2, -(-4 * L2_BYTES // (n * h * 4)))
    out = []
    for _ in range(sets):
        x = torch.randn(n, h, device="cuda")
        w = torch.rand(h, device="cuda") + 0.5
        dy = torch.randn(n, h, device="cuda", dtype=BF16)
        _, rstd = torch.ops.aten._fused_rms_norm(x, [h], w, EPS)
        out.append((x, w, dy, rstd))
    return out


def norm_then_cast(h):
    return lambda x, w, dy, rstd: torch.ops.aten._fused_rms_norm(x, [h], w, EPS)[0].to(BF16)


def norm_cast(x, w, dy, rstd):
    return torch.ops.torchfuse.norm_cast(x, w, None, EPS, True, BF16)


def cast_then_backward(h):
    return lambda x, w, dy, rstd: torch.ops.aten._fused_rms_norm_backward(dy.float(), x, [h], rstd, w, [True, True])


def norm_cast_backward(x, w, dy, rstd):
    return torch.ops.torchfuse.norm_cast_backward(dy, x, None, rstd, w, None, True, 3)


def norm_cast_kernels():
    """{kernel: calls} of norm_cast's forward and (named "bwd <kernel>") backward so far."""
    ops = json.loads(torch.ops.torchfuse.stats())["ops"]
    forward = ops.get("torchfuse::norm_cast", {}).get("kernels", {})
    backward = ops.get("torchfuse::norm_cast_backward", {}).get("kernels", {})
    return forward | {"bwd " + k: v for k, v in backward.items()}


def timed(sides, inputs):
    """{label: median µs per call} of each (label, fn, forced variant) side, and the kernels the
    side's norm_cast call ran ("stock" where none)."""
    graphs, ran = {}, {}
    for label, fn, forced in sides:
        torch.ops.torchfuse._force_variant(forced)
        before = norm_cast_kernels()
        fn(*inputs[0])
        after = norm_cast_kernels()
        ran[label] = ",".join(k for k in after if after[k] != before.get(k, 0)) or "stock"
        graphs[label] = capture_graph(fn, inputs)
    torch.ops.torchfuse._force_variant("")
    times = replay_times(graphs, len(inputs), rounds=5, reps=10)
    return {label: statistics.median(t) for label, t in times.items()}, ran


def ulps_apart(a, b):
    """How many bf16 elements differ, and by at most how many units in the last place."""
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    diff = (ai - bi).abs()
    return int((diff != 0).sum()), int(diff.max())


def main():
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--lib-dir", required=True)
    p.add_argument("--out")
    a = p.parse_args()
    extra = Path(tempfile.mkdtemp()) / "norm_cast_sweep.toml"
    write_sweep_registry(extra, SHAPES)
    os.environ["TORCHFUSE_REGISTRY_EXTRA"] = str(extra)
    torch.ops.load_library(str(Path(a.lib_dir) / "libtorchfuse.so"))
    bw = copy_bandwidth()
    rows = [f"# torchfuse::norm_cast (RMSNorm, fp32 x, bf16 y) vs the norm then the cast\n",
            f"{torch.cuda.get_device_name()}, copy bandwidth {bw:.2f} TB/s. Command: "
            f"`python3 scripts/bench/bench_norm_cast.py --lib-dir DIR`. µs per call, CUDA-graph replays. "
            "Roofline: forward reads x (4 B) and writes y (2 B) an element; backward reads x, dy (2 B) and "
            "writes dx (4 B).\n",
            "| rows x hidden | pass | norm then cast (stock or registry) | norm_cast, registry | best forced | its kernel | vs norm then cast | % of copy bw | bf16 elements differing (max ulp) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for n, h in SHAPES:
        inputs = input_sets(n, h)
        fwd = [("norm then cast", norm_then_cast(h), ""), ("norm_cast", norm_cast, "")]
        fwd += [(variant_name("rms_fwd", c), norm_cast, variant_name("rms_fwd", c)) for c in candidates(h, "rms_fwd")]
        t, ran = timed(fwd, inputs)
        forced = {k: v for k, v in t.items() if k not in ("norm then cast", "norm_cast") and ran[k] != "stock"}
        best = min(forced, key=forced.get) if forced else "norm_cast"
        # The reference unforced (a forced sweep candidate would serve the plain norm too).
        x, w = inputs[0][0], inputs[0][1]
        reference = norm_then_cast(h)(*inputs[0])
        torch.ops.torchfuse._force_variant(best if forced else "")
        differing, ulp = ulps_apart(norm_cast(*inputs[0]), reference)
        torch.ops.torchfuse._force_variant("")
        moved = n * h * 6
        rows.append(f"| {n} x {h} | forward | {t['norm then cast']:.1f} | {t['norm_cast']:.1f} ({ran['norm_cast']}) | "
                    f"{t[best]:.1f} | {ran[best]} | {t['norm then cast'] / t[best]:.2f}x | "
                    f"{moved / (t[best] * 1e-6) / 1e12 / bw * 100:.0f}% | {differing} of {x.numel()} ({ulp}) |")
        t, ran = timed([("cast then backward", cast_then_backward(h), ""), ("norm_cast_backward", norm_cast_backward, "")],
                       inputs)
        moved = n * h * 10
        rows.append(f"| {n} x {h} | backward | {t['cast then backward']:.1f} | {t['norm_cast_backward']:.1f} "
                    f"({ran['norm_cast_backward']}) | | | {t['cast then backward'] / t['norm_cast_backward']:.2f}x | "
                    f"{moved / (t['norm_cast_backward'] * 1e-6) / 1e12 / bw * 100:.0f}% | |")
        print(rows[-2], rows[-1], sep="\n", flush=True)
        del inputs, x, w
    write_report(rows, a.out, "bench_norm_cast.md")


if __name__ == "__main__":
    main()
