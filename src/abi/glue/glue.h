// What every file of the C++ glue shares (src/abi/glue/): the description of a call for
// Rust, the hand-over to Rust and back, the libraries kernels are registered with, and each op
// family's registration function.
//
// The glue is thin marshalling between PyTorch's dispatcher and the Rust core
// (src/abi/entries.rs). Every override does three things only: describe the call to Rust
// (torchfuse_abi.h, the one definition of the boundary), take back the tensors Rust produced,
// or, when Rust answers TF_STOCK, call PyTorch's own kernel with the unchanged arguments; the
// last two are `fused_or_stock`, written once below. All
// decisions (enabled?, which kernel?, why stock?) and all logging live in Rust. No C++
// exception crosses into Rust (every function Rust calls catches and answers TF_ERROR) and no
// Rust panic crosses back (the Rust entry points catch panics and answer TF_STOCK).
//
// One file per op family (norm, embedding, adam, attention, gelu, cross_entropy, swiglu,
// rotary, column_sum, mixed_add, linear: the aten overrides and torchfuse's own ops of the family, as
// src/ops/ has one module each), call.cpp (this header's functions) and registration.cpp
// (entries, control ops, the ABI layout, the C entry points).
#pragma once

#include "../torchfuse_abi.h"

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
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <c10/core/CPUAllocator.h>
#include <dlfcn.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace torchfuse_glue {

TfTensor absent();
// Stock's rule (check_fast_path_restrictions): same sizes, and the same stride on every dim
// of size > 1, so both tensors store their elements in the same order.
bool same_geometry(const at::Tensor& a, const at::Tensor& b);
// `written`: the kernel writes the tensor (its data pointer is the mutable one, which a
// copy-on-write tensor materializes for, as stock's in-place kernels do). `like`: the list's
// reference tensor at this index, or null.
TfTensor describe(const at::Tensor& t, bool written = false, const at::Tensor* like = nullptr);
TfTensor describe(const std::optional<at::Tensor>& t);
// PyTorch's current stream on the tensor's device.
TfLaunch launch_for(const at::Tensor& t);
at::Tensor take(void* owned);
// The outputs Rust produced (a null slot is an undefined tensor: an output not requested).
std::array<at::Tensor, 3> take_outputs(TfOutputs& out);

// Each family's Rust entry point, found from its call struct.
template <class Call>
using RustAnswer = void (*)(uint32_t, const TfLaunch*, const Call*, TfOutputs*, TfStatus*);
inline RustAnswer<TfNormCall> rust_answer(const TfNormCall&) { return torchfuse_rs_norm; }
inline RustAnswer<TfEmbeddingCall> rust_answer(const TfEmbeddingCall&) {
  return torchfuse_rs_embedding;
}
inline RustAnswer<TfAdamCall> rust_answer(const TfAdamCall&) { return torchfuse_rs_adam; }
inline RustAnswer<TfAttentionCall> rust_answer(const TfAttentionCall&) {
  return torchfuse_rs_attention;
}
inline RustAnswer<TfGeluCall> rust_answer(const TfGeluCall&) { return torchfuse_rs_gelu; }
inline RustAnswer<TfCrossEntropyCall> rust_answer(const TfCrossEntropyCall&) {
  return torchfuse_rs_cross_entropy;
}
inline RustAnswer<TfSwigluCall> rust_answer(const TfSwigluCall&) { return torchfuse_rs_swiglu; }
inline RustAnswer<TfRotaryCall> rust_answer(const TfRotaryCall&) { return torchfuse_rs_rotary; }
inline RustAnswer<TfColumnSumCall> rust_answer(const TfColumnSumCall&) {
  return torchfuse_rs_column_sum;
}
inline RustAnswer<TfMixedAddCall> rust_answer(const TfMixedAddCall&) {
  return torchfuse_rs_mixed_add;
}
inline RustAnswer<TfLinearCall> rust_answer(const TfLinearCall&) { return torchfuse_rs_linear; }

// Hands one call to its family's Rust entry point on `on`'s device and stream. True: fused,
// the outputs are in `out`; false: stock must run it. Bad input Rust refused is raised here,
// as PyTorch's error.
template <class Call>
bool fused_by_rust(TfEntry entry, const TfLaunch& launch, const Call& call, TfOutputs& out) {
  TfStatus status;
  status.code = TF_STOCK;
  status.message[0] = '\0';
  rust_answer(call)(entry, &launch, &call, &out, &status);
  status.message[TF_MESSAGE_BYTES - 1] = '\0';
  TORCH_CHECK(status.code != TF_ERROR, status.message);
  return status.code == TF_FUSED;
}

