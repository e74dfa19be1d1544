"""Layer graphs' guards (torchfuse.layer_graphs) without a GPU: the switch, which classes are
recognised, the reasons a call runs eager, what counts as a fresh KV cache, and that a call the
guards refuse is the layer's own. The replays themselves: test_gpu_layer_graphs.py."""
import sys

import pytest
import torch

from conftest import ROOT

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer  # noqa: E402

sys.path.insert(0, str(ROOT / "python"))
from torchfuse import layer_graphs  # noqa: E402
import layer_families  # noqa: E402


def small_llama():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("value,on", [("1", True), ("on", True), ("TRUE", True), ("", False),
                                      ("0", False), ("off", False)])
def test_requested_reads_the_env_var(monkeypatch, value, on):
    monkeypatch.setenv("TORCHFUSE_LAYER_GRAPHS", value)
    assert layer_graphs.requested() is on


def test_not_requested_leaves_the_layers_alone(monkeypatch):
    from transformers import modeling_layers
    monkeypatch.delenv("TORCHFUSE_LAYER_GRAPHS", raising=False)
    before = modeling_layers.GradientCheckpointingLayer.__call__
    assert layer_graphs.patch_layers(modeling_layers) is True
    assert modeling_layers.GradientCheckpointingLayer.__call__ is before
    try:
        from timm.models import vision_transformer
    except ImportError:
        return
    assert layer_graphs.patch_timm_blocks(vision_transformer) is True
    assert vision_transformer.Block.__call__ is torch.nn.Module.__call__


def test_recognised_classes():
    model = small_llama()
    assert layer_graphs.recognised(type(model.model.layers[0]))
    assert not layer_graphs.recognised(type(model.model.layers[0].mlp))
    own = type("LlamaDecoderLayer", (torch.nn.Module,), {"__module__": "my_model"})
    assert not layer_graphs.recognised(own), "a class of the same name outside transformers"


def describe_reason(layer, *args, **kwargs):
    with pytest.raises(layer_graphs._Eager) as e:
        layer_graphs._describe(torch, layer, args, kwargs, (DynamicCache,))
    return str(e.value)


def test_the_reasons_a_call_runs_eager():
    model = small_llama().train()
    layer = model.model.layers[0]
    hidden = torch.randn(1, 8, 64, requires_grad=True)
    assert "CUDA" in describe_reason(layer, hidden)
    layer.eval()
    assert "training" in describe_reason(layer, hidden)
    layer.train()
    with torch.no_grad():
        assert "training" in describe_reason(layer, hidden)
    handle = layer.self_attn.register_forward_pre_hook(lambda m, a: None)
    assert "hooks on LlamaAttention" in describe_reason(layer, hidden)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    assert "global" in describe_reason(layer, hidden)
    handle.remove()
    with torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x):
        assert "saved-tensor" in describe_reason(layer, hidden)
    layer.gradient_checkpointing = True
    assert "checkpointing" in describe_reason(layer, hidden)
    layer.gradient_checkpointing = False
    with torch.inference_mode():
        assert "training" in describe_reason(layer, hidden)


def test_transformers_output_capture_hooks_stand_aside_while_idle():
    """transformers puts its output-capturing hooks on the layers and their attention for good
    at the first call that asks for hidden states: with no capture on they return at once and
    are not a reason to run eager (the call then fails on its CPU tensors only); a call that
    captures runs eager; any other forward hook beside them does too."""
    model = small_llama().train()
    layer = model.model.layers[0]
    hidden = torch.randn(1, 8, 64, requires_grad=True)
    ids = torch.randint(0, 100, (1, 8))
    model(input_ids=ids, output_hidden_states=True)
    assert layer._forward_hooks and layer.self_attn._forward_hooks  # installed for good
    assert "CUDA" in describe_reason(layer, hidden)
    seen = []  # the reason while a call captures (a hook outside the layer asks)
    handle = model.model.norm.register_forward_pre_hook(
        lambda m, a: seen.append(describe_reason(layer, hidden)))
    model(input_ids=ids, output_hidden_states=True)
    handle.remove()
    assert len(seen) == 1 and "output capture" in seen[0]
    handle = layer.register_forward_hook(lambda m, a, o: None)
    assert "hooks on LlamaDecoderLayer" in describe_reason(layer, hidden)
    handle.remove()


