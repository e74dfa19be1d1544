"""Embedding benchmark per docs/testing.md ("Benchmarks"): `embedding` (forward) and `embedding_dense_backward`
ops, stock vs torchfuse in one process (torch.ops.torchfuse.set_enabled), CUDA events,
warm-up, medians of interleaved rounds, fresh random inputs rotated over more memory than L2,
copy bandwidth measured in the same run as the roofline.
Bytes (issue 4): forward = T·D read + T·D written; backward = T·D read + V·D written (the zero
rows included).

  --small  also the small-T cases the registry's thresholds come from
  --quick  one dtype and distribution per case (a smoke run)
  --sweep  also time forward launch shapes (THREADS x UNROLL, forced by name through
           TORCHFUSE_REGISTRY_EXTRA + torch.ops.torchfuse._force_variant)
  --serve-all  torchfuse's kernels also below the registry's thresholds (to set them)
  --compare-sort  backward only: also the launch sort's variant forced (emb_bwd_sorted*) beside
           the registry's choice (on sm 90 the one-cluster sort up to 32768 tokens)
  --cases V:D:T,...  only these cases (default: issue 4's, plus --small's)
"""
import argparse
import json
import os
from pathlib import Path

import torch

from bench_common import copy_bandwidth, graph_timings, run_timings

# (V, D, T) of issue 4.
CASES = [(50304, 768, 16384), (128256, 4096, 8192), (32000, 4096, 16384), (50304, 768, 131072)]
SMALL = [(50304, 768, 256), (50304, 768, 1024), (50304, 768, 2048), (50304, 768, 3072), (50304, 768, 8192),
         (1000, 64, 4096), (32000, 4096, 512), (32000, 4096, 2048)]
DISTS = ["uniform", "zipf", "equal"]
SWEEP = [(t, u) for t in (128, 256, 512) for u in (2, 4, 8)]


def sweep_name(threads, unroll):
    return f"sweep_emb_fwd_t{threads}_u{unroll}"


def write_sweep_registry(path):
    lines = []
    for t, u in SWEEP:
        lines += ["[[variant]]", f'name = "{sweep_name(t, u)}"', 'op = "embedding_fwd"',
                  'source = "embedding.cu"', 'dtypes = ["f32", "bf16", "f16"]', "sm = [80, 90]",
                  f"params = {{ THREADS = {t}, UNROLL = {u} }}", ""]
    Path(path).write_text("\n".join(lines))


def draw(kind, num_weights, tokens, gen):
    if kind == "uniform":
        return torch.randint(0, num_weights, (tokens,), device="cuda", generator=gen)
    if kind == "zipf":
        ranks = torch.arange(1, num_weights + 1, device="cuda", dtype=torch.float64)
        probs = ranks.pow(-1.1)
        return torch.multinomial(probs / probs.sum(), tokens, replacement=True, generator=gen)
    return torch.full((tokens,), int(torch.randint(0, num_weights, (1,), generator=gen, device="cuda")),
                      device="cuda")


