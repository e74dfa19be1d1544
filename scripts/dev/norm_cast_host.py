"""Host time of norm_cast's layer wrapper (python/torchfuse/rewrites.py, `_norm_cast_forward`),
on CPU: a tiny HF GPT-2 block's forward with CUDA bf16 autocast flagged on (the wrapper's guards
pass; the CPU tensors then make each switched norm run its own forward, so what is timed is the
wrapper alone, not the op). Interleaved rounds, the minimum per side of each round's mean.

  TORCHFUSE_LIB_DIR=target/release python3 scripts/dev/norm_cast_host.py [--rounds 10] [--calls 500]
"""
import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402

import torchfuse  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--calls", type=int, default=500)
    a = p.parse_args()
    torchfuse.enable(os.environ.get("TORCHFUSE_LIB_DIR"))
    import transformers.models.gpt2.modeling_gpt2 as G
    from transformers import GPT2Config, GPT2LMHeadModel

    wrapper = G.GPT2Block.forward
    assert wrapper.__code__.co_name == "norm_cast", "norm_cast's rewrite is not on GPT2Block"
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=128, n_positions=32))
    block, x = model.transformer.h[0], torch.randn(1, 8, 64)
    set_enabled = torch.ops.torchfuse.set_enabled

    def side(forward, autocast, toggle):
        def run():
            G.GPT2Block.forward = forward
            torch.set_autocast_enabled("cuda", autocast)
            torch.set_autocast_dtype("cuda", torch.bfloat16)
            set_enabled("norm_cast", toggle)
            start = time.perf_counter()
            for _ in range(a.calls):
                block(x)
            return (time.perf_counter() - start) / a.calls * 1e6
        return run

    sides = {
        "without the wrapper": side(wrapper.__wrapped__, True, True),
        "wrapper, autocast off": side(wrapper, False, True),
        "wrapper, toggle off": side(wrapper, True, False),
        "wrapper, both norms switched": side(wrapper, True, True),
    }
    best = {name: float("inf") for name in sides}
    with torch.no_grad():
        for _ in range(a.rounds):
            for name, run in sides.items():
                best[name] = min(best[name], run())
    G.GPT2Block.forward = wrapper
    torch.set_autocast_enabled("cuda", False)
    base = best["without the wrapper"]
    for name, us in best.items():
        print(f"{name:32s} {us:8.1f} us  ({us - base:+.1f})")


if __name__ == "__main__":
    main()
