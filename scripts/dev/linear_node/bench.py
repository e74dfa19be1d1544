"""Host cost of one Linear's forward and backward: stock's decomposition (autocast's casts as
separate ops, then linear's t/reshape/addmm/view, each an autograd node) against the prototype
one-node op (linear.cpp: the casts and the matmul under one node, the same values and
gradients bitwise), on CPU with tiny tensors so that dispatch and autograd, not kernels, set
the time. fp64 -> fp32 stands in for autocast's fp32 -> bf16 (the same ops; CPU bf16 matmuls
would add kernel time). Build first: ./build.sh. Rounds interleaved; medians.

    python3 scripts/dev/linear_node/bench.py
"""
import statistics
import time

import torch
import torch.nn.functional as F

torch.ops.load_library("/tmp/linear_node/proto.so")
torch.set_num_threads(1)
linear_node = torch.ops.proto.linear_node
lean_node = torch.ops.proto.linear_node_lean  # a plain autograd Node: members, no saved_data map
low, high = torch.float32, torch.float64
x = torch.randn(2, 4, 8, dtype=high, requires_grad=True)
weight = torch.randn(8, 8, dtype=high, requires_grad=True)
bias = torch.randn(8, dtype=high, requires_grad=True)
x_low = torch.randn(2, 4, 8, dtype=low, requires_grad=True)  # an input already cast (shared_cast)
grad = torch.ones(2, 4, 8, dtype=low)


def stock_three_casts():
    F.linear(x.to(low), weight.to(low), bias.to(low)).backward(grad)


def node_three_casts():
    linear_node(x, weight, bias, 6).backward(grad)  # 6: torch.float32's ScalarType


def lean_three_casts():
    lean_node(x, weight, bias, 6).backward(grad)


def stock_two_casts():
    F.linear(x_low, weight.to(low), bias.to(low)).backward(grad)


def node_two_casts():
    linear_node(x_low, weight, bias, 6).backward(grad)


def lean_two_casts():
    lean_node(x_low, weight, bias, 6).backward(grad)


def stock_one_cast():  # no bias, x already cast: a Llama MLP's or o_proj's Linear
    F.linear(x_low, weight.to(low)).backward(grad)


def node_one_cast():
    linear_node(x_low, weight, None, 6).backward(grad)


def lean_one_cast():
    lean_node(x_low, weight, None, 6).backward(grad)


def one_multiply():  # the floor: one op and one node, and backward()'s own start
    (x_low * 2.0).backward(grad)


def gradients(fn):
    for t in (x, x_low, weight, bias):
        t.grad = None
    fn()
    return [t.grad for t in (x, x_low, weight, bias) if t.grad is not None]


def per_call_us(fn, n=1500):
    for _ in range(200):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


same = all(torch.equal(a, b) for pair in ((stock_three_casts, node_three_casts), (stock_two_casts, node_two_casts),
                                            (stock_one_cast, node_one_cast), (stock_three_casts, lean_three_casts),
                                            (stock_two_casts, lean_two_casts), (stock_one_cast, lean_one_cast))
           for a, b in zip(gradients(pair[0]), gradients(pair[1])))
print("gradients bitwise stock's:", same)
cases = (stock_three_casts, node_three_casts, lean_three_casts, stock_two_casts, node_two_casts, lean_two_casts,
         stock_one_cast, node_one_cast, lean_one_cast, one_multiply)
times = {f.__name__: [] for f in cases}
for _ in range(6):
    for f in cases:
        times[f.__name__].append(per_call_us(f))
for name, t in times.items():
    print(f"{name:18s} {statistics.median(t):6.1f} us (rounds {min(t):.1f}-{max(t):.1f})")
