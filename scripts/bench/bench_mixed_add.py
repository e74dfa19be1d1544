"""Mixed-dtype add benchmark per docs/testing.md ("Benchmarks"): `a + b` of an fp32 tensor and a
16-bit one of one shape (an fp32 residual stream plus a layer's bf16 output under autocast),
torchfuse's kernel (kernels/mixed_add.cu; the registry's variant and benchmark-only ones forced
by name) vs stock's add in one process. GPU time as CUDA-graph replays (the host out of the way)
and per call in eager (the host in), medians of interleaved rounds, fresh random inputs rotated
over more memory than L2, copy bandwidth measured in the same run as the roofline (bytes: a and
b read once, out written once). The last column: whether the outputs are stock's bit for bit.

Usage: bench_mixed_add.py --lib-dir DIR [--out DIR]  (writes DIR/bench_mixed_add.md)
"""
import torch

from bench_common import graph_timings, kernel_bench_setup, run_timings, sweep_variants, write_report

# Benchmark-only variants (names apart from registry/mixed_add.toml's) and their params.
SWEEP = {f"sweep_mixed_add_t{t}_c{c}": dict(THREADS=t, CHUNKS=c)
         for t, c in [(128, 4), (256, 4), (512, 4), (1024, 2)]}

# (rows, cols, 16-bit dtype): residual adds of GPT-2 124M at B32 and B8 (S1024, 768 wide),
# Llama-style 1024 and Qwen2.5-0.5B 896 wide at B4 S1024, Mistral-style 2048 wide, a 4096-wide
# model, an fp16 form, and the small end where stock may be as fast.
CASES = [
    (32768, 768, torch.bfloat16), (8192, 768, torch.bfloat16), (4096, 1024, torch.bfloat16),
    (4096, 896, torch.bfloat16), (4096, 2048, torch.bfloat16), (8192, 4096, torch.bfloat16),
    (8192, 768, torch.float16), (2048, 768, torch.bfloat16), (1024, 768, torch.bfloat16),
    (512, 768, torch.bfloat16), (256, 768, torch.bfloat16), (128, 512, torch.bfloat16),
]
NAME = {torch.bfloat16: "bf16", torch.float16: "f16"}
# Bytes an element moves: a (fp32) and b (16-bit) read once, out (fp32) written once.
BYTES_PER_ELEMENT = 4 + 2 + 4


def main():
    sweep_variants("mixed_add", "mixed_add.cu", ["bf16", "f16"], SWEEP)
    args, bandwidth = kernel_bench_setup()
    rows = [f"# Mixed-dtype adds (fp32 + 16-bit, one shape) on {torch.cuda.get_device_name()} "
            f"(torch {torch.__version__})", "",
            f"Copy bandwidth in this run: {bandwidth:.2f} TB/s. Command: `python3 "
            "scripts/bench/bench_mixed_add.py --lib-dir DIR`. µs per call, medians; graph: "
            "CUDA-graph replays (GPU time), eager: one call after another (host included).", "",
            "| rows x cols | 16-bit dtype | stock graph | torchfuse graph (registry's variant) | best forced | "
            "its variant | vs stock, graph | % of copy bw | stock eager | torchfuse eager | vs stock, eager "
            "| stock's bits |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    sides = ([("stock", False, ""), ("torchfuse", True, "")]
             + [(name, True, name) for name in SWEEP])
    for r, c, half in CASES:
        n = r * c
        sets = max(2, (256 << 20) // (n * BYTES_PER_ELEMENT) + 1)
        inputs = [(torch.randn(r, c, device="cuda"), torch.randn(r, c, device="cuda").to(half))
                  for _ in range(sets)]

        def add(a, b):
            return a + b

        graph = graph_timings("mixed_add", add, inputs, sides)
        eager = run_timings("mixed_add", add, inputs, sides[:2])
        ours = add(*inputs[0])
        torch.ops.torchfuse.set_enabled("mixed_add", False)
        stock = add(*inputs[0])
        torch.ops.torchfuse.set_enabled("mixed_add", True)
        same = (ours.dtype == stock.dtype and ours.stride() == stock.stride()
                and torch.equal(ours.view(torch.int32), stock.view(torch.int32)))
        forced = {k: v for k, v in graph.items() if k in SWEEP or k == "torchfuse"}
        best = min(forced, key=forced.get)
        roof = n * BYTES_PER_ELEMENT / (bandwidth * 1e12) * 1e6
        rows.append(f"| {r} x {c} | {NAME[half]} | {graph['stock']:.1f} | {graph['torchfuse']:.1f} | "
                    f"{forced[best]:.1f} | {best} | {graph['stock'] / graph['torchfuse']:.2f}x | "
                    f"{100 * roof / graph['torchfuse']:.0f}% | {eager['stock']:.1f} | {eager['torchfuse']:.1f} | "
                    f"{eager['stock'] / eager['torchfuse']:.2f}x | {'yes' if same else 'NO'} |")
        print(rows[-1], flush=True)
        del inputs
        torch.cuda.empty_cache()
    write_report(rows, args.out, "bench_mixed_add.md")


if __name__ == "__main__":
    main()
