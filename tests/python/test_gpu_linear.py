"""nn.Linear through torchfuse::linear_cast (the linear rewrite: one autograd node a Linear),
under CUDA autocast and without it, against the same calls with the toggle off (stock's nodes:
autocast's casts, its weight cache, F.linear): outputs and every gradient bit for bit over
random Linears, stock's error for mixed dtypes without autocast, unchanged HF models trained for
a few steps with the same losses and gradients bit for bit, no more peak memory, and every
Linear's call served. Each check runs in a fresh interpreter with the launcher's
hooks installed (torchfuse.enable()), as a user's job gets them. The CPU half: test_linear.py."""
import json
import re
import subprocess
import sys

import pytest

from conftest import LIB_DIR, ROOT, check, clean_env, requires_cuda, run_python
from gpu_util import fresh_seed
from test_head_views import HEAD_CASES, OP_PRELUDE, SPLIT_CASES

pytestmark = requires_cuda

PRELUDE = r"""
import json, random, sys, torch
sys.path.insert(0, {python!r})
import torchfuse
torchfuse.enable({lib!r})
OP = "torchfuse::linear_cast"
def served(op=OP):
    return json.loads(torch.ops.torchfuse.stats())["ops"].get(op, {{}}).get("fused", 0)
def same(a, b):
    return all(x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride() and torch.equal(x, y)
               for x, y in zip(a, b)) and len(a) == len(b)
rng = random.Random({seed})
torch.manual_seed({seed})
def random_case(make, dtypes):
    # A module of random sizes (make(in, out)) and an input: under bf16/fp16 autocast (an fp32 or
    # 16-bit input), or without autocast (always for fp32) the module and input in one dtype, as
    # a model in that dtype runs. -> (module, input, the leaves, dtype, autocast, a description)
    dtype = rng.choice(dtypes)
    autocast = dtype != torch.float32 and rng.random() < 0.7
    lead = rng.choice([(rng.randrange(1, 600),), (rng.randrange(1, 5), rng.randrange(1, 300))])
    fin, fout = rng.choice([8, 64, 768, 1000]), rng.choice([8, 96, 2304, 1001])
    m = make(fin, fout).cuda()
    m.weight.requires_grad_(rng.random() < 0.8)
    if not autocast:
        m.to(dtype)
    xdtype = rng.choice([torch.float32, dtype]) if autocast else dtype
    x = torch.randn(*lead, fin, device="cuda", dtype=xdtype).requires_grad_()
    leaves = [t for t in (x, *m.parameters()) if t.requires_grad]
    return m, x, leaves, dtype, autocast, f"{{lead}} {{fin}}->{{fout}} {{dtype}} autocast={{autocast}}"
def outputs_and_grads(call, x, leaves, dtype, autocast):
    # call()'s output and gradients, and how many calls the node served meanwhile.
    before = served()
    with torch.autocast("cuda", dtype=dtype, enabled=autocast):
        y = call()
    dy = torch.randn_like(y, generator=torch.Generator(device="cuda").manual_seed(1))
    return [y, *torch.autograd.grad(y, leaves, dy)], served() - before
"""

RANDOM_LINEARS = PRELUDE + r"""
results = []
for _ in range(60):
    m, x, leaves, dtype, autocast, case = random_case(
        lambda fin, fout: torch.nn.Linear(fin, fout, bias=rng.random() < 0.5),
        [torch.bfloat16, torch.bfloat16, torch.float16, torch.float32])
    outs = []
    for on in (False, True):
        torch.ops.torchfuse.set_enabled("linear", on)
        outs.append(outputs_and_grads(lambda: m(x), x, leaves, dtype, autocast))
    results.append([same(outs[0][0], outs[1][0]), outs[0][1], outs[1][1], case])
errors = []
for on in (False, True):  # without autocast F.linear refuses mixed dtypes: stock's error either way
    torch.ops.torchfuse.set_enabled("linear", on)
    try:
        torch.nn.Linear(8, 4).cuda().to(torch.bfloat16)(torch.randn(2, 8, device="cuda", requires_grad=True))
        errors.append(None)
    except RuntimeError as error:
        errors.append(str(error))
results.append([errors[0] is not None and errors[0] == errors[1], 0, 1, f"mixed dtypes: {{errors}}"])
print("RESULT " + json.dumps(results))
"""

