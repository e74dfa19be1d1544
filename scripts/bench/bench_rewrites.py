"""Rewritten HF modules against their original code, forward + backward, GPU time per call:
the module as transformers writes it (under `torchfuse.disabled()`) and as the rewrite layer
serves it, interleaved in one process, CUDA events, medians; inputs larger than L2, fresh each
round. The copy roofline: one read and one write of the input at copy bandwidth, per pass.

  python3 scripts/bench/bench_rewrites.py --lib-dir DIR [--out DIR]
"""
import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))


def cases():
    """(name, make): make() gives (inputs needing grad, the call, its outputs' grads maker).
    Gemma's norm on its fp32 residual stream (Gemma-2B width, 8192 tokens) and on bf16 q heads
    (Gemma 3's q_norm: head dim 256); Pythia-410M's partial rotary (16 heads of 64, a quarter
    rotated, q and k as views of the projection, bf16 with fp32 cos/sin as under autocast); Qwen3's
    q_norm (Llama's form) on bf16 heads with its fp32 weight, as under autocast; T5's norm on its
    fp32 residual stream (T5-large width)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gpt_neox import modeling_gpt_neox

    def norm(width, shape, dtype):
        module = GemmaRMSNorm(width).cuda()
        return lambda: ((torch.randn(shape, device="cuda").to(dtype).requires_grad_(True),), module)

    def neox_rotary(b, s, h, d, rotary_dim):
        def make():
            qkv = torch.randn(b, s, 3, h, d, device="cuda").to(torch.bfloat16)
            q, k = (qkv[:, :, i].transpose(1, 2).detach().requires_grad_(True) for i in (0, 1))
            angles = torch.rand(b, s, rotary_dim // 2, device="cuda") * 100
            emb = torch.cat((angles, angles), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            return (q, k), lambda q, k: modeling_gpt_neox.apply_rotary_pos_emb(q, k, cos, sin)
        return make

    yield "GemmaRMSNorm 8192x2048 fp32", norm(2048, (8192, 2048), torch.float32)
    yield "GemmaRMSNorm 8192x2048 bf16", norm(2048, (8192, 2048), torch.bfloat16)
    yield "GemmaRMSNorm q heads 8192x8x256 bf16", norm(256, (8192, 8, 256), torch.bfloat16)
    yield "GPT-NeoX rotary, Pythia-410M B4 S1024 (16 of 64 dims)", neox_rotary(4, 1024, 16, 64, 16)
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    q_norm = Qwen3RMSNorm(128).cuda()
    yield ("Qwen3RMSNorm q heads 8192x16x128 bf16, fp32 weight (autocast)",
           lambda: ((torch.randn(8192, 16, 128, device="cuda").to(torch.bfloat16).requires_grad_(True),), q_norm))
    from transformers.models.t5.modeling_t5 import T5LayerNorm
    t5 = T5LayerNorm(1024).cuda()
    yield "T5LayerNorm 16384x1024 fp32", lambda: ((torch.randn(16384, 1024, device="cuda").requires_grad_(True),), t5)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib-dir", required=True)
    p.add_argument("--out")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    import torchfuse
    assert torchfuse.enable(a.lib_dir), "torchfuse did not load"
    from bench_common import copy_bandwidth, timed_loop, write_report  # beside this script
    bandwidth = copy_bandwidth() * 1e12  # TB/s
    lines = [f"# Rewritten HF modules vs their original code ({torch.cuda.get_device_name()})", "",
             f"`python3 scripts/bench/bench_rewrites.py --lib-dir {a.lib_dir}`; forward + backward, GPU µs "
             f"(CUDA events, median of {a.rounds} interleaved rounds of 30); copy bandwidth {bandwidth / 1e12:.2f} TB/s", "",
             "| module or function | original | rewritten | speed-up | one read + write of the inputs at copy bandwidth |",
             "|---|---|---|---|---|"]
    for name, make in cases():
        results = {"original": [], "rewritten": []}
        for _ in range(a.rounds):
            inputs, call = make()
            outputs = call(*inputs)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            grads = [torch.randn_like(o) for o in outputs]

            def step():
                torch.autograd.backward(call(*inputs), grads)

            for side, times in results.items():
                with torchfuse.disabled() if side == "original" else contextlib.nullcontext():
                    step()  # warm
                    times.append(statistics.median(timed_loop(step, [()], 30)))
        original, rewritten = (statistics.median(v) for v in results.values())
        nbytes = sum(t.numel() * t.element_size() for t in inputs)
        roofline = 2 * nbytes / bandwidth * 1e6
        lines.append(f"| {name} | {original:.1f} | {rewritten:.1f} | {original / rewritten:.2f}x | {roofline:.1f} |")
    write_report(lines, a.out, "bench_rewrites.md")


if __name__ == "__main__":
    main()
