"""The rewrite layer's recognition (python/torchfuse/compositions.py) against the real model code
of the transformers version the GPU machine has (installed by scripts/setup): which classes'
forwards are a known composition, and which are left alone. No GPU, no downloads."""
import importlib
import pkgutil
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "python"))
from torchfuse import compositions  # noqa: E402

transformers = pytest.importorskip("transformers", reason="scripts/setup installs transformers")


def module(name):
    return importlib.import_module(f"transformers.{name}")


def recognised(module_name):
    return {cls.__name__: form for cls, form in compositions.scan(module(module_name)).items()}


def test_hf_activations_recognised_by_code():
    found = recognised("activations")
    assert found == {"NewGELUActivation": "new_gelu", "FastGELUActivation": "fast_gelu"}
    assert compositions.COMPUTES["new_gelu"] == compositions.COMPUTES["fast_gelu"] == "gelu_tanh"


@pytest.mark.parametrize("model", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_llama_rms_norm_and_its_copies_are_recognised(model):
    found = recognised(f"models.{model}.modeling_{model}")
    norms = [name for name, form in found.items() if form == "hf_rms_norm"]
    assert len(norms) == 1 and norms[0].endswith("RMSNorm"), found


@pytest.mark.parametrize("model", ["llama", "mistral", "qwen2", "qwen3"])
def test_llama_gated_mlp_and_its_copies_are_recognised(model):
    found = recognised(f"models.{model}.modeling_{model}")
    assert [name for name, form in found.items() if form == "hf_gated_mlp"] == [f"{found_prefix(found)}MLP"]
    assert compositions.COMPUTES["hf_gated_mlp"] == "swiglu"


@pytest.mark.parametrize("model,mlp", [("gpt2", "GPT2MLP"), ("gpt_neo", "GPTNeoMLP"), ("imagegpt", "ImageGPTMLP"),
                                       ("decision_transformer", "DecisionTransformerGPT2MLP")])
def test_gpt2_mlp_and_its_copies_are_recognised(model, mlp):
    found = recognised(f"models.{model}.modeling_{model}")
    assert [name for name, form in found.items() if form == "hf_conv1d_mlp"] == [mlp], found
    assert compositions.COMPUTES["hf_conv1d_mlp"] == "gelu_tanh"


def test_conv1d_recognised_despite_its_modules_future_annotations():
    """transformers.pytorch_utils has `from __future__ import annotations`, which sets a code
    flag that changes nothing computed; a changed Conv1D forward is still not the form."""
    from transformers.pytorch_utils import Conv1D

    assert Conv1D.forward.__code__.co_flags & __import__("__future__").annotations.compiler_flag
    assert compositions.form_of(Conv1D.forward) == "hf_conv1d"
    assert compositions.COMPUTES["hf_conv1d"] == "linear"  # the linear rewrite's, and the MLP's c_proj

    class Scaled(Conv1D):
        def forward(self, x):
            size_out = x.size()[:-1] + (self.nf,)
            x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight, alpha=2)
            return x.view(size_out)

    import torch
    assert compositions.form_of(Scaled.forward) is None


def found_prefix(found):
    return next(name for name in found if name.endswith("RMSNorm"))[:-len("RMSNorm")]


def test_silu_act_fns_are_known_and_other_activations_are_not():
    import torch
    from transformers import activations

    assert compositions.is_silu(torch.nn.SiLU, torch)
    assert compositions.is_silu(type(activations.ACT2FN["silu"]), torch)
    assert not compositions.is_silu(type(activations.ACT2FN["gelu"]), torch)
    assert not compositions.is_silu(torch.nn.GELU, torch)

    class Tweaked(activations.SiLUActivation):
        def forward(self, input):
            return 2 * super().forward(input)

    assert not compositions.is_silu(Tweaked, torch)


@pytest.mark.parametrize("model", ["gemma", "gemma2", "t5", "bert"])
def test_other_forms_are_left_alone(model):
    # Gemma multiplies by (1 + weight) in fp32 (its own form); T5's norm casts to the weight's
    # dtype first.
    found = recognised(f"models.{model}.modeling_{model}")
    assert "hf_rms_norm" not in found.values(), found


@pytest.mark.parametrize("model, cls", [("t5", "T5LayerNorm"), ("longt5", "LongT5LayerNorm"),
                                        ("switch_transformers", "SwitchTransformersLayerNorm")])
def test_t5s_rms_norm_is_its_own_form(model, cls):
    found = recognised(f"models.{model}.modeling_{model}")
    assert found[cls] == "t5_rms_norm" and compositions.COMPUTES["t5_rms_norm"] == "hf_rms_norm"


