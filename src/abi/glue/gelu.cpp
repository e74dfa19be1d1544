// torchfuse::gelu_tanh and its backward.
#include "glue.h"

namespace torchfuse_glue {
namespace {

// torchfuse::gelu_tanh(input, dtype): gelu(input, approximate="tanh") with the output in
// `dtype` (default: the input's), computed in fp32.
at::Tensor gelu_tanh_stock(const at::Tensor& input, std::optional<at::ScalarType> dtype) {
  return at::gelu(input.to(dtype.value_or(input.scalar_type())), "tanh");
}

at::Tensor gelu_tanh_backward_stock(const at::Tensor& grad_out, const at::Tensor& input) {
  return at::gelu_backward(grad_out, input.to(grad_out.scalar_type()), "tanh")
      .to(input.scalar_type());
}

at::Tensor gelu_tanh_cuda(const at::Tensor& input, std::optional<at::ScalarType> dtype) {
  TfGeluCall call{};
  call.input = describe(input);
  call.out_dtype = static_cast<int16_t>(dtype.value_or(input.scalar_type()));
  return fused_or_stock(TF_ENTRY_GELU_TANH, input, call,
                        [&] { return gelu_tanh_stock(input, dtype); });
}

at::Tensor gelu_tanh_backward_cuda(const at::Tensor& grad_out, const at::Tensor& input) {
  TfGeluCall call{};
  call.input = describe(input);
  call.grad_out = describe(grad_out);
  return fused_or_stock(TF_ENTRY_GELU_TANH_BACKWARD, input, call,
                        [&] { return gelu_tanh_backward_stock(grad_out, input); });
}

at::Tensor call_gelu_tanh(const at::Tensor& input, std::optional<at::ScalarType> dtype) {
  static const auto op = own_op<decltype(call_gelu_tanh)>("torchfuse::gelu_tanh");
  return op.call(input, dtype);
}

at::Tensor call_gelu_tanh_backward(const at::Tensor& grad_out, const at::Tensor& input) {
  static const auto op =
      own_op<decltype(call_gelu_tanh_backward)>("torchfuse::gelu_tanh_backward");
  return op.call(grad_out, input);
}

// The gradient goes to the input in the input's dtype (autograd's rule for a cast).
class GeluTanhFunction : public torch::autograd::Function<GeluTanhFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            std::optional<at::ScalarType> dtype) {
    ctx->save_for_backward({input});
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_gelu_tanh(input, dtype);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor input = ctx->get_saved_variables()[0];
    // create_graph: PyTorch's own backward ops, which are differentiable (a double backward).
    const at::Tensor grad = at::GradMode::is_enabled()
                                ? gelu_tanh_backward_stock(grads[0], input)
                                : call_gelu_tanh_backward(grads[0], input);
    return {grad, at::Tensor()};
  }
};

at::Tensor gelu_tanh_autograd(const at::Tensor& input, std::optional<at::ScalarType> dtype) {
  if (composition_only({input})) return gelu_tanh_stock(input, dtype);
  return GeluTanhFunction::apply(input, dtype);
}

}  // namespace

bool register_gelu(uint32_t entry, const char* /*name*/, torch::Library* /*aten*/) {
  using c10::DispatchKey;
  switch (entry) {
    case TF_ENTRY_GELU_TANH:
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("gelu_tanh", TORCH_FN(gelu_tanh_stock));
      torchfuse_impl(DispatchKey::CUDA).impl("gelu_tanh", TORCH_FN(gelu_tanh_cuda));
      torchfuse_impl(DispatchKey::Autograd).impl("gelu_tanh", TORCH_FN(gelu_tanh_autograd));
      return true;
    case TF_ENTRY_GELU_TANH_BACKWARD:
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("gelu_tanh_backward", TORCH_FN(gelu_tanh_backward_stock));
      torchfuse_impl(DispatchKey::CUDA)
          .impl("gelu_tanh_backward", TORCH_FN(gelu_tanh_backward_cuda));
      return true;
    default: return false;
  }
}

}  // namespace torchfuse_glue
