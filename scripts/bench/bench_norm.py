"""LayerNorm / RMSNorm benchmark per docs/testing.md ("Benchmarks"), forward and backward ops.

One process; torchfuse toggled at run time (torch.ops.torchfuse.set_enabled); CUDA events,
warm-up, medians of interleaved rounds; fresh random inputs (never zeros) rotated across more
memory than L2; copy bandwidth measured in the same run is the roofline.
Bytes: forward = read x + write y; backward = read x + read dy + write dx (issue 3).

  --sweep   also time every candidate variant of kernels/norm.cu per shape (forced by name
            through TORCHFUSE_REGISTRY_EXTRA + torch.ops.torchfuse._force_variant); the results
            are what registry/norm.toml is written from. With --graph the candidates are also
            replayed from CUDA graphs ("graph_candidates" in the JSON): narrow rows are
            host-bound per call, so only the replays rank them.
  --compile also time torch.compile'd F.layer_norm / F.rms_norm (forward, and forward+backward
            minus forward is not separable there, so only forward), and Liger if importable.
"""
import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from bench_common import copy_bandwidth, graph_timings, run_timings, timed_loop

SHAPES = [(16384, 768), (16384, 1024), (16384, 2048), (16384, 4096), (8192, 8192), (4096, 16384),
          (2048, 65536)]
# Launch-bound sizes, for the registry's min_rows thresholds.
SMALL = [(512, 768), (2048, 768), (4096, 768), (8192, 768), (2048, 2048), (4096, 2048), (1024, 4096),
         (4096, 4096), (1024, 8192), (512, 16384)]
OPS = ["ln_fwd", "ln_bwd", "rms_fwd", "rms_bwd"]
TOGGLE = {"ln": "layer_norm", "rms": "rms_norm"}
REGISTRY_OP = {"ln_fwd": "layer_norm_fwd", "ln_bwd": "layer_norm_bwd", "rms_fwd": "rms_norm_fwd",
               "rms_bwd": "rms_norm_bwd"}
ATEN = {"ln_fwd": "native_layer_norm", "ln_bwd": "native_layer_norm_backward",
        "rms_fwd": "_fused_rms_norm", "rms_bwd": "_fused_rms_norm_backward"}


# Widest row one CTA holds in registers; wider rows are split across a cluster (sm 90).
CTA_MAX_COLS = 16384


