"""Known compositions of library code, recognised by what their code is, not by their names.

Two kinds: a class's `forward` (FORMS), and a module-level function (FUNCTION_FORMS: HF's loss
functions), which must also have the reference's defaults.

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
import __future__
import ast
import dis
import inspect
import math
import sys
import textwrap

# The reference forms, each written exactly as the library writes it (transformers 5.17), in a
# module that imports `math` and `torch` as the library's modules do: the compiler emits
# different bytecode for attribute calls on an imported name (the attention forms' modules import
# ALL_ATTENTION_FUNCTIONS). Compiled, never run.
_PRELUDE = "import math\nimport torch\nfrom transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS\n\n\n"
# The body of HF's attention forward (Llama's and its copies), its one varying line (what else
# the attention interface is passed) left to fill.
_ATTENTION_BODY = """    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )

    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
{extra}        **kwargs,
    )

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights
"""
# HF's attention forwards' signature. The library's annotations and defaults are left out: the
# code object compared holds neither (the defaults are compared apart, `_FORM_DEFAULTS`).
_ATTENTION_SIGNATURE = ("def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values,"
                        " **kwargs):\n")
# Gemma's forms write the attention's dropout the other way round.
_DROPOUT_FLIPPED = ("dropout=0.0 if not self.training else self.attention_dropout",
                    "dropout=self.attention_dropout if self.training else 0.0")

# OLMo 2's projections: q and k normed whole before the heads are split.
_OLMO2_PROJECTIONS = ((
    """    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
""",
    """    query_states = self.q_norm(self.q_proj(hidden_states))
    key_states = self.k_norm(self.k_proj(hidden_states))
    value_states = self.v_proj(hidden_states)

    query_states = query_states.view(hidden_shape).transpose(1, 2)
    key_states = key_states.view(hidden_shape).transpose(1, 2)
    value_states = value_states.view(hidden_shape).transpose(1, 2)
"""),)


def _attention_source(extra="", replacements=()):
    """An attention form's source: Llama's, with `extra` passed to the attention interface too
    and the (old, new) text replacements made."""
    source = _ATTENTION_SIGNATURE + _ATTENTION_BODY.format(extra=f"        {extra}\n" if extra else "")
    for old, new in replacements:
        assert old in source, old
        source = source.replace(old, new)
    return source


_SOURCES = {
    # transformers.activations.NewGELUActivation.forward (GPT-2's "gelu_new").
    "new_gelu": """def forward(self, input):
    return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))
""",
    # transformers.activations.FastGELUActivation.forward ("gelu_fast").
    "fast_gelu": """def forward(self, input):
    return 0.5 * input * (1.0 + torch.tanh(input * 0.7978845608 * (1.0 + 0.044715 * input * input)))
""",
    # transformers.models.llama.modeling_llama.LlamaMLP.forward (the gated MLP), and its copies.
    # What it computes depends on its act_fn too: the rewrite checks that at every call.
    "hf_gated_mlp": """def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj
""",
    # The same gated MLP with its activation named `activation_fn` (Llama 4's and its copies).
    "llama4_gated_mlp": """def forward(self, x):
    down_proj = self.activation_fn(self.gate_proj(x)) * self.up_proj(x)
    return self.down_proj(down_proj)
""",
    # The same gated MLP returned without the name (EXAONE 4.5's, GLM-4V's vision MLP and their
    # copies).
    "hf_gated_mlp_inline": """def forward(self, hidden_state):
    return self.down_proj(self.act_fn(self.gate_proj(hidden_state)) * self.up_proj(hidden_state))
""",
    # The same gated MLP with a dropout of the product before down_proj (T5Gemma's and T5Gemma
    # 2's).
    "t5gemma_gated_mlp": """def forward(self, x):
    hidden_states = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
    hidden_states = self.dropout(hidden_states)
    down_proj = self.down_proj(hidden_states)
    return down_proj
""",
    # Gemma 3n's text MLP: the gated MLP whose gate may first keep its top activations
    # (`_gaussian_topk`, where the layer's activation_sparsity is above 0).
    "gemma3n_gated_mlp": """def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    gate_proj = self.gate_proj(hidden_states)
    if self.activation_sparsity > 0.0:
        gate_proj = self._gaussian_topk(gate_proj)
    activations = self.act_fn(gate_proj)
    up_proj = self.up_proj(hidden_states)
    down_proj = self.down_proj(activations * up_proj)
    return down_proj
""",
    # RecurrentGemma's MLP: the gated MLP with the activation named first.
    "recurrent_gemma_gated_mlp": """def forward(self, hidden_states):
    gate = self.act_fn(self.gate_proj(hidden_states))
    return self.down_proj(gate * self.up_proj(hidden_states))
""",
    # Falcon-H1's MLP: the gated MLP with multipliers on the gate and the output.
    "falcon_h1_gated_mlp": """def forward(self, x):
    y = self.up_proj(x) * self.act_fn(self.gate_proj(x) * self.gate_multiplier)
    y = self.down_proj(y) * self.down_multiplier
    return y
""",
    # DeepSeek-V4's MLP: the gated MLP with its gate clamped from above and its up from both
    # sides at its `limit`.
    "deepseek_v4_clamped_gated_mlp": """def forward(self, x: torch.Tensor) -> torch.Tensor:
    gate = self.gate_proj(x).clamp(max=self.limit)
    up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
    return self.down_proj(self.act_fn(gate) * up)
""",
    # GLM-5-next's text and vision MLPs: the same clamps at its `swiglu_limit`, written apart.
    "glm5_clamped_gated_mlp": """def forward(self, x):
    gate = self.gate_proj(x)
    up = self.up_proj(x)
    # Key difference using clamping
    gate = gate.clamp(min=None, max=self.swiglu_limit)
    up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
    return self.down_proj(self.act_fn(gate) * up)
""",
    # The same gated MLP with a dropout of its output (Seed-OSS's).
    "seed_oss_gated_mlp": """def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    down_proj = nn.functional.dropout(down_proj, p=self.residual_dropout, training=self.training)
    return down_proj
""",
    # transformers.models.phi3.modeling_phi3.Phi3MLP.forward (one projection for gate and up,
    # chunked), and its copies (GLM, GLM-4, Dia, ...). Depends on its activation_fn as the gated
    # MLP on its act_fn.
    "hf_packed_gated_mlp": """def forward(self, hidden_states):
    up_states = self.gate_up_proj(hidden_states)

    gate, up_states = up_states.chunk(2, dim=-1)
    up_states = up_states * self.activation_fn(gate)

    return self.down_proj(up_states)
""",
    # transformers.models.llama.modeling_llama.LlamaAttention.forward and its copies (Gemma,
    # Granite, GLM, Ernie 4.5, Qwen2-MoE, ...): q, k and v projected and split into heads, the
    # rotary, the cache, the attention interface, the heads merged and projected. The globals it
    # calls (apply_rotary_pos_emb, ALL_ATTENTION_FUNCTIONS, eager_attention_forward) are called
    # by the rewrite as the original calls them, whatever they are (`_CALLED_AS_THEY_ARE`).
    "hf_attention": _attention_source(),
    # The same with the layer's sliding window passed to the attention (Qwen2's and its copies).
    "hf_attention_sliding_window": _attention_source("sliding_window=self.sliding_window,"),
    # The same with q and k normed per head between the view and the transpose, and the layer's
    # sliding window (Qwen3's and its copies: Qwen3-MoE, Dots1, Mellum, ...).
    "qwen3_attention": _attention_source("sliding_window=self.sliding_window,", (
        ("query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
         "query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)"),
        ("key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
         "key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)"))),
    # The same with q and k normed per head after the transpose, the dropout written the other
    # way round, and the layer's sliding window (Gemma 3's and its copies).
    "gemma3_attention": _attention_source("sliding_window=self.sliding_window,", (
        ("\n    cos, sin = position_embeddings",
         "\n    query_states = self.q_norm(query_states)\n    key_states = self.k_norm(key_states)\n\n"
         "    cos, sin = position_embeddings"),
        _DROPOUT_FLIPPED)),
    # The same with the dropout written the other way round, the layer's sliding window and its
    # logit softcapping (Gemma 2's and its copies).
    "gemma2_attention": _attention_source("sliding_window=self.sliding_window, softcap=self.attn_logit_softcapping,",
                                          (_DROPOUT_FLIPPED,)),
    # The same with q and k normed whole (over all heads) before the view, written apart from
    # the views (OLMo 2's and FlexOLMo's), and with the layer's sliding window (OLMo 3's).
    "olmo2_attention": _attention_source(replacements=_OLMO2_PROJECTIONS),
    "olmo3_attention": _attention_source("sliding_window=self.sliding_window,", _OLMO2_PROJECTIONS),
    # transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXAttention.forward (Pythia's) and its
    # copies: one projection for q, k and v, split into heads of all three and chunked.
    "gpt_neox_attention": """def forward(self, hidden_states, attention_mask, layer_past, position_embeddings, **kwargs):
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, 3 * self.head_size)

    qkv = self.query_key_value(hidden_states).view(hidden_shape).transpose(1, 2)
    query_states, key_states, value_states = qkv.chunk(3, dim=-1)

    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

    # Cache QKV values
    if layer_past is not None:
        key_states, value_states = layer_past.update(key_states, value_states, self.layer_idx)

    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )

    # Compute attention
    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        scaling=self.scaling,
        dropout=0.0 if not self.training else self.attention_dropout,
        **kwargs,
    )

    # Reshape outputs and final projection
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.dense(attn_output)

    return attn_output, attn_weights