def test_config_read_at_each_call_is_part_of_the_key():
    """Mistral's attention reads its config's sliding window at each call (and OLMo's its q/k/v
    clip): a graph bakes in what it was, so a config changed after the capture changes the
    key (eager), and changed back replays again."""
    model = layer_families.build("mistral", sliding_window=64)
    attention = layer_families.decoder_layers(model)[0].self_attn
    before = layer_graphs._module_state(torch, attention)
    changes = (("sliding_window", 32), ("clip_qkv", 0.5), ("_attn_implementation", "eager"))
    for name, value in changes:
        old = getattr(model.config, name, None)
        setattr(model.config, name, value)
        assert layer_graphs._module_state(torch, attention) != before, name
        setattr(model.config, name, old)
        assert layer_graphs._module_state(torch, attention) == before, name


FRESH = (DynamicLayer, DynamicSlidingWindowLayer)


def test_one_walk_finds_the_layers_parameters_and_buffers_in_order():
    """_members' parameters and buffers are layer.parameters()'s and layer.buffers(), in their
    order, a tied parameter once; a module state per module."""
    model = small_llama()
    layer = model.model.layers[0]
    layer.register_buffer("scale", torch.ones(2))
    layer.mlp.register_buffer("scale", torch.ones(3))
    layer.mlp.down_proj.weight = layer.mlp.up_proj.weight  # tied: once
    layer.mlp.shared = layer.self_attn.q_proj  # a module in two places: at its first
    assert layer_graphs._walk(layer) == list(layer.modules())
    states, parameters, buffers = layer_graphs._members(torch, layer)
    assert [id(p) for p in parameters] == [id(p) for p in layer.parameters()]
    assert [id(b) for b in buffers] == [id(b) for b in layer.buffers()] and len(buffers) == 2
    assert len(states) == len(list(layer.modules()))


def test_a_fresh_cache_is_one_that_holds_nothing_for_the_layer():
    cache = DynamicCache()
    assert layer_graphs._fresh_cache(cache, 0, FRESH)
    assert layer_graphs._fresh_cache(cache, 3, FRESH)
    k = torch.randn(1, 2, 4, 8)
    cache.update(k, k, 0)
    assert not layer_graphs._fresh_cache(cache, 0, FRESH), "it holds layer 0's keys"
    assert layer_graphs._fresh_cache(cache, 1, FRESH)
    assert not layer_graphs._fresh_cache(cache, None, FRESH)
    windowed = DynamicCache()
    windowed.layers.append(DynamicSlidingWindowLayer(sliding_window=4))
    assert layer_graphs._fresh_cache(windowed, 0, FRESH)
    windowed.update(k, k, 0)
    assert not layer_graphs._fresh_cache(windowed, 0, FRESH)
    assert not layer_graphs._fresh_cache(windowed, 0, (DynamicLayer,)), "a class not named"
    offloaded = DynamicCache()
    offloaded.offloading = True
    assert not layer_graphs._fresh_cache(offloaded, 0, FRESH)


def test_the_recording_cache_takes_one_update_of_its_layer():
    cache = layer_graphs._RecordingCache(2)
    k, v = torch.randn(2), torch.randn(2)
    assert cache.update(k, v, 2, {"cos": None}) == (k, v)
    with pytest.raises(layer_graphs._Eager):
        cache.update(k, v, 2)
    with pytest.raises(layer_graphs._Eager):
        layer_graphs._RecordingCache(0).update(k, v, 1)
    with pytest.raises(layer_graphs._Eager, match="get_seq_length"):
        layer_graphs._RecordingCache(0).get_seq_length()


def test_a_refused_call_is_the_layers_own():
    """The patched __call__ on a CPU model (every call refused) gives the original's outputs and
    gradients exactly."""
    from transformers import modeling_layers
    cls = modeling_layers.GradientCheckpointingLayer
    original = cls.__call__
    model = small_llama().train()
    ids = torch.randint(0, 100, (2, 8))
    expected = model(input_ids=ids, labels=ids).loss
    expected.backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    cls.__call__ = layer_graphs._layer_call(torch, original)
    layer_graphs.counts.clear()
    try:
        got = model(input_ids=ids, labels=ids).loss
        got.backward()
    finally:
        cls.__call__ = original
    # Each layer's call counted with its reason, and the summary says so.
    assert layer_graphs.counts == {("LlamaDecoderLayer", "eager: an argument not on a CUDA device"): 2}
    assert layer_graphs.summary() == "  LlamaDecoderLayer: eager: an argument not on a CUDA device x2"
    assert torch.equal(got, expected)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected_grads))
    assert all("graphs" not in layer_graphs.state_of(layer)
               for layer in model.model.layers)


