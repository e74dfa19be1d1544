// Thin marshalling between PyTorch's dispatcher and the Rust core (src/abi/entries.rs).
//
// Every override here does three things only: describe the call to Rust (torchfuse_abi.h,
// the one definition of the boundary), take back the tensors Rust produced, or, when Rust
// answers TF_STOCK, call PyTorch's own CUDA kernel with the unchanged arguments. All decisions
// (enabled?, which kernel?, why stock?) and all logging live in Rust. No C++ exception
// crosses into Rust (every function Rust calls catches and answers TF_ERROR) and no Rust
// panic crosses back (the Rust entry points catch panics and answer TF_STOCK).

#include "torchfuse_abi.h"

#include <ATen/ATen.h>
#include <ATen/CUDAFunctions.h>
#include <ATen/autocast_mode.h>
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice_native.h>
#include <ATen/ops/cross_entropy_loss_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/embedding_compositeexplicitautograd_dispatch.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <c10/core/CPUAllocator.h>
#include <dlfcn.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

// ---------------------------------------------------------------- describing a call

TfTensor absent() { return TfTensor{}; }

// Stock's rule (check_fast_path_restrictions): same sizes, and the same stride on every dim
// of size > 1, so both tensors store their elements in the same order.
bool same_geometry(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes()) return false;
  const auto sizes = a.sizes();
  const auto sa = a.strides();
  const auto sb = b.strides();
  for (size_t d = 0; d < sizes.size(); ++d)
    if (sizes[d] != 1 && sa[d] != sb[d]) return false;
  return true;
}

// `written`: the kernel writes the tensor (its data pointer is the mutable one, which a
// copy-on-write tensor materializes for, as stock's in-place kernels do). `like`: the list's
// reference tensor at this index, or null.
TfTensor describe(const at::Tensor& t, bool written = false, const at::Tensor* like = nullptr) {
  TfTensor f{};
  if (!t.defined()) return f;
  f.handle = &t;
  f.dtype = static_cast<int16_t>(t.scalar_type());
  const bool strided = t.layout() == at::kStrided && !t.is_nested();
  const bool cuda = t.is_cuda();
  f.device = cuda ? static_cast<int16_t>(t.device().index()) : int16_t{-1};
  // Symbolic sizes (a compiler's fake tensor under dynamic shapes): numel() would raise.
  f.symbolic = t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
  if (!strided || f.symbolic) return f;
  f.numel = t.numel();
  // No storage: a torch.func wrapper (grad, vmap) handed to the SDPA backend choice. A Python
  // or functionalization key: a compiler's fake or functional tensor, whose pointer means
  // nothing (and may raise when read).
  const bool readable =
      cuda && t.has_storage() &&
      !t.key_set().has_any(c10::DispatchKeySet(
          {c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
  f.data = !readable ? nullptr : written ? t.data_ptr() : const_cast<void*>(t.const_data_ptr());
  f.dense = t.is_non_overlapping_and_dense();
  f.like_first = like != nullptr && same_geometry(t, *like);
  return f;
}

TfTensor describe(const std::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined()) ? describe(*t) : absent();
}

// PyTorch's current stream on the tensor's device, through the device-generic interface (no
// CUDA headers needed here).
TfLaunch launch_for(const at::Tensor& t) {
  const c10::Stream stream =
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device());
  return TfLaunch{static_cast<int32_t>(t.device().index()), stream.native_handle()};
}

at::Tensor take(void* owned) {
  if (owned == nullptr) return at::Tensor();
  auto* tensor = static_cast<at::Tensor*>(owned);
  at::Tensor t = std::move(*tensor);
  delete tensor;
  return t;
}

// The outputs Rust produced (a null slot is an undefined tensor: an output not requested).
std::array<at::Tensor, 3> take_outputs(TfOutputs& out) {
  return {take(out.tensors[0]), take(out.tensors[1]), take(out.tensors[2])};
}

// Hands one call to Rust on `on`'s device and stream. True: fused, the outputs are in `out`;
// false: stock must run it. Bad input Rust refused is raised here, as PyTorch's error.
template <class Call>
bool fused_by_rust(void (*rust)(uint32_t, const TfLaunch*, const Call*, TfOutputs*, TfStatus*),
                   TfEntry entry, const TfLaunch& launch, const Call& call, TfOutputs& out) {
  TfStatus status;
  status.code = TF_STOCK;
  status.message[0] = '\0';
  rust(entry, &launch, &call, &out, &status);
  status.message[TF_MESSAGE_BYTES - 1] = '\0';
  TORCH_CHECK(status.code != TF_ERROR, status.message);
  return status.code == TF_FUSED;
}

template <class Call>
bool fused_by_rust(void (*rust)(uint32_t, const TfLaunch*, const Call*, TfOutputs*, TfStatus*),
                   TfEntry entry, const at::Tensor& on, const Call& call, TfOutputs& out) {
  const c10::DeviceGuard guard(on.device());
  return fused_by_rust(rust, entry, launch_for(on), call, out);
}

template <size_t N>
uint32_t mask_bits(const std::array<bool, N>& mask) {
  uint32_t bits = 0;
  for (size_t i = 0; i < N; ++i) bits |= mask[i] ? (1u << i) : 0u;
  return bits;
}

// ---------------------------------------------------------------- layer_norm, rms_norm

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
  TfOutputs out{};
  if (fused_by_rust(torchfuse_rs_norm, TF_ENTRY_NATIVE_LAYER_NORM, input, call, out)) {
    auto r = take_outputs(out);
    return {r[0], r[1], r[2]};
  }
  return at::cuda::native_layer_norm(input, normalized_shape, weight, bias, eps);
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
  TfOutputs out{};
  if (fused_by_rust(torchfuse_rs_norm, TF_ENTRY_NATIVE_LAYER_NORM_BACKWARD, input, call, out)) {
    auto r = take_outputs(out);
    return {r[0], r[1], r[2]};
  }
  return at::cuda::native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd,
                                              weight, bias, output_mask);
}

