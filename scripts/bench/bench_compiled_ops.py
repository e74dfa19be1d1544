"""torchfuse's ops against what Inductor makes of the compositions they replace (issue 36: under
torch.compile, a rewrite should call our op only where it beats Inductor's own kernels).

For each composition HF's code runs, at the end-to-end bench models' shapes (GPT-2 124M and the
Llama-style model at their bench batches), forward + backward of:
- `inductor`: torch.compile of the original composition (HF's code, in the dtypes the model
  runs it in under bf16 autocast);
- `op compiled`: torch.compile of a function calling torchfuse's op (Inductor calls it as an
  extern kernel, as a compiled graph of a rewritten model would);
- `op eager`: the op called eagerly.
torchfuse::hf_rms_norm is CompositeImplicitAutograd: a compiled graph gets its decomposition
(aten::rms_norm), so its `op compiled` column measures Inductor on that. torchfuse::cross_entropy
has its own autograd kernel: a compiled graph of static shapes Rust would serve calls
torchfuse::cross_entropy_fwd / _bwd, torchfuse's kernels.
Each side's forward + backward over the input sets is captured in a CUDA graph and the replays
timed with CUDA events (a compiled callable's host work, guards and autograd bookkeeping, is a
few hundred µs a call and would otherwise be all that is measured); warm-up, medians of
interleaved rounds, input sets rotated over more memory than L2, copy bandwidth measured in the
same run.

Usage: bench_compiled_ops.py --lib-dir DIR [--out DIR]  (writes DIR/bench_compiled_ops.md)
"""
import math
import statistics

import torch
import torch.nn.functional as F

from bench_common import capture_graph, kernel_bench_setup, replay_times, write_report

BF16, FP32 = torch.bfloat16, torch.float32


def new_gelu_to_bf16(x):
    """GPT-2's MLP between its matmuls: NewGELU (fp32 under autocast, as torch.pow widens it),
    then the cast c_proj's matmul makes."""
    y = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x.float(), 3.0))))
    return y.to(BF16)


def hf_rms_norm(x, weight):
    hidden = x.to(FP32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * hidden.to(x.dtype)


def silu_mul(gate, up):
    return F.silu(gate) * up


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def rotary(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def causal_lm_loss(logits, labels):
    return F.cross_entropy(logits.float(), labels, ignore_index=-100)


def layer_norm(x, weight, bias):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, 1e-5)


def embedding(ids, weight):
    return F.embedding(ids, weight)


def cases():
    """(name, shape label, original, op call, make inputs, bytes one pass moves). An op call of
    None: an aten op torchfuse overrides, whose `op eager` is the original called eagerly (the
    override serving it) and which has no op of its own to compile."""
    ops = torch.ops.torchfuse
    r = lambda *s, dtype=BF16: torch.randn(*s, device="cuda", dtype=dtype)  # noqa: E731
    yield ("gelu_tanh (GPT-2 MLP)", "8192x3072", new_gelu_to_bf16, lambda x: ops.gelu_tanh(x, BF16),
           lambda: (r(8192, 3072).requires_grad_(),), 2 * 8192 * 3072 * 2)
    for rows, hidden in ((4096, 1024), (4096, 4096)):
        yield ("hf_rms_norm", f"{rows}x{hidden}", hf_rms_norm, lambda x, w: ops.hf_rms_norm(x, w, 1e-6),
               lambda rows=rows, hidden=hidden: (r(rows, hidden).requires_grad_(), r(hidden).requires_grad_()),
               2 * rows * hidden * 2)
    for rows, width in ((4096, 2816), (4096, 11008)):
        yield ("silu_mul", f"{rows}x{width}", silu_mul, ops.silu_mul,
               lambda rows=rows, width=width: (r(rows, width).requires_grad_(), r(rows, width).requires_grad_()),
               3 * rows * width * 2)
    b, s, d = 4, 1024, 64
    yield ("rotary", f"q {b}x16x{s}x{d}, k {b}x8x{s}x{d}", rotary,
           lambda q, k, c, sn: ops.rotary(q, k, c, sn, 1),
           lambda: (r(b, 16, s, d).requires_grad_(), r(b, 8, s, d).requires_grad_(), r(b, s, d), r(b, s, d)),
           2 * b * 24 * s * d * 2)
    for rows, vocab in ((4096, 32000), (8192, 50304)):
        yield ("cross_entropy (causal-LM loss)", f"{rows}x{vocab}", causal_lm_loss,
               lambda logits, labels: ops.cross_entropy(logits, labels, 1, -100, 0.0, FP32),
               lambda rows=rows, vocab=vocab: (r(rows, vocab).requires_grad_(),
                                                torch.randint(0, vocab, (rows,), device="cuda")),
               rows * vocab * 2)
    # GPT-2's aten ops under autocast (fp32: LayerNorm and embedding are autocast's fp32 ops),
    # at B8 and B32 x 1024 tokens.
    for rows in (8192, 32768):
        yield ("layer_norm (GPT-2)", f"{rows}x768", layer_norm, None,
               lambda rows=rows: (r(rows, 768, dtype=FP32).requires_grad_(), r(768, dtype=FP32).requires_grad_(),
                                  r(768, dtype=FP32).requires_grad_()),
               2 * rows * 768 * 4)
        yield ("embedding (GPT-2 wte)", f"{rows} of 50304x768", embedding, None,
               lambda rows=rows: (torch.randint(0, 50304, (rows,), device="cuda"),
                                  r(50304, 768, dtype=FP32).requires_grad_()),
               2 * rows * 768 * 4)


def fwd_bwd(fn):
    """One forward and backward of fn: every floating input that requires grad gets one. The
    incoming gradients are drawn once per output shape (at warm-up), not timed."""
    incoming = {}

    def grad_for(o):
        key = (tuple(o.shape), o.dtype)
        if key not in incoming:
            incoming[key] = torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o)
        return incoming[key]

    def step(*args):
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        leaves = [a for a in args if a.requires_grad]
        return torch.autograd.grad(outs, leaves, [grad_for(o) for o in outs])
    return step