""",
    # transformers.models.gpt2.modeling_gpt2.GPT2Attention.forward: one Conv1D projection for q,
    # k and v, split three ways, each split into heads (cross-attention's q from a projection of
    # its own), the cache, the attention interface (or eager's upcast and reordered attention),
    # the heads merged and projected, the residual's dropout.
    "gpt2_attention": """def forward(self, hidden_states, past_key_values, attention_mask, encoder_hidden_states,
            encoder_attention_mask, output_attentions, **kwargs):
    is_cross_attention = encoder_hidden_states is not None
    if past_key_values is not None:
        if isinstance(past_key_values, EncoderDecoderCache):
            is_updated = past_key_values.is_updated.get(self.layer_idx)
            if is_cross_attention:
                # after the first generated id, we can subsequently re-use all key/value_layer from cache
                curr_past_key_values = past_key_values.cross_attention_cache
            else:
                curr_past_key_values = past_key_values.self_attention_cache
        else:
            curr_past_key_values = past_key_values

    if is_cross_attention:
        if not hasattr(self, "q_attn"):
            raise ValueError(
                "If class is used as cross attention, the weights `q_attn` have to be defined. "
                "Please make sure to instantiate class with `GPT2Attention(..., is_cross_attention=True)`."
            )
        query_states = self.q_attn(hidden_states)
        attention_mask = encoder_attention_mask

        # Try to get key/value states from cache if possible
        if past_key_values is not None and is_updated:
            key_states = curr_past_key_values.layers[self.layer_idx].keys
            value_states = curr_past_key_values.layers[self.layer_idx].values
        else:
            key_states, value_states = self.c_attn(encoder_hidden_states).split(self.split_size, dim=2)
            shape_kv = (*key_states.shape[:-1], -1, self.head_dim)
            key_states = key_states.view(shape_kv).transpose(1, 2)
            value_states = value_states.view(shape_kv).transpose(1, 2)
    else:
        query_states, key_states, value_states = self.c_attn(hidden_states).split(self.split_size, dim=2)
        shape_kv = (*key_states.shape[:-1], -1, self.head_dim)
        key_states = key_states.view(shape_kv).transpose(1, 2)
        value_states = value_states.view(shape_kv).transpose(1, 2)

    shape_q = (*query_states.shape[:-1], -1, self.head_dim)
    query_states = query_states.view(shape_q).transpose(1, 2)

    if (past_key_values is not None and not is_cross_attention) or (
        past_key_values is not None and is_cross_attention and not is_updated
    ):
        key_states, value_states = curr_past_key_values.update(key_states, value_states, self.layer_idx)
        # set flag that curr layer for cross-attn is already updated so we can re-use in subsequent calls
        if is_cross_attention:
            past_key_values.is_updated[self.layer_idx] = True

    using_eager = self.config._attn_implementation == "eager"
    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )

    if using_eager and self.reorder_and_upcast_attn:
        attn_output, attn_weights = self._upcast_and_reordered_attn(
            query_states, key_states, value_states, attention_mask
        )
    else:
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=self.attn_dropout.p if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )

    attn_output = attn_output.reshape(*attn_output.shape[:-2], -1).contiguous()
    attn_output = self.c_proj(attn_output)
    attn_output = self.resid_dropout(attn_output)

    return attn_output, attn_weights
""",
    # The same with q, k and v sliced from one packed projection, and the config's sliding window
    # (Phi-3's and its copies).
    "phi3_attention": _attention_source('sliding_window=getattr(self.config, "sliding_window", None),', ((
        """    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
""",
        """    qkv = self.qkv_proj(hidden_states)
    query_pos = self.config.num_attention_heads * self.head_dim
    query_states = qkv[..., :query_pos]
    key_states = qkv[..., query_pos : query_pos + self.num_key_value_heads * self.head_dim]
    value_states = qkv[..., query_pos + self.num_key_value_heads * self.head_dim :]

    query_states = query_states.view(hidden_shape).transpose(1, 2)
    key_states = key_states.view(hidden_shape).transpose(1, 2)
    value_states = value_states.view(hidden_shape).transpose(1, 2)
"""),)),
    # The same with the config's sliding window, where it has one (Mistral's and its copies).
    "hf_attention_config_sliding_window": _attention_source(
        'sliding_window=getattr(self.config, "sliding_window", None),'),
    # transformers.activations.SiLUActivation.forward (ACT2FN["silu"]): an act_fn the gated
    # MLP may have.
    "hf_silu": """def forward(self, input):
    return nn.functional.silu(input)
""",
    # transformers.activations.GELUTanh.forward (ACT2FN["gelu_pytorch_tanh"], Gemma's gated MLP
    # act_fn): what it computes is its `act` attribute, checked per instance
    # (rewrites._gated_mlp_call).
    "hf_gelu_tanh": """def forward(self, input):
    return self.act(input)
""",
    # transformers.models.gpt2.modeling_gpt2.GPT2MLP.forward, and its copies. What it computes
    # depends on its act and c_proj too: the rewrite checks them at every call.
    "hf_conv1d_mlp": """def forward(self, hidden_states):
    hidden_states = self.c_fc(hidden_states)
    hidden_states = self.act(hidden_states)
    hidden_states = self.c_proj(hidden_states)
    hidden_states = self.dropout(hidden_states)
    return hidden_states
""",
    # transformers.pytorch_utils.Conv1D.forward (GPT-2's projections; the linear rewrite's too):
    # a c_proj the MLP above may have. Under autocast its addmm casts its input to the autocast
    # dtype.
    "hf_conv1d": """def forward(self, x):
    size_out = x.size()[:-1] + (self.nf,)
    x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
    x = x.view(size_out)
    return x
""",
    # transformers.models.gemma.modeling_gemma.GemmaRMSNorm.forward (Gemma 1, 2, 3 and their
    # copies): the norm in fp32, times (1 + weight) in fp32, then the input's dtype. What it
    # computes depends on its _norm too (the form below): the rewrite checks that at every call.
    "gemma_rms_norm": """def forward(self, x):
    output = self._norm(x.float())
    # Llama does x.to(float16) * w whilst Gemma is (x * w).to(float16)
    # See https://github.com/huggingface/transformers/pull/29402
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)
""",
    # GemmaRMSNorm._norm: the _norm the form above may call.
    "gemma_norm": """def _norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
""",
    # transformers.models.gemma4.modeling_gemma4.Gemma4RMSNorm.forward, and Gemma 3n's and
    # their copies: Gemma's without the `1 +`, the weight optional (`with_scale`).
    "gemma4_rms_norm": """def forward(self, hidden_states):
    normed_output = self._norm(hidden_states.float())
    if self.with_scale:
        normed_output = normed_output * self.weight.float()
    return normed_output.type_as(hidden_states)
""",
    # Gemma4RMSNorm._norm: the _norm the form above may call.
    "gemma4_norm": """def _norm(self, hidden_states):
    mean_squared = hidden_states.pow(2).mean(-1, keepdim=True) + self.eps
    # Use torch.pow() (over torch.sqrt() or torch.rsqrt()) to address compiler differences between Torch and JAX
    return hidden_states * torch.pow(mean_squared, -0.5)
""",
    # transformers.models.llama4.modeling_llama4.Llama4TextRMSNorm.forward and its copies:
    # Gemma's `_norm` of x in fp32, rounded to x's dtype, times the weight (Llama's composition).
    "llama4_rms_norm": """def forward(self, x):
    output = self._norm(x.float()).type_as(x)
    return output * self.weight
""",
    # transformers.models.moshi.modeling_moshi.MoshiRMSNorm.forward and its copies (Kyutai's
    # speech-to-text): Gemma's `_norm` of x in fp32, times the weight in fp32, cast back once.
    "moshi_rms_norm": """def forward(self, x):
    output = self._norm(x.float())
    output = output * self.weight.float()
    return output.type_as(x)
""",
    # transformers.models.esmfold2.modeling_esmfold2.EsmFold2RMSNorm.forward and its copies
    # (Llama 4's q/k L2 norm, NanoChat's, HRM's, FalconMamba's weightless norm): Gemma's `_norm`
    # of x in fp32, no weight, cast back.
    "fp32_rms_norm_weightless": """def forward(self, x):
    return self._norm(x.float()).type_as(x)
""",
    # transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4UnweightedRMSNorm.forward
    # (GLM-5-next's too): x times its rsqrt factor, computed in fp32 and rounded to x's dtype.
    "unweighted_rms_norm": """def forward(self, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps).to(x.dtype)
""",
    # transformers.models.cohere.modeling_cohere.CohereLayerNorm.forward and its copies
    # (Cohere 2, Cohere2-MoE, ...): LayerNorm without a bias, in fp32, the weight in fp32.
    "cohere_layer_norm": """def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    mean = hidden_states.mean(-1, keepdim=True)
    variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
    hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon)
    hidden_states = self.weight.to(torch.float32) * hidden_states
    return hidden_states.to(input_dtype)
