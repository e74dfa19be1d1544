// aten's add.Tensor: Rust serves an fp32 tensor plus a 16-bit one of the same shape (a residual
// stream's add under autocast); every other call runs stock's kernel with the unchanged
// arguments.
#include "glue.h"

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

}  // namespace

bool register_mixed_add(uint32_t entry, const char* name, torch::Library* aten) {
  switch (entry) {
    case TF_ENTRY_MIXED_ADD: aten->impl(name, TORCH_FN(add_tensor)); return true;
    default: return false;
  }
}

}  // namespace torchfuse_glue
