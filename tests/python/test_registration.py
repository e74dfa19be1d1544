"""Which aten kernels torchfuse registers, per configuration (runs without a GPU: the
dispatcher table is the same on CPU-only machines)."""
import json

import pytest

from conftest import ROOT, check, run_python

# Every aten op torchfuse overrides at the CUDA key, by toggle (docs/architecture.md).
OPS = {
    "layer_norm": ["native_layer_norm", "native_layer_norm_backward"],
    "rms_norm": ["_fused_rms_norm", "_fused_rms_norm_backward"],
    "embedding": ["embedding", "embedding_dense_backward"],
    "adam": ["_fused_adam_", "_fused_adam_.tensor_lr", "_fused_adamw_", "_fused_adamw_.tensor_lr"],
    "sdpa": ["_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"],
}
ALL_ATEN = [op for ops in OPS.values() for op in ops]

DUMP = """
import json, torch
ours = {}
for op in %r:
    lines = torch._C._dispatch_dump("aten::" + op).splitlines()
    cuda = [l for l in lines if l.startswith("CUDA:")]
    ours[op] = any("torchfuse" in l for l in cuda)
print("RESULT " + json.dumps(ours))
""" % (ALL_ATEN,)


def result(proc):
    """What a child process printed on its last `RESULT ` line, as JSON."""
    check(proc)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[7:])


def registered(proc):
    return {op for op, ours in result(proc).items() if ours}


def test_stock_torch_has_none_of_ours():
    assert registered(run_python(DUMP)) == set()


def test_all_ops_registered_by_default():
    assert registered(run_python(DUMP, load_library=True)) == set(ALL_ATEN)


@pytest.mark.parametrize("setting,expected", [
    ("layer_norm", ["layer_norm"]),
    ("layer_norm,adam", ["layer_norm", "adam"]),
    ("-sdpa", ["layer_norm", "rms_norm", "embedding", "adam"]),
    ("none", []),
])
def test_torchfuse_ops_selects_exactly_those(setting, expected):
    want = {op for t in expected for op in OPS[t]}
    assert registered(run_python(DUMP, load_library=True, TORCHFUSE_OPS=setting)) == want


# The library and the Python hooks read TORCHFUSE alike: off, on, or (a bad value) on with a
# warning.
SWITCH = "import sys; sys.path.insert(0, %r); from torchfuse import _hooks; print('OFF', _hooks.switched_off())\n"


@pytest.mark.parametrize("value,on", [("0", False), ("false", False), ("OFF", False), ("No", False),
                                      ("1", True), ("true", True), ("yes", True), ("maybe", True)])
def test_torchfuse_switch_spellings(value, on):
    from conftest import ROOT
    proc = run_python(SWITCH % str(ROOT / "python") + DUMP, load_library=True, TORCHFUSE=value)
    assert registered(proc) == (set(ALL_ATEN) if on else set())
    assert f"OFF {not on}" in proc.stdout
    warnings = [l for l in proc.stderr.splitlines() if "WARN" in l]
    assert len(warnings) == (value == "maybe"), proc.stderr


def test_unknown_op_name_warns_once_and_keeps_the_default():
    """A typo must not switch every other op off: the whole setting falls back to `all`."""
    for setting in ("layer_norm,atention", "layernorm"):
        proc = run_python(DUMP, load_library=True, TORCHFUSE_OPS=setting)
        assert registered(proc) == set(ALL_ATEN)
        warnings = [l for l in proc.stderr.splitlines() if "WARN" in l]
        assert len(warnings) == 1, proc.stderr
        assert "using all" in warnings[0] and "rms_norm" in warnings[0]


def test_a_python_spelled_log_level_still_shows_warnings():
    """TORCHFUSE_LOG=warning (Python's name) is warn: the warning about a bad op name shows."""
    proc = run_python(DUMP, load_library=True, TORCHFUSE_OPS="bogus", TORCHFUSE_LOG="warning")
    assert "bogus" in proc.stderr and "using all" in proc.stderr, proc.stderr
    proc = run_python(DUMP, load_library=True, TORCHFUSE_OPS="bogus", TORCHFUSE_LOG="chatty")
    assert "bogus" in proc.stderr and "TORCHFUSE_LOG=\"chatty\"" in proc.stderr, proc.stderr


def test_override_warning_goes_to_our_debug_log_not_stderr():
    quiet = check(run_python("pass", load_library=True))
    assert "Overriding a previously registered kernel" not in quiet.stderr
    assert quiet.stderr.strip() == "", quiet.stderr
    loud = check(run_python("pass", load_library=True, TORCHFUSE_LOG="debug"))
    assert "DEBUG torch: " in loud.stderr and "Overriding" in loud.stderr