""",
    # transformers.models.mamba2.modeling_mamba2.MambaRMSNormGated.forward, and its copies
    # (Bamba, Granite 4's GraniteMoeHybrid, ...): x gated by silu(gate) in fp32, RMSNorm of that
    # in fp32, then the weight times it in x's dtype. Its `gate=None` default is part of the
    # form (_FORM_DEFAULTS).
    "mamba_rms_norm_gated": """def forward(self, hidden_states, gate=None):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)

    if gate is not None:
        hidden_states = hidden_states * nn.functional.silu(gate.to(torch.float32))
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)

    return self.weight * hidden_states.to(input_dtype)
""",
    # transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNormGated.forward, and its
    # copies (Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid): Llama's RMSNorm, then times act(gate) in fp32
    # (`ACT2FN[self.activation]`, checked at every call), cast back to x's dtype.
    "qwen3_next_rms_norm_gated": """def forward(self, hidden_states, gate):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    # Norm before gate
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    hidden_states = self.weight * hidden_states.to(input_dtype)
    hidden_states = hidden_states * ACT2FN[self.activation](gate.to(torch.float32))

    return hidden_states.to(input_dtype)
""",
    # transformers.models.t5.modeling_t5.T5LayerNorm.forward, and its copies (LongT5, Idefics,
    # Kosmos-2.5, ...): the statistics in fp32, x times rstd promoted to fp32, rounded to the
    # weight's dtype where that is 16-bit, then times the weight.
    "t5_rms_norm": """def forward(self, hidden_states):
    # T5 uses a layer_norm which only scales and doesn't shift, which is also known as Root Mean
    # Square Layer Normalization https://huggingface.co/papers/1910.07467 thus variance is calculated
    # w/o mean and there is no bias. Additionally we want to make sure that the accumulation for
    # half-precision inputs is done in fp32

    variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)

    # convert into half-precision if necessary
    if self.weight.dtype in [torch.float16, torch.bfloat16]:
        hidden_states = hidden_states.to(self.weight.dtype)

    return self.weight * hidden_states
""",
    # transformers.models.gpt_oss.modeling_gpt_oss.GptOssRMSNorm.forward and its copies (AFMoE,
    # FlexOlmo, ...): Llama's, with the weight multiplied in fp32 before the cast back.
    "gpt_oss_rms_norm": """def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)  # main diff with Llama
""",
    # transformers.models.helium.modeling_helium.HeliumRMSNorm.forward: GPT-OSS's with the weight
    # cast to fp32 before the product (which promotes a 16-bit weight to fp32 anyway).
    "helium_rms_norm": """def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight.to(torch.float32) * hidden_states).to(input_dtype)
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

# The Args and Returns of the docstring HF's apply_rotary_pos_emb and its copies share (a
# constant of their code: part of each form).
_ROPE_DOC = """    Args:
        q (`torch.Tensor`): The query tensor.
        k (`torch.Tensor`): The key tensor.
        cos (`torch.Tensor`): The cosine part of the rotary embedding.
        sin (`torch.Tensor`): The sine part of the rotary embedding.
        unsqueeze_dim (`int`, *optional*, defaults to 1):
            The 'unsqueeze_dim' argument specifies the dimension along which to unsqueeze cos[position_ids] and
            sin[position_ids] so that they can be properly broadcasted to the dimensions of q and k. For example, note
            that cos[position_ids] and sin[position_ids] have the shape [batch_size, seq_len, head_dim]. Then, if q and
            k have the shape [batch_size, heads, seq_len, head_dim], then setting unsqueeze_dim=1 makes
            cos[position_ids] and sin[position_ids] broadcastable to the shapes of q and k. Similarly, if q and k have
            the shape [batch_size, seq_len, heads, head_dim], then set unsqueeze_dim=2.
    Returns:
        `tuple(torch.Tensor)` comprising of the query and key tensors rotated using the Rotary Position Embedding.
"""


def _rope_source(summary, body):
    """An apply_rotary_pos_emb as HF writes it: its docstring's summary, the shared Args and
    Returns, then its body."""
    quotes = '"""'
    return (f"def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):\n    {quotes}{summary}{_ROPE_DOC}"
            f"    {quotes}\n{body}")


# GPT-NeoX's apply_rotary_pos_emb body (a slice of the head dim rotated, the rest cat back).
_NEOX_ROPE_BODY = """    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)

    # Keep half or full tensor for later concatenation
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]

    # Apply rotary embeddings on the first half or full tensor
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)

    # Concatenate back to full shape
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed
"""


# Llama's apply_rotary_pos_emb.
_LLAMA_ROPE = _rope_source("""Applies Rotary Position Embedding to the query and key tensors.

""", """    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
""")

# GLM's tables for its interleaved rotary: the first half of HF's cos and sin, each repeated.
_GLM_INTERLEAVE = """    # Interleave them instead of usual shape
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
"""

# GLM's apply_rotary_pos_emb body: GPT-NeoX's with the tables interleaved first (its
# rotate_half is the interleaved one).
_GLM_ROPE_BODY = _NEOX_ROPE_BODY.replace("\n\n    # Keep half", "\n\n" + _GLM_INTERLEAVE + "\n    # Keep half", 1)


