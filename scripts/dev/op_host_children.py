"""Issue 40: what the host does inside each of torchfuse's ops in a whole training step. Profiles
a few steps of a bench_models.py model and, for every op whose name matches --match, prints its
calls a step, its mean CPU time (total and self) and its children's mean time per call: where
an op's own host time goes (its glue and Rust code is the self time; allocations, launches and
stock ops it calls are children). The profiler inflates every host time: compare ops with each
other, not with unprofiled walls.

  cd scripts/bench; TORCHFUSE_LIB_DIR=DIR ../torchfuse python3 ../dev/op_host_children.py --model gpt2
"""
import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_models import adamw, build, train_step  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--match", default="torchfuse,CppNode,cross_entropy,Backward")
    a = p.parse_args()
    model, loss_of, _, what = build(a.model, torch)
    model = model.cuda()
    opt = adamw(torch, model.parameters(), "stock")
    for _ in range(8):
        train_step(torch, model, loss_of, opt)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            train_step(torch, model, loss_of, opt)
        torch.cuda.synchronize()
    keys = a.match.split(",")
    calls, total, self_time = collections.Counter(), collections.Counter(), collections.Counter()
    children = collections.defaultdict(collections.Counter)
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or not any(k in e.name for k in keys):
            continue
        calls[e.name] += 1
        total[e.name] += e.cpu_time_total
        self_time[e.name] += e.self_cpu_time_total
        for c in e.cpu_children:
            children[e.name][c.name] += c.cpu_time_total
    print(f"{what}: ops matching {keys}, {a.steps} profiled steps; µs per call (profiled)")
    for name, n in sorted(calls.items(), key=lambda kv: -total[kv[0]]):
        print(f"\n{name[:90]}: {n / a.steps:.0f} a step, total {total[name] / n:.1f}, "
              f"self {self_time[name] / n:.1f}; {total[name] / a.steps / 1e3:.2f} ms a step")
        for child, t in children[name].most_common(8):
            print(f"    {child[:80]:80s} {t / n:8.1f}")


if __name__ == "__main__":
    main()
