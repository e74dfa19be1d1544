"""The attention's head views in the linear node (the `head_views` toggle), on CPU (the node runs
on any device; the rewrite serves CUDA calls, and here CPU ones through the tests' switch):
torchfuse::linear_cast's `out_head_dim` and `merge_input_heads` give stock's tensors (sizes,
strides, values) and gradients bit for bit with one autograd node, stock's nodes where the node
would not make the views, stock's errors; HF's attention forms are recognised by their code; an
unchanged HF model's attention rewritten gives the original's losses and gradients bit for bit
with fewer autograd nodes. The GPU half: test_gpu_linear.py."""
import json

import pytest

from conftest import MAIN_LIB, ROOT, check, run_python

OP_PRELUDE = r"""
import json, torch
import torch.nn.functional as F
op = torch.ops.torchfuse.linear_cast
BF16 = torch.bfloat16
DEVICE = globals().get("DEVICE", "cpu")  # test_gpu_linear.py runs some of these cases on CUDA
g = torch.Generator().manual_seed(0)
def r(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE).requires_grad_(grad)
def bits(t):  # the tensor's bits: -0.0 is not +0.0 here
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) if t.is_floating_point() else t
def same(a, b):
    return len(a) == len(b) and all(s.dtype == t.dtype and s.shape == t.shape and s.stride() == t.stride()
                                    and torch.equal(bits(s), bits(t)) for s, t in zip(a, b))
def outputs_and_grads(fn, leaves, dy):
    y = fn()
    return [y, *torch.autograd.grad(y, leaves, dy)], y.grad_fn.name()
"""


def run_op(code):
    proc = check(run_python(OP_PRELUDE + code, load_library=True))
    return json.loads(proc.stdout.strip().splitlines()[-1])


HEAD_CASES = r"""
results = {}
for lead, heads, head_dim in [((2, 5), 4, 8), ((1, 7), 2, 16), ((3, 1), 3, 4), ((6,), 2, 8)]:
    for bias in (True, False):
        for wdtype, dtype in ((torch.float32, torch.float32), (BF16, BF16)):
            for layout, transposed in (("contiguous", True), ("as its view", True), ("contiguous", False)):
                x = r(*lead, 16, dtype=dtype)
                w, b = r(heads * head_dim, 16, dtype=wdtype), (r(heads * head_dim, dtype=wdtype) if bias else None)
                leaves = [t for t in (x, w, b) if t is not None]
                def stock():
                    heads = F.linear(x, w, b).view(*lead, -1, head_dim)
                    return heads.transpose(1, 2) if transposed else heads
                shape = stock().shape
                dy = torch.randn(*shape, generator=g).to(dtype).to(DEVICE)
                if layout != "contiguous":  # [B, S, H, D] memory seen as [B, H, S, D]
                    dy = dy.transpose(1, 2).contiguous().transpose(1, 2) if len(lead) > 1 else dy.mT.contiguous().mT
                ours, node = outputs_and_grads(lambda: op(x, w, b, dtype, False, head_dim, False, transposed),
                                               leaves, dy)
                theirs, _ = outputs_and_grads(stock, leaves, dy)
                results[f"{lead} {heads}x{head_dim} bias={bias} {dtype} {layout} transposed={transposed}"] = [
                    same(ours, theirs), node]
"""


def test_split_heads_are_stocks_view_and_transpose_bit_for_bit_in_one_node():
    """`out_head_dim`: the output is HF's `y.view(*lead, -1, head_dim).transpose(1, 2)`, or with
    `transpose_heads` false the view alone (its sizes and strides), and the gradients of the input,
    weight and bias equal those through stock's view and transpose, for an incoming gradient of any
    layout (contiguous, or as an attention's backward gives it)."""
    out = run_op(HEAD_CASES + 'print(json.dumps(results))')
    assert len(out) == 4 * 2 * 2 * 3
    for case, (equal, node) in out.items():
        assert equal, case
        assert node == "torchfuse::LinearCastBackward", case