std::tuple<at::Tensor, at::Tensor> fused_rms_norm(const at::Tensor& input,
                                                  at::IntArrayRef normalized_shape,
                                                  const std::optional<at::Tensor>& weight,
                                                  std::optional<double> eps) {
  TfNormCall call = norm_call(input, normalized_shape, weight);
  call.eps = eps.value_or(0.0);
  call.has_eps = eps.has_value();
  TfOutputs out{};
  if (fused_by_rust(torchfuse_rs_norm, TF_ENTRY_FUSED_RMS_NORM, input, call, out)) {
    auto r = take_outputs(out);
    return {r[0], r[1]};
  }
  return at::cuda::_fused_rms_norm(input, normalized_shape, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> fused_rms_norm_backward(
    const at::Tensor& grad_out, const at::Tensor& input, at::IntArrayRef normalized_shape,
    const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
    std::array<bool, 2> output_mask) {
  TfNormCall call = norm_call(input, normalized_shape, weight);
  call.grad_out = describe(grad_out);
  call.rstd = describe(rstd);
  call.output_mask = mask_bits(output_mask);
  TfOutputs out{};
  if (fused_by_rust(torchfuse_rs_norm, TF_ENTRY_FUSED_RMS_NORM_BACKWARD, input, call, out)) {
    auto r = take_outputs(out);
    return {r[0], r[1]};
  }
  return at::cuda::_fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight,
                                            output_mask);
}

// ---------------------------------------------------------------- embedding

at::Tensor embedding(const at::Tensor& weight, const at::Tensor& indices, int64_t padding_idx,
                     bool scale_grad_by_freq, bool sparse) {
  if (weight.is_cuda()) {
    TfEmbeddingCall call{};
    call.weight = describe(weight);
    call.indices = describe(indices);
    TfOutputs out{};
    if (fused_by_rust(torchfuse_rs_embedding, TF_ENTRY_EMBEDDING, weight, call, out))
      return take_outputs(out)[0];
  }
  return at::compositeexplicitautograd::embedding(weight, indices, padding_idx,
                                                  scale_grad_by_freq, sparse);
}

at::Tensor embedding_dense_backward(const at::Tensor& grad_output, const at::Tensor& indices,
                                    int64_t num_weights, int64_t padding_idx,
                                    bool scale_grad_by_freq) {
  if (grad_output.is_cuda()) {
    TfEmbeddingCall call{};
    call.grad = describe(grad_output);
    call.indices = describe(indices);
    call.num_weights = num_weights;
    call.padding_idx = padding_idx;
    call.scale_grad_by_freq = scale_grad_by_freq;
    TfOutputs out{};
    if (fused_by_rust(torchfuse_rs_embedding, TF_ENTRY_EMBEDDING_DENSE_BACKWARD, grad_output,
                      call, out))
      return take_outputs(out)[0];
  }
  return at::cuda::embedding_dense_backward(grad_output, indices, num_weights, padding_idx,
                                            scale_grad_by_freq);
}

// ---------------------------------------------------------------- adam / adamw

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
    return fused_by_rust(torchfuse_rs_adam, entry, TfLaunch{-1, nullptr}, call, out);
  }
  return fused_by_rust(torchfuse_rs_adam, entry, self[0], call, out);
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

// ---------------------------------------------------------------- sdpa

bool default_sdp_backends() {
  const at::Context& ctx = at::globalContext();
  return ctx.userEnabledFlashSDP() && ctx.userEnabledMemEfficientSDP() &&
         ctx.userEnabledMathSDP() && ctx.userEnabledCuDNNSDP();
}

// torch.use_deterministic_algorithms(True) without warn_only: stock's SDPA choice then skips
// cuDNN (its backward is not deterministic) for flash with its deterministic backward.
bool deterministic_required() {
  const at::Context& ctx = at::globalContext();
  return ctx.deterministicAlgorithms() && !ctx.deterministicAlgorithmsWarnOnly();
}

TfAttentionCall attention_call(const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, double dropout_p, bool is_causal,
                               std::optional<double> scale, bool has_mask,
                               bool return_debug_mask) {
  TfAttentionCall call{};
  call.query = describe(query);
  call.key = describe(key);
  call.value = describe(value);
  call.dropout_p = dropout_p;
  call.scale = scale.value_or(0.0);
  call.has_scale = scale.has_value();
  call.is_causal = is_causal;
  call.has_mask = has_mask;
  call.nested = query.is_nested() || key.is_nested() || value.is_nested();
  call.return_debug_mask = return_debug_mask;
  call.default_backends = default_sdp_backends();
  call.deterministic = deterministic_required();
  return call;
}

int64_t sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                   std::optional<double> scale, bool enable_gqa) {
  // Stock's choice first: it applies the user's backend flags and raises stock's errors.
  const int64_t stock = at::native::_fused_sdp_choice_cuda(query, key, value, attn_mask,
                                                           dropout_p, is_causal, scale, enable_gqa);
  if (!query.is_cuda()) return stock;
  constexpr int64_t kFlash = 1;
  TfAttentionCall call = attention_call(query, key, value, dropout_p, is_causal, scale,
                                        attn_mask.has_value() && attn_mask->defined(), false);
  call.stock_choice = stock;
  TfOutputs out{};
  return fused_by_rust(torchfuse_rs_attention, TF_ENTRY_SDP_CHOICE, query, call, out) ? kFlash
                                                                                      : stock;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt, c10::SymInt, at::Tensor,
           at::Tensor, at::Tensor>
flash_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                double dropout_p, bool is_causal, bool return_debug_mask,
                std::optional<double> scale) {
  if (query.is_cuda()) {
    const TfAttentionCall call = attention_call(query, key, value, dropout_p, is_causal, scale,
                                                false, return_debug_mask);
    TfOutputs out{};
    if (fused_by_rust(torchfuse_rs_attention, TF_ENTRY_FLASH_ATTENTION, query, call, out)) {
      auto r = take_outputs(out);
      // The bookkeeping outputs stock's flash returns without dropout: no cumulative lengths,
      // an unused RNG state (unfilled, as ours are: see torchfuse_cxx_empty_unfilled), an
      // empty debug mask.
      const auto unused_u64 = [&](c10::IntArrayRef size) {
        return at::Tensor(at::detail::empty_cuda(size, at::kUInt64, query.device(), std::nullopt));
      };
      return {r[0],
              r[1],
              at::Tensor(),
              at::Tensor(),
              c10::SymInt(query.size(2)),
              c10::SymInt(key.size(2)),
              unused_u64({2}),
              unused_u64({}),
              at::empty({0}, query.options())};
    }
  }
  return at::cuda::_scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                       return_debug_mask, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& cum_seq_q, const at::Tensor& cum_seq_k, int64_t max_q, int64_t max_k,
    double dropout_p, bool is_causal, const at::Tensor& philox_seed,
    const at::Tensor& philox_offset, std::optional<double> scale) {
  if (query.is_cuda() && !cum_seq_q.defined() && !cum_seq_k.defined()) {
    TfAttentionCall call =
        attention_call(query, key, value, dropout_p, is_causal, scale, false, false);
    call.grad_out = describe(grad_out);
    call.output = describe(out);
    call.logsumexp = describe(logsumexp);
    TfOutputs grads{};
    if (fused_by_rust(torchfuse_rs_attention, TF_ENTRY_FLASH_ATTENTION_BACKWARD, query, call,
                      grads)) {
      auto r = take_outputs(grads);
      return {r[0], r[1], r[2]};
    }
  }
  return at::cuda::_scaled_dot_product_flash_attention_backward(
      grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
      is_causal, philox_seed, philox_offset, scale);
}

// ---------------------------------------------------------------- torchfuse's own ops
//
// The ops the Python rewrite layer sends known compositions to. Each is defined here with
// everything torch needs to run it anywhere: a CompositeExplicitAutograd kernel (stock: the
// same function from PyTorch's own ops; also what Meta tensors and torch.compile's fake
// tensors run), the CUDA kernel (Rust serves it, or stock), and autograd, so a C++ program
// gets the same op.

// A tensor whose data torchfuse may not read, or a call a Python dispatch mode watches: a
// Python subclass (fake tensors under torch.compile), a functional or torch.func wrapper, an
// active TorchDispatchMode (FlopCounterMode, make_fx on real tensors), which must see the ops
// the stock composition runs.
bool traced(const at::Tensor& t) {
  return t.key_set().has_any(c10::DispatchKeySet(
             {c10::DispatchKey::Python, c10::DispatchKey::Functionalize,
              c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::FuncTorchBatched})) ||
         c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Python);
}