@pytest.mark.parametrize("model, expected", [
    ("gpt_oss", {"GptOssRMSNorm": "gpt_oss_rms_norm"}),
    ("helium", {"HeliumRMSNorm": "helium_rms_norm", "apply_rotary_pos_emb": "helium_rotary"}),
    ("nemotron", {"apply_rotary_pos_emb": "nemotron_partial_rotary"}),
    ("qwen4_exp", {"apply_rotary_pos_emb": "qwen4_exp_partial_rotary"}),
    ("seed_oss", {"SeedOssMLP": "seed_oss_gated_mlp"}),
    ("gemma3n", {"Gemma3nTextMLP": "gemma3n_gated_mlp"}),
    ("recurrent_gemma", {"RecurrentGemmaMlp": "recurrent_gemma_gated_mlp"}),
    ("falcon_h1", {"FalconH1MLP": "falcon_h1_gated_mlp"}),
    ("deepseek_v4", {"DeepseekV4UnweightedRMSNorm": "unweighted_rms_norm",
                     "DeepseekV4MLP": "deepseek_v4_clamped_gated_mlp"}),
    ("glm5_next", {"Glm5NextTextUnweightedRMSNorm": "unweighted_rms_norm", "Glm5NextTextMLP": "glm5_clamped_gated_mlp",
                   "Glm5NextVisionMLP": "glm5_clamped_gated_mlp"}),
    ("olmo2", {"Olmo2RMSNorm": "gpt_oss_rms_norm", "apply_rotary_pos_emb": "hf_rotary_cast_back"}),
    ("olmo", {"apply_rotary_pos_emb": "hf_rotary_cast_back"}),
    ("modernbert", {"apply_rotary_pos_emb": "hf_rotary_upcast"}),
    ("esm", {"apply_rotary_pos_emb": "hf_rotary_upcast"}),
    ("qwen2_5_vl", {"Qwen2_5_VLMLP": "hf_gated_mlp_inline"}),
    ("exaone4_5", {"Exaone4_5_MLP": "hf_gated_mlp_inline"}),
    ("gemma4", {"Gemma4RMSNorm": "gemma4_rms_norm", "apply_rotary_pos_emb": "hf_single_rotary"}),
    ("gemma3n", {"Gemma3nRMSNorm": "gemma4_rms_norm", "apply_rotary_pos_emb": "hf_single_rotary"}),
    ("cohere2", {"Cohere2LayerNorm": "cohere_layer_norm"}),
    ("moshi", {"MoshiRMSNorm": "moshi_rms_norm"}),
    ("kyutai_speech_to_text", {"KyutaiSpeechToTextRMSNorm": "moshi_rms_norm"}),
    ("esmfold2", {"EsmFold2RMSNorm": "fp32_rms_norm_weightless"}),
    ("hrm_text", {"HrmTextRMSNorm": "fp32_rms_norm_weightless"}),
    ("llama4", {"Llama4TextL2Norm": "fp32_rms_norm_weightless", "Llama4TextRMSNorm": "llama4_rms_norm",
                "Llama4TextMLP": "llama4_gated_mlp"}),
    ("nanochat", {"NanoChatRMSNorm": "fp32_rms_norm_weightless"}),
    ("falcon_mamba", {"FalconMambaWeightlessRMSNorm": "fp32_rms_norm_weightless",
                      "FalconMambaRMSNorm": "hf_rms_norm"}),
])
def test_gpt_oss_norm_olmo_rotary_and_the_inline_gated_mlp_are_their_own_forms(model, expected):
    """GPT-OSS's RMSNorm (the weight multiplied in fp32, then cast), Gemma 4's and 3n's (Gemma's
    without `1 +`, the weight optional), Moshi's and the weightless fp32 ones (Gemma's `_norm` of
    x.float(), the weight in fp32 or none, cast back once), Cohere's LayerNorm (fp32, no bias), OLMo's rotary (cast back to the inputs' dtypes),
    ModernBERT's (of q and k upcast) and the gated MLP returned without a name, in the models
    that write them, each served by the op of its family."""
    mod = module(f"models.{model}.modeling_{model}")
    found = {cls.__name__: form for cls, form in compositions.scan(mod).items()}
    found.update(compositions.scan_functions(mod))
    assert {name: found.get(name) for name in expected} == expected, found
    ops = {"gpt_oss_rms_norm": "hf_rms_norm", "helium_rms_norm": "hf_rms_norm", "helium_rotary": "rotary",
           "nemotron_partial_rotary": "rotary", "qwen4_exp_partial_rotary": "rotary", "seed_oss_gated_mlp": "swiglu",
           "gemma3n_gated_mlp": "swiglu", "recurrent_gemma_gated_mlp": "swiglu", "falcon_h1_gated_mlp": "swiglu",
           "unweighted_rms_norm": "hf_rms_norm", "deepseek_v4_clamped_gated_mlp": "swiglu",
           "glm5_clamped_gated_mlp": "swiglu",
           "gemma4_rms_norm": "hf_rms_norm", "cohere_layer_norm": "layer_norm",
           "moshi_rms_norm": "hf_rms_norm", "fp32_rms_norm_weightless": "hf_rms_norm", "hf_rms_norm": "hf_rms_norm",
           "llama4_rms_norm": "hf_rms_norm", "llama4_gated_mlp": "swiglu", "hf_single_rotary": "rotary",
           "hf_rotary_cast_back": "rotary",
           "hf_rotary_upcast": "rotary", "hf_gated_mlp_inline": "swiglu"}
    assert all(compositions.COMPUTES[form] == ops[form] for form in expected.values())