template <class Call>
bool fused_by_rust(TfEntry entry, const at::Tensor& on, const Call& call, TfOutputs& out) {
  const c10::DeviceGuard guard(on.device());
  return fused_by_rust(entry, launch_for(on), call, out);
}

// The outputs Rust produced, as the op returns them: one tensor, or a tuple of the first ones.
template <class R>
struct Returned;
template <>
struct Returned<at::Tensor> {
  static at::Tensor take(TfOutputs& out) { return std::move(take_outputs(out)[0]); }
};
template <class... T>
struct Returned<std::tuple<T...>> {
  static std::tuple<T...> take(TfOutputs& out) {
    return from(take_outputs(out), std::index_sequence_for<T...>{});
  }
  template <size_t... I>
  static std::tuple<T...> from(std::array<at::Tensor, 3>&& r, std::index_sequence<I...>) {
    return std::tuple<T...>{std::move(r[I])...};
  }
};

// The one path of an override, once its call is described: Rust decides (on `on`'s device and
// stream), then the outputs it produced, or `stock()`'s (PyTorch's own kernel or composition,
// with the unchanged arguments).
template <class Call, class Stock>
auto fused_or_stock(TfEntry entry, const at::Tensor& on, const Call& call, Stock&& stock)
    -> decltype(stock()) {
  TfOutputs out{};
  if (fused_by_rust(entry, on, call, out))
    return Returned<decltype(stock())>::take(out);
  return stock();
}

template <size_t N>
uint32_t mask_bits(const std::array<bool, N>& mask) {
  uint32_t bits = 0;
  for (size_t i = 0; i < N; ++i) bits |= mask[i] ? (1u << i) : 0u;
  return bits;
}

// A tensor whose data torchfuse may not read, or a call a Python dispatch mode watches: a
// Python subclass (fake tensors under torch.compile), a functional or torch.func wrapper, an
// active TorchDispatchMode (FlopCounterMode, make_fx on real tensors), which must see the ops
// the stock composition runs.
bool traced(const at::Tensor& t);
// Whether torchfuse's C++ autograd Functions cannot take this call, so PyTorch's own ops
// (the original composition) must: a torch.func transform is active (grad, vmap, jacrev: C++
// Functions raise under them), or a tensor carries a forward-mode AD tangent (they have no jvp).
bool composition_only(std::initializer_list<at::Tensor> tensors);

// `out.copy_(x)` for x a 4-D view with a contiguous last dim and `out` a view of its sizes whose
// elements do not overlap: kv_copy's rows kernel where Rust serves it (its toggle, `kv_cache`,
// on), else copy_ itself. Not differentiable: for backward passes below autograd.
void copy_rows_into(const at::Tensor& x, const at::Tensor& out);

// torchfuse's own op `name` as a typed handle, for the autograd Functions to call below
// autograd; the signature is the caller's own (`own_op<decltype(call_x)>`), kept in a static:
// one lookup.
template <class Signature>
c10::TypedOperatorHandle<Signature> own_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The libraries kernels are registered with (made on first use, never destroyed).
torch::Library& aten_cuda_library();
// For CompositeImplicitAutograd aten ops, whose CUDA calls are taken above autograd.
torch::Library& aten_autograd_cuda_library();
// torchfuse's own ops: their schemas (added to the namespace the control ops define) and
// kernels per dispatch key.
torch::Library& torchfuse_ops();
torch::Library& torchfuse_impl(c10::DispatchKey key);
// The source location the dispatcher shows in `_dispatch_dump` for our kernels.
extern const char* const kRegistrationFile;

// torchfuse's own ops (the ops the Python rewrite layer sends known compositions to) are each
// defined with everything torch needs to run them anywhere: a CompositeExplicitAutograd kernel
// (stock: the same function from PyTorch's own ops; also what Meta tensors and torch.compile's
// fake tensors run), the CUDA kernel (Rust serves it, or stock), and autograd, so a C++ program
// gets the same op.
//
// Each family registers its entries' kernels: `name` is the op an override takes
// (kEntryNames); `aten` the library of the catalog's dispatch key for an aten override (null for
// a dispatch stub and for torchfuse's own ops, whose schemas the catalog defines first); false
// where the entry is not the family's.
#define TF_DECLARE_REGISTER(family) \
  bool register_##family(uint32_t entry, const char* name, torch::Library* aten);
TF_FOR_EACH_FAMILY(TF_DECLARE_REGISTER)
#undef TF_DECLARE_REGISTER

}  // namespace torchfuse_glue