def test_a_layer_of_a_class_not_known_is_its_own_and_counted():
    """A GradientCheckpointingLayer of a class not in LAYERS (here a copy of Llama's under
    another name) runs its own code, and the summary names it."""
    from transformers import modeling_layers
    original = modeling_layers.GradientCheckpointingLayer.__call__
    model = small_llama().train()
    layer = model.model.layers[0]
    unknown = type("MyDecoderLayer", (type(layer),), {"__module__": "transformers.models.mine"})
    layer.__class__ = unknown
    hidden = torch.randn(1, 8, 64)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(8)[None])
    expected = original(layer, hidden, position_embeddings=(cos, sin))
    layer_graphs.counts.clear()
    got = layer_graphs._layer_call(torch, original)(layer, hidden, position_embeddings=(cos, sin))
    assert torch.equal(got, expected)
    assert layer_graphs.counts == {("MyDecoderLayer", "eager: not a class layer graphs know"): 1}


def test_a_call_the_guards_cannot_read_runs_eager(capsys):
    """An error inside the guards (here: the description of the call raises) never reaches the
    user: the call is the layer's own, and the layer is left eager with one warning."""
    from transformers import modeling_layers
    cls = modeling_layers.GradientCheckpointingLayer
    original = cls.__call__
    model = small_llama().train()
    layer = model.model.layers[0]
    hidden = torch.randn(1, 8, 64, requires_grad=True)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(8)[None])
    expected = layer(hidden, position_embeddings=(cos, sin))
    guarded = layer_graphs._layer_call(torch, original)

    def broken(*args, **kwargs):
        raise ValueError("unreadable")

    layer_graphs.switch.on = True
    original_describe = layer_graphs._describe
    layer_graphs._describe = broken
    try:
        got = guarded(layer, hidden, position_embeddings=(cos, sin))
    finally:
        layer_graphs._describe = original_describe
    assert torch.equal(got, expected)
    assert layer_graphs.state_of(layer)["failed"] == "its call could not be checked"
    assert "could not be checked" in capsys.readouterr().err


def test_the_kernel_switches_are_part_of_the_key():
    """sdpa_kernel(...) and TF32 change the kernels a graph would bake in: the flags differ."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    plain = layer_graphs._backend_flags(torch)
    with sdpa_kernel(SDPBackend.MATH):
        assert layer_graphs._backend_flags(torch) != plain
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = not before
    try:
        assert layer_graphs._backend_flags(torch) != plain
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert layer_graphs._backend_flags(torch) == plain


@pytest.fixture
def fake_graphs(monkeypatch):
    """CUDA's graph plumbing faked on CPU: a capture runs its code eagerly, a replay does
    nothing. The capture's own code (static inputs, the recorder, the outputs and gradients it
    keeps) then runs on a CPU layer, and a replay of the capture's own inputs gives back what
    the capture computed."""
    import contextlib
    import types

    class Graph:
        def replay(self):
            pass

    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


def layer_call_arguments(model, ids):
    """(args, kwargs) HF's model passes its first decoder layer in a training forward."""
    layer = layer_families.decoder_layers(model)[0]
    seen = []
    handle = layer.register_forward_pre_hook(lambda m, a, k: seen.append((a, dict(k))), with_kwargs=True)
    model(input_ids=ids, labels=ids)
    handle.remove()
    return seen[0]


def flat_call_with_a_fresh_cache(model, cache=DynamicCache):
    """The first decoder layer's call in a training forward, flattened: (leaves, their tree, the
    index of the KV cache among them or None), the cache replaced by a fresh one made by
    `cache()`."""
    from torch.utils import _pytree
    ids = torch.randint(1, 1000, (2, 16))
    leaves, tree = _pytree.tree_flatten(layer_call_arguments(model, ids))
    slot = next((i for i, x in enumerate(leaves) if isinstance(x, DynamicCache)), None)
    if slot is not None:
        leaves[slot] = cache()
    return leaves, tree, slot


