"""scripts/torchfuse: LD_PRELOAD plus the Python hook that makes Adam/AdamW built without
foreach/fused/differentiable use the fused step. CPU checks run everywhere; the CUDA ones
need a GPU."""
import json
import subprocess
import sys

from conftest import LIB_DIR, ROOT, clean_env, requires_cuda

LAUNCHER = ROOT / "scripts" / "torchfuse"


def launch(code, **env):
    env = clean_env(TORCHFUSE_LIB_DIR=LIB_DIR, **env)
    return subprocess.run([str(LAUNCHER), sys.executable, "-c", code], env=env,
                          capture_output=True, text=True, timeout=600)


def last_json(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


DESCRIBE = """
import json, torch
def describe(opt):
    g = opt.param_groups[0]
    return {"fused": g["fused"], "foreach": g["foreach"], "default_fused": opt.defaults["fused"],
            "amp_scaling": getattr(opt, "_step_supports_amp_scaling", False)}
"""


def test_without_a_command_it_prints_usage():
    proc = subprocess.run([str(LAUNCHER)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "usage" in proc.stderr


def test_cpu_params_are_left_as_pytorch_built_them():
    out = last_json(launch(DESCRIBE + """
m = torch.nn.Linear(4, 3)
print(json.dumps({"hooked": hasattr(torch.optim.Adam.__init__, "__wrapped__"),
                  "adamw": describe(torch.optim.AdamW(m.parameters())),
                  "adam": describe(torch.optim.Adam(m.parameters(), lr=1e-2))}))
"""))
    assert out["hooked"]
    untouched = {"fused": None, "foreach": None, "default_fused": None, "amp_scaling": False}
    assert out["adamw"] == untouched
    assert out["adam"] == untouched


def test_a_shadowed_sitecustomize_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_RAN'] = '1'\n")
    out = last_json(launch("import json, os\nprint(json.dumps(os.environ.get('SHADOWED_RAN')))",
                           PYTHONPATH=tmp_path))
    assert out == "1"


def test_torchfuse_0_installs_no_hook():
    out = last_json(launch("import json, torch\n"
                           "print(json.dumps(hasattr(torch.optim.Adam.__init__, '__wrapped__')))",
                           TORCHFUSE=0))
    assert out is False


GPU_CASES = DESCRIBE + """
torch.ops.torchfuse.reset_stats()
def params():
    return list(torch.nn.Linear(64, 64).cuda().parameters())
class MyAdam(torch.optim.Adam):
    pass
cases = {
    "adamw_default": torch.optim.AdamW(params()),
    "adam_default": torch.optim.Adam(params(), lr=1e-3, weight_decay=0.0),
    "adamw_foreach": torch.optim.AdamW(params(), foreach=True),
    "adam_fused_false": torch.optim.Adam(params(), fused=False),
    "adam_differentiable": torch.optim.Adam(params(), differentiable=True),
    "subclass": MyAdam(params()),
    "group_foreach": torch.optim.AdamW([{"params": params(), "foreach": False}]),
    "mixed_devices": torch.optim.AdamW(params() + list(torch.nn.Linear(2, 2).parameters())),
}
out = {name: describe(opt) for name, opt in cases.items()}
# A step of the substituted optimizer reaches torchfuse's kernel.
opt = cases["adamw_default"]
for p in opt.param_groups[0]["params"]:
    p.grad = torch.randn_like(p)
opt.step()
torch.cuda.synchronize()
ops = json.loads(torch.ops.torchfuse.stats())["ops"]
out["fused_adamw_calls"] = ops.get("_fused_adamw_", {}).get("fused", 0)
# A checkpoint of a foreach run loads into a substituted optimizer, which stays fused.
src = torch.optim.AdamW(params(), foreach=True)
for p in src.param_groups[0]["params"]:
    p.grad = torch.randn_like(p)
src.step()
dst = torch.optim.AdamW(params())
dst.load_state_dict(src.state_dict())
state = next(iter(dst.state.values()))
out["loaded"] = dict(describe(dst), step_device=str(state["step"].device))
print(json.dumps(out))
"""


@requires_cuda
def test_cuda_adam_and_adamw_default_to_the_fused_step():
    proc = launch(GPU_CASES, TORCHFUSE_LOG="info")
    out = last_json(proc)
    fused = {"fused": True, "foreach": None, "default_fused": True, "amp_scaling": True}
    assert out["adamw_default"] == fused
    assert out["adam_default"] == fused
    assert out["adamw_foreach"]["foreach"] is True and out["adamw_foreach"]["fused"] is None
    assert out["adam_fused_false"]["fused"] is False
    for name in ("adam_differentiable", "subclass", "group_foreach", "mixed_devices"):
        assert out[name]["fused"] is None and not out[name]["amp_scaling"], name
    assert out["fused_adamw_calls"] == 1
    assert out["loaded"]["fused"] is True and out["loaded"]["step_device"].startswith("cuda")
    assert "AdamW: fused step instead of the foreach default (2 params" in proc.stderr
    assert "Adam: fused step instead of the foreach default" in proc.stderr


@requires_cuda
def test_the_adam_toggle_switches_the_hook_off():
    code = DESCRIBE + "print(json.dumps(describe(torch.optim.AdamW(torch.nn.Linear(8, 8).cuda().parameters()))))"
    assert last_json(launch(code, TORCHFUSE_OPS="-adam"))["fused"] is None
    off_at_run_time = DESCRIBE + """
torch.ops.torchfuse.set_enabled("adam", False)
print(json.dumps(describe(torch.optim.AdamW(torch.nn.Linear(8, 8).cuda().parameters()))))
"""
    assert last_json(launch(off_at_run_time))["fused"] is None


@requires_cuda
def test_fp16_params_keep_stocks_step_and_gradscalers_error():
    """A pure-fp16 model with AMP's GradScaler: stock's default AdamW raises (fp16 gradients
    cannot be unscaled); under the launcher the optimizer stays unfused, so the job stops the
    same way instead of silently training pure fp16."""
    code = DESCRIBE + """
m = torch.nn.Linear(8, 8).cuda().half()
opt = torch.optim.AdamW(m.parameters())
scaler = torch.amp.GradScaler("cuda")
scaler.scale(m(torch.randn(4, 8, device="cuda", dtype=torch.half)).float().sum()).backward()
try:
    scaler.step(opt)
    error = None
except ValueError as e:
    error = str(e)
print(json.dumps({"optimizer": describe(opt), "error": error}))
"""
    proc = launch(code, TORCHFUSE_LOG="info")
    out = last_json(proc)
    assert out["optimizer"]["fused"] is None, out
    assert out["error"] == "Attempting to unscale FP16 gradients.", out
    assert "float16 params" in proc.stderr


def test_from_a_checkout_the_projects_environment_runs_the_command():
    """No environment active: scripts/torchfuse runs the command with the Python environment
    scripts/setup made (the torch the libraries are built against), and says so; an active one
    is the user's choice and is kept."""
    venv = sys.prefix  # this test's own environment stands for the project's
    code = "import json, sys, torch; print(json.dumps(sys.prefix))"
    env = {k: v for k, v in clean_env(TORCHFUSE_LIB_DIR=LIB_DIR, TORCHFUSE_VENV=venv).items()
           if k not in ("VIRTUAL_ENV", "CONDA_PREFIX")}
    env["PATH"] = "/usr/bin:/bin"
    proc = subprocess.run([str(LAUNCHER), "python3", "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert last_json(proc) == venv, proc.stderr
    assert f"torchfuse: using the project's Python environment {venv}" in proc.stderr
    mine = subprocess.run([str(LAUNCHER), sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "VIRTUAL_ENV": sys.prefix}, timeout=600)
    assert last_json(mine) == sys.prefix and "project's Python environment" not in mine.stderr
