"""The cross-entropy of a tiny BART's own logits and labels under bf16 autocast, torchfuse's
and stock's in one process, against float64: the coverage harness saw BART's first loss differ
from stock's by 1.7e-4 (relative) with only the cross_entropy toggle on (seventh session).

    python3 scripts/dev/bart_cross_entropy_check.py LIB_DIR      (on a GPU machine)
"""
import sys

import torch

sys.path.insert(0, "python")
import torchfuse  # noqa: E402

assert torchfuse.enable(sys.argv[1]), "torchfuse did not load"
torch.ops.torchfuse._serve_below_thresholds(True)
from transformers import BartConfig, BartForCausalLM  # noqa: E402

cfg = BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=512, max_position_embeddings=256)
torch.manual_seed(0)
model = BartForCausalLM(cfg).cuda()
ids = torch.randint(1, 512, (2, 64), generator=torch.Generator().manual_seed(100)).cuda()
cross_entropy, captured = torch.nn.functional.cross_entropy, {}


def spy(input, target, *args, **kwargs):
    captured["call"] = (input.detach().clone(), target.clone(), args, kwargs)
    return cross_entropy(input, target, *args, **kwargs)


torch.nn.functional.cross_entropy = spy
with torch.autocast("cuda", dtype=torch.bfloat16):
    loss = model(input_ids=ids, labels=ids).loss
torch.nn.functional.cross_entropy = cross_entropy
x, target, args, kwargs = captured["call"]
print("input", x.dtype, tuple(x.shape), "target", target.dtype, tuple(target.shape), "args", args, kwargs,
      "loss", loss.item())


def under_autocast():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return cross_entropy(x, target, *args, **kwargs).item()


torch.ops.torchfuse.set_enabled("cross_entropy", True)
ours = under_autocast()
torch.ops.torchfuse.set_enabled("cross_entropy", False)
stock = under_autocast()
exact = cross_entropy(x.double(), target, *args, **kwargs).item()
print(f"ours {ours!r} stock {stock!r} float64 {exact!r} ours-ref {ours - exact:.3e} stock-ref {stock - exact:.3e}")