# Module-level functions of transformers.loss.loss_utils (5.17), with their defaults.
_FUNCTION_SOURCES = {
    # transformers.integrations.moe._default_apply_gate: the gate of HF's MoE experts (Mixtral,
    # Qwen2/3-MoE, OLMoE and the others built with use_experts_implementation) under its default
    # experts implementations (grouped_mm, batched_mm), each experts class's `_apply_gate`. What
    # it computes depends on the module's act_fn: the rewrite checks that at every call.
    "hf_moe_apply_gate": ('''def _default_apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
    """
    Default gating mechanism: splits the gate_up_out into gate and up parts,
    applies the activation function to the gate part, and multiplies it with the up part.
    Args:
        gate_up_out (`torch.Tensor`):
            The output tensor from the gate and up projection of shape (S, 2 * intermediate_dim).
    Returns:
        `torch.Tensor`: The gated output tensor of shape (S, intermediate_dim).
    """
    gate, up = gate_up_out.chunk(2, dim=-1)  # (S, intermediate_dim)
    return self.act_fn(gate) * up  # (S, intermediate_dim)
''', None),
    "hf_fixed_cross_entropy": ("""def fixed_cross_entropy(source, target, num_items_in_batch=None, ignore_index=-100, **kwargs):
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = nn.functional.cross_entropy(source, target, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        # just in case users pass an int for num_items_in_batch, which could be the case for custom trainer
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
""", (None, -100)),
    # transformers.models.llama.modeling_llama.rotate_half, and its copies.
    "hf_rotate_half": ("""def rotate_half(x):
    \"\"\"Rotates half the hidden dims of the input.\"\"\"
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
""", None),
    # transformers.models.glm.modeling_glm.rotate_half, and its copies (GLM-4's, Ernie 4.5's,
    # Moonshine's): each pair (x[2p], x[2p+1]) becomes (-x[2p+1], x[2p]), the interleaved layout.
    "hf_rotate_pairs": ("""def rotate_half(x):
    \"\"\"Rotates half the hidden dims of the input.\"\"\"
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)
""", None),
    # transformers.models.cohere.modeling_cohere.rotate_half, and its copies: the same, written
    # Cohere's way.
    "cohere_rotate_pairs": ("""def rotate_half(x):
    # Split and rotate. Note that this function is different from e.g. Llama.
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    rot_x = torch.stack([-x2, x1], dim=-1).flatten(-2)
    return rot_x
""", None),
    # transformers.models.llama.modeling_llama.apply_rotary_pos_emb, and its copies (the
    # docstring is a constant of the code, so it is part of the form).
    "hf_rotary": (_LLAMA_ROPE, (1,)),
    # Llama's apply_rotary_pos_emb code calling another rotate_half (`_HELPER_FORMS`): BLT's,
    # with Cohere's interleaved one; NanoChat's, with Llama's sign-flipped.
    "hf_rotary_pairs": (_LLAMA_ROPE, (1,)),
    "hf_rotary_flipped": (_LLAMA_ROPE, (1,)),
    # transformers.models.gemma4.modeling_gemma4.apply_rotary_pos_emb, and its copies (Gemma 3n's,
    # DiffusionGemma's): Llama's rotary of one tensor, the model calling it for q and k apart.
    "hf_single_rotary": ("def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1):\n"
                         '    """Applies Rotary Position Embedding to the query and key tensors.\n\n'
                         + _ROPE_DOC.replace("        q (`torch.Tensor`): The query tensor.\n"
                                             "        k (`torch.Tensor`): The key tensor.\n",
                                             "        x (`torch.Tensor`): The tensor to embed.\n")
                         + '    """\n' + """    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (x * cos) + (rotate_half(x) * sin)
""", (1,)),
    # transformers.models.gpt_neox.modeling_gpt_neox.apply_rotary_pos_emb, and its copies: the
    # rotate-half rotary of the first cos.shape[-1] features of the head dim (all, or a part:
    # Pythia's rotary_pct), the rest passed through, then cat. Three writings of it: GPT-NeoX's,
    # the same code under GLM's docstring (Qwen3-Next and others), Phi-3's with the cat inline.
    "hf_partial_rotary": (_rope_source("""Applies Rotary Position Embedding to the query and key tensors.

""", _NEOX_ROPE_BODY), (1,)),
    "hf_partial_rotary_glm_doc": (_rope_source("""Applies Rotary Position Embedding to the query and key tensors.

    Removes the interleaving of cos and sin from GLM

""", _NEOX_ROPE_BODY), (1,)),
    "hf_partial_rotary_inline": (_rope_source("""Applies Rotary Position Embedding to the query and key tensors.

""", """    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)

    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]

    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed
"""), (1,)),
    # transformers.models.dinov3_vit.modeling_dinov3_vit.apply_rotary_pos_emb, and its copies
    # (EoMT-DINOv3's, Sapiens 2's): Llama's rotary of the patch tokens only, the prefix tokens
    # (class and register tokens) passed through, then cat along the tokens.
    "hf_prefix_rotary": ('''def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Applies Rotary Position Embedding to the query and key tensors, but only to the patch tokens,
    ignoring the prefix tokens (cls token and register tokens).

    Args:
        q (`torch.Tensor`): The query tensor.
        k (`torch.Tensor`): The key tensor.
        cos (`torch.Tensor`): The cosine part of the rotary embedding.
        sin (`torch.Tensor`): The sine part of the rotary embedding.

    Returns:
        `tuple(torch.Tensor)` comprising of the query and key tensors rotated using the Rotary Position Embedding.
    """

    num_tokens = q.shape[-2]
    num_patches = sin.shape[-2]
    num_prefix_tokens = num_tokens - num_patches  # cls token + register tokens

    q_prefix_tokens, q_patches = q.split((num_prefix_tokens, num_patches), dim=-2)
    k_prefix_tokens, k_patches = k.split((num_prefix_tokens, num_patches), dim=-2)

    # apply rope only to patch tokens
    q_patches = (q_patches * cos) + (rotate_half(q_patches) * sin)
    k_patches = (k_patches * cos) + (rotate_half(k_patches) * sin)

    q = torch.cat((q_prefix_tokens, q_patches), dim=-2)
    k = torch.cat((k_prefix_tokens, k_patches), dim=-2)

    return q, k
''', None),
    # transformers.models.glm4v.modeling_glm4v.apply_rotary_pos_emb (GLM-4V's text attention, and
    # GLM-OCR's): the interleaved rotary (its rotate_half_llm pairs 2p with 2p+1) of the first
    # cos.shape[-1] features, the rest passed through, then cat; the tables taken as given.
    "glm4v_rotary_pairs_partial": (_rope_source("""Applies Rotary Position Embedding to the query and key tensors.

""", """    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)

    # Keep half or full tensor for later concatenation
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]

    # Apply rotary embeddings on the first half or full tensor
    q_embed = (q_rot * cos) + (rotate_half_llm(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half_llm(k_rot) * sin)

    # Concatenate back to full shape
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed
"""), (1,)),
    # transformers.models.gpt_oss.modeling_gpt_oss.apply_rotary_pos_emb: the rotate-half rotary
    # written with halves of the head dim and tables of half its size (its _apply_rotary_emb:
    # chunk, the two products of each half, cat).
    "gpt_oss_apply_rotary_emb": ('''def _apply_rotary_emb(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    first_half, second_half = torch.chunk(x, 2, dim=-1)
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.cat((first_, second_), dim=-1)
''', None),
    "gpt_oss_rotary": ('''def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = _apply_rotary_emb(q, cos, sin)
    k_embed = _apply_rotary_emb(k, cos, sin)
    return q_embed, k_embed
''', (1,)),
    # transformers.models.gptj.modeling_gptj.rotate_every_two (CodeGen's too): each pair
    # (x[2p], x[2p+1]) becomes (-x[2p+1], x[2p]), the interleaved layout, of a 4-D x.
    "gptj_rotate_every_two": ("""def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)  # in einsum notation: rearrange(x, '... d j -> ... (d j)')
""", None),
    # transformers.models.gptj.modeling_gptj.apply_rotary_pos_emb (CodeGen's too): the
    # interleaved rotary of one tensor [batch, tokens, heads, rotary dim] (the model calls it for
    # q and k apart, with their rotary slices), sin before cos, each of half the rotary dim,
    # repeated pair by pair and broadcast over the heads.
    "gptj_rotary": ("""def apply_rotary_pos_emb(tensor: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (rotate_every_two(tensor) * sin)
""", None),
    # OLMo's (and its copies'): Llama's, each result cast back to its input's dtype.
    "hf_rotary_cast_back": (_rope_source("""Applies Rotary Position Embedding to the query and key tensors.

""", """    q_type, k_type = q.dtype, k.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed.to(q_type), k_embed.to(k_type)
"""), (1,)),
    # ModernBERT's (and ESM's, Evolla's): Llama's of q and k upcast to fp32, cast back.
    "hf_rotary_upcast": (_rope_source("""Applies Rotary Position Embedding to the query and key tensors.

""", """    original_dtype = q.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q.float() * cos) + (rotate_half(q.float()) * sin)
    k_embed = (k.float() * cos) + (rotate_half(k.float()) * sin)
    return q_embed.to(original_dtype), k_embed.to(original_dtype)
"""), (1,)),
    # transformers.models.nanochat.modeling_nanochat.rotate_half: Llama's with both signs
    # flipped, cat((x2, -x1)): minus Llama's rotate_half.
    "nanochat_rotate_half": ("""def rotate_half(x):
    \"\"\"Rotates half the hidden dims of the input with flipped signs for NanoChat.\"\"\"
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((x2, -x1), dim=-1)
""", None),
    # GLM's apply_rotary_pos_emb (GLM-4's, Moonshine's): cos and sin of HF's rotate-half layout,
    # their first halves each repeated twice (the interleaved layout), the first cos.shape[-1]
    # features rotated pair by pair, the rest passed through, then cat.
    "hf_rotary_pairs_partial": (_rope_source("""Applies Rotary Position Embedding to the query and key tensors.

""", _GLM_ROPE_BODY), (1,)),
    # Cohere's (Cohere 2's and their copies'): the interleaved rotary of q and k upcast to fp32,
    # both cast back to q's dtype; cos and sin come interleaved.
    "cohere_rotary_pairs_upcast": (_rope_source("""Applies Rotary Position Embedding to the query and key tensors.

""", """    dtype = q.dtype
    q = q.float()
    k = k.float()
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed.to(dtype=dtype), k_embed.to(dtype=dtype)
"""), (1,)),
    # Ernie 4.5's (and its MoE's): GLM's tables, all of the head dim, in fp32, cast back to q's
    # dtype.
    "hf_rotary_pairs_upcast": (_rope_source("""Applies Rotary Position Embedding to the query and key tensors.

""", """    # glm rope style (with full dim) and full precision
    original_dtype = q.dtype

    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)

""" + _GLM_INTERLEAVE + """
    q_embed = (q.float() * cos) + (rotate_half(q).float() * sin)
    k_embed = (k.float() * cos) + (rotate_half(k).float() * sin)

    return q_embed.to(original_dtype), k_embed.to(original_dtype)
"""), (1,)),
    # transformers.models.helium.modeling_helium.apply_rotary_pos_emb: GLM's tables and its
    # interleaved rotate_half over the whole head dim, in the inputs' dtypes.
    "helium_rotary": (_rope_source("""Applies Rotary Position Embedding to the query and key tensors.

""", """    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)

""" + _GLM_INTERLEAVE + """
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)

    return q_embed, k_embed
"""), (1,)),
    # transformers.models.qwen4_exp.modeling_qwen4_exp.apply_rotary_pos_emb: GPT-NeoX's partial
    # rotary with k optional (none: q's alone, returned alone).
    "qwen4_exp_partial_rotary": ('''def apply_rotary_pos_emb(q, k=None, cos=None, sin=None, unsqueeze_dim=1):
    """Applies Rotary Position Embedding to the query and key tensors, or only the queries if the keys are not provided.

''' + _ROPE_DOC.replace("        k (`torch.Tensor`): The key tensor.\n",
                        "        k (`torch.Tensor`): The key tensor if provided.\n") + '''    """
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]

    # Keep half or full tensor for later concatenation
    q_rope, q_nope = q[..., :rotary_dim], q[..., rotary_dim:]
    # Apply rotary embeddings on the first half or full tensor
    q_rope = (q_rope * cos) + (rotate_half(q_rope) * sin)
    # Concatenate back to full shape
    q_rotated = torch.cat([q_rope, q_nope], dim=-1)

    if k is not None:
        k_rope, k_nope = k[..., :rotary_dim], k[..., rotary_dim:]
        k_rope = (k_rope * cos) + (rotate_half(k_rope) * sin)
        k_rotated = torch.cat([k_rope, k_nope], dim=-1)
        return q_rotated, k_rotated
    else:
        return q_rotated
''', (None, None, None, 1)),
    # transformers.models.nemotron.modeling_nemotron.apply_rotary_pos_emb: GPT-NeoX's partial
    # rotary (the first cos.shape[-1] features rotated, the rest cat back) written another way.
    "nemotron_partial_rotary": (_rope_source("""Applies Rotary Position Embedding to the query and key tensors.

""", """    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)

    rot_dim = cos.shape[-1]
    # If q_pass/k_pass is empty, rotary pos embedding is applied to all tensor q/k
    q, q_pass = q[..., :rot_dim], q[..., rot_dim:]
    k, k_pass = k[..., :rot_dim], k[..., rot_dim:]

    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return torch.cat((q_embed, q_pass), dim=-1), torch.cat((k_embed, k_pass), dim=-1)
"""), (1,)),
    # The causal-LM loss every HF *ForCausalLM model's `loss_function` is (LOSS_MAPPING).
    "hf_causal_lm_loss": ("""def ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs):
    # Upcast to float if we need to compute the loss to avoid potential precision issues
    logits = logits.float()

    if shift_labels is None:
        # Shift so that tokens < n predict n
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()

    # Flatten the tokens
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1)
    shift_labels = shift_labels.to(logits.device)
    loss = fixed_cross_entropy(logits, shift_labels, num_items_in_batch, ignore_index, **kwargs)
    return loss
""", (None, -100, None)),
    # transformers.masking_utils (5.17): HF's decisions to build no SDPA mask (`is_causal=True`
    # for a causal one, nothing for a bidirectional one), which they refuse in any trace.
    "hf_ignore_causal_mask_sdpa": ("""def _ignore_causal_mask_sdpa(
    padding_mask: torch.Tensor | None,
    q_length: int,
    kv_length: int,
    q_offset: int,
    kv_offset: int,
    local_attention_size: int | None = None,
) -> bool:
    \"\"\"
    Detects whether the causal mask can be ignored in case PyTorch's SDPA is used, rather relying on SDPA's `is_causal` argument.

    In case no token is masked in the 2D `padding_mask` argument, if `query_length == 1` or
    `key_value_length == query_length`, we rather rely on SDPA `is_causal` argument to use causal/non-causal masks,
    allowing to dispatch to the flash attention kernel (that can otherwise not be used if a custom `attn_mask` is
    passed).
    \"\"\"
    if padding_mask is not None and padding_mask.shape[-1] > kv_length:
        mask_indices = torch.arange(kv_length, device=padding_mask.device) + kv_offset
        padding_mask = padding_mask[:, mask_indices]

    # When using `torch.export` or `torch.onnx.dynamo_export`, we must pass an example input, and `is_causal` behavior is
    # hard-coded to the forward. If a user exports a model with query_length > 1, the exported model will hard-code `is_causal=True`
    # which is in general wrong (see https://github.com/pytorch/pytorch/issues/108108). Thus, we only set
    # `ignore_causal_mask = True` if we are not tracing
    if is_tracing(padding_mask):
        return False
    # In this case, we need to add special patterns to the mask no matter what, so we cannot use any of the later skip conditions
    if local_attention_size is not None and kv_length >= local_attention_size:
        return False

    # If `q_length == 1`, we then use `is_causal=False` in sdpa integration to mimic lower-right alignment. If `kv_length == q_length`,
    # we use `is_causal=True` as upper-left alignment (torch's default) is the same as lower-right in this case. If we have padding,
    # we need to add padding to the mask, so cannot be skipped
    if (q_length == 1 or kv_length == q_length) and (padding_mask is None or fast_all(padding_mask)):
        return True
    # Additional case to optimize prefill: if the cache is empty (`q_offset == 0`), we can use `is_causal=True` even
    # with a padding_mask, if the padding_mask only contains padding related to "future k/v tokens" of the static k/v states
    # returned by StaticCaches. This works thanks to the upper-left alignment of sdpa's `is_causal` mask
    if q_offset == 0 and (
        padding_mask is None or (fast_all(padding_mask[:, :q_length]) and fast_all(~padding_mask[:, q_length:]))
    ):
        return True

    return False
""", (None,)),
    "hf_ignore_bidirectional_mask_sdpa": ("""def _ignore_bidirectional_mask_sdpa(
    padding_mask: torch.Tensor | None,
    kv_length: int,
    local_attention_size: int | None = None,
) -> bool:
    \"\"\"
    Detects whether the bidirectional mask can be ignored in case PyTorch's SDPA is used.

    In case no token is masked in the 2D `padding_mask` argument and no local attention constraint applies
    (i.e. `local_attention_size` is None or `kv_length < local_attention_size`), we skip mask creation,
    allowing to dispatch to the flash attention kernel (that can otherwise not be used if a custom `attn_mask` is
    passed).
    \"\"\"
    if _is_torch_xpu_available:
        # XPU devices have special handling for mask skipping:
        # - Skip if no padding and no local attention constraint
        return _can_skip_bidirectional_mask_xpu(padding_mask, kv_length, local_attention_size)

    # When using `torch.export` or `torch.onnx.dynamo_export`, we need to avoid to check the contents of the mask;
    # otherwise, we will encounter dynamic control flows
    if (
        not is_tracing(padding_mask)
        and (padding_mask is None or padding_mask.all())
        # in this case we need to add special patterns to the mask so cannot be skipped otherwise
        and (local_attention_size is None or kv_length < local_attention_size)
    ):
        return True

    return False
""", (None,)),
}

