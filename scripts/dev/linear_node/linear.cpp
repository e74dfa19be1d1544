#include <ATen/ATen.h>
#include <torch/library.h>
#include <torch/csrc/autograd/custom_function.h>
#include <ATen/ExpandUtils.h>

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One autograd node for F.linear of x, w, b cast to `dtype` (casts inside when `fuse_casts`).
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
