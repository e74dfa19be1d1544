"""The LD_PRELOAD path: registration in torch processes, silence and near-zero cost
elsewhere, and dlopen forwarding that keeps the caller's RPATH (docs/architecture.md, "Loading")."""
import re
import shutil
import subprocess
import sys

import pytest

from conftest import PRELOAD_LIB, ROOT, check, clean_env, run_python

FIXTURE = ROOT / "tests" / "fixtures" / "rpath"


def test_bin_true_under_preload_prints_nothing():
    proc = subprocess.run(["/bin/true"], env=clean_env(LD_PRELOAD=PRELOAD_LIB, TORCHFUSE_LOG="debug"),
                          capture_output=True, text=True)
    assert proc.returncode == 0
    assert proc.stdout == "" and proc.stderr == ""


def test_preload_has_no_libtorch_dependency():
    dynamic = subprocess.run(["readelf", "-d", str(PRELOAD_LIB)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"Shared library: \[(.+?)\]", dynamic)
    assert needed and not any("torch" in n or "c10" in n for n in needed), needed


def test_preload_registers_once_torch_is_loaded():
    code = """
import torch
lines = torch._C._dispatch_dump("aten::native_layer_norm").splitlines()
print("OURS", any("torchfuse" in l for l in lines if l.startswith("CUDA:")))
"""
    proc = check(run_python(code, preload=True, TORCHFUSE_LOG="info"))
    assert "OURS True" in proc.stdout
    assert proc.stderr.count("overrides registered for") == 1, proc.stderr


def dlopen_instructions():
    """The exported dlopen's instructions up to its first jmp (works on stripped libraries:
    the address comes from the dynamic symbol table)."""
    nm, objdump = shutil.which("nm"), shutil.which("objdump")
    if nm is None or objdump is None:
        pytest.skip("binutils (nm, objdump) not installed")
    symbols = subprocess.run([nm, "-D", "--defined-only", str(PRELOAD_LIB)], capture_output=True, text=True,
                             check=True).stdout
    address = int(next(l.split()[0] for l in symbols.splitlines() if l.split()[-1] == "dlopen"), 16)
    text = subprocess.run([objdump, "-d", "-M", "intel", f"--start-address={address:#x}",
                           f"--stop-address={address + 64:#x}", str(PRELOAD_LIB)],
                          capture_output=True, text=True, check=True).stdout
    instructions = []
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and parts[0].strip().rstrip(":").isalnum():
            instructions.append(parts[-1].strip())
            if instructions[-1].startswith("jmp"):
                break
    return instructions


def test_dlopen_forwarding_is_a_tail_jump():
    instructions = dlopen_instructions()
    assert instructions and instructions[-1].startswith("jmp") and "rip" in instructions[-1], instructions
    # Exactly one call (the check), no return: control reaches libc's dlopen by the jump,
    # with the caller's return address still on the stack.
    assert len([i for i in instructions if i.startswith("call")]) == 1, instructions
    assert not any(i.startswith("ret") for i in instructions), instructions
    # The arguments are restored before the jump.
    assert instructions[-3:-1] == ["pop    rsi", "pop    rdi"], instructions


@pytest.fixture(scope="module")
def rpath_fixture(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the RPATH fixture")
    out = tmp_path_factory.mktemp("rpath")
    (out / "private").mkdir()
    run = lambda *args: subprocess.run(args, check=True, capture_output=True)
    run(cc, "-shared", "-fPIC", FIXTURE / "target.c", "-o", out / "private" / "libfixture_target.so")
    for tag, dtags in (("rpath", "--disable-new-dtags"), ("runpath", "--enable-new-dtags")):
        run(cc, "-shared", "-fPIC", FIXTURE / "loader.c", "-o", out / f"libloader_{tag}.so",
            f"-Wl,-rpath,$ORIGIN/private,{dtags}", "-ldl")
    run(cc, FIXTURE / "main.c", "-o", out / "main", "-ldl")
    return out


@pytest.mark.parametrize("tag", ["rpath", "runpath"])
@pytest.mark.parametrize("preload", [False, True])
def test_bare_dlopen_resolves_against_the_callers_rpath(rpath_fixture, tag, preload):
    env = clean_env(LD_PRELOAD=PRELOAD_LIB) if preload else clean_env()
    proc = subprocess.run([str(rpath_fixture / "main"), str(rpath_fixture / f"libloader_{tag}.so")],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "via_loader=42 direct_from_main=not-found"


def test_bare_dlopen_inside_a_torch_process_after_registration(rpath_fixture):
    code = f"""
import ctypes, torch
lines = torch._C._dispatch_dump("aten::embedding").splitlines()
assert any("torchfuse" in l for l in lines if l.startswith("CUDA:")), "not registered"
print("VALUE", ctypes.CDLL({str(rpath_fixture / 'libloader_rpath.so')!r}).load_bare())
"""
    assert "VALUE 42" in check(run_python(code, preload=True)).stdout


def test_cpu_training_under_preload_is_bit_identical():
    script = ROOT / "scripts" / "train_gpt.py"
    args = [sys.executable, str(script), "--device", "cpu", "--steps", "5", "--d", "64",
            "--layers", "2", "--seq", "32", "--batch", "4"]
    runs = []
    for env in (clean_env(), clean_env(LD_PRELOAD=PRELOAD_LIB, TORCHFUSE_LOG="info")):
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        runs.append((proc.stdout, proc.stderr))
    losses = [[l for l in out.splitlines() if "loss" in l] for out, _ in runs]
    assert len(losses[0]) >= 2, runs[0][0]
    strip = lambda ls: [re.sub(r" in [0-9.]+s$", "", l) for l in ls]
    assert strip(losses[0]) == strip(losses[1])
    # The preloaded run did load torchfuse.
    assert "overrides registered for" in runs[1][1]
