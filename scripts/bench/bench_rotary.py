"""Rotary benchmark per docs/testing.md ("Benchmarks"): torch.ops.torchfuse.rotary and its
backward (q and k in one launch), torchfuse's kernel vs stock (the same op switched off: HF's
composition, op for op), in one process. CUDA events, warm-up, medians of interleaved rounds,
input sets rotated over more memory than L2, copy bandwidth measured in the same run.
Bytes: q and k read once and their outputs written once (cos and sin, read per row, are
counted once).

Usage: bench_rotary.py --lib-dir DIR [--out DIR]  (writes DIR/bench_rotary.md)
"""

import torch

from bench_common import kernel_bench_setup, run_timings, write_report

# (batch, seq, q heads, kv heads, head dim, q/k dtype, cos/sin dtype): the Llama-style bench
# model under autocast (fp32 cos/sin: fp32 output) and in pure bf16, Llama-7B at S4096, and a
# short sequence (where a launch costs more than the bytes).
CASES = [
    (4, 1024, 16, 8, 64, torch.bfloat16, torch.float32),
    (4, 1024, 16, 8, 64, torch.bfloat16, torch.bfloat16),
    (1, 4096, 32, 32, 128, torch.bfloat16, torch.bfloat16),
    (1, 128, 8, 8, 64, torch.bfloat16, torch.float32),
]
NAME = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def views(b, s, h, d, dtype):
    """[B, H, S, D] views of a [B, S, H*D] projection, as HF's attention makes them."""
    return torch.randn(b, s, h * d, device="cuda").to(dtype).view(b, s, h, d).transpose(1, 2)


def main():
    args, bandwidth = kernel_bench_setup()
    rows = [f"# Rotary (HF's rotate-half form, q and k) on {torch.cuda.get_device_name()} (torch {torch.__version__})",
            "", f"Copy bandwidth in this run: {bandwidth:.2f} TB/s. Times: µs per call, median.", "",
            "| q, k | dtypes | direction | stock | torchfuse | vs stock | % of copy bw |", "|---|---|---|---|---|---|---|"]
    sides = [("stock", False, ""), ("torchfuse", True, "")]
    for b, s, hq, hk, d, x_dtype, trig_dtype in CASES:
        out_dtype = torch.promote_types(x_dtype, trig_dtype)
        n = b * s * (hq + hk) * d
        sets = max(2, (256 << 20) // (n * 2 * 2) + 1)
        qs = [views(b, s, hq, d, x_dtype) for _ in range(sets)]
        ks = [views(b, s, hk, d, x_dtype) for _ in range(sets)]
        angles = torch.rand(b, s, d // 2, device="cuda") * 100
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(trig_dtype), emb.sin().to(trig_dtype)
        fwd = run_timings("rotary", lambda q, k: torch.ops.torchfuse.rotary(q, k, cos, sin, 1),
                          list(zip(qs, ks)), sides)
        dqs = [torch.randn(q.shape, device="cuda").to(out_dtype) for q in qs]
        dks = [torch.randn(k.shape, device="cuda").to(out_dtype) for k in ks]
        bwd = run_timings("rotary", lambda dq, dk: torch.ops.torchfuse.rotary_backward(dq, dk, cos, sin, 1, x_dtype),
                          list(zip(dqs, dks)), sides)
        xb, ob = torch.finfo(x_dtype).bits // 8, torch.finfo(out_dtype).bits // 8
        for direction, t in (("forward", fwd), ("backward", bwd)):
            roof = n * (xb + ob) / (bandwidth * 1e12) * 1e6
            rows.append(f"| [{b},{hq},{s},{d}], [{b},{hk},{s},{d}] | {NAME[x_dtype]}, {NAME[trig_dtype]} cos/sin | "
                        f"{direction} | {t['stock']:.1f} | {t['torchfuse']:.1f} | {t['stock'] / t['torchfuse']:.2f}x | "
                        f"{100 * roof / t['torchfuse']:.0f}% |")
            print(rows[-1], flush=True)
        del qs, ks, dqs, dks
        torch.cuda.empty_cache()
    write_report(rows, args.out, "bench_rotary.md")


if __name__ == "__main__":
    main()
