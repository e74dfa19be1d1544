// aten's add.Tensor: Rust serves an fp32 tensor plus a 16-bit one of the same shape (a residual
// stream's add under autocast); every other call runs stock's kernel with the unchanged
// arguments. aten's copy_: Rust serves a 16-bit CUDA tensor copied into an fp32 one of the same
// sizes and strides, both dense (autocast's casts back in the backward); every other copy runs
// stock's copy_.
#include "glue.h"

#include <ATen/ops/copy_compositeexplicitautograd_dispatch.h>

namespace torchfuse_glue {
namespace {

at::Tensor add_tensor(const at::Tensor& self, const at::Tensor& other, const at::Scalar& alpha) {
  const auto stock = [&] { return at::cuda::add(self, other, alpha); };
  // Adds of one dtype (nearly all of them: stock's add is one vectorized pass there), a CPU
  // scalar operand, and named tensors (stock's meta function names the result's dims) stay
  // stock's without a call into Rust.
  if (self.scalar_type() == other.scalar_type() || !self.is_cuda() || !other.is_cuda() ||
      self.has_names() || other.has_names())
    return stock();
  TfMixedAddCall call{};
  call.self = describe(self);
  call.other = describe(other);
  call.alpha_is_one = !alpha.isComplex() && !alpha.isBoolean() && alpha.toDouble() == 1.0;
  return fused_or_stock(TF_ENTRY_MIXED_ADD, self, call, stock);
}

at::Tensor& copy_cuda(at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  const auto stock = [&]() -> at::Tensor& {
    return at::compositeexplicitautograd::copy_(self, src, non_blocking);
  };
  // Everything but a widening of bf16/fp16 into fp32 on one device, in one layout, stays stock's
  // without a call into Rust: most copies keep their dtype or narrow it (stock's copy of those
  // is vectorized), cross devices, or restride. Overlapping memory, negated views and named
  // tensors keep stock's checks and semantics.
  const auto from = src.scalar_type();
  if (self.scalar_type() != at::kFloat || (from != at::kBFloat16 && from != at::kHalf) ||
      !self.is_cuda() || !src.is_cuda() || self.device() != src.device() || traced(self) ||
      traced(src) || self.sizes() != src.sizes() || self.strides() != src.strides() ||
      !self.is_non_overlapping_and_dense() || src.is_neg() || self.is_neg() ||
      self.has_names() || src.has_names() || self.storage().is_alias_of(src.storage()))
    return stock();
  TfMixedAddCall call{};
  // Written: a copy-on-write destination gets its own memory first (as stock's write does),
  // before the source is read.
  call.self = describe(self, /*written=*/true);
  call.other = describe(src);
  call.alpha_is_one = 1;
  TfOutputs written{};
  if (!fused_by_rust(TF_ENTRY_MIXED_COPY, self, call, written)) return stock();
  return self;
}

}  // namespace

bool register_mixed_add(uint32_t entry, const char* name, torch::Library* aten) {
  switch (entry) {
    case TF_ENTRY_MIXED_ADD: aten->impl(name, TORCH_FN(add_tensor)); return true;
    case TF_ENTRY_MIXED_COPY: aten->impl(name, TORCH_FN(copy_cuda)); return true;
    default: return false;
  }
}

}  // namespace torchfuse_glue
