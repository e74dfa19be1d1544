"""Known compositions of library code, recognised by what their code is, not by their names.

HF's model code repeats a few compositions of small ops (the tanh GELU, RMSNorm computed in
fp32) under many class names: `LlamaRMSNorm` is copied into dozens of models. A class's
`forward` is one of the known forms when its bytecode, constants and the names it loads equal
those of the reference written below, compiled by the same interpreter, and the globals it
loads (`torch`, `math`) are those modules. Local variable names, annotations, docstrings and
line numbers do not matter; anything else does: Gemma's `(1 + weight)` form, a user's changed
forward, another library version's code are different code and are left alone.

This module recognises; the rewrite layer (issue 23) decides what serves a recognised form.
Nothing here imports torch.
"""
import dis
import math
import sys

# The reference forms, each written exactly as the library writes it (transformers 5.17), in a
# module that imports `math` and `torch` as the library's modules do: the compiler emits
# different bytecode for attribute calls on an imported name. Compiled, never run.
_PRELUDE = "import math\nimport torch\n\n\n"
_SOURCES = {
    # transformers.activations.NewGELUActivation.forward (GPT-2's "gelu_new").
    "new_gelu": """def forward(self, input):
    return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))
""",
    # transformers.activations.FastGELUActivation.forward ("gelu_fast").
    "fast_gelu": """def forward(self, input):
    return 0.5 * input * (1.0 + torch.tanh(input * 0.7978845608 * (1.0 + 0.044715 * input * input)))
""",
    # transformers.models.llama.modeling_llama.LlamaRMSNorm.forward, and its copies.
    "hf_rms_norm": """def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
""",
}

# Form name -> the composition it computes.
COMPUTES = {"new_gelu": "gelu_tanh", "fast_gelu": "gelu_tanh", "hf_rms_norm": "hf_rms_norm"}


def _compiled(source):
    """The code object of the one function `source` defines, compiled after the prelude."""
    module = compile(_PRELUDE + source, "<torchfuse reference>", "exec")
    return next(c for c in module.co_consts if hasattr(c, "co_code"))


FORMS = {name: _compiled(source) for name, source in _SOURCES.items()}


def _globals_loaded(code):
    """The global names a code object loads."""
    return {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}


def _same_code(a, b):
    """Equal bytecode, constants, loaded names and signature shape."""
    return (
        a.co_code == b.co_code
        and a.co_consts == b.co_consts
        and a.co_names == b.co_names
        and a.co_argcount == b.co_argcount
        and a.co_posonlyargcount == b.co_posonlyargcount
        and a.co_kwonlyargcount == b.co_kwonlyargcount
        and a.co_nlocals == b.co_nlocals
        and (a.co_flags & ~0x10) == (b.co_flags & ~0x10)  # CO_NESTED aside
    )


def _expected_global(name):
    return {"math": math, "torch": sys.modules.get("torch")}.get(name)


def form_of(function):
    """The name of the known form `function` is, or None."""
    code = getattr(function, "__code__", None)
    if code is None or getattr(function, "__defaults__", None) or getattr(function, "__closure__", None):
        return None
    for name, reference in FORMS.items():
        if not _same_code(code, reference):
            continue
        loaded = _globals_loaded(code)
        if all(
            _expected_global(g) is not None and function.__globals__.get(g) is _expected_global(g)
            for g in loaded
        ):
            return name
    return None


def scan(module):
    """The classes defined in `module` whose own `forward` is a known form: {class: form}."""
    found = {}
    for value in list(vars(module).values()):
        if not isinstance(value, type) or value.__module__ != module.__name__:
            continue
        forward = value.__dict__.get("forward")
        form = form_of(forward) if forward is not None else None
        if form is not None:
            found[value] = form
    return found
