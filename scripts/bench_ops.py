"""Op benchmarks per DESIGN.md §6: one process, torchfuse toggled at run time
(torch.ops.torchfuse.set_enabled), CUDA events, warm-up, medians of interleaved rounds,
fresh random inputs rotated across more memory than L2, copy bandwidth measured in the
same run as the roofline. Writes bench.md and bench.json."""
import argparse
import json
import statistics
from pathlib import Path

import torch


def timed_loop(fn, inputs, reps):
    """Median µs per call over `reps` timed loops, each cycling through all `inputs`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        for args in inputs:
            fn(*args)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(inputs))
    return samples


def copy_bandwidth():
    a = torch.randn(1 << 28, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    us = statistics.median(timed_loop(lambda: b.copy_(a), [()], 20))
    del a, b
    return 2 * (1 << 28) * 4 / (us * 1e-6) / 1e12


def input_sets(make, bytes_per_set, l2_bytes):
    count = max(2, min(32, -(-4 * l2_bytes // max(bytes_per_set, 1))))
    return [make() for _ in range(count)]


def ab(toggle, fn, inputs, rounds=5, reps=10):
    """Interleaved rounds of stock and torchfuse; medians of all samples."""
    times = {True: [], False: []}
    for on in (True, False):  # warm-up, includes kernel compile
        torch.ops.torchfuse.set_enabled(toggle, on)
        timed_loop(fn, inputs, 2)
    for _ in range(rounds):
        for on in (False, True):
            torch.ops.torchfuse.set_enabled(toggle, on)
            times[on] += timed_loop(fn, inputs, reps)
    torch.ops.torchfuse.set_enabled(toggle, True)
    return statistics.median(times[False]), statistics.median(times[True])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib-dir", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.ops.load_library(str(Path(a.lib_dir) / "libtorchfuse.so"))
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    device = f"{props.name} sm{props.major}{props.minor}"
    print(f"device {device}, torch {torch.__version__}, copy bandwidth {bw:.2f} TB/s (measured now)")

    rows = []
    shapes = [(16384, 768), (16384, 1024), (16384, 2048), (16384, 4096), (8192, 8192), (4096, 16384),
              (8192, 768), (2048, 768), (512, 768), (64, 768), (4096, 32768 - 8)]
    for dtype in (torch.float32, torch.bfloat16):
        for n, h in shapes:
            size = torch.finfo(dtype).bits // 8
            nbytes = 2 * n * h * size
            def make():
                x = torch.randn(n, h, device="cuda", dtype=dtype)
                w = torch.randn(h, device="cuda", dtype=dtype)
                b = torch.randn(h, device="cuda", dtype=dtype)
                return (x, w, b)
            inputs = input_sets(make, n * h * size, l2)
            fn = lambda x, w, b: torch.ops.aten.native_layer_norm(x, [h], w, b, 1e-5)
            before = json.loads(torch.ops.torchfuse.stats())["ops"].get("native_layer_norm", {}).get("kernels", {})
            stock_us, ours_us = ab("layer_norm", fn, inputs)
            after = json.loads(torch.ops.torchfuse.stats())["ops"]["native_layer_norm"].get("kernels", {})
            kernel = ",".join(k for k in after if after[k] != before.get(k, 0)) or "stock"
            row = dict(op="ln_fwd", dtype=str(dtype)[6:], shape=f"{n}x{h}", stock_us=stock_us, torchfuse_us=ours_us,
                       speedup=stock_us / ours_us, stock_pct_copy=100 * nbytes / (stock_us * 1e-6) / 1e12 / bw,
                       torchfuse_pct_copy=100 * nbytes / (ours_us * 1e-6) / 1e12 / bw, kernel=kernel)
            rows.append(row)
            print(f"{row['op']:7s} {row['dtype']:9s} {row['shape']:>12s}  stock {stock_us:8.1f} us "
                  f"({row['stock_pct_copy']:3.0f}% copy)  torchfuse {ours_us:8.1f} us ({row['torchfuse_pct_copy']:3.0f}% copy)"
                  f"  x{row['speedup']:.2f}  [{kernel}]", flush=True)
            del inputs

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=device, torch=torch.__version__, copy_tb_s=bw,
                command="scripts/bench .dev $OUT (scripts/bench_ops.py)")
    (out / "bench.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"LayerNorm forward (`native_layer_norm`), {device}, torch {torch.__version__}, "
             f"copy bandwidth {bw:.2f} TB/s measured in the same run. Bytes = read x + write y.", "",
             "| dtype | rows x hidden | stock µs | torchfuse µs | speed-up | stock % of copy | torchfuse % of copy | kernel |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['shape']} | {r['stock_us']:.1f} | {r['torchfuse_us']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['stock_pct_copy']:.0f}% | {r['torchfuse_pct_copy']:.0f}% | {r['kernel']} |")
    (out / "bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
