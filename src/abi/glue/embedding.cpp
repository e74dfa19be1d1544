// aten's embedding and embedding_dense_backward.
#include "glue.h"

namespace torchfuse_glue {
namespace {

at::Tensor embedding(const at::Tensor& weight, const at::Tensor& indices, int64_t padding_idx,
                     bool scale_grad_by_freq, bool sparse) {
  const auto stock = [&] {
    return at::compositeexplicitautograd::embedding(weight, indices, padding_idx,
                                                    scale_grad_by_freq, sparse);
  };
  if (!weight.is_cuda()) return stock();
  TfEmbeddingCall call{};
  call.weight = describe(weight);
  call.indices = describe(indices);
  return fused_or_stock(TF_ENTRY_EMBEDDING, weight, call, stock);
}

at::Tensor embedding_dense_backward(const at::Tensor& grad_output, const at::Tensor& indices,
                                    int64_t num_weights, int64_t padding_idx,
                                    bool scale_grad_by_freq) {
  const auto stock = [&] {
    return at::cuda::embedding_dense_backward(grad_output, indices, num_weights, padding_idx,
                                              scale_grad_by_freq);
  };
  if (!grad_output.is_cuda()) return stock();
  TfEmbeddingCall call{};
  call.grad = describe(grad_output);
  call.indices = describe(indices);
  call.num_weights = num_weights;
  call.padding_idx = padding_idx;
  call.scale_grad_by_freq = scale_grad_by_freq;
  return fused_or_stock(TF_ENTRY_EMBEDDING_DENSE_BACKWARD, grad_output, call, stock);
}

}  // namespace

bool register_embedding(uint32_t entry, const char* name, torch::Library* aten) {
  switch (entry) {
    case TF_ENTRY_EMBEDDING: aten->impl(name, TORCH_FN(embedding)); return true;
    case TF_ENTRY_EMBEDDING_DENSE_BACKWARD:
      aten->impl(name, TORCH_FN(embedding_dense_backward));
      return true;
    default: return false;
  }
}

}  // namespace torchfuse_glue
