"""What every benchmark here shares (docs/testing.md, "Benchmarks"): CUDA-event timing of calls over
rotated input sets, interleaved A/B rounds with torchfuse toggled at run time, the same calls
as CUDA-graph replays, the two rooflines (copy bandwidth, bf16 matmul peak) measured in the
running process, the correctness contract's error measure, and benchmark-only registry
variants."""
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch


def timed_loop(fn, inputs, reps):
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


def rel_err(out, ref):
    """The contract's measure (docs/testing.md), as tests/python/gpu_util.py has it:
    ||out - ref|| / ||ref|| in float64 (the absolute difference where ref is zero)."""
    out, ref = out.double(), ref.double()
    denom = ref.norm().item()
    return (out - ref).norm().item() / denom if denom > 0 else (out - ref).norm().item()


def copy_bandwidth():
    a = torch.randn(1 << 28, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    us = statistics.median(timed_loop(lambda: b.copy_(a), [()], 20))
    del a, b
    return 2 * (1 << 28) * 4 / (us * 1e-6) / 1e12


def run_timings(toggle, fn, inputs, sides, rounds=5, reps=8):
    """sides: list of (label, on, forced variant or ""). Interleaved rounds, medians."""
    times = {label: [] for label, _, _ in sides}
    for label, on, forced in sides:  # warm-up, includes kernel compile
        torch.ops.torchfuse.set_enabled(toggle, on)
        torch.ops.torchfuse._force_variant(forced)
        timed_loop(fn, inputs, 2)
    for _ in range(rounds):
        for label, on, forced in sides:
            torch.ops.torchfuse.set_enabled(toggle, on)
            torch.ops.torchfuse._force_variant(forced)
            times[label] += timed_loop(fn, inputs, reps)
    torch.ops.torchfuse.set_enabled(toggle, True)
    torch.ops.torchfuse._force_variant("")
    return {label: statistics.median(t) for label, t in times.items()}


def capture_graph(fn, inputs, capture_error_mode="global"):
    """fn's calls over all input sets, run once on a side stream (warm-up), then captured in a
    CUDA graph. Raises RuntimeError where a call cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in inputs:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        for args in inputs:
            fn(*args)
    return graph


def replay_times(graphs, calls, rounds, reps):
    """{label: per-call µs samples} of each graph (`calls` calls each): replays timed with
    events, interleaved rounds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {label: [] for label in graphs}
    for graph in graphs.values():
        graph.replay()
    for _ in range(rounds):
        for label, graph in graphs.items():
            for _ in range(reps):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times[label].append(start.elapsed_time(end) * 1e3 / calls)
    return times


def graph_timings(toggle, fn, inputs, sides, rounds=5, reps=10):
    """GPU time per call without the host in the way (docs/testing.md: many small launches): each
    side's calls over all input sets captured once in a CUDA graph, replays timed with events,
    interleaved rounds, medians. Sides whose calls cannot be captured are left out."""
    graphs = {}
    for label, on, forced in sides:
        torch.ops.torchfuse.set_enabled(toggle, on)
        torch.ops.torchfuse._force_variant(forced)
        try:
            graphs[label] = capture_graph(fn, inputs)
        except RuntimeError as e:
            print(f"  {label}: no graph ({str(e).splitlines()[0]})", flush=True)
    torch.ops.torchfuse.set_enabled(toggle, True)
    torch.ops.torchfuse._force_variant("")
    times = replay_times(graphs, len(inputs), rounds, reps)
    del graphs
    return {label: statistics.median(t) for label, t in times.items()}


def matmul_peak():
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    us = statistics.median(timed_loop(lambda: a @ b, [()], 20))
    return 2 * n ** 3 / (us * 1e-6) / 1e12


def sweep_variants(op, source, dtypes, variants):
    """Benchmark-only variants of registry op `op` (name -> {PARAM: value}), to force by name
    (torch.ops.torchfuse._force_variant): written to a registry file that TORCHFUSE_REGISTRY_EXTRA
    names, read when torchfuse loads (call this before kernel_bench_setup)."""
    lines = []
    for name, params in variants.items():
        values = ", ".join(f"{key} = {value}" for key, value in params.items())
        lines += ["[[variant]]", f'name = "{name}"', f'op = "{op}"', f'source = "{source}"',
                  f"dtypes = {json.dumps(dtypes)}", "sm = [80, 90]", f"params = {{ {values} }}", ""]
    path = Path(tempfile.mkdtemp()) / f"{op}_sweep.toml"
    path.write_text("\n".join(lines))
    os.environ["TORCHFUSE_REGISTRY_EXTRA"] = str(path)


def kernel_bench_setup():
    """The command line every per-op kernel bench takes (--lib-dir, --out), torchfuse loaded with
    the kernels serving every shape (the tables the registry's thresholds are read from), and the
    copy bandwidth measured now: (args, TB/s)."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser()
    parser.add_argument("--lib-dir", required=True)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.ops.load_library(str(Path(args.lib_dir) / "libtorchfuse.so"))
    torch.ops.torchfuse._serve_below_thresholds(True)
    return args, copy_bandwidth()


def write_report(rows, out_dir, name):
    """Prints the table's lines and writes them to OUT_DIR/name when --out was given."""
    text = "\n".join(rows) + "\n"
    print(text)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / name).write_text(text)
