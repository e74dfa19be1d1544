// scaled_dot_product_attention: the CUDA backend choice (a dispatch stub) and the flash
// attention forward and backward it leads to.
#include "glue.h"

namespace torchfuse_glue {
namespace {

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
  return fused_by_rust(TF_ENTRY_SDP_CHOICE, query, call, out) ? kFlash : stock;
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
    if (fused_by_rust(TF_ENTRY_FLASH_ATTENTION, query, call, out)) {
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
  const auto stock = [&] {
    return at::cuda::_scaled_dot_product_flash_attention_backward(
        grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
        dropout_p, is_causal, philox_seed, philox_offset, scale);
  };
  if (!query.is_cuda() || cum_seq_q.defined() || cum_seq_k.defined()) return stock();
  TfAttentionCall call =
      attention_call(query, key, value, dropout_p, is_causal, scale, false, false);
  call.grad_out = describe(grad_out);
  call.output = describe(out);
  call.logsumexp = describe(logsumexp);
  return fused_or_stock(TF_ENTRY_FLASH_ATTENTION_BACKWARD, query, call, stock);
}

}  // namespace

bool register_attention(uint32_t entry, const char* name, torch::Library* aten) {
  switch (entry) {
    case TF_ENTRY_SDP_CHOICE:
      at::native::_fused_sdp_choice_stub.set_cuda_dispatch_ptr(&sdp_choice);
      return true;
    case TF_ENTRY_FLASH_ATTENTION: aten->impl(name, TORCH_FN(flash_attention)); return true;
    case TF_ENTRY_FLASH_ATTENTION_BACKWARD:
      aten->impl(name, TORCH_FN(flash_attention_backward));
      return true;
    default: return false;
  }
}

}  // namespace torchfuse_glue
