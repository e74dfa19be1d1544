"""scripts/dev/norm_registry_from_sweep.py on a made-up sweep (no GPU needed): which candidate each
bucket gets, from which timings, and that what it writes is a registry of the expected variants."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")

ROOT = Path(__file__).resolve().parents[2]
META = {"device": "test GPU", "torch": "test", "copy_tb_s": 3.0, "command": "made up"}


def row(op, shape, stock_us, candidates, graph=None):
    r = {"op": op, "dtype": "bfloat16", "shape": shape, "stock_us": stock_us, "torchfuse_us": stock_us,
         "candidates": candidates}
    if graph is not None:
        stock_graph, graph_candidates = graph
        r.update(stock_graph_us=stock_graph, torchfuse_graph_us=stock_graph, graph_candidates=graph_candidates)
    return r


def generate(tmp_path, rows):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"meta": META, "rows": rows}))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "dev" / "norm_registry_from_sweep.py"), str(sweep)],
                         capture_output=True, text=True, check=True).stdout
    return out, {v["name"]: v for v in tomllib.loads(out)["variant"]}


def test_graph_timings_decide_where_the_sweep_has_them(tmp_path):
    # Per call t32x4 looks fastest; as graph replays t96x2 is, and the replays decide.
    rows = [row("ln_bwd", "16384x768", 100.0,
                {"sweep_ln_bwd_t32x4_e24_p0": 40.0, "sweep_ln_bwd_t96x2_e8_p0": 45.0},
                graph=(90.0, {"sweep_ln_bwd_t32x4_e24_p0": 39.0, "sweep_ln_bwd_t96x2_e8_p0": 36.0}))]
    text, variants = generate(tmp_path, rows)
    assert list(variants) == ["ln_bwd_16bit_h768_t96x2_e8"]
    v = variants["ln_bwd_16bit_h768_t96x2_e8"]
    assert v["params"] == {"THREADS_PER_ROW": 96, "ROWS_PER_BLOCK": 2, "ELEMS_PER_THREAD": 8, "PREFETCH": 0,
                           "STREAM": 1}
    assert v["hidden"] == [1, 768] and v["dtypes"] == ["bf16", "f16"]
    assert "stock 90.0 us, this 36.0 us" in text


def test_shared_memory_accumulators_need_the_margin(tmp_path):
    # 8192: SMEM_ACC 5% faster than the best register-held candidate -> chosen; 16384: 1% -> not.
    rows = [row("rms_bwd", "8192x8192", 300.0, {},
                graph=(300.0, {"sweep_rms_bwd_t512x1_e16_p0": 160.0, "sweep_rms_bwd_t384x1_e24_p0_s2": 152.0})),
            row("rms_bwd", "4096x16384", 300.0, {},
                graph=(300.0, {"sweep_rms_bwd_t1024x1_e16_p0": 160.0, "sweep_rms_bwd_t1024x1_e16_p0_s1": 158.4}))]
    _, variants = generate(tmp_path, rows)
    assert sorted(variants) == ["rms_bwd_16bit_h16384_t1024x1_e16", "rms_bwd_16bit_h8192_t384x1_e24_s2"]
    assert variants["rms_bwd_16bit_h8192_t384x1_e24_s2"]["params"] == {
        "THREADS_PER_ROW": 384, "ROWS_PER_BLOCK": 1, "ELEMS_PER_THREAD": 24, "PREFETCH": 0, "SMEM_ACC": 1,
        "MIN_BLOCKS": 2}
    assert "SMEM_ACC" not in variants["rms_bwd_16bit_h16384_t1024x1_e16"]["params"]


def test_per_call_timings_without_replays_and_stock_where_nothing_wins(tmp_path):
    rows = [row("rms_fwd", "16384x2048", 60.0, {"sweep_rms_fwd_t128x1_e16_p1": 50.0}),
            row("ln_fwd", "16384x4096", 100.0, {"sweep_ln_fwd_t128x1_e32_p1": 98.5})]
    text, variants = generate(tmp_path, rows)
    assert list(variants) == ["rms_fwd_16bit_h2048_t128x1_e16_pf"]
    assert "layer_norm_fwd 16bit hidden 2049..4096: stock" in text