def cluster_candidates(hidden, op):
    """A row split across a cluster of 2, 4 or 8 CTAs (sm 90), each holding a chunk of 4096 to
    16384 columns with 256, 512 or 1024 threads."""
    out = []
    for cluster in (2, 4, 8):
        chunk = -(-hidden // cluster)
        if not 4096 <= chunk <= CTA_MAX_COLS:
            continue
        for tpr in (256, 512, 1024):
            ept = -(-chunk // tpr // 8) * 8
            if not 8 <= ept <= 64 or tpr * ept > chunk * 3 // 2 or (tpr == 1024 and op.endswith("bwd")):
                continue
            out.append(dict(THREADS_PER_ROW=tpr, ROWS_PER_BLOCK=1, ELEMS_PER_THREAD=ept,
                            PREFETCH=int(op.endswith("fwd")), CLUSTER=cluster))
            out += smem_twin(out[-1], op)
    return out


def smem_twin(p, op):
    """For the backward: the same shape with its dgamma/dbeta accumulators in shared memory
    (SMEM_ACC) and registers capped for 1024 threads per SM (MIN_BLOCKS), when they fit."""
    if not op.endswith("bwd"):
        return []
    threads = p["THREADS_PER_ROW"] * p["ROWS_PER_BLOCK"]
    acc_bytes = (2 if op.startswith("ln") else 1) * threads * p["ELEMS_PER_THREAD"] * 4
    if acc_bytes > 160 * 1024:
        return []
    return [dict(p, SMEM_ACC=1, MIN_BLOCKS=max(1, 1024 // threads))]


def candidates(hidden, op):
    """Launch shapes worth trying for one row width: every (threads, elems) that holds the row
    without wasting more than a third, plus the tightest one."""
    if hidden > CTA_MAX_COLS:
        return cluster_candidates(hidden, op)
    fits, clusters = [], cluster_candidates(hidden, op)
    for tpr in (32, 64, 96, 128, 192, 256, 384, 512, 768, 1024):
        for ept in (8, 16, 24, 32, 48, 64):
            cap = tpr * ept
            if cap >= hidden:
                fits.append((cap, tpr, ept))
    tight = min(fits)[0]
    chosen = sorted({(tpr, ept) for cap, tpr, ept in fits if cap <= max(tight, hidden * 4 // 3)})
    out = []
    for tpr, ept in chosen:
        rpb = max(1, 128 // tpr)
        if op.endswith("bwd"):
            if rpb > 1 and rpb * tpr * ept * 4 > 48 * 1024:
                continue
            out.append(dict(THREADS_PER_ROW=tpr, ROWS_PER_BLOCK=rpb, ELEMS_PER_THREAD=ept, PREFETCH=0))
            out += smem_twin(out[-1], op)
            # CTAs of 256 or 512 threads (more rows each): fewer partial rows for the column
            # reduction to read, at the same occupancy where registers allow.
            for big in (256, 512):
                more = big // tpr
                if more > rpb and more * tpr * ept * 4 <= 48 * 1024:
                    out.append(dict(THREADS_PER_ROW=tpr, ROWS_PER_BLOCK=more, ELEMS_PER_THREAD=ept, PREFETCH=0))
        else:
            for pf in (0, 1):
                out.append(dict(THREADS_PER_ROW=tpr, ROWS_PER_BLOCK=rpb, ELEMS_PER_THREAD=ept, PREFETCH=pf))
    return out + clusters


def variant_name(op, p):
    cluster = f"_c{p['CLUSTER']}" if p.get("CLUSTER", 1) > 1 else ""
    smem = f"_s{p['MIN_BLOCKS']}" if p.get("SMEM_ACC") else ""
    return (f"sweep_{op}_t{p['THREADS_PER_ROW']}x{p['ROWS_PER_BLOCK']}_e{p['ELEMS_PER_THREAD']}"
            f"_p{p['PREFETCH']}{cluster}{smem}")


def write_sweep_registry(path, shapes):
    seen, lines = set(), []
    for op in OPS:
        for _, h in shapes:
            for p in candidates(h, op):
                name = variant_name(op, p)
                if name in seen:
                    continue
                seen.add(name)
                cap = p["THREADS_PER_ROW"] * p["ELEMS_PER_THREAD"] * p.get("CLUSTER", 1)
                sm = "[90, 90]" if p.get("CLUSTER", 1) > 1 else "[80, 90]"
                params = ", ".join(f"{k} = {v}" for k, v in p.items())
                lines += ["[[variant]]", f'name = "{name}"', f'op = "{REGISTRY_OP[op]}"', 'source = "norm.cu"',
                          'dtypes = ["f32", "bf16", "f16"]', f"sm = {sm}", f"hidden = [1, {cap}]",
                          f"params = {{ {params} }}", ""]
    Path(path).write_text("\n".join(lines))


def make_case(op, n, h, dtype):
    """A fresh random input set for one call of `op`."""
    x = torch.randn(n, h, device="cuda", dtype=dtype)
    w = torch.rand(h, device="cuda", dtype=dtype) + 0.5
    b = torch.randn(h, device="cuda", dtype=dtype)
    if op == "ln_fwd":
        return (x, w, b)
    if op == "rms_fwd":
        return (x, w)
    dy = torch.randn(n, h, device="cuda", dtype=dtype)
    with torch.no_grad():
        if op == "ln_bwd":
            torch.ops.torchfuse.set_enabled("layer_norm", False)
            _, mean, rstd = torch.ops.aten.native_layer_norm(x, [h], w, b, 1e-5)
            torch.ops.torchfuse.set_enabled("layer_norm", True)
            return (dy, x, mean, rstd, w, b)
        torch.ops.torchfuse.set_enabled("rms_norm", False)
        _, rstd = torch.ops.aten._fused_rms_norm(x, [h], w, 1e-6)
        torch.ops.torchfuse.set_enabled("rms_norm", True)
        return (dy, x, rstd, w)


def op_fn(op, h):
    if op == "ln_fwd":
        return lambda x, w, b: torch.ops.aten.native_layer_norm(x, [h], w, b, 1e-5)
    if op == "rms_fwd":
        return lambda x, w: torch.ops.aten._fused_rms_norm(x, [h], w, 1e-6)
    if op == "ln_bwd":
        return lambda dy, x, m, r, w, b: torch.ops.aten.native_layer_norm_backward(
            dy, x, [h], m, r, w, b, [True, True, True])
    return lambda dy, x, r, w: torch.ops.aten._fused_rms_norm_backward(dy, x, [h], r, w, [True, True])


def kernels_used(op, before):
    after = json.loads(torch.ops.torchfuse.stats())["ops"].get(ATEN[op], {}).get("kernels", {})
    used = [k for k in after if after[k] != before.get(k, 0)]
    return ",".join(used) or "stock", after


def compiled_forward_us(op, h, inputs):
    import torch.nn.functional as F
    if op == "ln_fwd":
        f = torch.compile(lambda x, w, b: F.layer_norm(x, [h], w, b, 1e-5), dynamic=False)
    else:
        f = torch.compile(lambda x, w: F.rms_norm(x, [h], w, 1e-6), dynamic=False)
    for args in inputs[:2]:
        f(*args)
    return statistics.median(timed_loop(f, inputs, 20))


def liger_forward_us(op, h, dtype, inputs):
    try:
        if op == "ln_fwd":
            from liger_kernel.transformers.functional import liger_layer_norm as fn
            return statistics.median(timed_loop(lambda x, w, b: fn(x, w, b, 1e-5), inputs, 20))
        from liger_kernel.transformers.functional import liger_rms_norm as fn
        return statistics.median(timed_loop(lambda x, w: fn(x, w, 1e-6), inputs, 20))
    except Exception:  # not installed on the GPU machine, or its API differs
        return None


def warm_one(job):
    """One candidate's kernels compiled into the disk cache by a call on a few hundred rows,
    and its outputs' largest difference from stock's, relative to stock's largest value."""
    lib_dir, op, h, dtype, name = job
    torch.ops.load_library(str(Path(lib_dir) / "libtorchfuse.so"))
    torch.manual_seed(h)
    args = make_case(op, 300, h, getattr(torch, dtype))
    fn = op_fn(op, h)
    toggle = TOGGLE[op.split("_")[0]]
    torch.ops.torchfuse.set_enabled(toggle, False)
    stock = fn(*args)
    torch.ops.torchfuse.set_enabled(toggle, True)
    torch.ops.torchfuse._force_variant(name)
    before = json.loads(torch.ops.torchfuse.stats())["ops"].get(ATEN[op], {}).get("kernels", {})
    ours = fn(*args)
    if kernels_used(op, before)[0] != name:
        return name, dtype, float("inf")
    err = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
              for a, b in zip(ours, stock) if a is not None and a.numel())
    return name, dtype, err


def warm_cache(lib_dir, ops, shapes, jobs):
    import multiprocessing
    work = [(lib_dir, op, h, dtype, variant_name(op, c)) for op in ops for _, h in shapes
            for dtype in ("float32", "bfloat16") for c in candidates(h, op)]
    work = list({(w[1], w[3], w[4]): w for w in work}.values())
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        checked = pool.map(warm_one, work, chunksize=1)
    print(f"compiled {len(work)} candidate kernels in {jobs} processes", flush=True)
    for name, dtype, err in checked:
        limit = 1e-5 if dtype == "float32" else 2e-2
        if not err <= limit:
            print(f"  {name} {dtype}: relative difference from stock {err:.2e} (limit {limit:.0e})", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--small", action="store_true", help="also the launch-bound shapes")
    p.add_argument("--graph", action="store_true",
                   help="also GPU time per call from CUDA-graph replays (no host gaps)")
    p.add_argument("--shapes", help="rows x hidden list, e.g. 2048x65536,4096x32768 (default: the issue's)")
    p.add_argument("--warm-jobs", type=int, default=0,
                   help="with --sweep: compile the candidates first in this many processes at once "
                        "(they share TORCHFUSE_CACHE_DIR), instead of one after another")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    else:
        shapes = SHAPES + (SMALL if a.small else [])
    if a.sweep:
        extra = out / "norm_sweep.toml"
        write_sweep_registry(extra, shapes)
        os.environ["TORCHFUSE_REGISTRY_EXTRA"] = str(extra)
        if a.warm_jobs:
            warm_cache(a.lib_dir, a.ops.split(","), shapes, a.warm_jobs)
    torch.ops.load_library(str(Path(a.lib_dir) / "libtorchfuse.so"))
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    device = f"{props.name} sm{props.major}{props.minor}"
    print(f"device {device}, torch {torch.__version__}, copy bandwidth {bw:.2f} TB/s (measured now)", flush=True)

    rows = []
    for op in a.ops.split(","):
        toggle = TOGGLE[op.split("_")[0]]
        for dtype in (torch.float32, torch.bfloat16):
            size = torch.finfo(dtype).bits // 8
            for n, h in shapes:
                per_set = (2 if op.endswith("fwd") else 3) * n * h * size
                count = max(2, min(16, -(-3 * l2 // per_set)))
                try:
                    inputs = [make_case(op, n, h, dtype) for _ in range(count)]
                except torch.OutOfMemoryError:
                    print(f"{op} {dtype} {n}x{h}: out of memory, skipped", flush=True)
                    continue
                fn = op_fn(op, h)
                sides = [("stock", False, ""), ("torchfuse", True, "")]
                if a.sweep:
                    sides += [(variant_name(op, c), True, variant_name(op, c)) for c in candidates(h, op)]
                before = json.loads(torch.ops.torchfuse.stats())["ops"].get(ATEN[op], {}).get("kernels", {})
                torch.ops.torchfuse.set_enabled(toggle, True)
                fn(*inputs[0])
                kernel, _ = kernels_used(op, before)
                t = run_timings(toggle, fn, inputs, sides)
                pct = lambda us: 100 * per_set / (us * 1e-6) / 1e12 / bw
                row = dict(op=op, dtype=str(dtype)[6:], shape=f"{n}x{h}", stock_us=t["stock"],
                           torchfuse_us=t["torchfuse"], speedup=t["stock"] / t["torchfuse"],
                           stock_pct_copy=pct(t["stock"]), torchfuse_pct_copy=pct(t["torchfuse"]), kernel=kernel)
                if a.sweep:
                    row["candidates"] = {k: v for k, v in t.items() if k.startswith("sweep_")}
                if a.graph:
                    # With --sweep the candidates are replayed too (narrow rows are host-bound per call).
                    g = graph_timings(toggle, fn, inputs, sides)
                    if a.sweep:
                        row["graph_candidates"] = {k: v for k, v in g.items() if k.startswith("sweep_")}
                    if "stock" in g and "torchfuse" in g:
                        row.update(stock_graph_us=g["stock"], torchfuse_graph_us=g["torchfuse"],
                                   graph_speedup=g["stock"] / g["torchfuse"],
                                   stock_graph_pct_copy=pct(g["stock"]),
                                   torchfuse_graph_pct_copy=pct(g["torchfuse"]))
                if a.compile and op.endswith("fwd"):
                    torch.ops.torchfuse.set_enabled(toggle, False)
                    row["compile_us"] = compiled_forward_us(op, h, inputs)
                    row["liger_us"] = liger_forward_us(op, h, dtype, inputs)
                    torch.ops.torchfuse.set_enabled(toggle, True)
                rows.append(row)
                extra = ""
                if a.sweep:
                    best = min(row["candidates"].items(), key=lambda kv: kv[1])
                    extra = f"  best {best[0]} {best[1]:.1f} us (x{t['stock'] / best[1]:.2f})"
                if row.get("compile_us"):
                    extra += f"  compile {row['compile_us']:.1f} us"
                if row.get("torchfuse_graph_us"):
                    extra += (f"  graph: stock {row['stock_graph_us']:.1f} us ({row['stock_graph_pct_copy']:.0f}%)"
                              f" torchfuse {row['torchfuse_graph_us']:.1f} us ({row['torchfuse_graph_pct_copy']:.0f}%)"
                              f" x{row['graph_speedup']:.2f}")
                print(f"{op:7s} {row['dtype']:9s} {row['shape']:>11s}  stock {t['stock']:8.1f} us ({row['stock_pct_copy']:3.0f}%)"
                      f"  torchfuse {t['torchfuse']:8.1f} us ({row['torchfuse_pct_copy']:3.0f}%)  x{row['speedup']:.2f}"
                      f"  [{kernel}]{extra}", flush=True)
                del inputs
                torch.cuda.empty_cache()

    meta = dict(device=device, torch=torch.__version__, copy_tb_s=bw,
                command="scripts/bench/all .dev $OUT  (scripts/bench/bench_norm.py " + " ".join(
                    f for f, on in (("--sweep", a.sweep), ("--compile", a.compile), ("--small", a.small),
                                    ("--graph", a.graph)) if on) + ")")
    (out / "bench_norm.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"LayerNorm / RMSNorm ops, {device}, torch {torch.__version__}, copy bandwidth {bw:.2f} TB/s "
             "measured in the same run. Bytes: fwd = read x + write y; bwd = read x + read dy + write dx.", "",
             "Per call: back-to-back calls timed with events (the host's time to issue a call counts where it "
             "exceeds the GPU's); graph: the same calls replayed from a CUDA graph (GPU time only).", "",
             "| op | dtype | rows x hidden | stock µs | torchfuse µs | speed-up | stock % of copy | torchfuse % of copy "
             "| graph: stock µs | graph: torchfuse µs | graph: speed-up | graph: torchfuse % of copy "
             "| torch.compile µs | kernel |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        comp = f"{r['compile_us']:.1f}" if r.get("compile_us") else "–"
        graph = (f"{r['stock_graph_us']:.1f} | {r['torchfuse_graph_us']:.1f} | {r['graph_speedup']:.2f}x | "
                 f"{r['torchfuse_graph_pct_copy']:.0f}%") if r.get("torchfuse_graph_us") else "– | – | – | –"
        lines.append(f"| {r['op']} | {r['dtype']} | {r['shape']} | {r['stock_us']:.1f} | {r['torchfuse_us']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['stock_pct_copy']:.0f}% | {r['torchfuse_pct_copy']:.0f}% | {graph} | "
                     f"{comp} | {r['kernel']} |")
    (out / "bench_norm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
