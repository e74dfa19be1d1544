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

__all__ = ["enable", "install_hooks", "library_dir", "loaded"]


def library_dir():
    """Where libtorchfuse.so is: TORCHFUSE_LIB_DIR, else this checkout's target/release."""
    configured = os.environ.get("TORCHFUSE_LIB_DIR")
    if configured:
        return Path(configured)
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
            torch.ops.load_library(str(library))
        except Exception as e:
            print(f"torchfuse: cannot load {library} ({e!r}); PyTorch runs unchanged",
                  file=sys.stderr)
            return False
    install_hooks()
    return True