def test_merged_heads_are_stocks_reshape_bit_for_bit_in_one_node():
    """`merge_input_heads`: the input [*lead, heads, head_dim] is taken as HF's
    `x.reshape(*lead, -1).contiguous()` before o_proj; output and gradients equal stock's."""
    out = run_op(r"""
results = {}
for lead, heads, head_dim in [((2, 5), 4, 8), ((1, 7), 2, 16), ((3,), 2, 8)]:
    for bias in (True, False):
        for dtype in (torch.float32, BF16):
            x = r(*lead, heads, head_dim, dtype=dtype)
            w, b = r(12, heads * head_dim, dtype=dtype), (r(12, dtype=dtype) if bias else None)
            leaves = [t for t in (x, w, b) if t is not None]
            dy = torch.randn(*lead, 12, generator=g).to(dtype)
            ours, node = outputs_and_grads(lambda: op(x, w, b, dtype, False, 0, True), leaves, dy)
            theirs, _ = outputs_and_grads(lambda: F.linear(x.reshape(*lead, -1).contiguous(), w, b), leaves, dy)
            results[f"{lead} {heads}x{head_dim} bias={bias} {dtype}"] = [same(ours, theirs), node]
print(json.dumps(results))
""")
    assert len(out) == 3 * 2 * 2
    for case, (equal, node) in out.items():
        assert equal, case
        assert node == "torchfuse::LinearCastBackward", case


SPLIT_CASES = r"""
split_op = torch.ops.torchfuse.linear_cast_split
results = {}
def info(ts):
    return [(t.shape, t.stride(), t.storage_offset()) for t in ts]
for (batch, seq), heads, kv_heads, head_dim in [((2, 5), 4, 4, 8), ((1, 7), 2, 1, 16), ((3, 1), 3, 3, 4),
                                                ((1, 1), 2, 1, 8)]:
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    q, kv = sizes[0], sizes[1]
    for conv1d in ((True, False) if heads == kv_heads else (False,)):
        for dtype in (torch.float32, BF16):
            for used in ((0, 1, 2), (0, 2), (1,)):
                for layout in ("contiguous", "token order"):
                    x = r(batch, seq, 16, dtype=dtype)
                    w = r(16, sum(sizes), dtype=dtype) if conv1d else r(sum(sizes), 16, dtype=dtype)
                    b = r(sum(sizes), dtype=dtype)
                    def stock():
                        if conv1d:  # GPT-2's
                            chunks = torch.addmm(b, x.view(-1, 16), w).view(batch, seq, -1).split(q, dim=2)
                        else:  # Phi-3's
                            qkv = F.linear(x, w, b)
                            chunks = qkv[..., :q], qkv[..., q:q + kv], qkv[..., q + kv:]
                        return [c.view(batch, seq, -1, head_dim).transpose(1, 2) for c in chunks]
                    def grads_of(outputs, create_graph=False):
                        dys = []
                        for i in used:
                            dy = torch.randn(batch, sizes[i] // head_dim, seq, head_dim, generator=g).to(dtype)
                            # -0.0 in a third of the places: slices' gradients are summed with
                            # zeros (+0.0), a split's cat keeps them
                            dy = torch.where(torch.rand(dy.shape, generator=g) < 0.33, -0.0, dy).to(dtype).to(DEVICE)
                            if layout == "token order":  # [B, S, H, D] memory seen as [B, H, S, D]
                                dy = dy.transpose(1, 2).contiguous().transpose(1, 2)
                            dys.append(dy)
                        return torch.autograd.grad([outputs[i] for i in used], [x, w, b], dys,
                                                   create_graph=create_graph)
                    state = g.get_state()
                    ours = split_op(x, w, b, dtype, conv1d, sizes, head_dim, not conv1d)
                    ours_grads = grads_of(ours)
                    g.set_state(state)
                    theirs = stock()
                    theirs_grads = grads_of(theirs)
                    node = {t.grad_fn.name() for t in ours}
                    # The double backward: the first gradients' sum differentiated again.
                    def second_order(fn):
                        g.set_state(state)
                        return torch.autograd.grad(sum(t.float().sum() for t in grads_of(fn(), True)), [x, w, b],
                                                   allow_unused=True)
                    second = [second_order(lambda: split_op(x, w, b, dtype, conv1d, sizes, head_dim, not conv1d)),
                              second_order(stock)]
                    results[f"{batch}x{seq} {heads}/{kv_heads}x{head_dim} conv1d={conv1d} {dtype} {used} {layout}"] = [
                        same(ours, theirs) and info(ours) == info(theirs), same(ours_grads, theirs_grads),
                        all((s is None and t is None) or torch.equal(bits(s), bits(t)) for s, t in zip(*second)),
                        sorted(node)]
errors = []
for sizes in ([8, 8, 8], [8, 8, 4]):  # widths that are not the output's, or not whole heads
    try:
        split_op(r(2, 3, 16), r(16, 20), None, torch.float32, True, sizes, 8)
        errors.append(None)
    except RuntimeError as error:
        errors.append(str(error))
results["errors"] = errors
"""


