"""Adam / AdamW benchmark per docs/testing.md ("Benchmarks"): torchfuse's multi-tensor step vs stock's fused
kernel, and (run under scripts/torchfuse) an unchanged `AdamW(params)` step vs stock's
default foreach step.

One process; torchfuse toggled at run time (torch.ops.torchfuse.set_enabled); CUDA events
around each call (host overhead included where the GPU waits for it), warm-up, medians of
interleaved rounds; fresh random state (never zeros); the parameter sets are 10-40x L2.
Roofline: copy bandwidth measured in the same run. Bytes per element: read param, grad,
exp_avg, exp_avg_sq and write param, exp_avg, exp_avg_sq (28 B in fp32, 14 B in bf16).

  --sweep   also time every candidate launch shape (forced by name through
            TORCHFUSE_REGISTRY_EXTRA + torch.ops.torchfuse._force_variant)
  --small   also time small steps (launch-bound), for the registry's min_rows

Usage: TORCHFUSE_LIB_DIR=.dev scripts/torchfuse python3 scripts/bench/bench_adam.py --out DIR
"""
import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

SETS = ["gpt2-124M f32", "gpt2-350M f32", "gpt2-124M bf16", "10k-tiny f32"]
SWEEP = [(t, u, cs) for t in (256, 512) for u in (1, 2) for cs in (0, 1)]