def kernels_used(aten, before):
    after = json.loads(torch.ops.torchfuse.stats())["ops"].get(aten, {}).get("kernels", {})
    return ",".join(k for k in after if after[k] != before.get(k, 0)) or "stock"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--small", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--serve-all", action="store_true",
                   help="serve calls below the registry's row thresholds too (to measure them)")
    p.add_argument("--graph", action="store_true",
                   help="also GPU time per call from CUDA-graph replays (stock's backward syncs: not capturable)")
    p.add_argument("--compare-sort", action="store_true")
    p.add_argument("--cases", default="")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.sweep:
        write_sweep_registry(out / "embedding_sweep.toml")
        os.environ["TORCHFUSE_REGISTRY_EXTRA"] = str(out / "embedding_sweep.toml")
    torch.ops.load_library(str(Path(a.lib_dir) / "libtorchfuse.so"))
    if a.serve_all:
        torch.ops.torchfuse._serve_below_thresholds(True)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    device = f"{props.name} sm{props.major}{props.minor}"
    print(f"device {device}, torch {torch.__version__}, copy bandwidth {bw:.2f} TB/s (measured now)", flush=True)

    rows = []
    cases = CASES + (SMALL if a.small else [])
    if a.cases:
        cases = [tuple(int(x) for x in c.split(":")) for c in a.cases.split(",")]
    for num_weights, dim, tokens in cases:
        for dtype in ((torch.bfloat16,) if a.quick else (torch.float32, torch.bfloat16)):
            size = torch.finfo(dtype).bits // 8
            weight = torch.randn(num_weights, dim, device="cuda", dtype=dtype)
            for dist in (DISTS[:1] if a.quick else DISTS):
                for op in (("bwd",) if a.compare_sort else ("fwd", "bwd")):
                    if op == "fwd":
                        per_set = 2 * tokens * dim * size
                        aten = "embedding"
                        fn = lambda idx, grad: torch.ops.aten.embedding(weight, idx)
                    else:
                        per_set = (tokens + num_weights) * dim * size
                        aten = "embedding_dense_backward"
                        fn = lambda idx, grad: torch.ops.aten.embedding_dense_backward(
                            grad, idx, num_weights, -1, False)
                    count = max(2, min(8, -(-3 * l2 // per_set)))
                    inputs = [(draw(dist, num_weights, tokens, gen),
                               torch.randn(tokens, dim, device="cuda", dtype=dtype) if op == "bwd" else None)
                              for _ in range(count)]
                    before = json.loads(torch.ops.torchfuse.stats())["ops"].get(aten, {}).get("kernels", {})
                    fn(*inputs[0])
                    kernel = kernels_used(aten, before)
                    sides = [("stock", False, ""), ("torchfuse", True, "")]
                    if a.sweep and op == "fwd":
                        sides += [(sweep_name(*c), True, sweep_name(*c)) for c in SWEEP]
                    if a.compare_sort:
                        launch_sort = "emb_bwd_sorted" if dim <= 1024 else "emb_bwd_sorted_wide"
                        sides += [("launch_sort", True, launch_sort)]
                    t = run_timings("embedding", fn, inputs, sides)
                    pct = lambda us: 100 * per_set / (us * 1e-6) / 1e12 / bw
                    row = dict(op=op, dtype=str(dtype)[6:], dist=dist, V=num_weights, D=dim, T=tokens,
                               stock_us=t["stock"], torchfuse_us=t["torchfuse"],
                               speedup=t["stock"] / t["torchfuse"], stock_pct_copy=pct(t["stock"]),
                               torchfuse_pct_copy=pct(t["torchfuse"]), kernel=kernel)
                    if a.graph:
                        # Stock's backward synchronizes with the host: never captured.
                        g = graph_timings("embedding", fn, inputs, sides[:2] if op == "fwd" else sides[1:])
                        row.update({f"{side}_graph_us": us for side, us in g.items()})
                        row.update({f"{side}_graph_pct_copy": pct(us) for side, us in g.items()})
                    if a.compare_sort:
                        row["launch_sort_us"] = t["launch_sort"]
                        print(f"    launch sort {t['launch_sort']:.1f} us"
                              + (f", graph {row['launch_sort_graph_us']:.1f} us" if a.graph else ""), flush=True)
                    elif len(sides) > 2:
                        row["candidates"] = {k: v for k, v in t.items() if k.startswith("sweep_")}
                        best = min(row["candidates"].items(), key=lambda kv: kv[1])
                        print(f"    best {best[0]} {best[1]:.1f} us", flush=True)
                    rows.append(row)
                    print(f"{op} {row['dtype']:9s} {dist:8s} V{num_weights:<7d} D{dim:<5d} T{tokens:<7d} "
                          f"stock {t['stock']:8.1f} us ({row['stock_pct_copy']:3.0f}%)  torchfuse "
                          f"{t['torchfuse']:8.1f} us ({row['torchfuse_pct_copy']:3.0f}%)  x{row['speedup']:.2f}  [{kernel}]"
                          + (f"  graph: torchfuse {row['torchfuse_graph_us']:.1f} us ({row['torchfuse_graph_pct_copy']:.0f}%)"
                             if "torchfuse_graph_us" in row else ""),
                          flush=True)
                    del inputs
            del weight
            torch.cuda.empty_cache()

    flags = " ".join(f for f, on in (("--small", a.small), ("--quick", a.quick), ("--sweep", a.sweep),
                                      ("--serve-all", a.serve_all), ("--graph", a.graph),
                                      ("--compare-sort", a.compare_sort),
                                      (f"--cases {a.cases}", bool(a.cases))) if on)
    meta = dict(device=device, torch=torch.__version__, copy_tb_s=bw,
                command=f"TORCHFUSE_BENCH=embedding scripts/bench/all .dev $OUT  (scripts/bench/bench_embedding.py {flags})")
    (out / "bench_embedding.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"Embedding ops, {device}, torch {torch.__version__}, copy bandwidth {bw:.2f} TB/s measured in "
             "the same run. Bytes: fwd = T·D read + T·D written; bwd = T·D read + V·D written.", "",
             "Per call: back-to-back calls timed with events; graph: torchfuse's calls replayed from a CUDA graph "
             "(GPU time only; stock's backward synchronizes with the host, so it cannot be captured).", "",
             "| op | dtype | indices | V | D | T | stock µs | torchfuse µs | speed-up | stock % of copy "
             "| torchfuse % of copy | graph: torchfuse µs | graph: torchfuse % of copy | kernel |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        graph = (f"{r['torchfuse_graph_us']:.1f} | {r['torchfuse_graph_pct_copy']:.0f}%"
                 if "torchfuse_graph_us" in r else "– | –")
        lines.append(f"| {r['op']} | {r['dtype']} | {r['dist']} | {r['V']} | {r['D']} | {r['T']} | {r['stock_us']:.1f} | "
                     f"{r['torchfuse_us']:.1f} | {r['speedup']:.2f}x | {r['stock_pct_copy']:.0f}% | "
                     f"{r['torchfuse_pct_copy']:.0f}% | {graph} | {r['kernel']} |")
    (out / "bench_embedding.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