def test_a_capture_with_fake_graphs_keeps_what_the_replay_needs(fake_graphs):
    """_capture on a CPU Llama layer given a fresh KV cache and an expanded mask: the produced
    tensors are the layer's output, then its keys and values; the input gradients and every
    parameter's are kept; the parameters are the layer's own again afterwards; a replay of the
    same inputs gives the eager call's output, keys and values."""
    from torch.utils import _pytree
    model = small_llama().train()
    layer = model.model.layers[0]
    ids = torch.randint(0, 100, (2, 8))
    args, kwargs = layer_call_arguments(model, ids)
    kwargs["attention_mask"] = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril().expand(2, 1, 8, 8)
    kwargs["past_key_values"] = DynamicCache()
    own = list(layer.parameters())
    original = type(layer).__mro__[1].__call__  # GradientCheckpointingLayer's own
    leaves, tree = _pytree.tree_flatten((args, kwargs))
    slot = next(i for i, x in enumerate(leaves) if isinstance(x, DynamicCache))
    graphs = layer_graphs._capture(torch, layer, original, "key", leaves, tree, slot, {})
    assert [p is q for p, q in zip(layer.parameters(), own)] == [True] * len(own)
    assert graphs.n_kv == 2 and graphs.present == [True, True, True]
    hidden = args[0] if args else kwargs["hidden_states"]
    assert graphs.produced[0].shape == hidden.shape
    assert graphs.produced[1].shape == (2, 2, 8, 16) and graphs.produced[2].shape == (2, 2, 8, 16)
    assert [g is not None for g in graphs.input_grads] == [t.requires_grad for t in graphs.statics]
    assert all(g is not None and g.shape == p.shape for g, p in zip(graphs.param_grads, own))
    expected_cache = DynamicCache()
    eager_kwargs = dict(kwargs, past_key_values=expected_cache)
    expected = original(layer, *args, **eager_kwargs)
    tensors = [x for x in leaves if type(x) is torch.Tensor]
    outs = layer_graphs._replay_function(torch).apply(graphs, layer_graphs._Token(), len(tensors),
                                                      *tensors, *own)
    torch.testing.assert_close(outs[0], expected)
    torch.testing.assert_close(outs[1], expected_cache.layers[0].keys)
    torch.testing.assert_close(outs[2], expected_cache.layers[0].values)
    assert all(o.requires_grad for o in outs)


def test_a_captures_inputs_are_leaves_joined_to_nothing(fake_graphs):
    """The capture's static inputs are new leaves with the call's values, requiring a gradient
    where the argument does: the hidden states a layer gets carry the job's graph (here the
    embedding's), and a static copy that autograd recorded joined the capture's backward to it
    (on the GPU its first capture then failed: that graph's nodes sit on the default stream)."""
    from torch.utils import _pytree
    model = small_llama().train()
    layer = model.model.layers[0]
    args, kwargs = layer_call_arguments(model, torch.randint(0, 100, (2, 8)))
    kwargs["past_key_values"] = None  # the forward's cache holds its keys already
    leaves, tree = _pytree.tree_flatten((args, kwargs))
    tensors = [x for x in leaves if type(x) is torch.Tensor]
    assert any(t.grad_fn is not None for t in tensors)  # the hidden states: the embedding's output
    original = type(layer).__mro__[1].__call__
    graphs = layer_graphs._capture(torch, layer, original, "key", leaves, tree, None, {})
    assert [s.is_leaf for s in graphs.statics] == [True] * len(tensors)
    assert [s.requires_grad for s in graphs.statics] == [t.requires_grad for t in tensors]
    for s, t in zip(graphs.statics, tensors):
        torch.testing.assert_close(s, t, rtol=0, atol=0)


def test_a_call_inside_a_backward_runs_eager():
    """A reentrant checkpoint recomputes its layers inside the backward, where only eager's RNG
    state gives the forward's dropout again: _describe refuses such a call."""
    model = small_llama().train()
    layer = model.model.layers[0]
    hidden = torch.randn(1, 8, 64, requires_grad=True)
    reasons = []
    x = torch.ones(2, requires_grad=True)

    def recompute(grad):  # as torch.utils.checkpoint's reentrant backward does
        with torch.enable_grad():
            reasons.append(describe_reason(layer, hidden))

    x.register_hook(recompute)
    (x * 2).sum().backward()
    assert reasons and "inside a backward" in reasons[0]


def test_an_attribute_that_changes_kind_is_read_again():
    """The scan of a module's attributes is read again when one stops being a scalar (a
    container's contents then in the key, a tensor refused) or another takes a removed one's
    place in a __dict__ of the same size."""
    module = torch.nn.Linear(2, 2)
    first = layer_graphs._module_state(torch, module)
    module.mode = 1.0
    with_mode = layer_graphs._module_state(torch, module)
    assert with_mode != first
    module.mode = [1.0]
    as_list = layer_graphs._module_state(torch, module)
    module.mode.append(2.0)
    assert layer_graphs._module_state(torch, module) != as_list, "its contents are in the key"
    module.mode = torch.ones(1)
    with pytest.raises(layer_graphs._Eager, match="tensor"):
        layer_graphs._module_state(torch, module)
    del module.mode
    module.note = object()
    before = layer_graphs._module_state(torch, module)
    del module.note
    module.scale = 2.0  # the same number of attributes
    assert layer_graphs._module_state(torch, module) != before


