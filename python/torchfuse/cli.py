"""The `torchfuse` command.

    torchfuse [--] COMMAND [ARGS...]  runs an unchanged command with torchfuse (scripts/torchfuse
                                      in a checkout): `torchfuse python train.py`, `torchfuse
                                      torchrun --nproc_per_node 8 train.py` (the preload and the
                                      start-up hook pass to every child process through the
                                      environment); `--` ends torchfuse's options, so that what
                                      follows is the command even where it is named like one of
                                      torchfuse's words (`torchfuse -- doctor` runs a program
                                      named doctor)
    torchfuse doctor                  checks this machine: each line ok, or what is wrong and how
                                      to fix it
    torchfuse stats DIR               the per-rank stats a job run with TORCHFUSE_STATS_DIR=DIR
                                      left: each rank's calls, their sum, and whether every rank
                                      made the same choices; a damaged file (a rank killed while
                                      writing it) is named on stderr and left out
    torchfuse --version, -V           torchfuse's version, and torch's
    torchfuse --help, -h              this text (`torchfuse doctor --help`: one command's)

Exit status: the command's own; 127 when it is not found, 126 when it cannot be executed; 2 for
a usage error, or when the built libraries are missing. `doctor`: 1 when something is broken,
3 when nothing is but torchfuse would serve nothing here (no GPU, every op off).
`stats`: 1 when the report leaves out a damaged file, 2 when no file is usable.
"""
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

USAGE = "usage:\n" + __doc__.split("\n", 2)[2].rstrip() + "\n"
PACKAGE_DIR = Path(__file__).resolve().parent
LIBRARIES = ("libtorchfuse.so", "libtorchfuse_preload.so")


def usage(subcommand):
    """The usage of `torchfuse SUBCOMMAND`: its row of the table above and the lines continuing it."""
    rows = re.split(r"\n(?=    torchfuse )", __doc__.split("\n\n")[1])
    return "usage:\n" + next(row for row in rows if row.startswith(f"    torchfuse {subcommand} ")) + "\n"


def usage_error(message, subcommand=None):
    """`message`, then the usage of the subcommand it is about (the whole usage is too long to
    leave the message in sight)."""
    print(f"torchfuse: {message}\n{usage(subcommand) if subcommand else 'see `torchfuse --help`'}",
          file=sys.stderr)
    return 2


def version():
    from . import __version__

    try:
        import torch
    except (ImportError, OSError):  # OSError: a torch whose CUDA libraries are missing
        return f"torchfuse {__version__} (torch does not import)"
    return f"torchfuse {__version__} (torch {torch.__version__})"


def cannot_run(program):
    """Why `program` cannot be run, and the shell's exit status for it (127 not found, 126 not
    executable), or None. Checked before exec, so that the user reads a sentence, not an errno."""
    if "/" not in program:
        return None if shutil.which(program) else ("not found on PATH", 127)
    if not os.path.exists(program):
        return "no such file", 127
    if os.path.isdir(program):
        return "it is a folder", 126
    if not os.access(program, os.X_OK):
        return "not executable (permission denied)", 126
    return None


def launch(command):
    """Replaces this process with `command`, torchfuse preloaded and its hook on the path."""
    problem = cannot_run(command[0])
    if problem:
        why, status = problem
        # A script named without its interpreter: the usual slip.
        python = shlex.join(["python", *command])
        hint = f" (did you mean 'torchfuse {python}'?)" if command[0].endswith(".py") else ""
        print(f"torchfuse: cannot run {command[0]!r}: {why}{hint}", file=sys.stderr)
        return status
    from . import how_to_build, library_dir

    lib_dir = library_dir().resolve()
    missing = [name for name in LIBRARIES if not (lib_dir / name).is_file()]
    if missing:
        print(f"torchfuse: {', '.join(missing)} not in {lib_dir} ({how_to_build()}, or set "
              "TORCHFUSE_LIB_DIR); run `torchfuse doctor`", file=sys.stderr)
        return 2
    env = dict(os.environ)
    preload = str(lib_dir / "libtorchfuse_preload.so")
    env["LD_PRELOAD"] = preload + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    # Only the start-up hook's folder goes ahead of the command's own paths: the hook finds the
    # torchfuse package itself, after them (the package's parent may be a whole site-packages).
    paths = [str(PACKAGE_DIR / "_startup")]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["TORCHFUSE_LIB_DIR"] = str(lib_dir)
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:  # found and executable, yet not a program the kernel runs
        missing_interpreter = isinstance(e, FileNotFoundError)
        why = "the interpreter its #! line names does not exist" if missing_interpreter else e.strerror
        print(f"torchfuse: cannot run {command[0]!r}: {why}", file=sys.stderr)
        return 126


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
    from . import how_to_build, library_dir

    lib_dir = library_dir()
    missing = [name for name in LIBRARIES if not (lib_dir / name).is_file()]
    if missing:
        report.fail("libraries", f"{', '.join(missing)} not in {lib_dir}",
                    f"{how_to_build()}, or set TORCHFUSE_LIB_DIR")
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
                    f"a torchfuse built for this torch: {how_to_build()}")
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
    if gpus and not enabled:
        report.info("run", "skipped: no op is registered to run (every op is off)")
    elif gpus:
        from . import _doctor_gpu

        for what, result in _doctor_gpu.run_each_family(torch):
            report.check(f"run {what}", result, "switch the op off with TORCHFUSE_OPS=-<op> and report it")
    idle = idle_because(gpus, enabled)
    if idle:
        report.info("serving", f"nothing on this machine: {idle}")
    else:
        report.ok("serving", f"{', '.join(enabled)} on {len(gpus)} GPU(s)")
    return 1 if report.broken else IDLE if idle else 0


