// torchfuse::rotary (HF's apply_rotary_pos_emb, rotate-half or interleaved) and its backward;
// torchfuse::kv_copy (the first append to HF's KV cache: fresh copies of K and V, as cat makes).
#include "glue.h"

namespace torchfuse_glue {
namespace {

// torchfuse::rotary(q, k, cos, sin, unsqueeze_dim, interleaved, passthrough): HF's
// apply_rotary_pos_emb (the rotate-half form, or with `interleaved` the rotate_every_two form of
// GLM, Cohere and GPT-J), q and k in one call; with `passthrough`, GPT-NeoX's partial rotary:
// the first r features of the head dim rotate (r: the tables' last dim, as unsqueezed), the
// rest pass through, and the two are concatenated (the original's split and cat). The
// gradients go to q and k (cos and sin that need one take HF's own ops, autograd included).
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

// rotate_half's transpose. rotate_half(x) = cat(-x2, x1) with x1 the first d / 2 (rounded
// down) elements, so -x2 fills the first d - d / 2 of the output: the gradient is
// cat(dy[d - d/2:], -dy[:d - d/2]).
at::Tensor rotate_half_transposed(const at::Tensor& dy) {
  const int64_t split = dy.size(-1) - dy.size(-1) / 2;
  return at::cat({dy.slice(-1, split), -dy.slice(-1, 0, split)}, -1);
}

// GLM's rotate_half (GPT-J's rotate_every_two): stack((-x[..., 1::2], x[..., 0::2]), -1)
// flattened, each pair (x[2p], x[2p+1]) becoming (-x[2p+1], x[2p]).
at::Tensor rotate_pairs(const at::Tensor& x) {
  return at::stack({-x.slice(-1, 1, c10::nullopt, 2), x.slice(-1, 0, c10::nullopt, 2)}, -1)
      .flatten(-2);
}

// rotate_pairs' transpose: each pair (g[2p], g[2p+1]) becomes (g[2p+1], -g[2p]).
at::Tensor rotate_pairs_transposed(const at::Tensor& g) {
  return at::stack({g.slice(-1, 1, c10::nullopt, 2), -g.slice(-1, 0, c10::nullopt, 2)}, -1)
      .flatten(-2);
}

// HF's composition, with `rotate` in rotate_half's place (the Meta kernels below pass the
// identity).
template <class Rotate>
std::tuple<at::Tensor, at::Tensor> rotary_composed(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& cos, const at::Tensor& sin,
                                                   int64_t unsqueeze_dim, Rotate rotate) {
  const at::Tensor c = cos.unsqueeze(unsqueeze_dim), s = sin.unsqueeze(unsqueeze_dim);
  return {q * c + rotate(q) * s, k * c + rotate(k) * s};
}

// The gradients of q and k from the outputs' (undefined stays undefined), composed of
// differentiable PyTorch ops, in q's and k's dtype; `rotate` in rotate_half_transposed's place.
template <class Rotate>
std::tuple<at::Tensor, at::Tensor> rotary_backward_composed(
    const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& cos,
    const at::Tensor& sin, int64_t unsqueeze_dim, at::ScalarType x_dtype, Rotate rotate) {
  const at::Tensor c = cos.unsqueeze(unsqueeze_dim), s = sin.unsqueeze(unsqueeze_dim);
  auto one = [&](const at::Tensor& g) {
    return g.defined() ? (g * c + rotate(g * s)).to(x_dtype) : at::Tensor();
  };
  return {one(grad_q), one(grad_k)};
}

// Partial rotary's rotated features: the tables' last dim, as the original reads it (after
// the unsqueeze).
int64_t rotated_features(const at::Tensor& cos, int64_t unsqueeze_dim) {
  return cos.unsqueeze(unsqueeze_dim).size(-1);
}

// x's first r features and the rest: the original's two slices (one split).
std::vector<at::Tensor> rotated_and_passed(const at::Tensor& x, int64_t r) {
  return x.split_with_sizes({r, x.size(-1) - r}, -1);
}

std::tuple<at::Tensor, at::Tensor> rotary_stock(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& cos, const at::Tensor& sin,
                                                int64_t unsqueeze_dim, bool interleaved,
                                                bool passthrough) {
  auto rotated = [&](const at::Tensor& a, const at::Tensor& b) {
    return interleaved ? rotary_composed(a, b, cos, sin, unsqueeze_dim, rotate_pairs)
                       : rotary_composed(a, b, cos, sin, unsqueeze_dim, rotate_half);
  };
  if (!passthrough) return rotated(q, k);
  const int64_t r = rotated_features(cos, unsqueeze_dim);
  const auto qs = rotated_and_passed(q, r), ks = rotated_and_passed(k, r);
  auto [q_embed, k_embed] = rotated(qs[0], ks[0]);
  return {at::cat({q_embed, qs[1]}, -1), at::cat({k_embed, ks[1]}, -1)};
}

// Partial rotary's backward (cat's, then the rotation's, then the split's): the rotated
// features' gradient by the rotation's transpose, the rest's passed back in x's dtype.
std::tuple<at::Tensor, at::Tensor> rotary_backward_stock(const at::Tensor& grad_q,
                                                         const at::Tensor& grad_k,
                                                         const at::Tensor& cos,
                                                         const at::Tensor& sin,
                                                         int64_t unsqueeze_dim,
                                                         at::ScalarType x_dtype,
                                                         bool interleaved, bool passthrough) {
  auto rotated = [&](const at::Tensor& a, const at::Tensor& b) {
    return interleaved ? rotary_backward_composed(a, b, cos, sin, unsqueeze_dim, x_dtype,
                                                  rotate_pairs_transposed)
                       : rotary_backward_composed(a, b, cos, sin, unsqueeze_dim, x_dtype,
                                                  rotate_half_transposed);
  };
  if (!passthrough) return rotated(grad_q, grad_k);
  const int64_t r = rotated_features(cos, unsqueeze_dim);
  auto rotated_part = [&](const at::Tensor& g) { return g.defined() ? g.slice(-1, 0, r) : g; };
  auto [dq, dk] = rotated(rotated_part(grad_q), rotated_part(grad_k));
  auto whole = [&](const at::Tensor& d, const at::Tensor& g) {
    return g.defined() ? at::cat({d, g.slice(-1, r).to(x_dtype)}, -1) : at::Tensor();
  };
  return {whole(dq, grad_q), whole(dk, grad_k)};
}

// Meta tensors (and a compiler's fake ones, whose symbolic sizes the slices of rotate_half
// cannot take there): the rotation changes neither sizes, dtype nor layout, so the composition
// without it gives the outputs' metadata.
const auto unrotated = [](const at::Tensor& t) { return t; };

// The interleaved rotation pairs (x[2p], x[2p+1]) of the rotated features (the last dim, or
// in partial rotary the tables' last dim): of an odd count the composition stacks halves of
// unequal sizes and raises, so the Meta kernels raise too (clearer).
void check_pairs(const at::Tensor& x, const at::Tensor& cos, int64_t unsqueeze_dim,
                 bool interleaved, bool passthrough) {
  const c10::SymInt rotated =
      passthrough ? cos.unsqueeze(unsqueeze_dim).sym_size(-1) : x.sym_size(-1);
  TORCH_CHECK(!interleaved || rotated % 2 == 0,
              "torchfuse::rotary: the interleaved rotation pairs the rotated features, so their "
              "count must be even; got ",
              rotated);
}

// Partial rotary's outputs: the cat's, row-major of the inputs' sizes in `dtype`.
at::Tensor passed_through_like(const at::Tensor& x, at::ScalarType dtype) {
  return at::empty_symint(x.sym_sizes(), x.options().dtype(dtype));
}

std::tuple<at::Tensor, at::Tensor> rotary_meta(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin,
                                               int64_t unsqueeze_dim, bool interleaved,
                                               bool passthrough) {
  check_pairs(q, cos, unsqueeze_dim, interleaved, passthrough);
  check_pairs(k, cos, unsqueeze_dim, interleaved, passthrough);
  if (passthrough) {
    // x * cos + rotate(x) * sin, then cat with x's rest: x's dtype promoted with the tables'.
    auto promoted = [&](const at::Tensor& x) {
      return c10::promoteTypes(c10::promoteTypes(x.scalar_type(), cos.scalar_type()),
                               sin.scalar_type());
    };
    return {passed_through_like(q, promoted(q)), passed_through_like(k, promoted(k))};
  }
  return rotary_composed(q, k, cos, sin, unsqueeze_dim, unrotated);
}

std::tuple<at::Tensor, at::Tensor> rotary_backward_meta(const at::Tensor& grad_q,
                                                        const at::Tensor& grad_k,
                                                        const at::Tensor& cos,
                                                        const at::Tensor& sin,
                                                        int64_t unsqueeze_dim,
                                                        at::ScalarType x_dtype,
                                                        bool interleaved, bool passthrough) {
  for (const at::Tensor* g : {&grad_q, &grad_k})
    if (g->defined()) check_pairs(*g, cos, unsqueeze_dim, interleaved, passthrough);
  if (passthrough) {
    auto one = [&](const at::Tensor& g) {
      return g.defined() ? passed_through_like(g, x_dtype) : at::Tensor();
    };
    return {one(grad_q), one(grad_k)};
  }
  return rotary_backward_composed(grad_q, grad_k, cos, sin, unsqueeze_dim, x_dtype, unrotated);
}

std::tuple<at::Tensor, at::Tensor> rotary_cuda(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin,
                                               int64_t unsqueeze_dim, bool interleaved,
                                               bool passthrough) {
  TfRotaryCall call{};
  call.q = describe(q);
  call.k = describe(k);
  call.cos = describe(cos);
  call.sin = describe(sin);
  call.unsqueeze_dim = unsqueeze_dim;
  call.interleaved = interleaved;
  call.passthrough = passthrough;
  return fused_or_stock(TF_ENTRY_ROTARY, q, call, [&] {
    return rotary_stock(q, k, cos, sin, unsqueeze_dim, interleaved, passthrough);
  });
}

std::tuple<at::Tensor, at::Tensor> rotary_backward_cuda(const at::Tensor& grad_q,
                                                        const at::Tensor& grad_k,
                                                        const at::Tensor& cos,
                                                        const at::Tensor& sin,
                                                        int64_t unsqueeze_dim,
                                                        at::ScalarType x_dtype,
                                                        bool interleaved, bool passthrough) {
  TfRotaryCall call{};
  call.grad_q = describe(grad_q);
  call.grad_k = describe(grad_k);
  call.cos = describe(cos);
  call.sin = describe(sin);
  call.unsqueeze_dim = unsqueeze_dim;
  call.x_dtype = static_cast<int16_t>(x_dtype);
  call.interleaved = interleaved;
  call.passthrough = passthrough;
  return fused_or_stock(TF_ENTRY_ROTARY_BACKWARD, grad_q, call, [&] {
    return rotary_backward_stock(grad_q, grad_k, cos, sin, unsqueeze_dim, x_dtype, interleaved,
                                 passthrough);
  });
}

std::tuple<at::Tensor, at::Tensor> call_rotary(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin,
                                               int64_t unsqueeze_dim, bool interleaved,
                                               bool passthrough) {
  static const auto op = own_op<decltype(call_rotary)>("torchfuse::rotary");
  return op.call(q, k, cos, sin, unsqueeze_dim, interleaved, passthrough);
}

std::tuple<at::Tensor, at::Tensor> call_rotary_backward(const at::Tensor& grad_q,
                                                        const at::Tensor& grad_k,
                                                        const at::Tensor& cos,
                                                        const at::Tensor& sin,
                                                        int64_t unsqueeze_dim,
                                                        at::ScalarType x_dtype,
                                                        bool interleaved, bool passthrough) {
  static const auto op = own_op<decltype(call_rotary_backward)>("torchfuse::rotary_backward");
  return op.call(grad_q, grad_k, cos, sin, unsqueeze_dim, x_dtype, interleaved, passthrough);
}

class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& cos, const at::Tensor& sin,
                                                int64_t unsqueeze_dim, bool interleaved,
                                                bool passthrough) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["unsqueeze_dim"] = unsqueeze_dim;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(q.scalar_type());
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["passthrough"] = passthrough;
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [q_embed, k_embed] =
        call_rotary(q, k, cos, sin, unsqueeze_dim, interleaved, passthrough);
    return {q_embed, k_embed};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const int64_t dim = ctx->saved_data["unsqueeze_dim"].toInt();
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const bool interleaved = ctx->saved_data["interleaved"].toBool();
    const bool passthrough = ctx->saved_data["passthrough"].toBool();
    // create_graph, or one output unused: the composed, differentiable form.
    auto [dq, dk] = at::GradMode::is_enabled() || !grads[0].defined() || !grads[1].defined()
                        ? rotary_backward_stock(grads[0], grads[1], saved[0], saved[1], dim,
                                                x_dtype, interleaved, passthrough)
                        : call_rotary_backward(grads[0], grads[1], saved[0], saved[1], dim,
                                               x_dtype, interleaved, passthrough);
    return {dq, dk, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> rotary_autograd(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& cos, const at::Tensor& sin,
                                                   int64_t unsqueeze_dim, bool interleaved,
                                                   bool passthrough) {
  // cos/sin that need a gradient, and what the Function cannot take: HF's ops.
  if (q.scalar_type() != k.scalar_type() ||
      (at::GradMode::is_enabled() && (cos.requires_grad() || sin.requires_grad())) ||
      composition_only({q, k, cos, sin}))
    return rotary_stock(q, k, cos, sin, unsqueeze_dim, interleaved, passthrough);
  auto outputs = RotaryFunction::apply(q, k, cos, sin, unsqueeze_dim, interleaved, passthrough);
  return {outputs[0], outputs[1]};
}

// torchfuse::kv_copy(key, value, key_dtype, value_dtype): what HF's DynamicLayer.update makes
// of its first append, `torch.cat([cache, x], dim=-2)` with the cache the 1-D empty tensor its
// lazy initialization made (skipped by cat but for its dtype): a fresh tensor of x's values in
// the promoted dtype, row-major (cat's memory format: the 1-D empty cache suggests the
// contiguous format, which then decides it whatever x's layout).
// Out of place (torch.func's transforms take it where the C++ Function cannot run).
at::Tensor fresh_copy(const at::Tensor& x, at::ScalarType dtype) {
  return x.to(x.options().dtype(dtype), /*non_blocking=*/false, /*copy=*/true,
              at::MemoryFormat::Contiguous);
}

std::tuple<at::Tensor, at::Tensor> kv_copy_stock(const at::Tensor& key, const at::Tensor& value,
                                                 at::ScalarType key_dtype,
                                                 at::ScalarType value_dtype) {
  return {fresh_copy(key, key_dtype), fresh_copy(value, value_dtype)};
}

// Each tensor is its own call to Rust (K and V may differ in dtype: under autocast K is fp32
// after HF's rotary and V bf16, promoted by the cat).
at::Tensor kv_copy_one(const at::Tensor& x, at::ScalarType dtype) {
  TfRotaryCall call{};
  call.q = describe(x);
  call.x_dtype = static_cast<int16_t>(dtype);
  return fused_or_stock(TF_ENTRY_KV_COPY, x, call, [&] { return fresh_copy(x, dtype); });
}

std::tuple<at::Tensor, at::Tensor> kv_copy_cuda(const at::Tensor& key, const at::Tensor& value,
                                                at::ScalarType key_dtype,
                                                at::ScalarType value_dtype) {
  return {kv_copy_one(key, key_dtype), kv_copy_one(value, value_dtype)};
}

std::tuple<at::Tensor, at::Tensor> call_kv_copy(const at::Tensor& key, const at::Tensor& value,
                                                at::ScalarType key_dtype,
                                                at::ScalarType value_dtype) {
  static const auto op = own_op<decltype(kv_copy_stock)>("torchfuse::kv_copy");
  return op.call(key, value, key_dtype, value_dtype);
}

// Whether x, a [B, H, S, D] tensor, lies in memory token by token, [B, S, H, D] (HF's K and V:
// a projection's output viewed per head and transposed), gaps allowed (GPT-2's slices of its
// packed projection).
bool in_token_order(const at::Tensor& x) {
  if (x.dim() != 4) return false;
  int64_t span = 1;  // the elements one step of the inner dims covers
  for (const int64_t d : {3, 1, 2, 0}) {  // x's dims from the innermost in that order: D, H, S, B
    if (x.size(d) == 1) continue;
    if (x.stride(d) < span) return false;
    span = x.stride(d) * x.size(d);
  }
  return true;
}

// Whether x's gradient may be handed back token by token: x lies so, and is HF's per-head view
// made by a transpose (or permute) of a view or reshape. That view's backward reshapes the
// gradient to row-major whatever its layout (a copy of stock's, a view of ours), so no op after
// it sees another layout than stock's. Where x is a transpose of a tensor of its own (a norm's
// output, say), that tensor's backward would get the other layout: stock's is kept there.
// Traced or symbolic tensors are not asked (reading a symbolic size would specialize it: an
// export's dynamic dim; the trace keeps stock's ops anyway).
bool undone_by_a_view(const at::Tensor& x) {
  if (traced(x) || x.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || !x.grad_fn() ||
      !in_token_order(x))
    return false;
  const auto& node = x.grad_fn();
  const std::string name = node->name();
  if ((name != "TransposeBackward0" && name != "PermuteBackward0") || node->num_inputs() != 1 ||
      node->next_edges().size() != 1)
    return false;
  const auto& next = node->next_edge(0).function;
  if (!next) return false;
  const std::string next_name = next->name();
  return next_name == "ViewBackward0" || next_name == "UnsafeViewBackward0" ||
         next_name == "ReshapeAliasBackward0";
}

// The saved data KvCopyFunction's forward leaves its backward, by input (`key`, `value`).
std::string saved_dtype(const std::string& input) { return input + "_dtype"; }
std::string saved_token_order(const std::string& input) { return input + "_in_token_order"; }

class KvCopyFunction : public torch::autograd::Function<KvCopyFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& key, const at::Tensor& value,
                                                at::ScalarType key_dtype,
                                                at::ScalarType value_dtype) {
    for (const auto& [input, x] : {std::pair<std::string, const at::Tensor&>{"key", key},
                                   std::pair<std::string, const at::Tensor&>{"value", value}}) {
      ctx->saved_data[saved_dtype(input)] = static_cast<int64_t>(x.scalar_type());
      ctx->saved_data[saved_token_order(input)] = undone_by_a_view(x);
    }
    ctx->set_materialize_grads(false);
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [k, v] = call_kv_copy(key, value, key_dtype, value_dtype);
    torch::autograd::variable_list constant;
    if (!key.requires_grad()) constant.push_back(k);
    if (!value.requires_grad()) constant.push_back(v);
    ctx->mark_non_differentiable(constant);
    return {k, v};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto back = [&](const at::Tensor& g, const std::string& input) {
      if (!g.defined()) return g;
      const auto to = static_cast<at::ScalarType>(ctx->saved_data[saved_dtype(input)].toInt());
      if (g.scalar_type() != to) return g.to(to);
      const bool token_order = ctx->saved_data[saved_token_order(input)].toBool();
      if (!token_order || at::GradMode::is_enabled() || !g.is_cuda() || traced(g) ||
          in_token_order(g))
        return g;
      return kv_copy_one(g.transpose(1, 2), to).transpose(1, 2);
    };
    return {back(grads[0], "key"), back(grads[1], "value"), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> kv_copy_autograd(const at::Tensor& key, const at::Tensor& value,
                                                    at::ScalarType key_dtype,
                                                    at::ScalarType value_dtype) {
  if (composition_only({key, value})) return kv_copy_stock(key, value, key_dtype, value_dtype);
  auto outputs = KvCopyFunction::apply(key, value, key_dtype, value_dtype);
  return {outputs[0], outputs[1]};
}

}  // namespace

void copy_rows_into(const at::Tensor& x, const at::Tensor& out) {
  TfRotaryCall call{};
  // Written: a copy-on-write view gets its own memory first, as stock's write gives it.
  call.out = describe(out, /*written=*/true);
  call.q = describe(x);
  call.x_dtype = static_cast<int16_t>(out.scalar_type());
  TfOutputs written{};
  if (!fused_by_rust(TF_ENTRY_KV_COPY, x, call, written)) out.copy_(x);
}

bool register_rotary(uint32_t entry, const char* /*name*/, torch::Library* /*aten*/) {
  using c10::DispatchKey;
  switch (entry) {
    case TF_ENTRY_ROTARY:
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("rotary", TORCH_FN(rotary_stock));
      torchfuse_impl(DispatchKey::CUDA).impl("rotary", TORCH_FN(rotary_cuda));
      torchfuse_impl(DispatchKey::Meta).impl("rotary", TORCH_FN(rotary_meta));
      torchfuse_impl(DispatchKey::Autograd).impl("rotary", TORCH_FN(rotary_autograd));
      return true;
    case TF_ENTRY_ROTARY_BACKWARD:
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("rotary_backward", TORCH_FN(rotary_backward_stock));
      torchfuse_impl(DispatchKey::CUDA)
          .impl("rotary_backward", TORCH_FN(rotary_backward_cuda));
      torchfuse_impl(DispatchKey::Meta)
          .impl("rotary_backward", TORCH_FN(rotary_backward_meta));
      return true;
    case TF_ENTRY_KV_COPY:
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("kv_copy", TORCH_FN(kv_copy_stock));
      torchfuse_impl(DispatchKey::CUDA).impl("kv_copy", TORCH_FN(kv_copy_cuda));
      torchfuse_impl(DispatchKey::Autograd).impl("kv_copy", TORCH_FN(kv_copy_autograd));
      return true;
    default: return false;
  }
}

}  // namespace torchfuse_glue
