"""The rewrite layer: known compositions in library code sent to one op torchfuse serves.

When `transformers.activations` or a `transformers.models.<name>.modeling_<name>` module is
imported, every class defined there whose `forward` is a known form (compositions.py: by its
code, not its name) gets a forward that calls torchfuse's op instead, provided the op's
toggle is on (`TORCHFUSE_OPS`). The same holds for known module-level functions (the causal-LM
loss in `transformers.loss.loss_utils`, also replaced in its LOSS_MAPPING, from which every
model's `loss_function` is taken; the models' `apply_rotary_pos_emb`; in
`transformers.masking_utils`, HF's decisions to build no attention mask, see
`_mask_skip_under_compile`; in `transformers.cache_utils`, the KV cache's first append). Each
rewrite is logged
once at info; a class that looks like one (its name says RMSNorm or GELU) but whose code differs
is left alone and logged at debug.

The new forward calls the op only for plain CUDA tensors of a dtype the op serves, outside
torch.compile (Inductor fuses the original composition itself, and sees torchfuse's aten
overrides where it does not; the causal-LM loss, whose kernel is faster than Inductor's, is
the exception) and torch.func's transforms (grad, vmap: the ops' C++ autograd
cannot run under them), and only while everything the original calls through its globals
(`torch.tanh`, `nn.functional.cross_entropy`, `rotate_half`, ...) is what it was when the code
was recognised: a patch of any of them (z-loss, Liger's cross-entropy) makes the original code,
which calls the patch, run. Everything else runs the original code. The ops return what
the original would: same dtype (under autocast too), shape and strides (GPT-2's MLP, whose
intermediate the caller never sees, passes its GELU's result to the next matmul in the dtype
that matmul would have cast it to); their calls are
counted in torchfuse's stats, and `torch.ops.torchfuse.set_enabled(name, False)` sends them to
PyTorch's own kernels.
"""
import functools
import inspect
import sys
import threading
import types
import typing

from . import compositions
from ._library import enabled_toggles, note, rewrite_switch

# Class-name fragments of compositions we know of but may not recognise in every model (a
# different form): those classes are logged at debug as left alone.
_LOOKALIKES = ("RMSNorm", "GELU")


def is_model_module(name):
    """`transformers.models.<name>.modeling_<name>`-shaped module names."""
    parts = name.split(".")
    return len(parts) == 4 and parts[:2] == ["transformers", "models"] and parts[3].startswith(
        "modeling_")


MODULES = ("transformers.activations", "transformers.loss.loss_utils", "transformers.masking_utils",
           "transformers.integrations.moe", "transformers.cache_utils", "transformers.pytorch_utils")


def wants(name):
    """Whether the module of this name holds compositions the layer may rewrite."""
    return name in MODULES or is_model_module(name)


def _served_dtypes(torch):
    """The dtypes torchfuse's kernels take (anything else runs the original code)."""
    return (torch.float32, torch.bfloat16, torch.float16)


def _unobserved(torch, module):
    """Nothing but the module's own forward sees or changes its call: no hooks of its own or
    global ones, no forward set on the instance, no `__call__` of its class's own."""
    base = torch.nn.Module
    kind = type(module)
    return ("forward" not in module.__dict__
            and kind.__call__ is base.__call__ and kind._call_impl is base._call_impl
            and not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                     or module._backward_pre_hooks)
            and not _global_module_hooks(torch))


def _untraced_call(torch):
    """A function telling whether this call runs outside torch.compile and torch.func's
    transforms, with the rewrites not switched off by torchfuse.disable(): where a rewrite may
    run."""
    compiling, transforms = torch.compiler.is_compiling, torch._C._are_functorch_transforms_active
    return lambda: rewrite_switch.on and not compiling() and not transforms()


# Rewritten forward -> (the form it replaced, the original's Dependencies), for rewrites that
# look at a submodule's forward.
_REWRITTEN = {}


def _gelu_forward(torch, original, form, dependencies=None, widens=False):
    """HF's tanh GELU in one op; `widens`: the form calls torch.pow, which CUDA autocast runs in
    fp32 (its fp32 list), so its result is fp32 whatever the input's dtype."""
    op = torch.ops.torchfuse.gelu_tanh.default
    tensor, served, fp32 = torch.Tensor, _served_dtypes(torch), torch.float32
    untraced, autocast = _untraced_call(torch), torch.is_autocast_enabled
    unchanged = (dependencies or compositions.Dependencies(original)).unchanged

    @functools.wraps(original)
    def forward(self, input):
        if (type(input) is tensor and input.is_cuda and input.dtype in served and untraced()
                and unchanged()):
            return op(input, fp32 if widens and autocast("cuda") else input.dtype)
        return original(self, input)

    return forward


def _llama_norm(torch, original, dependencies=None, eps_attribute="variance_epsilon"):
    """Llama's RMSNorm of a module's x, `weight * (x.float() * rstd).to(x.dtype)`, as one op: a
    function (module, x) -> the result, or None where the original must run. A 16-bit x with an
    fp32 weight (q/k norms under autocast: the projection's output is 16-bit, the weight fp32)
    is HF's norm without a weight, rounded to x's dtype, times the fp32 weight (an fp32 result,
    by promotion): aten::rms_norm of x with no weight (fp32 statistics, the result rounded once
    to x's dtype; autocast leaves rms_norm alone), then the original's multiply: two kernels for
    eight. Any other call goes to torchfuse::hf_rms_norm, which serves x and a weight of one
    dtype and runs the composition otherwise. The module's eps is its `eps_attribute`."""
    op, rms_norm = torch.ops.torchfuse.hf_rms_norm.default, torch.rms_norm
    tensor, parameter, fp32 = torch.Tensor, torch.nn.Parameter, torch.float32
    untraced, plain = _untraced_call(torch), _norm_call(torch, original, dependencies)
    unchanged = (dependencies or compositions.Dependencies(original)).unchanged

    def norm(module, x):
        weight, eps = module.weight, getattr(module, eps_attribute)
        if (type(x) is tensor and type(weight) in (tensor, parameter) and weight.dtype == fp32
                and x.dtype != fp32 and x.dim() >= 1 and x.shape[-1] >= _RMS_NORM_MIN_HIDDEN
                and plain(x, weight, eps)):
            return _row_wise(x, lambda rows: weight * rms_norm(rows, (x.shape[-1],), None, eps))
        if (type(x) is tensor and x.is_cuda and type(weight) in (tensor, parameter)
                and type(eps) is float and untraced() and unchanged()):
            return _row_wise(x, lambda rows: op(rows, weight, eps))
        return None

    return norm


def _rms_norm_forward(torch, original, form, dependencies=None):
    """Llama's RMSNorm (LlamaRMSNorm and its copies) in one op (`_llama_norm`)."""
    norm = _llama_norm(torch, original, dependencies)

    @functools.wraps(original)
    def forward(self, hidden_states):
        out = norm(self, hidden_states)
        return original(self, hidden_states) if out is None else out

    _NARROWERS[forward] = _rms_norm_narrower(torch, original, dependencies)
    return forward


def _rms_norm_narrower(torch, original, dependencies=None):
    """The `_NARROWERS` entry of Llama's RMSNorm rewritten (`_rms_norm_forward`): for an fp32 x
    of row-major strides (the wrapper has checked it contiguous; a size-1 dim's stride may still
    differ, where `_row_wise` gives the original its way) and an fp32 weight, that forward
    returns torchfuse::hf_rms_norm's fp32 result, which the consumers cast to bf16;
    torchfuse::norm_cast (rms) is that op and that cast in one. The op is looked up at each call:
    it is defined only where its toggle is registered, and only norm_cast's rewrite calls a
    narrower."""
    plain, fp32, bf16 = (torch.Tensor, torch.nn.Parameter), torch.float32, torch.bfloat16
    untraced = _untraced_call(torch)
    unchanged = (dependencies or compositions.Dependencies(original)).unchanged

    def narrow(module, x):
        own = module.__dict__
        weight, eps = own["_parameters"].get("weight"), own.get("variance_epsilon")
        if (type(weight) in plain and weight.dtype == fp32 and weight.shape == x.shape[-1:]
                and weight.device == x.device and type(eps) is float and "weight" not in own
                and x.stride() == _row_major_strides(x.shape) and untraced() and unchanged()):
            return torch.ops.torchfuse.norm_cast.default(x, weight, None, eps, True, bf16)
        return None

    return narrow


def _row_major_strides(shape):
    """The strides of a freshly made tensor of this shape (a size-1 dim's too)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _llama4_rms_norm_forward(torch, original, form, dependencies=None):
    """Llama 4's text RMSNorm (and its copies): Gemma's `_norm` of `x.float()`, rounded to x's
    dtype, times the weight: Llama's composition, served as Llama's (`_llama_norm`), its eps in
    `self.eps`. The instance's `_norm` must be the recognised one (it reads that eps)."""
    norm, known_norm = _llama_norm(torch, original, dependencies, "eps"), _own_norm("gemma_norm")

    @functools.wraps(original)
    def forward(self, x):
        out = norm(self, x) if known_norm(self) else None
        return original(self, x) if out is None else out

    return forward


def _global_module_hooks(torch):
    """Whether global module hooks are set: they see every module's call, an activation
    module's the original builds and calls among them."""
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                or hooks._global_backward_hooks or hooks._global_backward_pre_hooks)


def _norm_then_gate_forward(torch, original, form, dependencies=None):
    """Qwen3-Next's gated RMSNorm (Qwen3.5's, OLMo-Hybrid's): Llama's RMSNorm of x
    (`_llama_norm`: one op), then times act(gate) in fp32, cast back to x's dtype, the gating as
    the original computes it. Served where `self.activation` is "silu" and HF's ACT2FN builds
    its SiLUActivation for it (whose call is F.silu; no global module hooks to see that call):
    F.silu is called directly. Anything else runs the original."""
    dependencies = (dependencies or compositions.Dependencies(original)).add(vars(torch.nn),
                                                                             ("functional", "silu"))
    norm, kind_of = _llama_norm(torch, original, dependencies), _activation_kinds(torch)
    silu, fp32, tensor = torch.nn.functional.silu, torch.float32, torch.Tensor
    act2fn = original.__globals__.get("ACT2FN")
    getitem = type(act2fn).__getitem__

    def builds_silu(name):
        entry = dict.get(act2fn, name) if isinstance(act2fn, dict) else None
        return isinstance(entry, type) and kind_of(entry) == "silu"

    @functools.wraps(original)
    def forward(self, hidden_states, gate):
        activation = self.activation
        if (type(gate) is tensor and type(activation) is str and activation == "silu"
                and type(act2fn).__getitem__ is getitem and builds_silu(activation)
                and not _global_module_hooks(torch)):
            out = norm(self, hidden_states)
            if out is not None:
                return (out * silu(gate.to(fp32))).to(hidden_states.dtype)
        return original(self, hidden_states, gate)

    return forward


def _rows_view(x):
    """x with its dims ordered as they lie in memory, if that is dense with the last dim
    innermost (q and k heads as HF transposes them out of a projection), else None; and the
    permutation back (None where x is contiguous). A row-wise op of that view, permuted back,
    has x's strides, as an elementwise composition's result has."""
    if x.is_contiguous():
        return x, None
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    view = x.permute(order)
    if order[-1] != x.dim() - 1 or not view.is_contiguous():
        return None, None
    return view, sorted(range(x.dim()), key=order.__getitem__)


def _row_wise(x, norm):
    """`norm` (a row-wise op returning a dense result) of x as it lies in memory, permuted back
    to x's strides, which the original's elementwise composition keeps; None where that cannot
    be had (x not dense, or strides a dense result cannot take): the original runs."""
    rows, back = _rows_view(x)
    if rows is None:
        return None
    out = norm(rows)
    out = out if back is None else out.permute(back)
    return out if out.stride() == x.stride() else None


# Narrower rows keep the original's code: aten's fused RMSNorm backward is off a float64
# reference where the input gradient nearly cancels (measured on one-feature rows; the same
# bound as HF_RMS_NORM_MIN_HIDDEN in src/ops/norm.rs for the Llama form).
_RMS_NORM_MIN_HIDDEN = 32


def _norm_call(torch, original, dependencies=None):
    """A function telling whether a call of an RMSNorm form (x, its weight, its eps) may go to
    a norm op: a plain CUDA x of a served dtype, a plain 1-D weight of x's width (`None` only
    where the caller says the form has none: `weightless=True`), a float eps, outside traces,
    and what the original calls unchanged."""
    tensor, weight_types = torch.Tensor, (torch.Tensor, torch.nn.Parameter)
    served, untraced = _served_dtypes(torch), _untraced_call(torch)
    unchanged = (dependencies or compositions.Dependencies(original)).unchanged

    def plain(x, weight, eps, weightless=False):
        return (type(x) is tensor and x.is_cuda and x.dtype in served and x.dim() >= 1
                and ((weightless and weight is None)
                     or (type(weight) in weight_types and weight.dim() == 1 and weight.shape[0] == x.shape[-1]))
                and type(eps) is float and untraced() and unchanged())

    return plain


def _own_norm(norm_form):
    """A function telling whether a module's `_norm` (what its forward calls) is the instance's
    own method and of the known form `norm_form`, with what it calls unchanged: another
    instance's `_norm` reads another eps, a replaced one computes something else."""
    norms = {}  # a _norm function -> its Dependencies if it is the known form, else None

    def known_norm(self):
        method = self._norm
        function = getattr(method, "__func__", None)
        if getattr(method, "__self__", None) is not self:
            return False
        if function not in norms:
            known = compositions.form_of(function) == norm_form
            norms[function] = compositions.Dependencies(function) if known else None
        dependencies = norms[function]
        return dependencies is not None and dependencies.unchanged()

    return known_norm


def _gemma_rms_norm_forward(torch, original, form, dependencies=None):
    """Gemma's RMSNorm: x normalised in fp32, times `1 + weight` in fp32, rounded once to x's
    dtype. That is aten::rms_norm of `x.float()` with the weight `1.0 + weight.float()` (as the
    original makes it, so its gradient reaches the weight the same way), then the original's
    cast: one norm kernel (torchfuse's `_fused_rms_norm`, where it serves the shape) where the
    original launches six. The instance's `_norm` must be the recognised one (what forward
    calls), and what it calls unchanged."""
    rms_norm, served = torch.rms_norm, _served_dtypes(torch)
    plain, known_norm = _norm_call(torch, original, dependencies), _own_norm("gemma_norm")

    @functools.wraps(original)
    def forward(self, x):
        weight, eps = self.weight, self.eps
        if (plain(x, weight, eps) and x.shape[-1] >= _RMS_NORM_MIN_HIDDEN
                and weight.dtype in served and known_norm(self)):
            out = _row_wise(x, lambda rows: rms_norm(rows.float(), (x.shape[-1],),
                                                     1.0 + weight.float(), eps).type_as(x))
            if out is not None:
                return out
        return original(self, x)

    return forward


