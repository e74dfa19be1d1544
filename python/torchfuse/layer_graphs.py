"""Opt-in CUDA graphs of HF decoder layers and timm's ViT blocks (TORCHFUSE_LAYER_GRAPHS=1): each
recognised layer's forward and backward replayed from graphs captured on the layer's third call
of one shape, everything around the layers (the user's loop, the loss, the optimizer, logging
and its syncs) unchanged and eager. On a host-bound step the layers' Python, dispatch and
autograd work is most of the host's time; a replay is one launch. docs/step-capture.md holds the
design and the measurements.

A call replays only when everything the graph baked in is as it was at capture, checked at every
call (anything else runs the layer's own code, eager, as if this module were absent):
- the layer's class is one of LAYERS or BLOCKS (their forwards read and write nothing outside
  their arguments and parameters but the KV cache, below), grad on, no gradient checkpointing,
  outside torch.compile, torch.func, inference mode and anomaly mode, no saved-tensor hooks;
- every submodule: a class of torch.nn, of a transformers model, its activations or Conv1D, or
  PEFT's LoRA Linear (not a quantized layer's or another adapter's, whose Python state a graph
  would freeze), its scalar attributes (`training`, a dropout's `p`, `scaling`, ...), the
  contents of its dict, list, tuple and set attributes (LoRA's adapters' settings) and the
  config attributes it reads at each call (CALL_TIME_CONFIG: the attention implementation, a
  sliding window, ...) as captured, no hooks (global ones neither; transformers' output-
  capturing hooks pass while no capture is on), no tensor attribute that is not a parameter or
  buffer (FSDP1's views of its flat parameter);
- the arguments: the same tree of tensors of the same shapes, strides, dtypes, device and
  requires_grad (their values are copied into the graph's inputs) and the same other values
  (None, numbers, strings, flags); autocast's state, deterministic mode, TF32 and the SDPA
  backends' switches as captured (torchfuse's own op toggles switched at run time with
  `set_enabled` are not seen: the graph keeps the ops it was captured with);
- the parameters and buffers: the same tensors at the same addresses, requires_grad as captured;
  their values are read at replay, so the optimizer's in-place updates are seen. `model.to()`
  and `load_state_dict(assign=True)` move them: the graphs, which can never replay again, are
  dropped and the layer captures anew, once (a second move, as of parameters offloaded every
  step, leaves it eager);
- a KV cache argument is a fresh DynamicCache (HF builds one in every training forward with
  use_cache on) whose layer for this one is a DynamicLayer or DynamicSlidingWindowLayer: the
  replay gives back the keys and values the layer appended, as outputs of its autograd node, and
  the cache gets them by its own `update` after the replay, a copy as eager's first append makes,
  gradients flowing back through it as through eager's;
- no earlier replay of this layer still waits for its backward (a second forward before the
  first's backward, gradient accumulation of two forwards into one loss: eager).

What a replay returns is fresh memory (the outputs and the inputs' gradients are copied out of the
graph), or, for a parameter's gradient, the backward graph's own buffer lent to autograd: a .grad
of None becomes it (no copy, no second set of gradients in memory), a .grad of its own adds it in
place. The backward's buffers have a pool of their own, which no forward replay writes. Whatever
still holds a lent buffer when the next backward replays is counted (references to its storage) and
looked after first: a .grad being accumulated into moves to a copy of its own (the same tensor, the
same values); a gradient torch.autograd.grad returned, a hook's, a view has its values put back. So
nothing a user keeps changes at the next replay, with one exception no count sees: a copy of a
.grad queued on another stream (record_stream) and the .grad dropped must be waited for before the
layer's next backward, as a step's synchronisation does. The weights are cast inside the graph (the
autocast cache is off in captures, as PyTorch requires), from their values at each replay. The
graphs write the same memory at every replay: a second backward through one replay (retain_graph),
or one after the layer's next replay, raises a RuntimeError naming this switch instead of reading
overwritten activations; a double backward (create_graph=True) through a replay raises autograd's
once_differentiable error. A capture that fails (a sync inside the layer, an op that cannot be
captured) gives the thread its stream and the device's random generator back (a failed capture
leaves the generator marked as capturing, and any later dropout would raise), is tried once more at
the layer's next call, then leaves the layer eager for the process, with one warning. Each layer
keeps its two memory pools for the process's life: its saved activations, as eager keeps them until
the backward, its workspace and its parameters' gradients. Dropout inside a layer draws from the
graph's registered generator: eager's distribution, not eager's numbers for a fixed seed.
"""
import atexit
import collections
import contextlib
import functools
import operator
import os
import sys
import types
import weakref

from ._library import note
from .rewrites import _global_module_hooks, _untraced_call