RANDOM_CONV1D = PRELUDE + r"""
from transformers.pytorch_utils import Conv1D
original = Conv1D.forward.__wrapped__  # HF's own code
results = []
for _ in range(30):
    m, x, leaves, dtype, autocast, case = random_case(lambda nx, nf: Conv1D(nf, nx),
                                                      [torch.bfloat16, torch.float16, torch.float32])
    outs = [outputs_and_grads(lambda: forward(m, x), x, leaves, dtype, autocast)
            for forward in (original, type(m).forward)]
    results.append([same(outs[0][0], outs[1][0]), outs[0][1], outs[1][1], case])
print("RESULT " + json.dumps(results))
"""

MODEL = PRELUDE + r"""
import transformers
name = {model!r}
if name == "llama":
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config)
elif name == "qwen2":  # q/k/v biases
    config = transformers.Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=256)
    model = transformers.Qwen2ForCausalLM(config)
elif name == "qwen3":  # q and k normed per head between the view and the transpose
    config = transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=256, head_dim=64)
    model = transformers.Qwen3ForCausalLM(config)
elif name == "gemma3":  # q and k normed per head after the transpose; a sliding layer and a full one
    config = transformers.Gemma3TextConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                           max_position_embeddings=256, head_dim=64, sliding_window=128,
                                           layer_types=["sliding_attention", "full_attention"])
    model = transformers.Gemma3ForCausalLM(config)
elif name == "gemma2":  # logit softcapping; a sliding layer and a full one
    config = transformers.Gemma2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                       max_position_embeddings=256, head_dim=64, sliding_window=128,
                                       layer_types=["sliding_attention", "full_attention"])
    model = transformers.Gemma2ForCausalLM(config)
elif name == "olmo2":  # q and k normed whole before the view
    config = transformers.Olmo2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=256)
    model = transformers.Olmo2ForCausalLM(config)
elif name == "olmo3":  # q and k normed whole; a sliding layer and a full one
    config = transformers.Olmo3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=256, sliding_window=128,
                                      layer_types=["sliding_attention", "full_attention"])
    model = transformers.Olmo3ForCausalLM(config)
elif name == "nemotron":  # Llama's form, its position embeddings required
    config = transformers.NemotronConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                         max_position_embeddings=256)
    model = transformers.NemotronForCausalLM(config)
elif name == "phi3":  # q, k and v sliced from one projection
    config = transformers.Phi3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                     max_position_embeddings=256, pad_token_id=0)
    model = transformers.Phi3ForCausalLM(config)
elif name == "gpt_neox":  # one q/k/v projection split into heads, then chunked
    config = transformers.GPTNeoXConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                        num_attention_heads=4, vocab_size=512, max_position_embeddings=256)
    model = transformers.GPTNeoXForCausalLM(config)
elif name == "mistral":  # the config's sliding window, shorter than the sequence
    config = transformers.MistralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                        max_position_embeddings=256, sliding_window=128)
    model = transformers.MistralForCausalLM(config)
else:  # gpt2: HF Conv1D projections, nn.Linear only as its LM head
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=256, n_head=4, vocab_size=512, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))
model = model.cuda()
autocast = {autocast!r}
if not autocast:  # the model in bf16, as a bf16 job (or FSDP2's bf16 parameters) trains it
    model.to(torch.bfloat16)
linears = sum(isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D" for m in model.modules())
start = {{k: v.detach().clone() for k, v in model.state_dict().items()}}
batches = [torch.randint(0, 512, (4, 256), device="cuda") for _ in range(3)]

def nodes(fn):  # the autograd graph's nodes from the loss
    seen, pending = set(), [fn]
    while pending:
        f = pending.pop()
        if f is not None and f not in seen:
            seen.add(f)
            pending.extend(n for n, _ in f.next_functions)
    return len(seen)

def train(on):
    torch.ops.torchfuse.set_enabled({toggle!r}, on)
    model.load_state_dict(start)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses, calls, copies, graph = [], served(), served("torchfuse::kv_copy"), 0
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()  # the other run's results, kept: not this run's peak
    for ids in batches:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        graph = nodes(loss.grad_fn)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return (losses, grads, served() - calls, torch.cuda.max_memory_allocated() - held, graph,
            served("torchfuse::kv_copy") - copies)

off, on = train(False), train(True)
print("RESULT " + json.dumps({{
    "losses": same(off[0], on[0]), "grads": same(off[1], on[1]), "served": [off[2], on[2]],
    "linears": linears, "steps": len(batches), "peak": [off[3], on[3]], "nodes": [off[4], on[4]],
    "rows_copies": [off[5], on[5]], "layers": model.config.num_hidden_layers}}))
"""


