"""Each decoder layer of an HF Llama-style model as a CUDA graph (torch.cuda.make_graphed_callables,
forward and backward), against the same model eager, in one process: the step's time, peak
memory and losses. The first measurement of docs/step-capture.md's second candidate, with no
torchfuse code in the graphing (run it plain, or under scripts/torchfuse to graph torchfuse's
kernels too).

  python3 scripts/dev/layer_graphs_probe.py [--model llama] [--rounds 4 --steps 10 --warmup 4]
  TORCHFUSE_LIB_DIR=DIR scripts/torchfuse python3 scripts/dev/layer_graphs_probe.py

The model's KV cache is turned off (config.use_cache = False): its update inside a layer is a
Python side effect a replay would skip (docs/step-capture.md). The layers are called with what
HF's model passes in training without padding: no mask, the rotary tables, no cache.
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_models import build, timed_steps  # noqa: E402


class LayerCall(torch.nn.Module):
    """layer(hidden, position_embeddings=(cos, sin)) with tensors only, as the graph takes it."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden, cos, sin):
        out = self.layer(hidden, attention_mask=None, position_embeddings=(cos, sin), past_key_values=None,
                         use_cache=False)
        return out[0] if isinstance(out, tuple) else out


class GraphedLayer(torch.nn.Module):
    """The layer's graphed call where the model calls it as captured; eager otherwise."""

    def __init__(self, layer, graphed):
        super().__init__()
        self.layer, self.graphed = layer, graphed

    def forward(self, hidden, attention_mask=None, position_embeddings=None, past_key_values=None, **kwargs):
        if attention_mask is None and past_key_values is None and position_embeddings is not None:
            return self.graphed(hidden, *position_embeddings)
        self.eager_calls = getattr(self, "eager_calls", 0) + 1
        return self.layer(hidden, attention_mask=attention_mask, position_embeddings=position_embeddings,
                          past_key_values=past_key_values, **kwargs)


def graph_layers(model, sample_ids):
    """model's decoder layers, each replaced by a GraphedLayer captured on the hidden states and
    rotary tables the model makes for `sample_ids`; the originals, to put back."""
    layers = model.model.layers
    captured = {}

    def keep(i):
        def hook(_module, args, kwargs):
            if i not in captured:
                hidden = (args[0] if args else kwargs["hidden_states"]).detach()
                cos, sin = kwargs["position_embeddings"]
                captured[i] = (hidden.clone().requires_grad_(True), cos.detach().clone(), sin.detach().clone())
        return hook

    handles = [layer.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(input_ids=sample_ids)
    for h in handles:
        h.remove()
    calls = tuple(LayerCall(layer) for layer in layers)
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        graphed = torch.cuda.make_graphed_callables(calls, tuple(captured[i] for i in range(len(layers))))
    originals = list(layers)
    for i, g in enumerate(graphed):
        layers[i] = GraphedLayer(originals[i], g)
    return originals


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=4)
    a = p.parse_args()
    torch.manual_seed(0)
    model, loss_of, tokens, what = build(a.model, torch)
    model.config.use_cache = False
    model = model.cuda().train()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sample = torch.randint(0, model.config.vocab_size, (4, 1024), device="cuda")
    eager_layers = list(model.model.layers)
    originals = graph_layers(model, sample)
    graphed_layers = list(model.model.layers)
    assert [id(x) for x in originals] == [id(x) for x in eager_layers]

    def use(layers):
        for i, layer in enumerate(layers):
            model.model.layers[i] = layer

    # Losses from the same start, a fresh optimizer each: eager against graphed.
    losses = {}
    for side, layers in (("eager", eager_layers), ("graphed", graphed_layers)):
        use(eager_layers)  # the state dict's keys are the eager model's; the tensors are shared
        model.load_state_dict(start)
        use(layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses[side] = timed_steps(torch, model, loss_of, opt, 0, 6)[1]
    # Time: interleaved rounds, one optimizer (the training goes on).
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, peaks = {"eager": [], "graphed": []}, {}
    for side, layers in (("eager", eager_layers), ("graphed", graphed_layers)):
        use(layers)
        timed_steps(torch, model, loss_of, opt, 0, a.warmup)  # warm-up: its times are not kept
    for _ in range(a.rounds):
        for side, layers in (("eager", eager_layers), ("graphed", graphed_layers)):
            use(layers)
            times[side].append(timed_steps(torch, model, loss_of, opt, 0, a.steps)[0])
            peaks[side] = max(peaks.get(side, 0), torch.cuda.max_memory_allocated())
    eager_calls = sum(getattr(layer, "eager_calls", 0) for layer in graphed_layers)
    print(f"{what}: each decoder layer graphed (make_graphed_callables) against eager, one process")
    for side in ("eager", "graphed"):
        ms = statistics.median(times[side])
        print(f"  {side:8s} {ms:7.2f} ms/step (rounds {', '.join(f'{t:.2f}' for t in times[side])}), "
              f"{tokens / ms * 1e3:,.0f} tokens/s, peak {peaks[side] / 2**30:.2f} GiB, losses "
              + " ".join(f"{x:.6f}" for x in losses[side]))
    ratio = statistics.median(times["eager"]) / statistics.median(times["graphed"])
    print(f"  graphed over eager: {ratio:.3f}x; the same losses: {losses['eager'] == losses['graphed']}; "
          f"graphed layers' calls run eager: {eager_calls}")


if __name__ == "__main__":
    main()
