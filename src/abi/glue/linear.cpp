// torchfuse::linear_cast(input, weight, bias, dtype): F.linear of the weight and bias cast to
// `dtype` (autocast's casts) and the input, as one autograd node. Under CUDA autocast stock
// makes a Linear of an op and a node per cast (weight and bias: ToCopyBackward0), a transpose
// (TBackward0), reshapes (ViewBackward0) and the GEMM (AddmmBackward0 or MmBackward0): five or
// six nodes for the backward engine to run, and as many ops for the host to dispatch. Here the
// forward is stock's (the same casts, then at::linear below autograd: the same kernels) and the
// backward makes exactly the calls stock's formulas make (mm_mat1_backward, mm_mat2_backward,
// the bias's sum_to, the casts back), so every gradient is stock's, bit for bit. It saves what
// stock saves, no more: the input only where the weight needs a gradient, the weight's cast only
// where the input does.
//
// Rust decides where the node runs (src/ops/linear.rs: where it is exact, an input already in
// `dtype` among it: the caller casts the input with stock's op, so that cast keeps its own node
// and a double backward reaches it) and counts the call; forward-mode AD, functorch transforms
// and traces take the composition through autograd (stock's nodes) before asking.
//
// Autocast's weight cache: within an autocast region stock casts a leaf weight once however
// often it is used. The node keeps that: a weight's cast is remembered (weakly) while something
// still holds it (the nodes that saved it) and the weight's version is unchanged, where
// autocast's cache is on. A reused module costs no second copy.
#include "glue.h"

#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <unordered_map>

namespace torchfuse_glue {
namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

at::Tensor linear_cast_stock(const at::Tensor& input, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, at::ScalarType dtype) {
  std::optional<at::Tensor> bias_cast;
  if (bias.has_value() && bias->defined()) bias_cast = bias->to(dtype);
  return at::linear(input.to(dtype), weight.to(dtype), bias_cast);
}

// Stock's nodes for a call the node does not take. Under the autocast the call stands for (the
// rewrite's case), nn.Linear's own call: autocast casts, its weight cache included.
at::Tensor linear_cast_composition(const at::Tensor& input, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, at::ScalarType dtype) {
  const c10::DeviceType device = input.device().type();
  if (at::autocast::is_autocast_available(device) && at::autocast::is_autocast_enabled(device) &&
      at::autocast::get_autocast_dtype(device) == dtype && input.scalar_type() == dtype)
    return at::linear(input, weight, bias);
  return linear_cast_stock(input, weight, bias, dtype);
}

// A parameter's cast, remembered while it is alive and the parameter unchanged (autocast's
// cache, for leaves requiring grad, where the cache is on).
struct RememberedCast {
  c10::weak_intrusive_ptr<c10::TensorImpl> param;
  c10::weak_intrusive_ptr<c10::TensorImpl> cast;
  uint32_t version;
  at::ScalarType dtype;
};

at::Tensor param_cast(const at::Tensor& param, at::ScalarType dtype) {
  if (param.scalar_type() == dtype) return param;
  if (!(param.is_leaf() && param.requires_grad() && at::autocast::is_autocast_cache_enabled()))
    return param.to(dtype);
  thread_local std::unordered_map<const c10::TensorImpl*, RememberedCast> remembered;
  const c10::TensorImpl* key = param.unsafeGetTensorImpl();
  const uint32_t version = param._version();
  const auto found = remembered.find(key);
  if (found != remembered.end() && found->second.dtype == dtype &&
      found->second.version == version && found->second.param.lock().get() == key) {
    c10::intrusive_ptr<c10::TensorImpl> cast = found->second.cast.lock();
    if (cast) return at::Tensor(std::move(cast));
  }
  at::Tensor cast = param.to(dtype);
  if (remembered.size() >= 4096) {  // forget the dead ones now and then
    for (auto it = remembered.begin(); it != remembered.end();)
      it = it->second.cast.expired() ? remembered.erase(it) : std::next(it);
  }
  remembered.insert_or_assign(
      key, RememberedCast{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()),
                          c10::weak_intrusive_ptr<c10::TensorImpl>(cast.getIntrusivePtr()),
                          version, dtype});
  return cast;
}

// The backward of the whole Linear. Edges: input, weight, bias.
struct LinearCastBackward : public torch::autograd::Node {
  // The input (its 2-D view is made again here, as stock's addmm saved it), where the weight
  // needs a gradient; the weight's cast where the input does: what stock saves.
  SavedVariable input, weight_cast;
  // A cast weight itself (a leaf, alive anyway, so not a saved tensor that hooks would move or
  // offload) and its version, for a create_graph backward's cast.
  at::Tensor cast_leaf;
  uint32_t cast_leaf_version = 0;
  std::vector<int64_t> input_sizes;
  at::ScalarType dtype = at::kFloat, weight_dtype = at::kFloat, bias_dtype = at::kFloat;
  int64_t in_features = 0, out_features = 0;
  bool has_bias = false;
  // Stock's stride tests (mm_mat1_backward on the input's 2-D view, mm_mat2_backward on the
  // weight cast's transpose), read in the forward.
  bool input_column_major = false, weight_t_column_major = true;

