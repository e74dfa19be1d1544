"""torchfuse's Python side.

`scripts/torchfuse` puts this package on the path and its start-up hook calls
`install_hooks()`. A program that cannot be launched that way (a notebook, an application
that embeds Python) calls `torchfuse.enable()` instead, after which the process runs as under
the launcher: the library is loaded and the hooks are installed (they apply to objects built
from then on).
"""
import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from ._hooks import install as install_hooks
from ._library import enabled_toggles, rewrite_switch

__all__ = ["__version__", "built_against", "disable", "disabled", "enable", "install_hooks",
           "library_dir", "loaded"]

# The one place the version is written: pyproject.toml reads it from here, and a test holds
# Cargo.toml to it.
__version__ = "0.1.0"

_MARKER = b"torchfuse-built-against-torch="


def built_against(library: str | os.PathLike) -> str | None:
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


def library_dir() -> Path:
    """Where libtorchfuse.so is: TORCHFUSE_LIB_DIR, else the installed wheel's torchfuse/_lib,
    else this checkout's target/release."""
    configured = os.environ.get("TORCHFUSE_LIB_DIR")
    if configured:
        return Path(configured)
    installed = Path(__file__).resolve().parent / "_lib"
    if (installed / "libtorchfuse.so").is_file():
        return installed
    return Path(__file__).resolve().parents[2] / "target" / "release"


def how_to_build() -> str:
    """What makes the libraries, where this package lives: scripts/setup in a checkout, a
    reinstall of the wheel otherwise."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "scripts" / "setup").is_file():
        return f"build them with {checkout / 'scripts' / 'setup'}"
    return "reinstall the torchfuse wheel built for this torch"


def loaded() -> bool:
    """Whether libtorchfuse is loaded in this process (its torch.ops.torchfuse ops exist)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        torch.ops.torchfuse.stats  # noqa: B018 (an unknown op raises)
        return True
    except (AttributeError, RuntimeError):
        return False


_warned = set()


def _warn(message):
    """A RuntimeWarning to the user, once a process for each message, however often enable()
    is called."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _loaded_library():
    """The path of the libtorchfuse.so this process has mapped, or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(" ", 5)[-1].strip()
                if path.endswith("/libtorchfuse.so"):
                    return Path(path)
    except OSError:
        pass
    return None


def enable(lib_dir: str | os.PathLike | None = None) -> bool:
    """Loads libtorchfuse.so into this process unless it is loaded already (by the launcher,
    LD_PRELOAD or an earlier call), installs the Python hooks, and switches torchfuse on again
    after a `disable()`. Returns True when torchfuse is loaded. Where it cannot be (no library
    in `lib_dir`, one built for another torch, a load error) it warns (RuntimeWarning) and
    returns False, and PyTorch runs unchanged. Once a library is loaded, a `lib_dir` holding
    another (or none) is not loaded: a warning says which library keeps serving."""
    import torch

    path = Path(lib_dir) if lib_dir is not None else library_dir()
    library = path / "libtorchfuse.so"
    if not loaded():
        if not library.is_file():
            _warn(f"torchfuse: no libtorchfuse.so in {path} ({how_to_build()}, or point "
                  "TORCHFUSE_LIB_DIR or lib_dir at them); PyTorch runs unchanged")
            return False
        try:
            mismatch = version_mismatch(library, torch.__version__)
        except OSError:
            mismatch = None  # unreadable: load_library below says why
        if mismatch:
            _warn(mismatch)
            return False
        try:
            torch.ops.load_library(str(library))
        except Exception as e:
            _warn(f"torchfuse: cannot load {library} ({e}); PyTorch runs unchanged")
            return False
    elif lib_dir is not None:
        serving = _loaded_library()
        if serving is None or not library.is_file() or serving.resolve() != library.resolve():
            _warn(f"torchfuse: {serving or 'libtorchfuse.so'} is loaded already and keeps serving; "
                  f"{library} is not loaded (one library a process)")
    install_hooks()
    if not rewrite_switch.on:  # after disable()
        _switch(True)
    return True


def _switch(on):
    """Every op of the loaded library on or off at run time, and the rewrites with them."""
    import torch

    rewrite_switch.on = on
    torch.ops.torchfuse.set_enabled("all", on)


def disable() -> bool:
    """Switches torchfuse off in this process: every call goes to PyTorch's own kernels and the
    rewritten Python code runs its original (optimizers built from now on are left as PyTorch
    builds them). `enable()` switches it on again. Returns whether torchfuse was loaded."""
    if not loaded():
        return False
    _switch(False)
    return True


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """`with torchfuse.disabled(): ...` runs the block as stock PyTorch; each op's state (on or
    off, TORCHFUSE_OPS and set_enabled included) comes back after it."""
    if not loaded():
        yield
        return
    import torch

    before, rewrites_before = enabled_toggles(torch), rewrite_switch.on
    _switch(False)
    try:
        yield
    finally:
        rewrite_switch.on = rewrites_before
        for name, on in before.items():
            torch.ops.torchfuse.set_enabled(name, on)
