"""Small HF models of each family layer graphs recognise (torchfuse.layer_graphs.LAYERS), for
the CPU and GPU layer-graph tests: one table of configs, dropout off (a replay draws other
random numbers than eager)."""
import torch

# family -> (config class, model class, the family's own settings over the common dims)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 64}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 64, "sliding_window": 64}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 64, "sliding_window": 64}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                {"residual_multiplier": 0.5, "attention_multiplier": 0.1}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "phi": ("PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 64}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.25}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    # Encoders, trained as masked LMs (the labels: every token), no KV cache.
    "bert": ("BertConfig", "BertForMaskedLM",
             {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM",
                {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}),
}

# Dims every family takes (GPT-2's config maps them to its n_embd, n_layer, n_head, n_positions).
DIMS = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, pad_token_id=0)


def build(family, seed=0, attention="sdpa", **config):
    """A small model of the family (DIMS, the family's settings, then `config`), in training."""
    import transformers
    config_name, model_name, own = FAMILIES[family]
    cfg = getattr(transformers, config_name)(**{**DIMS, **own, **config})
    cfg._attn_implementation = attention
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(cfg).train()


def decoder_layers(model):
    """The model's decoder layers (its GradientCheckpointingLayers), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