  variable_list apply(variable_list&& grads) override {
    variable_list out(3);
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return out;
    // The output's view (or matmul's _unsafe_view) back to the GEMM's [rows, out] gradient.
    const at::Tensor grad_2d = grad.reshape({-1, out_features});
    if (should_compute_output(0)) {
      // create_graph: the weight's cast made again through autograd, so that the input's
      // gradient depends on the weight as stock's does. (A cast weight's two second-order
      // terms then meet at the weight, each cast back, where stock's meet at its cast and are
      // cast once: that gradient is one bf16 rounding nearer than stock's, not bit for bit.)
      const at::Tensor w = at::GradMode::is_enabled() && cast_leaf.defined()
                               ? leaf_cast_again()
                               : weight_cast.unpack();
      const at::Tensor grad_input =
          input_column_major ? w.t().mm(grad_2d.t()).t() : grad_2d.mm(w);
      out[0] = grad_input.reshape(input_sizes);
    }
    if (should_compute_output(1)) {
      // mm_mat2_backward for mat2 = w.t(), then TBackward0's transpose and ToCopyBackward0's
      // cast.
      const at::Tensor input_2d = input.unpack().reshape({-1, in_features});
      const at::Tensor grad_weight_t = weight_t_column_major ? grad_2d.t().mm(input_2d).t()
                                                             : input_2d.t().mm(grad_2d);
      out[1] = grad_weight_t.t().to(weight_dtype);
    }
    if (has_bias && should_compute_output(2)) {
      // addmm's gradient of its broadcast bias, reduced by the engine (InputMetadata::reduce_grad).
      out[2] = at::sum_to(grad_2d, c10::IntArrayRef{out_features}).to(bias_dtype);
    }
    return out;
  }

  void release_variables() override {
    input.reset_data();
    weight_cast.reset_data();
    cast_leaf.reset();
  }

  at::Tensor leaf_cast_again() const {
    TORCH_CHECK(cast_leaf._version() == cast_leaf_version,
                "one of the variables needed for gradient computation has been modified by an "
                "inplace operation: the weight of a Linear (torchfuse::linear_cast) is at version ",
                cast_leaf._version(), "; expected version ", cast_leaf_version, " instead.");
    return cast_leaf.to(dtype);
  }

  std::string name() const override { return "torchfuse::LinearCastBackward"; }
};

at::Tensor linear_cast_autograd(const at::Tensor& input, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias_opt, at::ScalarType dtype) {
  const at::Tensor bias = bias_opt.has_value() ? *bias_opt : at::Tensor();
  // Transforms, forward-mode AD, and tensors or modes a trace watches (fake tensors, make_fx,
  // functionalization: they see stock's ops) take the composition.
  if (composition_only({input, weight, bias}) || traced(input) || traced(weight) ||
      (bias.defined() && traced(bias)))
    return linear_cast_composition(input, weight, bias_opt, dtype);
  // Rust decides (and counts) whether the node serves this call.
  TfLinearCall call{};
  call.input = describe(input);
  call.weight = describe(weight);
  call.bias = describe(bias_opt);
  call.dtype = static_cast<int16_t>(dtype);
  call.weight_leaf = weight.is_leaf();
  // Nothing is launched: no stream, no device guard.
  const TfLaunch where{input.is_cuda() ? static_cast<int32_t>(input.get_device()) : -1, nullptr};
  TfOutputs unused{};
  if (!fused_by_rust(TF_ENTRY_LINEAR_CAST, where, call, unused))
    return linear_cast_composition(input, weight, bias_opt, dtype);
  const bool needs_node = at::GradMode::is_enabled() &&
                          torch::autograd::compute_requires_grad(input, weight, bias);
  at::Tensor weight_cast, output;
  bool input_column_major = false;
  {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    // The casts are made here; autocast's own wrapper of linear would find nothing to cast.
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
    weight_cast = param_cast(weight, dtype);
    std::optional<at::Tensor> bias_cast;
    if (bias.defined()) bias_cast = param_cast(bias, dtype);
    output = at::linear(input, weight_cast, bias_cast);
    const at::Tensor input_2d = input.reshape({-1, input.size(-1)});
    input_column_major = input_2d.stride(0) == 1 && input_2d.stride(1) == input_2d.size(0);
  }
  if (!needs_node) return output;
  auto node = std::shared_ptr<LinearCastBackward>(new LinearCastBackward(),
                                                  torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias));
  node->input_sizes = input.sizes().vec();
  node->dtype = dtype;
  node->weight_dtype = weight.scalar_type();
  node->in_features = weight.size(1);
  node->out_features = weight.size(0);
  node->has_bias = bias.defined();
  if (node->has_bias) node->bias_dtype = bias.scalar_type();
  node->input_column_major = input_column_major;
  node->weight_t_column_major =
      weight_cast.stride(1) == 1 && weight_cast.stride(0) == weight_cast.size(1);
  if (node->should_compute_output(1)) node->input = SavedVariable(input, false);
  if (node->should_compute_output(0)) {
    node->weight_cast = SavedVariable(weight_cast, false);
    if (weight.scalar_type() != dtype) {
      node->cast_leaf = weight;
      node->cast_leaf_version = weight._version();
    }
  }
  torch::autograd::set_history(output, node);
  return output;
}

}  // namespace

bool register_linear(uint32_t entry, const char* /*name*/, torch::Library* /*aten*/) {
  using c10::DispatchKey;
  switch (entry) {
    case TF_ENTRY_LINEAR_CAST:
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("linear_cast", TORCH_FN(linear_cast_stock));
      torchfuse_impl(DispatchKey::Autograd).impl("linear_cast", TORCH_FN(linear_cast_autograd));
      return true;
    default: return false;
  }
}

}  // namespace torchfuse_glue
