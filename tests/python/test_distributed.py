"""Multi-process and DTensor jobs: the optimizer hook's decisions for FSDP2's DTensor params
(CPU: which params it leaves alone and why; GPU: one rank's fully_shard model, bf16 compute
and fp32 reduction, gets the fused step, served by torchfuse, with stock's fused results)."""
import json

import pytest

from conftest import LIB_DIR, ROOT, check, requires_cuda, run_python

PACKAGE_DIR = ROOT / "python"

# One process as a world of one (gloo over a local store), then `body`.
WORLD_OF_ONE = """
import json, os, torch, torch.distributed as dist, torchfuse
torchfuse.enable({lib!r})
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str({port}), RANK="0", WORLD_SIZE="1")
dist.init_process_group({backend!r})
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
"""


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(body, backend="gloo", **env):
    # The group destroyed before exit: left to the interpreter's teardown, gloo's threads can
    # abort the process ("terminate called without an active exception"; seen once in CI under
    # load, after the body's output).
    code = (WORLD_OF_ONE.format(lib=str(LIB_DIR), port=free_port(), backend=backend) + body
            + "\ndist.destroy_process_group()\n")
    proc = check(run_python(code, PYTHONPATH=PACKAGE_DIR, TORCHFUSE_LOG="debug", **env))
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_dtensor_params_the_fused_step_would_reject_are_left_alone_and_logged():
    out, log = run_world("""
mesh_a, mesh_b = init_device_mesh("cpu", (1,)), init_device_mesh("cpu", (1,), mesh_dim_names=("other",))
def dt(mesh):
    return torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
cases = {
    "mixed": torch.optim.AdamW([dt(mesh_a), torch.nn.Parameter(torch.randn(3))]),
    "two_meshes": torch.optim.AdamW([dt(mesh_a), dt(mesh_b)]),
    "cpu": torch.optim.AdamW([dt(mesh_a), dt(mesh_a)]),
}
print(json.dumps({k: o.param_groups[0]["fused"] for k, o in cases.items()}))
""")
    assert out == {"mixed": None, "two_meshes": None, "cpu": None}
    assert "AdamW left as PyTorch built it: params mix DTensors and plain tensors" in log
    assert "AdamW left as PyTorch built it: DTensor params on more than one device mesh" in log
    assert "AdamW left as PyTorch built it: params not all on CUDA" in log


FSDP_STEPS = """
torch.manual_seed(0)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
bf16_compute = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mp_policy=bf16_compute)
fully_shard(model, mp_policy=bf16_compute)
opt = torch.optim.AdamW(model.parameters(), **{kwargs})
data = torch.randn(5, 32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
for x in data:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
params = [p.full_tensor().double().flatten() for p in model.parameters()]
print(json.dumps({{"fused": opt.param_groups[0]["fused"], "dtensor": isinstance(next(model.parameters()), DTensor),
                  "amp_scaling": getattr(opt, "_step_supports_amp_scaling", False),
                  "adam": json.loads(torch.ops.torchfuse.stats())["ops"].get("_fused_adamw_", {{}}),
                  "params": torch.cat(params).tolist()}}))
"""


@requires_cuda
def test_fsdp2_dtensor_params_get_the_fused_step_torchfuse_serves():
    ours, log = run_world(FSDP_STEPS.format(kwargs="{}"), backend="nccl")
    stock, _ = run_world(FSDP_STEPS.format(kwargs="{'fused': True}"), backend="nccl", TORCHFUSE_OPS="-adam")
    assert ours["dtensor"] and ours["fused"] is True, log[-3000:]
    assert "AdamW: fused step instead of the foreach default (4 DTensor params; torchfuse)" in log
    # ShardedGradScaler agrees on skipped steps across ranks only when it unscales itself.
    assert ours["amp_scaling"] is False
    # Every step's local update ran torchfuse's kernel (one call a step, or one per group of
    # shards DTensor forms), none went to stock.
    assert ours["adam"].get("fused", 0) >= 5 and ours["adam"].get("stock", 0) == 0, ours["adam"]
    assert stock["fused"] is True and not stock["adam"].get("fused")
    import torch
    a, b = torch.tensor(ours["params"]), torch.tensor(stock["params"])
    assert ((a - b).norm() / b.norm()).item() < 1e-5
