"""Whole training steps of bench_models.py's unchanged HF models on several GPUs of one host,
launched with torchrun: DistributedDataParallel or FSDP2 (`fully_shard` of every layer of the
model's layer lists and of the model, bf16 compute and fp32 gradient reduction), stock against
torchfuse (`scripts/torchfuse torchrun ...`), 1 GPU against N with the same per-GPU batch.

Each (model, parallel, GPUs, side) is one torchrun job; rounds interleave them. Rank 0 reports
the median step time over CUDA events after warm-up, the peak memory and every step's loss;
each torchfuse job's ranks leave their stats (TORCHFUSE_STATS_DIR), and `torchfuse stats`
says whether every rank made the same choices. The table sets torchfuse's speed-up on N GPUs
beside its speed-up on 1 (issue 26's target: at least 97% of the 1-GPU one).

  python3 scripts/bench/bench_distributed.py --lib-dir .dev --out $OUT [--models gpt2,llama]
      [--parallel ddp,fsdp2] [--gpus 1,2] [--sides stock,torchfuse] [--rounds 1] [--steps 20] [--warmup 8]

Side `torchfuse-rank1-off` is torchfuse with TORCHFUSE=0 in rank 1 only (a misconfiguration a
user can make): the job must train to the end, rank 1 on stock's kernels. Side `torchfuse:SPEC`
sets TORCHFUSE_OPS=SPEC as in bench_models.py. Side `stock-fused-adam` is stock with PyTorch's
own `AdamW(fused=True)`, as in bench_models.py: a rounding change to judge loss differences by.

The full matrix is 16 torchrun jobs; on a machine with 10-minute commands, split it by
--models and --parallel (the runs append to OUT/bench_distributed.jsonl); `--merge A.jsonl
B.jsonl` reports the runs of several calls as one table, losses paired across them.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench_models import adamw, build, drift_lines, length_label, max_loss_diff, side_env, timed_steps

ROOT = Path(__file__).resolve().parents[2]
# NVLink multicast stays off on shared hosts, also in the jobs this starts.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def shard_fsdp2(torch, model):
    """FSDP2 as an LLM job sets it up: every layer of the model's layer lists and then the model
    `fully_shard`ed, bf16 compute and fp32 gradient reduction (so no autocast)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layers in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
        for layer in layers:
            fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def worker(a):
    # TORCHFUSE is read when torch loads the library: this module and bench_models import
    # no torch at the top, or rank 1 of torchfuse-rank1-off would quietly run with torchfuse.
    assert "torch" not in sys.modules, "torch imported before the worker's settings"
    if a.side == "torchfuse-rank1-off" and os.environ.get("RANK") == "1":
        os.environ["TORCHFUSE"] = "0"
    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, loss_of, per_step, what = build(a.worker, torch)
    model = model.cuda().train()
    if a.parallel == "ddp":
        stepped, autocast = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local]), True
    else:
        stepped, autocast = shard_fsdp2(torch, model), False
        what = what.replace("bf16 autocast", "bf16 parameters, no autocast")
    opt = adamw(torch, stepped.parameters(), a.side)
    ms, losses = timed_steps(torch, stepped, loss_of, opt, a.warmup, a.steps, autocast)
    if rank == 0:
        print(json.dumps({"model": a.worker, "parallel": a.parallel, "gpus": dist.get_world_size(),
                          "side": a.side, "what": what, "per_gpu_step": per_step, "ms": ms,
                          "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                          "fused_optimizer": opt.param_groups[0].get("fused"), "losses": losses}))
    dist.destroy_process_group()


def run(a, model, parallel, gpus, side, stats_dir):
    env = side_env(side, a.lib_dir)
    env.update(NO_MULTICAST)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(Path(__file__).parent), env.get("PYTHONPATH")] if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus),
           __file__, "--worker", model, "--parallel", parallel, "--side", side,
           "--steps", str(a.steps), "--warmup", str(a.warmup)]
    if side.startswith("torchfuse"):
        shutil.rmtree(stats_dir, ignore_errors=True)  # this job's files only
        env["TORCHFUSE_STATS_DIR"] = str(stats_dir)
        cmd = [str(ROOT / "scripts" / "torchfuse")] + cmd
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    reports = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not reports:
        print(proc.stderr[-3000:], file=sys.stderr, flush=True)
        return None
    r = json.loads(reports[-1])
    if side.startswith("torchfuse"):
        summary = subprocess.run([sys.executable, "-m", "torchfuse", "stats", str(stats_dir)], capture_output=True,
                                 text=True, env=dict(env, PYTHONPATH=str(ROOT / "python")))
        r["ranks_agree"] = ("every rank made the same choices" in summary.stdout if gpus > 1 else "–")
        if "ranks enable different ops" in summary.stdout:
            r["ranks_agree"] = "ranks enable different ops"
        (stats_dir / "summary.txt").write_text(summary.stdout + summary.stderr)
        r["stats"] = summary.stdout  # the per-rank table travels with the run's record
    return r