# Methods other than `forward` of library classes: form -> (the method's name, its source).
_METHOD_SOURCES = {
    # transformers.cache_utils.DynamicLayer.update: the KV cache layer every training forward of
    # an HF decoder builds (`use_cache` defaults to the config's True) and appends K and V to.
    "hf_dynamic_layer_update": ("update", '''def update(
    self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """
        Update the key and value caches in-place, and return the necessary keys and value states.

        Args:
            key_states (`torch.Tensor`): The new key states to cache.
            value_states (`torch.Tensor`): The new value states to cache.

        Returns:
            tuple[`torch.Tensor`, `torch.Tensor`]: The key and value states.
        """
    # Lazy initialization
    if not self.is_initialized:
        self.lazy_initialization(key_states, value_states)

    self.keys = torch.cat([self.keys, key_states], dim=-2)
    self.values = torch.cat([self.values, value_states], dim=-2)
    return self.keys, self.values
'''),
    # transformers.cache_utils.DynamicSlidingWindowLayer.update: the layer of a sliding-window
    # config (Mistral, Gemma 2 and 3's local layers), built and appended to the same way.
    "hf_dynamic_sliding_window_layer_update": ("update", '''def update(
    self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """
        Update the key and value caches in-place, and return the necessary keys and value states.

        Args:
            key_states (`torch.Tensor`): The new key states to cache.
            value_states (`torch.Tensor`): The new value states to cache.

        Returns:
            tuple[`torch.Tensor`, `torch.Tensor`]: The key and value states.
        """
    # Lazy initialization
    if not self.is_initialized:
        self.lazy_initialization(key_states, value_states)

    self.cumulative_length += key_states.shape[-2]

    # Compute the full states
    full_key_states = torch.cat([self.keys, key_states], dim=-2)
    full_value_states = torch.cat([self.values, value_states], dim=-2)
    # Only cache the last `self.sliding_window - 1` tokens (or all of them if lower than that)
    if not self.record_past:
        self.keys = full_key_states[:, :, -self.sliding_window + 1 :, :]
        self.values = full_value_states[:, :, -self.sliding_window + 1 :, :]
    # If we record the past, we keep them all for now, and they'll be restricted to the window size in `crop`
    else:
        self.keys = full_key_states
        self.values = full_value_states

    # Return the full states
    return full_key_states, full_value_states
'''),
}

# HF's attention forms (the `head_views` rewrites').
ATTENTION_FORMS = ("hf_attention", "hf_attention_sliding_window", "hf_attention_config_sliding_window",
                   "qwen3_attention", "gemma3_attention", "gemma2_attention", "olmo2_attention", "olmo3_attention",
                   "phi3_attention", "gpt_neox_attention", "gpt2_attention")

# Form name -> the composition it computes.
COMPUTES = {"hf_dynamic_layer_update": "kv_cache", "hf_dynamic_sliding_window_layer_update": "kv_cache",
            "new_gelu": "gelu_tanh", "fast_gelu": "gelu_tanh", "hf_conv1d_mlp": "gelu_tanh",
            "hf_rms_norm": "hf_rms_norm", "gemma_rms_norm": "hf_rms_norm", "t5_rms_norm": "hf_rms_norm",
            "hf_causal_lm_loss": "cross_entropy", "hf_gated_mlp": "swiglu", "hf_moe_apply_gate": "swiglu",
            "hf_packed_gated_mlp": "swiglu", "hf_gated_mlp_inline": "swiglu", "llama4_gated_mlp": "swiglu",
            "t5gemma_gated_mlp": "swiglu", "seed_oss_gated_mlp": "swiglu", "gemma3n_gated_mlp": "swiglu",
            "recurrent_gemma_gated_mlp": "swiglu", "falcon_h1_gated_mlp": "swiglu",
            "deepseek_v4_clamped_gated_mlp": "swiglu", "glm5_clamped_gated_mlp": "swiglu",
            "qwen4_exp_partial_rotary": "rotary",
            "hf_rotary": "rotary", "hf_single_rotary": "rotary",
            "hf_rotary_cast_back": "rotary", "hf_rotary_upcast": "rotary", "gpt_oss_rms_norm": "hf_rms_norm",
            "gemma4_rms_norm": "hf_rms_norm", "cohere_layer_norm": "layer_norm",
            "moshi_rms_norm": "hf_rms_norm", "fp32_rms_norm_weightless": "hf_rms_norm",
            "llama4_rms_norm": "hf_rms_norm", "unweighted_rms_norm": "hf_rms_norm",
            "mamba_rms_norm_gated": "hf_rms_norm", "qwen3_next_rms_norm_gated": "hf_rms_norm",
            "hf_partial_rotary": "rotary", "hf_partial_rotary_glm_doc": "rotary",
            "hf_partial_rotary_inline": "rotary", "hf_rotary_pairs_partial": "rotary",
            "hf_prefix_rotary": "rotary", "glm4v_rotary_pairs_partial": "rotary", "gpt_oss_rotary": "rotary",
            "gptj_rotary": "rotary", "helium_rotary": "rotary", "nemotron_partial_rotary": "rotary",
            "helium_rms_norm": "hf_rms_norm", "hf_rotary_pairs": "rotary", "hf_rotary_flipped": "rotary",
            "cohere_rotary_pairs_upcast": "rotary", "hf_rotary_pairs_upcast": "rotary",
            "hf_ignore_causal_mask_sdpa": "sdpa", "hf_ignore_bidirectional_mask_sdpa": "sdpa",
            "hf_conv1d": "linear", **dict.fromkeys(ATTENTION_FORMS, "head_views")}


