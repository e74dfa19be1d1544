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
import layer_families  # noqa: E402
from layer_families import DIMS, FAMILIES, decoder_layers  # noqa: E402

pytestmark = requires_cuda

@pytest.fixture(scope="module", autouse=True)
def graphs_patched():
    """torchfuse loaded; GradientCheckpointingLayer's and timm's ViT Block's __call__ patched as
    TORCHFUSE_LAYER_GRAPHS=1 does; the switch decides per test step."""
    load_torchfuse()
    from transformers import modeling_layers
    classes = [modeling_layers.GradientCheckpointingLayer]
    try:
        from timm.models import vision_transformer
        classes.append(vision_transformer.Block)
    except Exception:  # not installed, or its torchvision does not load
        pass
    undos = [layer_graphs.install(torch, cls) for cls in classes]
    yield
    for undo in undos:
        if undo is not None:
            undo()


def model_pair(family, seed=0, **config):
    """A small model of the family (layer_families' dims, updated by `config`), sdpa attention,
    in training on the GPU, and its copy."""
    model = layer_families.build(family, seed, **config).cuda()
    return model, copy.deepcopy(model)


def batch(seed, b=2, s=128):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, DIMS["vocab_size"], (b, s), generator=g).cuda()


def replays(model):
    return sum(layer_graphs.state_of(layer)["graphs"].generation
               if "graphs" in layer_graphs.state_of(layer) else 0 for layer in decoder_layers(model))


def step(model, ids, graphs, autocast, mask=None):
    layer_graphs.switch.on = graphs
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids, labels=ids, attention_mask=mask)
        out.loss.backward()
    finally:
        layer_graphs.switch.on = True
    return out


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def close(a, b, tol):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol * max(1.0, y.abs().max().item()))


