"""KV-cache copy benchmark per docs/testing.md ("Benchmarks"): the first append of HF's
DynamicLayer.update (`torch.cat([empty, x], -2)` of K and V) against torchfuse::kv_copy served
by PyTorch's one-pass copy in the glue and by the kv_copy kernel, in one process. CUDA events,
warm-up, medians of interleaved rounds, input sets rotated over more memory than L2, copy
bandwidth measured in the same run. Bytes: x read once, its copy written once.

Usage: bench_kv_copy.py --lib-dir DIR [--out DIR]  (writes DIR/bench_kv_copy.md)
"""

import statistics

import torch

from bench_common import kernel_bench_setup, timed_loop, write_report

NAME = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def gpt2_views(b, s, h, d, dtype):
    """K and V as GPT-2 makes them: [B, H, S, D] views of c_attn's [B, S, 3*H*D] output."""
    qkv = torch.randn(b, s, 3 * h * d, device="cuda").to(dtype)
    _, k, v = qkv.split(h * d, dim=2)
    return (k.view(b, s, h, d).transpose(1, 2), v.view(b, s, h, d).transpose(1, 2))


def llama_k(b, s, h, d, dtype):
    """K after the rotary with fp32 cos/sin under autocast: a fresh row-major fp32 tensor."""
    k = torch.randn(b, h, s, d, device="cuda", dtype=dtype)
    return (k, k)


def llama_v(b, s, h, d, dtype):
    """V under autocast: a bf16 [B, H, S, D] view of v_proj's [B, S, H*D] output."""
    v = torch.randn(b, s, h * d, device="cuda").to(dtype).view(b, s, h, d).transpose(1, 2)
    return (v, v)


# (name, make pair, batch, seq, heads, head dim, x dtype, cache dtype)
CASES = [
    ("GPT-2 b32 K, V", gpt2_views, 32, 1024, 12, 64, torch.bfloat16, torch.bfloat16),
    ("GPT-2 b8 K, V", gpt2_views, 8, 1024, 12, 64, torch.bfloat16, torch.bfloat16),
    ("Llama b4 K (fp32)", llama_k, 4, 1024, 8, 64, torch.float32, torch.float32),
    ("Llama b4 V (promoted)", llama_v, 4, 1024, 8, 64, torch.bfloat16, torch.float32),
    ("short, b1 S128", gpt2_views, 1, 128, 12, 64, torch.bfloat16, torch.bfloat16),
]


def original(k, v, dtype):
    """DynamicLayer.update's first append: the caches are 1-D empties of K's dtype."""
    keys = torch.tensor([], dtype=dtype, device=k.device)
    values = torch.tensor([], dtype=dtype, device=k.device)
    return torch.cat([keys, k], dim=-2), torch.cat([values, v], dim=-2)


def main():
    args, bandwidth = kernel_bench_setup()
    rows = [f"# KV-cache first append on {torch.cuda.get_device_name()} (torch {torch.__version__})",
            "", f"Copy bandwidth in this run: {bandwidth:.2f} TB/s. Times: µs per call (K and V), median.", "",
            "| case | x → cache | cat (stock) | glue copy | kernel | kernel vs cat | kernel vs glue | kernel % of copy bw |",
            "|---|---|---|---|---|---|---|---|"]
    for name, make, b, s, h, d, x_dtype, cache_dtype in CASES:
        n = 2 * b * s * h * d
        in_bytes = n * torch.finfo(x_dtype).bits // 8 * (3 if make is gpt2_views else 1)
        sets = max(2, (256 << 20) // in_bytes + 1)
        inputs = [make(b, s, h, d, x_dtype) for _ in range(sets)]
        sides = {
            "cat": (lambda k, v: original(k, v, cache_dtype), False),
            "glue": (lambda k, v: torch.ops.torchfuse.kv_copy(k, v, cache_dtype, cache_dtype), False),
            "kernel": (lambda k, v: torch.ops.torchfuse.kv_copy(k, v, cache_dtype, cache_dtype), True),
        }
        for fn, every_shape in sides.values():  # warm-up, includes the kernel's compile
            torch.ops.torchfuse._serve_below_thresholds(every_shape)
            timed_loop(fn, inputs, 2)
        times = {label: [] for label in sides}
        for _ in range(5):
            for label, (fn, every_shape) in sides.items():
                torch.ops.torchfuse._serve_below_thresholds(every_shape)
                times[label] += timed_loop(fn, inputs, 8)
        t = {label: statistics.median(v) for label, v in times.items()}
        bytes_moved = n * (torch.finfo(x_dtype).bits + torch.finfo(cache_dtype).bits) // 8
        roof = bytes_moved / (bandwidth * 1e12) * 1e6
        rows.append(f"| {name} [{b},{h},{s},{d}] | {NAME[x_dtype]} → {NAME[cache_dtype]} | {t['cat']:.1f} | "
                    f"{t['glue']:.1f} | {t['kernel']:.1f} | {t['cat'] / t['kernel']:.2f}x | "
                    f"{t['glue'] / t['kernel']:.2f}x | {100 * roof / t['kernel']:.0f}% |")
        print(rows[-1], flush=True)
        del inputs
        torch.cuda.empty_cache()
    torch.ops.torchfuse._serve_below_thresholds(True)
    write_report(rows, args.out, "bench_kv_copy.md")


if __name__ == "__main__":
    main()
