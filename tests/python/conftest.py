"""Shared helpers: where the built libraries are, and running Python in a fresh process
(registration happens at load time, so most checks need their own process)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
LIB_DIR = Path(os.environ.get("TORCHFUSE_LIB_DIR", ROOT / "target" / "release")).resolve()
MAIN_LIB = LIB_DIR / "libtorchfuse.so"
PRELOAD_LIB = LIB_DIR / "libtorchfuse_preload.so"

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="GPU test: no CUDA device on this machine")


def clean_env(**overrides):
    """The current environment without torchfuse settings, plus `overrides`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFUSE") and k != "LD_PRELOAD"}
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def run_python(code, preload=False, load_library=False, timeout=600, **env):
    """Runs `code` in a new interpreter; returns CompletedProcess (text)."""
    env = clean_env(**env)
    prefix = ""
    if preload:
        env["LD_PRELOAD"] = str(PRELOAD_LIB)
    if load_library:
        prefix = f"import torch; torch.ops.load_library({str(MAIN_LIB)!r})\n"
    return subprocess.run([sys.executable, "-c", prefix + code], env=env, capture_output=True,
                          text=True, timeout=timeout)


def check(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


@pytest.fixture(scope="session", autouse=True)
def libraries_exist():
    for lib in (MAIN_LIB, PRELOAD_LIB):
        assert lib.exists(), f"{lib} missing: build with scripts/setup or pass TORCHFUSE_LIB_DIR"