def test_control_ops_from_python():
    code = """
import json, torch
stats = json.loads(torch.ops.torchfuse.stats())
print("ENABLED", stats["enabled"])
print("OFF", torch.ops.torchfuse.set_enabled("layer_norm", False))
print("ON", torch.ops.torchfuse.set_enabled("layer_norm", True))
print("NOTREG", torch.ops.torchfuse.set_enabled("adam", True))
print("ALLOFF", torch.ops.torchfuse.set_enabled("all", False), json.loads(torch.ops.torchfuse.stats())["enabled"]["layer_norm"])
print("ALLON", torch.ops.torchfuse.set_enabled("ALL", True), json.loads(torch.ops.torchfuse.stats())["enabled"]["layer_norm"])
try:
    torch.ops.torchfuse.set_enabled("attention", True)
except RuntimeError as e:
    print("ERR", e)
ops = torch.ops.torchfuse
print("ASKED", ops.enabled("LAYER_NORM"), ops.enabled("adam"), ops.set_enabled("layer_norm", False),
      ops.enabled("layer_norm"), ops.set_enabled("layer_norm", True), ops.enabled("layer_norm"))
try:
    ops.enabled("attention")
except RuntimeError as e:
    print("ASKERR", e)
"""
    proc = check(run_python(code, load_library=True, TORCHFUSE_OPS="layer_norm"))
    out = proc.stdout
    assert "'layer_norm': True" in out and "'adam': False" in out
    assert "OFF False" in out and "ON True" in out and "NOTREG False" in out
    # `all` (as TORCHFUSE_OPS spells it): every registered op, no warning for the others.
    assert "ALLOFF False False" in out and "ALLON True True" in out
    assert "ERR torchfuse.set_enabled: unknown op 'attention' (valid: all, " in out
    # enabled(): registered and switched on now (adam is not registered).
    assert "ASKED True False False False True True" in out
    assert "ASKERR torchfuse.enabled: unknown op 'attention' (valid: layer_norm, " in out
    assert proc.stderr.count("WARN") == 1, proc.stderr  # adam's, not registered


def test_log_file_and_process_tag(tmp_path):
    log = tmp_path / "tf.log"
    check(run_python("pass", load_library=True, TORCHFUSE_LOG="info", TORCHFUSE_LOG_FILE=log, RANK=3))
    text = log.read_text()
    assert "rank=3" in text and "pid=" in text
    assert "overrides registered for: layer_norm, rms_norm, embedding, adam, sdpa" in text


def test_an_idle_process_says_so_at_info():
    """A process where no call reached torchfuse (CPU tensors, no GPU) ends with one info line
    saying nothing was served; under TORCHFUSE=0 the load line says it instead."""
    code = "import torch; torch.nn.functional.layer_norm(torch.randn(2, 8), (8,))"
    idle = check(run_python(code, load_library=True, TORCHFUSE_LOG="info"))
    assert "nothing served in this process: no call reached an enabled op" in idle.stderr, idle.stderr
    off = check(run_python(code, load_library=True, TORCHFUSE_LOG="info", TORCHFUSE="0"))
    assert "nothing served" not in off.stderr and "TORCHFUSE=0: loaded, nothing registered" in off.stderr


# What the op catalog (src/catalog.toml) declares, as the build reads it.
def catalog_entries():
    import tomllib
    return tomllib.loads((ROOT / "src" / "catalog.toml").read_text())["entry"]


OWN = """
import json, torch
names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("torchfuse::"))
schemas = {n: str(torch._C._dispatch_find_schema_or_throw(n, "").schema()) for n in names}
keys = {}
for op in %r:
    lines = torch._C._dispatch_dump("aten::" + op)  # op with its overload, as the catalog names it
    keys[op] = sorted(l.split(":")[0] for l in lines.splitlines() if "registered at torchfuse/" in l)
print("RESULT " + json.dumps({"schemas": schemas, "keys": keys}))
"""

CONTROL_OPS = {"set_enabled", "enabled", "stats", "reset_stats", "doctor", "note", "_serve_below_thresholds", "_force_variant"}


def test_the_catalog_defines_every_own_op_and_registers_each_override_at_its_key():
    """torchfuse's own ops are exactly the catalog's schemas (as the dispatcher parses them), and
    each aten override is registered at the dispatch key its entry names, at no other."""
    import torch
    entries = catalog_entries()
    aten = {e["op"]: e["key"] for e in entries if e.get("key") not in (None, "stub")}
    got = result(run_python(OWN % (sorted(aten),), load_library=True))
    want = {}
    for e in entries:
        for schema in e.get("schemas", []):
            parsed = torch._C.parse_schema("torchfuse::" + schema)
            want[f"torchfuse::{parsed.name.split('::')[-1]}"] = str(parsed)
    own = {n: s for n, s in got["schemas"].items() if n.split("::")[1] not in CONTROL_OPS}
    assert own == want
    assert got["keys"] == {op: [key] for op, key in aten.items()}