@pytest.mark.parametrize("model", ["gemma", "gemma2", "gemma3"])
def test_gemmas_rms_norm_is_its_own_form_with_its_norm(model):
    """Gemma 1, 2 and 3 write the same RMSNorm: its forward is the gemma_rms_norm form, its
    _norm the gemma_norm form; a _norm computing something else is not."""
    mod = module(f"models.{model}.modeling_{model}")
    cls = next(c for c, form in compositions.scan(mod).items() if form == "gemma_rms_norm")
    assert cls.__name__.endswith("RMSNorm") and compositions.COMPUTES["gemma_rms_norm"] == "hf_rms_norm"
    assert compositions.form_of(cls._norm) == "gemma_norm" and "gemma_norm" not in compositions.COMPUTES
    import types
    other = types.FunctionType(cls._norm.__code__, dict(cls._norm.__globals__, torch=types.SimpleNamespace()),
                               "_norm")
    assert compositions.form_of(other) is None


def modeling_modules():
    """Every transformers `modeling_<family>` module that imports here."""
    import transformers.models as models

    for info in pkgutil.iter_modules(models.__path__):
        try:
            yield importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
        except Exception:  # models needing optional packages
            continue


def test_dozens_of_models_share_llamas_rms_norm():
    total = sum(form == "hf_rms_norm" for mod in modeling_modules() for form in compositions.scan(mod).values())
    assert total >= 30, total


def test_every_modeling_module_is_read_without_an_error():
    """Each scan the rewrite layer runs on a module's import reads every transformers modeling
    module without raising: an error there loses that module's rewrites (the import hook warns
    and leaves the module as it is). OmDet-Turbo's and Swin2SR's encoders once raised in
    `consumer_input`."""
    scans = (compositions.scan, compositions.scan_shared_inputs, compositions.scan_consumers,
             compositions.scan_norm_handoffs)
    read = 0
    for mod in modeling_modules():
        for scan in scans:
            scan(mod)
        read += 1
    assert read >= 300, read


def compiled_forward(source, **globals_):
    """`forward` compiled in a module that imports math and torch, as library modules do."""
    namespace = dict(globals_)
    exec(compile("import math\nimport torch\n" + source, "<test>", "exec"), namespace)
    namespace.update(globals_)
    return namespace["forward"]


RMS_NORM = """
def forward(self, x):
    dtype = x.dtype
    x = x.to(torch.float32)
    var = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(var + self.variance_epsilon)
    return self.weight * x.to(dtype)
"""


def test_local_names_do_not_matter_but_code_and_globals_do():
    import torch

    assert compositions.form_of(compiled_forward(RMS_NORM)) == "hf_rms_norm"
    changed = RMS_NORM.replace("mean(-1, keepdim=True)", "mean(-1, keepdim=True) * 1.0")
    assert compositions.form_of(compiled_forward(changed)) is None
    gemma_like = RMS_NORM.replace("return self.weight * x.to(dtype)",
                                  "return (1.0 + self.weight) * x.to(dtype)")
    assert compositions.form_of(compiled_forward(gemma_like)) is None
    # The same code where `torch` is not torch computes something else.
    assert compositions.form_of(compiled_forward(RMS_NORM, torch=object())) is None
    assert torch is not None