def train_alike(eager, graphed, seeds, autocast):
    """A step of each model per seed (no optimizer), the graphs on for `graphed`: its losses and
    gradients are eager's (fp32: to cuBLAS's reordering under capture; bf16: to its rounding)."""
    tol = 2e-2 if autocast else 1e-4
    for i in seeds:
        out_e = step(eager, batch(i), False, autocast)
        out_g = step(graphed, batch(i), True, autocast)
        torch.testing.assert_close(out_g.loss, out_e.loss, rtol=tol / 10, atol=0)
        close(grads(graphed), grads(eager), tol)
        eager.zero_grad(), graphed.zero_grad()


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_graphed_training_is_eagers(family, autocast):
    """Five steps of AdamW, graphs from the third call on, every family of LAYERS (GPT-2, Gemma 2
    and 3 with a window shorter than the sequence): the losses, every gradient and the
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
        cache_e, cache_g = (getattr(out, "past_key_values", None) for out in (out_e, out_g))
        assert (cache_g is None) == (cache_e is None)
        if cache_e is not None:
            for le, lg in zip(cache_e.layers, cache_g.layers):
                close([lg.keys, lg.values], [le.keys, le.values], tol)
                assert lg.keys.shape == le.keys.shape and lg.keys.dtype == le.keys.dtype
                assert lg.keys.requires_grad == le.keys.requires_grad
        opt_e.step(), opt_g.step()
        opt_e.zero_grad(), opt_g.zero_grad()
    # From each layer's third call: its first capture succeeds (no retry).
    layers = DIMS["num_hidden_layers"]
    assert replays(graphed) == 3 * layers, "the graphs replay from the third call"
    assert replays(eager) == 0
    name = type(decoder_layers(graphed)[0]).__name__
    assert layer_graphs.counts[name, "replayed"] >= replays(graphed)
    assert layer_graphs.counts[name, "eager: before its capture (the first calls of a shape)"] >= 2 * layers


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_lora_training_is_eagers(autocast):
    """PEFT's LoRA on every Linear of a Llama (frozen base weights, adapters trained, B not
    zero): five steps of AdamW with and without the graphs give eager's losses and adapter
    gradients, the frozen weights get none, and the layers replayed."""
    peft = pytest.importorskip("peft")
    base = layer_families.build("llama", seed=12).cuda()
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                      target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    eager, graphed = model, copy.deepcopy(model)
    trained = [[p for p in m.parameters() if p.requires_grad] for m in (eager, graphed)]
    opt_e, opt_g = (torch.optim.AdamW(t, lr=1e-3) for t in trained)
    tol = 2e-2 if autocast else 1e-4
    for i in range(5):
        ids = batch(i)
        out_e, out_g = step(eager, ids, False, autocast), step(graphed, ids, True, autocast)
        torch.testing.assert_close(out_g.loss, out_e.loss, rtol=tol / 10, atol=0)
        close([p.grad for p in trained[1]], [p.grad for p in trained[0]], tol)
        assert all(p.grad is None for p in graphed.parameters() if not p.requires_grad)
        opt_e.step(), opt_g.step()
        opt_e.zero_grad(), opt_g.zero_grad()
    # From each layer's third call: layer 1's first capture, the first to compute an input's
    # gradient here (the embedding is frozen), failed once a process before the statics were
    # copied without autograd recording.
    layers = DIMS["num_hidden_layers"]
    assert replays(graphed) == 3 * layers, "the graphs replay from the third call"


def tiny_vit(seed):
    """timm's VisionTransformer, small: 64x64 images in 8x8 patches, three blocks with
    LayerScale, in training on the GPU."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(seed)
    return timm.models.vision_transformer.VisionTransformer(
        img_size=64, patch_size=8, embed_dim=256, depth=3, num_heads=4, num_classes=10,
        init_values=0.1).cuda().train()


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_timm_vit_trains_as_eager(autocast):
    """timm's ViT (its blocks called by an nn.Sequential): five steps of AdamW with and without
    the graphs give eager's losses and gradients, and the blocks replayed."""
    eager = tiny_vit(13)
    graphed = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_g = torch.optim.AdamW(graphed.parameters(), lr=1e-3)
    tol = 2e-2 if autocast else 1e-4
    g = torch.Generator(device="cpu").manual_seed(0)
    for i in range(5):
        images = torch.randn(8, 3, 64, 64, generator=g).cuda()
        labels = torch.randint(0, 10, (8,), generator=g).cuda()
        losses = []
        for graphs, model in ((False, eager), (True, graphed)):
            layer_graphs.switch.on = graphs
            try:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    loss = torch.nn.functional.cross_entropy(model(images), labels)
                loss.backward()
            finally:
                layer_graphs.switch.on = True
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=tol / 10, atol=0)
        close(grads(graphed), grads(eager), tol)
        opt_e.step(), opt_g.step()
        opt_e.zero_grad(), opt_g.zero_grad()
    replayed = sum(layer_graphs.state_of(b)["graphs"].generation
                   for b in graphed.blocks if "graphs" in layer_graphs.state_of(b))
    assert 2 * 3 <= replayed <= 3 * 3, "the graphs replay from the third call"


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
    assert replays(graphed) == before + DIMS["num_hidden_layers"], "the first forward replays, the second not"
    close(grads(graphed), grads(eager), 1e-4)