def test_every_recognised_class_has_a_family_in_the_tests():
    """LAYERS is the layer classes of layer_families' models: each one has the GPU tests' whole-
    model comparison with eager (test_gpu_layer_graphs.py) and the capture test below."""
    classes = {type(layer_families.decoder_layers(layer_families.build(family))[0]).__name__
               for family in layer_families.FAMILIES}
    assert classes == layer_graphs.LAYERS


@pytest.mark.parametrize("family", sorted(layer_families.FAMILIES))
def test_each_familys_capture_replays_its_eager_call(fake_graphs, family):
    """Every family of LAYERS (its class recognised): the capture of its first layer on HF's own
    arguments keeps the layer's output, and, where a decoder's model passes a fresh KV cache
    (its attention's cache index found), the keys and values it appended; a replay of the same
    inputs gives the eager call's output, and the cache's own update of the replay's keys and
    values leaves the cache eager's call leaves."""
    from transformers import modeling_layers
    from torch.utils import _pytree
    model = layer_families.build(family)
    layer = layer_families.decoder_layers(model)[0]
    assert layer_graphs.recognised(type(layer))
    leaves, tree, slot = flat_call_with_a_fresh_cache(model, lambda: DynamicCache(config=model.config))
    encoder = family in ("bert", "roberta")
    assert (slot is None) == encoder
    if not encoder:
        assert layer_graphs._layer_idx(layer) == 0
        assert layer_graphs._fresh_cache(leaves[slot], 0, FRESH)
    original = modeling_layers.GradientCheckpointingLayer.__call__
    graphs = layer_graphs._capture(torch, layer, original, "key", leaves, tree, slot, {})
    assert graphs.n_kv == (0 if encoder else 2)

    eager_leaves = list(leaves)
    if not encoder:
        eager_leaves[slot] = expected_cache = DynamicCache(config=model.config)
    args, kwargs = _pytree.tree_unflatten(eager_leaves, tree)
    expected = original(layer, *args, **kwargs)
    tensors = [x for x in leaves if type(x) is torch.Tensor]
    outs = layer_graphs._replay_function(torch).apply(graphs, layer_graphs._Token(), len(tensors),
                                                      *tensors, *layer.parameters())
    torch.testing.assert_close(outs[0], expected)
    if not encoder:
        cache = DynamicCache(config=model.config)
        cache.update(outs[1], outs[2], 0)
        assert type(cache.layers[0]) is type(expected_cache.layers[0])
        torch.testing.assert_close(cache.layers[0].keys, expected_cache.layers[0].keys)
        torch.testing.assert_close(cache.layers[0].values, expected_cache.layers[0].values)


def test_container_attributes_are_frozen_into_the_key():
    """_frozen: a dict's, list's or set's scalars (dtypes, devices too) as values, nested
    containers copied (a change inside one changes the key), other objects by their class, and
    a tensor inside one refused."""
    inner = {"a": 1}
    value = {"s": 2.0, "inner": inner, "list": [1, "x"], "set": {3}, "dtype": torch.float32,
             "device": torch.device("cpu"), "object": object()}
    frozen = layer_graphs._frozen(torch, value)
    assert hash(frozen) is not None
    inner["a"] = 2
    assert layer_graphs._frozen(torch, value) != frozen
    inner["a"] = 1
    assert layer_graphs._frozen(torch, value) == frozen
    assert layer_graphs._frozen(torch, dict(value, object=object())) == frozen, "by class"
    with pytest.raises(layer_graphs._Eager, match="tensor held"):
        layer_graphs._frozen(torch, {"t": [torch.ones(2)]})


