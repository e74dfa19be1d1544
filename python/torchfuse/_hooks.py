"""Patches applied to library modules when they are first imported (or at once, if they
already are): the one mechanism every Python-side substitution of torchfuse goes through.
Installing needs no torch import, so the launcher's start-up hook costs nothing in processes
that never import torch."""
import importlib.abc
import os
import sys

from . import layer_graphs, optim, rewrites

# Modules whose patches could not act yet (returned False), by name.
_pending = {}


def _retry_pending(torch_module):
    """torch's own import is over: the patches of modules it imported on its way run again.
    `import torch` imports torch.nn before it makes `torch.ops`, so a patch that asks the
    library (preloaded by the launcher) finds it only from here on."""
    for module in list(_pending.values()):
        _apply(module)
    return True


# Module name -> the functions that patch it, in order.
PATCHES = {
    "torch": [_retry_pending],
    "torch.optim.adam": [optim.patch_adam],
    "torch.nn.modules.linear": [rewrites.patch_linear],
    "transformers.modeling_layers": [layer_graphs.patch_layers],
    "timm.models.vision_transformer": [layer_graphs.patch_timm_blocks],
}


def patches_for(name):
    """The functions that patch the module of this name, in order."""
    found = list(PATCHES.get(name, []))
    if rewrites.wants(name):
        found.append(rewrites.patch_module)
    return found


def _warn(what, error):
    print(f"torchfuse: {what} ({error!r})", file=sys.stderr)


def _apply(module):
    """Runs each of the module's patches once. A patch that returns False could not act yet
    (the rewrites need the library, which `enable()` may load later): it runs again at the next
    `install()`."""
    done = module.__dict__.setdefault("_torchfuse_patched", set())
    _pending.pop(module.__name__, None)
    for patch in patches_for(module.__name__):
        name = f"{patch.__module__}.{patch.__name__}"
        if name in done:
            continue
        try:
            if patch(module) is False:
                _pending[module.__name__] = module
            else:
                done.add(name)
        except Exception as e:  # never break the user's job
            done.add(name)
            _warn(f"{name} not applied", e)


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, which then applies the module's patches. Everything else a
    loader answers (`get_data`, `get_resource_reader`, `get_source`, ...: pkgutil,
    importlib.resources and linecache ask the module's loader) is the wrapped loader's."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        if name == "_loader":  # not set yet (a copy made without __init__): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _apply(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Hands the modules `patches_for` names to `_apply` right after they are first imported."""

    def find_spec(self, name, path, target=None):
        if not patches_for(name):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


# The spellings of TORCHFUSE that switch torchfuse off, in any case (the library reads the same:
# src/runtime/config.rs; a test holds the two together).
OFF = ("0", "false", "no", "off")


def switched_off():
    """Whether TORCHFUSE switches torchfuse off in this process."""
    return os.environ.get("TORCHFUSE", "").strip().lower() in OFF


def install():
    """Installs the patches (idempotent); nothing when TORCHFUSE switches torchfuse off."""
    if switched_off():
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name, module in list(sys.modules.items()):
        if module is not None and patches_for(name):
            _apply(module)
    return True