def test_a_subclass_that_overrides_forward_is_left_alone():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class Scaled(LlamaRMSNorm):
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    assert compositions.form_of(LlamaRMSNorm.forward) == "hf_rms_norm"
    assert compositions.form_of(Scaled.forward) is None


def test_recognition_imports_no_torch():
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from torchfuse import compositions\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "print(sorted(compositions.FORMS))" % str(ROOT / "python"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("['cohere_layer_norm', 'deepseek_v4_clamped_gated_mlp', 'falcon_h1_gated_mlp', "
                                  "'fast_gelu', 'fp32_rms_norm_weightless', 'gemma2_attention', 'gemma3_attention', "
                                  "'gemma3n_gated_mlp', 'gemma4_norm', 'gemma4_rms_norm', 'gemma_norm', "
                                  "'gemma_rms_norm', 'glm5_clamped_gated_mlp', 'gpt2_attention', "
                                  "'gpt_neox_attention', 'gpt_oss_rms_norm', "
                                  "'helium_rms_norm', 'hf_attention', 'hf_attention_config_sliding_window', "
                                  "'hf_attention_sliding_window', 'hf_conv1d', 'hf_conv1d_mlp', 'hf_gated_mlp', "
                                  "'hf_gated_mlp_inline', 'hf_gelu_tanh', 'hf_packed_gated_mlp', 'hf_rms_norm', "
                                  "'hf_silu', 'llama4_gated_mlp', 'llama4_rms_norm', 'mamba_rms_norm_gated', "
                                  "'moshi_rms_norm', 'new_gelu', 'olmo2_attention', 'olmo3_attention', 'phi3_attention', "
                                  "'qwen3_attention', 'qwen3_next_rms_norm_gated', "
                                  "'recurrent_gemma_gated_mlp', 'seed_oss_gated_mlp', 't5_rms_norm', "
                                  "'t5gemma_gated_mlp', 'unweighted_rms_norm']")


def test_hf_causal_lm_loss_recognised_by_code_defaults_and_the_function_it_calls():
    import types

    import torch

    loss_utils = module("loss.loss_utils")
    original = getattr(loss_utils.ForCausalLMLoss, "__wrapped__", loss_utils.ForCausalLMLoss)
    assert compositions.function_form_of(original) == "hf_causal_lm_loss"
    assert compositions.COMPUTES["hf_causal_lm_loss"] == "cross_entropy"
    # The masked-LM loss is another form; fixed_cross_entropy is recognised but served only
    # through the causal-LM loss.
    assert compositions.function_form_of(loss_utils.ForMaskedLMLoss) is None
    assert compositions.function_form_of(loss_utils.fixed_cross_entropy) == "hf_fixed_cross_entropy"
    assert "fixed_cross_entropy" not in compositions.scan_functions(loss_utils)

    def clone(fn, defaults=None, **globals_):
        g = dict(fn.__globals__, **globals_)
        return types.FunctionType(fn.__code__, g, fn.__name__, defaults or fn.__defaults__)

    assert compositions.function_form_of(clone(original)) == "hf_causal_lm_loss"
    # Another ignore_index default, or a fixed_cross_entropy that is not HF's, is something else.
    assert compositions.function_form_of(clone(original, defaults=(None, -1, None))) is None
    assert compositions.function_form_of(
        clone(original, fixed_cross_entropy=lambda *a, **k: torch.zeros(()))) is None
    assert compositions.function_form_of(clone(original, nn=types.SimpleNamespace())) is None


def test_hf_rotary_and_its_copies_are_recognised_with_their_rotate_half():
    import types

    llama = module("models.llama.modeling_llama")
    assert compositions.scan_functions(llama) == {"apply_rotary_pos_emb": "hf_rotary"}
    assert compositions.COMPUTES["hf_rotary"] == "rotary"
    total = 0
    for name in ("mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo"):
        found = compositions.scan_functions(module(f"models.{name}.modeling_{name}"))
        total += found == {"apply_rotary_pos_emb": "hf_rotary"}
    assert total >= 4, total
    # GPT-NeoX rotates a partial head dim with its own code: its own form (three writings).
    assert compositions.scan_functions(module("models.gpt_neox.modeling_gpt_neox")) == {
        "apply_rotary_pos_emb": "hf_partial_rotary"}
    assert compositions.scan_functions(module("models.phi3.modeling_phi3")) == {
        "apply_rotary_pos_emb": "hf_partial_rotary_inline"}
    assert compositions.scan_functions(module("models.qwen3_next.modeling_qwen3_next")) == {
        "apply_rotary_pos_emb": "hf_partial_rotary_glm_doc"}
    assert compositions.COMPUTES["hf_partial_rotary"] == "rotary"
    # DINOv3's rotates the patch tokens only (its copies: EoMT-DINOv3's, Sapiens 2's).
    for name in ("dinov3_vit", "eomt_dinov3", "sapiens2"):
        assert compositions.scan_functions(module(f"models.{name}.modeling_{name}")) == {
            "apply_rotary_pos_emb": "hf_prefix_rotary"}, name
    assert compositions.COMPUTES["hf_prefix_rotary"] == "rotary"
    # GPT-OSS's: halves of the head dim, half-size tables (its own _apply_rotary_emb).
    assert compositions.scan_functions(module("models.gpt_oss.modeling_gpt_oss")) == {
        "apply_rotary_pos_emb": "gpt_oss_rotary"}
    # GPT-J's (CodeGen's): the interleaved rotary of one tensor, its helper rotate_every_two;
    # with another rotate_every_two it is not the form.
    for name in ("gptj", "codegen"):
        gptj_module = module(f"models.{name}.modeling_{name}")
        assert compositions.scan_functions(gptj_module) == {"apply_rotary_pos_emb": "gptj_rotary"}, name
        saved = gptj_module.rotate_every_two
        try:
            gptj_module.rotate_every_two = lambda x: x
            assert compositions.scan_functions(gptj_module) == {}, name
        finally:
            gptj_module.rotate_every_two = saved
    # GLM-4V's (GLM-OCR's) interleaved partial rotary, its rotate_half named rotate_half_llm.
    for name in ("glm4v", "glm_ocr"):
        assert compositions.scan_functions(module(f"models.{name}.modeling_{name}")) == {
            "apply_rotary_pos_emb": "glm4v_rotary_pairs_partial"}, name
    # The interleaved rotaries (rotate_half pairing 2p with 2p+1): GLM's, Cohere's, Ernie's.
    for name, form in (("glm", "hf_rotary_pairs_partial"), ("glm4", "hf_rotary_pairs_partial"),
                       ("moonshine", "hf_rotary_pairs_partial"), ("cohere", "cohere_rotary_pairs_upcast"),
                       ("cohere2", "cohere_rotary_pairs_upcast"), ("ernie4_5", "hf_rotary_pairs_upcast"),
                       ("blt", "hf_rotary_pairs"), ("nanochat", "hf_rotary_flipped")):
        interleaved = module(f"models.{name}.modeling_{name}")
        assert compositions.scan_functions(interleaved) == {"apply_rotary_pos_emb": form}, name
        assert compositions.COMPUTES[form] == "rotary"
    # Each calls its own rotate_half: GLM's code with Llama's rotate_half, or Llama's with GLM's,
    # is neither form.
    glm = module("models.glm4.modeling_glm4").apply_rotary_pos_emb
    glm = getattr(glm, "__wrapped__", glm)
    swapped = types.FunctionType(glm.__code__, dict(glm.__globals__, rotate_half=llama.rotate_half), glm.__name__,
                                 glm.__defaults__)
    assert compositions.function_form_of(swapped) is None
    f = getattr(llama.apply_rotary_pos_emb, "__wrapped__", llama.apply_rotary_pos_emb)
    swapped = types.FunctionType(f.__code__, dict(f.__globals__, rotate_half=glm.__globals__["rotate_half"]),
                                 f.__name__, f.__defaults__)
    assert compositions.function_form_of(swapped) is None
    # The same code calling another rotate_half is something else.
    f = llama.apply_rotary_pos_emb
    other = types.FunctionType(f.__code__, dict(f.__globals__, rotate_half=lambda x: x), f.__name__,
                               f.__defaults__)
    assert compositions.function_form_of(other) is None


@pytest.mark.parametrize("model, near", [
    ("llama", {}),
    ("gemma", {}),  # (1 + weight), the norm in fp32: its own form now
    ("gpt_neox", {}),  # partial rotary: a slice, then cat (its own form now)
    ("t5", {}),  # T5's RMSNorm (cast to the weight's dtype first): its own form now
    # the MLP's activation sparsity (its with_scale norm and one-tensor rotary: their own forms
    # now)
    ("gemma3n", {}),  # its gate's top activations kept first: its own form now
    ("phi3", {}),  # gate_up_proj, chunked: its own form now
    ("olmo2", {}),  # the weight multiplied in fp32, the rotary cast back: their own forms now
    ("exaone4_5", {}),  # the gated MLP returned without a name: its own form now
    ("glm", {}),  # interleaved rotary: its own form now
    ("gpt_oss", {}),  # halves rotated by chunk, half-width tables: its own form now
    ("openai_privacy_filter", {"apply_rotary_pos_emb": "hf_rotary"}),  # the same of interleaved pairs
])
def test_near_forms_name_what_is_like_a_known_form_but_is_not(model, near):
    """The coverage harness's guide to the forms to add next: what looks like a served form (its
    name, or the attributes its code reads) without being one; a recognised form is not near."""
    found = compositions.near_forms(module(f"models.{model}.modeling_{model}"))
    assert found == near, found


def test_the_coverage_report_covers_the_installed_transformers():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "coverage.py")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    llama = next(line for line in lines if line.startswith("| llama |"))
    for name in ("`LlamaRMSNorm` (hf_rms_norm)", "`LlamaMLP` (hf_gated_mlp)", "`apply_rotary_pos_emb` (hf_rotary)"):
        assert name in llama, llama
    gemma = next(line for line in lines if line.startswith("| gemma |"))
    assert "`GemmaRMSNorm` (gemma_rms_norm)" in gemma and gemma.endswith("| – |"), gemma
    # Qwen 3.5's gated norm, Cohere's interleaved rotary and GPT-J's (CodeGen's too) are
    # recognised; PE Audio's complex-product rotary and its copies are one group of the same
    # code, near a known form; Gemma 3n's norm and one-tensor rotary are forms of their own.
    qwen3_5 = next(line for line in lines if line.startswith("| qwen3_5 |"))
    assert "`Qwen3_5RMSNormGated` (qwen3_next_rms_norm_gated)" in qwen3_5, qwen3_5
    cohere = next(line for line in lines if line.startswith("| cohere |"))
    assert "`apply_rotary_pos_emb` (cohere_rotary_pairs_upcast)" in cohere, cohere
    for model in ("gptj", "codegen"):
        line = next(line for line in lines if line.startswith(f"| {model} |"))
        assert "`apply_rotary_pos_emb` (gptj_rotary)" in line and line.endswith("| – |"), line
    group = next(line for line in lines if "`pe_audio.apply_rotary_pos_emb`" in line)
    assert group.startswith("| hf_rotary | ") and int(group.split("|")[2]) >= 2, group
    gemma3n = next(line for line in lines if line.startswith("| gemma3n |"))
    for name in ("`Gemma3nRMSNorm` (gemma4_rms_norm)", "`apply_rotary_pos_emb` (hf_single_rotary)"):
        assert name in gemma3n, gemma3n