def run(template, **fields):
    code = template.format(python=str(ROOT / "python"), lib=str(LIB_DIR), seed=fresh_seed(), **fields)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=clean_env(TORCHFUSE_LOG="info"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rewrite linear: torch.nn.modules.linear.Linear.forward" in proc.stderr, proc.stderr[-3000:]
    return json.loads(re.search(r"^RESULT (.*)$", proc.stdout, re.M).group(1))


def test_random_linears_are_stocks_bits_and_served():
    """Random Linears (2-D and 3-D inputs, fp32 or 16-bit, biased or not, frozen weights) under
    bf16 and fp16 autocast, and without autocast in one dtype (bf16, fp16, fp32): with the node,
    the output and every gradient are stock's bit for bit, and each call was served by the node
    (none with the toggle off). Mixed dtypes without autocast get stock's error."""
    results = run(RANDOM_LINEARS)
    assert any("autocast=False" in case for *_, case in results)
    for equal, off, on, case in results:
        assert equal, case
        assert (off, on) == (0, 1), case


def test_random_hf_conv1ds_are_their_codes_bits_and_served():
    """Random HF Conv1Ds (GPT-2's projections) under bf16 and fp16 autocast and without autocast:
    through the rewritten forward the output and every gradient are Conv1D's own code's bit for
    bit, and each call was served by the node."""
    pytest.importorskip("transformers", reason="scripts/setup installs transformers")
    results = run(RANDOM_CONV1D)
    for equal, off, on, case in results:
        assert equal, case
        assert (off, on) == (0, 1), case


@pytest.mark.parametrize("model,autocast", [("llama", True), ("qwen2", True), ("gpt2", True),
                                            ("llama", False), ("gpt2", False)])
def test_unchanged_hf_models_train_with_stocks_bits_and_no_more_memory(model, autocast):
    """Tiny HF Llama, Qwen2 (q/k/v biases) and GPT-2 (Conv1D projections, a Linear LM head)
    trained three steps under bf16 autocast with fused AdamW, and Llama and GPT-2 in bf16 without
    autocast, every other rewrite on: the losses and the last step's gradients equal the
    toggle-off run's bit for bit, every Linear's and Conv1D's call was served, and the peak
    memory is not above stock's."""
    pytest.importorskip("transformers", reason="scripts/setup installs transformers")
    out = run(MODEL, model=model, autocast=autocast, toggle="linear")
    assert out["losses"] and out["grads"], out
    assert out["served"] == [0, out["linears"] * out["steps"]], out
    assert out["peak"][1] <= out["peak"][0], out


@pytest.mark.parametrize("model,autocast", [("llama", True), ("qwen2", True), ("mistral", True),
                                            ("qwen3", True), ("gemma3", True), ("gemma2", True),
                                            ("olmo2", True), ("olmo3", True), ("nemotron", True),
                                            ("gpt_neox", True), ("gpt2", True), ("phi3", True),
                                            ("llama", False)])
def test_hf_attention_with_head_views_trains_with_stocks_bits_and_fewer_nodes(model, autocast):
    """Tiny HF Llama, Qwen2 (its layer's sliding window, q/k/v biases), Mistral (the config's
    window), Qwen3 (q and k normed per head), Gemma 3 (normed after the transpose), Gemma 2 (logit
    softcapping), OLMo 2 and 3 (q and k normed whole), Nemotron (Llama's form), GPT-NeoX (one
    q/k/v projection), GPT-2 (c_attn split three ways) and Phi-3 (q, k and v sliced from one
    projection) trained three steps under bf16 autocast, and Llama in bf16 without it, with the attention's head views in the linear node (`head_views`) and
    without: the losses and the last step's gradients bit for bit, every Linear's call served either
    way, seven autograd nodes fewer a layer (the q/k/v views and transposes, the view before o_proj;
    five for Qwen3, whose q and k keep their transposes, three for OLMo 2 and 3, whose q and k keep
    their views too, and for GPT-NeoX's one projection and dense; eight for GPT-2, whose split
    goes too; ten for Phi-3, whose three slices go) and the peak memory not above. The
    backward's gradient of GPT-2's and Phi-3's three chunks is written straight into the
    projection's gradient by kv_copy's rows kernel (three calls a layer a step, of which GPT-2's
    cache's backward made two before)."""
    pytest.importorskip("transformers", reason="scripts/setup installs transformers")
    out = run(MODEL, model=model, autocast=autocast, toggle="head_views")
    assert out["losses"] and out["grads"], out
    served = out["linears"] * out["steps"]
    assert out["served"] == [served, served], out
    assert out["nodes"][0] - out["nodes"][1] == {"qwen3": 5, "olmo2": 3, "olmo3": 3, "gpt_neox": 3, "gpt2": 8, "phi3": 10}.get(model, 7) * 2, out
    assert out["peak"][1] <= out["peak"][0], out
    # The rows kernel's calls the node adds a layer a step: a split's three chunks (bf16 rows of
    # 64 features), less, for GPT-2, the two that kv_copy's backward makes without head_views
    # (its K and V are bf16 views of the split, so their gradients, laid out as the cache by the
    # attention, are made token-major there; from the node's outputs they pass as they are).
    # Phi-3's K is fp32 after the rotary: its cache's backward makes none either way.
    if model in ("gpt2", "phi3") and autocast:
        added = {"gpt2": 1, "phi3": 3}[model] * out["layers"] * out["steps"]
        assert out["rows_copies"][1] - out["rows_copies"][0] == added, out


def kv_copies_and_results(cases):
    """The CPU op cases of test_head_views.py run on CUDA: their results, and how many calls
    kv_copy's rows kernel served meanwhile."""
    code = ('DEVICE = "cuda"\n' + OP_PRELUDE + cases + """
stats = json.loads(torch.ops.torchfuse.stats())["ops"].get("torchfuse::kv_copy", {})
print(json.dumps([stats.get("fused", 0), results]))""")
    proc = check(run_python(code, load_library=True))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_head_gradients_written_by_the_rows_kernel_are_stocks_bits():
    """On CUDA the node's backward writes the heads' gradient into the GEMM's by kv_copy's rows
    kernel, where stock reshapes (a copy where the heads are not token-major) and, for a split,
    cats: test_head_views.py's cases (every layout of the incoming gradients, a chunk without one,
    double backward, -0.0) give stock's bits. The kernel served every split whose three chunks
    have gradients of whole 16-byte rows (three calls each; double backward keeps stock's calls),
    and the single head views whose gradient is not token-major (eight cases)."""
    copies, out = kv_copies_and_results(SPLIT_CASES)
    assert all(error is not None for error in out.pop("errors"))
    for case, (outputs, grads, double, node) in out.items():
        assert outputs and grads and double, case
    whole_rows = [case for case in out if "(0, 1, 2)" in case
                  and int(re.search(r"x(\d+) conv1d", case).group(1)) % 8 == 0]
    assert whole_rows and copies == 3 * len(whole_rows), (copies, whole_rows)
    copies, out = kv_copies_and_results(HEAD_CASES)
    for case, (equal, node) in out.items():
        assert equal, case
        assert node == "torchfuse::LinearCastBackward", case
    # Served where reshape copies and the rows are whole 16-byte runs: the two 4-D leads whose
    # head dim is a multiple of 8, transposed, the gradient contiguous, with and without a bias,
    # fp32 and bf16.
    assert copies == 2 * 2 * 2, copies
