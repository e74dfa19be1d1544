"""Issue 40: what one training step of a bench_models.py model still dispatches, phase by phase.
For the forward, the backward and the optimizer's step it prints the top-level ops the host
dispatched (ops called from Python or by autograd's engine, not those called inside another op)
and the kernels launched; for the backward also the autograd nodes by type, from a walk of the
loss's graph. Each op and node costs the host a dispatch: these are the counts a fusion lowers.

  cd scripts/bench; TORCHFUSE_LIB_DIR=DIR ../torchfuse python3 ../dev/graph_inventory.py --model llama
"""
import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_models import adamw, build, train_step  # noqa: E402

# The profiler's wrapper events: ops under them are the ones their phase dispatched.
WRAPPERS = ("autograd::engine::evaluate_function", "Optimizer.step", "Optimizer.zero_grad")


def graph_nodes(fn):
    """Counter of the node names reachable from fn."""
    seen, pending, names = set(), [fn], collections.Counter()
    while pending:
        f = pending.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names[f.name()] += 1
        pending.extend(n for n, _ in f.next_functions)
    return names


def top_level_ops(prof):
    """(Counter of top-level op names, kernel count) of a profile."""
    ops, kernels = collections.Counter(), 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            kernels += 1
            continue
        parent = e.cpu_parent
        if e.name.startswith(WRAPPERS) or e.name.startswith("cuda") or e.name.startswith("cu"):
            continue
        if parent is None or parent.name.startswith(WRAPPERS):
            ops[e.name] += 1
    return ops, kernels


def show(title, counter, top):
    print(f"\n{title}: {sum(counter.values())}")
    for name, n in counter.most_common(top):
        print(f"  {n:5d}  {name[:100]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama")
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args()
    model, loss_of, _, what = build(a.model, torch)
    model = model.cuda()
    opt = adamw(torch, model.parameters(), "stock")
    for _ in range(6):
        train_step(torch, model, loss_of, opt)
    torch.cuda.synchronize()
    print(f"{what}: one step")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as forward:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(model)
        torch.cuda.synchronize()
    nodes = graph_nodes(loss.grad_fn)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as backward:
        loss.backward()
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as step:
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    for phase, prof in (("forward", forward), ("backward", backward), ("optimizer", step)):
        ops, kernels = top_level_ops(prof)
        show(f"{phase}: {kernels} device events; top-level ops", ops, a.top)
    show("autograd nodes", nodes, a.top)


if __name__ == "__main__":
    main()
