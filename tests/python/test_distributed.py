"""Multi-process and DTensor jobs: the optimizer hook's decisions for FSDP2's DTensor params
(CPU: which params it leaves alone and why; GPU: one rank's fully_shard model, bf16 compute
and fp32 reduction, gets the fused step, served by torchfuse, with stock's fused results)."""
import json

import pytest

from conftest import LIB_DIR, ROOT, check, clean_env, requires_cuda, run_python

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
    # The process leaves by os._exit, past the group's and the interpreter's teardown: there
    # gloo's threads can abort it ("terminate called without an active exception", seen twice
    # in CI under load after the body's output, once with the group destroyed first). A world of
    # one has no peer waiting for the group's end. (PyTorch's fake backend has no threads, but
    # its all_gather leaves the output unwritten, so DTensor's results would be garbage.)
    code = (WORLD_OF_ONE.format(lib=str(LIB_DIR), port=free_port(), backend=backend) + body
            + "\nimport sys\nsys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n")
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


# torchfuse's fused step on local shards, here allowed on CPU, around a spy that records which
# path each step took: "Tensor" (the local shards) or "DTensor" (DTensor's dispatch).
SPIED_STEP = """stock = adam._fused_adam.__wrapped__
seen = []
def spy(params, *args, **kwargs):
    seen.append(type(params[0]).__name__)
    return stock(params, *args, **kwargs)
local = optim._fused_adam_on_local_shards(torch, spy, device_type="cpu")
"""


def test_a_fused_step_over_dtensors_runs_on_their_local_shards_with_stocks_bits():
    """torchfuse's _fused_adam (here allowed on CPU) hands the fused step the local shards where
    DTensor's dispatch would only run it on them: the same bits as through DTensor, Adam and
    AdamW, amsgrad included; a state laid out otherwise, a Partial param, a DTensor step count,
    and the adam toggle off each keep DTensor's path."""
    out, log = run_world("""
import torch.optim.adam as adam
from torch.distributed.tensor import Partial, Replicate
from torchfuse import optim
mesh = init_device_mesh("cpu", (1,))
""" + SPIED_STEP + """
def run(kind, fused_adam, steps=3, amsgrad=False, edit=None, grad_placements=None):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])),
              torch.nn.Parameter(distribute_tensor(torch.randn(5), mesh, [Replicate()]))]
    opt = getattr(torch.optim, kind)(params, lr=0.1, weight_decay=0.1, amsgrad=amsgrad, fused=True)
    adam._fused_adam = fused_adam
    seen.clear()
    for step in range(steps):
        for i, p in enumerate(params):
            placements = grad_placements(step, i) if grad_placements else None
            p.grad = distribute_tensor(torch.randn(p.shape), mesh, placements or p.placements)
        opt.step()
        if edit and step == 0:
            edit(opt, params)
    return [p.to_local().clone() for p in params], list(seen)

result = {}
for kind in ("Adam", "AdamW"):
    for amsgrad in (False, True):
        want, _ = run(kind, stock, amsgrad=amsgrad)
        got, paths = run(kind, local, amsgrad=amsgrad)
        result[f"{kind} amsgrad={amsgrad}"] = [all(torch.equal(a, b) for a, b in zip(want, got)), paths]

def replicated_state(opt, params):
    state = opt.state[params[0]]
    state["exp_avg"] = distribute_tensor(state["exp_avg"].full_tensor(), mesh, [Replicate()])
def dtensor_step(opt, params):
    opt.state[params[0]]["step"] = distribute_tensor(opt.state[params[0]]["step"], mesh, [Replicate()])
result["state laid out otherwise"] = run("AdamW", local, edit=replicated_state)[1]
result["DTensor step count"] = run("AdamW", local, edit=dtensor_step)[1]
# The same params and states from step to step (remembered), a gradient laid out otherwise.
result["gradient laid out otherwise"] = run(
    "AdamW", local, grad_placements=lambda step, i: [Replicate()] if step == 1 and i == 0 else None)[1]
torch.ops.torchfuse.set_enabled("adam", False)
result["toggle off"] = run("AdamW", local)[1]
torch.ops.torchfuse.set_enabled("adam", True)
partial = torch.nn.Parameter(DTensor.from_local(torch.randn(4), mesh, [Partial()]))
partial.grad = DTensor.from_local(torch.randn(4), mesh, [Partial()])
adam._fused_adam = local
seen.clear()
torch.optim.AdamW([partial], fused=True).step()
result["partial"] = list(seen)

def raised(fused_adam):  # a loss scale of two elements: PyTorch's error, through either path
    p = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
    p.grad = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    opt = torch.optim.AdamW([p], fused=True)
    opt.grad_scale = torch.ones(2)
    adam._fused_adam = fused_adam
    try:
        opt.step()
    except Exception as e:
        return type(e).__name__ + ": " + str(e).splitlines()[0]
result["two-element grad_scale"] = [raised(stock), raised(local)]
print(json.dumps(result))
""")
    for case in ("Adam amsgrad=False", "Adam amsgrad=True", "AdamW amsgrad=False", "AdamW amsgrad=True"):
        same_bits, paths = out[case]
        assert same_bits and paths == ["Tensor"] * 3, (case, out[case])
    # From the step after the edit on, DTensor's path (the first step still ran locally).
    assert out["state laid out otherwise"] == ["Tensor", "DTensor", "DTensor"], out
    assert out["DTensor step count"] == ["Tensor", "DTensor", "DTensor"], out
    assert out["gradient laid out otherwise"] == ["Tensor", "DTensor", "Tensor"], out
    assert out["toggle off"] == ["DTensor"] * 3, out
    assert out["partial"] == ["DTensor"], out
    stocks, ours = out["two-element grad_scale"]
    assert stocks and ours == stocks, out
    assert log.count("fused Adam/AdamW over DTensors: the step runs on each rank's local shards") == 1, log[-3000:]


