"""torchfuse's Python start-up hook (put on PYTHONPATH by scripts/torchfuse).

Most training scripts build `torch.optim.Adam(params)` / `AdamW(params)` with no `fused`
argument and get PyTorch's foreach step, about 3x slower than the fused one. When such an
optimizer is built, this hook makes it what `fused=True` would have made it, provided that:
the optimizer is exactly torch.optim.Adam or AdamW (not a subclass), the user passed none of
`foreach`, `fused`, `differentiable` (in the constructor or in any
param group), every param is a CUDA floating-point tensor (what PyTorch's fused step
accepts), and torchfuse's `adam` toggle is on in this process. Each substitution is logged
through torchfuse's log (info level). Anything unexpected leaves the optimizer as PyTorch
built it.

Python runs one `sitecustomize`; the one this shadows (if any) is run after this one.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys

_HOOK_DIR = os.path.dirname(os.path.abspath(__file__))
_FUSED_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _torchfuse_adam_enabled(torch):
    """True when torchfuse is loaded in this process with its `adam` toggle on."""
    try:
        stats = json.loads(torch.ops.torchfuse.stats())
    except Exception:
        return False
    return bool(stats.get("enabled", {}).get("adam", False))


def _note(torch, message):
    try:
        torch.ops.torchfuse.note(message)
    except Exception:
        pass


def _fused_allowed(torch, optimizer):
    """The conditions under which PyTorch itself would accept fused=True for these params."""
    supported_types = (torch.Tensor, torch.nn.Parameter)
    for group in optimizer.param_groups:
        if group.get("foreach") is not None or group.get("fused") is not None:
            return False
        if group.get("differentiable"):
            return False
        for p in group["params"]:
            if type(p) not in supported_types or not p.is_cuda:
                return False
            if str(p.dtype).removeprefix("torch.") not in _FUSED_DTYPES:
                return False
    return any(group["params"] for group in optimizer.param_groups)


def _make_fused(torch, optimizer):
    # What Adam.__init__ does for fused=True: the flag in the defaults and every group, and
    # AMP's GradScaler hands the step its scale instead of unscaling first.
    optimizer.defaults["fused"] = True
    for group in optimizer.param_groups:
        group["fused"] = True
    optimizer._step_supports_amp_scaling = True
    optimizer._torchfuse_made_fused = True


def _patch_adam(module):
    import torch

    adam_class = module.Adam
    original_init = adam_class.__init__
    original_load = adam_class.load_state_dict

    def __init__(self, params, *args, **kwargs):
        original_init(self, params, *args, **kwargs)
        try:
            # Subclasses may step differently (and GradScaler would trust them with its scale).
            if type(self) not in (adam_class, getattr(torch.optim, "AdamW", adam_class)):
                return
            chosen = any(kwargs.get(k) is not None for k in ("foreach", "fused"))
            if chosen or kwargs.get("differentiable", False):
                return
            if not _torchfuse_adam_enabled(torch) or not _fused_allowed(torch, self):
                return
            _make_fused(torch, self)
            tensors = sum(len(g["params"]) for g in self.param_groups)
            _note(torch, f"{type(self).__name__}: fused step instead of the foreach default "
                         f"({tensors} params; torchfuse launcher)")
        except Exception as e:  # never break the user's job
            print(f"torchfuse: optimizer hook skipped ({e!r})", file=sys.stderr)

    def load_state_dict(self, state_dict):
        # The saved groups' foreach/fused flags replace this optimizer's on load. They record
        # how the saving run was built (often the foreach default); this optimizer was made
        # fused, and GradScaler already trusts it with its scale, so it stays fused (PyTorch
        # then moves the loaded step counts to the device, as fused needs).
        if getattr(self, "_torchfuse_made_fused", False) and isinstance(state_dict, dict):
            try:
                groups = [dict(g, fused=True, foreach=None) if not g.get("differentiable") else g
                          for g in state_dict["param_groups"]]
                state_dict = dict(state_dict, param_groups=groups)
            except Exception as e:
                print(f"torchfuse: optimizer hook skipped on load ({e!r})", file=sys.stderr)
        return original_load(self, state_dict)

    __init__.__wrapped__ = original_init
    __init__.__doc__ = original_init.__doc__
    adam_class.__init__ = __init__
    adam_class.load_state_dict = load_state_dict


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            self._patch(module)
        except Exception as e:
            print(f"torchfuse: optimizer hook not installed ({e!r})", file=sys.stderr)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches torch.optim.adam right after it is first imported."""

    def find_spec(self, name, path, target=None):
        if name != "torch.optim.adam":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, _patch_adam)
                return spec
        return None


def _install():
    if os.environ.get("TORCHFUSE", "1") == "0":
        return
    if "torch.optim.adam" in sys.modules:
        _patch_adam(sys.modules["torch.optim.adam"])
    else:
        sys.meta_path.insert(0, _Finder())


def _run_shadowed_sitecustomize():
    for entry in sys.path:
        if os.path.abspath(entry or os.getcwd()) == _HOOK_DIR:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


try:
    _install()
except Exception as e:
    print(f"torchfuse: optimizer hook not installed ({e!r})", file=sys.stderr)
_run_shadowed_sitecustomize()
