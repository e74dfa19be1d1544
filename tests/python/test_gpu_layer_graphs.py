"""Layer graphs (torchfuse.layer_graphs, TORCHFUSE_LAYER_GRAPHS=1) on the GPU, with torchfuse's
ops loaded: small HF models of each recognised family trained with and without the graphs from
the same weights and data give the same losses, gradients and KV caches; the calls the guards
send to eager run eager and stay right (a second forward before the backward, hooks, eval,
gradient accumulation, outputs kept across steps); a stale backward raises."""
import copy
import warnings

import sys

import pytest
import torch

from conftest import ROOT, requires_cuda
from gpu_util import load_torchfuse

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "python"))
from torchfuse import layer_graphs  # noqa: E402

pytestmark = requires_cuda

SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, pad_token_id=0)
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM"), "phi3": ("Phi3Config", "Phi3ForCausalLM"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


@pytest.fixture(scope="module", autouse=True)
def graphs_patched():
    """torchfuse loaded; GradientCheckpointingLayer's __call__ patched as TORCHFUSE_LAYER_GRAPHS=1
    does; the switch decides per test step."""
    load_torchfuse()
    from transformers import modeling_layers
    cls = modeling_layers.GradientCheckpointingLayer
    original = cls.__call__
    if not getattr(original, "_torchfuse_layer_graphs", False):
        cls.__call__ = layer_graphs._layer_call(torch, original)
        cls.__call__._torchfuse_layer_graphs = True
    yield
    cls.__call__ = original


def model_pair(family, seed=0):
    config_name, model_name = FAMILIES[family]
    cfg = getattr(transformers, config_name)(**SMALL)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).cuda().train()
    return model, copy.deepcopy(model)


def batch(seed, b=2, s=128):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, SMALL["vocab_size"], (b, s), generator=g).cuda()


def replays(model):
    return sum(layer.__dict__.get("_torchfuse_layer_graphs", {}).get("graphs").generation
               if layer.__dict__.get("_torchfuse_layer_graphs", {}).get("graphs") else 0
               for layer in model.model.layers)


def step(model, ids, graphs, autocast):
    layer_graphs.switch.on = graphs
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    finally:
        layer_graphs.switch.on = True
    return out


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def close(a, b, tol):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol * max(1.0, y.abs().max().item()))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_graphed_training_is_eagers(family, autocast):
    """Five steps of AdamW, graphs from the third call on: the losses, every gradient and the
    KV cache each forward builds are eager's (fp32: to cuBLAS's reordering under capture;
    bf16: to bf16's rounding), and the graphs were replayed."""
    eager, graphed = model_pair(family)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_g = torch.optim.AdamW(graphed.parameters(), lr=1e-3)
    tol = 2e-2 if autocast else 1e-4
    for i in range(5):
        ids = batch(i)
        out_e, out_g = step(eager, ids, False, autocast), step(graphed, ids, True, autocast)
        torch.testing.assert_close(out_g.loss, out_e.loss, rtol=tol / 10, atol=0)
        close(grads(graphed), grads(eager), tol)
        cache_e, cache_g = out_e.past_key_values, out_g.past_key_values
        assert (cache_g is None) == (cache_e is None)
        if cache_e is not None:
            for le, lg in zip(cache_e.layers, cache_g.layers):
                close([lg.keys, lg.values], [le.keys, le.values], tol)
                assert lg.keys.shape == le.keys.shape and lg.keys.dtype == le.keys.dtype
        opt_e.step(), opt_g.step()
        opt_e.zero_grad(), opt_g.zero_grad()
    # From each layer's third call, or its fourth where the process's first capture failed
    # (layer_graphs.CAPTURES): at most one replay a layer fewer.
    layers = SMALL["num_hidden_layers"]
    assert 2 * layers <= replays(graphed) <= 3 * layers, "the graphs replay from the third call"
    assert replays(eager) == 0


