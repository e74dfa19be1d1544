"""Helpers for GPU tests that run torchfuse inside the test process."""
import inspect
import json
import os

import pytest
import torch

from conftest import MAIN_LIB

_loaded = False

# docs/testing.md ("Correctness") floors for ‖out − ref‖ / ‖ref‖.
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def load_torchfuse():
    """The library in this process, every op registered (where TORCHFUSE_OPS does not say
    otherwise)."""
    global _loaded
    if not _loaded:
        torch.ops.load_library(str(MAIN_LIB))
        _loaded = True


@pytest.fixture(scope="module")
def torchfuse_below_thresholds():
    """torchfuse loaded, and calls the registry's thresholds send to stock served by the kernels
    too (for the module): small random cases must reach the kernels."""
    load_torchfuse()
    torch.ops.torchfuse._serve_below_thresholds(True)
    yield
    torch.ops.torchfuse._serve_below_thresholds(False)


def original_and_rewrite(model, name, factory, form):
    """transformers.models.<model>'s `name` (a class, or a module-level function), its code as
    transformers wrote it (a class's forward; unwrapped where the rewrite layer has replaced it
    in this process), and the rewrite layer's replacement of that code (`rewrites.<factory>`,
    for `form`). Skips without transformers."""
    pytest.importorskip("transformers")
    import importlib
    import sys

    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "python"))
    from torchfuse import rewrites
    obj = getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), name)
    code = obj.forward if isinstance(obj, type) else obj
    original = inspect.unwrap(code)  # past the rewrite and any wrapper around it (shared_cast's)
    return obj, original, getattr(rewrites, factory)(torch, original, form)


def stats():
    return json.loads(torch.ops.torchfuse.stats())


def fused_count(op):
    """Calls of aten `op` a torchfuse kernel served so far."""
    return stats()["ops"].get(op, {}).get("fused", 0)


def kernel_count(op, kernel):
    """Calls of aten `op` the named torchfuse kernel (registry variant) served so far."""
    return stats()["ops"].get(op, {}).get("kernels", {}).get(kernel, 0)


def stock_reasons(op):
    """{reason: calls} of aten `op` that went to stock so far."""
    return stats()["ops"].get(op, {}).get("stock_reasons", {})


def asked_count(op):
    """Calls of aten `op` that reached torchfuse so far: served, or sent to stock with a reason
    (the registry sends a shape to stock where no kernel of ours beats it)."""
    return fused_count(op) + sum(stock_reasons(op).values())


class enabled:
    """Context manager: torchfuse on or off for one toggle."""

    def __init__(self, op, on):
        self.op, self.on = op, on

    def __enter__(self):
        torch.ops.torchfuse.set_enabled(self.op, self.on)

    def __exit__(self, *exc):
        torch.ops.torchfuse.set_enabled(self.op, True)


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def casts_in_graph(t):
    """ToCopyBackward0 nodes in the autograd graph behind t: autocast's casts of tensors that
    need grad (counted without a dispatch mode, under which some rewrites stand aside)."""
    seen, todo, count = set(), [t.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += node.name() == "ToCopyBackward0"
        todo += [next_node for next_node, _ in node.next_functions]
    return count


def poison_allocator(nbytes, device="cuda"):
    """Fills soon-to-be-reused allocator blocks with NaN, so unwritten outputs show up."""
    t = torch.full((max(nbytes // 4, 1) + 1024,), float("nan"), device=device)
    del t


def garbage_allocator(large_bytes, device="cuda"):
    """Hands every block the allocator will give out next back full of random bits: its cache
    emptied, then one large block and the small pool's blocks filled and freed. Scratch or
    output memory a kernel reads before writing then holds garbage (not NaN or zero, which a
    wrong result can hide behind)."""
    torch.cuda.empty_cache()
    words = max(large_bytes // 4, 1) + (1 << 20)
    big = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, device=device)
    small = [torch.randint(-(2**31), 2**31 - 1, (1 << 18,), dtype=torch.int32, device=device)
             for _ in range(32)]
    del big, small


def fresh_seed():
    return int.from_bytes(os.urandom(4), "little")
