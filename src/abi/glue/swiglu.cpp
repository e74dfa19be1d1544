// torchfuse::silu_mul (HF's gated MLP between its matmuls), silu_mul_packed (the same of the
// two halves of one tensor: Phi-3's gate_up_proj output), gelu_tanh_mul (GeGLU: Gemma's, a
// tanh-GELU gate), and their backwards.
#include "glue.h"

namespace torchfuse_glue {
namespace {

// The gate activations of HF's gated MLPs, as the original code computes them: `act` and its
// backward (autograd's own ops), and `create_graph_grads`, (dgate, dup) as a differentiable
// graph for a double backward, as autograd builds it for the original under grad mode.
struct Silu {
  static constexpr const char* kOp = "torchfuse::silu_mul";
  static constexpr const char* kBackwardOp = "torchfuse::silu_mul_backward";
  static constexpr TfEntry kEntry = TF_ENTRY_SILU_MUL;
  static constexpr TfEntry kBackwardEntry = TF_ENTRY_SILU_MUL_BACKWARD;
  static at::Tensor act(const at::Tensor& g) { return at::silu(g); }
  static at::Tensor act_backward(const at::Tensor& grad, const at::Tensor& g) {
    return at::silu_backward(grad, g);
  }
  // silu_backward has no derivative: autograd's own formula for it under grad mode, in its
  // order; at::silu is differentiable at any order.
  static std::tuple<at::Tensor, at::Tensor> create_graph_grads(const at::Tensor& grad,
                                                               const at::Tensor& g,
                                                               const at::Tensor& up) {
    const at::Tensor s = at::sigmoid(g);
    return {grad * up * s * (1 + g * (1 - s)), grad * act(g)};
  }
};

// Gemma's gelu_pytorch_tanh: F.gelu(approximate="tanh") (kernels/gelu_tanh.cuh's expressions).
struct GeluTanh {
  static constexpr const char* kOp = "torchfuse::gelu_tanh_mul";
  static constexpr const char* kBackwardOp = "torchfuse::gelu_tanh_mul_backward";
  static constexpr TfEntry kEntry = TF_ENTRY_GELU_TANH_MUL;
  static constexpr TfEntry kBackwardEntry = TF_ENTRY_GELU_TANH_MUL_BACKWARD;
  static at::Tensor act(const at::Tensor& g) { return at::gelu(g, "tanh"); }
  static at::Tensor act_backward(const at::Tensor& grad, const at::Tensor& g) {
    return at::gelu_backward(grad, g, "tanh");
  }
  // gelu_backward is differentiable: the original's own ops, fp32 inside as they compute.
  static std::tuple<at::Tensor, at::Tensor> create_graph_grads(const at::Tensor& grad,
                                                               const at::Tensor& g,
                                                               const at::Tensor& up) {
    return {act_backward(grad * up, g), grad * act(g)};
  }
};

// torchfuse::silu_mul(gate, up) and gelu_tanh_mul(gate, up): act(gate) * up, HF's gated MLP
// between its matmuls; same dtype and shape for both (anything else is stock's, broadcasting
// included).
template <class Act>
at::Tensor gated_stock(const at::Tensor& gate, const at::Tensor& up) {
  return Act::act(gate) * up;
}

// The original's autograd, op for op: mul's backward, then the activation's.
template <class Act>
std::tuple<at::Tensor, at::Tensor> gated_backward_stock(const at::Tensor& grad_out,
                                                        const at::Tensor& gate,
                                                        const at::Tensor& up) {
  return {Act::act_backward(grad_out * up, gate), grad_out * Act::act(gate)};
}

template <class Act>
at::Tensor gated_cuda(const at::Tensor& gate, const at::Tensor& up) {
  TfSwigluCall call{};
  call.gate = describe(gate);
  call.up = describe(up);
  return fused_or_stock(Act::kEntry, gate, call, [&] { return gated_stock<Act>(gate, up); });
}

template <class Act>
std::tuple<at::Tensor, at::Tensor> gated_backward_cuda(const at::Tensor& grad_out,
                                                       const at::Tensor& gate,
                                                       const at::Tensor& up) {
  TfSwigluCall call{};
  call.gate = describe(gate);
  call.up = describe(up);
  call.grad_out = describe(grad_out);
  return fused_or_stock(Act::kBackwardEntry, gate, call,
                        [&] { return gated_backward_stock<Act>(grad_out, gate, up); });
}

template <class Act>
at::Tensor call_gated(const at::Tensor& gate, const at::Tensor& up) {
  static const auto op = own_op<decltype(gated_stock<Act>)>(Act::kOp);
  return op.call(gate, up);
}

template <class Act>
std::tuple<at::Tensor, at::Tensor> call_gated_backward(const at::Tensor& grad_out,
                                                       const at::Tensor& gate,
                                                       const at::Tensor& up) {
  static const auto op = own_op<decltype(gated_backward_stock<Act>)>(Act::kBackwardOp);
  return op.call(grad_out, gate, up);
}

// Keeps gate and up for the backward (the original also keeps act(gate)).
template <class Act>
class GatedFunction : public torch::autograd::Function<GatedFunction<Act>> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate,
                            const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_gated<Act>(gate, up);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &gate = saved[0], &up = saved[1];
    if (at::GradMode::is_enabled()) {  // create_graph: a differentiable graph
      auto [dgate, dup] = Act::create_graph_grads(grads[0], gate, up);
      return {dgate, dup};
    }
    auto [dgate, dup] = call_gated_backward<Act>(grads[0], gate, up);
    return {dgate, dup};
  }
};