def test_gradient_accumulation_and_a_second_forward_are_eagers():
    """Two micro-batches accumulated into .grad, then two forwards summed into one loss (the
    second forward runs eager: the first replay waits for its backward): eager's gradients."""
    eager, graphed = model_pair("llama", seed=1)
    for graphs, model in ((False, eager), (True, graphed)):
        for i in range(3):  # the third call captures
            step(model, batch(i), graphs, False)
            model.zero_grad()
        step(model, batch(10), graphs, False)
        step(model, batch(11), graphs, False)  # accumulated: no zero_grad between
    close(grads(graphed), grads(eager), 1e-4)
    for model in (eager, graphed):
        model.zero_grad()
    before = replays(graphed)
    for graphs, model in ((False, eager), (True, graphed)):
        layer_graphs.switch.on = graphs
        a, b = model(input_ids=batch(20), labels=batch(20)), model(input_ids=batch(21), labels=batch(21))
        (a.loss + b.loss).backward()
        layer_graphs.switch.on = True
    assert replays(graphed) == before + SMALL["num_hidden_layers"], "the first forward replays, the second not"
    close(grads(graphed), grads(eager), 1e-4)


def test_what_the_guards_send_to_eager_is_right():
    """Hooks, eval, no_grad: eager calls (no replay), the same outputs as the model without the
    graphs. An output kept from a replay does not change at the next replay."""
    eager, graphed = model_pair("llama", seed=2)
    for i in range(3):
        step(graphed, batch(i), True, False)
    n = replays(graphed)
    kept = graphed(input_ids=batch(30)).logits
    kept_copy = kept.detach().clone()
    kept.sum().backward()
    graphed(input_ids=batch(31)).logits.sum().backward()
    assert replays(graphed) == n + 2 * SMALL["num_hidden_layers"]
    torch.testing.assert_close(kept.detach(), kept_copy, rtol=0, atol=0)
    n = replays(graphed)
    handle = graphed.model.layers[1].mlp.register_forward_hook(lambda m, i, o: None)
    graphed(input_ids=batch(32)).logits.sum().backward()
    handle.remove()
    assert replays(graphed) == n + SMALL["num_hidden_layers"] - 1, "the hooked layer runs eager"
    graphed.zero_grad()
    n = replays(graphed)
    eager.load_state_dict(graphed.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(graphed(input_ids=batch(33)).logits, eager(input_ids=batch(33)).logits)
    graphed.eval()
    graphed(input_ids=batch(34)).logits.sum().backward()
    graphed.train()
    assert replays(graphed) == n


def test_a_stale_backward_raises():
    """retain_graph, another replay, then the first graph's second backward: its activations are
    gone, and the error says so (never a silent wrong gradient)."""
    _, graphed = model_pair("llama", seed=3)
    for i in range(3):
        step(graphed, batch(i), True, False)
    first = graphed(input_ids=batch(40), labels=batch(40)).loss
    first.backward(retain_graph=True)
    graphed(input_ids=batch(41), labels=batch(41)).loss.backward()
    with pytest.raises(RuntimeError, match="TORCHFUSE_LAYER_GRAPHS"):
        first.backward()


def test_a_capture_that_fails_leaves_the_layer_eager():
    """A layer whose forward syncs (here: a forward pre-hook would be refused, so the MLP's
    forward is patched to call .item()) fails its capture: one warning, eager from then on, and
    the outputs are eager's."""
    eager, graphed = model_pair("llama", seed=4)
    mlp_class = type(graphed.model.layers[0].mlp)
    original = mlp_class.forward

    def syncing(self, x):
        float(x.float().abs().sum().item())
        return original(self, x)

    mlp_class.forward = syncing
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(6):  # two captures fail
                step(eager, batch(i), False, False)
                step(graphed, batch(i), True, False)
    finally:
        mlp_class.forward = original
    assert replays(graphed) == 0
    assert all(layer.__dict__["_torchfuse_layer_graphs"].get("failed") for layer in graphed.model.layers)
    close(grads(graphed), grads(eager), 1e-4)


def test_torch_compile_traces_the_layers_own_code():
    """Under torch.compile the patched __call__ steps aside before anything else: the compiled
    model trains with no capture and no replay."""
    eager, graphed = model_pair("llama", seed=5)
    compiled = torch.compile(graphed)
    for i in range(3):
        ids = batch(i)
        out = compiled(input_ids=ids, labels=ids)
        out.loss.backward()
        ref = eager(input_ids=ids, labels=ids)
        ref.loss.backward()
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-4, atol=0)
    assert all("graphs" not in layer.__dict__.get("_torchfuse_layer_graphs", {})
               for layer in graphed.model.layers)