def lora_llama(**lora):
    peft = pytest.importorskip("peft")
    model = layer_families.build("llama")
    config = peft.LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": "all-linear",
                                "lora_dropout": 0.0, **lora})
    model = peft.get_peft_model(model, config)
    with torch.no_grad():  # B starts at zero: LoRA would add nothing a test could see
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def test_a_lora_layers_adapter_settings_are_in_the_key():
    """PEFT's LoRA Linear is a submodule a replayed layer may have; its adapters' settings
    (scaling, adapters disabled, merged, which adapter is active) change the key; a class of
    another PEFT module (a quantized LoRA, an embedding) is refused."""
    model = lora_llama()
    layer = layer_families.decoder_layers(model)[0]
    states = layer_graphs._members(torch, layer)[0]
    q = layer.self_attn.q_proj
    q.scaling["default"] = 3.0
    assert layer_graphs._members(torch, layer)[0] != states
    q.scaling["default"] = 2.0
    assert layer_graphs._members(torch, layer)[0] == states
    with model.disable_adapter():
        assert layer_graphs._members(torch, layer)[0] != states
    model.merge_adapter()
    assert layer_graphs._members(torch, layer)[0] != states
    model.unmerge_adapter()
    assert layer_graphs._members(torch, layer)[0] == states
    import peft
    model.add_adapter("second", peft.LoraConfig(r=4, target_modules="all-linear"))
    with_second = layer_graphs._members(torch, layer)[0]
    model.set_adapter("second")
    assert layer_graphs._members(torch, layer)[0] != with_second
    for module, name in (("peft.tuners.lora.bnb", "Linear"), ("peft.tuners.lora.layer", "Embedding")):
        other = type(name, (torch.nn.Module,), {"__module__": module})()
        with pytest.raises(layer_graphs._Eager, match="a submodule of class"):
            layer_graphs._module_state(torch, other)


def test_a_lora_layers_capture_replays_its_eager_call(fake_graphs):
    """A LoRA-wrapped Llama layer (frozen base weights, trainable adapters, dropout on) captured
    with fake graphs: a replay of the same inputs gives the eager call's output; the gradients
    kept are the adapters' and the inputs', none for the frozen weights."""
    from transformers import modeling_layers
    from torch.utils import _pytree
    model = lora_llama(lora_dropout=0.1).eval()  # dropout off for the comparison, ...
    layer = layer_families.decoder_layers(model)[0]
    leaves, tree, slot = flat_call_with_a_fresh_cache(model)
    leaves = [x.detach().requires_grad_(x.is_floating_point()) if type(x) is torch.Tensor else x
              for x in leaves]  # ... the hidden states as a layer's input in training
    original = modeling_layers.GradientCheckpointingLayer.__call__
    graphs = layer_graphs._capture(torch, layer, original, "key", leaves, tree, slot, {})
    params = list(layer.parameters())
    assert [g is not None for g in graphs.param_grads] == [p.requires_grad for p in params]
    assert any(p.requires_grad for p in params) and not all(p.requires_grad for p in params)
    eager_leaves = list(leaves)
    eager_leaves[slot] = DynamicCache()
    args, kwargs = _pytree.tree_unflatten(eager_leaves, tree)
    expected = original(layer, *args, **kwargs)
    tensors = [x for x in leaves if type(x) is torch.Tensor]
    outs = layer_graphs._replay_function(torch).apply(graphs, layer_graphs._Token(), len(tensors),
                                                      *tensors, *params)
    torch.testing.assert_close(outs[0], expected)


def test_timms_vit_block_is_recognised_and_its_capture_replays_its_eager_call(fake_graphs):
    """timm's ViT Block (LayerScale and DropPath on): recognised, every submodule allowed, and a
    capture with fake graphs gives back the eager call's output and keeps a gradient for each
    parameter; install() puts the call on the class once."""
    pytest.importorskip("timm")
    from timm.models import vision_transformer
    torch.manual_seed(0)
    model = vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2,
                                                 num_heads=4, num_classes=10, init_values=0.1,
                                                 drop_path_rate=0.1).eval()  # DropPath: off
    block = model.blocks[1]
    assert {type(m).__name__ for m in block.modules()} >= {"LayerScale", "DropPath", "Mlp"}
    assert layer_graphs.recognised(type(block))
    assert not layer_graphs.recognised(type("Block", (torch.nn.Module,), {"__module__": "mine"}))
    layer_graphs._members(torch, block)  # no submodule refused
    x = torch.randn(2, 17, 64, requires_grad=True)
    graphs = layer_graphs._capture(torch, block, torch.nn.Module.__call__, "key", [x],
                                   _pytree_spec_of_one_tensor(), None, {})
    assert all(g is not None for g in graphs.param_grads)
    outs = layer_graphs._replay_function(torch).apply(graphs, layer_graphs._Token(), 1, x,
                                                      *block.parameters())
    torch.testing.assert_close(outs[0], block(x))
    cls = vision_transformer.Block
    assert "__call__" not in cls.__dict__, "timm's Block inherits torch.nn.Module's"
    undo = layer_graphs.install(torch, cls)
    if undo is None:
        pytest.skip("Block is patched in this process already (TORCHFUSE_LAYER_GRAPHS=1)")
    try:
        assert cls.__call__._torchfuse_layer_graphs
        assert layer_graphs.install(torch, cls) is None, "once"
        mixin = type("Mixin", (torch.nn.Module,), {"__call__": lambda self, *a, **k: "the mixin's"})
        sub = type("Sub", (cls, mixin), {})
        assert sub(dim=8, num_heads=2)(torch.randn(1, 2, 8)) == "the mixin's", "the MRO kept"
        torch.testing.assert_close(block(x), outs[0])
    finally:
        undo()
    assert "__call__" not in cls.__dict__


