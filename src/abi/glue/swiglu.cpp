// torchfuse::silu_mul (HF's gated MLP between its matmuls), silu_mul_packed (the same of the
// two halves of one tensor: Phi-3's gate_up_proj output), and their backwards.
#include "glue.h"

namespace torchfuse_glue {
namespace {

// torchfuse::silu_mul(gate, up): silu(gate) * up, HF's gated MLP between its matmuls; same
// dtype and shape for both (anything else is stock's, broadcasting included).
at::Tensor silu_mul_stock(const at::Tensor& gate, const at::Tensor& up) {
  return at::silu(gate) * up;
}

// The original's autograd, op for op: mul's backward, then silu's.
std::tuple<at::Tensor, at::Tensor> silu_mul_backward_stock(const at::Tensor& grad_out,
                                                           const at::Tensor& gate,
                                                           const at::Tensor& up) {
  return {at::silu_backward(grad_out * up, gate), grad_out * at::silu(gate)};
}

at::Tensor silu_mul_cuda(const at::Tensor& gate, const at::Tensor& up) {
  TfSwigluCall call{};
  call.gate = describe(gate);
  call.up = describe(up);
  TfOutputs out{};
  if (fused_by_rust(torchfuse_rs_swiglu, TF_ENTRY_SILU_MUL, gate, call, out))
    return take_outputs(out)[0];
  return silu_mul_stock(gate, up);
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward_cuda(const at::Tensor& grad_out,
                                                          const at::Tensor& gate,
                                                          const at::Tensor& up) {
  TfSwigluCall call{};
  call.gate = describe(gate);
  call.up = describe(up);
  call.grad_out = describe(grad_out);
  TfOutputs out{};
  if (fused_by_rust(torchfuse_rs_swiglu, TF_ENTRY_SILU_MUL_BACKWARD, gate, call, out)) {
    auto outputs = take_outputs(out);
    return {outputs[0], outputs[1]};
  }
  return silu_mul_backward_stock(grad_out, gate, up);
}

at::Tensor call_silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  static const auto op = own_op<decltype(call_silu_mul)>("torchfuse::silu_mul");
  return op.call(gate, up);
}

std::tuple<at::Tensor, at::Tensor> call_silu_mul_backward(const at::Tensor& grad_out,
                                                          const at::Tensor& gate,
                                                          const at::Tensor& up) {
  static const auto op =
      own_op<decltype(call_silu_mul_backward)>("torchfuse::silu_mul_backward");
  return op.call(grad_out, gate, up);
}

// Keeps gate and up for the backward (the original also keeps silu(gate)).
class SiluMulFunction : public torch::autograd::Function<SiluMulFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate,
                            const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_silu_mul(gate, up);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &gate = saved[0], &up = saved[1];
    if (at::GradMode::is_enabled()) {
      // create_graph: a differentiable composition (a double backward), as autograd's own
      // formula for silu is under grad mode (silu_backward has no derivative).
      const at::Tensor s = at::sigmoid(gate);
      return {grads[0] * up * s * (1 + gate * (1 - s)), grads[0] * (gate * s)};
    }
    auto [dgate, dup] = call_silu_mul_backward(grads[0], gate, up);
    return {dgate, dup};
  }
};

at::Tensor silu_mul_autograd(const at::Tensor& gate, const at::Tensor& up) {
  if (composition_only({gate, up})) return silu_mul_stock(gate, up);
  return SiluMulFunction::apply(gate, up);
}

// torchfuse::silu_mul_packed(gate_up): silu(gate) * up of `gate, up = gate_up.chunk(2, -1)`
// (Phi3MLP and its copies); an odd last dim is chunked unevenly, and broadcasting then fails as
// in the original.
at::Tensor silu_mul_packed_stock(const at::Tensor& gate_up) {
  const auto halves = gate_up.chunk(2, -1);
  return silu_mul_stock(halves[0], halves[1]);
}

// The gradient of gate_up, whole: the original's autograd (mul's, silu's) of each half, then
// chunk's backward, which concatenates them.
at::Tensor silu_mul_packed_backward_stock(const at::Tensor& grad_out, const at::Tensor& gate_up) {
  const auto halves = gate_up.chunk(2, -1);
  auto [dgate, dup] = silu_mul_backward_stock(grad_out, halves[0], halves[1]);
  return at::cat({dgate, dup}, -1);
}

