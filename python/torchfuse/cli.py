"""The `torchfuse` command.

    torchfuse COMMAND [ARGS...]   runs an unchanged command with torchfuse (scripts/torchfuse in a
                                  checkout): `torchfuse python train.py`, `torchfuse torchrun
                                  --nproc_per_node 8 train.py` (the preload and the start-up hook
                                  pass to every child process through the environment)
    torchfuse doctor              checks this machine: each line ok, or what is wrong and how to
                                  fix it; exit status 1 when something is broken
    torchfuse stats DIR           the per-rank stats a job run with TORCHFUSE_STATS_DIR=DIR left:
                                  each rank's calls, their sum, and whether every rank made the
                                  same choices
"""
import json
import os
import sys
from pathlib import Path

USAGE = "usage:\n" + __doc__.split("\n", 2)[2].rstrip() + "\n"
PACKAGE_DIR = Path(__file__).resolve().parent
LIBRARIES = ("libtorchfuse.so", "libtorchfuse_preload.so")


def launch(command):
    """Replaces this process with `command`, torchfuse preloaded and its hook on the path."""
    from . import library_dir

    lib_dir = library_dir().resolve()
    missing = [name for name in LIBRARIES if not (lib_dir / name).is_file()]
    if missing:
        print(f"torchfuse: {', '.join(missing)} not in {lib_dir} (build with scripts/setup, or set "
              "TORCHFUSE_LIB_DIR); run `torchfuse doctor`", file=sys.stderr)
        return 2
    env = dict(os.environ)
    preload = str(lib_dir / "libtorchfuse_preload.so")
    env["LD_PRELOAD"] = preload + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    paths = [str(PACKAGE_DIR / "_startup"), str(PACKAGE_DIR.parent)]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["TORCHFUSE_LIB_DIR"] = str(lib_dir)
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        print(f"torchfuse: cannot run {command[0]}: {e}", file=sys.stderr)
        return 127


class Report:
    """Lines of `torchfuse doctor`: `ok`, `--` (information) or `FAIL` with how to fix it."""

    def __init__(self):
        self.broken = False

    def line(self, status, what, detail):
        print(f"{status:4} {what}: {detail}", flush=True)

    def ok(self, what, detail):
        self.line("ok", what, detail)

    def info(self, what, detail):
        self.line("--", what, detail)

    def fail(self, what, detail, fix):
        self.broken = True
        self.line("FAIL", what, f"{detail}. Fix: {fix}")

    def check(self, what, result, fix):
        """`result`: the library's {"ok": bool, "detail": str}."""
        if result.get("ok"):
            self.ok(what, result.get("detail", ""))
        else:
            self.fail(what, result.get("detail", "failed"), fix)


def doctor():
    report = Report()
    report.info("python", sys.version.split()[0])
    try:
        import torch
    except ImportError as e:
        report.fail("torch", f"cannot import torch ({e})", "pip install torch==2.11.*")
        return 1
    report.ok("torch", f"{torch.__version__} (CUDA {torch.version.cuda})")
    from . import library_dir

    lib_dir = library_dir()
    missing = [name for name in LIBRARIES if not (lib_dir / name).is_file()]
    if missing:
        report.fail("libraries", f"{', '.join(missing)} not in {lib_dir}",
                    "build with scripts/setup, or set TORCHFUSE_LIB_DIR")
        return 1
    report.ok("libraries", str(lib_dir))
    from . import same_release, version_mismatch

    mismatch = version_mismatch(lib_dir / "libtorchfuse.so", torch.__version__)
    if mismatch:
        report.fail("torchfuse", mismatch.removeprefix("torchfuse: "),
                    "install the torchfuse built for this torch")
        return 1
    try:
        torch.ops.load_library(str(lib_dir / "libtorchfuse.so"))
    except Exception as e:
        report.fail("load", f"torch.ops.load_library failed ({e})",
                    "a torchfuse built for this torch (scripts/setup rebuilds it)")
        return 1
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    arch = ""
    if gpus:
        major, minor = gpus[0].major, gpus[0].minor
        arch = f"sm_{major}{minor}" + ("a" if major >= 9 else "")
        for i, p in enumerate(gpus):
            report.ok(f"gpu {i}", f"{p.name}, SM {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB")
    else:
        report.info("gpu", "none visible: kernels are compiled below but not run")
    info = json.loads(torch.ops.torchfuse.doctor(arch))
    built = info["torch_built_against"]
    if same_release(built, torch.__version__):
        report.ok("torchfuse", f"{info['version']}, built against torch {built}")
    else:
        report.fail("torchfuse", f"built against torch {built}, running torch {torch.__version__}",
                    f"install torch {built.split('+')[0]} or rebuild torchfuse against this torch")
    report.check("nvrtc", info["nvrtc"], "install torch's CUDA wheels (nvidia-cuda-nvrtc) or set "
                 "LD_LIBRARY_PATH to a CUDA 13 NVRTC")
    report.check("kernel cache", info["cache"], "set TORCHFUSE_CACHE_DIR to a writable folder")
    report.check("registry", info["registry"], "reinstall torchfuse (the built-in registry is invalid)")
    enabled = sorted(name for name, on in info["enabled"].items() if on)
    off = sorted(name for name, on in info["enabled"].items() if not on)
    report.info("ops", f"enabled: {', '.join(enabled) or 'none'}; off: {', '.join(off) or 'none'}"
                f" (TORCHFUSE_OPS={os.environ.get('TORCHFUSE_OPS', 'all')!r})")
    for source, result in sorted(info["kernels"].items()):
        report.check(f"compile {source}", result, "run `TORCHFUSE_LOG=debug torchfuse doctor` and "
                     "report the NVRTC log")
    if gpus:
        from . import _doctor_gpu

        for what, result in _doctor_gpu.run_each_family(torch):
            report.check(f"run {what}", result, "switch the op off with TORCHFUSE_OPS=-<op> and report it")
    return 1 if report.broken else 0


