"""Widening copy benchmark per docs/testing.md ("Benchmarks"): `out.copy_(b)` of a 16-bit tensor
into an fp32 one of the same layout (autocast's casts back in the backward: a weight's gradient
to its fp32 parameter, ToCopyBackward0 of an fp32 q or k), torchfuse's kernel
(kernels/mixed_add.cu's mixed_copy; the registry's variant and benchmark-only ones forced by
name) vs stock's copy_ in one process. GPU time as CUDA-graph replays, and per call in eager,
medians of interleaved rounds, inputs rotated over more memory than L2, copy bandwidth measured
in the same run as the roofline (bytes: b read once, out written once). The last column: whether
the outputs are stock's bit for bit.

Usage: bench_mixed_copy.py --lib-dir DIR [--out DIR]  (writes DIR/bench_mixed_copy.md)
"""
import torch

from bench_common import graph_timings, kernel_bench_setup, run_timings, sweep_variants, write_report

SWEEP = {f"sweep_mixed_copy_t{t}_c{c}": dict(THREADS=t, CHUNKS=c)
         for t, c in [(256, 2), (256, 4), (256, 8), (512, 2), (512, 4)]}

# (shape, transposed, 16-bit dtype): weight gradients of GPT-2 124M (c_attn, c_fc, the LM head),
# Llama-style (up/gate), Qwen2.5-0.5B (its MLP, the embedding's 151936 x 896), Phi-3-mini's
# gate_up and qkv (a Linear's gradient is the transpose of the GEMM's output), q/k gradients of
# Pythia-410M and Llama-style B4 S1024 (ToCopyBackward0 after SDPA), an fp16 form, bias-sized
# ones where stock may be as fast.
CASES = [
    ((768, 2304), False, torch.bfloat16), ((3072, 768), False, torch.bfloat16),
    ((50304, 768), False, torch.bfloat16), ((2816, 1024), True, torch.bfloat16),
    ((4864, 896), True, torch.bfloat16), ((151936, 896), False, torch.bfloat16),
    ((16384, 3072), True, torch.bfloat16), ((9216, 3072), True, torch.bfloat16),
    ((4, 16, 1024, 64), False, torch.bfloat16), ((4, 8, 1024, 64), False, torch.bfloat16),
    ((3072, 768), False, torch.float16), ((768, 768), False, torch.bfloat16),
    ((2304,), False, torch.bfloat16), ((768,), False, torch.bfloat16), ((64, 64), False, torch.bfloat16),
]
NAME = {torch.bfloat16: "bf16", torch.float16: "f16"}
BYTES_PER_ELEMENT = 2 + 4  # b read once, out written once


def main():
    sweep_variants("mixed_copy", "mixed_add.cu", ["bf16", "f16"], SWEEP)
    args, bandwidth = kernel_bench_setup()
    rows = [f"# Widening copies (16-bit into fp32, one layout) on {torch.cuda.get_device_name()} "
            f"(torch {torch.__version__})", "",
            f"Copy bandwidth in this run: {bandwidth:.2f} TB/s. Command: `python3 "
            "scripts/bench/bench_mixed_copy.py --lib-dir DIR`. µs per call, medians; graph: "
            "CUDA-graph replays (GPU time), eager: one call after another (host included).", "",
            "| shape | layout | 16-bit dtype | stock graph | torchfuse graph (registry's variant) | best forced | "
            "its variant | vs stock, graph | % of copy bw | stock eager | torchfuse eager | vs stock, eager "
            "| stock's bits |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    sides = [("stock", False, ""), ("torchfuse", True, "")] + [(name, True, name) for name in SWEEP]
    for shape, transposed, half in CASES:
        n = 1
        for size in shape:
            n *= size
        sets = max(2, (256 << 20) // (n * BYTES_PER_ELEMENT) + 1)

        def make():
            b = torch.randn(shape[::-1] if transposed else shape, device="cuda").to(half)
            b = b.t() if transposed else b  # a Linear's weight gradient: the GEMM's transpose
            return torch.empty_like(b, dtype=torch.float32), b

        inputs = [make() for _ in range(sets)]

        def copy(out, b):
            return out.copy_(b)

        graph = graph_timings("mixed_add", copy, inputs, sides)
        eager = run_timings("mixed_add", copy, inputs, sides[:2])
        out, b = inputs[0]
        ours = copy(out, b).clone()
        torch.ops.torchfuse.set_enabled("mixed_add", False)
        stock = copy(out, b).clone()
        torch.ops.torchfuse.set_enabled("mixed_add", True)
        same = torch.equal(ours.view(torch.int32), stock.view(torch.int32))
        forced = {k: v for k, v in graph.items() if k in SWEEP or k == "torchfuse"}
        best = min(forced, key=forced.get)
        roof = n * BYTES_PER_ELEMENT / (bandwidth * 1e12) * 1e6
        rows.append(f"| {'x'.join(map(str, shape))} | {'transposed' if transposed else 'contiguous'} | "
                    f"{NAME[half]} | {graph['stock']:.1f} | {graph['torchfuse']:.1f} | {forced[best]:.1f} | "
                    f"{best} | {graph['stock'] / graph['torchfuse']:.2f}x | {100 * roof / graph['torchfuse']:.0f}% | "
                    f"{eager['stock']:.1f} | {eager['torchfuse']:.1f} | {eager['stock'] / eager['torchfuse']:.2f}x | "
                    f"{'yes' if same else 'NO'} |")
        print(rows[-1], flush=True)
        del inputs
        torch.cuda.empty_cache()
    write_report(rows, args.out, "bench_mixed_copy.md")


if __name__ == "__main__":
    main()