def test_split_into_heads_is_stocks_split_or_slices_views_and_transposes_bit_for_bit_in_one_node():
    """torchfuse::linear_cast_split: the output split into q, k and v heads as GPT-2's attention
    splits c_attn's (a Conv1D's [in, out] weight, `split(split_size, dim=2)`) and as Phi-3's
    slices its qkv_proj's (a Linear's, k and v fewer heads than q), each chunk viewed and
    transposed into heads: three outputs of stock's sizes, strides, storage offsets and values,
    one node; the gradients of the input, weight and bias have the bits of those through stock's
    split or slices, views and transposes (the sign of a zero too: the engine's sum of the slices'
    zero-padded gradients makes -0.0 +0.0) for incoming gradients of any layout, with a chunk that
    has none (its columns zero), and in a double backward (create_graph: stock's calls on the
    gradients)."""
    out = run_op(SPLIT_CASES + 'print(json.dumps(results))')
    errors = out.pop("errors")
    assert all(error is not None for error in errors), errors
    assert len(out) == (2 + 1 + 2 + 1) * 2 * 3 * 2
    for case, (outputs, grads, double, node) in out.items():
        assert outputs and grads and double, case
        assert node == ["torchfuse::LinearCastBackward"], case


def test_views_the_node_would_not_make_keep_stocks_nodes_and_errors():
    """A non-contiguous input to merge (HF's reshape and contiguous copy it) runs stock's
    composition with its values; a width that is not whole heads, and a negative head size, get
    an error, as stock's view gives one."""
    out = run_op(r"""
x = r(2, 4, 5, 8).transpose(1, 2)  # [B, S, H, D] of a [B, H, S, D] tensor: not contiguous
w = r(12, 32)
dy = torch.randn(2, 5, 12, generator=g)
ours, node = outputs_and_grads(lambda: op(x, w, None, torch.float32, False, 0, True), [x, w], dy)
theirs, _ = outputs_and_grads(lambda: F.linear(x.reshape(2, 5, -1).contiguous(), w), [x, w], dy)
errors = {}
for name, call, stock in [
        ("not whole heads", lambda: op(r(2, 3, 16), r(12, 16), None, torch.float32, False, 5),
         lambda: F.linear(r(2, 3, 16), r(12, 16)).view(2, 3, -1, 5)),
        ("negative", lambda: op(r(2, 3, 16), r(12, 16), None, torch.float32, False, -1), None)]:
    try:
        call()
        errors[name] = None
    except RuntimeError as error:
        errors[name] = str(error)
    if stock is not None:
        try:
            stock()
        except RuntimeError as error:
            errors[name] = [errors[name], str(error)]
print(json.dumps({"same": same(ours, theirs), "node": node, "errors": errors}))
""")
    assert out["same"] and out["node"] != "torchfuse::LinearCastBackward", out
    ours, stock = out["errors"]["not whole heads"]
    assert ours == stock, out
    assert out["errors"]["negative"] is not None and "out_head_dim" in out["errors"]["negative"], out