def entry():
    """The `torchfuse` console script."""
    sys.exit(main(sys.argv[1:]))


def stats(directory):
    """Prints the stats files of one job's processes (stats-rank{R}-pid{P}.json, written at exit
    by every process that called an op) side by side. Decisions depend only on each call's
    inputs, so ranks that ran the same calls report the same counts, kernels and stock reasons;
    where they differ, the ops are named. Where several processes share a rank (workers inherit
    it), the one with the most calls is the rank's, the others are listed apart."""
    runs = [json.loads(f.read_text()) for f in sorted(Path(directory).glob("stats-*.json"))]
    if not runs:
        print(f"torchfuse: no stats files in {directory} (a job run with TORCHFUSE_STATS_DIR={directory} "
              "writes one per process that called an op)", file=sys.stderr)
        return 2

    def calls(run):
        return sum(o["fused"] + o["stock"] for o in run["ops"].values())

    def enabled(run):
        on = sorted(k for k, v in run.get("enabled", {}).items() if v)
        return "all" if on and len(on) == len(run.get("enabled", {})) else ", ".join(on) or "none"

    def order(rank):
        return (0, int(rank), "") if str(rank).isdigit() else (1, 0, str(rank))

    by_rank, others = {}, []
    for run in sorted(runs, key=calls, reverse=True):
        key = run.get("rank")
        if key is not None and key not in by_rank:
            by_rank[key] = run
        else:
            others.append(run)
    ranks = [by_rank[k] for k in sorted(by_rank, key=order)]
    shown = ranks or others  # a job without ranks: its processes
    print(f"{'rank':>4} {'pid':>8} {'fused':>9} {'stock':>9}  enabled ops")
    for r in shown:
        ops = r["ops"].values()
        print(f"{r.get('rank') or '-':>4} {r['pid']:>8} {sum(o['fused'] for o in ops):>9} "
              f"{sum(o['stock'] for o in ops):>9}  {enabled(r)}")
    if ranks and others:
        print(f"(also {len(others)} other process(es), e.g. workers inheriting a rank: pids "
              f"{', '.join(str(r['pid']) for r in others)})")
    sizes = {int(r["world_size"]) for r in ranks if str(r.get("world_size") or "").isdigit()}
    missing = sorted(set(range(max(sizes))) - {int(k) for k in by_rank if str(k).isdigit()}) if sizes else []
    if missing:
        print(f"ranks without stats: {', '.join(map(str, missing))} (they called no op, or did not exit normally)")
    names = sorted({name for r in shown for name in r["ops"]})
    print(f"\nall {len(shown)} {'ranks' if ranks else 'processes'}:\n  {'op':<46} {'fused':>9} {'stock':>9}")
    for name in names:
        fused = sum(r["ops"].get(name, {}).get("fused", 0) for r in shown)
        stock = sum(r["ops"].get(name, {}).get("stock", 0) for r in shown)
        print(f"  {name:<46} {fused:>9} {stock:>9}")
    if len(ranks) == 1 and not missing:
        print("\none rank: nothing to compare")
    if len(ranks) > 1:
        if len({enabled(r) for r in ranks}) > 1:
            print("\nranks enable different ops (TORCHFUSE / TORCHFUSE_OPS differ)")
        differing = [n for n in names if len({json.dumps(r["ops"].get(n), sort_keys=True) for r in ranks}) > 1]
        if differing:
            print(f"\nranks differ in: {', '.join(differing)} (different calls, e.g. uneven last batches, "
                  "or a rank with other settings)")
        else:
            print("\nevery rank made the same choices (same calls, kernels and stock reasons)")
    return 0


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    if argv == ["doctor"]:
        return doctor()
    if argv[0] == "stats":
        if len(argv) != 2:
            print(USAGE, file=sys.stderr)
            return 2
        return stats(argv[1])
    return launch(argv)