def _pytree_spec_of_one_tensor():
    """The tree of a call with one positional tensor and no keywords."""
    from torch.utils import _pytree
    return _pytree.tree_flatten(((torch.empty(0),), {}))[1]


def one_parameter_graphs(p):
    """The graphs of a layer `x * 2` with one parameter p, faked on CPU: its forward replay
    writes the output, its k-th backward replay writes the gradient k (every element) into the
    parameter's buffer, as a real backward graph rewrites its buffers at each replay."""
    import types

    class Graph:
        def __init__(self, run):
            self.replay = run

    x_static, produced, grad_out, grad_x = (torch.zeros(4) for _ in range(4))
    grad_p, backwards = torch.zeros_like(p), []

    def backward():
        backwards.append(None)
        grad_x.copy_(grad_out * 2)
        grad_p.fill_(float(len(backwards)))

    graphs = types.SimpleNamespace(
        statics=[x_static], produced=[produced], present=[True], grad_outs=[grad_out],
        input_grads=[grad_x], param_grads=[grad_p], generation=0, pending=None,
        forward=Graph(lambda: produced.copy_(x_static * 2)), backward=Graph(backward))
    graphs.lendable = layer_graphs._lendable(torch, graphs.param_grads, graphs.input_grads)
    return graphs


def replayed_loss(graphs, p):
    x = torch.ones(4, requires_grad=True)
    out, = layer_graphs._replay_function(torch).apply(graphs, layer_graphs._Token(), 1, x, p)
    return out.sum()


def test_a_parameters_gradient_is_lent_and_accumulates_as_eagers():
    """A .grad of None becomes the backward graph's buffer itself (no copy); backwards without
    zeroing add to it in place (the .grad keeps its identity, as eager's does); zeroed in place
    (zero_grad(set_to_none=False)) it holds the next gradient alone."""
    p = torch.nn.Parameter(torch.zeros(8))
    graphs = one_parameter_graphs(p)
    assert graphs.lendable == [True]
    replayed_loss(graphs, p).backward()
    grad = p.grad
    assert grad.data_ptr() == graphs.param_grads[0].data_ptr()
    assert torch.equal(grad, torch.full((8,), 1.0))
    replayed_loss(graphs, p).backward()
    replayed_loss(graphs, p).backward()
    assert p.grad is grad and torch.equal(grad, torch.full((8,), 6.0))  # 1 + 2 + 3
    p.grad.zero_()
    replayed_loss(graphs, p).backward()
    assert p.grad is grad and torch.equal(grad, torch.full((8,), 4.0))
    p.grad = None
    replayed_loss(graphs, p).backward()
    assert torch.equal(p.grad, torch.full((8,), 5.0))


