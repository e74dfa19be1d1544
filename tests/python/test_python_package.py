"""The `torchfuse` Python package (python/torchfuse): importing it is light, `enable()` loads the
library and installs the hooks once, TORCHFUSE=0 installs none, and the launcher's start-up
hook goes through the same package. CPU checks run everywhere; the CUDA one needs a GPU."""
import json

from conftest import LIB_DIR, ROOT, check, requires_cuda, run_python

PACKAGE_DIR = ROOT / "python"


def run(code, **env):
    proc = check(run_python(code, PYTHONPATH=PACKAGE_DIR, **env))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_the_package_imports_no_torch():
    out = run("import json, sys, torchfuse\n"
              "print(json.dumps({'torch': 'torch' in sys.modules, 'loaded': torchfuse.loaded()}))")
    assert out == {"torch": False, "loaded": False}


def test_enable_loads_the_library_and_hooks_adam_once():
    out = run(f"""
import json, torch, torchfuse
first = torchfuse.enable({str(LIB_DIR)!r})
second = torchfuse.enable({str(LIB_DIR)!r})
init = torch.optim.Adam.__init__
m = torch.nn.Linear(4, 3)
opt = torch.optim.AdamW(m.parameters())
print(json.dumps({{"first": first, "second": second, "loaded": torchfuse.loaded(),
                  "enabled": json.loads(torch.ops.torchfuse.stats())["enabled"],
                  "hooked": hasattr(init, "__wrapped__"),
                  "hooked_twice": hasattr(getattr(init, "__wrapped__", None), "__wrapped__"),
                  "cpu_params_fused": opt.param_groups[0]["fused"]}}))
""")
    assert out["first"] and out["second"] and out["loaded"]
    assert out["enabled"]["adam"] is True
    assert out["hooked"] and not out["hooked_twice"]
    # CPU params: PyTorch's fused step does not take them, so the optimizer is left alone.
    assert out["cpu_params_fused"] is None


def test_torchfuse_0_loads_but_installs_no_hook():
    out = run(f"""
import json, torch, torchfuse
ok = torchfuse.enable({str(LIB_DIR)!r})
print(json.dumps({{"ok": ok, "hooked": hasattr(torch.optim.Adam.__init__, "__wrapped__")}}))
""", TORCHFUSE="0")
    assert out == {"ok": True, "hooked": False}


def test_a_missing_library_warns_and_leaves_pytorch_alone(tmp_path):
    proc = check(run_python(f"""
import json, torch, torchfuse
ok = torchfuse.enable({str(tmp_path)!r})
print(json.dumps({{"ok": ok, "hooked": hasattr(torch.optim.Adam.__init__, "__wrapped__")}}))
""", PYTHONPATH=PACKAGE_DIR))
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"ok": False, "hooked": False}
    assert f"RuntimeWarning: torchfuse: no libtorchfuse.so in {tmp_path}" in proc.stderr


def test_enable_warns_once_and_names_the_library_that_serves(tmp_path):
    """A failing enable() warns with warnings.warn, once however often it is called; after a
    success, a lib_dir without the library is not loaded, and the warning names the one that
    keeps serving."""
    proc = check(run_python(f"""
import json, warnings, torch, torchfuse
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = [torchfuse.enable({str(tmp_path)!r}) for _ in range(3)]
    ok = torchfuse.enable({str(LIB_DIR)!r})
    again = torchfuse.enable({str(tmp_path)!r})
print(json.dumps({{"first": first, "ok": ok, "again": again,
                  "warnings": [(w.category.__name__, str(w.message)) for w in caught]}}))
""", PYTHONPATH=PACKAGE_DIR))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"] == [False, False, False] and out["ok"] and out["again"], out
    assert [category for category, _ in out["warnings"]] == ["RuntimeWarning"] * 2, out
    assert "no libtorchfuse.so in" in out["warnings"][0][1]
    assert f"{LIB_DIR / 'libtorchfuse.so'} is loaded already and keeps serving" in out["warnings"][1][1]
    assert proc.stderr.strip() == "", proc.stderr  # nothing printed besides the warnings caught


def test_disable_and_the_disabled_context():
    """disable() switches every op and the rewrites off, enable() back on; `disabled()` restores
    each op's own state after the block (TORCHFUSE_OPS and set_enabled included)."""
    out = run(f"""
import json, torch, torchfuse
from torchfuse._library import rewrite_switch
def on():
    return sorted(k for k, v in json.loads(torch.ops.torchfuse.stats())["enabled"].items() if v)
torchfuse.enable({str(LIB_DIR)!r})
start = on()
torch.ops.torchfuse.set_enabled("adam", False)
with torchfuse.disabled():
    inside = (on(), rewrite_switch.on)
after = (on(), rewrite_switch.on)
off = (torchfuse.disable(), on(), rewrite_switch.on)
back = (torchfuse.enable(), on(), rewrite_switch.on)
print(json.dumps({{"start": start, "inside": inside, "after": after, "off": off, "back": back}}))
""", TORCHFUSE_OPS="layer_norm,adam")
    assert out["start"] == ["adam", "layer_norm"], out
    assert out["inside"] == [[], False] and out["after"] == [["layer_norm"], True], out
    assert out["off"] == [True, [], False], out
    assert out["back"] == [True, ["adam", "layer_norm"], True], out


def test_modules_imported_before_enable_are_patched_at_enable():
    out = run(f"""
import json, torch, torch.optim
before = hasattr(torch.optim.Adam.__init__, "__wrapped__")
import torchfuse
torchfuse.enable({str(LIB_DIR)!r})
print(json.dumps({{"before": before, "after": hasattr(torch.optim.Adam.__init__, "__wrapped__")}}))
""")
    assert out == {"before": False, "after": True}


@requires_cuda
def test_enable_makes_an_unchanged_cuda_adamw_fused():
    out = run(f"""
import json, torch, torchfuse
torchfuse.enable({str(LIB_DIR)!r})
m = torch.nn.Linear(64, 32, device="cuda")
opt = torch.optim.AdamW(m.parameters())
m(torch.randn(8, 64, device="cuda")).sum().backward()
opt.step()
stats = json.loads(torch.ops.torchfuse.stats())["ops"]
print(json.dumps({{"fused": opt.param_groups[0]["fused"],
                  "served": sum(stats.get("_fused_adamw_", {{}}).get("kernels", {{}}).values())}}))
""")
    assert out["fused"] is True
    assert out["served"] == 1


def test_one_version_everywhere():
    """torchfuse.__version__ is the one written: the wheel's metadata reads it (pyproject's
    dynamic version), and the Rust crates carry the same."""
    import re
    import tomllib

    out = run("import json, torchfuse; print(json.dumps(torchfuse.__version__))")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["dynamic"] == ["version"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "torchfuse.__version__"}
    for cargo in (ROOT / "Cargo.toml", ROOT / "preload" / "Cargo.toml"):
        assert re.search(r'^version = "([^"]+)"', cargo.read_text(), re.M).group(1) == out, cargo