def main():
    args, bandwidth = kernel_bench_setup()
    rows = [f"# torchfuse's ops against Inductor's kernels for the same compositions ({torch.cuda.get_device_name()})",
            "", f"copy bandwidth {bandwidth:.2f} TB/s; forward + backward, GPU µs (CUDA-graph replays, medians of interleaved rounds); "
            "ratio = inductor / op compiled (> 1: our op is faster inside a compiled graph); for an aten op "
            "torchfuse overrides (no op compiled: nan), inductor / op eager", "",
            "| composition | shape | inductor | op compiled | op eager | ratio | one pass of the data at copy bandwidth |",
            "|---|---|---|---|---|---|---|"]
    for name, shape, original, op_call, make, bytes_once in cases():
        torch._dynamo.reset()
        inputs = [make() for _ in range(3)]
        sides = {"inductor": fwd_bwd(torch.compile(original))}
        if op_call:
            sides["op compiled"] = fwd_bwd(torch.compile(op_call))
        sides["op eager"] = fwd_bwd(op_call or original)  # an aten op: the override serves it
        graphs = {}
        for label, fn in sides.items():  # compiles, warms up, captures
            try:
                graphs[label] = capture_graph(fn, inputs)
            except RuntimeError as e:
                print(f"  {name} {shape} {label}: no graph ({str(e).splitlines()[0]})", flush=True)
        times = replay_times(graphs, len(inputs), rounds=5, reps=4)
        del graphs, inputs
        if len(times) < len(sides):
            continue
        us = {label: statistics.median(t) for label, t in times.items()}
        compiled = us.get("op compiled", us["op eager"])  # an aten override: its eager call
        rows.append(f"| {name} | {shape} | {us['inductor']:.1f} | {us.get('op compiled', float('nan')):.1f} | "
                    f"{us['op eager']:.1f} | {us['inductor'] / compiled:.2f}x | "
                    f"{bytes_once / (bandwidth * 1e12) * 1e6:.1f} |")
    write_report(rows, args.out, "bench_compiled_ops.md")


if __name__ == "__main__":
    main()
