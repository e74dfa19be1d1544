"""Whole training steps, stock against torchfuse: scripts/train_gpt.py (nothing in it knows about
torchfuse) at GPT-2 sizes on random tokens, run as is and under scripts/torchfuse (LD_PRELOAD
and the optimizer hook), in alternating fresh processes. Each run reports the median of its
step times (CUDA events around each step, after the warm-up steps); the table gives the median
over runs, the ratio, and the model FLOP utilisation against the bf16 matmul peak measured in
this process (FLOPs per token 6 N + 12 L d S, as nanoGPT counts them).

  python3 scripts/bench/bench_train.py --lib-dir .dev --out OUT [--rounds 3] [--steps 40]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from bench_common import matmul_peak

ROOT = Path(__file__).resolve().parents[2]
# name -> train_gpt.py arguments
CONFIGS = {
    "GPT-2 small (124M), B8 S1024": dict(vocab=50304, seq=1024, d=768, layers=12, heads=12, batch=8),
    "GPT-2 medium (350M), B8 S1024": dict(vocab=50304, seq=1024, d=1024, layers=24, heads=16, batch=8),
}


def env_without_torchfuse(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFUSE") and k != "LD_PRELOAD"}
    env.update(extra)
    return env


def run(config, steps, warmup, lib_dir):
    args = [sys.executable, str(ROOT / "scripts" / "train_gpt.py"), "--data", "random",
            "--steps", str(steps), "--warmup", str(warmup)]
    for k, v in config.items():
        args += [f"--{k}", str(v)]
    if lib_dir is None:
        proc = subprocess.run(args, env=env_without_torchfuse(), capture_output=True, text=True)
    else:
        env = env_without_torchfuse(TORCHFUSE_LIB_DIR=str(lib_dir), TORCHFUSE_LOG="info")
        proc = subprocess.run([str(ROOT / "scripts" / "torchfuse")] + args, env=env,
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
    ms = float(re.search(r"step time median ([0-9.]+) ms", proc.stdout).group(1))
    params = float(re.search(r"([0-9.]+)M params", proc.stdout).group(1)) * 1e6
    loss = float(re.search(r"final loss ([0-9.]+)", proc.stdout).group(1))
    # torchfuse's exit summary: which ops it served, with which kernels.
    at = proc.stderr.find("substitution summary")
    return ms, params, loss, proc.stderr[at:].strip() if lib_dir and at >= 0 else ""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    a = p.parse_args()
    lib_dir = Path(a.lib_dir).resolve()
    peak = matmul_peak()
    device = torch.cuda.get_device_name()
    print(f"device: {device}; bf16 matmul peak {peak:.0f} TFLOP/s (8192^3, same run)", flush=True)
    rows = []
    for name, config in CONFIGS.items():
        times = {"stock": [], "torchfuse": []}
        losses = {"stock": [], "torchfuse": []}
        summary = ""
        params = 0.0
        for _ in range(a.rounds):
            for side in ("stock", "torchfuse"):
                ms, params, loss, text = run(config, a.steps, a.warmup, lib_dir if side == "torchfuse" else None)
                times[side].append(ms)
                losses[side].append(loss)
                summary = text or summary
        tokens = config["batch"] * config["seq"]
        flops = tokens * (6 * params + 12 * config["layers"] * config["d"] * config["seq"])
        med = {side: statistics.median(t) for side, t in times.items()}
        mfu = {side: flops / (ms * 1e-3) / 1e12 / peak for side, ms in med.items()}
        row = dict(name=name, config=config, ms=med, runs=times, mfu=mfu, final_loss=losses,
                   speedup=med["stock"] / med["torchfuse"], torchfuse_summary=summary)
        rows.append(row)
        print(f"{name}: stock {med['stock']:.2f} ms ({100 * mfu['stock']:.0f}% MFU), torchfuse "
              f"{med['torchfuse']:.2f} ms ({100 * mfu['torchfuse']:.0f}% MFU), x{row['speedup']:.3f}; "
              f"runs {times}; final losses {losses}\n{summary}", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_train.json").write_text(json.dumps(
        {"device": device, "matmul_peak_tflops": peak, "rows": rows}, indent=1))
    lines = [f"# Training steps on {device}", "",
             f"`scripts/train_gpt.py --data random` (bf16 autocast, AdamW, tied embeddings), {a.steps} "
             f"steps, median of the steps after {a.warmup}, median over {a.rounds} alternating runs "
             f"per side. bf16 matmul peak measured in the same run: {peak:.0f} TFLOP/s.", "",
             "| model | stock ms/step (MFU) | torchfuse ms/step (MFU) | speed-up |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['name']} | {row['ms']['stock']:.2f} ({100 * row['mfu']['stock']:.0f}%) | "
                     f"{row['ms']['torchfuse']:.2f} ({100 * row['mfu']['torchfuse']:.0f}%) | "
                     f"{row['speedup']:.3f}x |")
    (out / "bench_train.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
