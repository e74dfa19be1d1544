"""Whole training steps of a bench_models.py model under torchfuse, the registry's choice
against variants forced by name (torch.ops.torchfuse._force_variant: every call of that
variant's op goes to it, past the registry's thresholds), in one process: interleaved rounds,
the median step of each (CUDA events), then the median over rounds. For a routing question a
kernel bench cannot answer alone (a kernel's output layout changes what the model's next ops
copy).

  TORCHFUSE_LIB_DIR=DIR scripts/torchfuse python3 scripts/dev/step_variant_ab.py \
      --model gpt2-b32 --force attn_d64_causal [--rounds 3 --steps 8 --warmup 4]
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_models import adamw, build, timed_steps  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--force", required=True, help="variant names, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    if not hasattr(torch.ops.torchfuse, "_force_variant"):
        raise SystemExit("run under torchfuse (scripts/torchfuse python3 ...)")
    torch.manual_seed(0)
    model, loss_of, per_step, what = build(args.model, torch)
    model.cuda().train()
    opt = adamw(torch, model.parameters(), "torchfuse")
    sides = [""] + args.force.split(",")
    times = {side: [] for side in sides}
    for side in sides:  # warm-up: the kernels compile
        torch.ops.torchfuse._force_variant(side)
        timed_steps(torch, model, loss_of, opt, args.warmup, 1)
    for _ in range(args.rounds):
        for side in sides:
            torch.ops.torchfuse._force_variant(side)
            ms, losses = timed_steps(torch, model, loss_of, opt, 2, args.steps)
            times[side].append(ms)
            print(f"{args.model} {side or 'registry'}: {ms:.2f} ms (loss {losses[-1]:.4f})", flush=True)
    torch.ops.torchfuse._force_variant("")
    base = statistics.median(times[""])
    print(f"\n{what}: ms a step, median over {args.rounds} rounds of {args.steps} steps")
    for side in sides:
        ms = statistics.median(times[side])
        print(f"| {args.model} | {side or 'registry'} | {ms:.2f} | {base / ms:.3f}x | "
              f"{per_step / ms * 1e3:,.0f}/s | {' '.join(f'{t:.2f}' for t in times[side])} |")


if __name__ == "__main__":
    main()
