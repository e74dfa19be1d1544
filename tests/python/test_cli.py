"""The `torchfuse` command (`python -m torchfuse`, python/torchfuse/cli.py): the launcher and
`torchfuse doctor`. CPU checks run everywhere (the doctor compiles a kernel of every family with
NVRTC); on a GPU the doctor also runs one call of every family against PyTorch's."""
import json
import os
import subprocess
import sys

import pytest

from conftest import LIB_DIR, ROOT, clean_env, requires_cuda


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
    proc = torchfuse(sys.executable, "-c", "import json, os, torch, torchfuse\n"
                     "print(json.dumps([torchfuse.loaded(), hasattr(torch.optim.Adam.__init__, '__wrapped__'),"
                     " 'libtorchfuse_preload.so' in os.environ['LD_PRELOAD']]))")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True, True, True]


def test_a_missing_command_is_an_error_not_a_traceback():
    proc = torchfuse("no-such-command-here")
    assert proc.returncode == 127 and "cannot run no-such-command-here" in proc.stderr


def test_doctor_reports_every_check():
    proc = torchfuse("doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for what in ("torch", "libraries", "torchfuse", "nvrtc", "kernel cache", "registry"):
        assert any(line.startswith("ok") and f" {what}: " in line for line in lines), (what, proc.stdout)
    for source in ("norm.cu", "adam.cu", "embedding.cu", "attention.cu", "gelu.cu", "cross_entropy.cu",
                   "swiglu.cu", "rotary.cu"):
        assert any(line.startswith("ok   compile " + source) for line in lines), (source, proc.stdout)
    assert not any(line.startswith("FAIL") for line in lines), proc.stdout


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


DDP_RANK = SWITCH_OFF + """
import json, os, torch, torch.distributed as dist
# Two GPUs: a rank each over NCCL (what jobs use); one GPU: both ranks on it over gloo.
two_gpus = torch.cuda.device_count() >= 2
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) if two_gpus else 0)
dist.init_process_group("nccl" if two_gpus else "gloo")
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
    """Two DDP ranks (NCCL on two GPUs, gloo on one): every decision is a function of the call's inputs, so
    both ranks serve the same calls with the same kernels; the launcher's stats say so. With
    torchfuse off in one rank the job still trains to the end (no collective waits on us)."""
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
