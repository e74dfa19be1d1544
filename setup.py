"""The wheel's Rust half (pyproject.toml holds the rest): libtorchfuse.so and
libtorchfuse_preload.so, built by cargo through setuptools-rust, installed into torchfuse/_lib.

build.rs compiles the C++ glue against the torch of the Python that TORCHFUSE_PYTHON names:
scripts/wheel sets it to the project's venv; otherwise it is the Python running this build,
which in pip's isolated build (`pip install .`) sees the torch pyproject.toml requires.
"""
import os
import sys

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools_rust import Binding, RustExtension, Strip, build_rust


class BuildRust(build_rust):
    """Keeps the libraries' plain names (the preload library finds libtorchfuse.so beside
    itself by that name), not Python's extension-module suffix."""

    def get_dylib_ext_path(self, ext, target_fname):
        path = super().get_dylib_ext_path(ext, target_fname)
        return os.path.join(os.path.dirname(path), target_fname.rsplit(".", 1)[-1] + ".so")


class BdistWheel(bdist_wheel):
    """One wheel for every CPython: the libraries link no libpython (they are loaded into
    torch's process, not imported as extension modules), so the tag is py3-none-<platform>.
    scripts/wheel then gives the platform its manylinux name (auditwheel)."""

    def get_tag(self):
        return ("py3", "none", super().get_tag()[2])


os.environ.setdefault("TORCHFUSE_PYTHON", sys.executable)

setup(
    rust_extensions=[
        RustExtension("torchfuse._lib.libtorchfuse", path="Cargo.toml", binding=Binding.NoBinding,
                      strip=Strip.All),
        RustExtension("torchfuse._lib.libtorchfuse_preload", path="preload/Cargo.toml",
                      binding=Binding.NoBinding, strip=Strip.All),
    ],
    cmdclass={"build_rust": BuildRust, "bdist_wheel": BdistWheel},
)
