"""`torchfuse doctor` on a GPU: one call of every op family through torchfuse's kernel (the
registry's thresholds lifted, so small inputs reach it) against the same call with the op
switched off (PyTorch's own), in this process."""
import json

# (family, toggle, op name in the stats, call): each call takes torch and returns a tensor.
FAMILIES = [
    ("layer_norm", "layer_norm", "native_layer_norm",
     lambda t, g: t.nn.functional.layer_norm(rand(t, g, 4096, 1024), (1024,))),
    ("rms_norm", "rms_norm", "_fused_rms_norm",
     lambda t, g: t.nn.functional.rms_norm(rand(t, g, 4096, 1024), (1024,))),
    ("embedding", "embedding", "embedding",
     lambda t, g: t.nn.functional.embedding(t.randint(0, 1000, (4096,), device="cuda", generator=g),
                                             rand(t, g, 1000, 256))),
    ("sdpa", "sdpa", "_scaled_dot_product_flash_attention",
     lambda t, g: t.nn.functional.scaled_dot_product_attention(
         *(rand(t, g, 2, 8, 256, 64) for _ in range(3)), is_causal=True)),
    ("gelu_tanh", "gelu_tanh", "torchfuse::gelu_tanh",
     lambda t, g: t.ops.torchfuse.gelu_tanh(rand(t, g, 4096, 1024), t.float32)),
    ("cross_entropy", "cross_entropy", "cross_entropy_loss",
     lambda t, g: t.nn.functional.cross_entropy(rand(t, g, 512, 1000), t.randint(0, 1000, (512,), device="cuda",
                                                                                   generator=g))),
    ("swiglu", "swiglu", "torchfuse::silu_mul",
     lambda t, g: t.ops.torchfuse.silu_mul(rand(t, g, 4096, 1024), rand(t, g, 4096, 1024))),
    ("rotary", "rotary", "torchfuse::rotary",
     lambda t, g: t.ops.torchfuse.rotary(rand(t, g, 2, 8, 128, 64), rand(t, g, 2, 4, 128, 64),
                                         rand(t, g, 2, 128, 64), rand(t, g, 2, 128, 64), 1)[0]),
    ("adam", "adam", "_fused_adamw_", lambda t, g: adamw_step(t, g)),
]


def rand(torch, generator, *shape):
    return torch.randn(*shape, device="cuda", generator=generator).bfloat16()


def adamw_step(torch, generator):
    param = torch.randn(1 << 20, device="cuda", generator=generator).requires_grad_(True)
    param.grad = torch.randn(1 << 20, device="cuda", generator=generator)
    torch.optim.AdamW([param], lr=1e-2, fused=True).step()
    return param.detach()


def fused_calls(torch, op):
    return json.loads(torch.ops.torchfuse.stats())["ops"].get(op, {}).get("fused", 0)


def stock_reasons(torch, op):
    return json.loads(torch.ops.torchfuse.stats())["ops"].get(op, {}).get("stock_reasons", {})


def run_each_family(torch):
    """[(family, {"ok": bool, "detail": str})]: served by torchfuse and within a bf16 tolerance
    of PyTorch's result."""
    results = []
    torch.ops.torchfuse._serve_below_thresholds(True)
    try:
        for family, toggle, op, call in FAMILIES:
            try:
                before = fused_calls(torch, op)
                torch.ops.torchfuse.set_enabled(toggle, True)
                ours = call(torch, torch.Generator("cuda").manual_seed(0)).float()
                served = fused_calls(torch, op) > before
                torch.ops.torchfuse.set_enabled(toggle, False)
                stock = call(torch, torch.Generator("cuda").manual_seed(0)).float()
                torch.ops.torchfuse.set_enabled(toggle, True)
                err = ((ours - stock).norm() / stock.norm().clamp_min(1e-30)).item()
                if not served:
                    result = {"ok": False, "detail": f"not served: {stock_reasons(torch, op)}"}
                elif not err <= 2e-2:
                    result = {"ok": False, "detail": f"differs from PyTorch's by {err:.3g} (relative)"}
                else:
                    result = {"ok": True, "detail": f"served, {err:.2g} from PyTorch's result"}
            except Exception as e:  # a broken family is a line of the report, not a crash
                result = {"ok": False, "detail": f"{type(e).__name__}: {e}"}
            results.append((family, result))
    finally:
        torch.ops.torchfuse._serve_below_thresholds(False)
    return results
