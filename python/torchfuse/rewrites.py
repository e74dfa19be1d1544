"""The rewrite layer: known compositions in library code sent to one op torchfuse serves.

When `transformers.activations` or a `transformers.models.<name>.modeling_<name>` module is
imported, every class defined there whose `forward` is a known form (compositions.py: by its
code, not its name) gets a forward that calls torchfuse's op instead, provided the op's
toggle is on (`TORCHFUSE_OPS`). Each rewrite is logged once at info; a class that looks like
one (its name says RMSNorm or GELU) but whose code differs is left alone and logged at debug.

The new forward calls the op only for plain CUDA tensors of a dtype the op serves, outside
torch.compile (Inductor fuses the original composition itself, and sees torchfuse's aten
overrides where it does not); everything else runs the original code. The ops return what
the original would: same dtype (under autocast too), shape and strides; their calls are
counted in torchfuse's stats, and `torch.ops.torchfuse.set_enabled(name, False)` sends them to
PyTorch's own kernels.
"""
import functools
import json
import sys

from . import compositions

# Forms whose code calls torch.pow: under CUDA autocast pow runs in fp32 (autocast's fp32
# list), so the result is fp32 whatever the activation's dtype.
_FP32_UNDER_AUTOCAST = {"new_gelu": True, "fast_gelu": False}

# Class-name fragments of compositions we know of but may not recognise in every model (a
# different form): those classes are logged at debug as left alone.
_LOOKALIKES = ("RMSNorm", "GELU")


def is_model_module(name):
    """`transformers.models.<name>.modeling_<name>`-shaped module names."""
    parts = name.split(".")
    return len(parts) == 4 and parts[:2] == ["transformers", "models"] and parts[3].startswith(
        "modeling_")


MODULES = ("transformers.activations",)


def wants(name):
    """Whether the module of this name holds compositions the layer may rewrite."""
    return name in MODULES or is_model_module(name)


def _enabled(torch):
    """The toggles on in this process ({name: bool}), or {} when torchfuse is not loaded."""
    try:
        return json.loads(torch.ops.torchfuse.stats()).get("enabled", {})
    except Exception:
        return {}


def _note(torch, message, debug=False):
    try:
        torch.ops.torchfuse.note(message, debug)
    except Exception:
        pass


def _gelu_forward(torch, original, form):
    op = torch.ops.torchfuse.gelu_tanh.default
    tensor, served, fp32 = torch.Tensor, (torch.float32, torch.bfloat16, torch.float16), torch.float32
    compiling, autocast = torch.compiler.is_compiling, torch.is_autocast_enabled
    widens = _FP32_UNDER_AUTOCAST[form]

    @functools.wraps(original)
    def forward(self, input):
        if type(input) is tensor and input.is_cuda and input.dtype in served and not compiling():
            return op(input, fp32 if widens and autocast("cuda") else input.dtype)
        return original(self, input)

    return forward


def _rms_norm_forward(torch, original, form):
    op = torch.ops.torchfuse.hf_rms_norm.default
    tensor, parameter = torch.Tensor, torch.nn.Parameter
    compiling = torch.compiler.is_compiling

    @functools.wraps(original)
    def forward(self, hidden_states):
        weight, eps = self.weight, self.variance_epsilon
        if (type(hidden_states) is tensor and hidden_states.is_cuda
                and type(weight) in (tensor, parameter) and type(eps) is float and not compiling()):
            return op(hidden_states, weight, eps)
        return original(self, hidden_states)

    return forward


# Op -> what makes the rewritten forward from the original.
_FORWARDS = {"gelu_tanh": _gelu_forward, "hf_rms_norm": _rms_norm_forward}


def patch_module(module):
    """Rewrites the known compositions `module` defines (see the module docstring)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    enabled = _enabled(torch)
    found = compositions.scan(module)
    for cls, form in found.items():
        op = compositions.COMPUTES[form]
        where = f"{module.__name__}.{cls.__qualname__}.forward"
        if not enabled.get(op, False):
            _note(torch, f"rewrite {op} off: {where} ({form}) left as it is", debug=True)
            continue
        cls.forward = _FORWARDS[op](torch, cls.forward, form)
        _note(torch, f"rewrite {op}: {where} ({form}) -> torch.ops.torchfuse.{op}")
    for name, value in list(vars(module).items()):
        if (isinstance(value, type) and value.__module__ == module.__name__ and value not in found
                and "forward" in value.__dict__ and any(k in name for k in _LOOKALIKES)):
            _note(torch, f"rewrite: {module.__name__}.{name}.forward is not a known form; "
                         "left alone", debug=True)
