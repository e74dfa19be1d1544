"""Column-sum benchmark per docs/testing.md ("Benchmarks"): `x.sum(0, keepdim=True)` of a
row-major [rows, cols] x (what autograd runs for every biased Linear's bias gradient), torchfuse's
kernel (kernels/column_sum.cu; the registry's variant and benchmark-only ones forced by name) vs
stock's reduction in one process. GPU time as CUDA-graph replays (the host out of the way) and
per call in eager (the host in: two launches against stock's one), medians of interleaved
rounds, fresh random inputs rotated over more memory than L2, copy bandwidth measured in the
same run as the roofline (bytes: the input read once). The error columns: ‖out − ref‖ / ‖ref‖
against a float64 sum of the same input, torchfuse's and stock's.

Usage: bench_column_sum.py --lib-dir DIR [--out DIR]  (writes DIR/bench_column_sum.md)
"""
import torch

from bench_common import graph_timings, kernel_bench_setup, rel_err, run_timings, sweep_variants, write_report

# Benchmark-only variants (names apart from registry/column_sum.toml's) and their params.
SWEEP = {
    f"sweep_colsum_w{w}_r{r}_u{u}": dict(WARPS=w, ROWS_PER_SPLIT=r, UNROLL=u)
    for w, r, u in [(8, 128, 4), (8, 256, 4), (16, 256, 2), (16, 1024, 4), (8, 1024, 8), (4, 256, 8)]
}

# (rows, cols, dtype): bias gradients of GPT-2 124M at B32 and B8 (S1024: c_attn, MLP in, the
# 768-wide projections), BERT-base at B32 S512, ViT-S/16 at B256, Qwen2.5-0.5B's q and k/v
# biases at B4 S1024, fp32 and fp16 forms, columns that allow no 16-byte access, and the small
# end where stock may be as fast.
CASES = [
    (32768, 768, torch.bfloat16), (32768, 2304, torch.bfloat16), (32768, 3072, torch.bfloat16),
    (8192, 768, torch.bfloat16), (8192, 3072, torch.bfloat16),
    (16384, 768, torch.bfloat16), (50432, 384, torch.bfloat16), (50432, 1536, torch.bfloat16),
    (4096, 896, torch.bfloat16), (4096, 128, torch.bfloat16),
    (32768, 768, torch.float32), (8192, 3072, torch.float32), (8192, 3072, torch.float16),
    (8192, 1000, torch.bfloat16), (8192, 1001, torch.float32),
    (2048, 768, torch.bfloat16), (1024, 768, torch.bfloat16), (256, 768, torch.bfloat16),
    (4096, 64, torch.bfloat16), (65536, 32, torch.bfloat16),
]
NAME = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def main():
    sweep_variants("column_sum", "column_sum.cu", ["f32", "bf16", "f16"], SWEEP)
    args, bandwidth = kernel_bench_setup()
    rows = [f"# Column sums (sum over the leading dim) on {torch.cuda.get_device_name()} "
            f"(torch {torch.__version__})", "",
            f"Copy bandwidth in this run: {bandwidth:.2f} TB/s. Command: `python3 "
            "scripts/bench/bench_column_sum.py --lib-dir DIR`. µs per call, medians; graph: "
            "CUDA-graph replays (GPU time), eager: one call after another (host included).", "",
            "| rows x cols | dtype | stock graph | torchfuse graph (registry's variant) | best forced | "
            "its variant | vs stock, graph | % of copy bw | stock eager | torchfuse eager | vs stock, eager "
            "| rel. error torchfuse / stock |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    sides = ([("stock", False, ""), ("torchfuse", True, "")]
             + [(name, True, name) for name in SWEEP])
    for r, c, dtype in CASES:
        n = r * c
        sets = max(2, (256 << 20) // (n * dtype.itemsize) + 1)
        xs = [torch.randn(r, c, device="cuda").to(dtype) for _ in range(sets)]
        inputs = [(x,) for x in xs]

        def column_sum(x):
            return x.sum(0, keepdim=True)

        graph = graph_timings("column_sum", column_sum, inputs, sides)
        eager = run_timings("column_sum", column_sum, inputs, sides[:2])
        ref = xs[0].double().sum(0, keepdim=True)
        ours = column_sum(xs[0])
        torch.ops.torchfuse.set_enabled("column_sum", False)
        stock = column_sum(xs[0])
        torch.ops.torchfuse.set_enabled("column_sum", True)
        assert ours.dtype == stock.dtype and ours.shape == stock.shape
        forced = {k: v for k, v in graph.items() if k in SWEEP or k == "torchfuse"}
        best = min(forced, key=forced.get)
        roof = n * dtype.itemsize / (bandwidth * 1e12) * 1e6
        rows.append(f"| {r} x {c} | {NAME[dtype]} | {graph['stock']:.1f} | {graph['torchfuse']:.1f} | "
                    f"{forced[best]:.1f} | {best} | {graph['stock'] / graph['torchfuse']:.2f}x | "
                    f"{100 * roof / graph['torchfuse']:.0f}% | {eager['stock']:.1f} | {eager['torchfuse']:.1f} | "
                    f"{eager['stock'] / eager['torchfuse']:.2f}x | "
                    f"{rel_err(ours, ref):.1e} / {rel_err(stock, ref):.1e} |")
        print(rows[-1], flush=True)
        del xs, inputs
        torch.cuda.empty_cache()
    write_report(rows, args.out, "bench_column_sum.md")


if __name__ == "__main__":
    main()
