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
    """The scan of a module's attributes is read again when one stops being a scalar (a tensor
    then refused) or another takes a removed one's place in a __dict__ of the same size."""
    module = torch.nn.Linear(2, 2)
    first = layer_graphs._module_state(torch, module)
    module.mode = 1.0
    assert layer_graphs._module_state(torch, module) != first
    module.mode = torch.ones(1)
    with pytest.raises(layer_graphs._Eager, match="tensor attribute mode"):
        layer_graphs._module_state(torch, module)
    del module.mode
    module.note = object()
    before = layer_graphs._module_state(torch, module)
    del module.note
    module.scale = 2.0  # the same number of attributes
    assert layer_graphs._module_state(torch, module) != before


FRESH = (DynamicLayer, DynamicSlidingWindowLayer)


def test_one_walk_finds_the_layers_parameters_and_buffers_in_order():
    """_members' parameters and buffers are layer.parameters()'s and layer.buffers(), in their
    order, a tied parameter once; a module state per module."""
    model = small_llama()
    layer = model.model.layers[0]
    layer.register_buffer("scale", torch.ones(2))
    layer.mlp.register_buffer("scale", torch.ones(3))
    layer.mlp.down_proj.weight = layer.mlp.up_proj.weight  # tied: once
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
    layer = model.model.layers[0]
    seen = []
    handle = layer.register_forward_pre_hook(lambda m, a, k: seen.append((a, dict(k))), with_kwargs=True)
    model(input_ids=ids, labels=ids)
    handle.remove()
    return seen[0]


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