// Whether torchfuse's C++ autograd Functions cannot take this call, so PyTorch's own ops
// (the original composition) must: a torch.func transform is active (grad, vmap, jacrev: C++
// Functions raise under them), or a tensor carries a forward-mode AD tangent (they have no jvp).
bool composition_only(std::initializer_list<at::Tensor> tensors) {
  // functorch includes its front-mode key in the thread's dispatch keys while any transform's
  // layer is on its stack (its own header needs a JSON library torch does not ship).
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode))
    return true;
  for (const at::Tensor& t : tensors)
    if (t.defined() && t._fw_grad(/*level=*/0).defined()) return true;
  return false;
}

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
  TfOutputs out{};
  if (fused_by_rust(torchfuse_rs_gelu, TF_ENTRY_GELU_TANH, input, call, out))
    return take_outputs(out)[0];
  return gelu_tanh_stock(input, dtype);
}

at::Tensor gelu_tanh_backward_cuda(const at::Tensor& grad_out, const at::Tensor& input) {
  TfGeluCall call{};
  call.input = describe(input);
  call.grad_out = describe(grad_out);
  TfOutputs out{};
  if (fused_by_rust(torchfuse_rs_gelu, TF_ENTRY_GELU_TANH_BACKWARD, input, call, out))
    return take_outputs(out)[0];
  return gelu_tanh_backward_stock(grad_out, input);
}

// torchfuse's own op `name` as a typed handle, for the autograd Functions to call below
// autograd; the signature is the caller's own (`own_op<decltype(call_x)>`), kept in a static:
// one lookup.
template <class Signature>
c10::TypedOperatorHandle<Signature> own_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
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
    if (fused_by_rust(torchfuse_rs_norm, TF_ENTRY_HF_RMS_NORM, input, call, out))
      return at::rms_norm(input, {input.size(-1)}, weight, eps);
  }
  const at::ScalarType input_dtype = input.scalar_type();
  at::Tensor hidden = input.to(at::kFloat);
  const at::Tensor variance = hidden.pow(2).mean(-1, /*keepdim=*/true);
  hidden = hidden * at::rsqrt(variance + eps);
  return weight * hidden.to(input_dtype);
}

// torchfuse::cross_entropy(logits, target, reduction, ignore_index, label_smoothing, dtype):
// PyTorch's cross_entropy of the logits cast to `dtype` (default: theirs), class-index
// targets, no class weights; the gradient goes to the logits in their dtype. Rust serves the
// forward where it can, reading the logits as they are (no cast copy), and then its backward
// through CrossEntropyFunction; otherwise PyTorch's own composition runs, autograd included.
at::Tensor cross_entropy_stock(const at::Tensor& logits, const at::Tensor& target,
                               int64_t reduction, int64_t ignore_index, double label_smoothing,
                               std::optional<at::ScalarType> dtype) {
  return at::cross_entropy_loss(logits.to(dtype.value_or(logits.scalar_type())), target,
                                std::nullopt, reduction, ignore_index, label_smoothing);
}

// The gradient of the logits composed of PyTorch ops (when Rust does not serve a backward whose
// forward it served, and for a double backward: these ops are differentiable in the logits and
// the incoming gradient): g_i (softmax - (1 - e) onehot - e / C) with label smoothing e over C
// classes, 0 where ignored (also where g_i is inf/NaN).
at::Tensor cross_entropy_backward_stock(const at::Tensor& grad_loss, const at::Tensor& logits,
                                        const at::Tensor& target,
                                        const at::Tensor& total_weight, int64_t reduction,
                                        int64_t ignore_index, double label_smoothing) {
  const at::Tensor ignored = target.eq(ignore_index);
  at::Tensor g = grad_loss.to(at::kFloat);
  if (reduction == at::Reduction::Mean) g = g / total_weight;
  g = g.expand({target.size(0)}).masked_fill(ignored, 0.0);  // `none`: one a row already
  at::Tensor grad = at::softmax(logits.to(at::kFloat), 1);
  grad = grad.scatter_add(
      1, target.masked_fill(ignored, 0).unsqueeze(1),
      ignored.logical_not().to(at::kFloat).mul(label_smoothing - 1.0).unsqueeze(1));
  if (label_smoothing != 0.0) grad = grad - label_smoothing / static_cast<double>(logits.size(1));
  return (grad * g.unsqueeze(1)).to(logits.scalar_type());
}

// torchfuse::cross_entropy_bwd(grad_loss, logits, target, lse, total_weight, reduction,
// ignore_index, label_smoothing): the gradient of the logits, from the forward's lse and
// total_weight. Rust serves it on CUDA where it can; otherwise (and on fake tensors) the
// composition above.
at::Tensor cross_entropy_bwd_stock(const at::Tensor& grad_loss, const at::Tensor& logits,
                                   const at::Tensor& target, const at::Tensor& /*lse*/,
                                   const at::Tensor& total_weight, int64_t reduction,
                                   int64_t ignore_index, double label_smoothing) {
  return cross_entropy_backward_stock(grad_loss, logits, target, total_weight, reduction,
                                      ignore_index, label_smoothing);
}

at::Tensor cross_entropy_bwd_cuda(const at::Tensor& grad_loss_in, const at::Tensor& logits,
                                  const at::Tensor& target, const at::Tensor& lse,
                                  const at::Tensor& total_weight, int64_t reduction,
                                  int64_t ignore_index, double label_smoothing) {
  const at::Tensor grad_loss = grad_loss_in.contiguous();
  TfCrossEntropyCall call{};
  call.logits = describe(logits);
  call.target = describe(target);
  call.grad_loss = describe(grad_loss);
  call.lse = describe(lse);
  call.total_weight = describe(total_weight);
  call.ignore_index = ignore_index;
  call.label_smoothing = label_smoothing;
  call.reduction = static_cast<int32_t>(reduction);
  TfOutputs out{};
  if (fused_by_rust(torchfuse_rs_cross_entropy, TF_ENTRY_CROSS_ENTROPY_BACKWARD, logits, call,
                    out))
    return take_outputs(out)[0];
  return cross_entropy_backward_stock(grad_loss, logits, target, total_weight, reduction,
                                      ignore_index, label_smoothing);
}

// Its shape on meta and fake tensors (symbolic sizes included): the logits'.
at::Tensor cross_entropy_bwd_meta(const at::Tensor& /*grad_loss*/, const at::Tensor& logits,
                                  const at::Tensor& /*target*/, const at::Tensor& /*lse*/,
                                  const at::Tensor& /*total_weight*/, int64_t /*reduction*/,
                                  int64_t /*ignore_index*/, double /*label_smoothing*/) {
  return at::empty_symint(logits.sym_sizes(), logits.options());
}

at::Tensor call_cross_entropy_bwd(const at::Tensor& grad_loss, const at::Tensor& logits,
                                  const at::Tensor& target, const at::Tensor& lse,
                                  const at::Tensor& total_weight, int64_t reduction,
                                  int64_t ignore_index, double label_smoothing) {
  static const auto op =
      own_op<decltype(call_cross_entropy_bwd)>("torchfuse::cross_entropy_bwd");
  return op.call(grad_loss, logits, target, lse, total_weight, reduction, ignore_index,
                 label_smoothing);
}

// torchfuse::cross_entropy_fwd(logits, target, reduction, ignore_index, label_smoothing,
// dtype) -> (loss, lse, total_weight): the forward a compiled graph calls (the loss in `dtype`,
// the fp32 log-sum-exp a row, the fp32 count of rows not ignored; 0 for `none`). Rust serves
// it on CUDA; where it does not at run time (switched off since the trace, a failure), and on
// fake tensors, PyTorch's loss with the log-sum-exp computed beside it.
using CrossEntropyOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

