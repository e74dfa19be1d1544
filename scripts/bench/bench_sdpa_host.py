"""Host µs against GPU µs of one attention call, forward and forward + backward, per SDPA backend,
at the shapes the bench models' layers call (bench_host.py's tiny shapes pick other backends).
Host time: the calls are queued behind a GPU sleep long enough to cover them, so the wall time of
issuing them is the host's alone (dispatch, backend choice, cuDNN's graph lookup, the launches).
GPU time: CUDA events around the same calls, the GPU's alone where it is the longer. A step
whose GPU idles on the host (issue 40: the Llama-style model's GPU is busy for 14 of 49 ms)
pays the host column; a GPU-bound step pays the GPU column.

  python3 scripts/bench/bench_sdpa_host.py                    # stock's backends, one by one
  scripts/torchfuse python3 scripts/bench/bench_sdpa_host.py  # the same calls through torchfuse
"""
import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CALLS = 20
SHAPES = {  # name: (batch, query heads, kv heads, sequence, head dim)
    "llama-style layer [4, 16/8, 1024, 64]": (4, 16, 8, 1024, 64),
    "gpt2-b32 layer [32, 12, 1024, 64]": (32, 12, 12, 1024, 64),
}
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def host_and_gpu_us(fn):
    """(host µs, GPU µs) per call of fn over CALLS calls: issued behind a GPU sleep (so the
    host's issuing is timed alone), run back to back after it (so the events time the GPU's
    work alone)."""
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU clock: longer than the issuing below
    begin.record()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    host = (time.perf_counter() - t0) * 1e6 / CALLS
    end.record()
    end.synchronize()
    return host, begin.elapsed_time(end) * 1e3 / CALLS


def backend_context(backend):
    return sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    loaded = hasattr(torch.ops.torchfuse, "set_enabled")
    print(f"SDPA host and GPU µs per call, bf16, causal ({torch.cuda.get_device_name()}, "
          f"{'through torchfuse' if loaded else 'stock'}); host: queued behind a GPU sleep; "
          f"medians of {a.rounds} rounds, the backends' order rotated round by round")
    print("| layer | backend | fwd host | fwd GPU | fwd+bwd host | fwd+bwd GPU |")
    print("|---|---|---|---|---|---|")
    for name, (b, h, kvh, s, d) in SHAPES.items():
        q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, kvh, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        grad = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        gqa = kvh != h

        def forward():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

        def forward_backward():  # autograd.grad: no accumulation into .grad between calls
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            torch.autograd.grad(out, (q, k, v), grad)

        served = []
        for label, backend in BACKENDS.items():
            with backend_context(backend):
                try:
                    for _ in range(3):
                        forward_backward()
                    served.append(label)
                except RuntimeError as e:  # this backend does not take the call
                    print(f"| {name} | {label} | – | – | – | – |  ({str(e).splitlines()[0][:80]})")
        samples = {label: [] for label in served}
        for r in range(a.rounds):
            for label in served[r % len(served):] + served[:r % len(served)]:
                with backend_context(BACKENDS[label]):
                    samples[label].append(host_and_gpu_us(forward) + host_and_gpu_us(forward_backward))
        for label in served:
            cols = [statistics.median(col) for col in zip(*samples[label])]
            print(f"| {name} | {label} | " + " | ".join(f"{c:.1f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