# The decoder layers whose forward is known to touch nothing but its arguments, its parameters
# and a KV cache's update (transformers 5's code, read; each has a GPU test of the whole model).
# Not here: GPT-J's block (it moves a tensor attribute, its sinusoids, to the device at its first
# call: the guards send it eager anyway), the MoE layers (their routing syncs with the host).
LAYERS = frozenset({
    "LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
    "Phi3DecoderLayer",
    # Gemma's (1 + weight) norms and GELU-tanh MLP; Gemma 2 and 3's four norms a layer, sliding
    # or global attention set per layer at construction, Gemma 3's q/k norms.
    "GemmaDecoderLayer", "Gemma2DecoderLayer", "Gemma3DecoderLayer",
    # Post-norm with q/k norms over the projections; a constant residual multiplier; parallel
    # attention and MLP after one norm (Cohere's, Phi's); GLM-4's four norms.
    "Olmo2DecoderLayer", "GraniteDecoderLayer", "CohereDecoderLayer", "PhiDecoderLayer",
    "Glm4DecoderLayer",
    # GPT-NeoX's (Pythia's) layer, its cache passed as `layer_past`; GPT-2's block, its
    # projections transformers' Conv1D (an addmm of its own weight and bias).
    "GPTNeoXLayer", "GPT2Block",
    # The encoders' post-norm layer (RoBERTa's is BERT's code): no KV cache in an encoder; a
    # decoder's cache runs eager (its index is on the attention's inner module).
    "BertLayer", "RobertaLayer",
})

# Blocks of other libraries whose forwards were read, by (module, class): timm's ViT block
# (pre-norm attention and MLP, LayerScale, DropPath; its classes in SUBMODULE_CLASSES).
BLOCKS = frozenset({("timm.models.vision_transformer", "Block")})

# Where the classes of a recognised layer's submodules may come from: torch.nn's, a transformers
# model's, its activations and Conv1D (transformers.pytorch_utils, GPT-2's projections). Other
# modules (a quantized Linear of transformers.integrations, an adapter) may keep Python state a
# graph would freeze.
SUBMODULE_ORIGINS = ("torch.nn.", "transformers.models.", "transformers.activations",
                     "transformers.pytorch_utils")
# Classes from elsewhere whose forwards were read: PEFT's LoRA Linear (on torch.nn.Linear or
# Conv1D). Its forward decides by its adapters' settings, kept in dicts and lists (`scaling`,
# `_active_adapter`, `merged_adapters`, `use_dora`, `lora_variant`): _frozen puts their contents
# in the key. A mixed-adapter batch (`adapter_names`) puts hooks on it: eager.
SUBMODULE_CLASSES = frozenset({
    ("peft.tuners.lora.layer", "Linear"),
    # timm's ViT block's own: its attention (fused SDPA or its math, by a flag set at
    # construction), MLP, LayerScale and DropPath (a Bernoulli draw: the graph's generator, as
    # dropout's); older timm kept its attention and LayerScale in vision_transformer.
    ("timm.layers.attention", "Attention"), ("timm.layers.mlp", "Mlp"),
    ("timm.layers.layer_scale", "LayerScale"), ("timm.layers.drop", "DropPath"),
    ("timm.layers.norm", "LayerNorm"),  # torch's, or timm's fast norm by a flag set at construction
    ("timm.models.vision_transformer", "Attention"), ("timm.models.vision_transformer", "LayerScale"),
})

# Calls of one shape that run eager before the capture: the first steps compile and tune
# kernels (NVRTC, cuBLAS) outside any capture.
EAGER_CALLS = 2
# Captures tried per layer before it stays eager: a second try for a failure that a lazy
# initialisation or a passing condition of the job's (a sync somewhere while capturing) causes.
CAPTURES = 2
# Iterations of forward and backward on the capture stream before the capture (its cuBLAS
# workspace and every lazy allocation made outside the graph's pool).
STREAM_WARMUP = 2

_ON = ("1", "true", "yes", "on")

# (layer class name, "replayed" or "eager: <reason>") -> calls, in this process: `summary()`,
# logged at info at exit.
counts = collections.Counter()

# Whether patched layers may replay (on where patched; the tests and benches switch it to compare
# eager with graphs in one process). torchfuse.disable() turns every substitution off, this too.
switch = types.SimpleNamespace(on=True)


# Layer -> its state (calls seen, its graphs, why it stays eager): outside the module, so that
# copy.deepcopy(model) and pickling (an EMA copy, torch.save) never meet a CUDA graph.
_STATES = weakref.WeakKeyDictionary()


def state_of(layer):
    """The layer's state: {"last": the last call's key, "seen": calls of it, "graphs": its
    _Graphs once captured, "failed": why it stays eager, "failures": captures that failed}."""
    state = _STATES.get(layer)
    if state is None:
        state = _STATES[layer] = {"last": None, "seen": 0}
    return state


def summary():
    """The calls of patched layers in this process, one line per (class, outcome), most first."""
    return "\n".join(f"  {name}: {outcome} x{n}" for (name, outcome), n in counts.most_common())


def requested():
    """Whether TORCHFUSE_LAYER_GRAPHS asks for layer graphs in this process."""
    return os.environ.get("TORCHFUSE_LAYER_GRAPHS", "").strip().lower() in _ON


class _Eager(Exception):
    """A reason this call runs the layer's own code."""


class _RecordingCache:
    """Stands in for a fresh KV cache during the capture: keeps the layer's one update (its keys
    and values become the graph's outputs) and answers it with the keys and values themselves:
    a fresh cache's first append answers copies of them, the same values in a dense layout (an
    attention may then take other kernels, within their rounding). Any other use of the cache
    fails the capture."""

    def __init__(self, layer_idx):
        self.layer_idx, self.updates = layer_idx, []

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if layer_idx != self.layer_idx or self.updates:
            raise _Eager("the layer updates the KV cache in a way a graph cannot replay")
        self.updates.append((key_states, value_states))
        return key_states, value_states

    def __getattr__(self, name):
        raise _Eager(f"the layer reads the KV cache's {name}")


class _Token:
    """Held by a replay's autograd node only: dead or done once its backward cannot come."""
    __slots__ = ("done", "__weakref__")

    def __init__(self):
        self.done = False


