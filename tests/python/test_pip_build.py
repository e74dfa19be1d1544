"""`pip wheel .` from a clean copy of the checkout, in a fresh venv that has nothing but pip: the
standard way to build from source (also what `pip install git+...` does). pip's isolated build
installs what pyproject.toml requires (torch 2.11 among it) and builds with cargo; the wheel,
installed beside torch 2.11, runs `torchfuse doctor`.

It downloads torch and its CUDA wheels (several GB) into the isolated build: opt in with
TORCHFUSE_TEST_PIP_BUILD=1 (about 4 minutes on a 2-core machine with a fast network)."""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.skipif(os.environ.get("TORCHFUSE_TEST_PIP_BUILD") != "1",
                                reason="downloads torch's wheels: set TORCHFUSE_TEST_PIP_BUILD=1")


def venv(path):
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return path / "bin"


def test_pip_wheel_from_a_checkout_builds_a_working_wheel(tmp_path):
    source = tmp_path / "source"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(source)], check=True)
    builder = venv(tmp_path / "builder")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHFUSE", "VIRTUAL_ENV"))}
    build = subprocess.run([str(builder / "pip"), "wheel", "-q", ".", "-w", str(tmp_path / "wheels")],
                           cwd=source, env=env, capture_output=True, text=True, timeout=3600)
    assert build.returncode == 0, build.stderr[-4000:]
    wheels = list((tmp_path / "wheels").glob("torchfuse-*.whl"))
    assert len(wheels) == 1, wheels
    # Installed beside this test's torch 2.11 (seen through a .pth file, not downloaded again).
    user = venv(tmp_path / "user")
    site = subprocess.run([str(user / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "torch-2.11.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(user / "pip"), "install", "-q", "--no-deps", str(wheels[0])], check=True)
    doctor = subprocess.run([str(user / "torchfuse"), "doctor"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert doctor.returncode in (0, 3), doctor.stdout + doctor.stderr  # 3: no GPU here, nothing broken
    assert "ok   libraries: " in doctor.stdout and "FAIL" not in doctor.stdout, doctor.stdout
