// aten's _fused_adam_ and _fused_adamw_ (float and tensor learning rates).
#include "glue.h"

namespace torchfuse_glue {
namespace {

// The tensors of one list, each compared with the param at its index.
std::vector<TfTensor> describe_list(at::TensorList list, at::TensorList params) {
  std::vector<TfTensor> tensors;
  tensors.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i)
    tensors.push_back(describe(list[i], true, i < params.size() ? &params[i] : nullptr));
  return tensors;
}

#define TORCHFUSE_ADAM_PARAMS                                                              \
  at::TensorList self, at::TensorList grads, at::TensorList exp_avgs,                      \
      at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList state_steps
#define TORCHFUSE_ADAM_TAIL                                                                \
  double beta1, double beta2, double weight_decay, double eps, bool amsgrad, bool maximize, \
      const std::optional<at::Tensor>&grad_scale, const std::optional<at::Tensor>&found_inf
#define TORCHFUSE_ADAM_ARGS(lr)                                                          \
  self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2, \
      weight_decay, eps, amsgrad, maximize, grad_scale, found_inf

// Hands the step to Rust; true when it ran. `lr_tensor`: the device lr, or null.
bool adam_in_rust(TfEntry entry, bool decoupled, const at::Tensor* lr_tensor,
                  TORCHFUSE_ADAM_PARAMS, double lr, TORCHFUSE_ADAM_TAIL) {
  const at::TensorList lists[6] = {self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                   state_steps};
  std::vector<TfTensor> tensors[6];
  TfAdamCall call{};
  for (size_t i = 0; i < 6; ++i) {
    tensors[i] = describe_list(lists[i], self);
    call.lists[i] = tensors[i].data();
    call.lens[i] = tensors[i].size();
  }
  if (lr_tensor != nullptr) call.lr_tensor = describe(*lr_tensor);
  call.grad_scale = describe(grad_scale);
  call.found_inf = describe(found_inf);
  call.lr = lr;
  call.beta1 = beta1;
  call.beta2 = beta2;
  call.weight_decay = weight_decay;
  call.eps = eps;
  call.decoupled = decoupled;
  call.amsgrad = amsgrad;
  call.maximize = maximize;
  TfOutputs out{};
  if (self.empty() || !self[0].is_cuda()) {
    // Rust still sees the call: it counts it and refuses lists stock would crash on.
    return fused_by_rust(entry, TfLaunch{-1, nullptr}, call, out);
  }
  return fused_by_rust(entry, self[0], call, out);
}

void fused_adam(TORCHFUSE_ADAM_PARAMS, double lr, TORCHFUSE_ADAM_TAIL) {
  if (!adam_in_rust(TF_ENTRY_FUSED_ADAM, false, nullptr, TORCHFUSE_ADAM_ARGS(lr)))
    at::cuda::_fused_adam_(TORCHFUSE_ADAM_ARGS(lr));
}
void fused_adamw(TORCHFUSE_ADAM_PARAMS, double lr, TORCHFUSE_ADAM_TAIL) {
  if (!adam_in_rust(TF_ENTRY_FUSED_ADAMW, true, nullptr, TORCHFUSE_ADAM_ARGS(lr)))
    at::cuda::_fused_adamw_(TORCHFUSE_ADAM_ARGS(lr));
}
// A CPU lr is read on the host, as stock does (its value goes to the float-lr kernel).
void fused_adam_tensor_lr(TORCHFUSE_ADAM_PARAMS, const at::Tensor& lr, TORCHFUSE_ADAM_TAIL) {
  const bool host_lr = lr.is_cpu();
  if (!adam_in_rust(TF_ENTRY_FUSED_ADAM_TENSOR_LR, false, host_lr ? nullptr : &lr,
                    TORCHFUSE_ADAM_ARGS(host_lr ? lr.item<double>() : 0.0)))
    at::cuda::_fused_adam_(TORCHFUSE_ADAM_ARGS(lr));
}
void fused_adamw_tensor_lr(TORCHFUSE_ADAM_PARAMS, const at::Tensor& lr, TORCHFUSE_ADAM_TAIL) {
  const bool host_lr = lr.is_cpu();
  if (!adam_in_rust(TF_ENTRY_FUSED_ADAMW_TENSOR_LR, true, host_lr ? nullptr : &lr,
                    TORCHFUSE_ADAM_ARGS(host_lr ? lr.item<double>() : 0.0)))
    at::cuda::_fused_adamw_(TORCHFUSE_ADAM_ARGS(lr));
}

}  // namespace

bool register_adam(uint32_t entry, const char* name, torch::Library* aten) {
  switch (entry) {
    case TF_ENTRY_FUSED_ADAM: aten->impl(name, TORCH_FN(fused_adam)); return true;
    case TF_ENTRY_FUSED_ADAM_TENSOR_LR: aten->impl(name, TORCH_FN(fused_adam_tensor_lr)); return true;
    case TF_ENTRY_FUSED_ADAMW: aten->impl(name, TORCH_FN(fused_adamw)); return true;
    case TF_ENTRY_FUSED_ADAMW_TENSOR_LR:
      aten->impl(name, TORCH_FN(fused_adamw_tensor_lr));
      return true;
    default: return false;
  }
}

}  // namespace torchfuse_glue