def report(runs, out, command):
    lines = [f"# Unchanged models on several GPUs (torchrun)\n\nCommand: `{command}`. Rank 0's median step time "
             "over CUDA events after warm-up, the median over rounds; loss difference: the largest |loss - stock's| "
             "over the steps of the same (model, parallel, GPUs) and over every pair of a run of the side and a "
             "stock run; in stock's row, stock against itself (its noise; nan with one stock run).\n",
             "| model | parallel | GPUs | side | ms/step | speed-up vs stock | peak GiB (rank 0) | max loss diff | "
             "fused optimizer | ranks agree |", "|---|---|---|---|---|---|---|---|---|---|"]
    # Runs of different lengths (merged calls) are kept apart: losses pair step for step.
    label_of = length_label(runs, lambda r: r["model"], lambda r: (r["model"], r["parallel"]))

    def key_of(r):
        return label_of(r), r["parallel"], r["gpus"]

    ordered = sorted(runs, key=lambda r: (r["model"], r["parallel"], r["gpus"], len(r.get("losses") or [])))
    keys = list(dict.fromkeys(key_of(r) for r in ordered))
    speedups, drift = {}, []
    for key in keys:
        label, parallel, gpus = key
        sides = {s: [r for r in runs if key_of(r) == key and r["side"] == s]
                 for s in dict.fromkeys(r["side"] for r in runs)}
        med = {s: statistics.median(r["ms"] for r in rs) for s, rs in sides.items() if rs}
        for side, rs in sides.items():
            if not rs:
                continue
            diff = max_loss_diff(rs, sides.get("stock", []), side == "stock")
            vs = med["stock"] / med[side] if "stock" in med else float("nan")
            if side == "torchfuse":
                speedups[key] = vs
            lines.append(f"| {label} | {parallel} | {gpus} | {side} | {med[side]:.2f} | {vs:.2f}x | "
                         f"{max(r['peak_gib'] for r in rs):.2f} | {diff:.2e} | {rs[0]['fused_optimizer']} | "
                         f"{rs[0].get('ranks_agree', '–')} |")
        drift += drift_lines(f"{label} {parallel} {gpus} GPUs", sides)
    lines += drift
    lines.append("\ntorchfuse's speed-up on N GPUs against its speed-up on 1 (target: at least 97% of the 1-GPU one):\n")
    for (model, parallel, gpus), s in sorted(speedups.items()):
        one = speedups.get((model, parallel, 1))
        if gpus > 1 and one:
            lines.append(f"- {model} {parallel} {gpus} GPUs: {s:.2f}x vs 1 GPU {one:.2f}x "
                         f"({'met' if s >= 0.97 * one else 'missed'})")
    (out / "bench_distributed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib-dir", default=str(ROOT / ".dev"))
    p.add_argument("--out", default="bench-out")
    p.add_argument("--models", default="gpt2,llama")
    p.add_argument("--parallel", default="ddp,fsdp2")
    p.add_argument("--gpus", default="1,2")
    p.add_argument("--sides", default="stock,torchfuse")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--merge", nargs="+", metavar="JSONL",
                   help="no runs: report the runs in these bench_distributed.jsonl files (several calls: "
                        "machines differ, so compare times within one call)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--side", default="stock", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    command = "python3 scripts/bench/bench_distributed.py " + " ".join(sys.argv[1:])
    if a.merge:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        runs = [json.loads(line) for path in a.merge for line in Path(path).read_text().splitlines()]
        return report(runs, out, command)
    for side in a.sides.split(","):
        if side not in ("stock", "stock-fused-adam", "torchfuse", "torchfuse-rank1-off") and \
                not side.startswith("torchfuse:"):
            p.error(f"unknown side {side!r}: stock, stock-fused-adam, torchfuse, torchfuse-rank1-off "
                    "or torchfuse:SPEC")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for rnd in range(a.rounds):
        for model in a.models.split(","):
            for parallel in a.parallel.split(","):
                for gpus in map(int, a.gpus.split(",")):
                    for side in a.sides.split(","):
                        label = re.sub(r"[^A-Za-z0-9_-]", "_", side)
                        stats_dir = out / "stats" / f"{model}-{parallel}-{gpus}gpu-r{rnd}-{label}"
                        r = run(a, model, parallel, gpus, side, stats_dir)
                        print(f"round {rnd} {model} {parallel} {gpus} GPUs {side}: "
                              + (f"{r['ms']:.2f} ms" if r else "failed"), flush=True)
                        if r:
                            runs.append(r)
                            with (out / "bench_distributed.jsonl").open("a") as f:
                                f.write(json.dumps(r) + "\n")
    report(runs, out, command)


if __name__ == "__main__":
    main()
