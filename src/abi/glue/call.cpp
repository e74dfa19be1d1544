// The description of a call for Rust, the hand-over of outputs, the tracer checks and the
// registration libraries every family uses (glue.h).
#include "glue.h"

namespace torchfuse_glue {

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
TfTensor describe(const at::Tensor& t, bool written, const at::Tensor* like) {
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
  f.strided = 1;
  f.ndim = t.dim();
  f.sizes = t.sizes().data();
  f.strides = t.strides().data();
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

const char* const kRegistrationFile = "torchfuse/src/abi/glue";

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

}  // namespace torchfuse_glue