TWO_RANKS = """
import json, os, sys, torch, torch.distributed as dist, torchfuse
torchfuse.enable({lib!r})
dist.init_process_group("gloo")
import torch.optim.adam as adam
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torchfuse import optim
mesh, other = init_device_mesh("cpu", (2,)), init_device_mesh("cpu", (2,), mesh_dim_names=("other",))
{spied_step}
def run(kind, fused_adam, layouts, amsgrad=False):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(shape), m, pl)) for shape, m, pl in layouts]
    opt = getattr(torch.optim, kind)(params, lr=0.1, weight_decay=0.1, amsgrad=amsgrad, fused=True)
    adam._fused_adam = fused_adam
    seen.clear()
    for step in range(3):
        torch.manual_seed(100 + step)  # the same gradients on both ranks, then sharded
        for p in params:
            p.grad = distribute_tensor(torch.randn(p.shape), p.device_mesh, p.placements)
        opt.step()
    return [p.full_tensor() for p in params], list(seen)

one_mesh = [((5, 3), mesh, [Shard(0)]), ((4, 5), mesh, [Shard(1)]), ((3,), mesh, [Replicate()]),
            ((1,), mesh, [Shard(0)])]  # uneven rows; a shard empty on rank 1
two_meshes = [((5, 3), mesh, [Shard(0)]), ((4,), other, [Shard(0)])]
result = {{}}
for name, layouts in (("one mesh", one_mesh), ("two meshes", two_meshes)):
    for kind, amsgrad in (("Adam", True), ("AdamW", False)):
        want, _ = run(kind, stock, layouts, amsgrad)
        got, paths = run(kind, local, layouts, amsgrad)
        same = torch.tensor(int(all(torch.equal(a, b) for a, b in zip(want, got))))
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        result[f"{{name}} {{kind}}"] = [bool(same), paths]
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(result))
# Both ranks leave together, and skip the interpreter's teardown: gloo's threads can abort a
# process there ("terminate called without an active exception", seen once in 8 runs).
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


def test_on_two_ranks_the_local_shards_step_gives_dtensors_bits(tmp_path):
    """Two CPU ranks over gloo, where a shard is not the whole tensor: uneven rows, a shard empty
    on one rank, a column shard and a replicated param take the local path with DTensor's bits;
    params on two meshes in one group keep DTensor's path (it steps only the first param's
    mesh)."""
    import subprocess
    import sys
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS.format(lib=str(LIB_DIR), spied_step=SPIED_STEP))
    env = clean_env(PYTHONPATH=str(PACKAGE_DIR), TORCHFUSE_LOG="info")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(script)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    for kind in ("Adam", "AdamW"):
        assert result[f"one mesh {kind}"] == [True, ["Tensor"] * 3], result
        assert result[f"two meshes {kind}"] == [True, ["DTensor"] * 3], result


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
    # The step ran on the local shards (DTensor's dispatch skipped), still torchfuse's kernel.
    assert "fused Adam/AdamW over DTensors: the step runs on each rank's local shards" in log
    # ShardedGradScaler agrees on skipped steps across ranks only when it unscales itself.
    assert ours["amp_scaling"] is False
    # Every step's local update ran torchfuse's kernel (one call a step, or one per group of
    # shards DTensor forms), none went to stock.
    assert ours["adam"].get("fused", 0) >= 5 and ours["adam"].get("stock", 0) == 0, ours["adam"]
    assert stock["fused"] is True and not stock["adam"].get("fused")
    import torch
    a, b = torch.tensor(ours["params"]), torch.tensor(stock["params"])
    assert ((a - b).norm() / b.norm()).item() < 1e-5
