"""Gated-MLP pointwise benchmark per docs/testing.md ("Benchmarks"): torch.ops.torchfuse.silu_mul,
silu_mul_packed (Phi-3's halves of one gate_up tensor) and gelu_tanh_mul (GeGLU: Gemma's) and
their backwards, torchfuse's kernel vs stock (the same op switched off: PyTorch's act(gate) * up,
and the activation's backward plus two multiplies; packed: of chunk's views, the backward's
halves concatenated), in one process. CUDA
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
# (tokens, intermediate size, dtype) of gelu_tanh_mul: Gemma-2B's MLP (16384) and Gemma-3-1B's
# (6912) at 4096 tokens, a small call.
GEGLU_CASES = [
    (4096, 16384, torch.bfloat16),
    (4096, 6912, torch.bfloat16),
    (512, 6912, torch.bfloat16),
]
NAME = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def main():
    args, bandwidth = kernel_bench_setup()
    rows = [f"# Gated-MLP pointwise (act(gate) * up) on {torch.cuda.get_device_name()} (torch {torch.__version__})", "",
            f"Copy bandwidth in this run: {bandwidth:.2f} TB/s. Times: µs per call, median.", "",
            "| shape | dtype | direction | stock | torchfuse | vs stock | % of copy bw |", "|---|---|---|---|---|---|---|"]
    sides = [("stock", False, ""), ("torchfuse", True, "")]
    ops = torch.ops.torchfuse
    # (op name, cases, shape label): packed's gate and up are the halves of one [r, 2c] tensor.
    kinds = [("silu_mul", CASES, "{r}x{c}"), ("silu_mul_packed", PACKED_CASES, "packed {r}x2x{c}"),
             ("gelu_tanh_mul", GEGLU_CASES, "GeGLU {r}x{c}")]
    for name, (r, c, dtype), label in [(name, case, label) for name, cases, label in kinds for case in cases]:
        n, b = r * c, torch.finfo(dtype).bits // 8
        sets = max(2, (256 << 20) // (n * b * 3) + 1)
        dys = [torch.randn(r, c, device="cuda").to(dtype) for _ in range(sets)]
        shapes = [(r, 2 * c)] if name == "silu_mul_packed" else [(r, c), (r, c)]
        inputs = [tuple(torch.randn(shape, device="cuda").to(dtype) for shape in shapes) for _ in range(sets)]
        fwd = run_timings("swiglu", getattr(ops, name), inputs, sides)
        bwd = run_timings("swiglu", getattr(ops, name + "_backward"), [(dy, *x) for dy, x in zip(dys, inputs)], sides)
        shape = label.format(r=r, c=c)
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