at::Tensor silu_mul_packed_cuda(const at::Tensor& gate_up) {
  TfSwigluCall call{};
  call.gate = describe(gate_up);
  TfOutputs out{};
  if (fused_by_rust(torchfuse_rs_swiglu, TF_ENTRY_SILU_MUL_PACKED, gate_up, call, out))
    return take_outputs(out)[0];
  return silu_mul_packed_stock(gate_up);
}

at::Tensor silu_mul_packed_backward_cuda(const at::Tensor& grad_out, const at::Tensor& gate_up) {
  TfSwigluCall call{};
  call.gate = describe(gate_up);
  call.grad_out = describe(grad_out);
  TfOutputs out{};
  if (fused_by_rust(torchfuse_rs_swiglu, TF_ENTRY_SILU_MUL_PACKED_BACKWARD, gate_up, call, out))
    return take_outputs(out)[0];
  return silu_mul_packed_backward_stock(grad_out, gate_up);
}

at::Tensor call_silu_mul_packed(const at::Tensor& gate_up) {
  static const auto op = own_op<decltype(call_silu_mul_packed)>("torchfuse::silu_mul_packed");
  return op.call(gate_up);
}

at::Tensor call_silu_mul_packed_backward(const at::Tensor& grad_out, const at::Tensor& gate_up) {
  static const auto op =
      own_op<decltype(call_silu_mul_packed_backward)>("torchfuse::silu_mul_packed_backward");
  return op.call(grad_out, gate_up);
}

// Keeps gate_up for the backward (the original keeps both halves and silu(gate)).
class SiluMulPackedFunction : public torch::autograd::Function<SiluMulPackedFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate_up) {
    ctx->save_for_backward({gate_up});
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_silu_mul_packed(gate_up);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor gate_up = ctx->get_saved_variables()[0];
    if (at::GradMode::is_enabled()) {
      // create_graph: a differentiable composition (a double backward), as silu_mul's.
      const auto halves = gate_up.chunk(2, -1);
      const at::Tensor &gate = halves[0], &up = halves[1];
      const at::Tensor s = at::sigmoid(gate);
      return {at::cat({grads[0] * up * s * (1 + gate * (1 - s)), grads[0] * (gate * s)}, -1)};
    }
    return {call_silu_mul_packed_backward(grads[0], gate_up)};
  }
};

at::Tensor silu_mul_packed_autograd(const at::Tensor& gate_up) {
  if (composition_only({gate_up})) return silu_mul_packed_stock(gate_up);
  return SiluMulPackedFunction::apply(gate_up);
}

}  // namespace

bool register_swiglu(uint32_t entry, const char* /*name*/) {
  using c10::DispatchKey;
  switch (entry) {
    case TF_ENTRY_SILU_MUL:
      torchfuse_ops().def("silu_mul(Tensor gate, Tensor up) -> Tensor");
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("silu_mul", TORCH_FN(silu_mul_stock));
      torchfuse_impl(DispatchKey::CUDA).impl("silu_mul", TORCH_FN(silu_mul_cuda));
      torchfuse_impl(DispatchKey::Autograd).impl("silu_mul", TORCH_FN(silu_mul_autograd));
      return true;
    case TF_ENTRY_SILU_MUL_BACKWARD:
      torchfuse_ops().def(
          "silu_mul_backward(Tensor grad_out, Tensor gate, Tensor up) -> (Tensor, Tensor)");
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("silu_mul_backward", TORCH_FN(silu_mul_backward_stock));
      torchfuse_impl(DispatchKey::CUDA)
          .impl("silu_mul_backward", TORCH_FN(silu_mul_backward_cuda));
      return true;
    case TF_ENTRY_SILU_MUL_PACKED:
      torchfuse_ops().def("silu_mul_packed(Tensor gate_up) -> Tensor");
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("silu_mul_packed", TORCH_FN(silu_mul_packed_stock));
      torchfuse_impl(DispatchKey::CUDA).impl("silu_mul_packed", TORCH_FN(silu_mul_packed_cuda));
      torchfuse_impl(DispatchKey::Autograd)
          .impl("silu_mul_packed", TORCH_FN(silu_mul_packed_autograd));
      return true;
    case TF_ENTRY_SILU_MUL_PACKED_BACKWARD:
      torchfuse_ops().def("silu_mul_packed_backward(Tensor grad_out, Tensor gate_up) -> Tensor");
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("silu_mul_packed_backward", TORCH_FN(silu_mul_packed_backward_stock));
      torchfuse_impl(DispatchKey::CUDA)
          .impl("silu_mul_packed_backward", TORCH_FN(silu_mul_packed_backward_cuda));
      return true;
    default: return false;
  }
}

}  // namespace torchfuse_glue