def test_what_holds_a_lent_gradient_keeps_its_values():
    """torch.autograd.grad while the .grad holds the buffer returns the new gradient and leaves
    the .grad alone; a gradient autograd.grad returned, and a tensor on an earlier .grad's
    memory, are unchanged by the next backward; a hook on the parameter sees each backward's own
    gradient, accumulation steps included."""
    p = torch.nn.Parameter(torch.zeros(8))
    graphs = one_parameter_graphs(p)
    full = lambda v: torch.full((8,), float(v))  # noqa: E731
    replayed_loss(graphs, p).backward()
    assert p.grad.data_ptr() == graphs.param_grads[0].data_ptr()  # lent
    again, = torch.autograd.grad(replayed_loss(graphs, p), [p])
    assert torch.equal(again, full(2)) and torch.equal(p.grad, full(1))
    replayed_loss(graphs, p).backward()
    assert torch.equal(p.grad, full(4)) and torch.equal(again, full(2))  # 1 + 3
    del again
    p.grad = None
    returned, = torch.autograd.grad(replayed_loss(graphs, p), [p])
    assert returned.data_ptr() == graphs.param_grads[0].data_ptr()  # lent to the caller
    replayed_loss(graphs, p).backward()
    assert torch.equal(returned, full(4)) and torch.equal(p.grad, full(5))
    del returned
    p.grad = None
    replayed_loss(graphs, p).backward()
    kept = p.grad.detach()
    p.grad = None
    replayed_loss(graphs, p).backward()
    assert torch.equal(kept, full(6)) and torch.equal(p.grad, full(7))
    del kept
    p.grad = None
    seen = []
    p.register_hook(lambda g: seen.append(g.clone()))
    replayed_loss(graphs, p).backward()
    replayed_loss(graphs, p).backward()  # adds to the lent .grad: the hook still sees 9
    assert [g[0].item() for g in seen] == [8.0, 9.0]
    assert torch.equal(p.grad, full(17))


def test_accumulation_hooks_and_held_storages_see_eagers_values():
    """While gradients accumulate into a lent .grad, a pre-hook on the parameter's AccumulateGrad
    node sees each backward's own gradient and the .grad keeps its old values until it is added
    to (it moves off the buffer, the same tensor); a storage object taken from a lent .grad keeps
    its values after the .grad is dropped."""
    p = torch.nn.Parameter(torch.zeros(8))
    graphs = one_parameter_graphs(p)
    full = lambda v: torch.full((8,), float(v))  # noqa: E731
    replayed_loss(graphs, p).backward()
    grad = p.grad
    seen = []
    node = torch.autograd.graph.get_gradient_edge(p).node
    handle = node.register_prehook(lambda grads: seen.append((grads[0].clone(), p.grad.clone())))
    replayed_loss(graphs, p).backward()
    handle.remove()
    assert torch.equal(seen[0][0], full(2)) and torch.equal(seen[0][1], full(1))
    assert p.grad is grad and torch.equal(grad, full(3))
    assert grad.data_ptr() != graphs.param_grads[0].data_ptr()
    p.grad = None
    replayed_loss(graphs, p).backward()
    storage = p.grad.untyped_storage()
    p.grad = None
    replayed_loss(graphs, p).backward()
    kept = torch.empty(0).set_(storage, 0, (8,), (1,))
    assert torch.equal(kept, full(3)) and torch.equal(p.grad, full(4))


def test_a_gradient_buffer_that_shares_its_memory_is_copied():
    """Buffers that are views, or share a storage, are not lent: a copy, as before."""
    base = torch.zeros(16)
    a, b, alone = base[:8], base[8:], torch.zeros(8)
    assert layer_graphs._lendable(torch, [a, b, alone, None]) == [False, False, True, False]
    twin = alone.view(8)
    assert layer_graphs._lendable(torch, [alone]) == [False]  # the view holds its storage too
    del twin
    # A replay writes its static tensors: a gradient that is one (passed straight through) is
    # not lent.
    assert layer_graphs._lendable(torch, [alone], others=[alone]) == [False]
    p = torch.nn.Parameter(torch.zeros(8))
    graphs = one_parameter_graphs(p)
    graphs.lendable = [False]
    replayed_loss(graphs, p).backward()
    assert p.grad.data_ptr() != graphs.param_grads[0].data_ptr()
    assert torch.equal(p.grad, torch.full((8,), 1.0))


def test_the_backward_graph_has_a_pool_of_its_own(fake_graphs, monkeypatch):
    """The parameters' gradient buffers are lent to autograd and may be held across the next
    forward (a .grad being accumulated into): the backward is captured into a pool of its own,
    so that no forward replay writes blocks the backward's capture took for them."""
    import contextlib
    import itertools
    handles, pools = itertools.count(1), []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))

    def graph(cuda_graph, pool=None, **kwargs):
        pools.append(pool)
        return contextlib.nullcontext()

    monkeypatch.setattr(torch.cuda, "graph", graph)
    model = layer_families.build("llama")
    layer = layer_families.decoder_layers(model)[0]
    leaves, tree, slot = flat_call_with_a_fresh_cache(model, lambda: DynamicCache(config=model.config))
    original = type(layer).__mro__[1].__call__
    layer_graphs._capture(torch, layer, original, "key", leaves, tree, slot, {})
    assert len(pools) == 2 and None not in pools and pools[0] != pools[1]