def test_lent_gradients_train_as_eagers():
    """Under autocast (fp32 training's weight gradients are transposed views, which
    AccumulateGrad copies to the weight's layout anyway: copied here too), the parameters'
    gradients are the backward graph's buffers themselves (no copy); training
    with zero_grad(set_to_none=False) and two micro-batches a step gives eager's gradients, and
    a gradient torch.autograd.grad returned is unchanged by the steps after it."""
    eager, graphed = model_pair("llama", seed=5)
    for i in range(4):  # the third call captures (the fourth, where a process's first fails)
        step(graphed, batch(i), True, True)
        graphed.zero_grad()
    layer = graphed.model.layers[0]
    graphs = layer_graphs.state_of(layer)["graphs"]
    assert any(graphs.lendable), "no gradient buffer could be lent"
    step(graphed, batch(5), True, True)
    lent = [p.grad.data_ptr() == b.data_ptr()
            for p, b, ok in zip(layer.parameters(), graphs.param_grads, graphs.lendable) if ok]
    assert lent and all(lent)
    weight = layer.mlp.down_proj.weight
    graphed.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = graphed(input_ids=batch(4), labels=batch(4)).loss
    taken, = torch.autograd.grad(loss, [weight])
    expected = taken.clone()
    index = next(i for i, p in enumerate(layer.parameters()) if p is weight)
    assert taken.data_ptr() == graphs.param_grads[index].data_ptr()  # lent to the caller
    graphed.zero_grad(set_to_none=False)
    eager.load_state_dict(graphed.state_dict())
    opt_e = torch.optim.SGD(eager.parameters(), lr=1e-2)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=1e-2)
    for i in range(4):
        for model, graphs_on, opt in ((eager, False, opt_e), (graphed, True, opt_g)):
            step(model, batch(10 + 2 * i), graphs_on, True)
            step(model, batch(11 + 2 * i), graphs_on, True)  # accumulated into .grad
        close(grads(graphed), grads(eager), 2e-2)
        opt_e.step(), opt_g.step()
        opt_e.zero_grad(set_to_none=False), opt_g.zero_grad(set_to_none=False)
    assert torch.equal(taken, expected)


def test_what_the_guards_send_to_eager_is_right():
    """A hook on a submodule, a dropout's p changed, eval, no_grad: eager calls (no replay), with
    eager's outputs and gradients. An output kept from a replay does not change at the next
    replay."""
    eager, graphed = model_pair("llama", seed=2)
    layers = DIMS["num_hidden_layers"]
    for i in range(3):
        step(eager, batch(i), False, False)
        step(graphed, batch(i), True, False)
    n = replays(graphed)
    kept = graphed(input_ids=batch(30)).logits
    kept_copy = kept.detach().clone()
    kept.sum().backward()
    graphed(input_ids=batch(31)).logits.sum().backward()
    assert replays(graphed) == n + 2 * layers
    torch.testing.assert_close(kept.detach(), kept_copy, rtol=0, atol=0)
    for model in (eager, graphed):
        model.zero_grad()
    eager.load_state_dict(graphed.state_dict())

    def compare(ids, expected_replays):
        n = replays(graphed)
        out_g, out_e = step(graphed, ids, True, False), step(eager, ids, False, False)
        torch.testing.assert_close(out_g.logits, out_e.logits, rtol=1e-4, atol=1e-4)
        close(grads(graphed), grads(eager), 1e-4)
        assert replays(graphed) == n + expected_replays
        for model in (eager, graphed):
            model.zero_grad()

    handle = graphed.model.layers[1].mlp.register_forward_hook(lambda m, i, o: None)
    compare(batch(32), layers - 1)  # the hooked layer runs eager
    handle.remove()
    graphed.model.layers[0].self_attn.attention_dropout = 0.0 + 1e-9
    eager.model.layers[0].self_attn.attention_dropout = 0.0 + 1e-9
    compare(batch(33), layers - 1)  # a scalar attribute changed: eager
    graphed.model.layers[0].self_attn.attention_dropout = 0.0
    eager.model.layers[0].self_attn.attention_dropout = 0.0
    compare(batch(34), layers)
    n = replays(graphed)
    graphed.eval()
    graphed(input_ids=batch(35)).logits.sum().backward()
    graphed.train()
    with torch.no_grad():
        graphed(input_ids=batch(36))
    assert replays(graphed) == n