def _mamba_gated_rms_norm_forward(torch, original, form, dependencies=None):
    """Mamba 2's gated RMSNorm (MambaRMSNormGated and its copies: Bamba's, Granite 4's): x times
    silu(gate) in fp32, that normalised in fp32, the weight times it in x's dtype. The gating
    stays the original's ops; the norm is aten::rms_norm of the fp32 product without a weight
    (one fused kernel where the original runs five, in fp32 as it computes), then the original's
    cast and weight multiply. A gate that is not a plain tensor runs the original."""
    rms_norm, silu, fp32, tensor = torch.rms_norm, torch.nn.functional.silu, torch.float32, torch.Tensor
    plain = _norm_call(torch, original, dependencies)

    @functools.wraps(original)
    def forward(self, hidden_states, gate=None):
        eps = self.variance_epsilon
        if ((gate is None or type(gate) is tensor) and plain(hidden_states, self.weight, eps)
                and hidden_states.shape[-1] >= _RMS_NORM_MIN_HIDDEN):
            input_dtype = hidden_states.dtype
            x = hidden_states.to(fp32)
            if gate is not None:
                x = x * silu(gate.to(fp32))
            out = _row_wise(x, lambda rows: rms_norm(rows, (x.shape[-1],), None, eps))
            if out is not None:
                return self.weight * out.to(input_dtype)
        return original(self, hidden_states, gate)

    return forward


def _own_norm_in_fp32(torch, original, dependencies, norm_form, weight_of):
    """The forward of a norm form that calls its instance's `_norm` (of the known form
    `norm_form`) on `x.float()`, times the weight in fp32 where it has one, and casts back to
    x's dtype once: aten::rms_norm of `x.float()` with the weight in fp32 or none (torchfuse's
    _fused_rms_norm), then the original's cast. `weight_of(module)` is the weight the form
    multiplies by, None where it multiplies by none, or False where the call is not one the
    rewrite knows (the original runs). Rows under 32 features run the original; a strided x is
    normalised as it lies in memory (`_row_wise`)."""
    rms_norm, served = torch.rms_norm, _served_dtypes(torch)
    plain, known_norm = _norm_call(torch, original, dependencies), _own_norm(norm_form)

    @functools.wraps(original)
    def forward(self, x):
        weight, eps = weight_of(self), self.eps
        if (weight is not False and plain(x, weight, eps, weightless=weight is None)
                and x.shape[-1] >= _RMS_NORM_MIN_HIDDEN and (weight is None or weight.dtype in served)
                and known_norm(self)):
            out = _row_wise(x, lambda rows: rms_norm(rows.float(), (x.shape[-1],),
                                                     None if weight is None else weight.float(), eps).type_as(x))
            if out is not None:
                return out
        return original(self, x)

    return forward


def _gemma4_rms_norm_forward(torch, original, form, dependencies=None):
    """Gemma 4's and Gemma 3n's RMSNorm (and their copies): x normalised in fp32 (rstd as
    `pow(mean + eps, -0.5)`), times the weight in fp32 where `with_scale` (v_norm has none),
    rounded once to x's dtype (`_own_norm_in_fp32`: rsqrt for pow(., -0.5), the same value to an
    fp32 rounding). A `with_scale` other than a bool runs the original."""
    def weight_of(module):
        scaled = module.with_scale
        if type(scaled) is not bool:
            return False
        # Scaled without a weight: the original's error.
        return _weight_or_false(module) if scaled else None

    return _own_norm_in_fp32(torch, original, dependencies, "gemma4_norm", weight_of)


def _fp32_own_norm_forward(torch, original, form, dependencies=None):
    """Moshi's RMSNorm (Kyutai's speech-to-text's), times its weight, and the weightless one
    (Llama 4's q/k L2 norm, NanoChat's, EsmFold 2's, HRM's, FalconMamba's, whose weight buffer
    is never read): Gemma's `_norm` of `x.float()` (x times rsqrt of its mean square plus eps),
    cast back once (`_own_norm_in_fp32`)."""
    weighted = form == "moshi_rms_norm"
    return _own_norm_in_fp32(torch, original, dependencies, "gemma_norm",
                             lambda module: _weight_or_false(module) if weighted else None)


def _unweighted_rms_norm_forward(torch, original, form, dependencies=None):
    """DeepSeek-V4's weightless RMSNorm (GLM-5-next's): x times its rsqrt factor computed in
    fp32 and rounded to x's dtype. aten::rms_norm of x without a weight (torchfuse's
    _fused_rms_norm: fp32 statistics, the result rounded once to x's dtype, where the original
    rounds the factor and then the product: closer to exact); rows under 32 features run the
    original; a strided x is normalised as it lies in memory (`_row_wise`)."""
    rms_norm, plain = torch.rms_norm, _norm_call(torch, original, dependencies)

    @functools.wraps(original)
    def forward(self, x):
        eps = self.eps
        if plain(x, None, eps, weightless=True) and x.shape[-1] >= _RMS_NORM_MIN_HIDDEN:
            out = _row_wise(x, lambda rows: rms_norm(rows, (x.shape[-1],), None, eps))
            if out is not None:
                return out
        return original(self, x)

    return forward


def _weight_or_false(module):
    """The module's weight for a form that multiplies by it, or False where it has none (no
    attribute, or None): the original runs, and raises its own error."""
    weight = getattr(module, "weight", None)
    return False if weight is None else weight


def _t5_rms_norm_forward(torch, original, form, dependencies=None):
    """T5's RMSNorm (T5LayerNorm and its copies): x times rstd is fp32 (x promoted), rounded to
    the weight's dtype where that is 16-bit, then times the weight. With an fp32 weight that is
    aten::rms_norm of `x.float()` (fp32 out, as the original's promotion gives); with a 16-bit
    weight of x's dtype its forward is Llama's composition, torchfuse::hf_rms_norm (whose x
    gradient is rounded once, where the original's two 16-bit paths are rounded and summed in
    16 bits: closer to exact). Other dtype pairs, and rows under 32 features with an fp32
    weight, run the original; a strided x is normalised as it lies in memory (`_row_wise`)."""
    rms_norm, hf_rms_norm = torch.rms_norm, torch.ops.torchfuse.hf_rms_norm.default
    fp32, plain = torch.float32, _norm_call(torch, original, dependencies)

    @functools.wraps(original)
    def forward(self, hidden_states):
        x, weight, eps = hidden_states, self.weight, self.variance_epsilon
        if plain(x, weight, eps):
            out = None
            if weight.dtype == x.dtype and weight.dtype != fp32:
                out = _row_wise(x, lambda rows: hf_rms_norm(rows, weight, eps))
            elif weight.dtype == fp32 and x.shape[-1] >= _RMS_NORM_MIN_HIDDEN:
                out = _row_wise(x, lambda rows: rms_norm(rows.float(), (x.shape[-1],), weight, eps))
            if out is not None:
                return out
        return original(self, hidden_states)

    return forward


def _fp32_norm_forward(torch, original, dependencies, norm):
    """The forward of a norm form computed wholly in fp32 and cast back once: `x.float()`
    normalised, times the weight in fp32 (a 16-bit one promoted exactly), `.to(x's dtype)`;
    its `self.weight` and `self.variance_epsilon`. That is `norm(x.float(), width, weight in
    fp32, eps)`, one aten norm, then the original's cast. A 1-D weight of x's width and a
    served dtype only, rows of 32 features or more (as every norm rewrite); a strided x is
    normalised as it lies in memory (`_row_wise`); anything else runs the original."""
    served, plain = _served_dtypes(torch), _norm_call(torch, original, dependencies)

    @functools.wraps(original)
    def forward(self, hidden_states):
        x, weight, eps = hidden_states, self.weight, self.variance_epsilon
        if plain(x, weight, eps) and x.shape[-1] >= _RMS_NORM_MIN_HIDDEN and weight.dtype in served:
            width = (x.shape[-1],)
            out = _row_wise(x, lambda rows: norm(rows.float(), width, weight.float(), eps).to(x.dtype))
            if out is not None:
                return out
        return original(self, hidden_states)

    return forward


def _gpt_oss_rms_norm_forward(torch, original, form, dependencies=None):
    """GPT-OSS's RMSNorm and its copies (OLMo 2 and 3, AFMoE, FlexOlmo; Helium's, its weight
    cast to fp32 first): Llama's statistics in fp32, then `(weight * x_normed).to(x's dtype)`
    with the weight multiplied in fp32:
    aten::rms_norm of `x.float()` (torchfuse's _fused_rms_norm), then the cast; one norm kernel
    and a cast where the original launches seven."""
    return _fp32_norm_forward(torch, original, dependencies, torch.rms_norm)


def _cohere_layer_norm_forward(torch, original, form, dependencies=None):
    """Cohere's LayerNorm (and its copies): mean and variance of x in fp32, no bias, times the
    weight in fp32, cast back: aten::layer_norm of `x.float()` (torchfuse's native_layer_norm
    where it serves), then the cast. Cohere's q/k norms carry a weight per head (2-D): the
    original runs them."""
    layer_norm = torch.layer_norm
    return _fp32_norm_forward(torch, original, dependencies,
                              lambda x, width, weight, eps: layer_norm(x, width, weight, None, eps))


def _exporting(torch):
    """A function telling whether torch.export is tracing: the flag it sets, read as a global
    Dynamo guards on (`is_exporting()` itself is True in any Dynamo trace). Without the flag
    (another torch), as if exporting."""
    compiler = torch.compiler
    return lambda: getattr(compiler, "_is_exporting_flag", True)


def _mask_skip_under_compile(torch, original, form, dependencies=None):
    """HF's decision to build no SDPA mask where none is needed (a causal mask with no padding:
    SDPA's `is_causal=True`; a bidirectional one: no mask), taken in eager and refused by the
    original in any trace, because an exported program would keep it for any input
    (pytorch#108108). Under torch.compile, not export, and without a padding mask, the decision
    depends on sizes only, which Dynamo guards on (a size that changes it recompiles): there
    this takes the original's eager decision, so a compiled model's attention runs the causal
    kernels as in eager instead of a materialised mask (cuDNN's attention 2.3x slower with one,
    GPT-2 at B32). Elsewhere, and wherever the original would read a padding mask's values,
    the original decides. Only what the sizes settle without a new guard is taken: a symbolic
    length against a sliding window (Mistral, Gemma 2/3's local layers under dynamic shapes)
    keeps the original's mask, since the guard would break a ranged `mark_dynamic`."""
    compiling, exporting = torch.compiler.is_compiling, _exporting(torch)
    # True only where the sizes settle it without a new guard (the same symbol on both sides,
    # or plain ints): a guard the original never made could break a ranged `mark_dynamic`.
    known = torch.fx.experimental.symbolic_shapes.statically_known_true

    def eager_decision_is_shape_only(padding_mask):
        return padding_mask is None and rewrite_switch.on and compiling() and not exporting()

    def outside_window(kv_length, local_attention_size):
        return local_attention_size is None or known(kv_length < local_attention_size)

    if form == "hf_ignore_causal_mask_sdpa":
        @functools.wraps(original)
        def ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset,
                                    local_attention_size=None):
            if (eager_decision_is_shape_only(padding_mask)
                    and outside_window(kv_length, local_attention_size)
                    and (known(q_length == 1) or known(kv_length == q_length))):
                return True
            # Elsewhere the original's answer in a trace (False: build the mask) is eager's too,
            # or its next case reads q_offset, a tensor under a cache.
            return original(padding_mask, q_length, kv_length, q_offset, kv_offset,
                            local_attention_size)

        return ignore_causal_mask_sdpa

    on_xpu = original.__globals__.get("_is_torch_xpu_available") is not False

    @functools.wraps(original)
    def ignore_bidirectional_mask_sdpa(padding_mask, kv_length, local_attention_size=None):
        if (not on_xpu and eager_decision_is_shape_only(padding_mask)
                and outside_window(kv_length, local_attention_size)):
            return True
        return original(padding_mask, kv_length, local_attention_size)

    return ignore_bidirectional_mask_sdpa


def _causal_lm_loss(torch, original, form, dependencies=None):
    """HF's ForCausalLMLoss with the loss computed by torchfuse::cross_entropy from the logits
    as they are (fp32 arithmetic, fp32 loss, as the original's `logits.float()` gives), so the
    fp32 copy of the logits is never made. Labels are shifted, flattened and reduced as the
    original does (`mean`, or `sum` / num_items_in_batch)."""
    op = torch.ops.torchfuse.cross_entropy.default
    tensor, served, fp32 = torch.Tensor, _served_dtypes(torch), torch.float32
    untraced, pad, is_tensor = _untraced_call(torch), torch.nn.functional.pad, torch.is_tensor
    compiling, exporting = torch.compiler.is_compiling, _exporting(torch)
    unchanged = compositions.Dependencies(original).unchanged  # fixed_cross_entropy's too
    # Under torch.compile the op runs too (the one rewrite measured faster than Inductor's
    # kernels for its composition: docs/bench/compile): the check of the original's
    # dependencies is made once per trace, as a constant of the graph.
    @torch.compiler.assume_constant_result
    def unchanged_when_traced():
        return unchanged()

    mean, total = 1, 2  # at::Reduction

    @functools.wraps(original)
    def loss_function(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                      shift_labels=None, **kwargs):
        if type(logits) is not tensor or not logits.is_cuda or logits.dtype not in served \
                or type(ignore_index) is not int:
            return original(logits, labels, vocab_size, num_items_in_batch, ignore_index,
                            shift_labels, **kwargs)
        if compiling():
            # Contiguous logits: the view below is the original's view of its fp32 copy. An
            # exported program keeps the original (it must load without torchfuse).
            if not (rewrite_switch.on and not exporting() and logits.is_contiguous()
                    and unchanged_when_traced()):
                return original(logits, labels, vocab_size, num_items_in_batch, ignore_index,
                                shift_labels, **kwargs)
            flat_logits = logits.view(-1, vocab_size)
        elif not untraced() or not unchanged():
            return original(logits, labels, vocab_size, num_items_in_batch, ignore_index,
                            shift_labels, **kwargs)
        else:
            try:  # logits the original's view of its fp32 copy would reject: its error, its way
                flat_logits = logits.view(-1, vocab_size)
            except RuntimeError:
                return original(logits, labels, vocab_size, num_items_in_batch, ignore_index,
                                shift_labels, **kwargs)
        if shift_labels is None:
            labels = pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:].contiguous()
        shift_labels = shift_labels.view(-1).to(logits.device)
        loss = op(flat_logits, shift_labels, mean if num_items_in_batch is None else total,
                  ignore_index, 0.0, fp32)
        if num_items_in_batch is not None:
            if is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss

    return loss_function


