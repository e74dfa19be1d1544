// LayerNorm and RMSNorm: aten's native_layer_norm and _fused_rms_norm (forward, backward),
// torchfuse::hf_rms_norm (HF's RMSNorm, decided by Rust, run by aten::rms_norm), and
// torchfuse::norm_cast[_backward] (a norm whose output is written in the dtype its consumers
// cast it to).
#include "glue.h"

namespace torchfuse_glue {
namespace {

TfNormCall norm_call(const at::Tensor& input, at::IntArrayRef normalized_shape,
                     const std::optional<at::Tensor>& weight) {
  TfNormCall call{};
  call.input = describe(input);
  call.weight = describe(weight);
  call.normalized_shape = normalized_shape.data();
  call.normalized_ndim = normalized_shape.size();
  return call;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> native_layer_norm(
    const at::Tensor& input, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps) {
  TfNormCall call = norm_call(input, normalized_shape, weight);
  call.bias = describe(bias);
  call.eps = eps;
  call.has_eps = 1;
  return fused_or_stock(TF_ENTRY_NATIVE_LAYER_NORM, input, call, [&] {
    return at::cuda::native_layer_norm(input, normalized_shape, weight, bias, eps);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> native_layer_norm_backward(
    const at::Tensor& grad_out, const at::Tensor& input, at::IntArrayRef normalized_shape,
    const at::Tensor& mean, const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, std::array<bool, 3> output_mask) {
  TfNormCall call = norm_call(input, normalized_shape, weight);
  call.bias = describe(bias);
  call.grad_out = describe(grad_out);
  call.mean = describe(mean);
  call.rstd = describe(rstd);
  call.output_mask = mask_bits(output_mask);
  return fused_or_stock(TF_ENTRY_NATIVE_LAYER_NORM_BACKWARD, input, call, [&] {
    return at::cuda::native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd,
                                                weight, bias, output_mask);
  });
}

std::tuple<at::Tensor, at::Tensor> fused_rms_norm(const at::Tensor& input,
                                                  at::IntArrayRef normalized_shape,
                                                  const std::optional<at::Tensor>& weight,
                                                  std::optional<double> eps) {
  TfNormCall call = norm_call(input, normalized_shape, weight);
  call.eps = eps.value_or(0.0);
  call.has_eps = eps.has_value();
  return fused_or_stock(TF_ENTRY_FUSED_RMS_NORM, input, call, [&] {
    return at::cuda::_fused_rms_norm(input, normalized_shape, weight, eps);
  });
}

std::tuple<at::Tensor, at::Tensor> fused_rms_norm_backward(
    const at::Tensor& grad_out, const at::Tensor& input, at::IntArrayRef normalized_shape,
    const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
    std::array<bool, 2> output_mask) {
  TfNormCall call = norm_call(input, normalized_shape, weight);
  call.grad_out = describe(grad_out);
  call.rstd = describe(rstd);
  call.output_mask = mask_bits(output_mask);
  return fused_or_stock(TF_ENTRY_FUSED_RMS_NORM_BACKWARD, input, call, [&] {
    return at::cuda::_fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight,
                                              output_mask);
  });
}

// torchfuse::hf_rms_norm(input, weight, eps): HF's RMSNorm (LlamaRMSNorm.forward and its
// copies). Where Rust decides aten::rms_norm computes the same thing, it runs here (autograd is
// then aten's, and an exception raised inside it, such as checkpointing's stop of a recompute,
// reaches the caller as it is); otherwise HF's composition runs op for op, as the Python code
// would.
at::Tensor hf_rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  if (input.is_cuda() && !traced(input) && !traced(weight)) {
    TfNormCall call{};
    call.input = describe(input);
    call.weight = describe(weight);
    call.eps = eps;
    call.has_eps = 1;
    TfOutputs out{};
    if (fused_by_rust(TF_ENTRY_HF_RMS_NORM, input, call, out))
      return at::rms_norm(input, {input.size(-1)}, weight, eps);
  }
  const at::ScalarType input_dtype = input.scalar_type();
  at::Tensor hidden = input.to(at::kFloat);
  const at::Tensor variance = hidden.pow(2).mean(-1, /*keepdim=*/true);
  hidden = hidden * at::rsqrt(variance + eps);
  return weight * hidden.to(input_dtype);
}

at::Tensor call_hf_rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  static const auto op = own_op<decltype(hf_rms_norm)>("torchfuse::hf_rms_norm");
  return op.call(input, weight, eps);
}

// torchfuse::norm_cast(input, weight, bias, eps, rms, dtype): the norm of input over its last
// dim, cast to `dtype`: LayerNorm (F.layer_norm's), or with `rms` HF's RMSNorm as
// torchfuse::hf_rms_norm computes it (a weight, no bias). What a layer's norm becomes under
// bf16 autocast where the layer hands its output only to Linear layers, which would cast it to
// bf16 (python/torchfuse/rewrites.py, `norm_cast`). Rust serves fp32 rows with a bf16 output
// in one pass, and their backward from the bf16 gradient, through NormCastFunction (one
// autograd node, no cast between); otherwise the norm and the cast run as the original's.
//
// norm_of: the norm alone, differentiable (the composition's, and the create_graph backward's).
at::Tensor norm_of(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                   const std::optional<at::Tensor>& bias, double eps, bool rms) {
  if (!rms) return at::layer_norm_symint(input, {input.sym_size(-1)}, weight, bias, eps);
  TORCH_CHECK(weight.has_value() && weight->defined() && !(bias.has_value() && bias->defined()),
              "torchfuse::norm_cast: HF's RMSNorm takes a weight and no bias");
  return call_hf_rms_norm(input, *weight, eps);
}

at::Tensor norm_then_cast(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                          const std::optional<at::Tensor>& bias, double eps, bool rms,
                          at::ScalarType dtype) {
  return norm_of(input, weight, bias, eps, rms).to(dtype);
}

TfNormCall norm_cast_call(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                          const std::optional<at::Tensor>& bias, double eps, bool rms,
                          at::ScalarType y_dtype) {
  TfNormCall call{};
  call.input = describe(input);
  call.weight = describe(weight);
  call.bias = describe(bias);
  call.eps = eps;
  call.has_eps = 1;
  call.rms = rms;
  call.y_dtype = static_cast<int16_t>(y_dtype);
  return call;
}

// The forward Rust served (y, mean for LayerNorm, rstd), or all undefined where the norm and
// the cast must run composed (a trace's fake tensors: the composition).
std::array<at::Tensor, 3> norm_cast_served(const at::Tensor& input,
                                           const std::optional<at::Tensor>& weight,
                                           const std::optional<at::Tensor>& bias, double eps,
                                           bool rms, at::ScalarType dtype) {
  TfOutputs out{};
  if (traced(input) ||
      !fused_by_rust(TF_ENTRY_NORM_CAST, input,
                     norm_cast_call(input, weight, bias, eps, rms, dtype), out))
    return {};
  return take_outputs(out);
}

// torchfuse::norm_cast_backward(grad_out, input, mean, rstd, weight, bias, rms, output_mask):
// dx, dweight, dbias (each where output_mask's bit asks; RMSNorm has no dbias) of the norm
// whose output was cast, from the gradient in the output's dtype: stock's norm backward of that
// gradient widened to x's dtype, which is what the original's cast passes back.
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_cast_backward_stock(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& mean,
    const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, bool rms, int64_t output_mask) {
  const at::Tensor dy = grad_out.to(input.scalar_type());
  auto bit = [&](int i) { return (output_mask >> i & 1) != 0; };
  if (rms && input.is_cuda()) {
    auto [dx, dw] =
        at::_fused_rms_norm_backward(dy, input, {input.size(-1)}, rstd, weight, {bit(0), bit(1)});
    return {dx, dw, at::Tensor()};
  }
  if (rms) {
    // Elsewhere (aten's fused backward is CUDA's only): dx = rstd (g - xhat mean(g xhat)),
    // g = dy w; dweight = the sum of dy xhat over the rows.
    const at::Tensor xhat = input * rstd;
    const at::Tensor g = weight.has_value() && weight->defined() ? dy * *weight : dy;
    const at::Tensor dx =
        bit(0) ? rstd * (g - xhat * (g * xhat).mean(-1, /*keepdim=*/true)) : at::Tensor();
    const at::Tensor dw =
        bit(1) ? (dy * xhat).reshape({-1, input.size(-1)}).sum(0) : at::Tensor();
    return {dx, dw, at::Tensor()};
  }
  TORCH_CHECK(mean.has_value() && mean->defined(),
              "torchfuse::norm_cast_backward: LayerNorm's backward takes the mean");
  return at::native_layer_norm_backward(dy, input, {input.size(-1)}, *mean, rstd, weight, bias,
                                        {bit(0), bit(1), bit(2)});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_cast_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& mean,
    const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, bool rms, int64_t output_mask) {
  TfNormCall call =
      norm_cast_call(input, weight, bias, 0.0, rms, grad_out.scalar_type());
  call.grad_out = describe(grad_out);
  call.mean = describe(mean);
  call.rstd = describe(rstd);
  call.output_mask = static_cast<uint32_t>(output_mask);
  return fused_or_stock(TF_ENTRY_NORM_CAST_BACKWARD, input, call, [&] {
    return norm_cast_backward_stock(grad_out, input, mean, rstd, weight, bias, rms,
                                    output_mask);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_norm_cast_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& mean,
    const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, bool rms, int64_t output_mask) {
  static const auto op =
      own_op<decltype(call_norm_cast_backward)>("torchfuse::norm_cast_backward");
  return op.call(grad_out, input, mean, rstd, weight, bias, rms, output_mask);
}

std::optional<at::Tensor> given(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

class NormCastFunction : public torch::autograd::Function<NormCastFunction> {
 public:
  // `y`, `mean` (LayerNorm) and `rstd` are the outputs of the forward Rust served. An absent
  // weight or bias (and RMSNorm's mean) comes as an empty tensor, `has_weight`/`has_bias`
  // false: a Function's tensor arguments must be defined (apply reads each one's device).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& bias,
                            const at::Tensor& y, const at::Tensor& mean, const at::Tensor& rstd,
                            double eps, bool rms, bool has_weight, bool has_bias) {
    ctx->save_for_backward({input, has_weight ? weight : at::Tensor(),
                            has_bias ? bias : at::Tensor(), rms ? at::Tensor() : mean, rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["rms"] = rms;
    // Not `y` itself: an input returned as it is would be a view (see CrossEntropyFunction).
    return y.detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1], &bias = saved[2];
    const bool rms = ctx->saved_data["rms"].toBool();
    torch::autograd::variable_list out(10);
    if (!grads[0].defined()) return out;
    const std::array<bool, 3> wanted = {ctx->needs_input_grad(0),
                                        weight.defined() && ctx->needs_input_grad(1),
                                        bias.defined() && ctx->needs_input_grad(2)};
    if (at::GradMode::is_enabled()) {
      // create_graph: the gradient must itself be differentiable, which the fused one is not.
      // The norm again from the saved inputs, and autograd's gradient of it at the gradient
      // widened as the original's cast widens it.
      const at::Tensor y =
          norm_of(input, given(weight), given(bias), ctx->saved_data["eps"].toDouble(), rms);
      torch::autograd::variable_list of;
      for (size_t i = 0; i < 3; ++i)
        if (wanted[i]) of.push_back(saved[i]);
      const auto grads_of = torch::autograd::grad({y}, of, {grads[0].to(y.scalar_type())},
                                                  /*retain_graph=*/true, /*create_graph=*/true,
                                                  /*allow_unused=*/true);
      for (size_t i = 0, k = 0; i < 3; ++i)
        if (wanted[i]) out[i] = grads_of[k++];
      return out;
    }
    auto [dx, dw, db] = call_norm_cast_backward(grads[0], input, given(saved[3]), saved[4],
                                                given(weight), given(bias), rms,
                                                mask_bits(wanted));
    out[0] = dx;
    out[1] = dw;
    out[2] = db;
    return out;
  }
};

at::Tensor norm_cast_autograd(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& bias, double eps, bool rms,
                              at::ScalarType dtype) {
  const at::Tensor w = weight.value_or(at::Tensor()), b = bias.value_or(at::Tensor());
  if (!input.is_cuda() || composition_only({input, w, b}))
    return norm_then_cast(input, weight, bias, eps, rms, dtype);
  auto [y, mean, rstd] = norm_cast_served(input, weight, bias, eps, rms, dtype);
  if (!y.defined()) return norm_then_cast(input, weight, bias, eps, rms, dtype);
  const bool differentiable =
      at::GradMode::is_enabled() && (input.requires_grad() || (w.defined() && w.requires_grad()) ||
                                     (b.defined() && b.requires_grad()));
  if (!differentiable) return y;
  const at::Tensor none = at::empty({0}, input.options());
  return NormCastFunction::apply(input, w.defined() ? w : none, b.defined() ? b : none, y,
                                 mean.defined() ? mean : none, rstd, eps, rms, w.defined(),
                                 b.defined());
}

// Below autograd (inference mode): the fused forward where Rust serves it.
at::Tensor norm_cast_cuda(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                          const std::optional<at::Tensor>& bias, double eps, bool rms,
                          at::ScalarType dtype) {
  at::Tensor y = norm_cast_served(input, weight, bias, eps, rms, dtype)[0];
  return y.defined() ? y : norm_then_cast(input, weight, bias, eps, rms, dtype);
}

}  // namespace

bool register_norm(uint32_t entry, const char* name, torch::Library* aten) {
  switch (entry) {
    case TF_ENTRY_NATIVE_LAYER_NORM: aten->impl(name, TORCH_FN(native_layer_norm)); return true;
    case TF_ENTRY_NATIVE_LAYER_NORM_BACKWARD:
      aten->impl(name, TORCH_FN(native_layer_norm_backward));
      return true;
    case TF_ENTRY_FUSED_RMS_NORM: aten->impl(name, TORCH_FN(fused_rms_norm)); return true;
    case TF_ENTRY_FUSED_RMS_NORM_BACKWARD:
      aten->impl(name, TORCH_FN(fused_rms_norm_backward));
      return true;
    case TF_ENTRY_HF_RMS_NORM:
      torchfuse_impl(c10::DispatchKey::CompositeImplicitAutograd)
          .impl("hf_rms_norm", TORCH_FN(hf_rms_norm));
      return true;
    case TF_ENTRY_NORM_CAST:
      torchfuse_impl(c10::DispatchKey::CompositeExplicitAutograd)
          .impl("norm_cast", TORCH_FN(norm_then_cast));
      torchfuse_impl(c10::DispatchKey::CUDA).impl("norm_cast", TORCH_FN(norm_cast_cuda));
      torchfuse_impl(c10::DispatchKey::Autograd).impl("norm_cast", TORCH_FN(norm_cast_autograd));
      return true;
    case TF_ENTRY_NORM_CAST_BACKWARD:
      torchfuse_impl(c10::DispatchKey::CompositeExplicitAutograd)
          .impl("norm_cast_backward", TORCH_FN(norm_cast_backward_stock));
      torchfuse_impl(c10::DispatchKey::CUDA)
          .impl("norm_cast_backward", TORCH_FN(norm_cast_backward_cuda));
      return true;
    default: return false;
  }
}

}  // namespace torchfuse_glue
