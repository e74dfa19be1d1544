"""The optimizer hook: an unchanged `torch.optim.Adam(params)` / `AdamW(params)` takes the fused
step, which torchfuse serves, instead of PyTorch's foreach default (about 3x slower).

When such an optimizer is built, it becomes what `fused=True` would have made it, provided
that: it is exactly torch.optim.Adam or AdamW (not a subclass), the user passed none of
`foreach`, `fused`, `differentiable` (in the constructor or in any param group), every param
is a CUDA floating-point tensor (what PyTorch's fused step accepts) and none is float16 (AMP's
GradScaler refuses fp16 gradients in the default step, not in the fused one), and torchfuse's `adam`
toggle is on in this process. Each substitution is logged through torchfuse's log (info
level), and so is why CUDA params were left alone. Anything unexpected leaves the optimizer as
PyTorch built it.

FSDP2 (`fully_shard`) makes the params DTensors: PyTorch's default for them is foreach too,
and it accepts fused=True for them (DTensor runs `_fused_adamw_` on each rank's local shards,
which torchfuse then serves). So an optimizer whose params are all CUDA DTensors of one device
mesh is made fused too; params mixing DTensors and plain tensors, or DTensors of several meshes,
are left alone (DTensor's fused step would reject them), with a log line saying so. For DTensor
params GradScaler is not handed the fused step's scale: FSDP's ShardedGradScaler agrees on
skipped steps across ranks only in its unscale_, which that path would skip.
"""
import sys

from ._library import enabled_toggles, note

_FUSED_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _dtensor_type(torch):
    """torch.distributed.tensor.DTensor, or None where it is not imported (then no param can be
    one) or this torch has no distributed package."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _why_not_fused(torch, optimizer, params):
    """None where PyTorch itself would accept fused=True for `params` (all of the optimizer's;
    fused is what torchfuse serves); otherwise why not, and whether that is worth an info line
    (CUDA params the user may expect to be fused) rather than a debug one."""
    plain_types, dtensor = (torch.Tensor, torch.nn.Parameter), _dtensor_type(torch)
    for group in optimizer.param_groups:
        if group.get("foreach") is not None or group.get("fused") is not None:
            return "a param group chose foreach or fused", False
        if group.get("differentiable"):
            return "a param group is differentiable", False
    if not params:
        return "no params", False
    dtensors = [p for p in params if dtensor is not None and isinstance(p, dtensor)]
    if dtensors and len(dtensors) < len(params):
        return "params mix DTensors and plain tensors", True
    if dtensors and len({p.device_mesh for p in dtensors}) > 1:  # DeviceMesh compares by ranks
        return "DTensor params on more than one device mesh", True
    if not dtensors and not all(type(p) in plain_types for p in params):
        return "params of a tensor subclass", True
    if not all(p.is_cuda for p in params):
        return "params not all on CUDA", False
    if not all(str(p.dtype).removeprefix("torch.") in _FUSED_DTYPES for p in params):
        return "params of a dtype fused Adam does not take", True
    if any(p.dtype == torch.float16 for p in params):
        # AMP's GradScaler refuses fp16 gradients in PyTorch's default step ("Attempting to
        # unscale FP16 gradients") but takes them in the fused one: pure-fp16 training would
        # silently run where stock stops it.
        return "float16 params (GradScaler refuses their gradients in the default step)", True
    return None


def _make_fused(torch, optimizer, amp_scaling):
    # What Adam.__init__ does for fused=True: the flag in the defaults and every group, and
    # (amp_scaling) AMP's GradScaler hands the step its scale instead of unscaling first.
    optimizer.defaults["fused"] = True
    for group in optimizer.param_groups:
        group["fused"] = True
    if amp_scaling:
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
            if not enabled_toggles(torch).get("adam", False):
                return
            params = [p for g in self.param_groups for p in g["params"]]
            why_not = _why_not_fused(torch, self, params)
            if why_not is not None:
                why, worth_info = why_not
                note(torch, f"{type(self).__name__} left as PyTorch built it: {why}", debug=not worth_info)
                return
            dtensor = _dtensor_type(torch)
            sharded = dtensor is not None and isinstance(params[0], dtensor)
            _make_fused(torch, self, amp_scaling=not sharded)
            note(torch, f"{type(self).__name__}: fused step instead of the foreach default "
                        f"({len(params)} {'DTensor ' if sharded else ''}params; torchfuse)")
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
