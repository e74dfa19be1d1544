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

A fused step over DTensors pays DTensor's dispatch (a sharding decision and a spec per tensor)
on the host, in every step, for what is one local kernel call on each rank: for a small GPT-2
under FSDP2 (148 params) 6.3-8.3 ms a step against 2.7-3.7 ms for the same call on the local
shards (`scripts/dev/fsdp2_adam_host.py`: a world of one on CPU, where the host's share is what
is timed). Where DTensor's dispatch would only run the op on each rank's shards (every
param, gradient and state a CUDA DTensor laid out as its param, Shard or Replicate, on one mesh
that holds the rank; the step counts and scalars plain one-element tensors), the fused step
gets those shards directly: the same kernel call on the same memory. Anything else goes
through DTensor as before. The params and states found laid out alike are remembered (by weak
reference), so that later steps check only their new gradients.
"""
import sys
import weakref

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


def _laid_out_as(dtensor, t, mesh, placements, shape):
    """Whether t is exactly a DTensor on `mesh` with these placements and this (global) shape."""
    return (type(t) is dtensor and (t.device_mesh is mesh or t.device_mesh == mesh)
            and t.placements == placements and t.shape == shape)


def _to_local(lists):
    return [[t.to_local() for t in tensors] for tensors in lists]


def _local_shards(dtensor, lists, device_type="cuda"):
    """Each rank's local shards of `lists` (params, then the lists that go with them, each
    empty or as long) where DTensor's own dispatch of a fused step would only run it on them:
    every tensor exactly a DTensor on `device_type`, all on one device mesh that holds this rank
    (DTensor skips the whole call where the first param's does not), each laid out as its param
    (the same placements, each Shard or Replicate: a Partial one would be reduced first, a
    strided shard is left to DTensor) and of its param's shape; otherwise None."""
    params = lists[0]
    others = [tensors for tensors in lists[1:] if tensors]
    if not params or any(len(tensors) != len(params) for tensors in others):
        return None
    if type(params[0]) is not dtensor or params[0].device.type != device_type:
        return None
    mesh = params[0].device_mesh
    if mesh.get_coordinate() is None:
        return None
    for i, p in enumerate(params):
        if type(p) is not dtensor or (p.device_mesh is not mesh and p.device_mesh != mesh):
            return None
        placements, shape = p.placements, p.shape
        if not all(pl.is_shard() or pl.is_replicate() for pl in placements):
            return None
        for tensors in others:
            if not _laid_out_as(dtensor, tensors[i], mesh, placements, shape):
                return None
    return _to_local(lists)


class _LocalShards:
    """`_local_shards` with a memory of the params and states it last found laid out alike (by
    weak reference: a discarded optimizer's tensors are freed), so that the next step with the
    same tensors checks only its new gradients against their params' layouts."""

    def __init__(self, device_type):
        self.device_type = device_type
        self.memo = None  # (weak references, (placements, shape) per param, mesh), set at once

    def __call__(self, dtensor, lists):
        params, grads = lists[0], lists[1]
        kept = [t for tensors in [params] + [ts for ts in lists[2:] if ts] for t in tensors]
        memo = self.memo
        if (memo is not None and len(memo[0]) == len(kept) and len(grads) == len(params)
                and all(ref() is t for ref, t in zip(memo[0], kept))):
            _, layouts, mesh = memo
            for g, (placements, shape) in zip(grads, layouts):
                if not _laid_out_as(dtensor, g, mesh, placements, shape):
                    return None
            return _to_local(lists)
        local = _local_shards(dtensor, lists, self.device_type)
        if local is not None:
            self.memo = ([weakref.ref(t) for t in kept], [(p.placements, p.shape) for p in params],
                         params[0].device_mesh)
        return local


def _fused_adam_on_local_shards(torch, original, device_type="cuda"):
    """torch.optim.adam._fused_adam, run on the local shards of DTensor lists where
    `_local_shards` finds them and the `adam` toggle is on (see the module's docstring); as
    PyTorch runs it otherwise. Only the decision is guarded: an error of the step itself is
    stock's, raised once."""
    said = set()  # the log line and the warning, once each
    local_shards = _LocalShards(device_type)

    def _fused_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, grad_scale,
                    found_inf, **kwargs):
        local = None
        # Dynamo wraps this function in torch.compiler.disable (as it does PyTorch's own), so a
        # compiled step calls it eagerly; should a trace reach it all the same, PyTorch's code.
        if not torch.compiler.is_compiling():
            local = choose(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                           grad_scale, found_inf, kwargs.get("lr"))
        if local is None:
            return original(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                            grad_scale, found_inf, **kwargs)
        if "noted" not in said:
            said.add("noted")
            note(torch, f"fused Adam/AdamW over DTensors: the step runs on each rank's local shards "
                        f"({len(params)} params; DTensor's dispatch skipped, the same kernel call)")
        return original(*local, state_steps, grad_scale, found_inf, **kwargs)

    def choose(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, grad_scale,
               found_inf, lr):
        """The local shards to step, or None for PyTorch's path."""
        try:
            dtensor = _dtensor_type(torch)
            # Step counts, the loss scale, found_inf and a tensor lr: plain one-element tensors,
            # as PyTorch checks them (a DTensor among them would take DTensor's dispatch anyway).
            scalars = list(state_steps) + [t for t in (grad_scale, found_inf, lr)
                                           if isinstance(t, torch.Tensor)]
            # Grad mode off, as Optimizer.step runs it: there to_local() is the shard itself,
            # and an in-place step on leaves that require grad keeps PyTorch's error otherwise.
            if (dtensor is not None and params and type(params[0]) is dtensor
                    and not torch.is_grad_enabled()
                    and all(type(t) is torch.Tensor and t.numel() == 1 for t in scalars)):
                local = local_shards(dtensor, [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs])
                if local is not None and torch.ops.torchfuse.enabled("adam"):
                    return local
        except Exception as e:  # never break the user's job: PyTorch's own path
            if "warned" not in said:
                said.add("warned")
                print(f"torchfuse: fused step on local shards skipped ({e!r})", file=sys.stderr)
        return None

    _fused_adam.__wrapped__ = original
    return _fused_adam


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
    # Adam's and AdamW's step call the module's _fused_adam by name (`adam()` picks it).
    if callable(getattr(module, "_fused_adam", None)):
        module._fused_adam = _fused_adam_on_local_shards(torch, module._fused_adam)