def test_the_coverage_training_part_reports_each_model(tmp_path):
    """The harness's training part, on CPU (stock only; the GPU runs both sides): a model that
    trains gets its row, one that cannot build gets its error, and the others still run."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "coverage.py"), "--train", "--device",
                           "cpu", "--models", "not_a_model,llama", "--chunk", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = (tmp_path / "coverage-train.md").read_text().splitlines()
    assert "1 of 2 train stock; 0 fail under torchfuse only." in rows
    llama = next(r for r in rows if r.startswith("| llama |"))
    assert llama.startswith("| llama | tiny |") and llama.endswith("|  |"), llama
    bad = next(r for r in rows if r.startswith("| not_a_model |"))
    assert "tiny: " in bad and "shallow: " in bad, bad
    # The table again from the run's JSONL (how a run cut by a time limit gets its table).
    again = tmp_path / "again"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "coverage.py"), "--train", "--device",
                           "cpu", "--models", "not_a_model,llama", "--from-jsonl", str(tmp_path / "coverage-train.jsonl"),
                           "--out", str(again)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (again / "coverage-train.md").read_text().splitlines() == rows


def test_every_served_form_has_its_one_rewrite():
    """The rewrite layer's one table holds a rewrite for each form compositions says is served,
    and nothing else."""
    from torchfuse import rewrites
    assert set(rewrites.REWRITES) == set(compositions.COMPUTES)
    assert all(callable(r.make) and r.calls for r in rewrites.REWRITES.values())


class _Sites:
    """Forwards whose input is passed only to `self` attributes' calls and read for its shape,
    or used otherwise (the analysis must then give up)."""

    def only_linears(self, x):
        n = x.shape[:-1]
        return self.a(x).view(*n, -1) + self.b(x)

    def branches(self, x):
        return self.a(x) if self.flag else self.b(x)

    def computed_with(self, x):
        return self.a(x) + self.b(x * 2)

    def passed_on(self, x):
        return self.a(x) + self.b(self.c(x), x)

    def by_keyword(self, x):
        return self.a(x) + self.b(input=x)

    def stored(self, x):
        y = x
        return self.a(y) + self.b(x)

    def reassigned(self, x):
        x = self.norm(x)
        return self.a(x) + self.b(x)

    def in_a_closure(self, x):
        return self.a(x) + (lambda: self.b(x))()

    def under_with(self, x):
        with self.ctx:
            return self.a(x) + self.b(x)

    def dtype_read(self, x):
        return self.a(x).to(x.dtype) + self.b(x)

    def self_reassigned(self, x):
        self = self.other
        return self.a(x) + self.b(x)

    def locals_read(self, x):
        return self.a(x) + self.b(locals()["x"])

    def a_function_of_it(self, x):
        return self.a(x) + torch_like.f(x)

    def conditional_callee(self, x):
        return (self.a if self.flag else self.b)(x) + self.c(x)

    def either_callee(self, x):
        return (self.maybe or self.b)(x) + self.c(x)


torch_like = None


@pytest.mark.parametrize("name,sites", [
    ("only_linears", ("a", "b")), ("branches", ("a", "b")), ("computed_with", None), ("passed_on", None),
    ("by_keyword", None), ("stored", None), ("reassigned", None), ("in_a_closure", None), ("under_with", None),
    ("dtype_read", None), ("self_reassigned", None), ("locals_read", None), ("a_function_of_it", None),
    ("conditional_callee", None), ("either_callee", None)])
def test_linear_input_sites_are_read_from_the_code_or_not_at_all(name, sites):
    assert compositions.linear_input_sites(getattr(_Sites, name)) == sites


def _decorated(function):
    import functools

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)

    return wrapper


class _Handoffs:
    """Layer forwards handing a norm's output to one submodule, or not only to it."""

    def assigned(self, x):
        residual = x
        x = self.norm(x)
        x, _ = self.attn(x, mask=self.mask)
        return x + residual

    def by_keyword(self, x):
        h = self.norm(x)
        out = self.attn(hidden_states=h, mask=None)
        return out + x

    def inline(self, x):
        return x + self.attn(self.norm(x)) + self.mlp(self.ln_2(x))

    def twice_to_one(self, x):
        h = self.norm(x)
        return self.attn(h) + self.attn(h)

    def in_a_loop(self, x):
        h = self.norm(x)
        for _ in range(2):
            x = x + self.attn(h)
        return x

    def in_a_comprehension(self, x):
        h = self.norm(x)
        return sum([self.attn(h) for _ in range(2)])

    def under_with(self, x):
        h = self.norm(x)
        with self.amp_off():
            return self.attn(h)

    @_decorated
    def decorated(self, x):
        h = self.norm(x)
        return self.attn(h)

    def kept_as_residual(self, x):
        h = self.norm(x)
        residual = h
        return self.attn(h) + residual

    def computed_with(self, x):
        h = self.norm(x)
        return self.attn(h * 2)

    def to_two_modules(self, x):
        h = self.norm(x)
        return self.attn(h) + self.mlp(h)

    def second_argument(self, x):
        h = self.norm(x)
        return self.attn(x, h)

    def norm_called_twice(self, x):
        h = self.norm(x)
        return self.attn(h) + self.norm(x)

    def inline_in_both_branches(self, x):
        if self.flag:
            return self.mlp(self.norm(x))
        return self.mlp(self.norm(x * 2))

    def inline_to_two_modules(self, x):
        return self.mlp(self.norm(x)) + self.attn(self.norm(x))

    def inline_by_keyword(self, x):
        return self.mlp(input=self.norm(x))

    def norm_passed_on(self, x):
        h = self.norm(x)
        return self.attn(h, self.norm)

    def reassigned_in_a_branch(self, x):
        h = self.norm(x)
        if self.flag:
            h = x
        return self.attn(h)

    def in_a_closure(self, x):
        h = self.norm(x)
        return self.attn(h) + (lambda: h)()

    def norm_with_keywords(self, x):
        h = self.norm(x, eps=1e-5)
        return self.attn(h)

    def reused_after_reassignment(self, x):
        h = self.norm(x)
        x = self.attn(h)
        h = x * 2
        return h + x


