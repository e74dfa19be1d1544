"""tanh-GELU benchmark per docs/testing.md ("Benchmarks"): torch.ops.torchfuse.gelu_tanh and its
backward, torchfuse's kernel vs stock (the same op switched off: PyTorch's gelu(approximate=
"tanh") plus the cast where dtypes differ) in one process, and HF's original composition
(NewGELUActivation, under autocast where the case's output is fp32), which is what the rewrite
replaces. CUDA events, warm-up, medians of interleaved rounds, fresh random inputs rotated over
more memory than L2, copy bandwidth measured in the same run as the roofline.
Bytes: forward = n·(in + out); backward = n·(dy + x + dx).

Usage: bench_gelu.py --lib-dir DIR [--out DIR]  (writes DIR/bench_gelu.md)
"""
import math
import statistics

import torch

from bench_common import kernel_bench_setup, run_timings, timed_loop, write_report

# (rows, cols, input dtype, output dtype): GPT-2 124M's MLP activation at B8 S1024 (bf16 under
# autocast gives fp32), the pure-bf16 and fp32 forms, a Llama-7B-sized one and a small one.
CASES = [
    (8192, 3072, torch.bfloat16, torch.float32),
    (8192, 3072, torch.bfloat16, torch.bfloat16),
    (8192, 3072, torch.float32, torch.float32),
    (4096, 11008, torch.bfloat16, torch.float32),
    (512, 3072, torch.bfloat16, torch.float32),
]
NAME = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def new_gelu(input):  # transformers.activations.NewGELUActivation.forward, as written there
    return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


def original_forward(x, out_dtype):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=out_dtype != x.dtype):
        return new_gelu(x)


def median_us(fn, inputs, rounds=5, reps=8):
    timed_loop(fn, inputs, 2)
    return statistics.median(sum((timed_loop(fn, inputs, reps) for _ in range(rounds)), []))


def main():
    args, bandwidth = kernel_bench_setup()
    device = torch.cuda.get_device_name()
    rows = [f"# tanh GELU on {device} (torch {torch.__version__})", "",
            f"Copy bandwidth in this run: {bandwidth:.2f} TB/s. Times: µs per call, median.", "",
            "| shape | dtypes | direction | HF original | stock | torchfuse | vs stock | vs original | % of copy bw |",
            "|---|---|---|---|---|---|---|---|---|"]
    sides = [("stock", False, ""), ("torchfuse", True, "")]
    for r, c, dtype, out_dtype in CASES:
        n = r * c
        sets = max(2, (256 << 20) // (n * 4) + 1)
        xs = [torch.randn(r, c, device="cuda").to(dtype) for _ in range(sets)]
        dys = [torch.randn(r, c, device="cuda").to(out_dtype) for _ in range(sets)]
        fwd = run_timings("gelu_tanh", lambda x: torch.ops.torchfuse.gelu_tanh(x, out_dtype), [(x,) for x in xs], sides)
        bwd = run_timings("gelu_tanh", torch.ops.torchfuse.gelu_tanh_backward, list(zip(dys, xs)), sides)
        orig_fwd = median_us(lambda x: original_forward(x, out_dtype), [(x,) for x in xs])
        leaves = [x.clone().requires_grad_(True) for x in xs]
        outs = [original_forward(x, out_dtype) for x in leaves]
        orig_bwd = median_us(lambda y, x, dy: torch.autograd.grad(y, x, dy, retain_graph=True),
                             list(zip(outs, leaves, dys)))
        del leaves, outs
        in_b, out_b = torch.finfo(dtype).bits // 8, torch.finfo(out_dtype).bits // 8
        for direction, t, orig, nbytes in (("forward", fwd, orig_fwd, n * (in_b + out_b)),
                                           ("backward", bwd, orig_bwd, n * (out_b + 2 * in_b))):
            roof = nbytes / (bandwidth * 1e12) * 1e6
            rows.append(f"| {r}x{c} | {NAME[dtype]}→{NAME[out_dtype]} | {direction} | {orig:.1f} | {t['stock']:.1f} | "
                        f"{t['torchfuse']:.1f} | {t['stock'] / t['torchfuse']:.2f}x | {orig / t['torchfuse']:.2f}x | "
                        f"{100 * roof / t['torchfuse']:.0f}% |")
            print(rows[-1], flush=True)
        del xs, dys
        torch.cuda.empty_cache()
    write_report(rows, args.out, "bench_gelu.md")


if __name__ == "__main__":
    main()