def test_padded_batches_train_as_eager():
    """Padded batches, a new padding each step (HF's attention mask becomes a 4-D mask, an
    argument whose values the replay copies): eager's losses and gradients, the graphs
    replayed."""
    eager, graphed = model_pair("llama", seed=6)
    for i in range(5):
        mask = torch.ones(2, 128, dtype=torch.long, device="cuda")
        mask[1, -(17 + 9 * i):] = 0  # right padding (no all-masked row), a new length each step
        out_e = step(eager, batch(i), False, False, mask)
        out_g = step(graphed, batch(i), True, False, mask)
        torch.testing.assert_close(out_g.loss, out_e.loss, rtol=1e-5, atol=0)
        close(grads(graphed), grads(eager), 1e-4)
        for model in (eager, graphed):
            model.zero_grad()
    assert replays(graphed) >= 2 * DIMS["num_hidden_layers"]


def test_a_sliding_window_trains_as_eager():
    """Mistral with a window shorter than the sequence: HF passes a sliding-window mask (an
    expanded tensor: the graph's copy of it is dense) and the cache's layers are sliding-window
    ones: eager's losses, gradients and caches, the graphs replayed."""
    eager, graphed = model_pair("mistral", seed=9, sliding_window=64)
    for i in range(5):
        out_e = step(eager, batch(i), False, False)
        out_g = step(graphed, batch(i), True, False)
        torch.testing.assert_close(out_g.loss, out_e.loss, rtol=1e-5, atol=0)
        close(grads(graphed), grads(eager), 1e-4)
        for le, lg in zip(out_e.past_key_values.layers, out_g.past_key_values.layers):
            assert type(lg) is type(le)
            close([lg.keys, lg.values], [le.keys, le.values], 1e-4)
        for model in (eager, graphed):
            model.zero_grad()
    assert replays(graphed) >= 2 * DIMS["num_hidden_layers"]


def test_gradients_through_the_kv_cache_and_autograd_grad():
    """A loss through a second forward that reads the first forward's KV cache: the gradient
    through the cache reaches the replayed layers as in eager. Gradients from autograd.grad are
    the user's own: the next replay does not change them."""
    eager, graphed = model_pair("llama", seed=7)
    for i in range(3):
        step(eager, batch(i), False, False)
        step(graphed, batch(i), True, False)
    for model in (eager, graphed):
        model.zero_grad()
    n = replays(graphed)
    for graphs, model in ((False, eager), (True, graphed)):
        layer_graphs.switch.on = graphs
        first = model(input_ids=batch(50), labels=batch(50))
        second = model(input_ids=batch(51, s=16), past_key_values=first.past_key_values)
        (first.loss + second.logits.float().pow(2).mean()).backward()
        layer_graphs.switch.on = True
    assert replays(graphed) == n + DIMS["num_hidden_layers"], "the first forward replays"
    close(grads(graphed), grads(eager), 1e-4)
    params = list(graphed.model.layers[0].parameters())
    loss = graphed(input_ids=batch(52), labels=batch(52)).loss
    got = torch.autograd.grad(loss, params)
    kept = [g.clone() for g in got]
    graphed(input_ids=batch(53), labels=batch(53)).loss.backward()
    assert replays(graphed) == n + 3 * DIMS["num_hidden_layers"]
    for g, k in zip(got, kept):
        torch.testing.assert_close(g, k, rtol=0, atol=0)


def test_parameters_loaded_anew_free_the_old_graphs_and_capture_again():
    """load_state_dict(assign=True) gives the layers new parameter tensors: the old graphs can
    never replay again, so they are dropped (their memory freed), the layers run eager, capture
    anew at their third call and replay, training as eager does; after a second move they stay
    eager."""
    import gc
    import weakref
    eager, graphed = model_pair("llama", seed=14)

    def load_anew():
        for model in (eager, graphed):
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()},
                                  assign=True)
            model.zero_grad()

    train_alike(eager, graphed, range(3), False)
    old = [weakref.ref(layer_graphs.state_of(layer)["graphs"]) for layer in decoder_layers(graphed)]
    load_anew()
    train_alike(eager, graphed, range(3, 7), False)
    gc.collect()
    assert all(ref() is None for ref in old), "the old graphs are freed"
    states = [layer_graphs.state_of(layer) for layer in decoder_layers(graphed)]
    assert all(s["graphs"].generation == 2 for s in states), "captured at the third call anew"
    load_anew()  # a second move (parameters that move every step): eager, the graphs freed
    train_alike(eager, graphed, range(7, 9), False)
    assert all("graphs" not in s and s["failed"] for s in states)