def test_hf_attention_forms_are_recognised_by_their_code():
    """Llama's attention forward and its copies, Qwen2's (the layer's sliding window), Mistral's
    (the config's), Qwen3's (q and k normed per head), Gemma 3's (normed after the transpose)
    Gemma 2's (logit softcapping), OLMo 2's and 3's (q and k normed whole) and Nemotron's (Llama's
    code, its position embeddings required), GPT-NeoX's (one q/k/v projection), GPT-2's (one
    Conv1D split three ways) and Phi-3's (one projection sliced) are recognised; a changed forward
    is not."""
    pytest.importorskip("transformers", reason="scripts/setup installs transformers")
    proc = check(run_python(f"""
import json, sys, textwrap, inspect
sys.path.insert(0, {str(ROOT / "python")!r})
from torchfuse import compositions
from transformers.models.llama import modeling_llama as L
from transformers.models.qwen2 import modeling_qwen2 as Q
from transformers.models.mistral import modeling_mistral as M
from transformers.models.gemma import modeling_gemma as G
from transformers.models.qwen3 import modeling_qwen3 as Q3
from transformers.models.gemma3 import modeling_gemma3 as G3
from transformers.models.gemma2 import modeling_gemma2 as G2
from transformers.models.olmo2 import modeling_olmo2 as O2
from transformers.models.olmo3 import modeling_olmo3 as O3
from transformers.models.nemotron import modeling_nemotron as N
from transformers.models.gpt_neox import modeling_gpt_neox as X
from transformers.models.gpt2 import modeling_gpt2 as GPT2
from transformers.models.phi3 import modeling_phi3 as P3
changed = {{}}
exec(compile(textwrap.dedent(inspect.getsource(L.LlamaAttention.forward)).replace("transpose(1, 2)", "transpose(2, 1)"),
             L.__file__, "exec"), vars(L), changed)
print(json.dumps([compositions.form_of(c.forward) for c in (L.LlamaAttention, G.GemmaAttention, Q.Qwen2Attention,
                                                            M.MistralAttention, Q3.Qwen3Attention,
                                                            G3.Gemma3Attention, G2.Gemma2Attention,
                                                            O2.Olmo2Attention, O3.Olmo3Attention,
                                                            N.NemotronAttention, X.GPTNeoXAttention,
                                                            GPT2.GPT2Attention, P3.Phi3Attention)]
                 + [compositions.form_of(changed["forward"])]))
"""))
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [
        "hf_attention", "hf_attention", "hf_attention_sliding_window", "hf_attention_config_sliding_window",
        "qwen3_attention", "gemma3_attention", "gemma2_attention", "olmo2_attention", "olmo3_attention",
        "hf_attention", "gpt_neox_attention", "gpt2_attention", "phi3_attention", None]


