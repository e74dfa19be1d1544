"""Cross-entropy benchmark per docs/testing.md ("Benchmarks"): forward + backward of
torch.ops.torchfuse.cross_entropy (what HF's causal-LM loss is rewritten to) against the same op
switched off (stock: PyTorch's cross_entropy of the logits cast to the loss dtype, which is
HF's original), plain F.cross_entropy (aten::cross_entropy_loss, served by torchfuse at
AutogradCUDA, against itself switched off), torch.compile of HF's form, and Liger-Kernel's
cross-entropy where liger_kernel imports. CUDA events, warm-up, medians of interleaved rounds,
input sets rotated over more memory than L2, copy bandwidth measured in the same run.
Bytes (the roofline): the logits read twice (forward, backward) and their gradient written
once.

Usage: bench_cross_entropy.py --lib-dir DIR [--out DIR]  (writes DIR/bench_cross_entropy.md)
"""
import statistics

import torch
import torch.nn.functional as F

from bench_common import kernel_bench_setup, run_timings, timed_loop, write_report

# (rows, classes, logits dtype, loss dtype): GPT-2 124M at B8 S1024 (HF's form: fp32 loss of
# bf16 logits), the Llama-style bench model, Llama-3's vocabulary, the pure-bf16 and fp32 forms;
# then small ones (where the registry's thresholds are decided): one short sequence, an ImageNet
# classifier's batch (timm: F.cross_entropy of fp32 logits) and a ten-class head.
CASES = [
    (8192, 50304, torch.bfloat16, torch.float32),
    (4096, 32000, torch.bfloat16, torch.float32),
    (8192, 128256, torch.bfloat16, torch.float32),
    (8192, 50304, torch.bfloat16, torch.bfloat16),
    (8192, 50304, torch.float32, torch.float32),
    (512, 50304, torch.bfloat16, torch.float32),
    (256, 1000, torch.float32, torch.float32),
    (64, 10, torch.float32, torch.float32),
]
NAME = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def fwd_bwd(loss_fn):
    def step(x, t):
        return torch.autograd.grad(loss_fn(x, t), x)
    return step


def median_us(fn, inputs, rounds=5, reps=4):
    timed_loop(fn, inputs, 2)
    return statistics.median(sum((timed_loop(fn, inputs, reps) for _ in range(rounds)), []))


def liger_loss():
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss
    except Exception:
        return None
    return LigerCrossEntropyLoss()


def main():
    args, bandwidth = kernel_bench_setup()
    liger = liger_loss()
    rows = [f"# Cross-entropy forward + backward on {torch.cuda.get_device_name()} (torch {torch.__version__})", "",
            f"Copy bandwidth in this run: {bandwidth:.2f} TB/s. Times: µs per forward + backward, median. "
            f"Liger-Kernel: {'yes' if liger else 'not importable'}.", "",
            "| shape | dtypes | stock (HF's form) | torchfuse | vs stock | % of copy bw | F.cross_entropy stock | "
            "F.cross_entropy torchfuse | torch.compile | Liger |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    sides = [("stock", False, ""), ("torchfuse", True, "")]
    for r, c, dtype, loss_dtype in CASES:
        # Input sets rotated over more memory than L2 (50 MB).
        sets = max(2, min(64, (128 << 20) // (r * c * torch.finfo(dtype).bits // 8)))
        xs = [(torch.randn(r, c, device="cuda") * 4).to(dtype).requires_grad_(True) for _ in range(sets)]
        ts = [torch.randint(0, c, (r,), device="cuda") for _ in range(sets)]
        inputs = list(zip(xs, ts))
        op = fwd_bwd(lambda x, t: torch.ops.torchfuse.cross_entropy(x, t, 1, -100, 0.0, loss_dtype))
        ours = run_timings("cross_entropy", op, inputs, sides, reps=4)
        plain = run_timings("cross_entropy", fwd_bwd(lambda x, t: F.cross_entropy(x, t)), inputs, sides, reps=4)
        torch.ops.torchfuse.set_enabled("cross_entropy", False)
        compiled = torch.compile(lambda x, t: F.cross_entropy(x.to(loss_dtype), t))
        compile_us = median_us(fwd_bwd(compiled), inputs)
        liger_us = median_us(fwd_bwd(lambda x, t: liger(x, t)), inputs) if liger and dtype != torch.float32 else None
        torch.ops.torchfuse.set_enabled("cross_entropy", True)
        nbytes = r * c * torch.finfo(dtype).bits // 8 * 3
        roof = nbytes / (bandwidth * 1e12) * 1e6
        rows.append(f"| {r}x{c} | {NAME[dtype]}→{NAME[loss_dtype]} | {ours['stock']:.0f} | {ours['torchfuse']:.0f} | "
                    f"{ours['stock'] / ours['torchfuse']:.2f}x | {100 * roof / ours['torchfuse']:.0f}% | "
                    f"{plain['stock']:.0f} | {plain['torchfuse']:.0f} | {compile_us:.0f} | "
                    f"{'–' if liger_us is None else f'{liger_us:.0f}'} |")
        print(rows[-1], flush=True)
        del xs, ts, inputs
        torch.cuda.empty_cache()
    write_report(rows, args.out, "bench_cross_entropy.md")


if __name__ == "__main__":
    main()
