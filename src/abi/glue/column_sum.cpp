// aten's sum.dim_IntList: Rust serves the sums over a contiguous tensor's leading dims (a
// bias's gradient); every other call runs stock's kernel with the unchanged arguments.
#include "glue.h"

namespace torchfuse_glue {
namespace {

at::Tensor sum_dim(const at::Tensor& self, at::OptionalIntArrayRef dim, bool keepdim,
                   std::optional<at::ScalarType> dtype) {
  const auto stock = [&] { return at::cuda::sum(self, dim, keepdim, dtype); };
  // Named tensors: stock's meta function names the result's dims.
  if (!self.is_cuda() || self.has_names()) return stock();
  TfColumnSumCall call{};
  call.input = describe(self);
  if (dim.has_value()) {
    call.has_dims = 1;
    call.dims = dim->data();
    call.ndims = dim->size();
  }
  call.keepdim = keepdim ? 1 : 0;
  if (dtype.has_value()) {
    call.has_dtype = 1;
    call.out_dtype = static_cast<int16_t>(*dtype);
  }
  return fused_or_stock(TF_ENTRY_COLUMN_SUM, self, call, stock);
}

}  // namespace

bool register_column_sum(uint32_t entry, const char* name, torch::Library* aten) {
  switch (entry) {
    case TF_ENTRY_COLUMN_SUM: aten->impl(name, TORCH_FN(sum_dim)); return true;
    default: return false;
  }
}

}  // namespace torchfuse_glue
