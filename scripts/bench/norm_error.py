"""How close torchfuse's LayerNorm is to float64, beside stock's own error, at the shapes real
models train with: the question behind the early loss difference the end-to-end records trace
to LayerNorm (docs/bench/train/h100-models-issue24.md). The tests only hold ours within twice
stock's error; this prints the ratio.

For each shape and input dtype: y = layer_norm(x, w, b) and its gradients dx, dw, db for one
random upstream gradient, from torchfuse's kernel and from stock's (the `layer_norm` toggle
off), each as ||out - ref|| / ||ref|| against the same computation in float64 on the same
values, and ours / stock's. Inputs as the models see them: activations of spread 1-4 with an
offset, weights near 1, biases near 0. One process, torchfuse loaded as a library.

  python3 scripts/bench/norm_error.py --lib-dir .dev [--shapes 8192x768,4096x1024] [--seeds 3] [--force]
"""
import argparse
import json
import statistics
from pathlib import Path

import torch

from bench_common import rel_err

# GPT-2 124M and BERT-base (B8 S1024 / B8 S512 rows, 768 wide), a Llama-style width.
SHAPES = "8192x768,4096x768,4096x1024"


def outputs(x, w, b, dy):
    """y, dx, dw, db of F.layer_norm over the last dim."""
    x, w, b = (t.detach().requires_grad_(True) for t in (x, w, b))
    y = torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, 1e-5)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), dy.to(y.dtype))
    return y.detach(), dx, dw, db


def fused_calls():
    """Calls torchfuse's kernels served so far, over every op."""
    return sum(op.get("fused", 0) for op in json.loads(torch.ops.torchfuse.stats())["ops"].values())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib-dir", default=str(Path(__file__).resolve().parents[2] / ".dev"))
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cpu: both sides are stock (a dry run)")
    p.add_argument("--force", action="store_true", help="torchfuse's kernels at every shape (else the registry's choice)")
    a = p.parse_args()
    torch.ops.load_library(str(Path(a.lib_dir) / "libtorchfuse.so"))
    torch.ops.torchfuse._serve_below_thresholds(a.force)
    names = ("y", "dx", "dw", "db")
    print("| shape | dtype | output | ours | stock | ours / stock (median over seeds) | torchfuse kernels a seed |")
    print("|---|---|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        rows, cols = map(int, shape.split("x"))
        for dtype in (getattr(torch, d) for d in a.dtypes.split(",")):
            errs, served = {n: [] for n in names}, []
            for seed in range(a.seeds):
                g = torch.Generator(device=a.device).manual_seed(seed)
                spread = 1 + 3 * torch.rand(rows, 1, device=a.device, generator=g)
                x = (torch.randn(rows, cols, device=a.device, generator=g) * spread + 0.5).to(dtype)
                w = (1 + 0.1 * torch.randn(cols, device=a.device, generator=g)).to(dtype)
                b = (0.1 * torch.randn(cols, device=a.device, generator=g)).to(dtype)
                dy = torch.randn(rows, cols, device=a.device, generator=g)
                ref = outputs(x.double(), w.double(), b.double(), dy.double())
                before = fused_calls()
                ours = outputs(x, w, b, dy)
                served.append(fused_calls() - before)  # 0: the registry left this shape to stock
                torch.ops.torchfuse.set_enabled("layer_norm", False)
                try:
                    stock = outputs(x, w, b, dy)
                finally:
                    torch.ops.torchfuse.set_enabled("layer_norm", True)
                for n, o, s, r in zip(names, ours, stock, ref):
                    errs[n].append((rel_err(o, r), rel_err(s, r)))
            for n in names:
                o = statistics.median(e[0] for e in errs[n])
                s = statistics.median(e[1] for e in errs[n])
                ratio = statistics.median(e[0] / e[1] if e[1] > 0 else float("nan") for e in errs[n])
                print(f"| {shape} | {str(dtype)[6:]} | {n} | {o:.2e} | {s:.2e} | {ratio:.2f} | {min(served)} |",
                      flush=True)


if __name__ == "__main__":
    main()