def _saved_tensor_hooks(torch):
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
    except Exception:
        return True  # unknown: assume they are set


class _Graphs:
    """One layer's captured forward and backward, their static tensors and its replay state."""

    def __init__(self, key, cache_slot, layer_idx):
        self.key, self.cache_slot, self.layer_idx = key, cache_slot, layer_idx
        self.generation, self.pending = 0, None


def _describe(torch, layer, args, kwargs, cache_types):
    """(the call's key, its flattened arguments, their tree, the index of a KV cache among them
    or None, the layer's parameters): the key holds everything a graph bakes in. Raises _Eager with the reason a call
    cannot be replayed."""
    from torch.utils import _pytree
    if not layer.training or not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        raise _Eager("not a training call with grad on")
    if torch.is_anomaly_enabled() or _saved_tensor_hooks(torch) or _global_module_hooks(torch):
        raise _Eager("anomaly mode, saved-tensor hooks or global module hooks")
    if getattr(layer, "gradient_checkpointing", False):
        raise _Eager("gradient checkpointing")
    # A call inside a backward is a reentrant checkpoint's recomputation: it must draw the
    # forward's random numbers (dropout), which only eager's RNG state replays.
    if torch._C._current_graph_task_id() != -1 or torch.jit.is_tracing():
        raise _Eager("inside a backward (a checkpoint's recomputation) or under torch.jit.trace")
    modules, parameters, buffers = _members(torch, layer)
    leaves, tree = _pytree.tree_flatten((args, kwargs))
    described, cache_slot = [], None
    for i, x in enumerate(leaves):
        if type(x) is torch.Tensor:
            if not x.is_cuda:
                raise _Eager("an argument not on a CUDA device")
            described.append((tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad))
        elif x is None or type(x) in (bool, int, float, str):
            described.append(x)
        elif type(x) in cache_types and cache_slot is None:
            cache_slot = i
            described.append("cache")
        else:
            raise _Eager(f"an argument of type {type(x).__name__}")
    params = []
    for p in parameters:
        if type(p) is not torch.nn.Parameter or not p.is_cuda:
            raise _Eager("a parameter that is not a plain CUDA tensor")
        params.append((id(p), p.data_ptr(), p.requires_grad, p.dtype, tuple(p.shape)))
    for b in buffers:
        if b.requires_grad:
            raise _Eager("a buffer that requires grad")
    autocast = torch.is_autocast_enabled("cuda")
    # Autocast's dtype counts only where autocast is on (`autocast(enabled=False)` sets one too).
    state = (autocast, torch.get_autocast_dtype("cuda") if autocast else None,
             torch.are_deterministic_algorithms_enabled(), _backend_flags(torch))
    key = (tree, tuple(described), tuple(params), tuple((id(b), b.data_ptr()) for b in buffers),
           modules, state)
    return key, leaves, tree, cache_slot, parameters


def _members(torch, layer):
    """One walk of the layer's modules: each one's _module_state, and the layer's parameters and
    buffers in `layer.parameters()`'s and `layer.buffers()`'s order (the same pre-order walk,
    each tensor once)."""
    states, parameters, buffers, seen = [], [], [], set()
    for module in _walk(layer):
        states.append(_module_state(torch, module))
        for members, found in ((module._parameters, parameters), (module._buffers, buffers)):
            for t in members.values():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    found.append(t)
    return tuple(states), parameters, buffers


def _walk(layer):
    """`layer.modules()`'s modules in its order (pre-order, a shared one at its first place),
    walked with a stack instead of its generators nested as deep as the module (a LoRA layer's
    83 modules: a fifth of the guard's time)."""
    found, seen, stack = [], set(), [layer]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        found.append(module)
        children = [child for child in module._modules.values() if child is not None]
        children.reverse()
        stack.extend(children)
    return found


_SCALARS = (bool, int, float, str, type(None))
_CONTAINERS = (dict, list, tuple, set, frozenset)
# Module -> _scan's reading of it: its attributes read once, and again when their names change
# or one of them is no longer a scalar.
_SCANS = weakref.WeakKeyDictionary()
# Class -> whether its modules may be in a replayed layer (SUBMODULE_ORIGINS, SUBMODULE_CLASSES).
_ALLOWED = {}
# The container attributes a class's forward reads, where only they are frozen into the key
# (PEFT's LoRA Linear keeps its init's arguments in a dict too); other classes: all of them.
FROZEN_ATTRIBUTES = {
    ("peft.tuners.lora.layer", "Linear"): ("scaling", "_active_adapter", "merged_adapters",
                                           "use_dora", "lora_variant", "_caches"),
}


@functools.cache
def _scalar_types(torch):
    """The attribute types a key holds as they are: Python's scalars, torch's dtypes and
    devices (a frozenset: `issuperset(map(type, values))` checks many values in C)."""
    return frozenset(_SCALARS + (torch.dtype, torch.device))


