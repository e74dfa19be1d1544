"""Host time of a fused AdamW step over FSDP2's DTensor params, through DTensor's dispatch (stock)
against the same call on the local shards (torchfuse's `_fused_adam_on_local_shards`, here
allowed on CPU), and whether both give the same bits. A small HF GPT-2 (12 layers, 64 wide),
`fully_shard` per block and at the root with bf16 compute, in a world of one process (gloo,
CPU): no GPU needed, what is timed is the host's work. Rounds interleave the two sides.

  TORCHFUSE_LIB_DIR=target/release python3 scripts/dev/fsdp2_adam_host.py [--rounds 5]
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torchfuse  # noqa: E402


def build():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=64, n_head=4, n_positions=64, vocab_size=512))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.transformer.h:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    ids = torch.randint(0, 512, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=15)
    a = p.parse_args()
    torchfuse.enable(os.environ.get("TORCHFUSE_LIB_DIR"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29541"),
                      RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    import torch.optim.adam as adam
    from torchfuse import optim
    installed = adam._fused_adam  # torchfuse's, for CUDA DTensors
    stock = installed.__wrapped__
    local = optim._fused_adam_on_local_shards(torch, stock, device_type="cpu")
    sides = {"stock (DTensor dispatch)": stock, "local shards": local}

    # Same bits: two identical models, one step each way.
    (m1, o1), (m2, o2) = build(), build()
    adam._fused_adam = stock
    o1.step()
    adam._fused_adam = local
    o2.step()
    same = all(torch.equal(x.to_local(), y.to_local()) for x, y in zip(m1.parameters(), m2.parameters()))

    model, opt = build()
    times = {name: [] for name in sides}
    for _ in range(a.rounds):
        for name, fn in sides.items():
            adam._fused_adam = fn
            t0 = time.perf_counter()
            for _ in range(a.steps):
                opt.step()
            times[name].append((time.perf_counter() - t0) * 1e3 / a.steps)
    adam._fused_adam = installed
    n = sum(1 for _ in model.parameters())
    print(f"fused AdamW step over {n} FSDP2 DTensor params (world of one, CPU), ms per step, "
          f"median of {a.rounds} interleaved rounds of {a.steps}:")
    for name, ts in times.items():
        print(f"  {name}: {statistics.median(ts):.2f} ms")
    print(f"  one step each way from the same start gives the same bits: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