MODEL = r"""
import json, sys, torch
sys.path.insert(0, {python!r})
import torchfuse
from torchfuse import rewrites
rewrites._HEAD_VIEWS_ON_CPU = True
torchfuse.enable({lib!r})
import transformers
torch.manual_seed(0)
sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
name = {model!r}
config = {{"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config,
           "gemma3": transformers.Gemma3TextConfig, "gemma2": transformers.Gemma2Config,
           "olmo2": transformers.Olmo2Config, "olmo3": transformers.Olmo3Config,
           "nemotron": transformers.NemotronConfig, "gpt_neox": transformers.GPTNeoXConfig,
           "gpt2": transformers.GPT2Config, "phi3": transformers.Phi3Config}}[name](**sizes)
if name == "phi3":  # its default pad token is past this vocabulary
    config.pad_token_id = 0
if name == "gpt2":  # no dropout: the two runs draw no masks
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
if name == "llama":
    config.attention_bias = True
if name in ("gemma3", "gemma2", "olmo3"):  # a sliding layer and a full one
    config.head_dim, config.sliding_window = 16, 8
    config.layer_types = ["sliding_attention", "full_attention"]
model = (transformers.GPT2LMHeadModel if name == "gpt2" else getattr(
    transformers, type(config).__name__.replace("TextConfig", "Config").replace("Config", "ForCausalLM")))(
    config).to({dtype})
ids = torch.randint(0, 128, (2, 16))

def nodes(fn):
    seen, pending, names = set(), [fn], []
    while pending:
        f = pending.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names.append(f.name())
        pending.extend(n for n, _ in f.next_functions)
    return names

def run(on):
    torch.ops.torchfuse.set_enabled("head_views", on)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    graph = nodes(loss.grad_fn)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], graph

off, on = run(False), run(True)
count = lambda graph, kind: sum(n == kind for n in graph)
attention = type({{"gpt_neox": lambda: model.gpt_neox.layers[0].attention, "gpt2": lambda: model.transformer.h[0].attn}}.get(
    name, lambda: model.model.layers[0].self_attn)())
print(json.dumps({{
    "loss": torch.equal(off[0], on[0]),
    "grads": all(torch.equal(a, b) for a, b in zip(off[1], on[1])),
    "views": [count(off[2], "ViewBackward0"), count(on[2], "ViewBackward0")],
    "transposes": [count(off[2], "TransposeBackward0"), count(on[2], "TransposeBackward0")],
    "linear_nodes": [count(off[2], "torchfuse::LinearCastBackward"), count(on[2], "torchfuse::LinearCastBackward")],
    "splits": [count(off[2], "SplitBackward0"), count(on[2], "SplitBackward0")],
    "slices": [count(off[2], "SliceBackward0"), count(on[2], "SliceBackward0")],
    "rewritten": attention.forward is not getattr(attention.forward, "__wrapped__", None)
                 and hasattr(attention.forward, "__wrapped__")}}))
"""


@pytest.mark.parametrize("model,dtype", [("llama", "torch.float32"), ("qwen2", "torch.bfloat16"),
                                         ("mistral", "torch.float32"), ("qwen3", "torch.float32"),
                                         ("gemma3", "torch.float32"), ("gemma2", "torch.float32"),
                                         ("olmo2", "torch.bfloat16"), ("olmo3", "torch.float32"),
                                         ("nemotron", "torch.float32"), ("gpt_neox", "torch.float32"),
                                         ("gpt2", "torch.float32"), ("gpt2", "torch.bfloat16"),
                                         ("phi3", "torch.float32"), ("phi3", "torch.bfloat16")])
def test_unchanged_hf_attention_gives_the_originals_bits_with_fewer_nodes(model, dtype):
    """Tiny HF Llama (with q/k/v/o biases), Qwen2 (its sliding-window form), Mistral (the
    config's), Qwen3 (q and k normed per head), Gemma 3 (normed after the transpose) and Gemma 2
    (logit softcapping), OLMo 2 and 3 (q and k normed whole), Nemotron (its partial rotary),
    GPT-NeoX (one q/k/v projection split into heads, then chunked: two projections a layer),
    GPT-2 (c_attn split three ways into heads: two projections a layer, its SplitBackward0 gone),
    Phi-3 (q, k and v sliced from qkv_proj: two projections a layer, its three SliceBackward0 gone),
    Gemma 2, 3 and OLMo 3 with a sliding and a full layer, trained one step without autocast: the loss
    and every gradient with the attention rewritten equal the original forward's (the toggle
    off) bit for bit; its graph has the four projections as the node's and three
    TransposeBackward0 (one where q and k keep theirs: Qwen3, OLMo) and four or more
    ViewBackward0 nodes fewer in each of the two layers."""
    pytest.importorskip("transformers", reason="scripts/setup installs transformers")
    proc = check(run_python(MODEL.format(python=str(ROOT / "python"), lib=str(MAIN_LIB.parent), model=model,
                                         dtype=dtype), TORCHFUSE_LOG="info"))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "rewrite head_views:" in proc.stderr, proc.stderr[-3000:]
    assert out["loss"] and out["grads"] and out["rewritten"], out
    # On CPU the other Linears keep stock's nodes (nn.Linear's rewrite serves CUDA calls): the
    # projections' own views go too (F.linear's of a 3-D input), besides the head views.
    layers = 2
    projections = 2 if model in ("gpt_neox", "gpt2", "phi3") else 4
    assert out["linear_nodes"] == [0, projections * layers], out
    assert out["transposes"][0] - out["transposes"][1] == (1 if model in ("qwen3", "olmo2", "olmo3", "gpt_neox")
                                                           else 3) * layers, out
    assert out["views"][0] - out["views"][1] >= projections * layers, out
    if model == "gpt2":
        assert out["splits"] == [layers, 0], out
    if model == "phi3":
        assert out["slices"][0] - out["slices"][1] == 3 * layers, out


