"""A causal-LM model type's config cut to tiny sizes, for the harnesses that build every family
(coverage_worker.py, scripts/dev/graph_breaks.py)."""
import transformers


def tiny_config(model_type, sizes, vocab):
    """`model_type`'s default config with each of `sizes` set where the config has that name,
    and special token ids that fall outside a vocabulary of `vocab` set to 0."""
    config = transformers.AutoConfig.for_model(model_type)
    known = config.to_dict()
    for key, value in sizes.items():
        if key in known:
            setattr(config, key, value)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(config, key, None), int) and not 0 <= getattr(config, key) < vocab:
            setattr(config, key, 0)
    return config
