"""One side of the coverage harness's training part (coverage.py --train): for each model type
given, builds a tiny config of its causal-LM class, trains a few steps under bf16 autocast with
AdamW on fixed random tokens, and prints one JSON line per model: its losses and, under
torchfuse, the ops served (fused counts) and the stock reasons; or the error it stopped with.

    python coverage_worker.py SIDE DEVICE MODEL_TYPE[,MODEL_TYPE...] [LIB_DIR]

SIDE `stock` runs PyTorch alone; `torchfuse` loads the library and the Python hooks first (what
`torchfuse python` does), with every kernel serving every shape, as tiny models need. DEVICE
`cpu` checks that the configs build and train (no torchfuse there); `cuda` is the measurement.
"""
import json
import sys
import traceback

import torch

SIDE, DEVICE, TYPES = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
if SIDE == "torchfuse":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "python"))
    import torchfuse

    assert torchfuse.enable(sys.argv[4]), "torchfuse did not load"
    torch.ops.torchfuse._serve_below_thresholds(True)

import transformers  # noqa: E402  (after the hooks, as under the launcher)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from tiny_configs import tiny_config  # noqa: E402

VOCAB, STEPS, BATCH, LENGTH = 512, 3, 2, 64
# Tiny sizes under every name configs use for them; a config takes those it has.
TINY = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "dim": 64, "embed_dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "d_ff": 128, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16,
    # Multi-head latent attention (DeepSeek and its copies).
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 32, "q_lora_rank": 32,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "vocab_size": VOCAB, "max_position_embeddings": 256, "n_positions": 256,
}


# Where a model's own dimensions do not follow from the tiny widths (DeepSeek's rope and nope
# head dims, partial rotary factors), its default widths with only these cut: depth, vocabulary,
# experts and positions.
SHALLOW = {key: TINY[key] for key in TINY if key.startswith(("num_hidden", "n_layer", "num_layers", "n_layers",
                                                             "decoder_layers", "num_experts", "num_local",
                                                             "n_routed", "vocab", "max_position", "n_positions"))}
# At most (fp32 weights, gradients and AdamW's two states: 16 bytes a parameter).
MAX_PARAMS = 1.5e9 if DEVICE == "cuda" else 4e8


def model_for(model_type, sizes):
    """The model on DEVICE, its parameter count checked on the meta device first."""
    config = tiny_config(model_type, sizes, VOCAB)
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    with torch.device("meta"):
        params = sum(p.numel() for p in model_class(config).parameters())
    if params > MAX_PARAMS:
        raise ValueError(f"{params / 1e6:.0f}M params at these sizes (more than {MAX_PARAMS / 1e6:.0f}M)")
    torch.manual_seed(0)
    return model_class(config).to(DEVICE)


def train(model_type):
    """Losses at the tiny sizes, or where those fail, at the shallow ones: (losses, sizes used)."""
    try:
        return train_at(model_type, TINY), "tiny"
    except Exception as tiny:  # noqa: BLE001 - the model's own dims may not follow from the tiny ones
        if SIDE == "torchfuse":
            torch.ops.torchfuse.reset_stats()
        try:
            return train_at(model_type, SHALLOW), "shallow"
        except Exception as shallow:  # noqa: BLE001
            raise SizesFailed(f"tiny: {one_line(tiny)}; shallow: {one_line(shallow)}") from shallow


class SizesFailed(Exception):
    """The model trained at neither size: its message names both errors."""


def one_line(e):
    """The exception's type and the first line of its message, cut at 100 characters."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def train_at(model_type, sizes):
    model = model_for(model_type, sizes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=g).to(DEVICE)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


for model_type in TYPES:
    result = {"model": model_type, "side": SIDE}
    if SIDE == "torchfuse":
        torch.ops.torchfuse.reset_stats()
    try:
        result["losses"], result["sizes"] = train(model_type)
    except Exception as e:  # noqa: BLE001 - a model that fails is reported, the others go on
        result["error"] = str(e) if isinstance(e, SizesFailed) else one_line(e)
        result["where"] = traceback.format_exc().splitlines()[-3:-1]
    if SIDE == "torchfuse":
        ops = json.loads(torch.ops.torchfuse.stats())["ops"]
        result["fused"] = {op: c["fused"] for op, c in ops.items() if c.get("fused")}
        result["stock_reasons"] = sorted({r for c in ops.values() for r in c.get("stock_reasons", {})})
    print(json.dumps(result), flush=True)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
