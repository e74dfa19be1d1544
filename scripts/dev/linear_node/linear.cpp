#include <ATen/ATen.h>
#include <torch/library.h>
#include <torch/csrc/autograd/custom_function.h>
#include <ATen/ExpandUtils.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One autograd node for F.linear of x, w and b cast to `dtype` below autograd (stock's forward,
// bitwise), its backward the calls stock's formulas make: a prototype for issue 40's design
// record (docs/bench/train/issue40-linear-node.md), CPU only, not part of the product.
struct LinearNode : public torch::autograd::Function<LinearNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const c10::optional<at::Tensor>& b, int64_t dtype_i) {
    auto dtype = static_cast<at::ScalarType>(dtype_i);
    at::AutoDispatchBelowADInplaceOrView guard;
    auto x_lp = x.scalar_type() == dtype ? x : x.to(dtype);
    auto w_lp = w.scalar_type() == dtype ? w : w.to(dtype);
    c10::optional<at::Tensor> b_lp;
    if (b.has_value() && b->defined()) b_lp = b->scalar_type() == dtype ? *b : b->to(dtype);
    auto y = at::linear(x_lp, w_lp, b_lp);
    ctx->save_for_backward({x_lp.reshape({-1, x.size(-1)}), w_lp});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    ctx->saved_data["has_b"] = b_lp.has_value();
    ctx->saved_data["b_dtype"] = b_lp.has_value() ? static_cast<int64_t>(b->scalar_type()) : int64_t(0);
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto x2d = saved[0], w_lp = saved[1];
    auto g2 = grads[0].reshape({-1, w_lp.size(0)});
    auto xs = ctx->saved_data["x_sizes"].toIntVector();
    auto dx = g2.mm(w_lp).reshape(xs).to(static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt()));
    auto dw = g2.t().mm(x2d).to(static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt()));
    at::Tensor db;
    if (ctx->saved_data["has_b"].toBool())
      db = at::sum_to(g2, at::IntArrayRef{w_lp.size(0)}).to(static_cast<at::ScalarType>(ctx->saved_data["b_dtype"].toInt()));
    return {dx, dw, db, at::Tensor()};
  }
};

at::Tensor linear_node(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b, int64_t dtype) {
  return LinearNode::apply(x, w, b, dtype);
}

TORCH_LIBRARY(proto, m) { m.def("linear_node(Tensor x, Tensor w, Tensor? b, int dtype) -> Tensor"); }
TORCH_LIBRARY_IMPL(proto, Autograd, m) { m.impl("linear_node", linear_node); }
TORCH_LIBRARY_IMPL(proto, CompositeExplicitAutograd, m) {
  m.impl("linear_node", [](const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b, int64_t d) {
    auto dt = static_cast<at::ScalarType>(d);
    c10::optional<at::Tensor> bl; if (b.has_value() && b->defined()) bl = b->to(dt);
    return at::linear(x.to(dt), w.to(dt), bl);
  });
}

// The same as a plain autograd Node (what PyTorch's generated nodes are): members instead of
// the Function API's saved_data map, one SavedVariable per saved tensor.
struct LinearBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable x2d, w_lp;
  std::vector<int64_t> x_sizes;
  at::ScalarType x_dtype, w_dtype, b_dtype;
  bool has_b = false;
  variable_list apply(variable_list&& grads) override {
    auto x2 = x2d.unpack(), w = w_lp.unpack();
    auto g2 = grads[0].reshape({-1, w.size(0)});
    variable_list out(3);
    if (should_compute_output(0)) out[0] = g2.mm(w).reshape(x_sizes).to(x_dtype);
    if (should_compute_output(1)) out[1] = g2.t().mm(x2).to(w_dtype);
    if (has_b && should_compute_output(2)) out[2] = at::sum_to(g2, at::IntArrayRef{w.size(0)}).to(b_dtype);
    return out;
  }
  void release_variables() override { x2d.reset_data(); w_lp.reset_data(); }
  std::string name() const override { return "LinearBackward"; }
};

at::Tensor linear_node_lean(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
                            int64_t dtype_i) {
  auto dtype = static_cast<at::ScalarType>(dtype_i);
  const at::Tensor bias = b.has_value() ? *b : at::Tensor();
  at::Tensor x_lp, w_lp, y;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    x_lp = x.scalar_type() == dtype ? x : x.to(dtype);
    w_lp = w.scalar_type() == dtype ? w : w.to(dtype);
    c10::optional<at::Tensor> b_lp;
    if (bias.defined()) b_lp = bias.scalar_type() == dtype ? bias : bias.to(dtype);
    y = at::linear(x_lp, w_lp, b_lp);
  }
  if (torch::autograd::compute_requires_grad(x, w, bias)) {
    auto node = std::shared_ptr<LinearBackward>(new LinearBackward(), torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(x, w, bias));
    node->x2d = torch::autograd::SavedVariable(x_lp.reshape({-1, x.size(-1)}), false);
    node->w_lp = torch::autograd::SavedVariable(w_lp, false);
    node->x_sizes = x.sizes().vec();
    node->x_dtype = x.scalar_type();
    node->w_dtype = w.scalar_type();
    node->has_b = bias.defined();
    node->b_dtype = bias.defined() ? bias.scalar_type() : dtype;
    torch::autograd::set_history(y, node);
  }
  return y;
}

TORCH_LIBRARY_FRAGMENT(proto, m) { m.def("linear_node_lean(Tensor x, Tensor w, Tensor? b, int dtype) -> Tensor"); }
TORCH_LIBRARY_IMPL(proto, Autograd, m) { m.impl("linear_node_lean", linear_node_lean); }
