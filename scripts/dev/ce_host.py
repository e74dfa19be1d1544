"""Issue 40: what the causal-LM loss costs the host, unprofiled, at the bench models' logits
(the profiler put 250-730 µs of self CPU in torchfuse::cross_entropy_bwd, one call a step).
Host µs per call (bench_host's: the least of 15 timings of 100 calls, the GPU left to run
behind) next to the GPU's µs (CUDA events): a host time near the GPU's means the call waits for
the GPU.

  python3 scripts/dev/ce_host.py --lib-dir DIR
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

SHAPES = {"GPT-2 B8": (8192, 50304), "Llama-style B4": (4096, 32000)}


def gpu_us(fn, calls=10):
    """The GPU's µs per call over CUDA events around `calls` calls."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib-dir", required=True)
    a = p.parse_args()
    torch.ops.load_library(f"{a.lib_dir}/libtorchfuse.so")
    op = torch.ops.torchfuse.cross_entropy.default
    from bench_host import host_us
    print("| logits | call | host µs | GPU µs |\n|---|---|---|---|")
    for name, (rows, cols) in SHAPES.items():
        logits = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, cols, (rows,), device="cuda")
        cases = {
            "torchfuse::cross_entropy fwd": lambda: op(logits.detach(), labels, 1, -100, 0.0, torch.float32),
            "torchfuse::cross_entropy fwd+bwd": lambda: torch.autograd.grad(
                op(logits, labels, 1, -100, 0.0, torch.float32), logits),
            "the same, 16 rows": lambda: torch.autograd.grad(
                op(logits[:16], labels[:16], 1, -100, 0.0, torch.float32), logits),
        }
        for case, fn in cases.items():
            for _ in range(3):
                fn()
            host, gpu = host_us(fn), gpu_us(fn)
            print(f"| {name} [{rows}, {cols}] | {case} | {host:.1f} | {gpu:.1f} |", flush=True)


if __name__ == "__main__":
    main()
