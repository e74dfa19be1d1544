"""Graph breaks torch.compile meets in unchanged HF causal LMs, stock or under torchfuse's
rewrites (CPU, tiny configs, a training forward with labels: the forward builds its KV cache):
`torch._dynamo.explain`'s count and its first reasons, a line per model. Dynamo's decisions do
not depend on the device, so a break the rewrites add shows here.

    python3 scripts/dev/graph_breaks.py stock MODEL_TYPE[,MODEL_TYPE...]
    PYTHONPATH=python python3 scripts/dev/graph_breaks.py LIB_DIR MODEL_TYPE[,MODEL_TYPE...]
"""
import sys
from pathlib import Path

import torch

if sys.argv[1] != "stock":
    import torchfuse

    assert torchfuse.enable(sys.argv[1]), "torchfuse did not load"
import transformers  # noqa: E402  (after the hooks, as under the launcher)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from tiny_configs import tiny_config  # noqa: E402

VOCAB = 64
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, head_dim=8, n_embd=32, n_layer=2, n_head=4, max_position_embeddings=64,
            n_positions=64, rotary_dim=4, moe_intermediate_size=32, num_experts=4, num_local_experts=4,
            num_experts_per_tok=2)

for model_type in sys.argv[2].split(","):
    try:
        config = tiny_config(model_type, TINY, VOCAB)
        torch.manual_seed(0)
        model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(config)
        ids = torch.randint(1, VOCAB, (2, 8))
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
        reasons = sorted({str(b.reason).splitlines()[0][:90] for b in explained.break_reasons})
        print(model_type, explained.graph_break_count, reasons[:3])
    except Exception as e:  # noqa: BLE001 - a model that does not build here is reported, the others go on
        print(model_type, "error", type(e).__name__, str(e).splitlines()[0][:100])
