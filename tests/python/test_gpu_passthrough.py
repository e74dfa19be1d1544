"""Ops without a kernel yet: the override must hand every call to stock unchanged and count
it as `stock: no kernel yet`."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import requires_cuda
from gpu_util import enabled, fresh_seed, load_torchfuse, stats

pytestmark = requires_cuda


@pytest.fixture(scope="module", autouse=True)
def torchfuse_loaded():
    load_torchfuse()


def no_kernel_yet(op):
    return stats()["ops"].get(op, {}).get("stock_reasons", {}).get("no kernel yet", 0)


def both(toggle, fn):
    """fn() with torchfuse on, then off, from the same fresh random seed."""
    seed = fresh_seed()
    out = []
    for on in (True, False):
        torch.manual_seed(seed)
        with enabled(toggle, on):
            out.append(fn())
    torch.cuda.synchronize()
    return out


def assert_same(a, b, exact=True):
    for x, y in zip(a, b):
        if exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y)


@pytest.mark.parametrize("backend", [None, SDPBackend.FLASH_ATTENTION])
def test_sdpa_fwd_bwd(backend):
    def fn():
        q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        if backend is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.float().square().sum().backward()
        return o.detach(), q.grad, k.grad, v.grad
    before = {op: no_kernel_yet(op) for op in ("sdpa backend choice", "_scaled_dot_product_flash_attention",
                                               "_scaled_dot_product_flash_attention_backward")}
    on, off = both("sdpa", fn)
    assert_same(on, off, exact=False)
    assert no_kernel_yet("sdpa backend choice") == before["sdpa backend choice"] + 1
    if backend == SDPBackend.FLASH_ATTENTION:
        for op in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"):
            assert no_kernel_yet(op) == before[op] + 1
