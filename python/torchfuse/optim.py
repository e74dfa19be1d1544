"""The optimizer hook: an unchanged `torch.optim.Adam(params)` / `AdamW(params)` takes the fused
step, which torchfuse serves, instead of PyTorch's foreach default (about 3x slower).

When such an optimizer is built, it becomes what `fused=True` would have made it, provided
that: it is exactly torch.optim.Adam or AdamW (not a subclass), the user passed none of
`foreach`, `fused`, `differentiable` (in the constructor or in any param group), every param
is a CUDA floating-point tensor (what PyTorch's fused step accepts), and torchfuse's `adam`
toggle is on in this process. Each substitution is logged through torchfuse's log (info
level). Anything unexpected leaves the optimizer as PyTorch built it.
"""
import json
import sys

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


def patch_adam(module):
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
                         f"({tensors} params; torchfuse)")
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
