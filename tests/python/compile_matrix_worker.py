"""One side of the compile-mode matrix (test_gpu_compile_matrix.py): trains a tiny HF model in
each mode a training job may bring, in one process, and prints one JSON line per mode with its
losses (and gradient norm), or the error it stopped with.

    python compile_matrix_worker.py MODEL SIDE MODES [LIB_DIR]

SIDE `stock` runs PyTorch alone; `torchfuse` loads the library and the Python hooks first
(what `torchfuse python` does), with every kernel serving every shape, as tiny models need.
"""
import json
import sys
import time
import traceback

import torch

MODEL, SIDE, MODES = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
if SIDE == "torchfuse":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "python"))
    import torchfuse

    assert torchfuse.enable(sys.argv[4]), "torchfuse did not load"
    torch.ops.torchfuse._serve_below_thresholds(True)

import transformers  # noqa: E402  (after the hooks, as under the launcher)

VOCAB, STEPS = 512, 4


def tiny_model():
    """The bench's families, tiny: GPT-2 (LayerNorm, tanh-GELU MLP), Llama (pre-norm RMSNorm,
    rotary, SwiGLU, GQA) and GLM-4 (RMSNorm closing each sublayer: post-norm)."""
    torch.manual_seed(0)
    if MODEL == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB,
                                         n_positions=128)
        return transformers.GPT2LMHeadModel(config)
    configs = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "glm4": (transformers.Glm4Config, transformers.Glm4ForCausalLM)}
    config_class, model_class = configs[MODEL]
    config = config_class(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                          max_position_embeddings=128, head_dim=32, pad_token_id=0)
    return model_class(config)


def batches(mode):
    """(batch, length) per step: a change of shape mid-run where the mode is about that."""
    if mode == "compile-dynamic":
        return [(4, 64), (4, 48), (2, 64), (4, 32)]
    if mode == "shape-change":  # a last batch of another size: dynamo recompiles, dynamic
        return [(4, 64), (4, 64), (3, 64), (2, 40)]
    return [(4, 64)] * STEPS


def data(shape, step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, shape, generator=g).cuda()


def train(mode):
    model = tiny_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_fn = opt.step
    if mode in ("checkpoint", "checkpoint-reentrant"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": mode == "checkpoint-reentrant"})
    if mode in ("compile", "compile-dynamic", "shape-change", "reduce-overhead", "max-autotune",
                "compile-fullgraph"):
        options = {"compile-dynamic": {"dynamic": True}, "reduce-overhead": {"mode": "reduce-overhead"},
                   "max-autotune": {"mode": "max-autotune"},
                   "compile-fullgraph": {"fullgraph": True}}.get(mode, {})
        model = torch.compile(model, **options)
    if mode == "compiled-optimizer":
        step_fn = torch.compile(opt.step)
    losses = []
    for step, shape in enumerate(batches(mode)):
        ids = data(shape, step)
        if mode in ("reduce-overhead", "max-autotune"):  # both run CUDA-graph trees
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        step_fn()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses}


def func_grad():
    """Gradients by torch.func.grad over the parameters (as per-sample-gradient and meta-learning
    code computes them), one batch, no autocast."""
    model = tiny_model().cuda()
    params = {k: v.detach() for k, v in model.named_parameters()}
    ids = data((2, 32), 0)

    def loss_of(p):
        return torch.func.functional_call(model, p, (), {"input_ids": ids, "labels": ids}).loss

    grads, loss = torch.func.grad_and_value(loss_of)(params)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
    return {"losses": [loss.item()], "grad_norm": norm.item()}


def sdpa_dynamic():
    """The issue's own example: SDPA compiled with dynamic shapes, forward and backward."""
    f = torch.compile(lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True),
                      dynamic=True)
    losses = []
    for length in (128, 96, 64):
        g = torch.Generator(device="cuda").manual_seed(length)
        q = torch.randn(2, 4, length, 64, device="cuda", dtype=torch.bfloat16, generator=g,
                        requires_grad=True)
        out = f(q)
        out.float().sum().backward()
        losses.append(out.float().square().mean().item() + q.grad.float().square().mean().item())
    return {"losses": losses}


for mode in MODES:
    started = time.perf_counter()
    torch._dynamo.reset()
    if SIDE == "torchfuse":
        torch.ops.torchfuse.reset_stats()
    try:
        result = {"func-grad": func_grad, "sdpa-dynamic": sdpa_dynamic}.get(mode, lambda: train(mode))()
    except Exception:  # reported, so one mode's failure does not hide the others'
        result = {"error": traceback.format_exc()[-3000:]}
    if SIDE == "torchfuse":
        ops = json.loads(torch.ops.torchfuse.stats())["ops"]
        result["fused"] = {op: c.get("fused", 0) for op, c in ops.items() if c.get("fused", 0)}
        result["stock_reasons"] = sorted({r for c in ops.values() for r in c.get("stock_reasons", {})})
    result["seconds"] = round(time.perf_counter() - started, 1)
    print("MODE " + json.dumps({"mode": mode, **result}), flush=True)