CrossEntropyOutputs cross_entropy_fwd_stock(const at::Tensor& logits, const at::Tensor& target,
                                            int64_t reduction, int64_t ignore_index,
                                            double label_smoothing, at::ScalarType dtype) {
  const at::Tensor loss =
      cross_entropy_stock(logits, target, reduction, ignore_index, label_smoothing, dtype);
  const at::Tensor lse = at::logsumexp(logits.to(at::kFloat), {1});
  const at::Tensor total_weight = reduction == at::Reduction::None
                                      ? at::zeros({}, logits.options().dtype(at::kFloat))
                                      : target.ne(ignore_index).sum().to(at::kFloat);
  return {loss, lse, total_weight};
}

CrossEntropyOutputs cross_entropy_fwd_cuda(const at::Tensor& logits, const at::Tensor& target,
                                           int64_t reduction, int64_t ignore_index,
                                           double label_smoothing, at::ScalarType dtype) {
  TfCrossEntropyCall call{};
  call.logits = describe(logits);
  call.target = describe(target);
  call.ignore_index = ignore_index;
  call.label_smoothing = label_smoothing > 0.0 ? label_smoothing : 0.0;
  call.reduction = static_cast<int32_t>(reduction);
  call.out_dtype = static_cast<int16_t>(dtype);
  TfOutputs out{};
  if (!traced(logits) &&
      fused_by_rust(torchfuse_rs_cross_entropy, TF_ENTRY_CROSS_ENTROPY, logits, call, out)) {
    auto [loss, lse, total_weight] = take_outputs(out);
    return {loss, lse, total_weight};
  }
  return cross_entropy_fwd_stock(logits, target, reduction, ignore_index, label_smoothing,
                                 dtype);
}

// Its shapes on meta and fake tensors (symbolic sizes included), as both paths above give.
CrossEntropyOutputs cross_entropy_fwd_meta(const at::Tensor& logits, const at::Tensor& /*target*/,
                                           int64_t reduction, int64_t /*ignore_index*/,
                                           double /*label_smoothing*/, at::ScalarType dtype) {
  const c10::SymInt rows = logits.sym_size(0);
  const at::TensorOptions fp32 = logits.options().dtype(at::kFloat);
  const at::Tensor loss = reduction == at::Reduction::None
                              ? at::empty_symint({rows}, logits.options().dtype(dtype))
                              : at::empty({}, logits.options().dtype(dtype));
  return {loss, at::empty_symint({rows}, fp32), at::empty({}, fp32)};
}

CrossEntropyOutputs call_cross_entropy_fwd(const at::Tensor& logits, const at::Tensor& target,
                                           int64_t reduction, int64_t ignore_index,
                                           double label_smoothing, at::ScalarType dtype) {
  static const auto op =
      own_op<decltype(call_cross_entropy_fwd)>("torchfuse::cross_entropy_fwd");
  return op.call(logits, target, reduction, ignore_index, label_smoothing, dtype);
}

class CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
 public:
  // `loss`, `lse` and `total_weight` are the outputs of the forward Rust served.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& target, const at::Tensor& loss,
                            const at::Tensor& lse, const at::Tensor& total_weight,
                            int64_t reduction, int64_t ignore_index, double label_smoothing) {
    ctx->save_for_backward({logits, target, lse, total_weight});
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    // Not `loss` itself: an input returned as it is becomes a view autograd forbids in-place
    // changes to (`loss *= scale`), which stock's loss allows.
    return loss.detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &logits = saved[0], &target = saved[1], &lse = saved[2],
                     &total_weight = saved[3];
    const int64_t reduction = ctx->saved_data["reduction"].toInt();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const double label_smoothing = ctx->saved_data["label_smoothing"].toDouble();
    // create_graph: the gradient must itself be differentiable, which the fused one is not.
    // Otherwise through torchfuse::cross_entropy_bwd, which a compiled graph records.
    const at::Tensor grad_logits =
        at::GradMode::is_enabled()
            ? cross_entropy_backward_stock(grads[0], logits, target, total_weight, reduction,
                                           ignore_index, label_smoothing)
            : call_cross_entropy_bwd(grads[0], logits, target, lse, total_weight, reduction,
                                     ignore_index, label_smoothing);
    return {grad_logits, at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The loss (with CrossEntropyFunction's autograd where the logits need a gradient) when Rust
// serves the forward; an undefined tensor when stock must run the call.
at::Tensor cross_entropy_served(TfEntry entry, const at::Tensor& logits, const at::Tensor& target,
                                int64_t reduction, int64_t ignore_index, double label_smoothing,
                                at::ScalarType loss_dtype) {
  if (!logits.is_cuda() || traced(logits) || traced(target) || composition_only({logits}))
    return at::Tensor();
  // Stock smooths only where label_smoothing > 0: a negative or NaN one is none at all.
  if (!(label_smoothing > 0.0)) label_smoothing = 0.0;
  TfCrossEntropyCall call{};
  call.logits = describe(logits);
  call.target = describe(target);
  call.ignore_index = ignore_index;
  call.label_smoothing = label_smoothing;
  call.reduction = static_cast<int32_t>(reduction);
  call.out_dtype = static_cast<int16_t>(loss_dtype);
  TfOutputs out{};
  if (!fused_by_rust(torchfuse_rs_cross_entropy, entry, logits, call, out)) return at::Tensor();
  auto [loss, lse, total_weight] = take_outputs(out);
  if (!(at::GradMode::is_enabled() && logits.requires_grad())) return loss;
  return CrossEntropyFunction::apply(logits, target, loss, lse, total_weight, reduction,
                                     ignore_index, label_smoothing);
}

// The dtype of stock's cross-entropy loss of these logits: under CUDA autocast nll_loss (on
// autocast's fp32 list) makes a 16-bit logits' loss fp32; otherwise the logits' dtype.
at::ScalarType loss_dtype_under_autocast(const at::Tensor& logits) {
  const at::ScalarType t = logits.scalar_type();
  const bool widened = at::autocast::is_autocast_enabled(c10::DeviceType::CUDA) &&
                       (t == at::kBFloat16 || t == at::kHalf);
  return widened ? at::kFloat : t;
}

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& target, int64_t reduction,
                         int64_t ignore_index, double label_smoothing,
                         std::optional<at::ScalarType> dtype) {
  at::Tensor loss = cross_entropy_served(TF_ENTRY_CROSS_ENTROPY, logits, target, reduction,
                                         ignore_index, label_smoothing,
                                         dtype.value_or(loss_dtype_under_autocast(logits)));
  if (loss.defined()) return loss;
  return cross_entropy_stock(logits, target, reduction, ignore_index, label_smoothing, dtype);
}

// A compiler's trace (static sizes) of a call Rust would serve: the graph gets
// torchfuse::cross_entropy_fwd, and CrossEntropyFunction's backward torchfuse::cross_entropy_bwd,
// which run Rust's kernels at run time, in place of PyTorch's decomposition (Inductor's own
// kernels for it were measured slower). An undefined tensor: the decomposition is traced.
at::Tensor cross_entropy_traced(const at::Tensor& logits, const at::Tensor& target,
                                int64_t reduction, int64_t ignore_index, double label_smoothing,
                                at::ScalarType loss_dtype) {
  if (!logits.is_cuda()) return at::Tensor();
  if (!(label_smoothing > 0.0)) label_smoothing = 0.0;
  TfCrossEntropyCall call{};
  call.logits = describe(logits);
  call.target = describe(target);
  call.ignore_index = ignore_index;
  call.label_smoothing = label_smoothing;
  call.reduction = static_cast<int32_t>(reduction);
  call.out_dtype = static_cast<int16_t>(loss_dtype);
  call.plan_only = 1;
  TfOutputs out{};
  if (!fused_by_rust(torchfuse_rs_cross_entropy, TF_ENTRY_CROSS_ENTROPY, logits, call, out))
    return at::Tensor();
  CrossEntropyOutputs outputs;
  {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    outputs = call_cross_entropy_fwd(logits, target, reduction, ignore_index, label_smoothing,
                                     loss_dtype);
  }
  auto& [loss, lse, total_weight] = outputs;
  if (!(at::GradMode::is_enabled() && logits.requires_grad())) return loss;
  return CrossEntropyFunction::apply(logits, target, loss, lse, total_weight, reduction,
                                     ignore_index, label_smoothing);
}

// torchfuse::cross_entropy at the Autograd key: the composition under torch.func and forward
// AD, the op pair in a compiler's trace where Rust would serve, and otherwise `cross_entropy`.
at::Tensor cross_entropy_autograd(const at::Tensor& logits, const at::Tensor& target,
                                  int64_t reduction, int64_t ignore_index,
                                  double label_smoothing, std::optional<at::ScalarType> dtype) {
  if (composition_only({logits}))
    return cross_entropy_stock(logits, target, reduction, ignore_index, label_smoothing, dtype);
  if (traced(logits) || traced(target)) {
    const at::Tensor loss =
        cross_entropy_traced(logits, target, reduction, ignore_index, label_smoothing,
                             dtype.value_or(loss_dtype_under_autocast(logits)));
    if (loss.defined()) return loss;
    return cross_entropy_stock(logits, target, reduction, ignore_index, label_smoothing, dtype);
  }
  return cross_entropy(logits, target, reduction, ignore_index, label_smoothing, dtype);
}

// aten::cross_entropy_loss, at AutogradCUDA (the op is CompositeImplicitAutograd: this kernel
// takes CUDA calls from any caller before PyTorch decomposes them into log_softmax + nll_loss,
// which is what runs when Rust does not serve, class weights included). The op has no CUDA
// autocast kernel, but nll_loss is on autocast's fp32 list: under autocast stock's loss of
// 16-bit logits is fp32, and so is ours (stock's log-probabilities stay 16-bit; ours are fp32).
at::Tensor aten_cross_entropy_loss(const at::Tensor& self, const at::Tensor& target,
                                   const std::optional<at::Tensor>& weight, int64_t reduction,
                                   c10::SymInt ignore_index, double label_smoothing) {
  const std::optional<int64_t> ignore = ignore_index.maybe_as_int();
  if (!(weight.has_value() && weight->defined()) && ignore.has_value()) {
    at::Tensor loss =
        cross_entropy_served(TF_ENTRY_CROSS_ENTROPY_LOSS, self, target, reduction, *ignore,
                             label_smoothing, loss_dtype_under_autocast(self));
    if (loss.defined()) return loss;
  }
  return at::compositeimplicitautograd::cross_entropy_loss_symint(
      self, target, weight, reduction, std::move(ignore_index), label_smoothing);
}

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

// torchfuse::rotary(q, k, cos, sin, unsqueeze_dim): HF's apply_rotary_pos_emb (the
// rotate-half form), q and k in one call. The gradients go to q and k (cos and sin that need
// one take HF's own ops, autograd included).
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

std::tuple<at::Tensor, at::Tensor> rotary_stock(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& cos, const at::Tensor& sin,
                                                int64_t unsqueeze_dim) {
  return rotary_composed(q, k, cos, sin, unsqueeze_dim, rotate_half);
}

std::tuple<at::Tensor, at::Tensor> rotary_backward_stock(const at::Tensor& grad_q,
                                                         const at::Tensor& grad_k,
                                                         const at::Tensor& cos,
                                                         const at::Tensor& sin,
                                                         int64_t unsqueeze_dim,
                                                         at::ScalarType x_dtype) {
  return rotary_backward_composed(grad_q, grad_k, cos, sin, unsqueeze_dim, x_dtype,
                                  rotate_half_transposed);
}

// Meta tensors (and a compiler's fake ones, whose symbolic sizes the slices of rotate_half
// cannot take there): the rotation changes neither sizes, dtype nor layout, so the composition
// without it gives the outputs' metadata.
const auto unrotated = [](const at::Tensor& t) { return t; };

std::tuple<at::Tensor, at::Tensor> rotary_meta(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin,
                                               int64_t unsqueeze_dim) {
  return rotary_composed(q, k, cos, sin, unsqueeze_dim, unrotated);
}

std::tuple<at::Tensor, at::Tensor> rotary_backward_meta(const at::Tensor& grad_q,
                                                        const at::Tensor& grad_k,
                                                        const at::Tensor& cos,
                                                        const at::Tensor& sin,
                                                        int64_t unsqueeze_dim,
                                                        at::ScalarType x_dtype) {
  return rotary_backward_composed(grad_q, grad_k, cos, sin, unsqueeze_dim, x_dtype, unrotated);
}

std::tuple<at::Tensor, at::Tensor> rotary_cuda(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin,
                                               int64_t unsqueeze_dim) {
  TfRotaryCall call{};
  call.q = describe(q);
  call.k = describe(k);
  call.cos = describe(cos);
  call.sin = describe(sin);
  call.unsqueeze_dim = unsqueeze_dim;
  TfOutputs out{};
  if (fused_by_rust(torchfuse_rs_rotary, TF_ENTRY_ROTARY, q, call, out)) {
    auto outputs = take_outputs(out);
    return {outputs[0], outputs[1]};
  }
  return rotary_stock(q, k, cos, sin, unsqueeze_dim);
}

std::tuple<at::Tensor, at::Tensor> rotary_backward_cuda(const at::Tensor& grad_q,
                                                        const at::Tensor& grad_k,
                                                        const at::Tensor& cos,
                                                        const at::Tensor& sin,
                                                        int64_t unsqueeze_dim,
                                                        at::ScalarType x_dtype) {
  TfRotaryCall call{};
  call.grad_q = describe(grad_q);
  call.grad_k = describe(grad_k);
  call.cos = describe(cos);
  call.sin = describe(sin);
  call.unsqueeze_dim = unsqueeze_dim;
  call.x_dtype = static_cast<int16_t>(x_dtype);
  TfOutputs out{};
  if (fused_by_rust(torchfuse_rs_rotary, TF_ENTRY_ROTARY_BACKWARD, grad_q, call, out)) {
    auto outputs = take_outputs(out);
    return {outputs[0], outputs[1]};
  }
  return rotary_backward_stock(grad_q, grad_k, cos, sin, unsqueeze_dim, x_dtype);
}

std::tuple<at::Tensor, at::Tensor> call_rotary(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin,
                                               int64_t unsqueeze_dim) {
  static const auto op = own_op<decltype(call_rotary)>("torchfuse::rotary");
  return op.call(q, k, cos, sin, unsqueeze_dim);
}

std::tuple<at::Tensor, at::Tensor> call_rotary_backward(const at::Tensor& grad_q,
                                                        const at::Tensor& grad_k,
                                                        const at::Tensor& cos,
                                                        const at::Tensor& sin,
                                                        int64_t unsqueeze_dim,
                                                        at::ScalarType x_dtype) {
  static const auto op = own_op<decltype(call_rotary_backward)>("torchfuse::rotary_backward");
  return op.call(grad_q, grad_k, cos, sin, unsqueeze_dim, x_dtype);
}

class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& cos, const at::Tensor& sin,
                                                int64_t unsqueeze_dim) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["unsqueeze_dim"] = unsqueeze_dim;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(q.scalar_type());
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [q_embed, k_embed] = call_rotary(q, k, cos, sin, unsqueeze_dim);
    return {q_embed, k_embed};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const int64_t dim = ctx->saved_data["unsqueeze_dim"].toInt();
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    // create_graph, or one output unused: the composed, differentiable form.
    auto [dq, dk] = at::GradMode::is_enabled() || !grads[0].defined() || !grads[1].defined()
                        ? rotary_backward_stock(grads[0], grads[1], saved[0], saved[1], dim,
                                                x_dtype)
                        : call_rotary_backward(grads[0], grads[1], saved[0], saved[1], dim,
                                               x_dtype);
    return {dq, dk, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> rotary_autograd(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& cos, const at::Tensor& sin,
                                                   int64_t unsqueeze_dim) {
  // cos/sin that need a gradient, and what the Function cannot take: HF's ops.
  if (q.scalar_type() != k.scalar_type() ||
      (at::GradMode::is_enabled() && (cos.requires_grad() || sin.requires_grad())) ||
      composition_only({q, k, cos, sin}))
    return rotary_stock(q, k, cos, sin, unsqueeze_dim);
  auto outputs = RotaryFunction::apply(q, k, cos, sin, unsqueeze_dim);
  return {outputs[0], outputs[1]};
}

// ---------------------------------------------------------------- control ops

bool control_set_enabled(c10::string_view op, bool enabled) {
  TfStatus status;
  status.code = TF_STOCK;
  status.message[0] = '\0';
  torchfuse_rs_set_enabled(op.data(), op.size(), enabled, &status);
  status.message[TF_MESSAGE_BYTES - 1] = '\0';
  TORCH_CHECK(status.code != TF_ERROR, status.message);
  return status.code == TF_FUSED;
}

std::string control_stats() {
  char* json = torchfuse_rs_stats_json();
  if (json == nullptr) return "{}";
  std::string s(json);
  torchfuse_rs_free_string(json);
  return s;
}

void control_reset_stats() { torchfuse_rs_reset_stats(); }

std::string control_doctor(c10::string_view arch) {
  char* json = torchfuse_rs_doctor_json(arch.data(), arch.size());
  TORCH_CHECK(json != nullptr, "torchfuse: the doctor's report could not be made");
  std::string text(json);
  torchfuse_rs_free_string(json);
  return text;
}

void control_note(c10::string_view message, bool debug) {
  torchfuse_rs_note(message.data(), message.size(), debug);
}

void control_serve_below_thresholds(bool serve) { torchfuse_rs_serve_below_thresholds(serve); }

void control_force_variant(c10::string_view name) {
  torchfuse_rs_force_variant(name.data(), name.size());
}

// Sends the dispatcher's "Overriding a previously registered kernel" warnings to our log.
class WarningsToLog : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override {
    const std::string& msg = warning.msg();
    torchfuse_rs_torch_warning(msg.data(), msg.size());
  }
};

// ---------------------------------------------------------------- registration

// The source location the dispatcher shows in `_dispatch_dump` for our kernels.
constexpr const char* kRegistrationFile = "torchfuse/src/abi/shim.cpp";

torch::Library& aten_cuda_library() {
  static torch::Library* lib = new torch::Library(torch::Library::IMPL, "aten",
                                                  c10::DispatchKey::CUDA, kRegistrationFile, 0);
  return *lib;
}

// For CompositeImplicitAutograd aten ops, whose CUDA calls are taken above autograd.
torch::Library& aten_autograd_cuda_library() {
  static torch::Library* lib = new torch::Library(
      torch::Library::IMPL, "aten", c10::DispatchKey::AutogradCUDA, kRegistrationFile, 0);
  return *lib;
}

// The aten op each entry overrides, in TfEntry order (the SDPA backend choice is a dispatch
// stub, not an op).
constexpr const char* kEntryNames[TF_ENTRY_COUNT] = {
    "native_layer_norm",
    "native_layer_norm_backward",
    "_fused_rms_norm",
    "_fused_rms_norm_backward",
    "embedding",
    "embedding_dense_backward",
    "_fused_adam_",
    "_fused_adam_.tensor_lr",
    "_fused_adamw_",
    "_fused_adamw_.tensor_lr",
    "sdpa backend choice",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "torchfuse::gelu_tanh",
    "torchfuse::gelu_tanh_backward",
    "torchfuse::hf_rms_norm",
    "torchfuse::cross_entropy",
    "torchfuse::cross_entropy (backward)",
    "cross_entropy_loss",
    "torchfuse::silu_mul",
    "torchfuse::silu_mul_backward",
    "torchfuse::rotary",
    "torchfuse::rotary_backward",
};

// torchfuse's own ops: their schemas (added to the namespace the control ops define) and
// kernels per dispatch key.
torch::Library& torchfuse_ops() {
  static torch::Library* lib = new torch::Library(torch::Library::FRAGMENT, "torchfuse",
                                                  std::nullopt, kRegistrationFile, 0);
  return *lib;
}

torch::Library& torchfuse_impl(c10::DispatchKey key) {
  // One library object per key, made on first use.
  static std::array<torch::Library*, 5> libs{};
  static const std::array<c10::DispatchKey, 5> keys = {
      c10::DispatchKey::CUDA, c10::DispatchKey::CompositeExplicitAutograd,
      c10::DispatchKey::Autograd, c10::DispatchKey::CompositeImplicitAutograd,
      c10::DispatchKey::Meta};
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i] != key) continue;
    if (libs[i] == nullptr)
      libs[i] = new torch::Library(torch::Library::IMPL, "torchfuse", key, kRegistrationFile, 0);
    return *libs[i];
  }
  TORCH_CHECK(false, "torchfuse: no library for dispatch key ", key);
}