FALLBACKS = r"""
import json, sys, textwrap, inspect, torch
sys.path.insert(0, {python!r})
import torchfuse
from torchfuse import rewrites, compositions
rewrites._HEAD_VIEWS_ON_CPU = True
torchfuse.enable({lib!r})
import transformers
from transformers.models.llama import modeling_llama as L
from transformers.models.qwen2 import modeling_qwen2 as Q
torch.manual_seed(0)
config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
config._attn_implementation = "sdpa"
x = torch.randn(2, 5, 32, requires_grad=True)
position = L.LlamaRotaryEmbedding(config)(x, torch.arange(5)[None])

def both(attention, *args, **kwargs):
    # The output (or error) and the graph's view nodes of the original forward (HF's code, called
    # directly) and of the module's call (the rewrite).
    out = []
    for call in (lambda: inspect.unwrap(type(attention).forward)(attention, *args, **kwargs),
                 lambda: attention(*args, **kwargs)):
        try:
            y = call()[0]
            graph, pending, seen = 0, [y.grad_fn], set()
            while pending:
                f = pending.pop()
                if f is not None and f not in seen:
                    seen.add(f)
                    graph += f.name() in ("ViewBackward0", "TransposeBackward0")
                    pending.extend(n for n, _ in f.next_functions)
            out.append((y, graph))
        except Exception as error:
            out.append((type(error).__name__ + ": " + str(error), None))
    (a, ga), (b, gb) = out
    equal = torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b
    return [bool(equal), ga == gb]

class Redirected(L.LlamaAttention):  # its own __getattr__ answers q_proj with another Linear
    def __getattr__(self, name):
        if name == "q_proj":
            return super().__getattr__("alt_q")
        return super().__getattr__(name)

results = {{}}
plain = L.LlamaAttention(config, 0)
results["served"] = both(plain, x, position, None)
redirected = Redirected(config, 0)
redirected.alt_q = torch.nn.Linear(32, 32, bias=False)
results["own __getattr__"] = both(redirected, x, position, None)
hooked = L.LlamaAttention(config, 0)
hooked.q_proj.register_forward_hook(lambda m, i, o: o * 2)
results["hooked q_proj"] = both(hooked, x, position, None)
with torch.autocast("cpu", dtype=torch.bfloat16):
    results["cpu autocast"] = both(plain, x, position, None)
qwen = Q.Qwen2Attention(transformers.Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2), 0)
results["missing argument"] = both(qwen, x, position)
with torch.no_grad():
    results["grad off"] = both(plain, x, position, None)
# GPT-2's: served for self-attention (eager's upcast and reordered attention too); its
# cross-attention and a hooked c_attn run the original.
from transformers.models.gpt2 import modeling_gpt2 as GPT2
def gpt2_attention(implementation, **options):
    g2config = transformers.GPT2Config(n_embd=32, n_head=4, attn_pdrop=0.0, resid_pdrop=0.0, **options)
    g2config._attn_implementation = implementation
    return GPT2.GPT2Attention(g2config, layer_idx=0, is_cross_attention=options.get("add_cross_attention", False))
results["gpt2 served"] = both(gpt2_attention("sdpa"), x)
results["gpt2 eager upcast"] = both(gpt2_attention("eager", reorder_and_upcast_attn=True), x)
results["gpt2 cross-attention"] = both(gpt2_attention("sdpa", add_cross_attention=True), x,
                                       encoder_hidden_states=torch.randn(2, 3, 32))
hooked_gpt2 = gpt2_attention("sdpa")
hooked_gpt2.c_attn.register_forward_pre_hook(lambda m, i: (i[0] * 2,))
results["gpt2 hooked c_attn"] = both(hooked_gpt2, x)
results["gpt2 non-contiguous input"] = both(gpt2_attention("sdpa"), x.transpose(0, 1).contiguous().transpose(0, 1))
scripted = gpt2_attention("sdpa")
scripted.c_attn = torch.jit.script(scripted.c_attn)  # its class has no forward to read
results["gpt2 scripted c_attn"] = both(scripted, x)
# Phi-3's: served where qkv_proj is as wide as the slices the original takes; else the original.
from transformers.models.phi3 import modeling_phi3 as P3
p3config = transformers.Phi3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
p3config._attn_implementation = "sdpa"
results["phi3 served"] = both(P3.Phi3Attention(p3config, 0), x, position, None)
uneven = P3.Phi3Attention(p3config, 0)
uneven.num_key_value_heads = 1
results["phi3 slices not the projection's width"] = both(uneven, x, position, None)
# A copy whose cache argument is named otherwise: the same bytecode, other names, not the form.
source = textwrap.dedent(inspect.getsource(L.LlamaAttention.forward)).replace("past_key_values", "past_key_value")
renamed = {{}}
exec(compile(source, L.__file__, "exec"), vars(L), renamed)
results["renamed parameter form"] = compositions.form_of(renamed["forward"])
print(json.dumps(results))
"""


