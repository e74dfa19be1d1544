"""Whole training steps of unchanged models with every side in one process, step by step: what
ranks a change on a host-bound step, where one side's step moves by a third from process to
process (docs/bench/train/issue40-norm-cast.md, "Eleventh session") and bench_models.py's
one-process-per-side rounds cannot.

One worker process per model, under scripts/torchfuse (torchfuse loaded, every op on), builds
the model once (bench_models.build: configs, no downloads), then takes turns: each side runs
`--turn` steps, the sides in turn, the order reversed every round (A B C, C B A, ...), for
`--rounds` rounds after `--warmup` rounds. A side is
  stock            torchfuse.disabled(): PyTorch's kernels and the original Python code, with
                   its own AdamW built under it (PyTorch's foreach default);
  torchfuse        every op on, the AdamW torchfuse makes fused (built once, shared by the
                   torchfuse sides);
  torchfuse:SPEC   torchfuse with SPEC's toggles switched at run time (`/` for `,`, as
                   TORCHFUSE_OPS: `torchfuse:-norm_cast/-column_sum`);
  torchfuse+graphs[:SPEC]  the same with layer graphs (TORCHFUSE_LAYER_GRAPHS=1 in the worker,
                   torchfuse.layer_graphs.switch on for this side only).
Every step is timed with CUDA events (the step as the GPU's stream sees it: a host-bound step's
waits included) and on the host (the time to enqueue it). Reported per side: the median step,
and the median over rounds of its ratio to stock's step of the same round (paired: the
machine's state shared). The stock side still passes through torchfuse's dispatcher overrides
and rewrite wrappers, each answering "switched off" (about a microsecond an override call on
the host): its step is a little slower than a process without torchfuse, so its ratios are a
little optimistic; bench_models.py's separate processes are the reference for stock itself.
Losses are not compared here (the sides train one model in turn): bench_models.py does that.

  python3 scripts/bench/bench_in_process.py --lib-dir .dev/cur --out $OUT \\
      --models qwen2.5-0.5b,llama --sides stock,torchfuse,torchfuse:-norm_cast [--rounds 20]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_models import build, side_env, train_step

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def switch_to(side, torchfuse, torch):
    """Puts this process in `side`'s state (torchfuse off, on, or on with a toggle spec).
    nn.Linear's and HF Conv1D's forwards are their own code where the side has the linear
    rewrite off, as in a process started with it off (their wrappers would otherwise still run,
    to call stock's nodes)."""
    from torchfuse import layer_graphs, rewrites
    layer_graphs.switch.on = "+graphs" in side
    torchs, _ = rewrites._linear_forwards(torch)
    rewritten = next((r for r, o in rewrites._LINEAR_REWRITTEN.items() if o is torchs), torchs)
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    conv1d_own = getattr(conv1d.forward, "__wrapped__", conv1d.forward) if conv1d is not None else None
    conv1d_rewritten = next((f for f, (form, _) in rewrites._REWRITTEN.items()
                             if form == "hf_conv1d" and f.__wrapped__ is conv1d_own), None)
    linear_on = side != "stock"
    if side == "stock":
        torchfuse.disable()
    else:
        torchfuse.enable()
        torch.ops.torchfuse.set_enabled("all", True)
        spec = side.split(":", 1)[1] if ":" in side else ""
        for item in filter(None, spec.split("/")):
            on = not item.startswith("-")
            torch.ops.torchfuse.set_enabled(item.lstrip("+-"), on)
            linear_on = on if item.lstrip("+-") in ("linear", "all") else linear_on
    torch.nn.Linear.forward = rewritten if linear_on else torchs
    if conv1d_rewritten is not None:
        conv1d.forward = conv1d_rewritten if linear_on else conv1d_own


def worker(a):
    sys.path.insert(0, str(ROOT / "python"))
    import torch

    if any("+graphs" in side for side in a.sides.split(",")):
        os.environ["TORCHFUSE_LAYER_GRAPHS"] = "1"  # before transformers is imported
    import torchfuse
    if not torchfuse.enable():
        raise SystemExit("torchfuse could not be loaded")

    torch.manual_seed(0)
    model, loss_of, per_step, what = build(a.worker, torch)
    model = model.cuda().train()
    sides = a.sides.split(",")
    optimizers = {}
    for group in {"stock" if s == "stock" else "torchfuse" for s in sides}:
        switch_to(group, torchfuse, torch)
        optimizers[group] = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = {s: [] for s in sides}  # per round: [(gpu ms, host ms), ...]
    event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    for rnd in range(a.warmup + a.rounds):
        order = sides if rnd % 2 == 0 else sides[::-1]
        marks = []
        for side in order:
            switch_to(side, torchfuse, torch)
            opt = optimizers["stock" if side == "stock" else "torchfuse"]
            for _ in range(a.turn):
                start, end = event(), event()
                start.record()
                t0 = time.perf_counter()
                train_step(torch, model, loss_of, opt)
                host = (time.perf_counter() - t0) * 1e3
                end.record()
                marks.append((side, start, end, host))
        torch.cuda.synchronize()
        if rnd >= a.warmup:
            for side in sides:
                times[side].append([(s.elapsed_time(e), h) for name, s, e, h in marks if name == side])
    switch_to("torchfuse", torchfuse, torch)
    print(json.dumps({"model": a.worker, "what": what, "per_step": per_step, "turn": a.turn,
                      "times": times}))


def per_round(times, a, b):
    """Round by round, side a's median step / side b's (b faster where above 1)."""
    return [statistics.median(g for g, _ in x) / statistics.median(g for g, _ in y)
            for x, y in zip(times[a], times[b])]


def summary(run, sides):
    """Per side: the median step (GPU events, host enqueue), the median over rounds of stock's
    step / the side's step in that round, and for a `torchfuse:SPEC` or `torchfuse+graphs` side
    beside `torchfuse`, its step / torchfuse's round by round (what SPEC's toggles or the layer
    graphs are worth: above 1 where torchfuse is faster) with the rounds torchfuse was faster
    in."""
    times = run["times"]
    rows = {}
    for side in sides:
        gpu = [g for rnd in times[side] for g, _ in rnd]
        host = [h for rnd in times[side] for _, h in rnd]
        paired = statistics.median(per_round(times, "stock", side)) if "stock" in times else None
        against = None
        if side != "torchfuse" and side.startswith("torchfuse") and "torchfuse" in times:
            ratios = per_round(times, side, "torchfuse")
            against = (statistics.median(ratios), sum(r > 1 for r in ratios), len(ratios))
        rows[side] = {"ms": statistics.median(gpu), "host_ms": statistics.median(host),
                      "spread": (min(gpu), max(gpu)), "vs_stock": paired, "vs_torchfuse": against}
    return rows


def report(runs, sides, out, command):
    lines = ["# Whole training steps, every side in one process (step by step)", "",
             f"Command: `{command}`. Median step over CUDA events (and the host's time to enqueue "
             "it); vs stock: the median over rounds of stock's step / the side's in the same round; "
             "torchfuse vs the side: for a `torchfuse:SPEC` or `torchfuse+graphs` side, the median over rounds of its step / "
             "torchfuse's in the same round, and the rounds torchfuse was faster in.",
             "", "| model | side | ms/step | min-max | host ms | vs stock (paired) | torchfuse vs the side (paired) "
             "| tokens or samples/s |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for side, r in summary(run, sides).items():
            vs = f"{r['vs_stock']:.2f}x" if r["vs_stock"] else "–"
            against = r["vs_torchfuse"]
            tf = f"{against[0]:.3f}x, faster in {against[1]} of {against[2]}" if against else "–"
            lines.append(f"| {run['what']} | {side} | {r['ms']:.2f} | {r['spread'][0]:.1f}-{r['spread'][1]:.1f} | "
                         f"{r['host_ms']:.1f} | {vs} | {tf} | {run['per_step'] / r['ms'] * 1e3:,.0f} |")
    text = "\n".join(lines) + "\n"
    (out / "bench_in_process.md").write_text(text)
    print(text, flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib-dir", default=str(ROOT / ".dev"))
    p.add_argument("--out", default="bench-out")
    p.add_argument("--models", default="llama")
    p.add_argument("--sides", default="stock,torchfuse")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--turn", type=int, default=2, help="steps a side runs before the next side's turn")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sides = a.sides.split(",")
    if any(s != "stock" and not s.startswith("torchfuse") for s in sides) or len(set(sides)) != len(sides):
        raise SystemExit("sides: distinct, each `stock`, `torchfuse` or `torchfuse:SPEC`")
    env = side_env("torchfuse", a.lib_dir)  # every op on: the worker switches them
    command = "python3 scripts/bench/bench_in_process.py " + " ".join(sys.argv[1:])
    runs = []
    for model in a.models.split(","):
        cmd = [str(ROOT / "scripts" / "torchfuse"), sys.executable, __file__, "--worker", model,
               "--sides", a.sides, "--rounds", str(a.rounds), "--warmup", str(a.warmup), "--turn", str(a.turn)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        (out / f"{model}.stderr").write_text(proc.stderr)  # torchfuse's warnings; a failure's start
        if proc.returncode != 0:
            print(f"{model}: failed\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
            continue
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        runs.append(run)
        with (out / "bench_in_process.jsonl").open("a") as f:
            f.write(json.dumps(run) + "\n")
        for side, r in summary(run, sides).items():
            print(f"{model} {side}: {r['ms']:.2f} ms" + (f", {r['vs_stock']:.2f}x stock" if r["vs_stock"] else ""),
                  flush=True)
    report(runs, sides, out, command)


if __name__ == "__main__":
    main()
