"""Issue 40 probe for a residual add + norm op: what the unfused chain costs the GPU today, at
the bench models' shapes, against the memory roofline of one pass that does the same work.

Under bf16 autocast an HF decoder layer adds its bf16 branch to the fp32 residual stream and
normalises the sum for the next Linear (GPT-2's `attn_output + residual` then `ln_2`; Llama's
residual add then `post_attention_layernorm`). Under torchfuse that is today:
  forward:  h = residual + branch (mixed_add), y = norm_cast(h) in bf16
  backward: dx = norm_cast_backward(dy, h), dh = dh_next + dx (the engine sums h's two
            gradients), d_branch = dh.to(bf16) (AddBackward0's cast for the bf16 operand)
Bytes an element (fp32 4, bf16 2): the chain's forward 6+4 (add) + 4+2 (norm) = 16, backward
4+2+4 (norm) + 4+4+4 (sum) + 4+2 (cast) = 28. One pass each: forward 4+2 read, 4+2 written = 12;
backward h, dy, dh_next read, dh and d_branch written = 16. Every shape runs LayerNorm (GPT-2's);
Llama's RMSNorm moves the same bytes a row.

  python3 scripts/dev/add_norm_probe.py --lib-dir DIR
"""
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_common import capture_graph, kernel_bench_setup, replay_times  # noqa: E402

SETS, ROUNDS, REPS = 3, 3, 10


def case(rows, width):
    """GPU µs of the chain (forward; forward and backward, through autograd as a step runs it),
    each over SETS input sets captured in a CUDA graph (no host in the way), and of its add and
    its sum + cast alone."""
    cuda, bf16 = dict(device="cuda"), torch.bfloat16
    w, b = (torch.randn(width, **cuda, requires_grad=True) for _ in range(2))
    sets = []
    for _ in range(SETS):
        residual = torch.randn(rows, width, **cuda, requires_grad=True)
        branch = torch.randn(rows, width, **cuda).to(bf16).requires_grad_()
        dy, dh_next = torch.randn(rows, width, **cuda).to(bf16), torch.randn(rows, width, **cuda)
        sets.append((residual, branch, dy, dh_next))
    norm_cast = torch.ops.torchfuse.norm_cast.default

    def forward(residual, branch, _dy, _dh):
        h = residual + branch
        return h, norm_cast(h, w, b, 1e-5, False, bf16)

    def step(residual, branch, dy, dh_next):
        h, y = forward(residual, branch, dy, dh_next)
        torch.autograd.grad([y, h], [residual, branch, w, b], [dy, dh_next])

    def add_only(residual, branch, _dy, _dh):
        with torch.no_grad():
            residual + branch

    def sum_cast(residual, _b, _dy, dh_next):
        with torch.no_grad():
            (dh_next + residual).to(bf16)

    fns = {"forward": forward, "forward and backward": step, "add": add_only, "sum + cast": sum_cast}
    graphs = {name: capture_graph(fn, sets) for name, fn in fns.items()}
    times = replay_times(graphs, SETS, ROUNDS, REPS)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    _, bandwidth = kernel_bench_setup()
    print(f"# A residual add + norm at bench shapes ({torch.cuda.get_device_name()}); copy "
          f"{bandwidth:.2f} TB/s\n")
    print("Chain: GPU µs a call (CUDA-graph replays, medians); backward: the step's minus the "
          "forward's (its dweight and dbias included).\n")
    print("| shape | forward chain µs | one-pass bound µs | backward chain µs | one-pass bound µs | "
          "add µs | sum + cast µs |\n|---|---|---|---|---|---|---|")
    for label, rows, width in (("GPT-2 B32 (32768x768)", 32768, 768), ("GPT-2 B8 (8192x768)", 8192, 768),
                               ("Llama-style B4 (4096x1024)", 4096, 1024)):
        t = case(rows, width)
        elems = rows * width
        fwd_bound, bwd_bound = (n * elems / (bandwidth * 1e12) * 1e6 for n in (12, 16))
        backward = t["forward and backward"] - t["forward"]
        print(f"| {label} | {t['forward']:.1f} | {fwd_bound:.1f} | {backward:.1f} | "
              f"{bwd_bound:.1f} | {t['add']:.1f} | {t['sum + cast']:.1f} |")
    ops = json.loads(torch.ops.torchfuse.stats())["ops"]
    print("\nserved (kernel: calls) / stock (reason: calls):")
    for name, entry in ops.items():
        print(f"  {name}: {entry}")


if __name__ == "__main__":
    main()
