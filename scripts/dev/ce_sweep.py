"""Cross-entropy kernels' CTA size, forward and backward timed apart: HF's form (bf16 logits,
fp32 loss) at the shapes of the step benches, each variant forced by name (the registry's and
THREADS 128-1024 written to TORCHFUSE_REGISTRY_EXTRA), CUDA events, medians of interleaved
rounds over input sets larger than L2, copy bandwidth of this run beside them.

Usage: ce_sweep.py --lib-dir DIR [--out DIR] [--no-sweep]  (--no-sweep: the registry's choice
alone, for libraries without the sweep's kernels' names)
"""
import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

THREADS = (128, 256, 512, 1024)
# (rows, classes): GPT-2 B32 (the bench's padded and HF's own vocabulary), Llama-style B4,
# Qwen2.5 B4, Llama-3 B2.
SHAPES = [(32768, 50304), (32768, 50257), (4096, 32000), (4096, 151936), (8192, 128256)]


def extra_registry():
    lines = []
    for way in ("fwd", "bwd"):
        for t in THREADS:
            lines += ["[[variant]]", f'name = "sweep_ce_{way}_wide_t{t}"', f'op = "cross_entropy_{way}_wide"',
                      'source = "cross_entropy.cu"', 'dtypes = ["bf16", "f16"]', "sm = [80, 90]",
                      f"params = {{ THREADS = {t} }}", ""]
    path = Path(tempfile.mkdtemp()) / "ce_sweep.toml"
    path.write_text("\n".join(lines))
    return path


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib-dir", required=True)
    parser.add_argument("--out")
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    if not args.no_sweep:
        os.environ["TORCHFUSE_REGISTRY_EXTRA"] = str(extra_registry())
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_common import copy_bandwidth, timed_loop

    torch.ops.load_library(str(Path(args.lib_dir) / "libtorchfuse.so"))
    torch.ops.torchfuse._serve_below_thresholds(True)
    bandwidth = copy_bandwidth()
    names = [""] + ([] if args.no_sweep else [f"sweep_ce_{w}_wide_t{t}" for w in ("fwd", "bwd") for t in THREADS])
    rows = [f"# cross-entropy CTA sweep, {torch.cuda.get_device_name()}, libraries {args.lib_dir}", "",
            f"Copy bandwidth {bandwidth:.2f} TB/s. µs, median; `registry` = the registry's choice; "
            "fwd % = logits bytes / copy bandwidth over the time; bwd % = twice that.", "",
            "| shape | variant | forward | fwd % of copy bw | backward | bwd % of copy bw |", "|---|---|---|---|---|---|"]
    for r, c in SHAPES:
        sets = max(2, min(16, (256 << 20) // (r * c * 2)))
        xs = [(torch.randn(r, c, device="cuda") * 4).to(torch.bfloat16) for _ in range(sets)]
        ts = [torch.randint(0, c, (r,), device="cuda") for _ in range(sets)]
        losses = []
        for x, t in zip(xs, ts):
            xg = x.requires_grad_(True)
            losses.append((xg, torch.ops.torchfuse.cross_entropy(xg, t, 1, -100, 0.0, torch.float32)))

        def forward(x, t):
            with torch.no_grad():
                torch.ops.torchfuse.cross_entropy(x, t, 1, -100, 0.0, torch.float32)

        def backward(x, loss):
            torch.autograd.grad(loss, x, retain_graph=True)

        times = {(n, w): [] for n in names for w in ("fwd", "bwd")}
        for rnd in range(6):
            for n in names:
                torch.ops.torchfuse._force_variant(n)
                if n == "" or "_fwd_" in n:
                    s = timed_loop(forward, list(zip(xs, ts)), 3)
                    times[(n, "fwd")] += s if rnd else []
                if n == "" or "_bwd_" in n:
                    s = timed_loop(backward, losses, 3)
                    times[(n, "bwd")] += s if rnd else []
        torch.ops.torchfuse._force_variant("")
        roof = r * c * 2 / (bandwidth * 1e12) * 1e6
        for n in names:
            f, b = times[(n, "fwd")], times[(n, "bwd")]
            fs = f"{statistics.median(f):.1f} | {100 * roof / statistics.median(f):.0f}%" if f else "– | –"
            bs = f"{statistics.median(b):.1f} | {200 * roof / statistics.median(b):.0f}%" if b else "– | –"
            rows.append(f"| {r}x{c} | {n or 'registry'} | {fs} | {bs} |")
            print(rows[-1], flush=True)
        del xs, ts, losses
        torch.cuda.empty_cache()
    text = "\n".join(rows) + "\n"
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "ce_sweep.md").write_text(text)


if __name__ == "__main__":
    main()
