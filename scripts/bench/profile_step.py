"""Where a whole training step of a bench_models.py model goes: GPU busy time (the kernels'
summed durations) against the step's wall time, kernel launches per step, and the largest GPU
kernels and host-side ops. GPU busy time well under the wall time means the host decides the
step (Python, dispatch, launches), not the kernels.

  python3 scripts/bench/profile_step.py --model gpt2 [--steps 5] [--top 15]
  scripts/torchfuse python3 scripts/bench/profile_step.py --model gpt2   # the same under torchfuse

With --compile the model's forward is torch.compile'd as bench_models.py's compile sides do
(Inductor's kernels show as triton_* names).

With --fsdp2 the model is sharded as bench_distributed.py shards it, bf16 parameters in the
step, no autocast: a world of one process, or of N under
`torchrun --nproc_per_node=N profile_step.py --fsdp2` (rank 0 prints).
"""
import argparse
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--fsdp2", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the model's forward")
    p.add_argument("--shapes", action="store_true", help="also the host ops by input shape")
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
        if a.shapes:
            print(prof.key_averages(group_by_input_shape=True).table(
                sort_by="cuda_time_total", row_limit=3 * a.top, max_name_column_width=40, max_shapes_column_width=90))
    if a.fsdp2:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
