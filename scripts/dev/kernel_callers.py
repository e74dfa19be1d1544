"""Who launches a step's kernels: for each GPU kernel whose name matches a pattern, the host ops
that launched it (the op, its input shapes and dtypes, and the ops around it up to the autograd
node or module call), summed over the profiled steps. profile_step.py says how much time a kernel
takes; this says which line of the model's step asked for it.

  TORCHFUSE_LIB_DIR=DIR scripts/torchfuse python3 scripts/dev/kernel_callers.py \
      --model gpt2-b32 --kernel "elementwise_kernel<128, 4" [--depth 4]

(run from scripts/bench/'s parent or anywhere: bench_models is imported from scripts/bench).
"""
import argparse
import collections
import os
import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_models import adamw, build, train_step  # noqa: E402


def chain(op, depth):
    """The op's name and shapes, then its parents' names, innermost first."""
    names = [f"{op.name} {op.input_shapes} {getattr(op, 'concrete_inputs', '') or ''}".strip()]
    parent = op.cpu_parent
    while parent is not None and len(names) <= depth:
        names.append(parent.name)
        parent = parent.cpu_parent
    return " <- ".join(names)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2-b32")
    p.add_argument("--kernel", required=True, help="a regex on the kernel's name")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--depth", type=int, default=4)
    a = p.parse_args()
    torch.manual_seed(0)
    model, loss_of, _, what = build(a.model, torch)
    model = model.cuda().train()
    opt = adamw(torch, model.parameters(), "stock")
    for _ in range(a.warmup):
        train_step(torch, model, loss_of, opt)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(a.steps):
            train_step(torch, model, loss_of, opt)
        torch.cuda.synchronize()
    pattern = re.compile(a.kernel)
    found = collections.defaultdict(lambda: [0, 0.0])  # caller chain -> [kernels, device µs]
    for op in prof.events():
        if op.device_type != torch.autograd.DeviceType.CPU:
            continue
        for k in op.kernels:
            if pattern.search(k.name):
                row = found[(k.name[:70], chain(op, a.depth))]
                row[0] += 1
                row[1] += k.duration
    print(f"{what}: kernels matching {a.kernel!r}, per step")
    for (kernel, callers), (n, us) in sorted(found.items(), key=lambda kv: -kv[1][1]):
        print(f"{us / a.steps / 1e3:8.3f} ms {n / a.steps:6.1f}x  {kernel}\n    {callers}")


if __name__ == "__main__":
    main()