def gpt2_shapes(n_layer, d, vocab=50257, ctx=1024):
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(n_layer):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,),
                   (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def set_shapes(name):
    if name.startswith("gpt2-124M"):
        return gpt2_shapes(12, 768)
    if name.startswith("gpt2-350M"):
        return gpt2_shapes(24, 1024)
    rnd = random.Random(0)
    return [(rnd.randint(16, 1024),) for _ in range(10000)]


def make_state(torch, shapes, dtype):
    def rand(shape, scale, positive=False):
        t = torch.randn(shape, device="cuda") * scale
        return (t.abs() if positive else t).to(dtype)

    return {
        "params": [rand(s, 1.0) for s in shapes],
        "grads": [rand(s, 0.1) for s in shapes],
        "exp_avgs": [rand(s, 0.01) for s in shapes],
        "exp_avg_sqs": [rand(s, 1e-4, positive=True) for s in shapes],
        "steps": [torch.tensor(10.0, device="cuda") for _ in shapes],
    }


def timed(torch, fn, reps, behind_sleep=0.0):
    """µs per call of fn. behind_sleep (seconds): the call is queued behind a GPU sleep that long,
    so its host work is done before the GPU reaches it and the events time the GPU work alone
    (what a training loop, whose host runs ahead, sees); 0: the host time shows too."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        if behind_sleep:
            torch.cuda._sleep(int(behind_sleep * 2e9))
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return samples


def copy_bandwidth(torch):
    a = torch.randn(1 << 28, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    us = statistics.median(timed(torch, lambda: b.copy_(a), 20))
    del a, b
    return 2 * (1 << 28) * 4 / (us * 1e-6) / 1e12


def sides_median(torch, fns, sides, rounds=5, reps=6, behind_sleep=0.0):
    """sides: (label, key into fns, adam on, forced variant). Interleaved rounds, medians (µs)."""
    times = {label: [] for label, _, _, _ in sides}
    for label, key, on, forced in sides:
        torch.ops.torchfuse.set_enabled("adam", on)
        torch.ops.torchfuse._force_variant(forced)
        timed(torch, fns[key], 2)
    for _ in range(rounds):
        for label, key, on, forced in sides:
            torch.ops.torchfuse.set_enabled("adam", on)
            torch.ops.torchfuse._force_variant(forced)
            times[label] += timed(torch, fns[key], reps, behind_sleep)
    torch.ops.torchfuse.set_enabled("adam", True)
    torch.ops.torchfuse._force_variant("")
    return {label: statistics.median(t) for label, t in times.items()}


def step_fn(torch, state, decoupled):
    op = torch._fused_adamw_ if decoupled else torch._fused_adam_

    def fn():
        op(state["params"], state["grads"], state["exp_avgs"], state["exp_avg_sqs"], [],
           state["steps"], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
           amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
    return fn


def kernel_used(torch):
    ops = json.loads(torch.ops.torchfuse.stats())["ops"]
    kernels = {}
    for name in ("_fused_adam_", "_fused_adamw_"):
        kernels.update(ops.get(name, {}).get("kernels", {}))
    return ",".join(sorted(kernels)) or "stock"


def variant_name(dtype, threads, unroll, streaming):
    return f"sweep_adam_{'f32' if dtype == 'f32' else '16bit'}_t{threads}_u{unroll}{'_cs' if streaming else ''}"


def write_sweep_registry(path):
    lines = []
    for dtype, dtypes in (("f32", '["f32"]'), ("bf16", '["bf16", "f16"]')):
        for threads, unroll, streaming in SWEEP:
            lines += ["[[variant]]", f'name = "{variant_name(dtype, threads, unroll, streaming)}"',
                      'op = "adam_step"', 'source = "adam.cu"', f"dtypes = {dtypes}", "sm = [80, 90]",
                      f"params = {{ THREADS = {threads}, UNROLL = {unroll}, STREAMING = {streaming} }}", ""]
    Path(path).write_text("\n".join(lines))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--small", action="store_true")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.sweep:
        extra = out / "adam-sweep-registry.toml"
        write_sweep_registry(extra)
        os.environ["TORCHFUSE_REGISTRY_EXTRA"] = str(extra)  # read when torchfuse loads
    import torch

    if not hasattr(torch.ops.torchfuse, "stats"):
        sys.exit("bench_adam: torchfuse is not loaded; run it under scripts/torchfuse")
    under_launcher = hasattr(torch.optim.Adam.__init__, "__wrapped__")
    torch.manual_seed(1234)
    device = torch.cuda.get_device_name()
    bw = copy_bandwidth(torch)
    print(f"device: {device}; copy bandwidth {bw:.2f} TB/s", flush=True)
    rows, lines = [], []

    def pct(us, nbytes):
        return 100 * nbytes / (us * 1e-6) / (bw * 1e12)

    for set_name in SETS:
        dtype_name = set_name.split()[1]
        dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
        shapes = set_shapes(set_name)
        state = make_state(torch, shapes, dtype)
        elements = sum(p.numel() for p in state["params"])
        nbytes = 7 * elements * state["params"][0].element_size()
        # Adam and AdamW interleaved in the same rounds, so drift between them cannot show up
        # as a difference of the ops.
        fns = {op: step_fn(torch, state, op == "AdamW") for op in ("Adam", "AdamW")}
        sides = []
        for op in ("Adam", "AdamW"):
            sides += [(f"{op} stock", op, False, ""), (f"{op} torchfuse", op, True, "")]
            if a.sweep and op == "AdamW":
                sides += [(f"{op} {variant_name(dtype_name, *v)}", op, True, variant_name(dtype_name, *v))
                          for v in SWEEP]
        torch.ops.torchfuse.reset_stats()
        # Sleep longer than the host needs for the call (10,000 tensors take milliseconds).
        t = sides_median(torch, fns, sides, behind_sleep=0.04 if len(shapes) > 1000 else 0.003)
        kernel = kernel_used(torch)
        # The same calls with their host time showing (one call between events).
        host = sides_median(torch, fns, [side for side in sides if "sweep_" not in side[0]], rounds=3)
        for op in ("Adam", "AdamW"):
            stock, ours = t[f"{op} stock"], t[f"{op} torchfuse"]
            row = dict(set=set_name, op=op, tensors=len(shapes), elements=elements, bytes=nbytes,
                       stock_us=stock, torchfuse_us=ours, kernel=kernel, speedup=stock / ours,
                       stock_host_us=host[f"{op} stock"], torchfuse_host_us=host[f"{op} torchfuse"],
                       stock_pct=pct(stock, nbytes), torchfuse_pct=pct(ours, nbytes),
                       sweep={k.split(" ", 1)[1]: v for k, v in t.items()
                              if k.startswith(op + " sweep_")})
            rows.append(row)
            print(f"{set_name:16s} {op:5s} {len(shapes):6d} tensors {elements/1e6:8.1f}M  stock "
                  f"{stock:9.1f} us ({row['stock_pct']:3.0f}%)  torchfuse {ours:9.1f} us "
                  f"({row['torchfuse_pct']:3.0f}%)  {row['speedup']:.2f}x  {kernel}; host included: "
                  f"stock {row['stock_host_us']:.1f} us, torchfuse {row['torchfuse_host_us']:.1f} us "
                  f"({row['stock_host_us'] / row['torchfuse_host_us']:.2f}x)", flush=True)
            for k, v in row["sweep"].items():
                print(f"    {k:28s} {v:9.1f} us ({pct(v, nbytes):3.0f}%)  {stock / v:.2f}x", flush=True)
        del state
        torch.cuda.empty_cache()

    small = []
    if a.small:
        for n_tensors, numel in [(1, 1024), (1, 16384), (1, 32768), (1, 65536), (1, 131072),
                                 (1, 1 << 20), (10, 1024), (32, 1024), (64, 1024), (100, 1024),
                                 (100, 16384), (1000, 1024)]:
            state = make_state(torch, [(numel,)] * n_tensors, torch.float32)
            t = sides_median(torch, {"AdamW": step_fn(torch, state, True)},
                             [("stock", "AdamW", False, ""), ("torchfuse", "AdamW", True, "")],
                             rounds=5, reps=20)
            small.append(dict(tensors=n_tensors, numel=numel, elements=n_tensors * numel, **t))
            print(f"small {n_tensors:5d} x {numel:8d}: stock {t['stock']:7.1f} us  torchfuse "
                  f"{t['torchfuse']:7.1f} us  {t['stock'] / t['torchfuse']:.2f}x", flush=True)

    launcher = []
    if under_launcher:
        # An unchanged `AdamW(params)`: built with torchfuse's adam off, the hook leaves it on
        # PyTorch's default (foreach) path; built with it on, the hook makes it fused.
        for set_name in ("gpt2-124M f32", "gpt2-350M f32"):
            shapes = set_shapes(set_name)
            params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
            for prm in params:
                prm.grad = torch.randn_like(prm) * 0.1
            torch.ops.torchfuse.set_enabled("adam", False)
            default = torch.optim.AdamW(params, lr=1e-3)
            fused_stock = torch.optim.AdamW(params, lr=1e-3, fused=True)
            torch.ops.torchfuse.set_enabled("adam", True)
            launched = torch.optim.AdamW(params, lr=1e-3)
            assert launched.param_groups[0]["fused"] is True and default.param_groups[0]["fused"] is None
            cases = [("stock default (foreach)", default, False), ("stock fused=True", fused_stock, False),
                     ("torchfuse launcher", launched, True)]
            for label, opt, on in cases:  # warm-up; creates the state
                torch.ops.torchfuse.set_enabled("adam", on)
                timed(torch, opt.step, 2)
            # Isolated: one step between events (its host time fully exposed). Pipelined: 5 steps
            # queued behind a GPU sleep, so the host runs ahead as in a training loop (where the
            # step's host work overlaps the backward pass): the GPU time of a step.
            def pipelined(opt):
                def run():
                    for _ in range(5):
                        opt.step()
                return run

            samples = {(label, mode): [] for label, _, _ in cases for mode in ("isolated", "pipelined")}
            for _ in range(5):
                for label, opt, on in cases:
                    torch.ops.torchfuse.set_enabled("adam", on)
                    samples[(label, "isolated")] += timed(torch, opt.step, 5)
                    samples[(label, "pipelined")] += [x / 5 for x in timed(torch, pipelined(opt), 2, 0.003)]
            torch.ops.torchfuse.set_enabled("adam", True)
            elements = sum(prm.numel() for prm in params)
            nbytes = 28 * elements
            for mode in ("isolated", "pipelined"):
                t = {label: statistics.median(samples[(label, mode)]) for label, _, _ in cases}
                launcher.append(dict(set=set_name, mode=mode, elements=elements, **t))
                print(f"launcher {set_name} {mode}: AdamW(params).step(): stock default "
                      f"{t['stock default (foreach)']:.0f} us ({pct(t['stock default (foreach)'], nbytes):.0f}%), "
                      f"stock fused {t['stock fused=True']:.0f} us, torchfuse launcher "
                      f"{t['torchfuse launcher']:.0f} us ({pct(t['torchfuse launcher'], nbytes):.0f}%): "
                      f"{t['stock default (foreach)'] / t['torchfuse launcher']:.2f}x over the default", flush=True)
            del params, default, fused_stock, launched
            torch.cuda.empty_cache()
    else:
        print("not under scripts/torchfuse: the launcher comparison is skipped", flush=True)

    cmd = "TORCHFUSE_LIB_DIR=.dev scripts/torchfuse python3 scripts/bench/bench_adam.py --out $OUT" + \
        (" --sweep" if a.sweep else "") + (" --small" if a.small else "")
    lines += [f"# Adam / AdamW step, {device}, torch {torch.__version__}", "",
              f"Copy bandwidth (roofline) {bw:.2f} TB/s, measured in the same run. Command: `{cmd}`.",
              "Bytes: read param, grad, exp_avg, exp_avg_sq + write param, exp_avg, exp_avg_sq "
              "(7 x element size per parameter). lr 1e-3, weight_decay 0.01, no amsgrad.",
              "GPU µs: the op's call queued behind a GPU sleep (host work hidden, as in training); "
              "host-included µs: one call between events, the GPU idle until the launch.", "",
              "| set | op | tensors | params | stock fused GPU µs | torchfuse GPU µs | speed-up | "
              "stock % copy | torchfuse % copy | host-included µs stock / torchfuse | kernel |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['set']} | {r['op']} | {r['tensors']} | {r['elements'] / 1e6:.1f}M | "
                     f"{r['stock_us']:.1f} | {r['torchfuse_us']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['stock_pct']:.0f}% | {r['torchfuse_pct']:.0f}% | "
                     f"{r['stock_host_us']:.0f} / {r['torchfuse_host_us']:.0f} "
                     f"({r['stock_host_us'] / r['torchfuse_host_us']:.2f}x) | {r['kernel']} |")
    if launcher:
        lines += ["", "Unchanged `AdamW(params)` step, `optimizer.step()` per step. Isolated: one step "
                  "between events (host time exposed); pipelined: 5 steps queued behind a GPU sleep "
                  "(the host runs ahead, as in training, so this is the step's GPU time):", "",
                  "| set | timing | stock default (foreach) µs | stock fused=True µs | torchfuse launcher µs | "
                  "speed-up over default |", "|---|---|---:|---:|---:|---:|"]
        for r in launcher:
            lines.append(f"| {r['set']} | {r['mode']} | {r['stock default (foreach)']:.0f} | {r['stock fused=True']:.0f} | "
                         f"{r['torchfuse launcher']:.0f} | "
                         f"{r['stock default (foreach)'] / r['torchfuse launcher']:.2f}x |")
    if small:
        lines += ["", "Small steps (AdamW f32, host included: they are launch-bound):", "",
                  "| tensors x numel | stock µs | torchfuse µs | speed-up |",
                  "|---|---:|---:|---:|"]
        for r in small:
            lines.append(f"| {r['tensors']} x {r['numel']} | {r['stock']:.1f} | {r['torchfuse']:.1f} | "
                         f"{r['stock'] / r['torchfuse']:.2f}x |")
    (out / "bench_adam.md").write_text("\n".join(lines) + "\n")
    (out / "bench_adam.json").write_text(json.dumps(dict(device=device, copy_tbps=bw, command=cmd,
                                                         rows=rows, launcher=launcher, small=small),
                                                    indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
