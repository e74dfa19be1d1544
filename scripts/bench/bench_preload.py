"""Cost of LD_PRELOAD=libtorchfuse_preload.so in a process that never loads torch:
`/bin/true` run N times with and without it, interleaved; reports the median and mean
difference per process."""
import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path


def run_once(env):
    t = time.perf_counter()
    subprocess.run(["/bin/true"], env=env, check=True)
    return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--runs", type=int, default=200)
    a = p.parse_args()
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    pre = dict(base, LD_PRELOAD=str(Path(a.lib_dir).resolve() / "libtorchfuse_preload.so"))
    plain, preloaded = [], []
    for _ in range(10):
        run_once(base), run_once(pre)
    for _ in range(a.runs):
        plain.append(run_once(base))
        preloaded.append(run_once(pre))
    med = (statistics.median(preloaded) - statistics.median(plain)) * 1e3
    mean = (statistics.mean(preloaded) - statistics.mean(plain)) * 1e3
    line = (f"preload overhead on /bin/true ({a.runs} paired runs): median {med:+.3f} ms, mean {mean:+.3f} ms "
            f"per process (plain median {statistics.median(plain)*1e3:.3f} ms)")
    print(line)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "preload.txt").write_text(line + "\n")


if __name__ == "__main__":
    main()