@pytest.mark.parametrize("name,pairs", [
    ("assigned", [("norm", "attn", 0)]), ("by_keyword", [("norm", "attn", "hidden_states")]),
    ("inline", [("norm", "attn", 0), ("ln_2", "mlp", 0)]), ("twice_to_one", []), ("in_a_loop", []),
    ("in_a_comprehension", []), ("under_with", []),
    ("decorated", [("norm", "attn", 0)]), ("reused_after_reassignment", [("norm", "attn", 0)]),
    ("kept_as_residual", []), ("computed_with", []), ("to_two_modules", []), ("second_argument", []),
    ("norm_called_twice", []), ("norm_passed_on", []), ("reassigned_in_a_branch", []), ("in_a_closure", []),
    ("norm_with_keywords", []), ("inline_in_both_branches", [("norm", "mlp", 0)]), ("inline_to_two_modules", []),
    ("inline_by_keyword", [("norm", "mlp", "input")])])
def test_norm_handoffs_are_read_from_the_code_or_not_at_all(name, pairs):
    assert compositions.norm_handoffs(getattr(_Handoffs, name)) == pairs


class _Consumers:
    def first_projection(self, x):
        x = self.fc1(x)
        x = self.act(x)
        return self.fc2(x)

    def projections(self, x):
        return self.q(x) + self.k(x)

    def first_projection_kept(self, x):
        y = self.fc1(x)
        return y + x

    def first_computed(self, x):
        x = self.fc1(x) * 2
        return x

    def starts_with_constants(self, x, flag=False):  # Swin2SR's encoder: an empty tuple's load fifth
        kept = ()
        more = () if flag else None
        return self.fc1(x) + x, kept, more