def _activation_kinds(torch):
    """A function telling what an activation module class computes, by its code: "silu"
    (nn.SiLU, HF's SiLUActivation), "gelu_attribute" (HF's GELUTanh: what its `act` attribute
    computes) or None; remembered per (class, its forward), so a forward patched later is looked
    at again."""
    kinds = {}

    def kind_of(kind):
        key = (kind, kind.__dict__.get("forward"))
        found = kinds.get(key, False)
        if found is False:
            found = kinds[key] = ("silu" if compositions.is_silu(kind, torch) else
                                  "gelu_attribute" if compositions.is_gelu_tanh_by_attribute(kind, torch)
                                  else None)
        return found

    return kind_of


def _gated_mlp_call(torch, original, dependencies=None):
    """A function telling which op a call of a gated-MLP form (its input, its activation) may go
    to: "silu" (SiLU-and-multiply) or "gelu_tanh" (tanh-GELU-and-multiply), else None. Served: a
    plain CUDA tensor in, outside traces, an activation computing SiLU (nn.SiLU, HF's
    SiLUActivation; not in place) or the tanh GELU (HF's GELUTanh whose `act` is F.gelu with
    approximate="tanh" and nothing else), nothing else seeing or changing its call, and what the
    original calls unchanged, the SiLU nn.SiLU and HF's SiLUActivation call among it."""
    tensor, untraced = torch.Tensor, _untraced_call(torch)
    unchanged = (dependencies or compositions.Dependencies(original)).add(vars(torch.nn),
                                                                          ("functional", "silu")).unchanged
    gelu, partial = torch._C._nn.gelu, functools.partial
    kind_of = _activation_kinds(torch)

    def activation(act):
        kind = kind_of(type(act))
        if kind == "silu":
            name = None if getattr(act, "inplace", False) else "silu"
        elif kind == "gelu_attribute":
            fn = vars(act).get("act")
            name = ("gelu_tanh" if type(fn) is partial and fn.func is gelu and not fn.args
                    and fn.keywords == {"approximate": "tanh"} else None)
        else:
            return None
        return name if name is not None and _unobserved(torch, act) else None

    def served(x, act):
        if type(x) is tensor and x.is_cuda and untraced() and unchanged():
            return activation(act)
        return None

    return served


def _gated_mlp_forward(torch, original, form, dependencies=None):
    """HF's gated MLP with act(gate) * up in one op where act_fn is SiLU (torchfuse::silu_mul:
    Llama's and its copies) or the tanh GELU (torchfuse::gelu_tanh_mul: Gemma's), and gate and
    up agree in dtype and shape; the matmuls are the module's own. Llama 4's form names its
    activation `activation_fn`. The forms' own steps around it (`_GATED_MLP_STEPS`) run as
    their originals write them."""
    ops = {"silu": torch.ops.torchfuse.silu_mul.default, "gelu_tanh": torch.ops.torchfuse.gelu_tanh_mul.default}
    act_attribute = "activation_fn" if form == "llama4_gated_mlp" else "act_fn"
    gate_step, up_step, product_step, output_step = _GATED_MLP_STEPS.get(form, (None, None, None, None))
    dropout = torch.nn.functional.dropout
    tensor, served = torch.Tensor, _served_dtypes(torch)
    takes = _gated_mlp_call(torch, original, dependencies)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        # The forms name their input differently (x, hidden_state): a call by keyword, or of
        # another arity, is the original's.
        x = args[0] if len(args) == 1 and not kwargs else None
        act = getattr(self, act_attribute)
        activation = takes(x, act)
        if activation is None:
            return original(self, *args, **kwargs)
        gate = self.gate_proj(x)
        if gate_step:
            gate = gate_step(self, gate)
        up = self.up_proj(x)
        if up_step:
            up = up_step(self, up)
        if (type(gate) is tensor and type(up) is tensor and gate.dtype == up.dtype
                and gate.dtype in served and gate.shape == up.shape):
            product = ops[activation](gate, up)
        else:
            product = act(gate) * up
        out = self.down_proj(product_step(self, product) if product_step else product)
        return output_step(self, out, dropout) if output_step else out

    return forward


# The gated-MLP forms' steps besides act(gate) * up, each as its original writes it: (to the
# gate before the activation, to up, to the product before down_proj, to the output (given
# F.dropout, the function the original calls: `takes` checks it is unchanged)).
_GATED_MLP_STEPS = {
    # Gemma 3n's: its gate's top activations kept first where its layer's sparsity is above 0.
    "gemma3n_gated_mlp": (lambda self, gate: self._gaussian_topk(gate) if self.activation_sparsity > 0.0 else gate,
                          None, None, None),
    # T5Gemma's: its dropout module on the product.
    "t5gemma_gated_mlp": (None, None, lambda self, product: self.dropout(product), None),
    # Seed-OSS's: F.dropout of its output with its residual_dropout.
    "seed_oss_gated_mlp": (None, None, None, lambda self, out, dropout: dropout(out, p=self.residual_dropout,
                                                                                training=self.training)),
    # Falcon-H1's: its multipliers on the gate before the activation and on the output.
    "falcon_h1_gated_mlp": (lambda self, gate: gate * self.gate_multiplier, None, None,
                            lambda self, out, dropout: out * self.down_multiplier),
    # DeepSeek-V4's and GLM-5-next's: the gate clamped from above, up from both sides.
    "deepseek_v4_clamped_gated_mlp": (lambda self, gate: gate.clamp(max=self.limit),
                                      lambda self, up: up.clamp(min=-self.limit, max=self.limit), None, None),
    "glm5_clamped_gated_mlp": (lambda self, gate: gate.clamp(min=None, max=self.swiglu_limit),
                               lambda self, up: up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit), None, None),
}