void define_own_op(uint32_t entry) {
  using c10::DispatchKey;
  switch (entry) {
    case TF_ENTRY_GELU_TANH:
      torchfuse_ops().def("gelu_tanh(Tensor input, ScalarType? dtype=None) -> Tensor");
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("gelu_tanh", TORCH_FN(gelu_tanh_stock));
      torchfuse_impl(DispatchKey::CUDA).impl("gelu_tanh", TORCH_FN(gelu_tanh_cuda));
      torchfuse_impl(DispatchKey::Autograd).impl("gelu_tanh", TORCH_FN(gelu_tanh_autograd));
      break;
    case TF_ENTRY_GELU_TANH_BACKWARD:
      torchfuse_ops().def("gelu_tanh_backward(Tensor grad_out, Tensor input) -> Tensor");
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("gelu_tanh_backward", TORCH_FN(gelu_tanh_backward_stock));
      torchfuse_impl(DispatchKey::CUDA)
          .impl("gelu_tanh_backward", TORCH_FN(gelu_tanh_backward_cuda));
      break;
    case TF_ENTRY_HF_RMS_NORM:
      torchfuse_ops().def("hf_rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
      torchfuse_impl(DispatchKey::CompositeImplicitAutograd)
          .impl("hf_rms_norm", TORCH_FN(hf_rms_norm));
      break;
    case TF_ENTRY_CROSS_ENTROPY:
      torchfuse_ops().def(
          "cross_entropy(Tensor logits, Tensor target, int reduction=1, int ignore_index=-100, "
          "float label_smoothing=0.0, ScalarType? dtype=None) -> Tensor");
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("cross_entropy", TORCH_FN(cross_entropy));
      torchfuse_impl(DispatchKey::Autograd)
          .impl("cross_entropy", TORCH_FN(cross_entropy_autograd));
      torchfuse_ops().def(
          "cross_entropy_fwd(Tensor logits, Tensor target, int reduction, int ignore_index, "
          "float label_smoothing, ScalarType dtype) -> (Tensor, Tensor, Tensor)");
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("cross_entropy_fwd", TORCH_FN(cross_entropy_fwd_stock));
      torchfuse_impl(DispatchKey::CUDA).impl("cross_entropy_fwd", TORCH_FN(cross_entropy_fwd_cuda));
      torchfuse_impl(DispatchKey::Meta).impl("cross_entropy_fwd", TORCH_FN(cross_entropy_fwd_meta));
      break;
    case TF_ENTRY_CROSS_ENTROPY_BACKWARD:
      torchfuse_ops().def(
          "cross_entropy_bwd(Tensor grad_loss, Tensor logits, Tensor target, Tensor lse, "
          "Tensor total_weight, int reduction, int ignore_index, float label_smoothing) -> Tensor");
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("cross_entropy_bwd", TORCH_FN(cross_entropy_bwd_stock));
      torchfuse_impl(DispatchKey::CUDA).impl("cross_entropy_bwd", TORCH_FN(cross_entropy_bwd_cuda));
      torchfuse_impl(DispatchKey::Meta).impl("cross_entropy_bwd", TORCH_FN(cross_entropy_bwd_meta));
      break;
    case TF_ENTRY_SILU_MUL:
      torchfuse_ops().def("silu_mul(Tensor gate, Tensor up) -> Tensor");
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("silu_mul", TORCH_FN(silu_mul_stock));
      torchfuse_impl(DispatchKey::CUDA).impl("silu_mul", TORCH_FN(silu_mul_cuda));
      torchfuse_impl(DispatchKey::Autograd).impl("silu_mul", TORCH_FN(silu_mul_autograd));
      break;
    case TF_ENTRY_SILU_MUL_BACKWARD:
      torchfuse_ops().def(
          "silu_mul_backward(Tensor grad_out, Tensor gate, Tensor up) -> (Tensor, Tensor)");
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("silu_mul_backward", TORCH_FN(silu_mul_backward_stock));
      torchfuse_impl(DispatchKey::CUDA)
          .impl("silu_mul_backward", TORCH_FN(silu_mul_backward_cuda));
      break;
    case TF_ENTRY_ROTARY:
      torchfuse_ops().def(
          "rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1) -> "
          "(Tensor, Tensor)");
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("rotary", TORCH_FN(rotary_stock));
      torchfuse_impl(DispatchKey::CUDA).impl("rotary", TORCH_FN(rotary_cuda));
      torchfuse_impl(DispatchKey::Meta).impl("rotary", TORCH_FN(rotary_meta));
      torchfuse_impl(DispatchKey::Autograd).impl("rotary", TORCH_FN(rotary_autograd));
      break;
    case TF_ENTRY_ROTARY_BACKWARD:
      torchfuse_ops().def(
          "rotary_backward(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, "
          "int unsqueeze_dim, ScalarType x_dtype) -> (Tensor, Tensor)");
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("rotary_backward", TORCH_FN(rotary_backward_stock));
      torchfuse_impl(DispatchKey::CUDA)
          .impl("rotary_backward", TORCH_FN(rotary_backward_cuda));
      torchfuse_impl(DispatchKey::Meta)
          .impl("rotary_backward", TORCH_FN(rotary_backward_meta));
      break;
    default: TORCH_CHECK(false, "torchfuse: unknown entry ", entry);
  }
}

void register_entry(uint32_t entry) {
  torch::Library& m = aten_cuda_library();
  TORCH_CHECK(entry < TF_ENTRY_COUNT, "torchfuse: unknown entry ", entry);
  const char* name = kEntryNames[entry];
  switch (entry) {
    case TF_ENTRY_NATIVE_LAYER_NORM: m.impl(name, TORCH_FN(native_layer_norm)); break;
    case TF_ENTRY_NATIVE_LAYER_NORM_BACKWARD:
      m.impl(name, TORCH_FN(native_layer_norm_backward));
      break;
    case TF_ENTRY_FUSED_RMS_NORM: m.impl(name, TORCH_FN(fused_rms_norm)); break;
    case TF_ENTRY_FUSED_RMS_NORM_BACKWARD: m.impl(name, TORCH_FN(fused_rms_norm_backward)); break;
    case TF_ENTRY_EMBEDDING: m.impl(name, TORCH_FN(embedding)); break;
    case TF_ENTRY_EMBEDDING_DENSE_BACKWARD: m.impl(name, TORCH_FN(embedding_dense_backward)); break;
    case TF_ENTRY_FUSED_ADAM: m.impl(name, TORCH_FN(fused_adam)); break;
    case TF_ENTRY_FUSED_ADAM_TENSOR_LR: m.impl(name, TORCH_FN(fused_adam_tensor_lr)); break;
    case TF_ENTRY_FUSED_ADAMW: m.impl(name, TORCH_FN(fused_adamw)); break;
    case TF_ENTRY_FUSED_ADAMW_TENSOR_LR: m.impl(name, TORCH_FN(fused_adamw_tensor_lr)); break;
    case TF_ENTRY_SDP_CHOICE:
      at::native::_fused_sdp_choice_stub.set_cuda_dispatch_ptr(&sdp_choice);
      break;
    case TF_ENTRY_FLASH_ATTENTION: m.impl(name, TORCH_FN(flash_attention)); break;
    case TF_ENTRY_FLASH_ATTENTION_BACKWARD: m.impl(name, TORCH_FN(flash_attention_backward)); break;
    case TF_ENTRY_GELU_TANH:
    case TF_ENTRY_GELU_TANH_BACKWARD:
    case TF_ENTRY_HF_RMS_NORM:
    case TF_ENTRY_CROSS_ENTROPY:
    case TF_ENTRY_CROSS_ENTROPY_BACKWARD:
    case TF_ENTRY_SILU_MUL:
    case TF_ENTRY_SILU_MUL_BACKWARD:
    case TF_ENTRY_ROTARY:
    case TF_ENTRY_ROTARY_BACKWARD: define_own_op(entry); break;
    case TF_ENTRY_CROSS_ENTROPY_LOSS:
      aten_autograd_cuda_library().impl(name, TORCH_FN(aten_cross_entropy_loss));
      break;
    default: TORCH_CHECK(false, "torchfuse: unknown entry ", entry);
  }
}

// Runs `body`, turning any C++ exception into TF_ERROR with its message.
template <class Body>
void protect(TfStatus* status, Body body) {
  try {
    body();
    status->code = TF_FUSED;
  } catch (const std::exception& e) {
    status->code = TF_ERROR;
    std::strncpy(status->message, e.what(), TF_MESSAGE_BYTES - 1);
    status->message[TF_MESSAGE_BYTES - 1] = '\0';
  }
}

// Every size and offset of torchfuse_abi.h, and the c10::ScalarType codes Rust uses, in the
// order src/abi/types.rs lists them.
#define TF_FIELD(type, field) static_cast<int64_t>(offsetof(type, field))
const std::vector<int64_t>& abi_layout() {
  static const std::vector<int64_t> layout = {
      sizeof(TfStatus), TF_FIELD(TfStatus, message), TF_MESSAGE_BYTES,
      TF_STOCK, TF_FUSED, TF_ERROR, TF_ENTRY_COUNT,
      sizeof(TfLaunch), TF_FIELD(TfLaunch, stream),
      sizeof(TfTensor), TF_FIELD(TfTensor, data), TF_FIELD(TfTensor, numel),
      TF_FIELD(TfTensor, dtype), TF_FIELD(TfTensor, device), TF_FIELD(TfTensor, dense),
      TF_FIELD(TfTensor, like_first), TF_FIELD(TfTensor, symbolic),
      sizeof(TfOutputs),
      sizeof(TfNormCall), TF_FIELD(TfNormCall, weight), TF_FIELD(TfNormCall, bias),
      TF_FIELD(TfNormCall, grad_out), TF_FIELD(TfNormCall, mean), TF_FIELD(TfNormCall, rstd),
      TF_FIELD(TfNormCall, normalized_shape), TF_FIELD(TfNormCall, normalized_ndim),
      TF_FIELD(TfNormCall, eps), TF_FIELD(TfNormCall, has_eps),
      TF_FIELD(TfNormCall, output_mask),
      sizeof(TfGeluCall), TF_FIELD(TfGeluCall, grad_out), TF_FIELD(TfGeluCall, out_dtype),
      sizeof(TfCrossEntropyCall), TF_FIELD(TfCrossEntropyCall, target),
      TF_FIELD(TfCrossEntropyCall, grad_loss), TF_FIELD(TfCrossEntropyCall, lse),
      TF_FIELD(TfCrossEntropyCall, total_weight), TF_FIELD(TfCrossEntropyCall, ignore_index),
      TF_FIELD(TfCrossEntropyCall, label_smoothing), TF_FIELD(TfCrossEntropyCall, reduction),
      TF_FIELD(TfCrossEntropyCall, out_dtype), TF_FIELD(TfCrossEntropyCall, plan_only),
      sizeof(TfSwigluCall), TF_FIELD(TfSwigluCall, up), TF_FIELD(TfSwigluCall, grad_out),
      sizeof(TfRotaryCall), TF_FIELD(TfRotaryCall, k), TF_FIELD(TfRotaryCall, cos),
      TF_FIELD(TfRotaryCall, sin), TF_FIELD(TfRotaryCall, grad_q), TF_FIELD(TfRotaryCall, grad_k),
      TF_FIELD(TfRotaryCall, unsqueeze_dim), TF_FIELD(TfRotaryCall, x_dtype),
      sizeof(TfEmbeddingCall), TF_FIELD(TfEmbeddingCall, grad),
      TF_FIELD(TfEmbeddingCall, indices), TF_FIELD(TfEmbeddingCall, num_weights),
      TF_FIELD(TfEmbeddingCall, padding_idx), TF_FIELD(TfEmbeddingCall, scale_grad_by_freq),
      sizeof(TfAdamCall), TF_FIELD(TfAdamCall, lens), TF_FIELD(TfAdamCall, lr_tensor),
      TF_FIELD(TfAdamCall, grad_scale), TF_FIELD(TfAdamCall, found_inf),
      TF_FIELD(TfAdamCall, lr), TF_FIELD(TfAdamCall, beta1), TF_FIELD(TfAdamCall, beta2),
      TF_FIELD(TfAdamCall, weight_decay), TF_FIELD(TfAdamCall, eps),
      TF_FIELD(TfAdamCall, decoupled), TF_FIELD(TfAdamCall, amsgrad),
      TF_FIELD(TfAdamCall, maximize),
      sizeof(TfAttentionCall), TF_FIELD(TfAttentionCall, key), TF_FIELD(TfAttentionCall, value),
      TF_FIELD(TfAttentionCall, grad_out), TF_FIELD(TfAttentionCall, output),
      TF_FIELD(TfAttentionCall, logsumexp), TF_FIELD(TfAttentionCall, dropout_p),
      TF_FIELD(TfAttentionCall, scale), TF_FIELD(TfAttentionCall, stock_choice),
      TF_FIELD(TfAttentionCall, has_scale), TF_FIELD(TfAttentionCall, is_causal),
      TF_FIELD(TfAttentionCall, has_mask), TF_FIELD(TfAttentionCall, nested),
      TF_FIELD(TfAttentionCall, return_debug_mask), TF_FIELD(TfAttentionCall, default_backends),
      TF_FIELD(TfAttentionCall, deterministic),
      static_cast<int64_t>(at::kByte), static_cast<int64_t>(at::kInt),
      static_cast<int64_t>(at::kLong), static_cast<int64_t>(at::kHalf),
      static_cast<int64_t>(at::kFloat), static_cast<int64_t>(at::kDouble),
      static_cast<int64_t>(at::kBFloat16),
  };
  return layout;
}
#undef TF_FIELD

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void torchfuse_cxx_register(uint32_t entry,
                                                                    TfStatus* status) {
  protect(status, [&] {
    WarningsToLog handler;
    c10::WarningUtils::WarningHandlerGuard guard(&handler);
    register_entry(entry);
  });
}

// Unfilled: aten's `empty` also fills a new tensor when deterministic algorithms are on
// (fill_uninitialized_memory), a whole extra write of an output the kernel overwrites anyway.
__attribute__((visibility("default"))) void* torchfuse_cxx_empty_unfilled(
    const int64_t* sizes, size_t ndim, int16_t scalar_type, int16_t device, TfStatus* status) {
  at::Tensor* tensor = nullptr;
  protect(status, [&] {
    tensor = new at::Tensor(at::detail::empty_cuda(
        c10::IntArrayRef(sizes, ndim), static_cast<c10::ScalarType>(scalar_type),
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)), std::nullopt));
  });
  return tensor;
}

