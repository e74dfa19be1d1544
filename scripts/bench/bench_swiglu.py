"""SwiGLU pointwise benchmark per docs/testing.md ("Benchmarks"): torch.ops.torchfuse.silu_mul and
silu_mul_packed (Phi-3's halves of one gate_up tensor) and their backwards, torchfuse's kernel
vs stock (the same op switched off: PyTorch's silu(gate) * up, and silu_backward plus two
multiplies; packed: of chunk's views, the backward's halves concatenated), in one process. CUDA
events, warm-up, medians of interleaved rounds, input sets rotated over more memory than L2,
copy bandwidth measured in the same run. Bytes (n = elements of y): forward = n·(gate + up + y);
backward = n·(dy + gate + up + dgate + dup).

Usage: bench_swiglu.py --lib-dir DIR [--out DIR]  (writes DIR/bench_swiglu.md)
"""

import torch

from bench_common import kernel_bench_setup, run_timings, write_report

# (tokens, intermediate size, dtype): the Llama-style bench model (B4 S1024), Llama-7B's MLP at
# 4096 tokens, the fp32 form, two small calls.
CASES = [
    (4096, 2816, torch.bfloat16),
    (4096, 11008, torch.bfloat16),
    (4096, 11008, torch.float32),
    (512, 2816, torch.bfloat16),
    (64, 1024, torch.bfloat16),
]
# (tokens, intermediate size, dtype) of silu_mul_packed: Phi-3-mini's MLP (8192) at 4096 tokens,
# a GLM-4-9B-like 13696 at 2048, a small call.
PACKED_CASES = [
    (4096, 8192, torch.bfloat16),
    (2048, 13696, torch.bfloat16),
    (512, 8192, torch.bfloat16),
]
NAME = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def main():
    args, bandwidth = kernel_bench_setup()
    rows = [f"# SwiGLU pointwise (silu(gate) * up) on {torch.cuda.get_device_name()} (torch {torch.__version__})", "",
            f"Copy bandwidth in this run: {bandwidth:.2f} TB/s. Times: µs per call, median.", "",
            "| shape | dtype | direction | stock | torchfuse | vs stock | % of copy bw |", "|---|---|---|---|---|---|---|"]
    sides = [("stock", False, ""), ("torchfuse", True, "")]
    ops = torch.ops.torchfuse
    for packed, (r, c, dtype) in [(False, case) for case in CASES] + [(True, case) for case in PACKED_CASES]:
        n, b = r * c, torch.finfo(dtype).bits // 8
        sets = max(2, (256 << 20) // (n * b * 3) + 1)
        dys = [torch.randn(r, c, device="cuda").to(dtype) for _ in range(sets)]
        if packed:  # gate and up: the halves of one [r, 2c] tensor
            inputs = [(torch.randn(r, 2 * c, device="cuda").to(dtype),) for _ in range(sets)]
            fwd = run_timings("swiglu", ops.silu_mul_packed, inputs, sides)
            bwd = run_timings("swiglu", ops.silu_mul_packed_backward, [(dy, *x) for dy, x in zip(dys, inputs)], sides)
        else:
            inputs = [tuple(torch.randn(r, c, device="cuda").to(dtype) for _ in range(2)) for _ in range(sets)]
            fwd = run_timings("swiglu", ops.silu_mul, inputs, sides)
            bwd = run_timings("swiglu", ops.silu_mul_backward, [(dy, *x) for dy, x in zip(dys, inputs)], sides)
        shape = f"packed {r}x2x{c}" if packed else f"{r}x{c}"
        for direction, t, nbytes in (("forward", fwd, 3 * n * b), ("backward", bwd, 5 * n * b)):
            roof = nbytes / (bandwidth * 1e12) * 1e6
            rows.append(f"| {shape} | {NAME[dtype]} | {direction} | {t['stock']:.1f} | {t['torchfuse']:.1f} | "
                        f"{t['stock'] / t['torchfuse']:.2f}x | {100 * roof / t['torchfuse']:.0f}% |")
            print(rows[-1], flush=True)
        del inputs, dys
        torch.cuda.empty_cache()
    write_report(rows, args.out, "bench_swiglu.md")


if __name__ == "__main__":
    main()
