// LayerNorm and RMSNorm: aten's native_layer_norm and _fused_rms_norm (forward, backward), and
// torchfuse::hf_rms_norm (HF's RMSNorm, decided by Rust, run by aten::rms_norm).
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
    default: return false;
  }
}

}  // namespace torchfuse_glue
