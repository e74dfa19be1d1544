"""Where the host time of one op's calls goes: runs a case of bench_host.py in a loop for a few
seconds, to be sampled by a native profiler, then folds the profiler's collapsed stacks into
the frames that hold the most samples (inclusive), torchfuse's own and libtorch's.

  py-spy record --native -r 200 -f raw -o stacks.txt -- python3 profile_host.py --lib-dir DIR --case NAME
(native unwinding through libtorch is slow: at 4000 samples/s py-spy fell 40 s behind on the H100
machine and wrote nothing before a timeout; keep the rate low and the loop a few seconds)
  python3 profile_host.py --fold stacks.txt [--top 40]
"""
import argparse
import collections
import sys
import time
from pathlib import Path


def loop(lib_dir, case, seconds):
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_host import cases  # beside this script
    if lib_dir:
        torch.ops.load_library(str(Path(lib_dir) / "libtorchfuse.so"))
        torch.ops.torchfuse._serve_below_thresholds(True)
    fn = next(make for name, _, _, make in cases() if case in name)()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            fn()
        torch.cuda.synchronize()


def fold(path, top):
    """Inclusive samples per frame (a frame counted once per stack), and the total."""
    inclusive, total = collections.Counter(), 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        for frame in set(stack.split(";")):
            inclusive[frame] += int(count)
    print(f"{total} samples")
    for frame, n in inclusive.most_common(top):
        print(f"{100 * n / total:5.1f}%  {frame[:160]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib-dir", default="")
    p.add_argument("--case", default="layer_norm fwd+bwd")
    p.add_argument("--seconds", type=float, default=5)
    p.add_argument("--fold")
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args()
    if a.fold:
        fold(a.fold, a.top)
    else:
        loop(a.lib_dir, a.case, a.seconds)


if __name__ == "__main__":
    main()
