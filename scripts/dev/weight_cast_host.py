"""Issue 40: what the linear node casting its weight itself (`weight_cast`) saves the host, per
Linear: host µs of one nn.Linear's forward and backward under bf16 autocast at a tiny shape (the
GPU's work negligible), its fp32 weight cast by the node (on) or by autocast with a
ToCopyBackward0 node (off); interleaved rounds in one process, medians of the least of 15
timings of 100 calls.

  TORCHFUSE_LIB_DIR=DIR python3 scripts/dev/weight_cast_host.py [--rounds 5]
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    import torch

    import torchfuse
    if not torchfuse.enable():
        raise SystemExit("torchfuse could not be loaded")
    torch.ops.torchfuse._serve_below_thresholds(True)
    from bench_host import host_us
    cases = {}
    for bias in (False, True):
        m = torch.nn.Linear(64, 64, bias=bias).cuda()
        x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)

        def call(m=m, x=x, dy=dy):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = m(x)
            y.backward(dy)
        cases[f"Linear 64->64 bias={bias}, fwd+bwd"] = call
    times = {(c, on): [] for c in cases for on in (True, False)}
    for r in range(a.rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            torch.ops.torchfuse.set_enabled("weight_cast", on)
            for name, fn in cases.items():
                for _ in range(20):
                    fn()
                times[(name, on)].append(host_us(fn))
    print("| call | weight_cast on µs | off µs | saved µs |\n|---|---|---|---|")
    for name in cases:
        on, off = statistics.median(times[(name, True)]), statistics.median(times[(name, False)])
        print(f"| {name} | {on:.1f} | {off:.1f} | {off - on:.1f} |")


if __name__ == "__main__":
    main()