def test_dropout_draws_new_numbers_at_each_replay():
    """Attention dropout inside a graphed layer: two replays of one input give different outputs
    (the generator advances), as two eager calls do."""
    model, _ = model_pair("llama", seed=8, attention_dropout=0.5)
    for i in range(3):
        step(model, batch(i), True, False)
    n = replays(model)
    outs = []
    for _ in range(2):
        out = model(input_ids=batch(60), labels=batch(60))
        out.loss.backward()
        outs.append(out.logits.detach())
    assert replays(model) == n + 2 * DIMS["num_hidden_layers"]
    assert not torch.equal(outs[0], outs[1])
    assert torch.isfinite(outs[0]).all()


def test_a_stale_backward_raises():
    """A second backward through one replay (retain_graph), and one after the layer's next replay:
    its activations are gone, and the error says so (never a silent wrong gradient)."""
    _, graphed = model_pair("llama", seed=3)
    for i in range(3):
        step(graphed, batch(i), True, False)
    first = graphed(input_ids=batch(40), labels=batch(40)).loss
    first.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="TORCHFUSE_LAYER_GRAPHS"):
        first.backward(retain_graph=True)  # the same replay twice
    graphed(input_ids=batch(41), labels=batch(41)).loss.backward()
    with pytest.raises(RuntimeError, match="TORCHFUSE_LAYER_GRAPHS"):
        first.backward()  # after the layer's next replay


def test_a_capture_that_fails_leaves_the_layer_eager(capfd):
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
    assert all(layer_graphs.state_of(layer).get("failed") == "its capture failed"
               for layer in graphed.model.layers)
    assert "runs eager: its capture failed twice" in capfd.readouterr().err
    close(grads(graphed), grads(eager), 1e-4)


def test_a_failed_capture_with_dropout_leaves_the_generator_usable():
    """A capture that fails on the GPU marks the default generator as capturing; without giving
    it back, the eager call the layer falls back to (its dropout) raised "Offset increment
    outside graph capture" (a LoRA fine-tune with dropout did). Each layer's first capture fails
    here (a sync while capturing), in a model with attention dropout: the steps run, the second
    captures replay, the job is back on its own stream, and a dropout outside the layers still
    draws."""
    model, _ = model_pair("llama", seed=9, attention_dropout=0.3)
    mlp_class = type(model.model.layers[0].mlp)
    original = mlp_class.forward
    failing = {"left": DIMS["num_hidden_layers"]}

    def syncs_at_first_captures(self, x):
        if torch.cuda.is_current_stream_capturing() and failing["left"] > 0:
            failing["left"] -= 1
            float(x.float().abs().sum().item())  # invalidates the capture
        return original(self, x)

    mlp_class.forward = syncs_at_first_captures
    try:
        for i in range(6):
            out = step(model, batch(i), True, False)
            assert torch.isfinite(out.loss)
    finally:
        mlp_class.forward = original
    assert failing["left"] == 0
    # Ending a failed capture raises before torch.cuda.graph gives the stream back: the job
    # went on on the capture's stream.
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert replays(model) > 0
    assert all("graphs" in layer_graphs.state_of(layer) for layer in model.model.layers)
    x = torch.ones(1 << 16, device="cuda")
    assert 0 < torch.nn.functional.dropout(x, 0.5).count_nonzero() < x.numel()