# `torchfuse doctor`'s exit status when nothing is broken but nothing would be served.
IDLE = 3
# The GPU architectures torchfuse's kernels are built for (registry/*.toml: SM 8.0 to 9.0,
# Ampere, Ada and Hopper); PyTorch serves every call on others.
SERVED_SM = ((8, 0), (9, 0))


def idle_because(gpus, enabled):
    """Why torchfuse would serve nothing here, or None."""
    if not enabled:
        return "every op is off (TORCHFUSE / TORCHFUSE_OPS)"
    if not gpus:
        return "no CUDA GPU visible (torchfuse's overrides take CUDA tensors only)"
    low, high = SERVED_SM
    if not any(low <= (p.major, p.minor) <= high for p in gpus):
        return (f"no GPU of SM {low[0]}.{low[1]} to {high[0]}.{high[1]} (Ampere, Ada, Hopper), which "
                "torchfuse's kernels are built for")
    return None


def entry():
    """The `torchfuse` console script."""
    sys.exit(main(sys.argv[1:]))


def stats(directory):
    """Prints the stats files of one job's processes (stats-rank{R}-pid{P}.json, written at exit
    by every process that called an op) side by side. Decisions depend only on each call's
    inputs, so ranks that ran the same calls report the same counts, kernels and stock reasons;
    where they differ, the ops are named. Where several processes share a rank (workers inherit
    it), the one with the most calls is the rank's, the others are listed apart. A file that
    cannot be read is named on stderr and left out (exit status 1: the report is not whole)."""
    runs, skipped = [], 0
    for path in sorted(Path(directory).glob("stats-*.json")):
        try:
            runs.append(read_stats(path))
        except ValueError as e:
            skipped += 1
            print(f"torchfuse stats: skipped {path}: {e}", file=sys.stderr)
    if not runs and skipped:
        print(f"torchfuse: no usable stats files in {directory} ({skipped} skipped)", file=sys.stderr)
        return 2
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
    if skipped:
        print(f"torchfuse stats: this report leaves out {skipped} damaged file(s), named above",
              file=sys.stderr)
        return 1
    return 0


def read_stats(path):
    """One process's stats file; a ValueError says why it cannot be used (a rank killed while
    writing it, or a file of something else)."""
    try:
        text = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror})") from None
    if not text.strip():
        raise ValueError("empty (a rank killed before it wrote it?)")
    try:
        run = json.loads(text)
    except ValueError:
        raise ValueError("not valid JSON (truncated? a rank killed before it finished writing)") from None
    ops = run.get("ops") if isinstance(run, dict) else None
    counted = isinstance(ops, dict) and all(
        isinstance(op, dict) and isinstance(op.get("fused"), int) and isinstance(op.get("stock"), int)
        for op in ops.values())
    if not (counted and "pid" in run):
        raise ValueError("not a torchfuse stats file (no pid, or no ops with fused and stock counts)")
    return run


def main(argv):
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    word, args = argv[0], argv[1:]
    if word in ("-h", "--help"):
        print(USAGE)
        return 0
    if word in ("-V", "--version"):
        print(version())
        return 0
    if word in ("doctor", "stats"):
        if "-h" in args or "--help" in args:
            print(usage(word))
            return 0
        option = next((arg for arg in args if arg.startswith("-")), None)
        if option:
            return usage_error(f"unknown option {option!r} for `torchfuse {word}`", word)
        if word == "doctor" and args:
            return usage_error(f"`torchfuse doctor` takes no arguments, not {args[0]!r}", word)
        if word == "stats" and len(args) != 1:
            return usage_error("`torchfuse stats` takes one folder", word)
        return doctor() if word == "doctor" else stats(args[0])
    if word == "--":
        return launch(args) if args else usage_error("`--` needs a command after it")
    if word.startswith("-"):
        return usage_error(f"unknown option {word!r} (a command that starts with '-' goes after `--`)")
    return launch(argv)