def _compiled(source):
    """The code object of the one function `source` defines, compiled after the prelude."""
    module = compile(_PRELUDE + source, "<torchfuse reference>", "exec")
    return next(c for c in module.co_consts if hasattr(c, "co_code"))


FORMS = {name: _compiled(source) for name, source in _SOURCES.items()}
# The defaults a class form's forward has (most have none). A set holds the defaults a form may
# have where its rewrite passes on only the arguments given (the attention forms': the
# original's own defaults serve the others): Nemotron's attention requires its position
# embeddings.
_FORM_DEFAULTS = {"mamba_rms_norm_gated": (None,), "hf_attention": {(None, None, None), (None, None)},
                  "hf_attention_sliding_window": (None,), "hf_attention_config_sliding_window": (None,),
                  "qwen3_attention": (None,), "gemma3_attention": (None, None, None),
                  "gemma2_attention": (None, None, None), "olmo2_attention": (None,), "olmo3_attention": (None,),
                  "phi3_attention": (None,), "gpt_neox_attention": (None, None),
                  "gpt2_attention": (None, None, None, None, False)}
FUNCTION_FORMS = {name: (_compiled(source), defaults)
                  for name, (source, defaults) in _FUNCTION_SOURCES.items()}
METHOD_FORMS = {name: (method, _compiled(source)) for name, (method, source) in _METHOD_SOURCES.items()}
# Function form -> the name the library defines it under (`apply_rotary_pos_emb`).
FUNCTION_NAMES = {form: code.co_name for form, (code, _) in FUNCTION_FORMS.items()}


def _globals_loaded(code):
    """The global names a code object loads."""
    return {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}


# Code flags that do not change what a function computes: CO_NESTED (defined inside another
# function), and `from __future__ import annotations` in its module (annotations kept as
# strings; transformers.pytorch_utils has it).
_FLAGS_ASIDE = 0x10 | __future__.annotations.compiler_flag


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
        and (a.co_flags & ~_FLAGS_ASIDE) == (b.co_flags & ~_FLAGS_ASIDE)
    )


# The helper forms a form's code calls by name, where not the usual ones (`rotate_half` is
# Llama's rotate-half): the interleaved rotaries call an interleaved rotate_half.
_HELPER_FORMS = {"hf_rotary_pairs": {"rotate_half": "cohere_rotate_pairs"},
                 "hf_rotary_flipped": {"rotate_half": "nanochat_rotate_half"},
                 "hf_rotary_pairs_partial": {"rotate_half": "hf_rotate_pairs"},
                 "glm4v_rotary_pairs_partial": {"rotate_half_llm": "hf_rotate_pairs"},
                 "gpt_oss_rotary": {"_apply_rotary_emb": "gpt_oss_apply_rotary_emb"},
                 "gptj_rotary": {"rotate_every_two": "gptj_rotate_every_two"},
                 "helium_rotary": {"rotate_half": "hf_rotate_pairs"},
                 "hf_rotary_pairs_upcast": {"rotate_half": "hf_rotate_pairs"},
                 "cohere_rotary_pairs_upcast": {"rotate_half": "cohere_rotate_pairs"}}


# The globals a form's rewrite calls as its original does, looked up in the module at each call,
# whatever they hold: nothing is assumed of them.
_CALLED_AS_THEY_ARE = {
    **dict.fromkeys(ATTENTION_FORMS, ("apply_rotary_pos_emb", "ALL_ATTENTION_FUNCTIONS", "eager_attention_forward")),
    "gpt2_attention": ("EncoderDecoderCache", "ALL_ATTENTION_FUNCTIONS", "eager_attention_forward")}
# The builtins a form's code calls (found as builtins: not shadowed in its module).
_BUILTINS = ("getattr", "hasattr", "isinstance", "ValueError")


def _global_is_expected(function, name, form=None):
    """The global `name` the function loads is what the reference's module would hold: the
    module `math`, `torch` or `torch.nn`, HF's ACT2FN, the known form of the function of that
    name (for `form`'s code: `_HELPER_FORMS`), or one the rewrite of `form` calls as it is."""
    torch = sys.modules.get("torch")
    if name in _CALLED_AS_THEY_ARE.get(form, ()):
        return name in function.__globals__
    if name in _BUILTINS:  # the builtin, not shadowed in the module
        return name not in function.__globals__
    value = function.__globals__.get(name)
    if name in ("math", "torch", "nn"):
        expected = {"math": math, "torch": torch, "nn": getattr(torch, "nn", None)}[name]
        return expected is not None and value is expected
    if name == "fixed_cross_entropy":
        return function_form_of(value) == "hf_fixed_cross_entropy"
    helpers = _HELPER_FORMS.get(form, {})
    if name == "rotate_half" or name in helpers:
        return function_form_of(value) == helpers.get(name, "hf_rotate_half")
    if name == "ACT2FN":  # HF's activations by name (what it builds is checked at each call)
        activations = sys.modules.get("transformers.activations")
        return activations is not None and value is getattr(activations, "ACT2FN", None)
    if name in _UNCALLED_HELPERS:
        return getattr(value, "__module__", "").startswith("transformers.") or type(value) is bool
    return False


# Helpers of transformers.masking_utils the mask-skip forms load, which their rewrite never
# calls (it decides only where these would not: no padding mask; the XPU path left to the
# original): HF's own, whatever their code.
_UNCALLED_HELPERS = ("is_tracing", "fast_all", "_is_torch_xpu_available",
                     "_can_skip_bidirectional_mask_xpu")


# The instructions that continue a chain of attribute loads (3.11 loads a method's attribute
# with LOAD_METHOD; 3.12 with LOAD_ATTR).
_ATTRIBUTE_LOADS = ("LOAD_ATTR", "LOAD_METHOD")


def _global_chains(code):
    """The chains of names the code loads from its globals: `nn.functional.cross_entropy` is
    ("nn", "functional", "cross_entropy"), `rotate_half` is ("rotate_half",)."""
    chains, chain = set(), None
    for instruction in dis.get_instructions(code):
        if instruction.opname == "LOAD_GLOBAL":
            if chain:
                chains.add(tuple(chain))
            chain = [instruction.argval]
        elif chain and instruction.opname in _ATTRIBUTE_LOADS:
            chain.append(instruction.argval)
        elif chain:
            chains.add(tuple(chain))
            chain = None
    if chain:
        chains.add(tuple(chain))
    return chains


def _resolve(namespace, chain):
    value = namespace.get(chain[0])
    for name in chain[1:]:
        value = getattr(value, name, None)
    return value


class Dependencies:
    """What a recognised function's code calls through its globals (`torch.tanh`,
    `nn.functional.cross_entropy`, a helper such as `rotate_half` and what that calls in turn),
    as it was when recognised. A rewrite runs only while `unchanged()`: a patch of any of them
    (a library's, a user's) means the original code, which calls the patch, must run.

    `unchanged` is a plain function, not a bound method: the rewrites keep it in their closures,
    and Dynamo cannot wrap a bound method in the closure of a function it reaches without a
    source (the forward of a module made inside a compiled region, a KV-cache layer's update):
    torch.compile would fail there, or break the graph, where it compiles stock's code whole."""

    def __init__(self, *functions):
        expected = self._expected = []
        self.unchanged = lambda: all(_resolve(namespace, chain) is value for namespace, chain, value in expected)
        seen = set()
        pending = list(functions)
        while pending:
            function = pending.pop()
            if id(function) in seen or getattr(function, "__code__", None) is None:
                continue
            seen.add(id(function))
            namespace = function.__globals__
            for chain in sorted(_global_chains(function.__code__)):
                value = _resolve(namespace, chain)
                self._expected.append((namespace, chain, value))
                if len(chain) == 1 and function_form_of(value) is not None:
                    pending.append(value)  # a known helper: what it calls counts too

    def add(self, namespace, chain):
        """Counts one more dependency: `chain` resolved in `namespace` (a module's dict)."""
        self._expected.append((namespace, chain, _resolve(namespace, chain)))
        return self