def _packed_gated_mlp_forward(torch, original, form, dependencies=None):
    """Phi-3's gated MLP (one gate_up_proj, its output chunked into gate and up) with
    `up * silu(gate)` in one op of the projection's output (torchfuse::silu_mul_packed, whose
    backward writes the projection's gradient whole, where the original's chunk backward
    concatenates two) where activation_fn is SiLU and the last dim is even (an odd one is
    chunked unevenly: the original's arithmetic and its error); the matmuls are the module's
    own."""
    op = torch.ops.torchfuse.silu_mul_packed.default
    tensor, served = torch.Tensor, _served_dtypes(torch)
    takes = _gated_mlp_call(torch, original, dependencies)

    @functools.wraps(original)
    def forward(self, hidden_states):
        act = self.activation_fn
        if takes(hidden_states, act) != "silu":
            return original(self, hidden_states)
        gate_up = self.gate_up_proj(hidden_states)
        if (type(gate_up) is tensor and gate_up.dtype in served and gate_up.dim() >= 1
                and gate_up.shape[-1] % 2 == 0):
            return self.down_proj(op(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(up * act(gate))

    return forward


def _moe_apply_gate(torch, original, form, dependencies=None):
    """HF's default gate of MoE experts (transformers.integrations.moe._default_apply_gate,
    `act_fn(gate) * up` of the halves of the experts' gate_up projection: Mixtral's, Qwen2/3-MoE's,
    OLMoE's under the default grouped_mm and batched_mm implementations) in one op of the
    projection's output (torchfuse::silu_mul_packed, as Phi-3's MLP) where act_fn is SiLU and
    the last dim is even (an odd one is chunked unevenly: the original's arithmetic and its
    error); anything else runs the original."""
    op = torch.ops.torchfuse.silu_mul_packed.default
    served = _served_dtypes(torch)
    takes = _gated_mlp_call(torch, original, dependencies)

    @functools.wraps(original)
    def _default_apply_gate(self, gate_up_out):
        if (takes(gate_up_out, getattr(self, "act_fn", None)) == "silu" and gate_up_out.dtype in served
                and gate_up_out.dim() >= 1 and gate_up_out.shape[-1] % 2 == 0):
            return op(gate_up_out)
        return original(self, gate_up_out)

    return _default_apply_gate


def _conv1d_mlp_forward(torch, original, form, dependencies=None):
    """HF's GPT-2 MLP (`dropout(c_proj(act(c_fc(x))))`) under CUDA autocast, where act is the
    tanh-GELU whose original returns fp32 there (it calls torch.pow, on autocast's fp32 list)
    and c_proj is a Conv1D or nn.Linear, whose matmul casts its input to the autocast dtype
    first. The GELU then returns that dtype itself: its fp32 result rounded once, which is what
    the cast would make of it (equal up to the fp32 rounding of the GELU's arithmetic: where the
    registry keeps PyTorch's own gelu for equal dtypes, it orders x^3 differently), and its
    backward takes the gradient in that dtype, which the cast's backward would only have
    widened. The fp32 activation, its cast and the cast's backward are never made.
    Anything else, or a hook on act or c_proj (which would see the dtype change), or a c_proj
    whose weight or bias is a tensor subclass or a torch function mode (which see the input
    before autocast and may act on its dtype: torchao's quantized weights pick kernels and
    scales by it), runs the original code. (Its original calls only the module's own
    submodules: `dependencies`, the factories' common argument, is not needed here.)"""
    op = torch.ops.torchfuse.gelu_tanh.default
    tensor, untraced = torch.Tensor, _untraced_call(torch)
    autocast, autocast_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
    narrow, linear_forwards = (torch.bfloat16, torch.float16), _linear_forwards(torch)
    plain = (torch.Tensor, torch.nn.Parameter)
    function_mode = torch._C._is_torch_function_mode_enabled
    casts_its_input = {}  # (c_proj type, its forward) -> its matmul runs under autocast's cast

    def widening_gelu(act):
        form, dependencies = _REWRITTEN.get(_class_forward(act), (None, None))
        return form == "new_gelu" and _unobserved(torch, act) and dependencies.unchanged()

    def plain_projection(proj):
        kind, forward = type(proj), _class_forward(proj)
        key = (kind, forward)
        known = casts_its_input.get(key)
        if known is None:
            known = casts_its_input[key] = forward in linear_forwards or _is_conv1d_forward(forward)
        bias = getattr(proj, "bias", None)
        return (known and _unobserved(torch, proj) and type(getattr(proj, "weight", None)) in plain
                and (bias is None or type(bias) in plain))

    @functools.wraps(original)
    def forward(self, hidden_states):
        dtype = autocast_dtype("cuda") if autocast("cuda") else None
        if (type(hidden_states) is not tensor or not hidden_states.is_cuda or not untraced()
                or dtype not in narrow or function_mode()
                or not widening_gelu(self.act) or not plain_projection(self.c_proj)):
            return original(self, hidden_states)
        hidden_states = self.c_fc(hidden_states)
        if type(hidden_states) is tensor and hidden_states.dtype == dtype:
            hidden_states = op(hidden_states, dtype)
        else:
            hidden_states = self.act(hidden_states)
        return self.dropout(self.c_proj(hidden_states))

    return forward


def _rotary_call(torch, original, dependencies=None):
    """A function telling whether a call of an apply_rotary_pos_emb form may go to
    torchfuse::rotary: plain CUDA tensors, q and k of one dtype (the op's autograd layer runs
    HF's composition for mixed ones), cos and sin needing no gradient (HF computes them under
    no_grad), an int unsqueeze_dim, outside traces, and the rotate_half the original calls
    (and torch.cat) as recognised: a module whose rotate_half is replaced later (another RoPE
    layout) gets its own code back."""
    tensor, untraced = torch.Tensor, _untraced_call(torch)
    unchanged = (dependencies or compositions.Dependencies(original)).unchanged

    def served(q, k, cos, sin, unsqueeze_dim):
        return (type(q) is tensor and type(k) is tensor and type(cos) is tensor
                and type(sin) is tensor and q.is_cuda and q.dtype == k.dtype and type(unsqueeze_dim) is int
                and not cos.requires_grad and not sin.requires_grad and untraced() and unchanged())

    return served


def _rotary(torch, original, form, dependencies=None):
    """HF's apply_rotary_pos_emb with q and k rotated by one op (torchfuse::rotary); its code
    calling Cohere's interleaved rotate_half (BLT's), the interleaved layout; calling NanoChat's
    (Llama's rotate_half negated), the op with sin negated, an exact table op: each product
    is the original's. Helium's: the interleaved layout with GLM's tables
    (`_interleaved_tables`), made as the original makes them."""
    op, served = torch.ops.torchfuse.rotary.default, _rotary_call(torch, original, dependencies)
    interleaved, flipped = form in ("hf_rotary_pairs", "helium_rotary"), form == "hf_rotary_flipped"
    glm_tables = form == "helium_rotary"

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if served(q, k, cos, sin, unsqueeze_dim):
            tables = _interleaved_tables(cos, sin, unsqueeze_dim) if glm_tables else (cos, sin)
            if tables is not None:
                cos, sin = tables
                return op(q, k, cos, -sin if flipped else sin, unsqueeze_dim, interleaved)
        return original(q, k, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb


def _one_tensor_rotary(op, x, cos, sin, unsqueeze_dim, interleaved=False):
    """torchfuse::rotary of one tensor x: x as its q and, as its k, x with nothing along the dim
    cos and sin are broadcast over (`unsqueeze_dim`, the heads): no rows, which the op reads and
    writes nothing of; its q result is x's. The empty k is detached: one needing a gradient
    would send one back through narrow, which makes a zero tensor of x's size and adds it to
    x's gradient."""
    return op(x, x.narrow(unsqueeze_dim, 0, 0).detach(), cos, sin, unsqueeze_dim, interleaved)[0]


def _one_tensor_fits(x, cos, unsqueeze_dim):
    """Whether x and its table take `_one_tensor_rotary`: x has the one dim more that the table
    is unsqueezed at (the heads), and `unsqueeze_dim` names one of x's dims (the empty k's)."""
    return x.dim() == cos.dim() + 1 and -x.dim() <= unsqueeze_dim < x.dim()


def _rotated_and_passed(t, rotary_dim):
    """t's first `rotary_dim` features and the rest: the views the partial rotaries' two slices
    make, by one split (in the backward one cat of the two gradients, where two slices' would
    fill a zero tensor each and add them)."""
    return t.split((rotary_dim, t.shape[-1] - rotary_dim), dim=-1)


def _single_rotary(torch, original, form, dependencies=None):
    """Gemma 4's apply_rotary_pos_emb (Gemma 3n's, DiffusionGemma's): Llama's rotary of one
    tensor x, the model calling it for q and for k apart (`_one_tensor_rotary`)."""
    op, served = torch.ops.torchfuse.rotary.default, _rotary_call(torch, original, dependencies)

    @functools.wraps(original)
    def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1):
        if served(x, x, cos, sin, unsqueeze_dim) and _one_tensor_fits(x, cos, unsqueeze_dim):
            return _one_tensor_rotary(op, x, cos, sin, unsqueeze_dim)
        return original(x, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb


def _every_two_rotary(torch, original, form, dependencies=None):
    """GPT-J's apply_rotary_pos_emb (CodeGen's): the interleaved rotary (rotate_every_two, pairs
    (2p, 2p+1)) of one tensor [batch, tokens, heads, rotary dim], sin and cos [batch, tokens,
    rotary dim / 2] given in that order. torchfuse::rotary of x alone (`_one_tensor_rotary`),
    the tables repeated pair by pair as the original repeats them and broadcast over the heads
    (`unsqueeze_dim` 2, the original's `[:, :, None, :]`). Other ranks and table sizes (which
    the original may broadcast or refuse) run the original."""
    op, served = torch.ops.torchfuse.rotary.default, _rotary_call(torch, original, dependencies)

    @functools.wraps(original)
    def apply_rotary_pos_emb(tensor, sin, cos):
        if (served(tensor, tensor, cos, sin, 2) and tensor.dim() == 4 and cos.dim() == 3
                and cos.shape == sin.shape and 2 * cos.shape[-1] == tensor.shape[-1]):
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
            return _one_tensor_rotary(op, tensor, cos, sin, 2, interleaved=True)
        return original(tensor, sin, cos)

    return apply_rotary_pos_emb


def _interleaved_tables(cos, sin, unsqueeze_dim):
    """GLM's cos and sin for the interleaved rotary: each of the first half of the features
    repeated twice (`cos[..., :d // 2].repeat_interleave(2, dim=-1)`, the original's own ops on
    the [B, S, d] tables), or None where the original would unsqueeze them at the last dim."""
    if cos.dim() == 0 or cos.unsqueeze(unsqueeze_dim).shape[-1] != cos.shape[-1] or cos.shape != sin.shape:
        return None
    half = cos.shape[-1] // 2
    return cos[..., :half].repeat_interleave(2, dim=-1), sin[..., :half].repeat_interleave(2, dim=-1)


def _rotary_cast_back(torch, original, form, dependencies=None):
    """OLMo's apply_rotary_pos_emb (and its copies): Llama's rotary, each result cast back to
    its input's dtype; ModernBERT's (ESM's, Evolla's) computes it of q and k upcast to fp32
    first. torchfuse::rotary (Llama's arithmetic and result dtype, computed in fp32 where it
    serves), then the original's casts. The upcast form goes to the op only where Llama's
    arithmetic promotes to fp32 anyway (cos, sin or q and k in fp32: ModernBERT's cos and sin
    under autocast): the op's own fallback, HF's composition in the inputs' dtypes, then computes
    what the original does; otherwise the original runs. Cohere's (Cohere 2's and their
    copies') is the upcast form of the interleaved rotary (pairs (2p, 2p+1)), and Ernie 4.5's the
    same with GLM's tables (`_interleaved_tables`) first."""
    op, served = torch.ops.torchfuse.rotary.default, _rotary_call(torch, original, dependencies)
    fp32, promote = torch.float32, torch.promote_types
    upcast = form != "hf_rotary_cast_back"
    interleaved = form in ("cohere_rotary_pairs_upcast", "hf_rotary_pairs_upcast")
    glm_tables = form == "hf_rotary_pairs_upcast"

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if served(q, k, cos, sin, unsqueeze_dim) and (
                not upcast or all(promote(t.dtype, trig.dtype) == fp32 for t in (q, k) for trig in (cos, sin))):
            tables = _interleaved_tables(cos, sin, unsqueeze_dim) if glm_tables else (cos, sin)
            if tables is not None:
                q_embed, k_embed = op(q, k, *tables, unsqueeze_dim, interleaved)
                # The upcast forms cast both back to q's dtype, OLMo's each to its own.
                return q_embed.to(q.dtype), k_embed.to(q.dtype if upcast else k.dtype)
        return original(q, k, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb


def _partial_rotary(torch, original, form, dependencies=None):
    """GPT-NeoX's apply_rotary_pos_emb (and its copies, Nemotron's written its own way): the
    rotate-half rotary of the first `cos.shape[-1]` features of each head (Pythia: a quarter),
    the rest passed through, then cat. One torchfuse::rotary call with `passthrough` does all
    of it: the rotated features and the rest written into the cat's row-major output (in the
    dtype the cat promotes to), and in the backward the gradient of the whole head at once, in
    place of the original's split, two cats forward and two backward. A rotary dim of the whole
    head dim (Phi-3's) is the same call with nothing passed through: the original's cat of an
    empty rest is a copy into that layout and dtype, made by the op's own store; an odd or
    too-wide one runs the original. GLM's (GLM-4's, Moonshine's) is the
    same of the interleaved rotary (pairs (2p, 2p+1)) with GLM's tables
    (`_interleaved_tables`), made as the original makes them; GLM-4V's (GLM-OCR's) the
    interleaved one with the tables as given."""
    op = torch.ops.torchfuse.rotary.default
    served = _rotary_call(torch, original, dependencies)
    interleaved = form in ("hf_rotary_pairs_partial", "glm4v_rotary_pairs_partial")
    glm_tables = form == "hf_rotary_pairs_partial"

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if served(q, k, cos, sin, unsqueeze_dim):
            tables = _interleaved_tables(cos, sin, unsqueeze_dim) if glm_tables else (cos, sin)
            # As the original reads it.
            rotary_dim = tables[0].unsqueeze(unsqueeze_dim).shape[-1] if tables is not None else 0
            head_dim = min(q.shape[-1], k.shape[-1])
            if rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim:
                return op(q, k, *tables, unsqueeze_dim, interleaved, True)
        return original(q, k, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb


def _optional_k_partial_rotary(torch, original, form, dependencies=None):
    """Qwen4-exp's apply_rotary_pos_emb: GPT-NeoX's partial rotary (`_partial_rotary`) with k
    optional; without k, q's alone (`_one_tensor_rotary` of its rotated slice, then the
    original's cat), returned alone. An odd or too-wide rotary dim, or tables of another rank,
    run the original; tables the original could not broadcast either reach the op, whose stock
    path raises the original's error."""
    with_k = _partial_rotary(torch, original, form, dependencies)
    op, cat = torch.ops.torchfuse.rotary.default, torch.cat
    served = _rotary_call(torch, original, dependencies)

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k=None, cos=None, sin=None, unsqueeze_dim=1):
        if k is not None:
            return with_k(q, k, cos, sin, unsqueeze_dim)
        if served(q, q, cos, sin, unsqueeze_dim) and _one_tensor_fits(q, cos, unsqueeze_dim):
            rotary_dim = cos.unsqueeze(unsqueeze_dim).shape[-1]  # as the original reads it
            if rotary_dim % 2 == 0 and 0 < rotary_dim <= q.shape[-1]:
                q_rope, q_nope = _rotated_and_passed(q, rotary_dim)
                return cat([_one_tensor_rotary(op, q_rope, cos, sin, unsqueeze_dim), q_nope], dim=-1)
        return original(q, k, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb


def _half_table_rotary(torch, original, form, dependencies=None):
    """GPT-OSS's apply_rotary_pos_emb: the rotate-half rotary written with the halves of the head
    dim (`first * cos - second * sin`, `second * cos + first * sin`, then cat) and tables of half
    its size. torchfuse::rotary computes the same products with each table repeated over both
    halves (the layout Llama's tables have: cat of the table with itself); tables of another
    size (which the original might broadcast) and odd head dims run the original. The results
    are laid out as the original's cat lays them out."""
    op, cat = torch.ops.torchfuse.rotary.default, torch.cat
    served = _rotary_call(torch, original, dependencies)

    def as_cat_makes_it(t):
        # The original's result is cat's of its two halves: row-major, or channels-last where
        # both halves look channels-last. The op lays its result out as Llama's arithmetic would
        # (a transposed q gives a transposed result); where that is not row-major, the halves
        # are cat as the original cats them (one split: its backward is one cat of the
        # gradients, where two slices' would fill a zero tensor each and add them).
        size, step = t.shape, 1
        row_major = []
        for n in reversed(size):
            row_major.append(step)
            step *= n
        if t.stride() == tuple(reversed(row_major)):
            return t
        return cat(t.split(size[-1] // 2, dim=-1), dim=-1)

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (served(q, k, cos, sin, unsqueeze_dim) and cos.dim() >= 1 and cos.shape == sin.shape
                and 2 * cos.shape[-1] == q.shape[-1] == k.shape[-1]):
            q_embed, k_embed = op(q, k, cat((cos, cos), dim=-1), cat((sin, sin), dim=-1), unsqueeze_dim, False)
            return as_cat_makes_it(q_embed), as_cat_makes_it(k_embed)
        return original(q, k, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb


def _prefix_rotary(torch, original, form, dependencies=None):
    """DINOv3's apply_rotary_pos_emb (EoMT-DINOv3's, Sapiens 2's): Llama's rotary of the patch
    tokens only, the prefix tokens (class and register tokens, as many as q has tokens beyond
    the tables' rows) passed through, then cat along the tokens. The patch tokens go to
    torchfuse::rotary as the views the original splits, the tables ([patches, head dim],
    broadcast over batch and heads as the original's products broadcast them) as one batch,
    and the cats are the original's. Tables of another rank, keyword arguments, and calls the
    original's split would refuse run the original."""
    op, cat = torch.ops.torchfuse.rotary.default, torch.cat
    served = _rotary_call(torch, original, dependencies)

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, **kwargs):
        if (not kwargs and served(q, k, cos, sin, 1) and q.dim() == 4 and k.dim() == 4
                and cos.dim() == 2 and sin.dim() == 2):
            tokens, patches = q.shape[-2], sin.shape[-2]
            prefix = tokens - patches
            if prefix >= 0 and k.shape[-2] == tokens:
                q_prefix, q_patches = q.split((prefix, patches), dim=-2)
                k_prefix, k_patches = k.split((prefix, patches), dim=-2)
                q_embed, k_embed = op(q_patches, k_patches, cos.unsqueeze(0), sin.unsqueeze(0), 1, False)
                return cat((q_prefix, q_embed), dim=-2), cat((k_prefix, k_embed), dim=-2)
        return original(q, k, cos, sin, **kwargs)

    return apply_rotary_pos_emb


def _kv_appends(torch, original, dependencies):
    """What both KV-cache rewrites share: whether the call may take the op (untraced, the
    original's dependencies unchanged), and the append of K and V to the caches with the first
    append (the cache a training forward builds, empty until then) as one op, torchfuse::kv_copy:
    the fresh row-major copies of K and V that `torch.cat([cache, x], dim=-2)` makes of the 1-D
    empty cache and x, in the dtype cat promotes to (the cache's is K's: after a rotary with fp32
    tables, an fp32 K promotes a bf16 V). Later appends, and K or V of another layout, run the
    original's cats."""
    op, tensor, promote = torch.ops.torchfuse.kv_copy.default, torch.Tensor, torch.promote_types
    untraced = _untraced_call(torch)
    unchanged = (dependencies or compositions.Dependencies(original)).unchanged

    def takes_op():
        return untraced() and unchanged()

    def first_append(cache, x):
        # cat's output is then x's values, fresh and row-major whatever x's layout: cat skips
        # the cache (a 1-D empty tensor) but for its dtype, and the cache's contiguous format
        # decides the output's.
        return (type(cache) is tensor and type(x) is tensor and x.is_cuda and cache.device == x.device
                and cache.dim() == 1 and cache.numel() == 0 and x.dim() == 4)

    def append(keys, values, key_states, value_states):
        # CUDA autocast leaves cat alone (measured on torch 2.11: fp16 K under bf16 autocast
        # stays fp16, fp16 with bf16 gives fp32): its output dtype is promote_types' always.
        if first_append(keys, key_states) and first_append(values, value_states):
            return op(key_states, value_states, promote(keys.dtype, key_states.dtype),
                      promote(values.dtype, value_states.dtype))
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)

    return takes_op, append


def _kv_update(torch, original, dependencies, appended):
    """A KV-cache layer's update as the original writes it, its first append as one op
    (_kv_appends): `appended(self, key_states, value_states, append)` is the original's code
    after its lazy initialization, its cats as `append`. Traces run the original."""
    takes_op, append = _kv_appends(torch, original, dependencies)

    @functools.wraps(original)
    def update(self, key_states, value_states, *args, **kwargs):
        if not takes_op():
            return original(self, key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return appended(self, key_states, value_states, append)

    return update


def _dynamic_layer_update(torch, original, form, dependencies=None):
    """HF's DynamicLayer.update (_kv_update)."""
    def appended(self, key_states, value_states, append):
        self.keys, self.values = append(self.keys, self.values, key_states, value_states)
        return self.keys, self.values

    return _kv_update(torch, original, dependencies, appended)


def _dynamic_sliding_window_layer_update(torch, original, form, dependencies=None):
    """HF's DynamicSlidingWindowLayer.update (_kv_update): the window's views of the full
    states as the original takes them."""
    def appended(self, key_states, value_states, append):
        self.cumulative_length += key_states.shape[-2]
        full_keys, full_values = append(self.keys, self.values, key_states, value_states)
        if not self.record_past:
            self.keys = full_keys[:, :, -self.sliding_window + 1:, :]
            self.values = full_values[:, :, -self.sliding_window + 1:, :]
        else:
            self.keys, self.values = full_keys, full_values
        return full_keys, full_values

    return _kv_update(torch, original, dependencies, appended)


# torchfuse's rewrite of nn.Linear.forward (`patch_linear`) -> torch's own: the rewrites that
# pass inputs to Linear submodules take either as "nn.Linear's own forward".
_LINEAR_REWRITTEN = {}


def _linear_forwards(torch):
    """nn.Linear's forward as torch defines it, and the one the class has now (the same, or
    torchfuse's linear rewrite of it)."""
    current = torch.nn.Linear.forward
    return _LINEAR_REWRITTEN.get(current, current), current


def _linear_dtype(torch):
    """A function (input, weight, bias) -> the dtype torchfuse::linear_cast computes a Linear's
    (or Conv1D's) call in, or None: under CUDA autocast to a 16-bit dtype, autocast's, the
    tensors of dtypes it casts; without autocast, the one dtype of the input, weight and bias
    (F.linear and addmm refuse mixed ones: stock's code gives that error)."""
    autocast, autocast_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
    narrow, eligible = (torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16, torch.float16)

    def cast_to(input, weight, bias):
        if autocast("cuda"):
            dtype = autocast_dtype("cuda")
            fits = (dtype in narrow and weight.dtype in eligible and input.dtype in eligible
                    and (bias is None or bias.dtype in eligible))
        else:
            dtype = input.dtype
            fits = dtype in eligible and weight.dtype == dtype and (bias is None or bias.dtype == dtype)
        return dtype if fits else None

    return cast_to


def _conv1d_forward(torch, original, form, dependencies=None):
    """HF's Conv1D (GPT-2's projections, and any class whose forward is its code) through
    torchfuse::linear_cast with the weight as it is ([in, out]): the addmm and the two views as
    one autograd node, stock's kernels and gradients bit for bit, under CUDA autocast after
    autocast's casts (the input's 2-D view is never in its cache: a plain cast), without
    autocast in the tensors' one dtype. Anything else runs the original: grad off, a
    non-contiguous input or one of fewer than two dims, an `nf` that is not the weight's width,
    a weight or bias that is not a plain parameter entry or that a subclass's attribute or
    __getattr__ could replace, a changed `torch.addmm`, traces and torch function or dispatch
    modes. torch.jit.script compiles the original."""
    op = torch.ops.torchfuse.linear_cast.default
    tensor, plain = torch.Tensor, (torch.Tensor, torch.nn.Parameter)
    untraced, jit_tracing = _untraced_call(torch), torch._C._get_tracing_state
    function_mode, dispatch_modes = torch._C._is_torch_function_mode_enabled, torch._C._len_torch_dispatch_stack
    module_getattr, cast_to = torch.nn.Module.__getattr__, _linear_dtype(torch)
    unchanged = (dependencies or compositions.Dependencies(original)).unchanged

    @functools.wraps(original)
    def forward(self, x):
        # `torch` read here: torch.jit.script compiles the original's source (`__wrapped__`) with
        # this function's names, and the original's code names torch.
        if (untraced() and type(x) is tensor and x.is_cuda and torch.is_grad_enabled() and x.dim() >= 2
                and x.is_contiguous()):
            params, own = self._parameters, self.__dict__
            weight, bias = params.get("weight"), params.get("bias")
            if (type(weight) in plain and type(bias) in plain and weight.is_cuda and weight.dim() == 2
                    and type(own.get("nf")) is int and own["nf"] == weight.shape[1]
                    and "weight" not in own and "bias" not in own
                    and _plain_linear_class(type(self), None, module_getattr)
                    and not function_mode() and not dispatch_modes() and not jit_tracing() and unchanged()):
                dtype = cast_to(x, weight, bias)
                if dtype is not None:
                    return op(x, weight, bias, dtype, True)
        return original(self, x)

    return forward


def _class_forward(module):
    """The forward a module's class defines, or None: a scripted module's class (or None in a
    submodule's slot) has none to read."""
    return getattr(type(module), "forward", None)


def _is_conv1d_forward(forward):
    """Whether a class's forward is HF Conv1D's code, or torchfuse's rewrite of it."""
    return _REWRITTEN.get(forward, (None,))[0] == "hf_conv1d" or compositions.form_of(forward) == "hf_conv1d"


@functools.lru_cache(maxsize=None)
def _plain_linear_class(cls, linear, module_getattr):
    """Whether `self.weight` and `self.bias` on an instance of `cls` (nn.Linear, HF Conv1D, or a
    subclass) are found as nn.Module finds them: no class attribute of those names (a property, a
    descriptor) and no __getattr__ or __getattribute__ of the subclass's own."""
    return cls is linear or (_submodule_only(cls, "weight") and _submodule_only(cls, "bias")
                             and cls.__getattr__ is module_getattr
                             and cls.__getattribute__ is object.__getattribute__)


def _linear_forward(torch, original):
    """nn.Linear's forward with grad on: torchfuse::linear_cast, whose GEMM and reshapes are one
    autograd node, stock's kernels and gradients bit for bit (src/abi/glue/linear.cpp), where
    stock's autograd runs three or four nodes (transpose, reshapes, GEMM) and the host
    dispatches four ops. Under CUDA autocast to a 16-bit dtype its casts are autocast's own (its
    cache, its cast nodes); without autocast (a model in bf16, FSDP2's bf16 parameters, fp32)
    the input, weight and bias share one dtype, as F.linear needs, and nothing is cast.
    Anything else runs torch's forward: autocast not to a 16-bit dtype, grad off, a weight, bias
    or input that is not a plain CUDA tensor of fp32, bf16 or fp16 (of one dtype without
    autocast), a weight or bias that is not a parameter entry or that a subclass's attribute or
    __getattr__ could replace, a patched F.linear, traces (torch.compile, torch.jit.trace,
    torch.func) and torch function or dispatch modes. The op keeps stock's path for the rest
    (shapes and layouts its node would not reproduce exactly, forward-mode AD, the toggle off).
    The closure's `F` is the original's, so that torch.jit.script, which compiles the original's
    source (`__wrapped__`) with this function's names, finds it."""
    op = torch.ops.torchfuse.linear_cast.default
    tensor, plain, linear = torch.Tensor, (torch.Tensor, torch.nn.Parameter), torch.nn.Linear
    grad_on, untraced, jit_tracing = torch.is_grad_enabled, _untraced_call(torch), torch._C._get_tracing_state
    function_mode, dispatch_modes = torch._C._is_torch_function_mode_enabled, torch._C._len_torch_dispatch_stack
    module_getattr, cast_to = torch.nn.Module.__getattr__, _linear_dtype(torch)
    F = original.__globals__["F"]
    linear_function, missing = F.linear, object()

    @functools.wraps(original)
    def forward(self, input):
        # Traces first: torch.compile reads nothing more of this wrapper than that.
        if untraced() and type(input) is tensor and input.is_cuda and grad_on():
            params = self._parameters
            weight, bias = params.get("weight"), params.get("bias", missing)
            if (type(weight) in plain and weight.is_cuda and (bias is None or type(bias) in plain)
                    and "weight" not in self.__dict__ and "bias" not in self.__dict__
                    and _plain_linear_class(type(self), linear, module_getattr)
                    and F.linear is linear_function and not function_mode() and not dispatch_modes()
                    and not jit_tracing()):
                dtype = cast_to(input, weight, bias)
                if dtype is not None:
                    return op(input, weight, bias, dtype)
        return original(self, input)

    return forward


def patch_linear(module):
    """Rewrites nn.Linear.forward (`_linear_forward`) where it is torch's own code, calling
    F.linear of the module's weight and bias. False where the library is not loaded yet."""
    torch = sys.modules.get("torch")
    enabled = enabled_toggles(torch) if torch is not None else {}
    if not enabled:
        return False
    linear = module.Linear
    original = linear.forward
    code = getattr(original, "__code__", None)
    if original in _LINEAR_REWRITTEN:  # rewritten already
        return True
    if (code is None or original.__module__ != module.__name__ or code.co_argcount != 2
            or set(code.co_names) != {"F", "linear", "weight", "bias"}):
        note(torch, f"rewrite linear: {module.__name__}.Linear.forward is not torch's own code; left alone")
        return True
    if not enabled.get("linear", False):
        note(torch, f"rewrite linear off: {module.__name__}.Linear.forward left as it is", debug=True)
        return True
    linear.forward = _linear_forward(torch, original)
    _LINEAR_REWRITTEN[linear.forward] = original
    note(torch, f"rewrite linear: {module.__name__}.Linear.forward -> " + _OPS
                + "linear_cast (one autograd node for the GEMM; under CUDA autocast after autocast's casts)")
    return True


# The tests' switch (set before the rewrite is made) to run `_head_views_forward` on CPU tensors
# too, without CPU autocast (whose casts `_linear_dtype` does not read): CI has no GPU.
_HEAD_VIEWS_ON_CPU = False

def _dropout(self):
    """The attention's dropout as HF's attention forwards pass it (Gemma's write the condition
    the other way round: the same reads, the same value)."""
    return 0.0 if not self.training else self.attention_dropout


# The keyword arguments each attention form passes its attention interface, in its order and
# read as its original reads them.
_ATTENTION_KEYWORDS = {
    "hf_attention": lambda self: {"dropout": _dropout(self), "scaling": self.scaling},
    "hf_attention_sliding_window": lambda self: {"dropout": _dropout(self), "scaling": self.scaling,
                                                 "sliding_window": self.sliding_window},
    "hf_attention_config_sliding_window": lambda self: {
        "dropout": _dropout(self), "scaling": self.scaling,
        "sliding_window": getattr(self.config, "sliding_window", None)},
    "qwen3_attention": lambda self: {"dropout": _dropout(self), "scaling": self.scaling,
                                     "sliding_window": self.sliding_window},
    "gemma3_attention": lambda self: {"dropout": _dropout(self), "scaling": self.scaling,
                                      "sliding_window": self.sliding_window},
    "gemma2_attention": lambda self: {"dropout": _dropout(self), "scaling": self.scaling,
                                      "sliding_window": self.sliding_window,
                                      "softcap": self.attn_logit_softcapping},
    "olmo2_attention": lambda self: {"dropout": _dropout(self), "scaling": self.scaling},
    "olmo3_attention": lambda self: {"dropout": _dropout(self), "scaling": self.scaling,
                                     "sliding_window": self.sliding_window},
    "gpt_neox_attention": lambda self: {"scaling": self.scaling, "dropout": _dropout(self)},
    "phi3_attention": lambda self: {"dropout": _dropout(self), "scaling": self.scaling,
                                    "sliding_window": getattr(self.config, "sliding_window", None)},
    "gpt2_attention": lambda self: {"dropout": self.attn_dropout.p if self.training else 0.0,
                                    "scaling": self.scaling},
}
# The forms whose q and k are normed per head (`self.q_norm`, `self.k_norm`) between the view and
# the transpose: there the node returns the view, and the norm and the transpose are the
# original's.
_ATTENTION_NORMED_QK = frozenset({"qwen3_attention"})
# The forms whose q and k are normed per head after the transpose (the original's norms, on the
# node's views).
_ATTENTION_NORMED_AFTER = frozenset({"gemma3_attention"})
# The forms whose q and k are normed whole (over all heads) before the view: there the node
# returns them unsplit, and the norms, views and transposes are the original's.
_ATTENTION_NORMED_WHOLE = frozenset({"olmo2_attention", "olmo3_attention"})
# The forms whose q, k and v are sliced from one packed projection (`qkv_proj`): there one node
# returns the three split into heads (torchfuse::linear_cast_split).
_ATTENTION_PACKED = frozenset({"phi3_attention"})


def _head_views_forward(torch, original, form, dependencies=None):
    """HF's attention forward (Llama's and its copies) with q, k and v each projected and split
    into heads by one autograd node (torchfuse::linear_cast with `out_head_dim`: the Linear's
    node returns `view(*lead, -1, head_dim).transpose(1, 2)` of its output), and the attention's
    output merged and projected by one (`merge_input_heads`: `reshape(*lead, -1).contiguous()`
    and o_proj), where stock runs a ViewBackward0 and a TransposeBackward0 for each projection
    and a ViewBackward0 before o_proj: seven dispatched ops and seven autograd nodes fewer a
    layer (five where q and k are normed per head between the view and the transpose, Qwen3's form: the
    node returns the view, the norms and transposes are the original's; three where they are normed
    whole before the view, OLMo 2's: the node returns them unsplit; ten where they are sliced from one
    packed projection, Phi-3's: one node, torchfuse::linear_cast_split, returns the three split into
    heads, and its backward cats their gradients where stock's slices' nodes each make a full-size
    zero gradient that the engine sums). The tensors the rotary, the
    cache and the attention see are stock's (sizes, strides, values) and every gradient is stock's,
    bit for bit; they are not autograd views of the projection's output, which nothing else sees
    (`_base` is None, and an in-place `detach_()` of one is not refused as a view's is). The rest of
    the forward runs as the original writes it: the module's `apply_rotary_pos_emb`, its cache's
    `update`, the attention interface `ALL_ATTENTION_FUNCTIONS` gives, each looked up at the call as
    the original does.

    Served where nn.Linear's rewrite would serve each projection's call (`_linear_forward`):
    grad on, hidden_states a plain 3-D CUDA tensor, q/k/v_proj plain, unobserved nn.Linear
    submodules on its device (`_plain_linear_check`) whose widths are whole heads, nn.Linear's
    forward torch's own (or the linear rewrite of it) calling an unpatched F.linear, autocast to
    a 16-bit dtype or none; outside traces, torch function and dispatch modes and global module
    hooks, with the `head_views` toggle on. o_proj takes the merged heads where it is such a
    Linear then and the attention's output is a contiguous [*lead, heads, head_dim] tensor; else
    the original's reshape, contiguous and o_proj call. Anything else runs the original."""
    op, enabled = torch.ops.torchfuse.linear_cast.default, torch.ops.torchfuse.enabled.default
    split_op = torch.ops.torchfuse.linear_cast_split.default
    untraced = _untraced_call(torch)
    heads, projection, attend = _attention_parts(torch, original)
    keywords, missing = _ATTENTION_KEYWORDS[form], object()
    normed, normed_after = form in _ATTENTION_NORMED_QK, form in _ATTENTION_NORMED_AFTER
    normed_whole, packed = form in _ATTENTION_NORMED_WHOLE, form in _ATTENTION_PACKED
    names = ("qkv_proj",) if packed else ("q_proj", "k_proj", "v_proj")
    attributes = ("head_dim", *names, "o_proj")

    def projections(self, x):
        """q, k and v's (weight, bias, dtype) (one packed projection's and its split's widths,
        as the original slices it) and the head size, or None: the original runs."""
        found = heads(self, x, attributes)
        if found is None:
            return None
        cls, own, children, head_dim = found
        projected = []
        for name in names:
            p = projection(cls, own, children, name, x)
            if p is None or p[0].shape[0] % head_dim != 0:
                return None
            projected.append(p)
        if packed:
            query_heads, kv_heads = self.config.num_attention_heads, self.num_key_value_heads
            if type(query_heads) is not int or type(kv_heads) is not int or query_heads <= 0 or kv_heads <= 0:
                return None
            widths = [query_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
            if projected[0][0].shape[0] != sum(widths):
                return None
            projected.append(widths)
        return (*projected, head_dim) if enabled("head_views") else None

    @functools.wraps(original)
    def forward(self, hidden_states, position_embeddings=missing, attention_mask=missing, past_key_values=None,
                **kwargs):
        # Traces first: torch.compile reads nothing more of this wrapper than that.
        served = None
        if untraced() and position_embeddings is not missing and attention_mask is not missing:
            served = projections(self, hidden_states)
        if served is None:
            return original(self, hidden_states, past_key_values=past_key_values,
                            **_passed_on(kwargs, missing, position_embeddings=position_embeddings,
                                         attention_mask=attention_mask))
        if packed:
            (weight, bias, dtype), widths, head_dim = served
            query_states, key_states, value_states = split_op(hidden_states, weight, bias, dtype, False, widths,
                                                              head_dim, True)
            return attend(self, hidden_states, query_states, key_states, value_states, position_embeddings,
                          past_key_values, attention_mask, keywords, kwargs, "o_proj")
        (qw, qb, qt), (kw, kb, kt), (vw, vb, vt), head_dim = served

        if normed_whole:
            query_states = self.q_norm(op(hidden_states, qw, qb, qt))
            key_states = self.k_norm(op(hidden_states, kw, kb, kt))
            value_states = op(hidden_states, vw, vb, vt, False, head_dim)
            hidden_shape = (*hidden_states.shape[:-1], -1, head_dim)
            query_states = query_states.view(hidden_shape).transpose(1, 2)
            key_states = key_states.view(hidden_shape).transpose(1, 2)
        elif normed:
            query_states = self.q_norm(op(hidden_states, qw, qb, qt, False, head_dim, False, False)).transpose(1, 2)
            key_states = self.k_norm(op(hidden_states, kw, kb, kt, False, head_dim, False, False)).transpose(1, 2)
            value_states = op(hidden_states, vw, vb, vt, False, head_dim)
        else:
            query_states = op(hidden_states, qw, qb, qt, False, head_dim)
            key_states = op(hidden_states, kw, kb, kt, False, head_dim)
            value_states = op(hidden_states, vw, vb, vt, False, head_dim)
        if normed_after:
            query_states = self.q_norm(query_states)
            key_states = self.k_norm(key_states)
        return attend(self, hidden_states, query_states, key_states, value_states, position_embeddings,
                      past_key_values, attention_mask, keywords, kwargs, "o_proj")

    return forward


def _neox_head_views_forward(torch, original, form, dependencies=None):
    """GPT-NeoX's attention forward (Pythia's) with its one q/k/v projection split into heads
    of all three by the Linear's node (`out_head_dim` 3 * head_size: stock's view and
    transpose), then chunked as the original chunks it, and `dense` taking the merged heads in
    its node: three dispatched ops and autograd nodes fewer a layer, the same tensors and
    gradients bit for bit. Served as `_head_views_forward` serves, the projections being
    query_key_value and dense; anything else runs the original."""
    op, enabled = torch.ops.torchfuse.linear_cast.default, torch.ops.torchfuse.enabled.default
    untraced = _untraced_call(torch)
    heads, projection, attend = _attention_parts(torch, original)
    keywords, missing = _ATTENTION_KEYWORDS[form], object()
    attributes = ("head_size", "query_key_value", "dense")

    def projections(self, x):
        """query_key_value's (weight, bias, dtype) and its head split's size, or None."""
        found = heads(self, x, attributes)
        if found is None:
            return None
        cls, own, children, head_size = found
        p = projection(cls, own, children, "query_key_value", x)
        if p is None or p[0].shape[0] % (3 * head_size) != 0:
            return None
        return (p, 3 * head_size) if enabled("head_views") else None

    @functools.wraps(original)
    def forward(self, hidden_states, attention_mask=missing, layer_past=None, position_embeddings=missing, **kwargs):
        # Traces first: torch.compile reads nothing more of this wrapper than that.
        served = None
        if untraced() and attention_mask is not missing and position_embeddings is not missing:
            served = projections(self, hidden_states)
        if served is None:
            return original(self, hidden_states, layer_past=layer_past,
                            **_passed_on(kwargs, missing, attention_mask=attention_mask,
                                         position_embeddings=position_embeddings))
        (weight, bias, dtype), heads_size = served
        qkv = op(hidden_states, weight, bias, dtype, False, heads_size)
        query_states, key_states, value_states = qkv.chunk(3, dim=-1)
        return attend(self, hidden_states, query_states, key_states, value_states, position_embeddings,
                      layer_past, attention_mask, keywords, kwargs, "dense")

    return forward


def _gpt2_head_views_forward(torch, original, form, dependencies=None):
    """GPT-2's attention forward with c_attn's output split into q, k and v heads by its node
    (torchfuse::linear_cast_split: stock's split, views and transposes, as views of the one GEMM
    output) and c_proj taking the merged heads in its node (`merge_input_heads`): eight
    dispatched ops and autograd nodes fewer a layer (the split, three views and transposes, the
    view before c_proj; one node for the split's three outputs), the tensors the cache and the
    attention see stock's (sizes, strides, values) and every gradient stock's bit for bit (the
    node's backward makes the split's, views' and transposes' calls). The cache, the attention
    interface (or eager's upcast and reordered attention), c_proj's call where it is not merged
    and the residual's dropout run as the original writes them. Served for self-attention (no
    encoder_hidden_states) with grad on, hidden_states a plain contiguous 3-D CUDA tensor (a CPU
    one with the tests' switch), c_attn and c_proj plain HF Conv1Ds (`_plain_conv1d_check`),
    c_attn three `split_size`s wide, `split_size` whole heads, outside traces, torch function
    and dispatch modes and global module hooks, with the `head_views` toggle on; anything else
    runs the original."""
    split_op, op = torch.ops.torchfuse.linear_cast_split.default, torch.ops.torchfuse.linear_cast.default
    enabled, untraced = torch.ops.torchfuse.enabled.default, _untraced_call(torch)
    heads, conv1d, _ = _attention_parts(torch, original, conv1d=True)
    names, keywords = original.__globals__, _ATTENTION_KEYWORDS[form]
    attributes = ("head_dim", "split_size", "c_attn", "c_proj")

    def projection(self, x):
        """c_attn's (weight, bias, dtype), the split's size and the head size, or None."""
        if not enabled("head_views"):
            return None
        found = heads(self, x, attributes)
        if found is None or not x.is_contiguous():
            return None
        cls, own, children, head_dim = found
        split_size = own.get("split_size")
        if type(split_size) is not int or split_size <= 0 or split_size % head_dim != 0:
            return None
        p = conv1d(cls, own, children, "c_attn", x)
        if p is None or p[0].shape[1] != 3 * split_size:
            return None
        return p, split_size, head_dim

    @functools.wraps(original)
    def forward(self, hidden_states, past_key_values=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, output_attentions=False, **kwargs):
        # Traces first: torch.compile reads nothing more of this wrapper than that.
        served = projection(self, hidden_states) if untraced() and encoder_hidden_states is None else None
        if served is None:
            return original(self, hidden_states, past_key_values, attention_mask, encoder_hidden_states,
                            encoder_attention_mask, output_attentions, **kwargs)
        if past_key_values is not None:
            if isinstance(past_key_values, names["EncoderDecoderCache"]):
                past_key_values.is_updated.get(self.layer_idx)  # read as the original reads it
                cache = past_key_values.self_attention_cache
            else:
                cache = past_key_values
        (weight, bias, dtype), split_size, head_dim = served
        query_states, key_states, value_states = split_op(hidden_states, weight, bias, dtype, True,
                                                          [split_size] * 3, head_dim)

        if past_key_values is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

        using_eager = self.config._attn_implementation == "eager"
        attention_interface = names["ALL_ATTENTION_FUNCTIONS"].get_interface(
            self.config._attn_implementation, names["eager_attention_forward"]
        )
        if using_eager and self.reorder_and_upcast_attn:
            attn_output, attn_weights = self._upcast_and_reordered_attn(
                query_states, key_states, value_states, attention_mask
            )
        else:
            attn_output, attn_weights = attention_interface(
                self, query_states, key_states, value_states, attention_mask, **keywords(self), **kwargs)

        own = self.__dict__
        p = (conv1d(type(self), own, own.get("_modules", {}), "c_proj", attn_output)
             if type(attn_output) is torch.Tensor and attn_output.dim() == 4 and attn_output.is_contiguous()
             else None)
        if p is not None:
            attn_output = op(attn_output, p[0], p[1], p[2], True, 0, True)
        else:
            attn_output = attn_output.reshape(*attn_output.shape[:-2], -1).contiguous()
            attn_output = self.c_proj(attn_output)
        attn_output = self.resid_dropout(attn_output)

        return attn_output, attn_weights

    return forward


def _plain_conv1d_check(torch):
    """A function (module, device) -> whether the module is a plain HF Conv1D on that device:
    its class's forward the recognised `hf_conv1d` code (or torchfuse's rewrite of it) with what
    that code calls (torch.addmm) unchanged, nothing but its forward observing its calls
    (`_unobserved`), its weight a plain 2-D tensor `nf` wide and its bias a plain tensor, neither
    an instance entry nor found through a class attribute or a __getattr__ of the class's own."""
    plain, module_getattr = (torch.Tensor, torch.nn.Parameter), torch.nn.Module.__getattr__
    conv1d_forms = {}  # a class's forward -> its original's `unchanged`, or None: not Conv1D's

    def plain_conv1d(m, device):
        forward = _class_forward(m)
        if forward not in conv1d_forms:
            rewritten = _REWRITTEN.get(forward)
            conv1d_forms[forward] = (
                rewritten[1].unchanged if rewritten is not None and rewritten[0] == "hf_conv1d"
                else compositions.Dependencies(forward).unchanged if compositions.form_of(forward) == "hf_conv1d"
                else None)
        unchanged = conv1d_forms[forward]
        if unchanged is None or not _unobserved(torch, m) or not unchanged():
            return False
        params, own = m._parameters, m.__dict__
        weight, bias = params.get("weight"), params.get("bias")
        return (type(weight) in plain and type(bias) in plain and weight.device == device and weight.dim() == 2
                and type(own.get("nf")) is int and own["nf"] == weight.shape[1]
                and "weight" not in own and "bias" not in own
                and _plain_linear_class(type(m), None, module_getattr))

    return plain_conv1d


def _passed_on(kwargs, missing, **arguments):
    """`kwargs` with the `arguments` that were given (not `missing`): a call of the original
    with the arguments as given, its own defaults (or its error) for the others."""
    kwargs.update((name, value) for name, value in arguments.items() if value is not missing)
    return kwargs


@functools.lru_cache(maxsize=None)
def _plain_attention_class(cls, module_getattr, names):
    """Whether an attention class's attributes `names` (its head size and projections) are its
    instance's entries as nn.Module finds them: no class attribute of those names, no
    __getattr__ or __getattribute__ of its own."""
    return (cls.__getattr__ is module_getattr and cls.__getattribute__ is object.__getattribute__
            and all(_submodule_only(cls, name) for name in names))


def _attention_parts(torch, original, conv1d=False):
    """What the head_views rewrites of `original` share: (heads(module, x, attributes): below,
    projection(cls, own, children, name, x): the plain Linear `name`'s (weight, bias, dtype) for
    input x, or None, attend(...): the rest of the forward, below). Served where nn.Linear's rewrite
    would serve a call (`_linear_forward`): grad on, x a plain 3-D CUDA tensor (a CPU one too with
    the tests' switch, without CPU autocast), nn.Linear's forward torch's own (or the linear rewrite
    of it) calling an unpatched F.linear, outside traces, torch function and dispatch modes and
    global module hooks; a projection is a plain, unobserved nn.Linear submodule on x's device
    (`_plain_linear_check`), not compiled in place, with a 2-D weight, of a dtype `_linear_dtype`
    serves. With `conv1d` the projections are HF Conv1Ds instead (`_plain_conv1d_check`), and
    nn.Linear's forward and F.linear are not asked about."""
    op = torch.ops.torchfuse.linear_cast.default
    tensor, grad_on, jit_tracing = torch.Tensor, torch.is_grad_enabled, torch._C._get_tracing_state
    function_mode, dispatch_modes = torch._C._is_torch_function_mode_enabled, torch._C._len_torch_dispatch_stack
    plain_module = _plain_conv1d_check(torch) if conv1d else _plain_linear_check(torch)
    cast_to = _linear_dtype(torch)
    functional, linear = torch.nn.functional, torch.nn.Linear
    linear_function, linear_forwards = functional.linear, _linear_forwards(torch)
    unpatched = compositions.Dependencies(linear_forwards[0]).unchanged
    torchs = linear_forwards[0].__module__ == "torch.nn.modules.linear"
    cpu_too, cpu_autocast = _HEAD_VIEWS_ON_CPU, torch.is_autocast_enabled
    module_getattr, names = torch.nn.Module.__getattr__, original.__globals__

    def heads(module, x, attributes):
        """(its class, its __dict__, its submodules, its head size) where a call of the attention
        `module` with input x may be served at all: its head size (`attributes[0]`, a positive
        int) and projections found where nn.Module finds them (no class attribute or __getattr__
        of the class's own in between); else None."""
        if not served(x):
            return None
        own, cls = module.__dict__, type(module)
        size = own.get(attributes[0])
        if type(size) is not int or size <= 0 or not _plain_attention_class(cls, module_getattr, attributes):
            return None
        return cls, own, own.get("_modules", {}), size

    def served(x):
        return (type(x) is tensor and (x.is_cuda or (cpu_too and not cpu_autocast("cpu"))) and x.dim() == 3
                and grad_on() and not function_mode() and not dispatch_modes() and not jit_tracing()
                and not _global_module_hooks(torch)
                and (conv1d or (torchs and linear.forward in linear_forwards
                                and functional.linear is linear_function and unpatched())))

    def projection(cls, own, children, name, x):
        if name in own or not _submodule_only(cls, name):
            return None
        m = children.get(name)
        if not plain_module(m, x.device) or m.__dict__.get("_compiled_call_impl") is not None:
            return None
        params = m._parameters
        weight, bias = params["weight"], params.get("bias")
        if weight.dim() != 2:  # F.linear takes a 1-D weight: its output has no head dim
            return None
        dtype = cast_to(x, weight, bias)
        return None if dtype is None else (weight, bias, dtype)

    def attend(module, hidden_states, query_states, key_states, value_states, position_embeddings, cache,
               attention_mask, keywords, kwargs, out_name):
        """The forward from the rotary on, as the attention forms write it: the module's
        `apply_rotary_pos_emb`, the cache's update, the attention interface with `keywords(module)`
        and kwargs, and the output projection `out_name`: in its node with the heads merged
        (`merge_input_heads`) where the attention's output is a contiguous [*lead, heads,
        head_dim] tensor and `out_name` a plain Linear then, else the original's reshape,
        contiguous and call."""
        input_shape = hidden_states.shape[:-1]
        cos, sin = position_embeddings
        query_states, key_states = names["apply_rotary_pos_emb"](query_states, key_states, cos, sin)

        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, module.layer_idx)

        attention_interface = names["ALL_ATTENTION_FUNCTIONS"].get_interface(
            module.config._attn_implementation, names["eager_attention_forward"]
        )
        attn_output, attn_weights = attention_interface(
            module, query_states, key_states, value_states, attention_mask, **keywords(module), **kwargs)

        if (type(attn_output) is tensor and attn_output.dim() == 4 and attn_output.shape[:2] == input_shape
                and attn_output.is_contiguous()):
            own = module.__dict__
            p = projection(type(module), own, own.get("_modules", {}), out_name, attn_output)
            if p is not None:
                return op(attn_output, p[0], p[1], p[2], False, 0, True), attn_weights
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return getattr(module, out_name)(attn_output), attn_weights

    return heads, projection, attend


def _plain_linear_check(torch):
    """A function (module, device) -> whether the module is a plain nn.Linear on that device
    (weight fp32 or 16-bit, bias absent or a plain tensor) that nothing but its own forward
    observes: _unobserved's checks but for the global hooks (the caller asks those once), read
    from the module's dicts, as it runs before every call of the modules it serves
    (Module.__getattr__ costs about a microsecond a lookup)."""
    linear, plain = torch.nn.Linear, (torch.Tensor, torch.nn.Parameter)
    weights = (torch.float32, torch.bfloat16, torch.float16)
    module_call, module_call_impl = torch.nn.Module.__call__, torch.nn.Module._call_impl

    def plain_linear(m, device):
        if type(m) is not linear:
            return False
        own, params = m.__dict__, m._parameters
        weight, bias = params.get("weight"), params.get("bias", False)
        return (type(weight) in plain and weight.dtype in weights and weight.device == device
                and (bias is None or type(bias) in plain)
                and "forward" not in own and "weight" not in own and "bias" not in own
                and linear.__call__ is module_call and linear._call_impl is module_call_impl
                and not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                         or m._backward_pre_hooks))

    return plain_linear


@functools.lru_cache(maxsize=None)
def _submodule_only(cls, name):
    """Whether `self.<name>` on an instance of `cls` finds its submodule: no class attribute (a
    property, a descriptor) of that name comes first."""
    return not any(name in vars(c) for c in cls.__mro__)


def _shared_cast(torch):
    """Under CUDA autocast every plain Linear casts its fp32 input to autocast's dtype
    (`input.to(dtype)`, autocast's cast): a module that passes one fp32 input to several of them
    has it cast once per Linear, each cast a copy kept for the backward. Cast once up front
    instead (bf16 autocast), the Linears take that tensor as it is: the same values in every
    matmul; the gradients of the Linears' inputs now add in bf16 before the one cast back
    (within the correctness contract, not bit for bit). A function (module, x, the attributes
    x goes to) -> the input to pass on: x cast, or x itself where any of those attributes is
    not a plain, unobserved Linear on x's device (or is shadowed by another attribute of that
    name), x is not a plain fp32 CUDA tensor, autocast is off or fp16, the call is traced or
    under a torch function or dispatch mode, or the toggle is switched off at run time
    (`set_enabled`: no op of its own stands between, so the rewrite asks)."""
    linear, tensor, fp32, bf16 = torch.nn.Linear, torch.Tensor, torch.float32, torch.bfloat16
    autocast, autocast_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
    untraced, enabled = _untraced_call(torch), torch.ops.torchfuse.enabled.default
    function_mode = torch._C._is_torch_function_mode_enabled
    plain_linear = _plain_linear_check(torch)
    # nn.Linear's own forward (F.linear of its weight and bias, which autocast casts), as torch
    # defines it: a patch of it, or of the F.linear it calls, means the Linears may do more.
    linear_forwards = _linear_forwards(torch)  # torch's own, and the linear rewrite's of it
    torchs = linear_forwards[0].__module__ == "torch.nn.modules.linear"
    unpatched = compositions.Dependencies(linear_forwards[0]).unchanged

    dispatch_modes = torch._C._len_torch_dispatch_stack

    def cast(module, x, sites):
        # bf16 only: its sums have fp32's range; fp16's could overflow where stock's fp32 sum
        # of the same gradients does not (loss scaling runs them near fp16's largest). Not
        # under a dispatch mode either, which must see stock's ops (one cast per Linear).
        if not (type(x) is tensor and x.dtype == fp32 and x.is_cuda and autocast("cuda")
                and autocast_dtype("cuda") == bf16 and untraced() and not function_mode()
                and not dispatch_modes() and torchs and linear.forward in linear_forwards
                and unpatched() and not _global_module_hooks(torch)):
            return x
        own, cls = module.__dict__, type(module)
        children = own.get("_modules", {})
        if (all(name not in own and _submodule_only(cls, name) and plain_linear(children.get(name), x.device)
                for name in sites) and enabled("shared_cast")):
            return x.to(bf16)
        return x

    return cast


def _shared_cast_forward(torch, forward, input_name, sites):
    """`forward` (the class's, rewritten or not) with its input cast once (`_shared_cast`) where
    its code (read before any rewrite) passes the input only to `sites` and reads its shape."""
    cast = _shared_cast(torch)

    @functools.wraps(forward)
    def shared_cast(self, *args, **kwargs):
        if args:
            return forward(self, cast(self, args[0], sites), *args[1:], **kwargs)
        if input_name in kwargs:
            kwargs[input_name] = cast(self, kwargs[input_name], sites)
        return forward(self, *args, **kwargs)

    return shared_cast


# A norm class's forward -> a function (module, x) -> the module's output for an fp32 x written
# in bf16 by torchfuse::norm_cast, or None where the original must run: the norms
# `_norm_cast_forward` may switch. nn.LayerNorm's is added when the first layer is rewritten,
# Llama's RMSNorm's (`_rms_norm_forward`) when its rewrite is made.
_NARROWERS = {}

# Classes whose forward passes its input only to its attributes' calls
# (`compositions.consumer_input`, read before any rewrite): {class: (the input's name, the
# attributes, the class's forward once its module was patched)}. A forward replaced since is
# another forward: no norm writes bf16 for it.
_CONSUMERS = {}


def _layer_norm_narrower(torch):
    """nn.LayerNorm's `_NARROWERS` entry: F.layer_norm of an fp32 x over its last dim with an
    fp32 weight and bias (the form measured on the GPU: GPT-2's, GPT-NeoX's, ViT's), then the
    cast, as torchfuse::norm_cast."""
    op, plain = torch.ops.torchfuse.norm_cast.default, (torch.Tensor, torch.nn.Parameter)
    fp32, bf16 = torch.float32, torch.bfloat16
    forward = torch.nn.LayerNorm.forward
    unchanged = compositions.Dependencies(forward).unchanged

    def plain_parameter(p, shape, device):
        return type(p) in plain and p.dtype == fp32 and p.shape == shape and p.device == device

    def narrow(module, x):
        own, params = module.__dict__, module._parameters
        weight, bias = params.get("weight"), params.get("bias")
        shape, eps = own.get("normalized_shape"), own.get("eps")
        if (type(shape) is tuple and len(shape) == 1 and x.shape[-1] == shape[0] and type(eps) is float
                and "weight" not in own and "bias" not in own
                and plain_parameter(weight, shape, x.device) and plain_parameter(bias, shape, x.device)
                and unchanged()):
            return op(x, weight, bias, eps, False, bf16)
        return None

    return forward, narrow


def _sites_check(torch):
    """A function (module, its sites, device) -> how many of the sites are there, each a plain,
    unobserved Linear (`_plain_linear_check`) or HF Conv1D (the recognised `hf_conv1d` forward:
    addmm of x, which autocast casts) on that device; None where any site is something else.
    A site that is no attribute at all (or a submodule slot set to None) counts as none: its call
    raises whatever its input's dtype (GPT-2's `q_attn`, made only for cross-attention)."""
    plain_linear, plain = _plain_linear_check(torch), (torch.Tensor, torch.nn.Parameter)
    module_getattr = torch.nn.Module.__getattr__
    conv1d_forms = {}  # a class's forward -> it is the recognised Conv1D forward

    def plain_conv1d(m, device):
        forward = _class_forward(m)
        known = conv1d_forms.get(forward)
        if known is None:
            known = conv1d_forms[forward] = _is_conv1d_forward(forward)
        if not (known and _unobserved(torch, m)):
            return False
        params = m._parameters
        weight, bias = params.get("weight"), params.get("bias")
        return (type(weight) in plain and weight.device == device and (bias is None or type(bias) in plain)
                and "weight" not in m.__dict__ and "bias" not in m.__dict__)

    def sites_present(module, sites, device):
        own, cls = module.__dict__, type(module)
        children = own.get("_modules", {})
        present = 0
        for name in sites:
            if name in own or not _submodule_only(cls, name):
                return None
            child = children.get(name, children)  # children itself: no such submodule
            if child is None:
                continue  # a slot set to None: its call raises whatever the input's dtype
            if child is children:
                if (name in own.get("_parameters", ()) or name in own.get("_buffers", ())
                        or cls.__getattr__ is not module_getattr):
                    return None
                continue
            if not (plain_linear(child, device) or plain_conv1d(child, device)):
                return None
            present += 1
        return present

    return sites_present


def _norm_cast_forward(torch, forward, pairs):
    """`forward` (a layer class's, rewritten or not) with the norms of `pairs`
    (`compositions.norm_handoffs`: (norm, sub, how), the norm's output handed only to `sub`)
    writing their output in bf16 where that is all its consumers make of it: under CUDA bf16
    autocast, each Linear `sub` passes its input to casts it to bf16 first. The norm and the
    cast become one op (torchfuse::norm_cast), and in the backward the cast back and the norm's
    backward: the norm's output is never made in fp32. Values: bitwise the norm's output cast,
    and the norm's gradient from the same bf16 gradient, where torchfuse's kernel serves the
    plain norm too (within the contract where the plain norm is stock's and only a narrowed-only
    kernel serves norm_cast, `registry/norm.toml`); the projections' input gradients add in
    bf16 as under shared_cast (required where `sub` has more than one: its toggle must be on).

    Per call: the norm is switched only for this forward's duration and its first call (an
    instance `forward` the norm's `__call__` finds first, popped again), made by this forward's
    own code (the caller's frame past nn.Module's call: not a submodule holding the same norm)
    under bf16 autocast still, in this thread, where the norm is one `_NARROWERS` has
    (nn.LayerNorm with a weight and a bias; Llama's RMSNorm rewritten), `sub`'s class passes its
    input only to Linear layers (`_CONSUMERS`, its forward unchanged since) and takes the norm's
    output as that input (`how`); both modules unobserved (no hooks, not compiled in place), and
    outside traces, torch function and dispatch modes, global module hooks. At the norm's call,
    x must be a plain, contiguous fp32 CUDA tensor and `sub`'s sites plain Linear/Conv1D layers
    on its device (`_sites_check`); anything else runs the norm's own forward."""
    if torch.nn.LayerNorm.forward not in _NARROWERS:
        layer_norm_forward, narrow = _layer_norm_narrower(torch)
        _NARROWERS[layer_norm_forward] = narrow
    tensor, fp32, bf16 = torch.Tensor, torch.float32, torch.bfloat16
    autocast, autocast_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
    untraced, enabled = _untraced_call(torch), torch.ops.torchfuse.enabled.default
    function_mode, dispatch_modes = torch._C._is_torch_function_mode_enabled, torch._C._len_torch_dispatch_stack
    sites_present, get_ident, frame = _sites_check(torch), threading.get_ident, sys._getframe
    # The code that calls the norm (past any decorator), and nn.Module's call between the two.
    layer_code = inspect.unwrap(forward).__code__
    module_call = {torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__}

    def called_by_the_layer():
        caller = frame(2)
        while caller is not None and caller.f_code in module_call:
            caller = caller.f_back
        return caller is not None and caller.f_code is layer_code

    def plain_module(m):
        return _unobserved(torch, m) and m.__dict__.get("_compiled_call_impl") is None

    def consumer_sites(sub, how):
        known = _CONSUMERS.get(type(sub))
        if known is None:
            return None
        input_name, sites, final_forward = known
        if type(sub).forward is not final_forward or (how != 0 and how != input_name) or not plain_module(sub):
            return None
        return sites

    def switch(norm, narrow, sub, sites):
        owner, own = get_ident(), norm.__dict__

        def switched(*args, **kwargs):
            if own.get("forward") is switched:
                own.pop("forward", None)  # the first call only
            if (get_ident() == owner and len(args) == 1 and not kwargs and called_by_the_layer()
                    and autocast("cuda") and autocast_dtype("cuda") == bf16):
                x = args[0]
                if type(x) is tensor and x.dtype == fp32 and x.is_cuda and x.is_contiguous():
                    present = sites_present(sub, sites, x.device)
                    if present is not None and (present < 2 or enabled("shared_cast")):
                        out = narrow(norm, x)
                        if out is not None:
                            return out
            return type(norm).forward(norm, *args, **kwargs)

        own["forward"] = switched
        return switched

    @functools.wraps(forward)
    def norm_cast(self, *args, **kwargs):
        if not (untraced() and autocast("cuda") and autocast_dtype("cuda") == bf16 and not function_mode()
                and not dispatch_modes() and not _global_module_hooks(torch)):
            return forward(self, *args, **kwargs)
        modules, chosen = self.__dict__.get("_modules", {}), []
        for norm_name, sub_name, how in pairs:
            norm, sub = modules.get(norm_name), modules.get(sub_name)
            narrow = _NARROWERS.get(getattr(type(norm), "forward", None))
            # A norm held under two names is left alone.
            if narrow is None or not plain_module(norm) or sum(m is norm for m in modules.values()) != 1:
                continue
            sites = consumer_sites(sub, how)
            if sites is not None:
                chosen.append((norm, narrow, sub, sites))
        if not chosen or not enabled("norm_cast"):
            return forward(self, *args, **kwargs)
        switched = [(norm, switch(norm, narrow, sub, sites)) for norm, narrow, sub, sites in chosen]
        try:
            return forward(self, *args, **kwargs)
        finally:
            for norm, mine in switched:
                if norm.__dict__.get("forward") is mine:
                    norm.__dict__.pop("forward", None)

    return norm_cast


class Rewrite(typing.NamedTuple):
    """One rewrite of a recognised form (compositions.py holds its reference code and the
    toggle that switches it): what makes the replacement from the original
    (`make(torch, original, form, dependencies)`), and what the replacement calls, as the log
    says it."""
    make: typing.Callable
    calls: str


_OPS = "torch.ops.torchfuse."

# Every rewrite, by the form it replaces: the one table (a test holds it to the forms
# compositions.COMPUTES says are served).
REWRITES = {
    # A class's forward.
    "new_gelu": Rewrite(functools.partial(_gelu_forward, widens=True), _OPS + "gelu_tanh"),
    "fast_gelu": Rewrite(_gelu_forward, _OPS + "gelu_tanh"),
    "hf_conv1d_mlp": Rewrite(_conv1d_mlp_forward, _OPS + "gelu_tanh"),
    "hf_conv1d": Rewrite(_conv1d_forward, _OPS + "linear_cast of the [in, out] weight (one autograd node; "
                                          "under CUDA autocast after autocast's casts)"),
    **dict.fromkeys((form for form in compositions.ATTENTION_FORMS
                     if form not in ("gpt_neox_attention", "gpt2_attention")),
                    Rewrite(_head_views_forward, _OPS + "linear_cast of q, k and v split into heads, and of the "
                                                 "merged heads for o_proj (one autograd node each)")),
    "gpt_neox_attention": Rewrite(_neox_head_views_forward, _OPS + "linear_cast of q, k and v split into heads "
                                                         "together, and of the merged heads for dense"),
    "gpt2_attention": Rewrite(_gpt2_head_views_forward, _OPS + "linear_cast_split of c_attn into q, k and v "
                                                     "heads, and linear_cast of the merged heads for c_proj"),
    "hf_rms_norm": Rewrite(_rms_norm_forward, _OPS + "hf_rms_norm; a 16-bit x with an fp32 weight: "
                                              "aten::rms_norm without the weight, then the weight"),
    "gemma_rms_norm": Rewrite(_gemma_rms_norm_forward, "aten::rms_norm in fp32 (torchfuse's _fused_rms_norm)"),
    "cohere_layer_norm": Rewrite(_cohere_layer_norm_forward, "aten::layer_norm in fp32 (torchfuse's "
                                                             "native_layer_norm), then the original's cast"),
    "qwen3_next_rms_norm_gated": Rewrite(_norm_then_gate_forward, "Llama's RMSNorm as hf_rms_norm's rewrite "
                                         "computes it, then the original's gating"),
    "mamba_rms_norm_gated": Rewrite(_mamba_gated_rms_norm_forward, "the original's gating, then aten::rms_norm in "
                                    "fp32 (torchfuse's _fused_rms_norm), the original's cast and weight"),
    "gemma4_rms_norm": Rewrite(_gemma4_rms_norm_forward, "aten::rms_norm in fp32 (torchfuse's _fused_rms_norm), "
                                                         "then the original's cast"),
    **dict.fromkeys(("gpt_oss_rms_norm", "helium_rms_norm"),
                    Rewrite(_gpt_oss_rms_norm_forward, "aten::rms_norm in fp32 (torchfuse's _fused_rms_norm), "
                                                       "then the original's cast")),
    "llama4_rms_norm": Rewrite(_llama4_rms_norm_forward, _OPS + "hf_rms_norm, as Llama's; a 16-bit x with an "
                                                         "fp32 weight: aten::rms_norm without the weight, then the weight"),
    **dict.fromkeys(("moshi_rms_norm", "fp32_rms_norm_weightless"),
                    Rewrite(_fp32_own_norm_forward, "aten::rms_norm in fp32 (torchfuse's _fused_rms_norm), "
                                                    "then the original's cast")),
    "unweighted_rms_norm": Rewrite(_unweighted_rms_norm_forward, "aten::rms_norm of x without a weight "
                                                                 "(torchfuse's _fused_rms_norm)"),
    "t5_rms_norm": Rewrite(_t5_rms_norm_forward, "aten::rms_norm in fp32 with an fp32 weight, else "
                                                 + _OPS + "hf_rms_norm"),
    **dict.fromkeys(("hf_gated_mlp", "hf_gated_mlp_inline", "llama4_gated_mlp", "t5gemma_gated_mlp",
                     "seed_oss_gated_mlp", "gemma3n_gated_mlp", "recurrent_gemma_gated_mlp", "falcon_h1_gated_mlp",
                     "deepseek_v4_clamped_gated_mlp", "glm5_clamped_gated_mlp"),
                    Rewrite(_gated_mlp_forward, _OPS + "silu_mul (SiLU) or gelu_tanh_mul (tanh GELU)")),
    "hf_packed_gated_mlp": Rewrite(_packed_gated_mlp_forward, _OPS + "silu_mul_packed"),
    # Module-level functions.
    "hf_moe_apply_gate": Rewrite(_moe_apply_gate, _OPS + "silu_mul_packed"),
    "hf_causal_lm_loss": Rewrite(_causal_lm_loss, _OPS + "cross_entropy"),
    "hf_rotary": Rewrite(_rotary, _OPS + "rotary"),
    "hf_rotary_pairs": Rewrite(_rotary, _OPS + "rotary (interleaved)"),
    "helium_rotary": Rewrite(_rotary, _OPS + "rotary (interleaved) of GLM's tables"),
    "hf_rotary_flipped": Rewrite(_rotary, _OPS + "rotary of -sin"),
    "hf_single_rotary": Rewrite(_single_rotary, _OPS + "rotary of x (and of none of it as k)"),
    **dict.fromkeys(("hf_rotary_cast_back", "hf_rotary_upcast"),
                    Rewrite(_rotary_cast_back, _OPS + "rotary, then the original's casts")),
    **dict.fromkeys(("cohere_rotary_pairs_upcast", "hf_rotary_pairs_upcast"),
                    Rewrite(_rotary_cast_back, _OPS + "rotary (interleaved), then the original's casts")),
    # GPT-NeoX's partial rotary, in its three writings.
    **dict.fromkeys(("hf_partial_rotary", "hf_partial_rotary_glm_doc", "hf_partial_rotary_inline",
                     "nemotron_partial_rotary"),
                    Rewrite(_partial_rotary, _OPS + "rotary, the rest of the head passed through in the same call")),
    **dict.fromkeys(("hf_rotary_pairs_partial", "glm4v_rotary_pairs_partial"),
                    Rewrite(_partial_rotary, _OPS + "rotary (interleaved), the rest of the head passed through in "
                                                    "the same call")),
    "qwen4_exp_partial_rotary": Rewrite(_optional_k_partial_rotary, _OPS + "rotary of q and k, the rest passed "
                                                                 "through in the same call; of q alone, then the "
                                                                 "original's cat"),
    "hf_prefix_rotary": Rewrite(_prefix_rotary, _OPS + "rotary of the patch tokens, then the original's cat"),
    "gptj_rotary": Rewrite(_every_two_rotary, _OPS + "rotary (interleaved) of x, of the tables repeated pair by pair"),
    "gpt_oss_rotary": Rewrite(_half_table_rotary, _OPS + "rotary of the half-size tables repeated over both halves"),
    # A class's other method.
    "hf_dynamic_layer_update": Rewrite(_dynamic_layer_update, _OPS + "kv_copy on the first append"),
    "hf_dynamic_sliding_window_layer_update": Rewrite(_dynamic_sliding_window_layer_update,
                                                      _OPS + "kv_copy on the first append"),
    "hf_ignore_causal_mask_sdpa": Rewrite(
        _mask_skip_under_compile, "under torch.compile, eager's is_causal=True where sizes decide"),
    "hf_ignore_bidirectional_mask_sdpa": Rewrite(
        _mask_skip_under_compile, "under torch.compile, eager's no mask where sizes decide"),
}


# Original module-level function -> its rewrite: a class that took the original as a method
# (an MoE experts class's `_apply_gate`, set when its module was imported before the function's
# module was patched: `torchfuse.enable()` after the model's import) takes the rewrite, whichever
# of the two modules is patched first.
_FUNCTIONS_REWRITTEN = {}


def _take_rewritten_methods(torch, module):
    for cls in list(vars(module).values()):
        if isinstance(cls, type) and cls.__module__ == module.__name__:
            for name, value in list(vars(cls).items()):
                rewritten = _FUNCTIONS_REWRITTEN.get(value) if isinstance(value, types.FunctionType) else None
                if rewritten is not None:
                    setattr(cls, name, rewritten)
                    note(torch, f"rewrite: {module.__name__}.{cls.__qualname__}.{name} takes the rewritten "
                                f"{value.__module__}.{value.__name__}", debug=True)


def patch_module(module):
    """Rewrites the known compositions `module` defines (see the module docstring). False where
    the library is not loaded yet (hooks installed before it): nothing is decided, and the
    module is patched when `enable()` loads it."""
    torch = sys.modules.get("torch")
    enabled = enabled_toggles(torch) if torch is not None else {}
    if not enabled:
        return False
    found = compositions.scan(module)
    # Read from the classes' own code before any rewrite replaces it.
    shared_inputs = compositions.scan_shared_inputs(module)
    consumers, handoffs = compositions.scan_consumers(module), compositions.scan_norm_handoffs(module)
    _take_rewritten_methods(torch, module)
    for cls, form in found.items():
        op = compositions.COMPUTES[form]
        where = f"{module.__name__}.{cls.__qualname__}.forward"
        # The head views are the linear node's: nothing to take without it.
        if not enabled.get(op, False) or (op == "head_views" and not enabled.get("linear", False)):
            note(torch, f"rewrite {op} off: {where} ({form}) left as it is", debug=True)
            continue
        original = cls.forward
        # Built once: the rewritten forward checks it, and rewrites of an enclosing module
        # check it through _REWRITTEN.
        dependencies = compositions.Dependencies(original)
        rewrite = REWRITES[form]
        cls.forward = rewrite.make(torch, original, form, dependencies)
        _REWRITTEN[cls.forward] = (form, dependencies)
        note(torch, f"rewrite {op}: {where} ({form}) -> {rewrite.calls}")
    for cls, (method, form) in compositions.scan_methods(module).items():
        op, where = compositions.COMPUTES[form], f"{module.__name__}.{cls.__qualname__}.{method}"
        if not enabled.get(op, False):
            note(torch, f"rewrite {op} off: {where} ({form}) left as it is", debug=True)
            continue
        rewrite = REWRITES[form]
        setattr(cls, method, rewrite.make(torch, getattr(cls, method), form))
        note(torch, f"rewrite {op}: {where} ({form}) -> {rewrite.calls}")
    for cls, (input_name, sites) in shared_inputs.items():
        where = f"{module.__name__}.{cls.__qualname__}.forward"
        if not enabled.get("shared_cast", False):
            note(torch, f"rewrite shared_cast off: {where} left as it is", debug=True)
            continue
        cls.forward = _shared_cast_forward(torch, cls.forward, input_name, sites)
        note(torch, f"rewrite shared_cast: {where} -> {input_name} cast once for {', '.join(sites)} "
                    "under autocast")
    for cls, pairs in handoffs.items():
        where = f"{module.__name__}.{cls.__qualname__}.forward"
        if not enabled.get("norm_cast", False):
            note(torch, f"rewrite norm_cast off: {where} left as it is", debug=True)
            continue
        cls.forward = _norm_cast_forward(torch, cls.forward, pairs)
        handed = ", ".join(f"{norm} -> {sub}" for norm, sub, _ in pairs)
        note(torch, f"rewrite norm_cast: {where} -> {handed}: the norm writes bf16 where its consumers "
                    "are Linear layers under bf16 autocast (" + _OPS + "norm_cast)")
    for cls, (input_name, sites) in consumers.items():
        _CONSUMERS[cls] = (input_name, sites, cls.forward)
    functions = compositions.scan_functions(module)
    for name, form in functions.items():
        original, op = getattr(module, name), compositions.COMPUTES[form]
        where = f"{module.__name__}.{name}"
        if not enabled.get(op, False):
            note(torch, f"rewrite {op} off: {where} ({form}) left as it is", debug=True)
            continue
        rewrite = REWRITES[form]
        rewritten = rewrite.make(torch, original, form)
        setattr(module, name, rewritten)
        _FUNCTIONS_REWRITTEN[original] = rewritten
        # Classes that took a shared module's function as a method (the MoE gate) in model
        # modules patched already (imported first).
        if not is_model_module(module.__name__):
            for other_name, other in list(sys.modules.items()):
                if other is not None and is_model_module(other_name):
                    _take_rewritten_methods(torch, other)
        for table in vars(module).values():  # LOSS_MAPPING: name -> loss function
            if isinstance(table, dict):
                for key, value in list(table.items()):
                    if value is original:
                        table[key] = rewritten
        note(torch, f"rewrite {op}: {where} ({form}) -> {rewrite.calls}")
    said = set()  # a name several forms share (apply_rotary_pos_emb) is said once
    for form, name in compositions.FUNCTION_NAMES.items():
        value = vars(module).get(name)
        if form in REWRITES and value is not None and name not in functions and name not in said:
            said.add(name)
            # Another object under the known name (the `kernels` package wraps HF's functions in
            # modules where it is installed) is said at info; other code (another model's RoPE
            # layout) at debug, as for classes.
            op, plain = compositions.COMPUTES[form], isinstance(value, types.FunctionType)
            note(torch, f"rewrite {op}: {module.__name__}.{name} is not the known {form} function "
                        f"(a {type(value).__module__}.{type(value).__qualname__}); left alone",
                 debug=plain)
    for name, value in list(vars(module).items()):
        if (isinstance(value, type) and value.__module__ == module.__name__ and value not in found
                and "forward" in value.__dict__ and any(k in name for k in _LOOKALIKES)):
            note(torch, f"rewrite: {module.__name__}.{name}.forward is not a known form; "
                        "left alone", debug=True)
