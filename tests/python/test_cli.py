"""The `torchfuse` command (`python -m torchfuse`, python/torchfuse/cli.py): the launcher, its
options and errors, `torchfuse doctor` and `torchfuse stats`. CPU checks run everywhere (the
doctor compiles a kernel of every family with NVRTC); on a GPU the doctor also runs one call of
every family against PyTorch's."""
import json
import os
import subprocess
import sys

import pytest

from conftest import HAS_CUDA, LIB_DIR, ROOT, check, clean_env, requires_cuda, run_python


def torchfuse(*args, **env):
    """`python -m torchfuse ARGS` with the checkout's package; a PYTHONPATH given goes after it."""
    path = os.pathsep.join([str(ROOT / "python")] + ([str(env.pop("PYTHONPATH"))] if "PYTHONPATH" in env else []))
    env = clean_env(PYTHONPATH=path, **{"TORCHFUSE_LIB_DIR": LIB_DIR, **env})
    return subprocess.run([sys.executable, "-m", "torchfuse", *args], env=env, capture_output=True,
                          text=True, timeout=600)


def test_without_a_command_it_prints_usage():
    proc = torchfuse()
    assert proc.returncode == 2 and "usage" in proc.stderr and "torchfuse doctor" in proc.stderr


def test_it_runs_a_command_with_torchfuse_loaded_and_hooked():
    """The hooks act on modules `import torch` imports itself: the optimizer's, and nn.Linear's,
    whose patch asks the preloaded library, reachable only once torch's import is over."""
    proc = torchfuse(sys.executable, "-c", "import json, os, torch, torchfuse\n"
                     "print(json.dumps([torchfuse.loaded(), hasattr(torch.optim.Adam.__init__, '__wrapped__'),"
                     " hasattr(torch.nn.Linear.forward, '__wrapped__'),"
                     " 'libtorchfuse_preload.so' in os.environ['LD_PRELOAD']]))")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True, True, True, True]


