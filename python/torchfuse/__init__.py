"""torchfuse's Python side.

`scripts/torchfuse` puts this package on the path and its start-up hook calls
`install_hooks()`. A program that cannot be launched that way (a notebook, an application
that embeds Python) calls `torchfuse.enable()` instead, after which the process runs as under
the launcher: the library is loaded and the hooks are installed (they apply to objects built
from then on).
"""
import os
import sys
from pathlib import Path

from ._hooks import install as install_hooks

__all__ = ["__version__", "built_against", "enable", "install_hooks", "library_dir", "loaded"]

# The one place the version is written: pyproject.toml reads it from here, and a test holds
# Cargo.toml to it.
__version__ = "0.1.0"

_MARKER = b"torchfuse-built-against-torch="


def built_against(library):
    """The torch version the library file was built against (its marker), or None."""
    data = Path(library).read_bytes()
    start = data.find(_MARKER)
    if start < 0:
        return None
    start += len(_MARKER)
    return data[start:data.index(b"\0", start)].decode()


def same_release(a, b):
    """Two torch versions of one release (2.11.0+cu130 and 2.11.0)."""
    return a.split("+")[0] == b.split("+")[0]


def version_mismatch(library, torch_version):
    """One line naming both versions when the library was built for another torch release
    (read from the file, before it is loaded: `enable`, `torchfuse doctor`; a library loaded by
    the launcher checks the running torch itself)."""
    built = built_against(library)
    if built is not None and not same_release(built, torch_version):
        return (f"torchfuse: {library} was built against torch {built}, this is torch "
                f"{torch_version}; PyTorch runs unchanged (install the torchfuse built for this "
                f"torch, or torch {built.split('+')[0]})")
    return None


def library_dir():
    """Where libtorchfuse.so is: TORCHFUSE_LIB_DIR, else the installed wheel's torchfuse/_lib,
    else this checkout's target/release."""
    configured = os.environ.get("TORCHFUSE_LIB_DIR")
    if configured:
        return Path(configured)
    installed = Path(__file__).resolve().parent / "_lib"
    if (installed / "libtorchfuse.so").is_file():
        return installed
    return Path(__file__).resolve().parents[2] / "target" / "release"


def loaded():
    """Whether libtorchfuse is loaded in this process (its torch.ops.torchfuse ops exist)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        torch.ops.torchfuse.stats  # noqa: B018 (an unknown op raises)
        return True
    except (AttributeError, RuntimeError):
        return False


def enable(lib_dir=None):
    """Loads libtorchfuse.so into this process unless it is loaded already (by the launcher,
    LD_PRELOAD or an earlier call), and installs the Python hooks. Returns True when torchfuse
    is loaded; without the library it warns once and returns False, and PyTorch runs
    unchanged."""
    import torch

    if not loaded():
        path = Path(lib_dir) if lib_dir is not None else library_dir()
        library = path / "libtorchfuse.so"
        try:
            mismatch = version_mismatch(library, torch.__version__)
        except OSError:
            mismatch = None  # no file: load_library below says so
        if mismatch:
            print(mismatch, file=sys.stderr)
            return False
        try:
            torch.ops.load_library(str(library))
        except Exception as e:
            print(f"torchfuse: cannot load {library} ({e!r}); PyTorch runs unchanged",
                  file=sys.stderr)
            return False
    install_hooks()
    return True