# Forms whose rewrite binds the arguments by the reference's names (its own signature): their
# parameter names must be the reference's too (bytecode reads arguments by position).
_NAMED_PARAMETERS = frozenset(_CALLED_AS_THEY_ARE)


def _parameter_names(code):
    count = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)
    return code.co_varnames[:count]


def _matches(function, form, reference, defaults):
    code = getattr(function, "__code__", None)
    return (code is not None and _same_code(code, reference)
            and (form not in _NAMED_PARAMETERS or _parameter_names(code) == _parameter_names(reference))
            and getattr(function, "__defaults__", None) == defaults
            and not getattr(function, "__kwdefaults__", None)
            and not getattr(function, "__closure__", None)
            and all(_global_is_expected(function, g, form) for g in _globals_loaded(code)))


def form_of(function):
    """The name of the known `forward` form `function` is, or None."""
    def accepted(name):
        defaults = _FORM_DEFAULTS.get(name)
        return defaults if isinstance(defaults, set) else (defaults,)
    return next((name for name, reference in FORMS.items()
                 if any(_matches(function, name, reference, defaults) for defaults in accepted(name))), None)


def function_form_of(function):
    """The name of the known module-level function form `function` is, or None."""
    return next((name for name, (reference, defaults) in FUNCTION_FORMS.items()
                 if _matches(function, name, reference, defaults)), None)


def is_silu(module_type, torch):
    """Whether modules of this type compute SiLU: torch.nn.SiLU, or a class whose forward is
    HF's SiLUActivation form."""
    return module_type is torch.nn.SiLU or (
        form_of(module_type.__dict__.get("forward")) == "hf_silu"
        and module_type.__mro__[1] is torch.nn.Module)


def is_gelu_tanh_by_attribute(module_type, torch):
    """Whether modules of this type compute what their `act` attribute computes, as HF's
    GELUTanh does (whose `act` is F.gelu with approximate="tanh", or its Python composition)."""
    return (form_of(module_type.__dict__.get("forward")) == "hf_gelu_tanh"
            and module_type.__mro__[1] is torch.nn.Module)


def scan_functions(module):
    """The functions defined in `module` that are a known form whose composition torchfuse
    serves: {attribute name: form}."""
    found = {}
    for name, value in list(vars(module).items()):
        if callable(value) and getattr(value, "__module__", None) == module.__name__:
            form = function_form_of(value)
            if form is not None and form in COMPUTES:
                found[name] = form
    return found


# Opcodes that load a local for the stack (3.11, 3.12); any other use of the input's name (a
# store, a delete, a comprehension's clear) makes the analysis below give up.
_LOADS = ("LOAD_FAST", "LOAD_FAST_CHECK")
# Markers that carry no data flow of their own.
_SKIPPED_OPCODES = ("CACHE", "NOP", "EXTENDED_ARG", "RESUME", "PRECALL")
# A `with` block (autocast switched off around a call, say) or anything that reads the frame's
# locals wholesale: where they appear, what a call sees is not what the code says.
_OPAQUE_OPCODES = ("BEFORE_WITH", "SETUP_WITH", "BEFORE_ASYNC_WITH")
_OPAQUE_NAMES = frozenset({"locals", "vars", "eval", "exec", "globals", "autocast"})
# CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR, CO_ITERABLE_COROUTINE.
_SUSPENDS = 0x20 | 0x80 | 0x100 | 0x200


def linear_input_sites(function):
    """Where a forward's input (its parameter after `self`) goes, read from its bytecode: the
    names of the `self` attributes it is passed to as the only argument of a call
    (`self.q_proj(hidden_states)`), if that and `.shape` are all the code does with it; None
    otherwise (it is stored, deleted, captured by a closure, passed on, computed with, read
    under a `with`, or the frame's locals are read). What those attributes are is checked at
    run time."""
    code = getattr(function, "__code__", None)
    if code is None or code.co_argcount < 2 or code.co_flags & _SUSPENDS:
        return None
    self_name, x_name = code.co_varnames[0], code.co_varnames[1]
    if {self_name, x_name} & set(code.co_cellvars) or _OPAQUE_NAMES & set(code.co_names):
        return None
    instructions = [i for i in dis.get_instructions(code) if i.opname not in _SKIPPED_OPCODES]
    if any(i.opname in _OPAQUE_OPCODES for i in instructions):
        return None
    sites = []
    for n, ins in enumerate(instructions):
        # Superinstructions (3.13's LOAD_FAST_LOAD_FAST) name two locals at once.
        names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
        if ins.opname.startswith(("STORE_", "DELETE_")) and self_name in names:
            return None
        if x_name not in names or not ins.opname.startswith(("LOAD_", "STORE_", "DELETE_")):
            continue
        if ins.opname not in _LOADS or n + 1 >= len(instructions):
            return None
        # A jump landing after `self` is loaded ((self.a if c else self.b)(x)) joins paths whose
        # callees the neighbours below do not show (one landing on the `self` load is a
        # statement's start: the three that follow run in a row).
        if any(i.is_jump_target for i in instructions[max(n - 1, 0):n + 2]):
            return None
        after = instructions[n + 1]
        if after.opname == "LOAD_ATTR" and after.argval == "shape":
            continue
        before, callee = (instructions[n - 2], instructions[n - 1]) if n >= 2 else (None, None)
        if (before is not None and before.opname in _LOADS and before.argval == self_name
                and callee.opname in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(callee.argval, str)
                and after.opname == "CALL" and after.arg == 1):
            sites.append(callee.argval)
            continue
        return None
    return tuple(sites)


def consumer_input(function):
    """Where a forward sends its input, if only to its attributes' calls: (the input's name, the
    attributes), shared_cast's reading (`linear_input_sites`, one site or more), or where the
    forward's first statement is `x = self.<a>(x)` (an MLP's first projection; x names another
    tensor from there on), (x, (a,)). None otherwise. What the attributes are is checked at run
    time."""
    code = getattr(function, "__code__", None)
    sites = linear_input_sites(function)
    if sites:
        return code.co_varnames[1], sites
    if code is None or code.co_argcount < 2 or code.co_flags & _SUSPENDS:
        return None
    self_name, x_name = code.co_varnames[0], code.co_varnames[1]
    if {self_name, x_name} & set(code.co_cellvars) or _OPAQUE_NAMES & set(code.co_names):
        return None
    first = [i for i in dis.get_instructions(code) if i.opname not in _SKIPPED_OPCODES][:5]
    if len(first) < 5 or any(i.is_jump_target for i in first):
        return None
    load_self, attribute, load_x, call, store = first
    if store.opname not in ("STORE_FAST", "STORE_FAST_LOAD_FAST"):
        return None  # (another instruction's argval may be anything: a constant's empty tuple)
    # 3.13 fuses the store with the next statement's first load (STORE_FAST_LOAD_FAST).
    stored = store.argval[0] if store.opname == "STORE_FAST_LOAD_FAST" else store.argval
    if (load_self.opname in _LOADS and load_self.argval == self_name
            and attribute.opname in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(attribute.argval, str)
            and load_x.opname in _LOADS and load_x.argval == x_name
            and call.opname == "CALL" and call.arg == 1 and stored == x_name):
        return x_name, (attribute.argval,)
    return None


def _self_call(node, self_name):
    """`self.<attribute>(...)`: the attribute's name, else None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == self_name):
        return node.func.attr
    return None


def _instructions(code):
    """A code object's instructions as what they do (opcode and argument, not where)."""
    return [(i.opname, i.argrepr) for i in dis.get_instructions(code) if i.opname not in _SKIPPED_OPCODES]


def _function_tree(function, exact=True):
    """The parsed source of `function` (an ast.FunctionDef), checked against its code: the
    source compiled again gives the same instructions (a source file changed since the import,
    or code the compiler sees otherwise there, `super()`'s class cell, a nested function, reads
    as None), or None. `exact=False`: the same names and locals only (for a reading that only
    filters, as `_made_as_norms`)."""
    code = getattr(function, "__code__", None)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        compiled = compile(tree, "<analysis>", "exec", dont_inherit=True)
    except (OSError, TypeError, SyntaxError, ValueError):
        return None
    node = tree.body[0] if tree.body else None
    inner = next((c for c in compiled.co_consts if getattr(c, "co_name", None) == code.co_name), None)
    if (not isinstance(node, ast.FunctionDef) or inner is None or inner.co_varnames != code.co_varnames
            or inner.co_names != code.co_names or inner.co_argcount != code.co_argcount
            or (exact and _instructions(inner) != _instructions(code))):
        return None
    return node


# Nodes whose body may run more than once in one run of the statement holding them.
_REPEATING = (ast.For, ast.AsyncFor, ast.While, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp,
              ast.Lambda)


