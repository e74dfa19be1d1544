"""shared_cast benchmark per docs/testing.md ("Benchmarks"): one HF decoder layer (Llama's code,
the shapes of Qwen2.5-0.5B and of the bench's Llama-style model), forward and backward under
bf16 autocast from an fp32 residual stream, with the rewrite layer on and shared_cast switched
on and off at run time (`set_enabled`: its wrapper asks before each cast), in one process.
CUDA events, warm-up, medians of interleaved rounds, input sets rotated over more memory than
L2; the eager step is host-sensitive, so the same calls are also timed as CUDA-graph replays
(GPU time alone). Peak memory of one call per side beside it.

Usage: bench_shared_cast.py --lib-dir DIR [--out DIR]  (writes DIR/bench_shared_cast.md)
"""
import argparse
import sys
from pathlib import Path

import torch

# (name, hidden, heads, kv heads, intermediate, batch, seq)
CASES = [
    ("Qwen2.5-0.5B layer", 896, 14, 2, 4864, 4, 1024),
    ("Llama-style 300M layer", 1024, 16, 8, 2816, 4, 1024),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib-dir", required=True)
    parser.add_argument("--out")
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "python"))
    import torchfuse
    torchfuse.enable(args.lib_dir)
    import transformers.models.llama.modeling_llama as L
    from bench_common import graph_timings, run_timings, write_report

    assert L.LlamaAttention.forward.__code__.co_name == "shared_cast", "shared_cast is not on"
    rows = [f"# shared_cast: one decoder layer, forward + backward, bf16 autocast, on {torch.cuda.get_device_name()}"
            f" (torch {torch.__version__})", "",
            "Times: µs per call, median (eager: CUDA events around the calls; graph: replays). "
            "Peak: MiB above the inputs for one call.", "",
            "| case | eager off | eager on | eager gain | graph off | graph on | graph gain | peak off | peak on |",
            "|---|---|---|---|---|---|---|---|---|"]
    sides = [("off", False, ""), ("on", True, "")]
    for name, hidden, heads, kv_heads, inter, b, s in CASES:
        config = L.LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                               intermediate_size=inter, num_hidden_layers=1)
        config._attn_implementation = "sdpa"
        layer = L.LlamaDecoderLayer(config, 0).cuda()
        rotary = L.LlamaRotaryEmbedding(config).cuda()
        position_ids = torch.arange(s, device="cuda").expand(b, s)
        sets = max(2, (256 << 20) // (b * s * hidden * 4) + 1)
        inputs = [(torch.randn(b, s, hidden, device="cuda", requires_grad=True),) for _ in range(sets)]
        cos, sin = rotary(inputs[0][0], position_ids)
        grad = torch.randn(b, s, hidden, device="cuda")

        def call(x):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = layer(x, position_embeddings=(cos, sin))
            out.backward(grad)

        eager = run_timings("shared_cast", call, inputs, sides)
        graph = graph_timings("shared_cast", call, inputs, sides)
        peak = {}
        for label, on, _ in sides:
            torch.ops.torchfuse.set_enabled("shared_cast", on)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            call(*inputs[0])
            torch.cuda.synchronize()
            peak[label] = (torch.cuda.max_memory_allocated() - base) / 2**20
        torch.ops.torchfuse.set_enabled("shared_cast", True)
        g_off, g_on = graph.get("off"), graph.get("on")
        graph_cells = (f"{g_off:.1f} | {g_on:.1f} | {g_off / g_on:.2f}x" if g_off and g_on else "– | – | –")
        rows.append(f"| {name} [{b}×{s}, {hidden}] | {eager['off']:.1f} | {eager['on']:.1f} | "
                    f"{eager['off'] / eager['on']:.2f}x | {graph_cells} | {peak['off']:.0f} | {peak['on']:.0f} |")
        print(rows[-1], flush=True)
        del inputs, layer
        torch.cuda.empty_cache()
    write_report(rows, args.out, "bench_shared_cast.md")


if __name__ == "__main__":
    main()
