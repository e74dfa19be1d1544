"""Rewritten HF modules against their original code, forward + backward, GPU time per call:
the module as transformers writes it (under `torchfuse.disabled()`) and as the rewrite layer
serves it, interleaved in one process, CUDA events, medians; inputs larger than L2, fresh each
round. The copy roofline: one read and one write of the input at copy bandwidth, per pass.

  python3 scripts/bench/bench_rewrites.py --lib-dir DIR [--out DIR]
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))


def cases():
    """(name, module, input shape, input dtype): Gemma's norm on its fp32 residual stream
    (Gemma-2B width, 8192 tokens) and on bf16 q/k heads (Gemma 3's q_norm: head dim 256)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    yield "GemmaRMSNorm 8192x2048 fp32", GemmaRMSNorm(2048), (8192, 2048), torch.float32
    yield "GemmaRMSNorm 8192x2048 bf16", GemmaRMSNorm(2048), (8192, 2048), torch.bfloat16
    yield "GemmaRMSNorm q heads 8192x8x256 bf16", GemmaRMSNorm(256), (8192, 8, 256), torch.bfloat16


def time_us(fn, reps=30):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib-dir", required=True)
    p.add_argument("--out")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    import torchfuse
    assert torchfuse.enable(a.lib_dir), "torchfuse did not load"
    from bench_common import copy_bandwidth  # beside this script
    bandwidth = copy_bandwidth() * 1e12  # TB/s
    lines = [f"# Rewritten HF modules vs their original code ({torch.cuda.get_device_name()})", "",
             f"`python3 scripts/bench/bench_rewrites.py --lib-dir {a.lib_dir}`; forward + backward, GPU µs "
             f"(CUDA events, median of {a.rounds} interleaved rounds of 30); copy bandwidth {bandwidth / 1e12:.2f} TB/s", "",
             "| module | original | rewritten | speed-up | one read + write of the input at copy bandwidth |",
             "|---|---|---|---|---|"]
    for name, module, shape, dtype in cases():
        module = module.cuda()
        results = {"original": [], "rewritten": []}
        for _ in range(a.rounds):
            x = torch.randn(shape, device="cuda").to(dtype).requires_grad_(True)
            grad = torch.randn_like(x)

            def step():
                module(x).backward(grad)

            for side in results:
                if side == "original":
                    with torchfuse.disabled():
                        step()
                        results[side].append(time_us(step))
                else:
                    step()
                    results[side].append(time_us(step))
        original, rewritten = (statistics.median(v) for v in results.values())
        roofline = 2 * x.numel() * x.element_size() / bandwidth * 1e6
        lines.append(f"| {name} | {original:.1f} | {rewritten:.1f} | {original / rewritten:.2f}x | {roofline:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "bench_rewrites.md").write_text(text)


if __name__ == "__main__":
    main()
