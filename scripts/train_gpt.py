"""A small GPT trained the ordinary way: nothing in here knows about torchfuse.

nn.Embedding, nn.LayerNorm, F.scaled_dot_product_attention and AdamW (fused on CUDA, as
nanoGPT does), bf16 autocast on CUDA. Data: token sequences from a fixed random Markov
chain, so the loss has something to learn (or, with --data random, uniform random tokens made
on the device up front, for timing). Prints the loss every few steps and at the end, and the
median time of the steps after --warmup (CUDA events around each step).
"""
import argparse
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, ctx, d, layers, heads):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def markov_batches(vocab, batch, seq, device, seed):
    g = torch.Generator().manual_seed(seed)
    # Each token has 4 likely successors: learnable structure.
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    while True:
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(seq):
            pick = torch.randint(0, 4, (batch,), generator=g)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        tokens = tokens.to(device)
        yield tokens[:, :-1], tokens[:, 1:]


def random_batches(vocab, batch, seq, device, seed, count=8):
    """A few batches of uniform random tokens made up front, cycled: no host work per step."""
    g = torch.Generator(device=device).manual_seed(seed)
    made = [torch.randint(0, vocab, (batch, seq + 1), generator=g, device=device) for _ in range(count)]
    i = 0
    while True:
        tokens = made[i % count]
        i += 1
        yield tokens[:, :-1], tokens[:, 1:]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", choices=["markov", "random"], default="markov")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the step time")
    a = p.parse_args()

    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    model = GPT(a.vocab, a.seq, a.d, a.layers, a.heads).to(device)
    # As most scripts write it: PyTorch's default (foreach) step, unless scripts/torchfuse's hook
    # makes it the fused one.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    batches = random_batches if a.data == "random" else markov_batches
    data = batches(a.vocab, a.batch, a.seq, device, a.seed)
    timed = device.type == "cuda"
    events = []
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    print(f"training on {device}: {sum(p.numel() for p in model.parameters())/1e6:.2f}M params, "
          f"{a.steps} steps of {a.batch}x{a.seq} tokens")
    start = time.time()
    for step in range(1, a.steps + 1):
        x, y = next(data)
        if timed:
            events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            events[-1][0].record()
        with autocast:
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if timed:
            events[-1][1].record()
        if step % 10 == 0 or step == 1 or step == a.steps:
            print(f"step {step:4d} loss {loss.item():.6f}")
    if timed:
        torch.cuda.synchronize()
        ms = [start_.elapsed_time(end_) for start_, end_ in events[a.warmup:]]
        if ms:
            print(f"step time median {statistics.median(ms):.3f} ms over {len(ms)} steps "
                  f"({a.batch * a.seq / statistics.median(ms) * 1e3:.0f} tokens/s)")
    print(f"final loss {loss.item():.6f} (uniform would be {math.log(a.vocab):.3f}) in {time.time() - start:.1f}s")


if __name__ == "__main__":
    main()