def test_every_layer_captures_at_its_first_try():
    """Each layer's input carries a gradient (the embedding trains): the first capture of each
    layer, the process's first among them, succeeds on the job's default stream. (A static input
    copied with autograd recording joined the capture's backward to the job's graph on the
    default stream: each process's first capture of such a layer failed.)"""
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    for family in ("llama", "gpt2"):
        model, _ = model_pair(family, seed=11)
        for i in range(4):
            step(model, batch(i), True, True)
        states = [layer_graphs.state_of(layer) for layer in decoder_layers(model)]
        assert [s.get("failures", 0) for s in states] == [0] * len(states), family
        assert all("graphs" in s for s in states) and replays(model) > 0, family
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


def test_layers_replay_after_a_call_that_asked_for_hidden_states():
    """A call with output_hidden_states puts transformers' capturing hooks on the layers for
    good: that call runs eager and gets every hidden state; later calls, with no capture on,
    replay and train as eager does."""
    eager, graphed = model_pair("llama", seed=13)
    states = {}
    for name, model in (("eager", eager), ("graphed", graphed)):
        layer_graphs.switch.on = name == "graphed"
        try:
            out = model(input_ids=batch(0), labels=batch(0), output_hidden_states=True)
        finally:
            layer_graphs.switch.on = True
        states[name] = out.hidden_states
        out.loss.backward()
        model.zero_grad()
    assert len(states["graphed"]) == DIMS["num_hidden_layers"] + 1
    close(states["graphed"], states["eager"], 1e-4)
    assert decoder_layers(graphed)[0]._forward_hooks  # transformers' hooks stay
    train_alike(eager, graphed, range(1, 5), True)
    assert replays(graphed) > 0


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
    assert all("graphs" not in layer_graphs.state_of(layer)
               for layer in graphed.model.layers)


DDP_WORLD_OF_ONE = """
import json, os, sys, torch, torch.distributed as dist, torchfuse
sys.path.insert(0, {tests!r})
torchfuse.enable({lib!r})
from torchfuse import layer_graphs
import copy, layer_families
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str({port}), RANK="0", WORLD_SIZE="1")
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
from torch.nn.parallel import DistributedDataParallel as DDP
base = layer_families.build("llama").cuda()
models = {{"eager": DDP(copy.deepcopy(base)), "graphed": DDP(copy.deepcopy(base),
                                                          gradient_as_bucket_view=True)}}
opts = {{k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}}
result = {{"loss": [], "grads": []}}
for i in range(6):
    ids = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(i)).cuda()
    losses, grads = {{}}, {{}}
    for name, model in models.items():
        layer_graphs.switch.on = name == "graphed"
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses[name] = loss.item()
        grads[name] = [p.grad.float().clone() for p in model.parameters()]
        opts[name].step()
        opts[name].zero_grad()
    result["loss"].append([losses["eager"], losses["graphed"]])
    result["grads"].append(max(((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()
                               for a, b in zip(grads["graphed"], grads["eager"])))
result["replays"] = sum(layer_graphs.state_of(layer)["graphs"].generation
                        for layer in layer_families.decoder_layers(models["graphed"].module)
                        if "graphs" in layer_graphs.state_of(layer))
dist.destroy_process_group()
print(json.dumps(result))
sys.stdout.flush()
os._exit(0)
"""


def test_ddp_trains_as_eager():
    """DistributedDataParallel (a world of one over NCCL; its hooks on the parameters' gradient
    accumulation, gradients as views of its buckets): the replays' parameter gradients reach
    DDP's buckets as eager's do, so the losses and gradients are eager's, and the layers
    replayed."""
    import json
    import socket
    from conftest import LIB_DIR, check, run_python
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = DDP_WORLD_OF_ONE.format(tests=str(ROOT / "tests" / "python"), lib=str(LIB_DIR),
                                   port=port)
    proc = check(run_python(code, PYTHONPATH=ROOT / "python", TORCHFUSE_LAYER_GRAPHS="1"))
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for eager, graphed in result["loss"]:
        assert abs(eager - graphed) <= 2e-3 * abs(eager), result["loss"]
    assert max(result["grads"]) < 2e-2, result["grads"]
    assert result["replays"] >= 3 * DIMS["num_hidden_layers"], result