def norm_handoffs(function):
    """Where a layer's forward hands a submodule's output, unchanged and to nothing else, to
    another submodule: `h = self.<norm>(x)` followed by one use of `h` (not in a loop), the
    argument (the first positional, or one keyword) of a `self.<sub>(...)` call, up to `h`'s
    next assignment; or `self.<sub>(self.<norm>(x), ...)`, at every call of the norm. The first
    module is mentioned only in those calls, each with one positional argument; no `with` block.
    [(norm, sub, how)]: `how` is 0 (the first positional argument) or the keyword's name.
    Read from the source, checked against the code (`_function_tree`); anything it cannot
    follow (a closure over `h`, an assignment of it in a branch, a use in an expression) gives
    no pair. Which modules these are (a norm, a submodule passing its input only to Linear
    layers) is checked at run time. A decorated forward is read through to the function it
    wraps (`functools.wraps`' `__wrapped__`)."""
    function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    if code is None or code.co_argcount < 1 or code.co_flags & _SUSPENDS or _OPAQUE_NAMES & set(code.co_names):
        return []
    tree = _function_tree(function)
    if tree is None:
        return []
    self_name = code.co_varnames[0]
    # `self` reassigned; or a `with` block, under which a call may run with autocast switched
    # off or changed (an alias of torch.autocast reads as any other name).
    if any((isinstance(n, ast.Name) and n.id == self_name and not isinstance(n.ctx, ast.Load))
           or isinstance(n, (ast.With, ast.AsyncWith)) for n in ast.walk(tree)):
        return []

    def position(call, node):
        """How `node` is an argument of `call`: 0, a keyword's name, or None."""
        if call.args and call.args[0] is node:
            return 0
        for keyword in call.keywords:
            if keyword.value is node and keyword.arg is not None:
                return keyword.arg
        return None

    calls = sorted((n for n in ast.walk(tree) if _self_call(n, self_name)), key=lambda n: (n.lineno, n.col_offset))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    # self.<name> read anywhere other than as a call's function: the module is passed on or
    # stored, so its calls are not all in view.
    attribute_reads = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == self_name:
            attribute_reads[node.attr] = attribute_reads.get(node.attr, 0) + 1

    def handed_to(node):
        """(sub, how) where `node` is an argument of a `self.<sub>(...)` call, else None."""
        holder = parents.get(node)
        if isinstance(holder, ast.keyword):
            holder = parents.get(holder)
        how = position(holder, node) if _self_call(holder, self_name) else None
        return None if how is None else (_self_call(holder, self_name), how)

    def one_argument(call):
        return len(call.args) == 1 and not call.keywords and not isinstance(call.args[0], ast.Starred)

    def repeated(node, statement):
        """Whether `node` may run more than once in one run of `statement` (in a loop, a
        comprehension, a lambda)."""
        while node is not statement and node is not None:
            node = parents.get(node)
            if isinstance(node, _REPEATING):
                return True
        return False

    pairs = []
    for norm in dict.fromkeys(_self_call(c, self_name) for c in calls):
        own_calls = [c for c in calls if _self_call(c, self_name) == norm]
        # Every mention of self.<norm> is one of these calls: it is not passed on or stored.
        if attribute_reads.get(norm) != len(own_calls) or not all(map(one_argument, own_calls)):
            continue
        # Every call's output an argument of the same module's calls (GPT-NeoX's post-attention
        # norm, called in both branches of its residual choice).
        handed = {handed_to(c) for c in own_calls}
        if len(handed) == 1 and None not in handed:
            pairs.append((norm, *handed.pop()))
            continue
        statement = parents.get(own_calls[0])
        if not (len(own_calls) == 1 and isinstance(statement, ast.Assign) and len(statement.targets) == 1
                and isinstance(statement.targets[0], ast.Name) and statement in tree.body):
            continue
        name = statement.targets[0].id
        if name not in code.co_varnames or name in code.co_cellvars:
            continue
        # Its one use: handed to a module more than once (twice, in a loop), the original casts
        # it once a call and adds the casts' gradients in fp32.
        uses = []
        for later in tree.body[tree.body.index(statement) + 1:]:
            names = [n for n in ast.walk(later) if isinstance(n, ast.Name) and n.id == name]
            uses += [None if repeated(n, later) else handed_to(n) for n in names if isinstance(n.ctx, ast.Load)]
            if any(not isinstance(n.ctx, ast.Load) for n in names):
                # An assignment ends h's life only as a simple statement: in a branch or loop
                # the old h may live on past it.
                if not isinstance(later, ast.Assign):
                    uses.append(None)
                break
            if isinstance(later, ast.Return):
                break
        if len(uses) == 1 and uses[0] is not None:
            pairs.append((norm, *uses[0]))
    return list(dict.fromkeys(pairs))


def _own_classes(module):
    """The classes `module` defines itself (not those it imports)."""
    return [value for value in list(vars(module).values())
            if isinstance(value, type) and value.__module__ == module.__name__]


def scan_shared_inputs(module):
    """The classes defined in `module` whose own `forward` passes its input to two or more of
    its attributes' calls and does nothing else with it but read its shape (an attention's
    q/k/v projections, a gated MLP's gate and up): {class: (the input's name, the attributes)}.
    Under autocast, where those attributes are plain Linear layers, each casts the same fp32
    input to the same low-precision tensor."""
    found = {}
    for value in _own_classes(module):
        forward = value.__dict__.get("forward")
        sites = linear_input_sites(forward) if forward is not None else None
        if sites is not None and len(sites) >= 2:
            found[value] = (forward.__code__.co_varnames[1], sites)
    return found


def scan_consumers(module):
    """The classes defined in `module` whose own `forward` passes its input only to its
    attributes' calls (`consumer_input`): {class: (the input's name, the attributes)}."""
    found = {}
    for value in _own_classes(module):
        forward = value.__dict__.get("forward")
        consumer = consumer_input(forward) if forward is not None else None
        if consumer is not None:
            found[value] = consumer
    return found


def _made_as_norms(cls):
    """The attributes `cls.__init__` assigns a call of something named like a norm
    (`self.ln_1 = nn.LayerNorm(...)`, `LlamaRMSNorm(...)`), or named so themselves: which of a
    layer's handoffs may start at a norm (a filter only; the modules' types decide at run time)."""
    init = cls.__dict__.get("__init__")
    tree = _function_tree(init, exact=False) if init is not None else None
    if tree is None:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            made = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            for target in node.targets:
                if isinstance(target, ast.Attribute) and ("Norm" in made or "norm" in target.attr):
                    names.add(target.attr)
    return names


def scan_norm_handoffs(module):
    """The classes defined in `module` whose own `forward` hands a norm's output only to one
    submodule (`norm_handoffs`, its first module made as a norm in `__init__`):
    {class: ((norm, sub, how), ...)}."""
    found = {}
    for value in _own_classes(module):
        forward, init = value.__dict__.get("forward"), value.__dict__.get("__init__")
        # The source is read only where `__init__`'s code names a norm at all (what
        # `_made_as_norms` finds is among its names): a module's import reads a few classes'
        # source, not every class's.
        names = getattr(getattr(init, "__code__", None), "co_names", ())
        if forward is None or not any("norm" in name.lower() for name in names):
            continue
        pairs = norm_handoffs(forward)
        norms = _made_as_norms(value) if pairs else set()
        pairs = tuple(pair for pair in pairs if pair[0] in norms)
        if pairs:
            found[value] = pairs
    return found


def scan(module):
    """The classes defined in `module` whose own `forward` is a known form whose composition
    torchfuse serves: {class: form}."""
    found = {}
    for value in _own_classes(module):
        forward = value.__dict__.get("forward")
        form = form_of(forward) if forward is not None else None
        if form is not None and form in COMPUTES:
            found[value] = form
    return found


def scan_methods(module):
    """The classes defined in `module` with an own method (other than `forward`) of a known form
    whose composition torchfuse serves: {class: (method name, form)}."""
    found = {}
    for value in _own_classes(module):
        for form, (method, reference) in METHOD_FORMS.items():
            function = value.__dict__.get(method)
            if form in COMPUTES and function is not None and _matches(function, form, reference, None):
                found[value] = (method, form)
    return found


# What a class's forward near a known form looks like, by form: its class name or the
# attributes its code reads. A guide to the forms to add next (`scripts/bench/coverage.py`), not
# a recognition: nothing is rewritten on it.
_NEAR_CLASS = {
    "hf_rms_norm": lambda name, names: name.endswith("RMSNorm") or {"pow", "mean", "rsqrt"} <= names,
    "hf_gated_mlp": lambda name, names: "down_proj" in names and bool({"gate_proj", "gate_up_proj"} & names),
    "new_gelu": lambda name, names: "GELU" in name and "tanh" in names,
}


def near_forms(module):
    """The classes and functions defined in `module` that look like a form torchfuse serves but
    are not one (another composition under a familiar name or call shape: Gemma's `(1 + w)`
    RMSNorm, GPT-NeoX's partial rotary): {name: the form they are near}."""
    near = {}
    for name, value in list(vars(module).items()):
        if getattr(value, "__module__", None) != module.__name__:
            continue
        if isinstance(value, type):
            forward = value.__dict__.get("forward")
            code = getattr(forward, "__code__", None)
            if code is None or form_of(forward) in COMPUTES:
                continue
            names = set(code.co_names)
            for form, looks_like in _NEAR_CLASS.items():
                if looks_like(value.__name__, names):
                    near[value.__name__] = form
                    break
        elif callable(value) and function_form_of(value) not in COMPUTES:
            for form, function_name in FUNCTION_NAMES.items():
                if name == function_name and form in COMPUTES:
                    near[name] = form
                    break
    return near
