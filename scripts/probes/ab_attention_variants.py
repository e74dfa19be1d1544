"""Two attention registry variants against each other, forced by name, as CUDA-graph replays
(GPU time only) in interleaved rounds: forward and forward+backward at the issue-6 shapes
that do not fail capture. For differences too small for bench_attention.py's side order.

  python3 scripts/probes/ab_attention_variants.py --lib-dir .dev [--deterministic] \
      [--variants wg,wg_persistent]

A variant suffix X names attn_d<D>_<causal|full>_X in registry/attention.toml, and "-" the
unsuffixed attn_d<D>_<causal|full> (the mma.sync kernels)."""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_attention import SHAPES, make_inputs, phase_calls
from bench_common import capture_graph, replay_times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib-dir", required=True)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--variants", default="wg,wg_persistent")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    torch.ops.load_library(str(Path(args.lib_dir) / "libtorchfuse.so"))
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.ops.torchfuse._serve_below_thresholds(True)
    suffixes = args.variants.split(",")
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() & 0xFFFFFFFF)
    print(f"device: {torch.cuda.get_device_name()}; deterministic={args.deterministic}")
    # Every issue-6 shape but GPT-2's, whose forward+backward no side can capture.
    for b, h, s, d, causal in SHAPES[1:]:
        inputs = make_inputs(b, h, s, d, 2, gen)
        mask = "causal" if causal else "full"
        for phase, fn in phase_calls(causal).items():
            graphs = {}
            for suffix in suffixes:
                tail = "" if suffix == "-" else f"_{suffix}"
                torch.ops.torchfuse._force_variant(f"attn_d{d}_{mask}{tail}")
                graphs[suffix] = capture_graph(fn, inputs, capture_error_mode="thread_local")
            torch.ops.torchfuse._force_variant("")
            times = replay_times(graphs, len(inputs), args.rounds, 5)
            med = {k: statistics.median(v) for k, v in times.items()}
            first = med[suffixes[0]]
            cells = "  ".join(f"{k} {v:8.1f}us ({v / first:.3f})" for k, v in med.items())
            print(f"{phase:6s} B{b} H{h} S{s} D{d} {mask:6s}  {cells}", flush=True)


if __name__ == "__main__":
    main()
