"""The unchanged training script under scripts/torchfuse (LD_PRELOAD and the optimizer hook)
on the GPU: substitutions are logged and the loss follows stock's."""
import re
import subprocess
import sys

from conftest import LIB_DIR, ROOT, clean_env, requires_cuda

pytestmark = requires_cuda


def losses(stdout):
    return [float(m.group(1)) for m in re.finditer(r"^step +\d+ loss ([0-9.]+)$", stdout, re.M)]


def test_training_under_the_launcher_matches_stock():
    # 32 x 128 = 4096 rows per LayerNorm: at the f32 kernel's measured threshold.
    args = [sys.executable, str(ROOT / "scripts" / "train_gpt.py"), "--steps", "40", "--batch", "32"]
    stock = subprocess.run(args, env=clean_env(), capture_output=True, text=True, timeout=600)
    ours = subprocess.run([str(ROOT / "scripts" / "torchfuse")] + args,
                          env=clean_env(TORCHFUSE_LIB_DIR=LIB_DIR, TORCHFUSE_LOG="info"),
                          capture_output=True, text=True, timeout=600)
    assert stock.returncode == 0, stock.stderr
    assert ours.returncode == 0, ours.stderr
    a, b = losses(stock.stdout), losses(ours.stdout)
    assert len(a) == len(b) >= 4
    for s, o in zip(a, b):
        assert abs(s - o) <= 0.02 * s, (a, b)
    assert b[-1] < 0.8 * b[0], "the model did not learn"
    log = ours.stderr
    # Autocast runs layer_norm in fp32; both directions are served by kernels.
    assert re.search(r"native_layer_norm f32 \[32, 128, 256\] -> kernel ln_fwd_\w+", log), log
    assert re.search(r"native_layer_norm_backward f32 \[32, 128, 256\] -> kernel ln_bwd_\w+", log), log
    assert re.search(r"substitution summary\n.*\n  native_layer_norm +[1-9]\d* +0 ", log), log
    # The script's AdamW(params) (stock: the foreach step) runs torchfuse's fused step.
    assert "AdamW: fused step instead of the foreach default" in log, log
    assert re.search(r"_fused_adamw_ f32 \[\d+, \d+\] -> kernel adam_f32_\w+", log), log
    assert re.search(r"\n  _fused_adamw_ +40 +0 ", log), log
    print(log[-3000:])