def _frozen(torch, value):
    """A container attribute's contents as the key holds them: scalars, dtypes and devices as
    they are, containers as tuples of their contents' (a dict's with its keys), any other
    object by its class (as an object attribute, unread, is by nothing). Raises _Eager for a
    tensor inside: the graph would keep reading its memory after the attribute changes."""
    scalars = _scalar_types(torch)
    if type(value) in scalars:
        return value
    if isinstance(value, dict):
        if scalars.issuperset(map(type, value.values())):  # the common case, without recursion
            return tuple(value.items())
        return tuple((k, _frozen(torch, v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        if scalars.issuperset(map(type, value)):
            return tuple(value)
        return tuple(_frozen(torch, v) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(_frozen(torch, v) for v in value)
    if isinstance(value, torch.Tensor):
        raise _Eager("a tensor held in a module's attribute")
    return type(value)


def _scan(torch, module):
    """(the module's attribute names, a getter of its scalar attributes' values as a tuple, the
    names of its container attributes to freeze (dicts, lists, tuples, sets, but
    torch.nn.Module's own; FROZEN_ATTRIBUTES' for its class), whether it has a config) for
    _module_state; raises _Eager for a tensor attribute that is neither parameter nor buffer."""
    scalars, names, containers = _scalar_types(torch), [], []
    only = FROZEN_ATTRIBUTES.get((type(module).__module__, type(module).__qualname__))
    for name, value in module.__dict__.items():
        if type(value) in scalars:
            names.append(name)
        elif isinstance(value, torch.Tensor):
            raise _Eager(f"a tensor attribute {name} of {type(module).__name__} (not a parameter "
                         "or buffer)")
        elif (isinstance(value, _CONTAINERS) and name not in _module_internals(torch)
              and (only is None or name in only)):
            containers.append(name)
    if len(names) == 1:
        single = names[0]
        getter = lambda d: (d[single],)  # noqa: E731 (itemgetter of one name gives no tuple)
    else:
        getter = operator.itemgetter(*names) if names else (lambda d: ())
    return tuple(module.__dict__), getter, tuple(containers), "config" in module.__dict__


@functools.cache
def _module_internals(torch):
    """The attributes every torch.nn.Module has (its parameters', buffers', submodules' and
    hooks' dicts): what they hold is checked on its own, not frozen into the key."""
    return frozenset(torch.nn.Module().__dict__)


# The config attributes the recognised classes' forwards read at each call rather than at
# construction (transformers 5.17, read): the attention implementation (every attention), the
# sliding window (Mistral's, Phi-3's, StarCoder2's), Phi-3's head count, OLMo's q/k/v clip. A
# graph bakes in what they were: their values are in the key.
CALL_TIME_CONFIG = ("_attn_implementation", "sliding_window", "num_attention_heads", "clip_qkv")


def _module_state(torch, module):
    """What a graph bakes in of one module of the layer: its class (SUBMODULE_ORIGINS' or
    SUBMODULE_CLASSES' only), its scalar attributes (`training`, a dropout's `p`, `scaling`,
    ...), its container attributes' contents (_frozen) and the config attributes it reads at
    each call (CALL_TIME_CONFIG). Raises _Eager for hooks, a forward set on the instance, or a
    tensor attribute that is neither parameter nor buffer (FSDP1's views of its flat parameter are
    such attributes: the graph would read memory FSDP frees, and no gradient would reach the
    flat parameter). An attribute added, removed, or no longer a scalar reads the module
    again."""
    cls, attributes = type(module), module.__dict__
    allowed = _ALLOWED.get(cls)
    if allowed is None:
        named = (cls.__module__, cls.__qualname__)
        allowed = _ALLOWED[cls] = (cls.__module__.startswith(SUBMODULE_ORIGINS)
                                   or named in SUBMODULE_CLASSES or named in BLOCKS)
    if not allowed:
        raise _Eager(f"a submodule of class {cls.__module__}.{cls.__name__}")
    if (module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
            or "forward" in attributes):
        raise _Eager(f"hooks on {cls.__name__}")
    if module._forward_hooks and not _idle_output_capture(module._forward_hooks):
        raise _Eager(f"hooks on {cls.__name__}, or transformers' output capture on")
    scan = _SCANS.get(module)
    if scan is None or scan[0] != tuple(attributes):
        scan = _SCANS[module] = _scan(torch, module)
    values = scan[1](attributes)
    if not _scalar_types(torch).issuperset(map(type, values)):  # a container, object or tensor now
        scan = _SCANS[module] = _scan(torch, module)
        values = scan[1](attributes)
    contents = tuple([_frozen(torch, attributes[name]) for name in scan[2]]) if scan[2] else ()
    config = attributes["config"] if scan[3] else None
    read = (tuple([_frozen(torch, getattr(config, name, None)) for name in CALL_TIME_CONFIG])
            if config is not None else None)
    return cls, values, contents, read


_OUTPUT_CAPTURING = "transformers.utils.output_capturing"


def _idle_output_capture(hooks):
    """Whether a module's forward hooks are all transformers' output-capturing hooks and no
    capture is on. transformers puts them on the layers and their attention for good the first
    time a call asks for hidden states or attentions; with no capture on, each returns at once,
    so a replay that skips them is the call. A call that captures runs eager: its hooks must see
    the layer's outputs."""
    for hook in hooks.values():
        if (getattr(hook, "__module__", None) != _OUTPUT_CAPTURING
                or not getattr(hook, "__qualname__", "").endswith(".output_capturing_hook")):
            return False
    collector = getattr(sys.modules.get(_OUTPUT_CAPTURING), "_active_collector", None)
    try:
        return collector is not None and collector.get() is None
    except Exception:  # a transformers this was not read for: the hooks run, eager
        return False


def _backend_flags(torch):
    """The switches that pick the kernels a graph bakes in: TF32 and reduced-precision matmuls,
    the attention backends SDPA may take (`sdpa_kernel(...)` sets them for a block)."""
    cuda = torch.backends.cuda
    return (torch.get_float32_matmul_precision(), cuda.matmul.allow_tf32,
            cuda.matmul.allow_bf16_reduced_precision_reduction,
            cuda.matmul.allow_fp16_reduced_precision_reduction, torch.backends.cudnn.allow_tf32,
            cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
            cuda.cudnn_sdp_enabled())


def _addresses(key):
    """The parameters' and buffers' identities and addresses in a call's key (_describe)."""
    return [p[:2] for p in key[2]], key[3]


def _fresh_cache(cache, layer_idx, layer_classes):
    """Whether `cache` (a DynamicCache) holds nothing yet for this layer and will append to a
    layer of one of `layer_classes` (DynamicLayer, DynamicSlidingWindowLayer: their first append
    answers the keys and values given, copied), as the recording cache answers for it."""
    if layer_idx is None or getattr(cache, "offloading", False):
        return False
    layers = cache.layers
    if layer_idx < len(layers):
        return type(layers[layer_idx]) in layer_classes and not layers[layer_idx].is_initialized
    return getattr(cache, "layer_class_to_replicate", None) in layer_classes


def recognised(cls):
    """Whether layer graphs may take this class's calls: one of LAYERS, from transformers, or one
    of BLOCKS."""
    return ((cls.__name__ in LAYERS and cls.__module__.startswith("transformers.models."))
            or (cls.__module__, cls.__qualname__) in BLOCKS)


def _cache_classes():
    """(the KV cache classes a call may pass, the cache layers a fresh one appends to):
    transformers' DynamicCache, where transformers' caches are imported (a job without them
    has no cache to pass)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None:
        return (), ()
    return ((cache_utils.DynamicCache,),
            (cache_utils.DynamicLayer, cache_utils.DynamicSlidingWindowLayer))


def _layer_idx(layer):
    """The index the layer's attention updates a KV cache at: its `self_attn`'s (most families),
    `attn`'s (GPT-2) or `attention`'s (GPT-NeoX), else the layer's own; None if it has none."""
    for name in ("self_attn", "attn", "attention"):
        index = getattr(getattr(layer, name, None), "layer_idx", None)
        if index is not None:
            return index
    return getattr(layer, "layer_idx", None)


@contextlib.contextmanager
def _parameter_aliases(torch, layer):
    """Each of the layer's parameters replaced, for the capture, by a new leaf on the same memory
    (its values and address): the graph reads and its gradients are the parameter's, but autograd
    makes the alias's accumulation node on the capture stream. The parameter's own node may be
    alive on another stream (a loop that keeps the last step's loss keeps it), and a capture
    that joins it breaks. Yields the aliases in `layer.parameters()`'s order."""
    aliases, swapped = {}, []
    try:
        for module in layer.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    alias = aliases.setdefault(id(p), torch.nn.Parameter(p.detach(), p.requires_grad))
                    module._parameters[name] = alias
                    swapped.append((module, name, p))
        yield list(layer.parameters())
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p


def _capture(torch, layer, original_call, key, leaves, tree, cache_slot, side_streams):
    """The layer's forward and backward captured on the call's arguments: a _Graphs."""
    graphs = _Graphs(key, cache_slot, _layer_idx(layer))
    statics = [_static_copy(torch, x) if type(x) is torch.Tensor else x for x in leaves]
    tensors = [s for s in statics if type(s) is torch.Tensor]
    with _parameter_aliases(torch, layer) as params:
        wants_grad = [t for t in tensors if t.requires_grad] + [p for p in params if p.requires_grad]
        grads = _record(torch, layer, original_call, graphs, statics, wants_grad, leaves, tree,
                        cache_slot, side_streams)
    graphs.statics = tensors
    by_id = {id(t): g for t, g in zip(wants_grad, grads)}
    graphs.input_grads = [by_id.get(id(t)) if t.requires_grad else None for t in tensors]
    graphs.param_grads = [by_id.get(id(p)) if p.requires_grad else None for p in params]
    graphs.lendable = _lendable(torch, graphs.param_grads, graphs.input_grads + graphs.statics
                                + graphs.produced + graphs.grad_outs)
    return graphs


def _static_copy(torch, x):
    """A capture's input for the argument x: a new leaf with x's values (requiring a gradient
    where x does), joined to nothing. A copy that autograd recorded would join the capture's
    backward to the job's own graph, whose nodes sit on the default stream: the capture's
    backward then waits on that stream and fails ("operation would make the legacy stream depend
    on a capturing blocking stream", measured at each process's first layer whose input carries
    a gradient)."""
    with torch.no_grad():
        # empty_like keeps a dense tensor's strides and gives an expanded one (HF's masks, which
        # cannot be written in place) a dense layout: the same values.
        s = torch.empty_like(x)
        s.copy_(x)
    return s.requires_grad_(x.requires_grad)


def _storage_refs(torch, t):
    """How many hold t's storage: tensors on it (views included), and references to its Python
    storage object (one object however often it is asked for: `untyped_storage()` held
    elsewhere is seen by its Python references only)."""
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) + sys.getrefcount(storage)


@functools.lru_cache(maxsize=None)
def _own_refs(torch, device):
    """_storage_refs of a tensor on `device` that nothing else holds (measured once a device: it
    depends on how this torch keeps storages and their Python objects)."""
    return _storage_refs(torch, torch.empty(1, device=device))


def _moved_off(grad, buffer):
    """Where `grad` (a .grad) is the lent buffer, it is moved to a copy of its own (the same
    tensor object, the same values): the buffer is then free for the replay. Whether it was."""
    if (grad is None or grad.data_ptr() != buffer.data_ptr() or grad.shape != buffer.shape
            or grad.stride() != buffer.stride()):
        return False
    grad.data = grad.clone()
    return True


def _lendable(torch, grads, others=()):
    """Per parameter's gradient buffer of the backward graph: whether a replay's backward may
    hand the buffer itself to autograd (no copy): it alone holds its storage, all of it, and no
    other buffer nor any of `others` (the inputs' gradients, the graphs' static inputs, outputs
    and output gradients, which a replay writes) shares it, so that who else holds it later can
    be counted."""
    storages = collections.Counter(t.untyped_storage().data_ptr()
                                   for t in list(grads) + list(others) if t is not None)
    return [g is not None and g._base is None and g.storage_offset() == 0
            and g.untyped_storage().nbytes() == g.numel() * g.element_size() > 0
            and storages[g.untyped_storage().data_ptr()] == 1
            and _storage_refs(torch, g) == _own_refs(torch, g.device) for g in grads]


@contextlib.contextmanager
def _failure_undone(torch, stream, device):
    """What a capture that fails on the GPU leaves behind, undone; the failure is raised on.
    Ending such a capture (a sync inside it invalidates it) raises before torch.cuda.graph gives
    the thread its stream back: the job would go on on the capture's stream. And the device's
    default generator stays marked as capturing: every later random draw outside a capture (the
    eager call this layer falls back to, any dropout of the job) then raises "Offset increment
    outside graph capture". A capture of one kernel, which ends, gives the generator back
    (measured on an H200: eager's numbers, as if the failed capture had not happened)."""
    prior = torch.cuda.current_stream(device)
    try:
        yield
    except BaseException:
        torch.cuda.set_stream(prior)
        try:
            graph = torch.cuda.CUDAGraph()
            stream.wait_stream(prior)
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    torch.empty(1, device=device).zero_()
                finally:
                    graph.capture_end()
            prior.wait_stream(stream)
        except Exception as e:  # the failure raised on is the capture's, this one is noted
            note(torch, f"layer graphs: the generator could not be given back ({e!r})")
        raise


def _record(torch, layer, original_call, graphs, statics, wants_grad, leaves, tree, cache_slot,
            side_streams):
    """The capture itself (the layer's parameters being aliases meanwhile): the graphs and the
    tensors they produce, kept in `graphs`; the gradients of `wants_grad` the backward writes."""
    from torch.utils import _pytree
    layer_idx = graphs.layer_idx

    def run():
        args = list(statics)
        recorder = None
        if cache_slot is not None:
            recorder = args[cache_slot] = _RecordingCache(layer_idx)
        call_args, call_kwargs = _pytree.tree_unflatten(args, tree)
        out = original_call(layer, *call_args, **call_kwargs)
        if recorder is not None and len(recorder.updates) != 1:
            raise _Eager("the layer did not update the KV cache once")
        return out, (recorder.updates[0] if recorder is not None else ())

    def differentiable(outs):
        return [o for o in outs if type(o) is torch.Tensor and o.requires_grad]

    device = leaves[next(i for i, x in enumerate(leaves) if type(x) is torch.Tensor)].device
    stream = side_streams.setdefault(device, torch.cuda.Stream(device))
    autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    # Autocast's weight cache is off in the warm-up too: no cast of it outlives it on this stream.
    no_cache = lambda: torch.autocast("cuda", dtype=autocast[1], enabled=autocast[0],  # noqa: E731
                                      cache_enabled=False)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), no_cache():
        for _ in range(STREAM_WARMUP):
            out, kv = run()  # the capture's outputs, the keys and values too
            outs = differentiable(_pytree.tree_flatten(out)[0] + list(kv))
            torch.autograd.grad(outs, wants_grad, [torch.zeros_like(o) for o in outs],
                                allow_unused=True)
            del out, kv, outs
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    # A pool each: the backward's gradient buffers are lent to autograd and may be held (a .grad
    # across gradient accumulation's next forward), so no forward replay may write their memory,
    # as it would where the backward's capture took blocks the forward's had freed.
    forward_pool, backward_pool = torch.cuda.graph_pool_handle(), torch.cuda.graph_pool_handle()
    forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with _failure_undone(torch, stream, device):
        with torch.cuda.graph(forward, pool=forward_pool, stream=stream,
                              capture_error_mode="thread_local"):
            with no_cache():
                out, kv = run()
    out_leaves, out_tree = _pytree.tree_flatten(out)
    if not all(o is None or type(o) is torch.Tensor for o in out_leaves):
        raise _Eager("the layer returns something other than tensors")
    # The replay's outputs: the layer's tensors, then the keys and values its KV cache update
    # took (outputs too, so that the cache's contents carry gradients as eager's do).
    produced = [o for o in out_leaves if o is not None] + list(kv)
    outs = differentiable(produced)
    grad_outs = [torch.empty_like(o) for o in outs]
    with _failure_undone(torch, stream, device):
        with torch.cuda.graph(backward, pool=backward_pool, stream=stream,
                              capture_error_mode="thread_local"):
            grads = torch.autograd.grad(outs, wants_grad, grad_outs, allow_unused=True)
    torch.cuda.current_stream(device).wait_stream(stream)
    graphs.forward, graphs.backward = forward, backward
    graphs.out_tree, graphs.layer_outputs = out_tree, [o is not None for o in out_leaves]
    graphs.produced, graphs.n_kv = [o.detach() for o in produced], len(kv)
    # Per produced tensor: whether autograd carries a gradient for it.
    graphs.present = [o.requires_grad for o in produced]
    graphs.grad_outs = grad_outs
    return grads


def _replay_function(torch):
    """The autograd Function a replay is: forward replays the forward graph, backward the
    backward graph."""

    class LayerReplay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, graphs, token, n_inputs, *tensors):
            for static, x in zip(graphs.statics, tensors[:n_inputs]):
                static.copy_(x)
            graphs.forward.replay()
            graphs.generation += 1
            ctx.graphs, ctx.generation, ctx.token = graphs, graphs.generation, token
            ctx.parameters = tensors[n_inputs:]
            ctx.set_materialize_grads(False)  # an unused output's gradient: None, zeroed below
            outs = tuple(o.clone() for o in graphs.produced)
            fixed = [o for o, d in zip(outs, graphs.present) if not d]
            if fixed:
                ctx.mark_non_differentiable(*fixed)
            return outs

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            graphs = ctx.graphs
            # The backward graph reuses the memory of the activations it has read: a second
            # backward through one replay, or one after the layer's next replay, would read
            # overwritten activations.
            if ctx.token.done or ctx.generation != graphs.generation:
                raise RuntimeError(
                    "torchfuse layer graphs: a second backward through a replayed layer call "
                    "(retain_graph?), or one after the layer ran again: its activations are gone. "
                    "Run without TORCHFUSE_LAYER_GRAPHS=1.")
            wanted = iter(graphs.grad_outs)
            for g, d in zip(grads, graphs.present):
                if d:
                    static = next(wanted)
                    static.zero_() if g is None else static.copy_(g)
            # A parameter's gradient buffer is lent to autograd, not copied: a .grad of None
            # becomes the buffer itself (no copy, no second gradient's memory), a .grad of its own
            # adds it in place. The next replay writes the buffer again, so whatever still holds
            # it then is looked after first: a .grad on it (gradient accumulation) moves to a copy
            # of its own, the same tensor with the same values; any other holder (a gradient
            # autograd.grad returned, a hook's, a view) has the old values put back after the
            # replay, and autograd gets a copy of the new ones.
            held = {}
            for i, (buffer, lend) in enumerate(zip(graphs.param_grads, graphs.lendable)):
                if not lend:
                    continue
                own = _own_refs(torch, buffer.device)
                refs = _storage_refs(torch, buffer)
                if refs == own + 1 and _moved_off(ctx.parameters[i].grad, buffer):
                    refs = own
                if refs > own:
                    held[i] = buffer.clone()
            graphs.backward.replay()
            ctx.token.done = True
            # The inputs' gradients are copies: the previous layer's backward or the user may
            # keep them.
            out = [g.clone() if g is not None else None for g in graphs.input_grads]
            for i, (buffer, lend) in enumerate(zip(graphs.param_grads, graphs.lendable)):
                if buffer is None:
                    out.append(None)
                elif not lend:
                    out.append(buffer.clone())
                elif i not in held:
                    out.append(buffer.detach())  # a tensor of its own on the buffer's memory
                else:
                    new = buffer.clone()
                    buffer.copy_(held[i])
                    out.append(new)
            return (None, None, None, *out)

    return LayerReplay


def _layer_call(torch, original_call):
    """The decoder layers' __call__: the replay where the call may take it, the original
    otherwise."""
    from torch.utils import _pytree
    side_streams, warned = {}, set()
    replay = _replay_function(torch)

    def warn_once(layer, message):
        """One warning per layer class and kind of failure (the message before its details)."""
        name = type(layer).__name__
        kind = (name, message.split(" (")[0])
        if kind not in warned:
            warned.add(kind)
            print(f"torchfuse: layer graphs: {name} runs eager: {message}", file=sys.stderr)

    def give_up(layer, state, reason):
        """The layer eager for the process: its graphs' memory released, the reason kept."""
        state.pop("graphs", None)
        state["failed"] = reason

    def plan(layer, args, kwargs):
        state = state_of(layer)
        if state.get("failed"):
            raise _Eager(state["failed"])
        cache_types, fresh_layers = _cache_classes()
        key, leaves, tree, cache_slot, parameters = _describe(torch, layer, args, kwargs, cache_types)
        if cache_slot is not None:
            layer_idx = _layer_idx(layer)
            if layer_idx is None:
                raise _Eager("a KV cache, and no layer index found to update it at")
            if not _fresh_cache(leaves[cache_slot], layer_idx, fresh_layers):
                raise _Eager("a KV cache that already holds this layer's keys")
        graphs = state.get("graphs")
        if graphs is None:
            if key != state["last"]:
                state["last"], state["seen"] = key, 0
            state["seen"] += 1
            if state["seen"] <= EAGER_CALLS:
                raise _Eager("before its capture (the first calls of a shape)")
            try:
                graphs = state["graphs"] = _capture(torch, layer, original_call, key, leaves, tree,
                                                    cache_slot, side_streams)
            except Exception as e:  # never break the job: this call runs eager
                # One more capture at the next call of this shape (a first capture can meet a
                # lazy initialisation); a second failure leaves the layer eager.
                state["failures"] = state.get("failures", 0) + 1
                state["seen"] = EAGER_CALLS
                first = e.__context__ if e.__context__ is not None else e
                note(torch, f"layer graphs: {type(layer).__name__} {_layer_idx(layer)}: capture "
                     f"{state['failures']} of {CAPTURES} failed ({first!r})")
                if state["failures"] >= CAPTURES:
                    give_up(layer, state, "its capture failed")
                    warn_once(layer, f"its capture failed twice ({first!r})")
                raise _Eager("its capture failed") from None
            note(torch, f"layer graphs: {type(layer).__name__} {_layer_idx(layer)} captured")
        elif key != graphs.key:
            if _addresses(key) != _addresses(graphs.key):
                # Parameters or buffers moved since the capture (model.to(),
                # load_state_dict(assign=True)): the graphs can never replay again. Their memory
                # goes (an earlier replay's pending backward keeps what it needs), and this call
                # is the first of a new capture's; a second move (parameters that move every
                # step, offloaded) leaves the layer eager.
                state["moves"] = state.get("moves", 0) + 1
                if state["moves"] > 1:
                    give_up(layer, state, "its parameters move between calls")
                    raise _Eager(state["failed"])
                del state["graphs"]
                state["last"], state["seen"] = key, 1
                raise _Eager("parameters or buffers moved since the capture")
            raise _Eager("a call that differs from the captured one")
        token = graphs.pending() if graphs.pending is not None else None
        if token is not None and not token.done:
            raise _Eager("an earlier replay waits for its backward")
        return graphs, leaves, parameters

    untraced = _untraced_call(torch)

    def replayed(graphs, leaves, parameters):
        """The replay's result in the layer's output tree; the cache's first append made."""
        tensors = [x for x in leaves if type(x) is torch.Tensor]
        token = _Token()
        outs = replay.apply(graphs, token, len(tensors), *tensors, *parameters)
        graphs.pending = weakref.ref(token)
        if graphs.cache_slot is not None:
            # The cache's own first append copies the replay's keys and values.
            leaves[graphs.cache_slot].update(*outs[len(outs) - graphs.n_kv:], graphs.layer_idx)
        produced = iter(outs)
        out_leaves = [next(produced) if present else None for present in graphs.layer_outputs]
        return _pytree.tree_unflatten(out_leaves, graphs.out_tree)

    def call(layer, *args, **kwargs):
        # torch.compile and torch.func trace the layer's own code (checked first: nothing here
        # is traced), as they do the rewrites'.
        if not (switch.on and untraced()):
            return original_call(layer, *args, **kwargs)
        name = type(layer).__name__
        if not recognised(type(layer)):  # counted: the summary says why a model got no replays
            counts[name, "eager: not a class layer graphs know"] += 1
            return original_call(layer, *args, **kwargs)
        try:
            planned = plan(layer, args, kwargs)
        except _Eager as reason:
            counts[name, f"eager: {reason}"] += 1
            return original_call(layer, *args, **kwargs)
        except Exception as e:  # never break the job: a layer the guards cannot read stays eager
            give_up(layer, state_of(layer), "its call could not be checked")
            warn_once(layer, f"its call could not be checked ({e!r})")
            counts[name, "eager: its call could not be checked"] += 1
            return original_call(layer, *args, **kwargs)
        failure = None
        try:
            result = replayed(*planned)
        except Exception as e:  # never break the job: this layer goes eager (nothing was kept)
            failure = repr(e)
        if failure is None:
            counts[name, "replayed"] += 1
            return result
        # Out of the except block, with no reference left here, so that the graphs' memory is
        # given back before the eager call.
        del planned
        give_up(layer, state_of(layer), "its replay failed")
        warn_once(layer, f"its replay failed ({failure})")
        counts[name, "eager: its replay failed"] += 1
        return original_call(layer, *args, **kwargs)

    return call


def install(torch, cls):
    """cls.__call__ replaced by the layer graphs' call around what it was (its own, or the next
    class's in the instance's MRO where it inherits one); once. Returns a function that undoes
    it, or None where it was installed already."""
    if getattr(cls.__call__, "_torchfuse_layer_graphs", False):
        return None
    own = cls.__dict__.get("__call__")
    if own is not None:
        original = own
    else:
        def original(self, *args, **kwargs):
            return super(cls, self).__call__(*args, **kwargs)
    call = _layer_call(torch, original)
    call._torchfuse_layer_graphs = True
    cls.__call__ = call

    def undo():
        if own is not None:
            cls.__call__ = own
        else:
            del cls.__call__
    return undo


_announced = []


def _patch(module, class_name):
    """The patch of a library module: its class `class_name` takes the layer graphs, where
    TORCHFUSE_LAYER_GRAPHS asks for them and CUDA is there."""
    if not requested():
        return True
    import torch
    if not torch.cuda.is_available():
        return True
    install(torch, getattr(module, class_name))
    if not _announced:
        _announced.append(True)
        note(torch, "layer graphs: on (TORCHFUSE_LAYER_GRAPHS)")
        atexit.register(lambda: counts and note(torch, "layer graphs: calls\n" + summary()))
    return True


def patch_layers(module):
    """transformers.modeling_layers: GradientCheckpointingLayer's __call__ (every HF decoder
    layer's) takes the layer graphs; the call itself takes only the classes of LAYERS."""
    return _patch(module, "GradientCheckpointingLayer")


def patch_timm_blocks(module):
    """timm.models.vision_transformer: its Block's __call__ takes the layer graphs."""
    return _patch(module, "Block")