template <class Act>
at::Tensor gated_autograd(const at::Tensor& gate, const at::Tensor& up) {
  if (composition_only({gate, up})) return gated_stock<Act>(gate, up);
  return GatedFunction<Act>::apply(gate, up);
}

// torchfuse::silu_mul_packed(gate_up): silu(gate) * up of `gate, up = gate_up.chunk(2, -1)`
// (Phi3MLP and its copies); an odd last dim is chunked unevenly, and broadcasting then fails as
// in the original.
at::Tensor silu_mul_packed_stock(const at::Tensor& gate_up) {
  const auto halves = gate_up.chunk(2, -1);
  return gated_stock<Silu>(halves[0], halves[1]);
}

// The gradient of gate_up, whole: the original's autograd (mul's, silu's) of each half, then
// chunk's backward, which concatenates them.
at::Tensor silu_mul_packed_backward_stock(const at::Tensor& grad_out, const at::Tensor& gate_up) {
  const auto halves = gate_up.chunk(2, -1);
  auto [dgate, dup] = gated_backward_stock<Silu>(grad_out, halves[0], halves[1]);
  return at::cat({dgate, dup}, -1);
}

at::Tensor silu_mul_packed_cuda(const at::Tensor& gate_up) {
  TfSwigluCall call{};
  call.gate = describe(gate_up);
  return fused_or_stock(TF_ENTRY_SILU_MUL_PACKED, gate_up, call,
                        [&] { return silu_mul_packed_stock(gate_up); });
}

at::Tensor silu_mul_packed_backward_cuda(const at::Tensor& grad_out, const at::Tensor& gate_up) {
  TfSwigluCall call{};
  call.gate = describe(gate_up);
  call.grad_out = describe(grad_out);
  return fused_or_stock(TF_ENTRY_SILU_MUL_PACKED_BACKWARD, gate_up, call,
                        [&] { return silu_mul_packed_backward_stock(grad_out, gate_up); });
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
      // create_graph: a differentiable graph (a double backward), as silu_mul's.
      const auto halves = gate_up.chunk(2, -1);
      auto [dgate, dup] = Silu::create_graph_grads(grads[0], halves[0], halves[1]);
      return {at::cat({dgate, dup}, -1)};
    }
    return {call_silu_mul_packed_backward(grads[0], gate_up)};
  }
};

at::Tensor silu_mul_packed_autograd(const at::Tensor& gate_up) {
  if (composition_only({gate_up})) return silu_mul_packed_stock(gate_up);
  return SiluMulPackedFunction::apply(gate_up);
}

template <class Act>
bool register_gated(const char* name) {
  using c10::DispatchKey;
  torchfuse_impl(DispatchKey::CompositeExplicitAutograd).impl(name, TORCH_FN(gated_stock<Act>));
  torchfuse_impl(DispatchKey::CUDA).impl(name, TORCH_FN(gated_cuda<Act>));
  torchfuse_impl(DispatchKey::Autograd).impl(name, TORCH_FN(gated_autograd<Act>));
  return true;
}

template <class Act>
bool register_gated_backward(const char* name) {
  using c10::DispatchKey;
  torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
      .impl(name, TORCH_FN(gated_backward_stock<Act>));
  torchfuse_impl(DispatchKey::CUDA).impl(name, TORCH_FN(gated_backward_cuda<Act>));
  return true;
}

}  // namespace

bool register_swiglu(uint32_t entry, const char* /*name*/, torch::Library* /*aten*/) {
  using c10::DispatchKey;
  switch (entry) {
    case TF_ENTRY_SILU_MUL: return register_gated<Silu>("silu_mul");
    case TF_ENTRY_SILU_MUL_BACKWARD: return register_gated_backward<Silu>("silu_mul_backward");
    case TF_ENTRY_GELU_TANH_MUL: return register_gated<GeluTanh>("gelu_tanh_mul");
    case TF_ENTRY_GELU_TANH_MUL_BACKWARD:
      return register_gated_backward<GeluTanh>("gelu_tanh_mul_backward");
    case TF_ENTRY_SILU_MUL_PACKED:
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("silu_mul_packed", TORCH_FN(silu_mul_packed_stock));
      torchfuse_impl(DispatchKey::CUDA).impl("silu_mul_packed", TORCH_FN(silu_mul_packed_cuda));
      torchfuse_impl(DispatchKey::Autograd)
          .impl("silu_mul_packed", TORCH_FN(silu_mul_packed_autograd));
      return true;
    case TF_ENTRY_SILU_MUL_PACKED_BACKWARD:
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("silu_mul_packed_backward", TORCH_FN(silu_mul_packed_backward_stock));
      torchfuse_impl(DispatchKey::CUDA)
          .impl("silu_mul_packed_backward", TORCH_FN(silu_mul_packed_backward_cuda));
      return true;
    default: return false;
  }
}

}  // namespace torchfuse_glue
