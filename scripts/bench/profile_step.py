"""Where a whole training step of a bench_models.py model goes: GPU busy time (the kernels'
summed durations) against the step's wall time, kernel launches per step, and the largest GPU
kernels and host-side ops. GPU busy time well under the wall time means the host decides the
step (Python, dispatch, launches), not the kernels.

  python3 scripts/bench/profile_step.py --model gpt2 [--steps 5] [--top 15]
  scripts/torchfuse python3 scripts/bench/profile_step.py --model gpt2   # the same under torchfuse

With --compile the model's forward is torch.compile'd as bench_models.py's compile sides do
(Inductor's kernels show as triton_* names).

With --python the host's side is profiled instead: the step's Python time by where the code
lives (torchfuse's rewrites, transformers, torch's Python, calls into torch's C++ from Python,
the backward's C++ engine), the largest Python functions, and the host's wall time of the
forward, the backward and the optimizer's step (each phase timed to its last launch, not to its
GPU work). cProfile slows Python down: read its shares, not its absolute times; it sees the
main thread only, so Python run on autograd's device thread (hooks, checkpointing's recompute,
Python autograd Functions' backward) counts inside the backward engine's time.

With --gaps the GPU's idle time inside the profiled steps is split (from the profiler's trace):
gaps before work the host had queued in time (the GPU's own latency between kernels) against
gaps the host closed late (the launch returned after the GPU had gone idle), the latter summed by
the host op that launched the work ending each gap: which host work the GPU waits on. The
profiler slows the host, so the late share is larger here than in an unprofiled step.

With --fsdp2 the model is sharded as bench_distributed.py shards it, bf16 parameters in the
step, no autocast: a world of one process, or of N under
`torchrun --nproc_per_node=N profile_step.py --fsdp2` (rank 0 prints).
"""
import argparse
import bisect
import os
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench_distributed import NO_MULTICAST, shard_fsdp2
from bench_models import adamw, build, train_step


# What issue 40 tracks of a step's GPU time: each kernel is counted under the op that launched it
# (the profiler's self device time of that op), the ops grouped by kind, first match wins.
KINDS = (
    ("matmul", re.compile(r"^aten::(mm|addmm|bmm|baddbmm|_scaled_mm|_grouped_mm|matmul|linear)$")),
    ("attention", re.compile(r"attention")),
    ("casts and copies", re.compile(r"^aten::(copy_|_to_copy|to|clone|contiguous)$")),
    ("cat", re.compile(r"^aten::cat$")),
    ("optimizer", re.compile(r"adam|_foreach_|Optimizer", re.I)),
    ("norms", re.compile(r"layer_norm|rms_norm")),
    ("cross-entropy", re.compile(r"cross_entropy|log_softmax|nll_loss")),
    ("torchfuse's other ops", re.compile(r"^torchfuse::")),
)


def gpu_time_by_kind(rows):
    """{kind: summed device µs} of (op name, self device µs) rows; kinds as KINDS, the rest
    "other"."""
    out = {}
    for name, us in rows:
        kind = next((k for k, pattern in KINDS if pattern.search(name)), "other")
        out[kind] = out.get(kind, 0.0) + us
    return out


def package_dir(name):
    """The directory of an importable package (without importing it), or None."""
    import importlib.util
    spec = importlib.util.find_spec(name)
    return os.path.dirname(spec.origin) + os.sep if spec and spec.origin else None


def package_areas():
    """(package directory, area) of torchfuse's, transformers' and torch's installed code."""
    return [(package_dir(p), area) for p, area in (("torchfuse", "torchfuse's Python"),
                                                   ("transformers", "transformers"),
                                                   ("torch", "torch's Python"))]


def area_of(filename, name, roots=None):
    """Where a profiled function runs: the area python_profile sums it under. `roots`: (package
    directory, area) pairs, by default `package_areas()`."""
    if filename == "~":  # a builtin: attribute it by what it is
        if "run_backward" in name:
            return "backward (C++ engine, hooks)"
        return "torch C++ and builtins called from Python"
    for root, area in package_areas() if roots is None else roots:
        if root and filename.startswith(root):
            return area
    return "other Python (the bench's loop)"