def test_what_the_rewrite_cannot_see_through_runs_the_original():
    """The original forward's output or error, and its view nodes, where an
    attention class's own __getattr__ could answer its projections, a projection is hooked, CPU
    autocast runs (the tests' switch), an argument is missing, grad is off, and for GPT-2's
    attention where it is cross-attention, c_attn is hooked or scripted or the input is not
    contiguous, and
    for Phi-3's where qkv_proj is not as wide as its slices: the original ran. A copy whose parameters are named otherwise is not the form (the rewrite binds
    by name). Where served (GPT-2's eager upcast and reordered attention too), the output is the
    same with the view nodes gone."""
    pytest.importorskip("transformers", reason="scripts/setup installs transformers")
    proc = check(run_python(FALLBACKS.format(python=str(ROOT / "python"), lib=str(MAIN_LIB.parent))))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("renamed parameter form") is None, out
    assert out.pop("served") == [True, False], out
    assert out.pop("gpt2 served") == [True, False], out
    assert out.pop("gpt2 eager upcast") == [True, False], out
    assert out.pop("phi3 served") == [True, False], out
    for case, (equal, same_graph) in out.items():
        assert equal and same_graph, (case, out)


def test_each_attention_forms_keywords_are_those_its_rewrite_passes():
    """The table the rewrites read agrees with the forms: every head_views form has its keywords
    (`_ATTENTION_KEYWORDS`), and those are the keywords, in order, its reference passes the
    attention interface (read from the reference's code)."""
    import sys
    import types
    sys.path.insert(0, str(ROOT / "python"))
    from torchfuse import compositions, rewrites
    forms = {form for form, op in compositions.COMPUTES.items() if op == "head_views"}
    assert set(rewrites._ATTENTION_KEYWORDS) == forms
    attention = types.SimpleNamespace(training=True, attention_dropout=0.1, scaling=0.125, sliding_window=1,
                                      attn_logit_softcapping=2.0, config=types.SimpleNamespace(sliding_window=3),
                                      attn_dropout=types.SimpleNamespace(p=0.2))
    for form in forms:
        keywords = [c for c in compositions.FORMS[form].co_consts if isinstance(c, tuple) and "dropout" in c]
        assert keywords == [tuple(rewrites._ATTENTION_KEYWORDS[form](attention))], form