def test_patched_modules_keep_their_loaders_answers():
    """The hooks wrap the loader of each module they patch (torch itself among them): pkgutil,
    importlib.resources and inspect get from it what the module's own loader gives."""
    code = ("import json, pkgutil, importlib.resources, inspect, torch\n"
            "import torch.nn.modules.linear as L\n"
            "print(json.dumps([pkgutil.get_data('torch', 'version.py').decode(),"
            " importlib.resources.files('torch').joinpath('version.py').read_text(),"
            " torch.__loader__.get_filename('torch'), inspect.getsource(L.Linear.__init__)]))")
    proc = torchfuse(sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stderr
    stock = check(run_python(code))
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == json.loads(stock.stdout.strip().splitlines()[-1])


def test_a_missing_command_is_an_error_not_a_traceback():
    proc = torchfuse("no-such-command-here")
    assert proc.returncode == 127, proc.stderr
    assert proc.stderr == "torchfuse: cannot run 'no-such-command-here': not found on PATH\n"


def test_help_prints_the_usage():
    for option in ("--help", "-h"):
        proc = torchfuse(option)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert proc.stdout.startswith("usage:\n    torchfuse [--] COMMAND"), proc.stdout
        for form in ("torchfuse doctor", "torchfuse stats DIR", "torchfuse --version, -V", "Exit status"):
            assert form in proc.stdout, (form, proc.stdout)


def test_version_names_torchfuse_and_torch():
    import torch
    version = check(run_python("import torchfuse; print(torchfuse.__version__)", PYTHONPATH=ROOT / "python"))
    for option in ("--version", "-V"):
        proc = torchfuse(option)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == f"torchfuse {version.stdout.strip()} (torch {torch.__version__})\n"


def test_version_without_torch(tmp_path):
    """A torch that does not import (here one that raises on import) still leaves the version."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    proc = torchfuse("--version", PYTHONPATH=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("torchfuse ") and proc.stdout.endswith(" (torch does not import)\n"), proc.stdout


@pytest.mark.parametrize("subcommand", ["doctor", "stats"])
def test_a_subcommand_help_prints_its_usage(subcommand):
    for option in ("--help", "-h"):
        proc = torchfuse(subcommand, option)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert proc.stdout.startswith(f"usage:\n    torchfuse {subcommand} "), proc.stdout
        assert "COMMAND" not in proc.stdout and "--version" not in proc.stdout, proc.stdout


# The usage of the subcommand an error is about follows it; otherwise where to find the whole usage.
DOCTOR_USAGE = "usage:\n    torchfuse doctor "
STATS_USAGE = "usage:\n    torchfuse stats DIR "
SEE_HELP = "see `torchfuse --help`"


@pytest.mark.parametrize("args, error, then", [
    (["doctor", "--bogus"], "unknown option '--bogus' for `torchfuse doctor`", DOCTOR_USAGE),
    (["doctor", "extra"], "`torchfuse doctor` takes no arguments, not 'extra'", DOCTOR_USAGE),
    (["stats", "--bogus", "dir"], "unknown option '--bogus' for `torchfuse stats`", STATS_USAGE),
    (["stats", "one", "two"], "`torchfuse stats` takes one folder", STATS_USAGE),
    (["--bogus", "python", "x.py"], "unknown option '--bogus' (a command that starts with '-' goes after `--`)",
     SEE_HELP),
    (["--"], "`--` needs a command after it", SEE_HELP),
])
def test_a_usage_error_names_the_word_and_exits_2(args, error, then):
    proc = torchfuse(*args)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.startswith(f"torchfuse: {error}\n{then}"), proc.stderr


def test_double_dash_ends_torchfuses_words(tmp_path):
    """`torchfuse -- COMMAND`: the command runs (with torchfuse preloaded), even one named like a
    torchfuse word: `torchfuse -- doctor` runs the program `doctor` on PATH."""
    script = tmp_path / "train.py"
    script.write_text("import os, sys\n"
                      "print('train', sys.argv[1:], 'libtorchfuse_preload.so' in os.environ['LD_PRELOAD'])\n")
    proc = torchfuse("--", sys.executable, str(script), "--lr", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "train ['--lr', '1'] True\n", proc.stdout
    doctor = tmp_path / "doctor"
    doctor.write_text("#!/bin/sh\necho the program named doctor \"$@\"\n")
    doctor.chmod(0o755)
    proc = torchfuse("--", "doctor", "--help", PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "the program named doctor --help\n", proc.stdout


def test_a_command_that_cannot_run_is_one_line_with_the_shells_status(tmp_path):
    """127: not found; 126: found but not executable. A script named without `python` gets the
    hint; no errno tuple or raw bytes path."""
    script = tmp_path / "train.py"
    script.write_text("print('never')\n")
    bad_interpreter = tmp_path / "bad"
    bad_interpreter.write_text("#!/no/such/interpreter\n")
    bad_interpreter.chmod(0o755)
    cases = [
        (["pyhton", "x.py"], 127, "cannot run 'pyhton': not found on PATH\n"),
        (["train.py", "--lr", "1"], 127,
         "cannot run 'train.py': not found on PATH (did you mean 'torchfuse python train.py --lr 1'?)\n"),
        ([str(tmp_path / "missing.py")], 127, f"cannot run '{tmp_path}/missing.py': no such file "
         f"(did you mean 'torchfuse python {tmp_path}/missing.py'?)\n"),
        ([str(script)], 126, f"cannot run '{script}': not executable (permission denied) "
         f"(did you mean 'torchfuse python {script}'?)\n"),
        ([str(tmp_path)], 126, f"cannot run '{tmp_path}': it is a folder\n"),
        ([str(bad_interpreter)], 126, f"cannot run '{bad_interpreter}': the interpreter its #! line names "
         "does not exist\n"),
    ]
    for args, status, message in cases:
        proc = torchfuse(*args)
        assert (proc.returncode, proc.stdout, proc.stderr) == (status, "", "torchfuse: " + message), args


def test_doctor_reports_every_check():
    """Every check passes; the last line says what would be served, and without a GPU that
    nothing would (exit 3: nothing broken, torchfuse idle)."""
    proc = torchfuse("doctor")
    assert proc.returncode == (0 if HAS_CUDA else 3), proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    if HAS_CUDA:
        assert lines[-1].startswith("ok   serving: ") and "layer_norm" in lines[-1], lines[-1]
    else:
        assert lines[-1] == ("--   serving: nothing on this machine: no CUDA GPU visible (torchfuse's "
                             "overrides take CUDA tensors only)"), lines[-1]
    for what in ("torch", "libraries", "torchfuse", "nvrtc", "kernel cache", "registry"):
        assert any(line.startswith("ok") and f" {what}: " in line for line in lines), (what, proc.stdout)
    for source in ("norm.cu", "adam.cu", "embedding.cu", "attention.cu", "gelu.cu", "cross_entropy.cu",
                   "swiglu.cu", "rotary.cu"):
        assert any(line.startswith("ok   compile " + source) for line in lines), (source, proc.stdout)
    assert not any(line.startswith("FAIL") for line in lines), proc.stdout


def test_doctor_says_when_every_op_is_off():
    proc = torchfuse("doctor", TORCHFUSE="off")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == ("--   serving: nothing on this machine: every op is off "
                                            "(TORCHFUSE / TORCHFUSE_OPS)"), proc.stdout


@pytest.mark.parametrize("broken", ["libraries", "kernel cache"])
def test_doctor_fails_with_a_fix(tmp_path, broken):
    if broken == "libraries":
        proc = torchfuse("doctor", TORCHFUSE_LIB_DIR=tmp_path)
    else:
        (tmp_path / "file").write_text("")
        proc = torchfuse("doctor", TORCHFUSE_CACHE_DIR=tmp_path / "file" / "cache")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAIL")]
    assert failed and f" {broken}: " in failed[0] and "Fix:" in failed[0], proc.stdout


@requires_cuda
def test_doctor_runs_every_family_on_the_gpu():
    proc = torchfuse("doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = [line for line in proc.stdout.splitlines() if " run " in line]
    assert len(ran) == 9 and all(line.startswith("ok") for line in ran), proc.stdout


def test_a_library_built_for_another_torch_is_refused_naming_both(tmp_path):
    """The version a library was built against is a marker in its file, read before loading it:
    `torchfuse.enable()` and `torchfuse doctor` refuse another torch release with one message
    naming both, and nothing is loaded (a library the launcher preloads checks the running torch
    itself: src/abi/lifecycle.rs)."""
    for name in ("libtorchfuse.so", "libtorchfuse_preload.so"):
        (tmp_path / name).write_bytes(b"\x7fELF...torchfuse-built-against-torch=2.99.0+cu999\0...")
    proc = subprocess.run([sys.executable, "-c", f"""
import json, torch, torchfuse
print(json.dumps([torchfuse.enable({str(tmp_path)!r}), torchfuse.loaded()]))
"""], env=clean_env(PYTHONPATH=ROOT / "python"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [False, False]
    assert "built against torch 2.99.0+cu999, this is torch 2.11" in proc.stderr, proc.stderr
    doctor = torchfuse("doctor", TORCHFUSE_LIB_DIR=tmp_path)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    failed = [line for line in doctor.stdout.splitlines() if line.startswith("FAIL")]
    assert failed and "torch 2.99.0+cu999" in failed[0] and "this is torch 2.11" in failed[0], doctor.stdout


def test_torchrun_children_get_torchfuse(tmp_path):
    """`torchfuse torchrun ...`: the preload and the start-up hook reach every rank's process:
    each has the library, the Adam hook and the rewrite layer (HF's GELU rewritten on import)."""
    pytest.importorskip("transformers", reason="scripts/setup installs transformers")
    script = tmp_path / "rank.py"
    # One write a line: the ranks share stdout (unbuffered: print's text and newline would be
    # two writes, which the other rank's could split).
    script.write_text("import json, os, sys, torch, torchfuse\n"
                      "from transformers.activations import NewGELUActivation\n"
                      "sys.stdout.write('RANK ' + json.dumps([int(os.environ['RANK']), torchfuse.loaded(),"
                      " hasattr(torch.optim.Adam.__init__, '__wrapped__'),"
                      " hasattr(NewGELUActivation.forward, '__wrapped__')]) + '\\n')\n")
    proc = torchfuse(torchrun_or_skip(), "--standalone", "--nproc_per_node", "2", str(script))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    ranks = sorted(json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("RANK "))
    assert ranks == [[0, True, True, True], [1, True, True, True]], proc.stdout


def test_accelerate_launch_children_get_torchfuse(tmp_path):
    """`torchfuse accelerate launch ...`: HF Accelerate's launcher starts its workers the way
    torchrun does (two GPUs: one process each through torchrun's machinery; otherwise one
    process), and each has the library and the Adam hook."""
    pytest.importorskip("accelerate", reason="accelerate is not installed here")
    script = tmp_path / "rank.py"
    script.write_text("import json, os, sys, torch, torchfuse\n"
                      "sys.stdout.write('RANK ' + json.dumps([int(os.environ.get('RANK', 0)), torchfuse.loaded(),"
                      " hasattr(torch.optim.Adam.__init__, '__wrapped__')]) + '\\n')\n")
    import torch
    procs = 2 if torch.cuda.device_count() >= 2 else 1
    where = ["--multi_gpu"] if procs == 2 else ["--cpu"]
    # `accelerate launch` is this module's main().
    proc = torchfuse(sys.executable, "-m", "accelerate.commands.launch", *where, "--num_processes", str(procs),
                     "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    ranks = sorted(json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("RANK "))
    assert ranks == [[rank, True, True] for rank in range(procs)], proc.stdout + proc.stderr[-3000:]


def torchrun_or_skip():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("no torchrun beside this Python")
    return torchrun


def test_each_rank_logs_to_its_own_file(tmp_path):
    """TORCHFUSE_LOG_FILE with {rank}: a file per rank, its lines tagged with that rank. With
    TORCHFUSE_STATS_DIR, processes that called no op (CPU ranks, torchrun's own) leave no
    stats, and `torchfuse stats` says there are none."""
    script = tmp_path / "rank.py"
    script.write_text("import torch\n")
    stats_dir = tmp_path / "stats"
    proc = torchfuse(torchrun_or_skip(), "--standalone", "--nproc_per_node", "2", str(script),
                     TORCHFUSE_LOG="info", TORCHFUSE_LOG_FILE=str(tmp_path / "log-{rank}.txt"),
                     TORCHFUSE_STATS_DIR=str(stats_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for rank in (0, 1):
        lines = (tmp_path / f"log-{rank}.txt").read_text().splitlines()
        tagged = [line for line in lines if f" rank={rank}]" in line]
        assert any("overrides registered for:" in line for line in tagged), lines
        assert not any(f" rank={1 - rank}]" in line for line in lines), lines
    assert not list(stats_dir.glob("stats-*.json"))
    summary = torchfuse("stats", str(stats_dir))
    assert summary.returncode == 2 and "no stats files" in summary.stderr, summary.stderr
    assert torchfuse("stats").returncode == 2


# A rank switched off by hand (TORCHFUSE=0 set before torch loads the library): a
# misconfiguration the job must survive.
SWITCH_OFF = """
import os
if os.environ["RANK"] == os.environ.get("OFF_RANK"):
    os.environ["TORCHFUSE"] = "0"
"""


def test_a_rank_switched_off_warns_and_the_stats_show_it(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(SWITCH_OFF + "import torch\n")
    stats_dir = tmp_path / "stats"
    proc = torchfuse(torchrun_or_skip(), "--standalone", "--nproc_per_node", "2", str(script),
                     OFF_RANK="1", TORCHFUSE_STATS_DIR=str(stats_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "rank=1] WARN TORCHFUSE=0 in rank 1: loaded, nothing registered" in proc.stderr, proc.stderr[-3000:]
    assert "TORCHFUSE=0 in rank 0" not in proc.stderr
    # Rank 1's (empty) stats are there to see; rank 0 called nothing on a CPU machine.
    files = [p.name.split("-pid")[0] for p in stats_dir.glob("stats-*.json")]
    assert files == ["stats-rank1"], files
    summary = torchfuse("stats", str(stats_dir))
    assert summary.returncode == 0, summary.stderr
    row = [line.split() for line in summary.stdout.splitlines() if line.split()[:1] == ["1"]]
    assert row and row[0][-1] == "none", summary.stdout
    assert "ranks without stats: 0 " in summary.stdout, summary.stdout


def stats_file(rank, pid, fused):
    """What a process of a job run with TORCHFUSE_STATS_DIR writes at exit (src/abi/lifecycle.rs)."""
    op = {"fused": fused, "stock": 0, "kernels": {}, "stock_reasons": {}}
    return json.dumps({"ops": {"native_layer_norm": op}, "enabled": {"layer_norm": True}, "rank": str(rank),
                       "world_size": "3", "pid": pid})


def test_stats_skip_a_damaged_file_naming_it(tmp_path):
    """A rank killed while writing leaves an empty or cut-short file: each is one line on stderr
    naming it and why, the report covers the rest, and the exit status (1) says it is not whole."""
    (tmp_path / "stats-rank0-pid41.json").write_text(stats_file(0, 41, fused=5))
    (tmp_path / "stats-rank1-pid42.json").write_text(stats_file(1, 42, fused=5)[:40])
    (tmp_path / "stats-rank2-pid43.json").write_text("")
    proc = torchfuse("stats", str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"torchfuse stats: skipped {tmp_path}/stats-rank1-pid42.json: not valid JSON (truncated? a rank "
        "killed before it finished writing)",
        f"torchfuse stats: skipped {tmp_path}/stats-rank2-pid43.json: empty (a rank killed before it wrote it?)",
        "torchfuse stats: this report leaves out 2 damaged file(s), named above",
    ], proc.stderr
    assert proc.stdout.splitlines()[1].split() == ["0", "41", "5", "0", "all"], proc.stdout
    assert "ranks without stats: 1, 2 " in proc.stdout, proc.stdout


def test_stats_with_no_usable_file_exit_2(tmp_path):
    (tmp_path / "stats-rank0-pid41.json").write_text(stats_file(0, 41, fused=5)[:-1])
    (tmp_path / "stats-rank1-pid42.json").write_text(json.dumps({"something": "else"}))
    proc = torchfuse("stats", str(tmp_path))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.splitlines() == [
        f"torchfuse stats: skipped {tmp_path}/stats-rank0-pid41.json: not valid JSON (truncated? a rank "
        "killed before it finished writing)",
        f"torchfuse stats: skipped {tmp_path}/stats-rank1-pid42.json: not a torchfuse stats file (no pid, "
        "or no ops with fused and stock counts)",
        f"torchfuse: no usable stats files in {tmp_path} (2 skipped)",
    ], proc.stderr


DDP_RANK = SWITCH_OFF + """
import json, os, torch, torch.distributed as dist
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
torch.manual_seed(0)
# GPT-2's shapes (vocabulary 50304, width 768, 8192 tokens a step): sizes the registry serves.
model = torch.nn.Sequential(torch.nn.Embedding(50304, 768), torch.nn.LayerNorm(768), torch.nn.Linear(768, 50304)).cuda()
model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(model.parameters())
g = torch.Generator().manual_seed(1 + dist.get_rank())
for _ in range(3):
    x = torch.randint(0, 50304, (8, 1024), generator=g).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


@requires_cuda
@pytest.mark.parametrize("off_rank", [None, "1"], ids=["all-on", "rank1-off"])
def test_ddp_ranks_make_the_same_choices(tmp_path, off_rank):
    """Two DDP ranks over NCCL, a GPU each (two ranks over gloo on one GPU hung on the H100
    machine, so one GPU skips): every decision is a function of the call's inputs, so
    both ranks serve the same calls with the same kernels; the launcher's stats say so. With
    torchfuse off in one rank the job still trains to the end (no collective waits on us)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (one NCCL rank each)")
    script = tmp_path / "ddp.py"
    script.write_text(DDP_RANK)
    stats_dir = tmp_path / "stats"
    proc = torchfuse(torchrun_or_skip(), "--standalone", "--nproc_per_node", "2", str(script),
                     TORCHFUSE_STATS_DIR=str(stats_dir), **({"OFF_RANK": off_rank} if off_rank else {}))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    ranks = [json.loads(p.read_text()) for p in sorted(stats_dir.glob("stats-rank*.json"))]
    if off_rank:
        assert "rank=1] WARN TORCHFUSE=0 in rank 1: loaded, nothing registered" in proc.stderr, proc.stderr[-3000:]
        assert len(ranks) == 2 and ranks[1]["ops"] == {} and ranks[0]["ops"], ranks
        assert "ranks enable different ops" in torchfuse("stats", str(stats_dir)).stdout
        return
    assert len(ranks) == 2 and ranks[0]["ops"] == ranks[1]["ops"], ranks
    for op in ("native_layer_norm", "cross_entropy_loss", "_fused_adamw_"):
        assert ranks[0]["ops"].get(op, {}).get("fused", 0) > 0, (op, ranks[0]["ops"])
    summary = torchfuse("stats", str(stats_dir))
    assert "every rank made the same choices" in summary.stdout, summary.stdout


def test_the_launched_python_keeps_its_own_paths_first(tmp_path):
    """An installed wheel's package sits in a whole site-packages: the launcher puts only its
    start-up hook ahead of the command's paths, and the hook adds the package's folder after
    the command's own standard library and site-packages."""
    import shutil as sh

    site = tmp_path / "site"
    sh.copytree(ROOT / "python" / "torchfuse", site / "torchfuse",
                ignore=sh.ignore_patterns("__pycache__"))
    child = ("import json, sys, sysconfig, torchfuse; print(json.dumps({'path': sys.path, "
             "'stdlib': sysconfig.get_paths()['stdlib'], 'package': torchfuse.__file__}))")
    launcher = (f"import sys; sys.path.insert(0, {str(site)!r}); from torchfuse import cli; "
                f"sys.exit(cli.main([sys.executable, '-c', {child!r}]))")
    env = clean_env(TORCHFUSE_LIB_DIR=LIB_DIR)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", launcher], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["package"] == str(site / "torchfuse" / "__init__.py"), out
    assert out["path"].index(str(site)) > out["path"].index(out["stdlib"]), out["path"]