def python_profile(step, steps, top, show=True, sync=None):
    """The host's side of `steps` steps: phase wall times (one step, timed on the host), then the
    cProfile'd Python time per step by area and the `top` functions by own time, printed where
    `show` (every rank of a distributed run takes the same steps; rank 0 prints). `sync` waits
    for the GPU (torch.cuda.synchronize by default)."""
    import cProfile
    import pstats

    sync = sync or torch.cuda.synchronize

    phases, depth = {}, [0]
    original_backward = torch.Tensor.backward

    def timed_backward(self, *args, **kwargs):
        # Tensor.backward may re-enter itself (a tensor subclass, a torch function mode): the
        # outermost call is timed.
        depth[0] += 1
        begin = time.perf_counter()
        try:
            return original_backward(self, *args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0 and "start" in phases:
                phases["forward"] = begin - phases.pop("start")
                phases["backward"] = time.perf_counter() - begin
                phases["start"] = time.perf_counter()

    sync()
    phases["start"] = time.perf_counter()
    torch.Tensor.backward = timed_backward
    try:
        step()
    finally:
        torch.Tensor.backward = original_backward
    rest = "optimizer and the rest" if "backward" in phases else "the whole step (no Tensor.backward seen)"
    phases[rest] = time.perf_counter() - phases.pop("start")
    if show:
        print("host wall of one step (ms, to the last launch): " + ", ".join(
            f"{k} {v * 1e3:.2f}" for k, v in phases.items()))
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    sync()
    prof.disable()
    if not show:
        return
    stats = pstats.Stats(prof).stats
    areas, roots = {}, package_areas()  # found once, not per profiled function
    for (filename, _, name), (_, _, own, _, _) in stats.items():
        area = area_of(filename, name, roots)
        areas[area] = areas.get(area, 0.0) + own
    total = sum(areas.values()) or 1.0
    print(f"profiled Python time {total * 1e3 / steps:.2f} ms/step, by area (ms/step, share): " + ", ".join(
        f"{a} {t * 1e3 / steps:.2f} ({t / total:.0%})" for a, t in sorted(areas.items(), key=lambda kv: -kv[1])))
    print(f"{'own ms/step':>12} {'calls/step':>10}  function")
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (filename, line, name), (_, calls, own, _, _) in rows:
        where = name if filename == "~" else f"{name} ({'/'.join(filename.split('/')[-2:])}:{line})"
        print(f"{own * 1e3 / steps:12.3f} {calls / steps:10.0f}  {where}")


def idle_gaps(events):
    """The GPU's idle gaps between the device events of a chrome trace (`events`: its
    traceEvents), each as (µs idle, the host launched the next work late: bool, the outermost host
    op around that launch or None). The GPU is idle where no kernel, copy or memset runs (streams
    merged); a gap counts as the host's where the runtime call that launched the work ending it
    returned after the gap began (the work was not yet queued when the GPU went idle)."""
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                     and "dur" in e), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and "dur" in e), key=lambda e: e["ts"])
    starts = [e["ts"] for e in ops]
    longest = max((e["dur"] for e in ops), default=0)

    def outermost_op(tid, ts):
        # The earliest-starting op of that thread still running at ts: ops nest, so it is the
        # outermost. Scanned back from ts, no further than the longest op lasts.
        best = None
        for i in range(bisect.bisect_right(starts, ts) - 1, -1, -1):
            e = ops[i]
            if ts - e["ts"] > longest:
                break
            if e["tid"] == tid and e["ts"] + e["dur"] >= ts:
                best = e
        return best["name"] if best else None

    gaps, busy_until = [], None
    for e in device:
        if busy_until is not None and e["ts"] > busy_until:
            launch = launches.get(e.get("args", {}).get("correlation"))
            late = launch is not None and launch["ts"] + launch.get("dur", 0) > busy_until
            gaps.append((e["ts"] - busy_until, late, outermost_op(launch["tid"], launch["ts"]) if late else None))
        busy_until = max(busy_until or 0, e["ts"] + e["dur"])
    return gaps


