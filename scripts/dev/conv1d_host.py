"""Host cost of one HF Conv1D's forward and backward, its own code (x.view, addmm, view: three
ops and three autograd nodes) against torchfuse::linear_cast's Conv1D form (one op, one node),
on CPU with tiny fp32 tensors so that dispatch and autograd, not kernels, set the time: without
autocast (as under FSDP2's bf16 parameters), and in a CPU bf16 autocast region a call (both
sides then cast the input, weight and bias alike). The rewrite's Python guard is timed on its
own (on CPU the rewritten forward stops at `x.is_cuda`): the same checks, in the same order.
Rounds interleaved; medians of per-call microseconds.

    TORCHFUSE_LIB_DIR=target/release python3 scripts/dev/conv1d_host.py
"""
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
import torch  # noqa: E402

import torchfuse  # noqa: E402

torchfuse.enable(os.environ.get("TORCHFUSE_LIB_DIR"))
from torchfuse import compositions, rewrites  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

torch.set_num_threads(1)
original = Conv1D.forward.__wrapped__
op = torch.ops.torchfuse.linear_cast.default
m = Conv1D(8, 8)
x = torch.randn(2, 4, 8, requires_grad=True)
grad = torch.ones(2, 4, 8)
untraced, cast_to = rewrites._untraced_call(torch), rewrites._linear_dtype(torch)
unchanged = compositions.Dependencies(original).unchanged
plain, module_getattr = (torch.Tensor, torch.nn.Parameter), torch.nn.Module.__getattr__


def guard():
    """The rewritten forward's checks, as it makes them for a CUDA call it serves."""
    params, own = m._parameters, m.__dict__
    weight, bias = params.get("weight"), params.get("bias")
    return (untraced() and type(x) is torch.Tensor and torch.is_grad_enabled() and x.dim() >= 2
            and x.is_contiguous() and type(weight) in plain and type(bias) in plain and weight.dim() == 2
            and type(own.get("nf")) is int and own["nf"] == weight.shape[1] and "weight" not in own
            and "bias" not in own and rewrites._plain_linear_class(type(m), None, module_getattr)
            and not torch._C._is_torch_function_mode_enabled() and not torch._C._len_torch_dispatch_stack()
            and not torch._C._get_tracing_state() and unchanged() and cast_to(x, weight, bias))


def under_autocast(fn):
    """fn's call in its own CPU bf16 autocast region (its cast cache emptied after each, as a
    step's forward casts each weight once)."""
    def call():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn()
        y.backward(grad.to(torch.bfloat16))
    return call


cases = {
    "Conv1D's code fwd+bwd": lambda: original(m, x).backward(grad),
    "linear_cast node fwd+bwd": lambda: op(x, m.weight, m.bias, torch.float32, True).backward(grad),
    "the rewrite's guard": guard,
    "autocast: Conv1D's code": under_autocast(lambda: original(m, x)),
    "autocast: linear_cast node": under_autocast(lambda: op(x, m.weight, m.bias, torch.bfloat16, True)),
}
assert guard() is not None
assert op(x, m.weight, m.bias, torch.float32, True).grad_fn.name() == "torchfuse::LinearCastBackward"
times = {name: [] for name in cases}
for _ in range(30):
    for name, fn in cases.items():
        for _ in range(50):
            fn()
        start = time.perf_counter()
        for _ in range(500):
            fn()
        times[name].append((time.perf_counter() - start) / 500 * 1e6)
for name, values in times.items():
    print(f"{name:28s} {statistics.median(values):7.2f} us")
stock, node, check, stock_autocast, node_autocast = (statistics.median(times[n]) for n in cases)
print(f"saved a Conv1D call: {stock - node - check:.2f} us ({stock / (node + check):.2f}x); "
      f"under autocast {stock_autocast - node_autocast - check:.2f} us "
      f"({stock_autocast / (node_autocast + check):.2f}x)")
