// Cross-entropy: torchfuse::cross_entropy (HF's causal-LM loss), the op pair a compiled graph
// calls (cross_entropy_fwd / _bwd), and aten's cross_entropy_loss for any caller.
#include "glue.h"

namespace torchfuse_glue {
namespace {

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
  return fused_or_stock(TF_ENTRY_CROSS_ENTROPY_BACKWARD, logits, call, [&] {
    return cross_entropy_backward_stock(grad_loss, logits, target, total_weight, reduction,
                                        ignore_index, label_smoothing);
  });
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

// Stock smooths only where label_smoothing > 0: a negative or NaN one is none at all.
double effective_smoothing(double label_smoothing) {
  return label_smoothing > 0.0 ? label_smoothing : 0.0;
}

// A forward call for Rust (the loss in `loss_dtype`), its smoothing already effective.
TfCrossEntropyCall forward_call(const at::Tensor& logits, const at::Tensor& target,
                                int64_t reduction, int64_t ignore_index, double label_smoothing,
                                at::ScalarType loss_dtype) {
  TfCrossEntropyCall call{};
  call.logits = describe(logits);
  call.target = describe(target);
  call.ignore_index = ignore_index;
  call.label_smoothing = label_smoothing;
  call.reduction = static_cast<int32_t>(reduction);
  call.out_dtype = static_cast<int16_t>(loss_dtype);
  return call;
}

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
  const auto stock = [&] {
    return cross_entropy_fwd_stock(logits, target, reduction, ignore_index, label_smoothing,
                                   dtype);
  };
  if (traced(logits)) return stock();
  const TfCrossEntropyCall call = forward_call(logits, target, reduction, ignore_index,
                                               effective_smoothing(label_smoothing), dtype);
  return fused_or_stock(TF_ENTRY_CROSS_ENTROPY, logits, call, stock);
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

// The loss of a forward Rust serves (or a compiled graph's op will), with CrossEntropyFunction's
// autograd where the logits need a gradient.
at::Tensor with_gradient(const at::Tensor& logits, const at::Tensor& target,
                         const at::Tensor& loss, const at::Tensor& lse,
                         const at::Tensor& total_weight, int64_t reduction, int64_t ignore_index,
                         double label_smoothing) {
  if (!(at::GradMode::is_enabled() && logits.requires_grad())) return loss;
  return CrossEntropyFunction::apply(logits, target, loss, lse, total_weight, reduction,
                                     ignore_index, label_smoothing);
}

// The loss (with CrossEntropyFunction's autograd where the logits need a gradient) when Rust
// serves the forward; an undefined tensor when stock must run the call.
at::Tensor cross_entropy_served(TfEntry entry, const at::Tensor& logits, const at::Tensor& target,
                                int64_t reduction, int64_t ignore_index, double label_smoothing,
                                at::ScalarType loss_dtype) {
  if (!logits.is_cuda() || traced(logits) || traced(target) || composition_only({logits}))
    return at::Tensor();
  label_smoothing = effective_smoothing(label_smoothing);
  const TfCrossEntropyCall call =
      forward_call(logits, target, reduction, ignore_index, label_smoothing, loss_dtype);
  TfOutputs out{};
  if (!fused_by_rust(entry, logits, call, out)) return at::Tensor();
  auto [loss, lse, total_weight] = take_outputs(out);
  return with_gradient(logits, target, loss, lse, total_weight, reduction, ignore_index,
                       label_smoothing);
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
  label_smoothing = effective_smoothing(label_smoothing);
  TfCrossEntropyCall call =
      forward_call(logits, target, reduction, ignore_index, label_smoothing, loss_dtype);
  call.plan_only = 1;
  TfOutputs out{};
  if (!fused_by_rust(TF_ENTRY_CROSS_ENTROPY, logits, call, out))
    return at::Tensor();
  CrossEntropyOutputs outputs;
  {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    outputs = call_cross_entropy_fwd(logits, target, reduction, ignore_index, label_smoothing,
                                     loss_dtype);
  }
  auto& [loss, lse, total_weight] = outputs;
  return with_gradient(logits, target, loss, lse, total_weight, reduction, ignore_index,
                       label_smoothing);
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

}  // namespace

bool register_cross_entropy(uint32_t entry, const char* name, torch::Library* aten) {
  using c10::DispatchKey;
  switch (entry) {
    case TF_ENTRY_CROSS_ENTROPY:
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("cross_entropy", TORCH_FN(cross_entropy));
      torchfuse_impl(DispatchKey::Autograd)
          .impl("cross_entropy", TORCH_FN(cross_entropy_autograd));
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("cross_entropy_fwd", TORCH_FN(cross_entropy_fwd_stock));
      torchfuse_impl(DispatchKey::CUDA).impl("cross_entropy_fwd", TORCH_FN(cross_entropy_fwd_cuda));
      torchfuse_impl(DispatchKey::Meta).impl("cross_entropy_fwd", TORCH_FN(cross_entropy_fwd_meta));
      return true;
    case TF_ENTRY_CROSS_ENTROPY_BACKWARD:
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("cross_entropy_bwd", TORCH_FN(cross_entropy_bwd_stock));
      torchfuse_impl(DispatchKey::CUDA).impl("cross_entropy_bwd", TORCH_FN(cross_entropy_bwd_cuda));
      torchfuse_impl(DispatchKey::Meta).impl("cross_entropy_bwd", TORCH_FN(cross_entropy_bwd_meta));
      return true;
    case TF_ENTRY_CROSS_ENTROPY_LOSS:
      aten->impl(name, TORCH_FN(aten_cross_entropy_loss));
      return true;
    default: return false;
  }
}

}  // namespace torchfuse_glue