def print_gaps(prof, steps, top):
    """Prints idle_gaps of a finished profile, per step."""
    import json
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    gaps = idle_gaps(events)
    early = [us for us, late, _ in gaps if not late]
    late = [(us, op) for us, late, op in gaps if late]
    print(f"GPU idle between its work: {sum(us for us, _, _ in gaps) / 1e3 / steps:.2f} ms/step in "
          f"{len(gaps) / steps:.0f} gaps; work queued in time: {sum(early) / 1e3 / steps:.2f} ms/step "
          f"({len(early) / steps:.0f} gaps, median {sorted(early)[len(early) // 2] if early else 0:.1f} us); "
          f"the host launching late: {sum(us for us, _ in late) / 1e3 / steps:.2f} ms/step ({len(late) / steps:.0f} gaps)")
    by_op = {}
    for us, op in late:
        total, count = by_op.get(op, (0.0, 0))
        by_op[op] = (total + us, count + 1)
    print(f"{'late ms/step':>12} {'gaps/step':>9}  outermost host op of the late launch")
    for op, (us, count) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{us / 1e3 / steps:12.3f} {count / steps:9.1f}  {op}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--fsdp2", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the model's forward")
    p.add_argument("--shapes", action="store_true", help="also the host ops by input shape")
    p.add_argument("--python", action="store_true", help="the host's Python time instead (cProfile)")
    p.add_argument("--gaps", action="store_true", help="also where the GPU idles (see above)")
    a = p.parse_args()
    torch.manual_seed(0)
    model, loss_of, _, what = build(a.model, torch)
    rank = 0
    if a.fsdp2:
        for key, value in dict(MASTER_ADDR="localhost", MASTER_PORT="29512", RANK="0", WORLD_SIZE="1",
                               LOCAL_RANK="0", **NO_MULTICAST).items():
            os.environ.setdefault(key, value)
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl")
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        what = what.replace("bf16 autocast", "bf16 parameters, no autocast") + f" (FSDP2, {world} GPU{'s' if world > 1 else ''})"
    model = model.cuda().train()
    if a.fsdp2:
        model = shard_fsdp2(torch, model)
    opt = adamw(torch, model.parameters(), "stock")  # the benches' unchanged AdamW
    stepped = torch.compile(model) if a.compile else model
    if a.compile:
        what += ", torch.compile"

    def step():
        train_step(torch, stepped, loss_of, opt, autocast=not a.fsdp2)

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - begin) * 1e3 / a.steps
    if a.python:
        if rank == 0:
            print(f"{what}: wall {wall_ms:.2f} ms/step (unprofiled)")
        python_profile(step, a.steps, a.top, show=rank == 0)
        if a.fsdp2:
            torch.distributed.destroy_process_group()
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=a.shapes) as prof:
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
    # GPU-side events, less the spans of user annotations (the optimizer's step shows as one).
    # NCCL's kernels run on their own streams beside the compute, so they are summed apart.
    kernels = [e for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    comm = [e for e in kernels if "nccl" in e.name.lower()]
    comm_ms = sum(e.device_time for e in comm) / 1e3 / a.steps
    busy_ms = sum(e.device_time for e in kernels) / 1e3 / a.steps - comm_ms
    if rank == 0:
        print(f"{what}: wall {wall_ms:.2f} ms/step (unprofiled), GPU busy {busy_ms:.2f} ms/step"
              + (f" (and NCCL kernels {comm_ms:.2f} ms/step, overlapping)" if comm else "")
              + f", {len(kernels) / a.steps:.0f} kernels/step")
        # The CPU-side ops' self device time: each kernel once, under the op that launched it
        # (the kernels' own rows and user annotations, such as the optimizer's span, left out).
        cpu = torch.autograd.DeviceType.CPU
        ops = [(e.key, e.self_device_time_total) for e in prof.key_averages()
               if e.device_type == cpu and e.self_device_time_total > 0
               and not getattr(e, "is_user_annotation", False)]
        kinds = gpu_time_by_kind(ops)
        total = sum(kinds.values()) or 1.0
        print("GPU time by kind (ms/step, share): " + ", ".join(
            f"{kind} {us / 1e3 / a.steps:.2f} ({us / total:.0%})"
            for kind, us in sorted(kinds.items(), key=lambda kv: -kv[1])))
        for key in ("self_cuda_time_total", "self_cpu_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=a.top, max_name_column_width=60))
        if a.gaps:
            print_gaps(prof, a.steps, a.top)
        if a.shapes:
            print(prof.key_averages(group_by_input_shape=True).table(
                sort_by="cuda_time_total", row_limit=3 * a.top, max_name_column_width=40, max_shapes_column_width=90))
    if a.fsdp2:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
