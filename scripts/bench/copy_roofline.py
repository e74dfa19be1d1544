"""The copy roofline at a given size: a copy of the same bytes an op moves, timed as CUDA-graph
replays (no host gaps), rotated over more memory than L2. Two copies: an elementwise kernel on
the SMs (`torch.mul(a, 1, out=b)`, what a norm kernel competes with) and `b.copy_(a)`, which a
graph records as a memcpy node (run by a copy engine, slower). Small tensors do not reach the
bandwidth of a 1 GiB copy (ramp-up and tail of one kernel), so an op's % of that big copy
understates how close it is at its own size.

  python3 scripts/bench/copy_roofline.py [MB read ...]   (default: the issue-3/4 small shapes)
"""
import statistics
import sys

import torch


def copy_us(nbytes, sets, copy):
    n = nbytes // 4
    pairs = [(torch.randn(n, device="cuda"), torch.empty(n, device="cuda")) for _ in range(sets)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for a, b in pairs:
            copy(a, b)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a, b in pairs:
            copy(a, b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    samples = []
    for _ in range(50):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / sets)
    return statistics.median(samples)


def main():
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    # MB read (= MB written) by: LN fwd 16384x768 bf16/f32, 16384x2048 bf16, 16384x4096 bf16,
    # and the big copy the benches use as the roofline.
    sizes = [float(x) for x in sys.argv[1:]] or [25.2, 50.3, 67.1, 134.2, 1073.7]
    print(f"{torch.cuda.get_device_name()}: copies as CUDA-graph replays")
    for mb in sizes:
        nbytes = int(mb * 1e6) // 16 * 16
        sets = max(2, min(16, -(-3 * l2 // (2 * nbytes))))
        sm = copy_us(nbytes, sets, lambda a, b: torch.mul(a, 1.0, out=b))
        ce = copy_us(nbytes, sets, lambda a, b: b.copy_(a))
        print(f"  {mb:8.1f} MB read + {mb:8.1f} MB written: SM kernel {sm:8.1f} us, "
              f"{2 * nbytes / sm / 1e6:.2f} TB/s; memcpy node {ce:8.1f} us, {2 * nbytes / ce / 1e6:.2f} TB/s")


if __name__ == "__main__":
    main()