@pytest.mark.parametrize("name,found", [
    ("first_projection", ("x", ("fc1",))), ("projections", ("x", ("q", "k"))), ("first_projection_kept", None),
    ("first_computed", None), ("starts_with_constants", None)])
def test_consumer_inputs_are_read_from_the_code(name, found):
    assert compositions.consumer_input(getattr(_Consumers, name)) == found


@pytest.mark.parametrize("family,layer,pairs,consumers", [
    ("gpt2", "GPT2Block", (("ln_1", "attn", 0), ("ln_2", "mlp", 0)),
     {"GPT2Attention": ("hidden_states", ("q_attn", "c_attn")), "GPT2MLP": ("hidden_states", ("c_fc",))}),
    ("llama", "LlamaDecoderLayer", (("input_layernorm", "self_attn", "hidden_states"), ("post_attention_layernorm", "mlp", 0)),
     {"LlamaAttention": ("hidden_states", ("q_proj", "k_proj", "v_proj")), "LlamaMLP": ("x", ("gate_proj", "up_proj"))}),
    ("gpt_neox", "GPTNeoXLayer", (("input_layernorm", "attention", 0), ("post_attention_layernorm", "mlp", 0)),
     {"GPTNeoXAttention": ("hidden_states", ("query_key_value",)), "GPTNeoXMLP": ("hidden_states", ("dense_h_to_4h",))}),
    ("vit", "ViTLayer", (("layernorm_before", "attention", 0), ("layernorm_after", "mlp", 0)),
     {"ViTAttention": ("hidden_states", ("q_proj", "k_proj", "v_proj"))})])