__attribute__((visibility("default"))) void torchfuse_cxx_define_control_ops(TfStatus* status) {
  protect(status, [] {
    static torch::Library* lib =
        new torch::Library(torch::Library::DEF, "torchfuse", std::nullopt, kRegistrationFile, 0);
    lib->def("set_enabled(str op, bool enabled) -> bool", &control_set_enabled);
    lib->def("stats() -> str", &control_stats);
    lib->def("reset_stats() -> ()", &control_reset_stats);
    lib->def("doctor(str arch=\"\") -> str", &control_doctor);
    // The launcher's Python hook reports its substitutions here, to torchfuse's log.
    lib->def("note(str message, bool debug=False) -> ()", &control_note);
    // Test hook: kernels also serve shapes below their measured thresholds.
    lib->def("_serve_below_thresholds(bool serve) -> ()", &control_serve_below_thresholds);
    // Benchmark hook: serve the named variant's op with it ("" clears).
    lib->def("_force_variant(str name) -> ()", &control_force_variant);
  });
}

__attribute__((visibility("default"))) size_t torchfuse_cxx_abi_layout(int64_t* out,
                                                                       size_t cap) {
  const std::vector<int64_t>& layout = abi_layout();
  for (size_t i = 0; i < layout.size() && i < cap; ++i) out[i] = layout[i];
  return layout.size();
}

__attribute__((visibility("default"))) const char* torchfuse_cxx_entry_name(uint32_t entry) {
  return entry < TF_ENTRY_COUNT ? kEntryNames[entry] : nullptr;
}

__attribute__((visibility("default"))) size_t torchfuse_cxx_libtorch_file(char* out, size_t cap) {
  try {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&c10::GetCPUAllocator), &info) == 0 ||
        info.dli_fname == nullptr)
      return 0;
    const size_t len = std::strlen(info.dli_fname);
    if (cap > 0) {
      std::strncpy(out, info.dli_fname, cap - 1);
      out[cap - 1] = '\0';
    }
    return len;
  } catch (...) {
    return 0;
  }
}

}  // extern "C"
