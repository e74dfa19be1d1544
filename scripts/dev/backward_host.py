"""Issue 40: does a backward cost the host more with torchfuse loaded, and where? Host µs per
fwd+bwd call at tiny shapes (the GPU's work is negligible), for calls torchfuse does not serve
(a cast, a mul) and calls it does (LayerNorm), in fresh processes: stock, the library loaded,
the library loaded with every op switched off. Median over interleaved rounds of the least of
15 timings of 100 calls.

  TORCHFUSE_LIB_DIR=DIR python3 scripts/dev/backward_host.py [--rounds 3]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def cases(torch):
    F, cuda = torch.nn.functional, dict(device="cuda")
    x = torch.randn(8, 64, **cuda, requires_grad=True)
    w, b = (torch.randn(64, **cuda, requires_grad=True) for _ in range(2))
    g32, g16 = torch.randn(8, 64, **cuda), torch.randn(8, 64, **cuda).bfloat16()
    return {
        "mul fwd+bwd": lambda: (x * 2.0).backward(g32),
        "to bf16 fwd+bwd": lambda: x.to(torch.bfloat16).backward(g16),
        "mul, to bf16 fwd+bwd": lambda: (x * 2.0).to(torch.bfloat16).backward(g16),
        "layer_norm fwd+bwd": lambda: F.layer_norm(x, (64,), w, b).backward(g32),
        "layer_norm, to bf16 fwd+bwd": lambda: F.layer_norm(x, (64,), w, b).to(torch.bfloat16).backward(g16),
        "autograd.grad of mul": lambda: torch.autograd.grad((x * 2.0,), (x,), (g32,)),
    }


def worker(side):
    import torch
    if side != "stock":
        torch.ops.load_library(os.path.join(os.environ["TORCHFUSE_LIB_DIR"], "libtorchfuse.so"))
        torch.ops.torchfuse._serve_below_thresholds(True)
        if side == "all off":
            for op in json.loads(torch.ops.torchfuse.stats())["enabled"]:
                torch.ops.torchfuse.set_enabled(op, False)
    from bench_host import host_us  # the least of 15 timings of 100 calls, as bench_host's table
    out = {}
    for name, fn in cases(torch).items():
        for _ in range(20):
            fn()
        out[name] = host_us(fn)
    print(json.dumps(out))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker")
    a = p.parse_args()
    if a.worker:
        return worker(a.worker)
    sides = ["stock", "torchfuse", "all off"]
    runs = {s: [] for s in sides}
    for _ in range(a.rounds):
        for s in sides:
            out = subprocess.run([sys.executable, __file__, "--worker", s], check=True,
                                 capture_output=True, text=True).stdout
            runs[s].append(json.loads(out.strip().splitlines()[-1]))
    print("| call | " + " | ".join(sides) + " |\n|---|" + "---|" * len(sides))
    for name in runs["stock"][0]:
        print(f"| {name} | " + " | ".join(f"{statistics.median(r[name] for r in runs[s]):.1f}" for s in sides) + " |")


if __name__ == "__main__":
    main()