def test_norm_handoffs_found_in_hf_layers(family, layer, pairs, consumers):
    """The layers' norms and the modules taking their output (GPT-NeoX's post-attention norm in
    both branches of its residual choice), and those modules' classes
    passing their input only to their projections (GPT-2's attention to q_attn too, made only
    for cross-attention)."""
    m = module(f"models.{family}.modeling_{family}")
    found = {cls.__name__: v for cls, v in compositions.scan_norm_handoffs(m).items()}
    assert found == {layer: pairs}, found
    read = {cls.__name__: v for cls, v in compositions.scan_consumers(m).items()}
    assert {name: read.get(name) for name in consumers} == consumers, read


@pytest.mark.parametrize("family,attention,mlp", [
    ("llama", "LlamaAttention", "LlamaMLP"), ("qwen2", "Qwen2Attention", "Qwen2MLP"),
    ("qwen3", "Qwen3Attention", "Qwen3MLP"), ("mistral", "MistralAttention", "MistralMLP"),
    ("gemma2", "Gemma2Attention", "Gemma2MLP")])
def test_shared_inputs_found_in_hf_attention_and_gated_mlps(family, attention, mlp):
    found = {cls.__name__: v for cls, v in
             compositions.scan_shared_inputs(module(f"models.{family}.modeling_{family}")).items()}
    assert found[attention] == ("hidden_states", ("q_proj", "k_proj", "v_proj")), found
    assert found[mlp] == ("x", ("gate_proj", "up_proj")), found
    # Phi-3's packed projections take their input once: nothing to share.
    assert not compositions.scan_shared_inputs(module("models.phi3.modeling_phi3"))
