// torchfuse::linear_cast(input, weight, bias, dtype): F.linear of the input, weight and bias cast
// to `dtype` (autocast's casts; none where they are in `dtype`, a Linear without autocast), its
// GEMM and reshapes as one autograd node. Stock's Linear dispatches, besides autocast's casts, a
// transpose, reshapes and the GEMM, each an op through autograd and a node for the backward
// engine (TBackward0, ViewBackward0, AddmmBackward0 or MmBackward0, ViewBackward0 or
// UnsafeViewBackward0). Here:
// - the casts are stock's own: autocast's cached_cast where autocast runs in `dtype` on the
//   input's device (its weight cache, its ToCopyBackward0 nodes), `.to` otherwise;
// - the forward is at::linear below autograd (the same kernels);
// - one node's backward makes exactly the calls stock's formulas make (mm_mat1_backward and
//   mm_mat2_backward with their stride tests, TBackward0's transpose, the engine's sum_to for
//   the broadcast bias), so every gradient is stock's, bit for bit, a double backward's too;
// - it saves what stock's GEMM saves: the input where the weight needs a gradient, the weight's
//   cast where the input does.
// With `weight_in_out` the weight is [in, out] and the call is HF's Conv1D (GPT-2's projections):
// addmm of the bias, the input's 2-D view and the weight as it is, viewed back (its code's
// kernels), one node for stock's ViewBackward0, AddmmBackward0 and ViewBackward0.
// The attention's head views (the `head_views` rewrite) may come into the node too:
// - `out_head_dim` > 0: the output is returned as HF's `y.view(*lead, -1, head_dim).transpose(1,
//   2)` (q, k, v split into heads), where stock runs a ViewBackward0 and a TransposeBackward0;
//   with `transpose_heads` false as the view alone (Qwen3's q and k, normed before the transpose);
// - `merge_input_heads`: the input [*lead, heads, head_dim] is taken as HF's `x.reshape(*lead,
//   -1).contiguous()` (the attention's output before o_proj), where stock runs a ViewBackward0.
// The backward makes the same calls on the gradient as those nodes (transpose, reshape), so the
// gradients are stock's bit for bit.
// torchfuse::linear_cast_split(..., split_sizes, head_dim, sliced) returns the output split into
// chunks of those widths, each viewed and transposed into heads (q, k, v):
// - GPT-2's attention splits c_attn's output so (`split(split_size, dim=2)`): stock runs a
//   SplitBackward0, then a ViewBackward0 and a TransposeBackward0 for each chunk;
// - Phi-3's slices its qkv_proj's (`sliced`): a SliceBackward0 for each, whose zero-padded
//   full-size gradients the engine sums.
// Its backward gives those nodes' values: each chunk's gradient transposed back and reshaped (a
// copy where the attention's gradient is not in token order), then one cat (a chunk without a
// gradient zeros), plus the sum's +0.0 for slices. On CUDA each chunk's gradient is copied once
// into its columns of the cat's output by kv_copy's rows kernel (`chunks_written`): the same
// bits at one pass a chunk (GPT-2 B32: 1.1 against 2.7 ms a step). The same copy made by
// PyTorch's strided copy_ was slower than stock's calls (its strided path is not vectorized).
// Rust decides where the node runs (src/ops/linear.rs: where it is exact) and counts the call;
// forward-mode AD, functorch transforms and traces take the composition (stock's nodes) first.
//
// With the `weight_cast` toggle on, under autocast the node also casts an fp32 weight and bias
// itself (below autograd: the same `_to_copy` kernel autocast runs) and keeps its edges to the
// parameters; its backward casts their gradients back as ToCopyBackward0 would (`.to` of the
// parameter's dtype). The host is spared a dispatched cast and a ToCopyBackward0 node for each.
// Autocast's cache shares a leaf's cast between its users until the outermost autocast exits;
// `CastMemo` below keeps the same sharing for the node's casts (within a thread). What differs
// from stock: a weight several Linears take in one region has each user's gradient cast back
// before the engine adds them (an fp32 sum where stock adds the 16-bit gradients, then casts
// once), within the correctness contract; with one user, every value is stock's bit for bit. A
// double backward gets the cast's node back (`CastBackward`) on the saved cast, so its
// gradients reach the parameter; the cast has two users there (the forward's GEMM and the first
// backward's), so the weight's second-order gradient is such an fp32 sum too.
#include "glue.h"

#include <ATen/TensorUtils.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <algorithm>
#include <numeric>
#include <unordered_map>

namespace torchfuse_glue {
namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// The GEMM's view of the input: HF Conv1D's `x.view(-1, x.size(-1))`; for a Linear, a 2-D
// input itself (addmm's or mm's operand, its strides as they are), another flattened as linear
// flattens it.
at::Tensor input_2d(const at::Tensor& t, bool weight_in_out) {
  if (weight_in_out) return t.view_symint({-1, t.sym_size(-1)});
  return t.dim() == 2 ? t : t.reshape_symint({-1, t.sym_size(-1)});
}

// F.linear, or (`weight_in_out`) HF Conv1D's forward where there is a bias (its code: addmm of
// the bias, the input's 2-D view and the weight, viewed to the input's leading dims and `out`).
at::Tensor linear_of(const at::Tensor& input, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, bool weight_in_out) {
  if (!weight_in_out) return at::linear(input, weight, bias);
  if (!bias.has_value() || !bias->defined()) return at::linear(input, weight.t(), std::nullopt);
  std::vector<c10::SymInt> size_out = input.sym_sizes().vec();
  TORCH_CHECK(!size_out.empty(), "linear_cast: a 0-dim input has no features");
  size_out.back() = weight.sym_size(1);
  return at::addmm(*bias, input_2d(input, true), weight).view_symint(size_out);
}

// HF's heads merged before o_proj: `x.reshape(*x.shape[:-2], -1).contiguous()`.
at::Tensor merged_heads(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 2, "linear_cast: merge_input_heads needs an input of two or more dims");
  return x.flatten(-2).contiguous();
}

// HF's split into heads: `y.view(*y.shape[:-1], -1, head_dim).transpose(1, 2)`, or the view
// alone.
at::Tensor split_heads(const at::Tensor& y, int64_t head_dim, bool transpose) {
  std::vector<c10::SymInt> sizes = y.sym_sizes().vec();
  TORCH_CHECK(!sizes.empty(), "linear_cast: a 0-dim output has no heads");
  sizes.back() = -1;
  sizes.emplace_back(head_dim);
  const at::Tensor heads = y.view_symint(sizes);
  return transpose ? heads.transpose(1, 2) : heads;
}

// A packed projection's output split into q, k and v heads: `y.split_with_sizes(split_sizes,
// -1)` (GPT-2's split), or with `sliced` the same views as slices (Phi-3's
// `qkv[..., start:end]`), each chunk `view(*lead, -1, head_dim).transpose(1, 2)`.
std::vector<at::Tensor> split_into_heads(const at::Tensor& y, at::IntArrayRef split_sizes,
                                         int64_t head_dim, bool sliced) {
  std::vector<at::Tensor> chunks;
  if (sliced) {
    int64_t start = 0;
    for (const int64_t size : split_sizes) {
      chunks.push_back(y.narrow(-1, start, size));
      start += size;
    }
  } else {
    chunks = y.split_with_sizes(split_sizes, -1);
  }
  std::vector<at::Tensor> out;
  for (const at::Tensor& chunk : chunks) out.push_back(split_heads(chunk, head_dim, true));
  return out;
}

// The linear of the three cast to `dtype`. An autocast of another dtype does not cast them again
// (the node's GEMM runs below autocast too).
at::Tensor linear_cast_plain(const at::Tensor& input, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, at::ScalarType dtype,
                             bool weight_in_out) {
  std::optional<at::Tensor> bias_cast;
  if (bias.has_value() && bias->defined()) bias_cast = bias->to(dtype);
  const at::Tensor input_cast = input.to(dtype), weight_cast = weight.to(dtype);
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return linear_of(input_cast, weight_cast, bias_cast, weight_in_out);
}

// How the node gives its output: whole, split into heads (`head_dim` > 0: `split_heads`), or
// split (or sliced) into chunks of `split_sizes` columns first, each split into heads and
// transposed (`split_into_heads`).
struct OutputHeads {
  int64_t head_dim = 0;
  bool transpose = true;
  std::vector<int64_t> split_sizes;
  bool sliced = false;

  std::vector<at::Tensor> of(const at::Tensor& y) const {
    if (!split_sizes.empty()) return split_into_heads(y, split_sizes, head_dim, sliced);
    return {head_dim > 0 ? split_heads(y, head_dim, transpose) : y};
  }
};

// The heads of linear_cast's arguments, and of linear_cast_split's.
OutputHeads heads_of(int64_t out_head_dim, bool transpose_heads) {
  TORCH_CHECK(out_head_dim >= 0, "linear_cast: out_head_dim must not be negative");
  return OutputHeads{out_head_dim, transpose_heads, {}};
}

OutputHeads split_heads_of(at::IntArrayRef split_sizes, int64_t head_dim, bool sliced) {
  TORCH_CHECK(!split_sizes.empty() && head_dim > 0,
              "linear_cast_split: split_sizes must not be empty and head_dim must be positive");
  return OutputHeads{head_dim, true, split_sizes.vec(), sliced};
}

// The op's meaning spelled out: the heads merged, the linear, the output as `heads` gives it.
std::vector<at::Tensor> spelled_out(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, at::ScalarType dtype,
                                    bool weight_in_out, const OutputHeads& heads,
                                    bool merge_input_heads) {
  return heads.of(linear_cast_plain(merge_input_heads ? merged_heads(input) : input, weight, bias,
                                    dtype, weight_in_out));
}

at::Tensor linear_cast_stock(const at::Tensor& input, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, at::ScalarType dtype,
                             bool weight_in_out, int64_t out_head_dim, bool merge_input_heads,
                             bool transpose_heads) {
  return spelled_out(input, weight, bias, dtype, weight_in_out,
                     heads_of(out_head_dim, transpose_heads), merge_input_heads)[0];
}

std::vector<at::Tensor> linear_cast_split_stock(const at::Tensor& input, const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias,
                                               at::ScalarType dtype, bool weight_in_out,
                                               at::IntArrayRef split_sizes, int64_t head_dim,
                                               bool sliced) {
  return spelled_out(input, weight, bias, dtype, weight_in_out,
                     split_heads_of(split_sizes, head_dim, sliced), false);
}

// Whether autocast runs in `dtype` on this device: then a cast is autocast's own (cached).
bool autocast_in(c10::DeviceType device, at::ScalarType dtype) {
  return at::autocast::is_autocast_available(device) && at::autocast::is_autocast_enabled(device) &&
         at::autocast::get_autocast_dtype(device) == dtype;
}

// Stock's nodes for a call the node does not take. Under the autocast the call stands for (the
// rewrite's case), the module's own code, autocast's casts included.
std::vector<at::Tensor> linear_cast_composition(const at::Tensor& input, const at::Tensor& weight,
                                                const std::optional<at::Tensor>& bias,
                                                at::ScalarType dtype, bool weight_in_out,
                                                const OutputHeads& heads, bool merge_input_heads) {
  const at::Tensor x = merge_input_heads ? merged_heads(input) : input;
  const at::Tensor y = autocast_in(input.device().type(), dtype)
                           ? linear_of(x, weight, bias, weight_in_out)
                           : linear_cast_plain(x, weight, bias, dtype, weight_in_out);
  return heads.of(y);
}

// A cast through autograd, as autocast's linear makes it (its cache takes fp32 leaves that
// need a gradient: a weight, a bias, an input made a leaf).
at::Tensor stock_cast(const at::Tensor& t, at::ScalarType dtype, bool autocast) {
  return autocast ? at::autocast::cached_cast(dtype, t, t.device().type()) : t.to(dtype);
}

// The casts the node made in the current autocast region, as autocast's cache would share them,
// one memo a thread (its entries are keyed by the source, on any device). The region is read
// from autocast's cache itself, which is process-wide and cleared whole (the outermost
// autocast's exit, torch.clear_autocast_cache()): a one-element fp32 CPU leaf's cached cast (to
// CPU autocast's 16-bit dtype) stays the same tensor until then. Entries hold weak references: a
// cast lives only as long as a node saves it, never longer than stock's.
struct CastMemo {
  using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  struct Cast {
    Weak source, cast;
    at::ScalarType dtype;
  };
  at::Tensor probe, probe_cast;
  std::unordered_map<const c10::TensorImpl*, Cast> casts;
};

// This thread's memo, its region brought up to date; null where nothing may be shared: with
// autocast's cache off (stock casts at every use then), or where the probe cannot be cached
// (CPU autocast's dtype not 16-bit: the probe's "cast" would be the probe itself forever).
CastMemo* cast_memo() {
  if (!at::autocast::is_autocast_cache_enabled()) return nullptr;
  const at::ScalarType probe_dtype = at::autocast::get_autocast_dtype(at::kCPU);
  if (probe_dtype != at::kBFloat16 && probe_dtype != at::kHalf) return nullptr;
  thread_local CastMemo memo;
  if (!memo.probe.defined()) {
    at::Tensor probe = at::zeros({1}, at::TensorOptions().dtype(at::kFloat));
    probe.set_requires_grad(true);
    memo.probe = std::move(probe);  // only once made: a failure leaves none, tried again next call
  }
  const at::Tensor cast = at::autocast::cached_cast(probe_dtype, memo.probe, at::kCPU);
  if (!memo.probe_cast.defined() ||
      cast.unsafeGetTensorImpl() != memo.probe_cast.unsafeGetTensorImpl()) {
    memo.casts.clear();  // a new region (the old probe cast is held: no new one takes its address)
    memo.probe_cast = cast;
  }
  return &memo;
}

// `t` cast to `dtype` inside the node: no autograd history (the node keeps the edge to `t`),
// shared through `memo` where autocast's cache would share it (an fp32 leaf that needs a
// gradient, not a view).
at::Tensor node_cast(CastMemo* memo, const at::Tensor& t, at::ScalarType dtype) {
  const bool shared = memo != nullptr && t.is_leaf() && t.requires_grad() && !t.is_view() &&
                      t.scalar_type() == at::kFloat;
  if (shared) {
    const auto found = memo->casts.find(t.unsafeGetTensorImpl());
    if (found != memo->casts.end() && found->second.dtype == dtype &&
        found->second.source.lock().get() == t.unsafeGetTensorImpl()) {
      auto cast = found->second.cast.lock();
      if (cast) return at::Tensor(std::move(cast));
    }
  }
  at::Tensor cast;
  {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    cast = t.to(dtype);
  }
  if (shared)
    memo->casts.insert_or_assign(
        t.unsafeGetTensorImpl(),
        CastMemo::Cast{CastMemo::Weak(t.getIntrusivePtr()), CastMemo::Weak(cast.getIntrusivePtr()),
                       dtype});
  return cast;
}

// Whether the `weight_cast` toggle is on (asked of Rust, which owns the toggles).
bool weight_cast_enabled() {
  static constexpr char kName[] = "weight_cast";
  TfStatus status;
  status.code = TF_STOCK;
  status.message[0] = '\0';
  torchfuse_rs_enabled(kName, sizeof(kName) - 1, &status);
  return status.code == TF_FUSED;
}

// ToCopyBackward0 for a cast the node made: the gradient back to the parameter's fp32. Only a
// double backward makes one (on the saved cast), so that the gradient's own graph reaches the
// parameter as through stock's cast.
struct CastBackward : public torch::autograd::Node {
  variable_list apply(variable_list&& grads) override {
    return {grads[0].defined() ? grads[0].to(at::kFloat) : at::Tensor()};
  }
  std::string name() const override { return "torchfuse::CastBackward"; }
};

// `cast` (saved without history) as the output of a cast node whose edge is `edge`.
at::Tensor with_cast_history(const at::Tensor& cast, const torch::autograd::Edge& edge) {
  auto node = std::shared_ptr<CastBackward>(new CastBackward(), torch::autograd::deleteNode);
  node->set_next_edges({edge});
  at::Tensor out = cast.detach();
  torch::autograd::set_history(out, node);
  return out;
}

// The backward of the GEMM and reshapes. Edges: the input's cast, the weight's, the bias's (each
// the tensor itself where it needed none, or where the node cast it).
struct LinearCastBackward : public torch::autograd::Node {
  // The input (its 2-D view is made again here, as stock's addmm saved it) where the weight
  // needs a gradient; the weight's cast where the input does.
  SavedVariable input, weight_cast;
  std::vector<int64_t> input_sizes;
  int64_t in_features = 0, out_features = 0;
  // The output's head split (`out_head_dim`): the GEMM's output sizes, which the gradient of
  // the [*lead, heads, head_dim] view (transposed back where it was transposed) is reshaped to;
  // empty without one.
  std::vector<int64_t> output_sizes;
  // How the forward gave its output (`heads.split_sizes`: chunks of these widths first, one
  // output each, for `linear_cast_split`; `heads.sliced`: the chunks stand for slices, Phi-3's,
  // whose zero-padded gradients the engine sums).
  OutputHeads heads;
  bool has_bias = false;
  // The weight is [in, out], the GEMM's second operand as it is (HF Conv1D); else nn.Linear's
  // [out, in], whose transpose the GEMM takes.
  bool weight_in_out = false;
  // Stock's stride tests (mm_mat1_backward on the input's 2-D view, mm_mat2_backward on the
  // GEMM's second operand), read in the forward.
  bool input_column_major = false, mat2_column_major = true;
  // The node cast the (fp32) weight and bias itself (`weight_cast`): their gradients go back to
  // fp32 here, as their ToCopyBackward0 nodes would take them.
  bool casts_in_node = false;

  // The GEMM output's gradient from the split chunks' (undefined where none has one): stock's
  // TransposeBackward0 and ViewBackward0 of each, then SplitBackward0's cat with zeros for a
  // chunk without one. Slices' gradients reach stock's GEMM as the engine's sum of their
  // zero-padded gradients: where two or more have one, every element gains +0.0 (a -0.0 becomes
  // +0.0, every other value stays). The cat then gains +0.0 too, one pass, for the same bits.
  at::Tensor split_gradient(const variable_list& grads) const {
    const auto first = std::find_if(grads.begin(), grads.end(),
                                    [](const at::Tensor& g) { return g.defined(); });
    if (first == grads.end()) return at::Tensor();
    at::Tensor grad = chunks_written(grads);
    if (!grad.defined()) {
      std::vector<int64_t> chunk_sizes = output_sizes;
      std::vector<at::Tensor> chunks;
      for (size_t i = 0; i < grads.size(); ++i) {
        chunk_sizes.back() = heads.split_sizes[i];
        chunks.push_back(grads[i].defined() ? grads[i].transpose(1, 2).reshape(chunk_sizes)
                                            : at::zeros(chunk_sizes, first->options()));
      }
      grad = at::cat(chunks, -1);
    }
    const auto given = std::count_if(grads.begin(), grads.end(),
                                     [](const at::Tensor& g) { return g.defined(); });
    if (!heads.sliced || given < 2) return grad;  // one slice's gradient is summed with nothing
    return at::GradMode::is_enabled() ? at::add(grad, 0) : grad.add_(0);
  }

  // The cat's output made directly: each chunk's gradient, [*lead, heads, tokens, head_dim] as
  // the attention hands it back, copied once into the columns it takes of a new contiguous
  // tensor (kv_copy's rows kernel). Stock transposes each chunk back, reshapes it (a strided
  // copy wherever the chunk is not laid out token-major) and cats the three: the same values
  // in the cat's layout, at one pass over each chunk instead of up to two. Undefined (stock's
  // calls then) in a double backward (the graph is stock's differentiable ops'), for a chunk
  // without a gradient, and for gradients that are not CUDA tensors of one dtype and device
  // with the chunks' sizes.
  at::Tensor chunks_written(const variable_list& grads) const {
    if (at::GradMode::is_enabled() || output_sizes.size() != 3) return at::Tensor();
    const at::Tensor& g0 = grads[0];
    for (const auto& g : grads)
      if (!g.defined() || !g.is_cuda() || traced(g) || g.dim() != 4 ||
          g.scalar_type() != g0.scalar_type() || g.device() != g0.device())
        return at::Tensor();
    const int64_t batch = output_sizes[0], tokens = output_sizes[1];
    const std::vector<int64_t>& widths = heads.split_sizes;
    for (size_t i = 0; i < grads.size(); ++i) {
      const auto& g = grads[i];
      if (g.size(0) != batch || g.size(2) != tokens || g.size(1) * g.size(3) != widths[i])
        return at::Tensor();
    }
    std::vector<int64_t> sizes = output_sizes;
    sizes.back() = std::accumulate(widths.begin(), widths.end(), int64_t{0});
    at::Tensor grad = at::empty(sizes, g0.options());
    int64_t column = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      const auto& g = grads[i];
      const at::Tensor columns = grad.narrow(-1, column, widths[i])
                                     .view({batch, tokens, g.size(1), g.size(3)})
                                     .transpose(1, 2);
      copy_rows_into(g, columns);
      column += widths[i];
    }
    return grad;
  }

  // The output's gradient as the heads' TransposeBackward0 and ViewBackward0 make it: the
  // reshape's view where the heads' layout allows one, else its contiguous copy, made by
  // kv_copy's rows kernel below autograd (a double backward keeps stock's reshape).
  at::Tensor heads_gradient(const at::Tensor& g) const {
    const at::Tensor g_heads = heads.transpose ? g.transpose(1, 2) : g;
    if (!at::GradMode::is_enabled() && g_heads.is_cuda() && !traced(g_heads) &&
        g_heads.dim() == 4 &&
        !at::detail::computeStride(g_heads.sizes(), g_heads.strides(), output_sizes).has_value()) {
      at::Tensor copy = at::empty(g_heads.sizes(), g_heads.options());
      copy_rows_into(g_heads, copy);
      return copy.view(output_sizes);
    }
    return g_heads.reshape(output_sizes);
  }

  variable_list apply(variable_list&& grads) override {
    variable_list out(3);
    // A head split's TransposeBackward0 and ViewBackward0 (a split's SplitBackward0 too).
    const at::Tensor grad = !heads.split_sizes.empty() ? split_gradient(grads)
                            : !grads[0].defined()       ? at::Tensor()
                            : output_sizes.empty()      ? grads[0]
                                                        : heads_gradient(grads[0]);
    if (!grad.defined()) return out;
    // The output's view (or matmul's _unsafe_view) back to the GEMM's [rows, out] gradient.
    const at::Tensor grad_2d = grad.dim() == 2 ? grad : grad.reshape({-1, out_features});
    if (should_compute_output(0)) {
      // mm_mat1_backward, mat2 the weight's cast (Conv1D) or its transpose (Linear). In a double
      // backward a cast the node made gets its cast node back, as stock's has one.
      at::Tensor w = weight_cast.unpack();
      if (casts_in_node && at::GradMode::is_enabled() && next_edge(1).is_valid())
        w = with_cast_history(w, next_edge(1));
      const at::Tensor grad_input =
          weight_in_out ? (input_column_major ? w.mm(grad_2d.t()).t() : grad_2d.mm(w.t()))
                        : (input_column_major ? w.t().mm(grad_2d.t()).t() : grad_2d.mm(w));
      // A 2-D input's gradient as the GEMM made it (a reshape would restride size-one dims);
      // Conv1D's view's gradient is ViewBackward0's reshape, as a merge of heads's is.
      out[0] = input_sizes.size() == 2 && !weight_in_out ? grad_input
                                                         : grad_input.reshape(input_sizes);
    }
    if (should_compute_output(1)) {
      // mm_mat2_backward; for a Linear then TBackward0's transpose. The saved input's 2-D form
      // as the forward made it; a reshape, as a saved-tensor hook may unpack other strides.
      // A merge of heads saved the input unmerged: its rows are in_features wide.
      const at::Tensor saved = input.unpack();
      const at::Tensor mat1 = saved.dim() == 2 && !weight_in_out ? saved
                                                                 : saved.reshape({-1, in_features});
      const at::Tensor grad_mat2 =
          mat2_column_major ? grad_2d.t().mm(mat1).t() : mat1.t().mm(grad_2d);
      out[1] = weight_in_out ? grad_mat2 : grad_mat2.t();
      if (casts_in_node) out[1] = out[1].to(at::kFloat);
    }
    if (has_bias && should_compute_output(2)) {
      // addmm's gradient of its broadcast bias, reduced by the engine (InputMetadata::reduce_grad).
      out[2] = at::sum_to(grad_2d, c10::IntArrayRef{out_features});
      if (casts_in_node) out[2] = out[2].to(at::kFloat);
    }
    return out;
  }

  void release_variables() override {
    input.reset_data();
    weight_cast.reset_data();
  }

  std::string name() const override { return "torchfuse::LinearCastBackward"; }
};

// The node's forward: its outputs as `heads` gives them.
std::vector<at::Tensor> linear_node(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias_opt,
                                    at::ScalarType dtype, bool weight_in_out,
                                    const OutputHeads& heads, bool merge_input_heads) {
  const at::Tensor bias = bias_opt.has_value() ? *bias_opt : at::Tensor();
  const auto composition = [&] {
    return linear_cast_composition(input, weight, bias_opt, dtype, weight_in_out, heads,
                                   merge_input_heads);
  };
  // Transforms, forward-mode AD, and tensors or modes a trace watches (fake tensors, make_fx,
  // functionalization: they see stock's ops) take the composition. So do the head views the
  // node would not make as views: an input to merge that is not contiguous (HF's reshape and
  // contiguous copy it), an output (or a split's chunk) whose width is not a whole number of
  // heads (its view fails), a split whose widths are not the output's (split_with_sizes'
  // error) or of an output that is not 3-D (its transpose would not be the heads').
  const int64_t out_features = weight.dim() == 2 ? weight.size(weight_in_out ? 1 : 0) : 0;
  const int64_t head_dim = heads.head_dim;
  const auto whole_heads = [&](int64_t width) { return width > 0 && width % head_dim == 0; };
  const bool heads_whole =
      head_dim == 0 ||
      (heads.split_sizes.empty()
           ? whole_heads(out_features)
           : input.dim() == 3 &&
                 std::all_of(heads.split_sizes.begin(), heads.split_sizes.end(), whole_heads) &&
                 std::accumulate(heads.split_sizes.begin(), heads.split_sizes.end(), int64_t{0}) ==
                     out_features);
  if (composition_only({input, weight, bias}) || traced(input) || traced(weight) ||
      (bias.defined() && traced(bias)) || !heads_whole ||
      (merge_input_heads && (input.dim() < 3 || !input.is_contiguous())))
    return composition();
  // The GEMM's input: the heads merged as a view of the contiguous input.
  const auto merged = [](const at::Tensor& t) {
    std::vector<int64_t> sizes = t.sizes().vec();
    const int64_t head_dim = sizes.back();
    sizes.pop_back();
    sizes.back() *= head_dim;
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return t.view(sizes);
  };
  const at::Tensor gemm_input = merge_input_heads ? merged(input) : input;
  // Rust decides (and counts) whether the node serves this call.
  TfLinearCall call{};
  call.input = describe(gemm_input);
  call.weight = describe(weight);
  call.bias = describe(bias_opt);
  call.dtype = static_cast<int16_t>(dtype);
  call.weight_in_out = weight_in_out ? 1 : 0;
  const bool autocast = autocast_in(input.device().type(), dtype);
  // The node casts the weight (and a bias) itself where autocast would cast them: both fp32 (the
  // parameters autocast's cache holds; 16-bit ones under another dtype keep stock's cast), on the
  // input's device, with grad on (no node otherwise).
  const bool casts_in_node =
      autocast && at::GradMode::is_enabled() && weight.scalar_type() == at::kFloat &&
      weight.device() == input.device() &&
      (!bias.defined() || (bias.scalar_type() == at::kFloat && bias.device() == input.device())) &&
      dtype != at::kFloat && weight_cast_enabled();
  call.casts_in_node = casts_in_node ? 1 : 0;
  // Nothing is launched: no stream, no device guard.
  const TfLaunch where{input.is_cuda() ? static_cast<int32_t>(input.get_device()) : -1, nullptr};
  TfOutputs unused{};
  if (!fused_by_rust(TF_ENTRY_LINEAR_CAST, where, call, unused)) return composition();
  // Conv1D's addmm casts the input's 2-D view, and o_proj the heads' merged view, which
  // autocast's cache never holds: a plain cast.
  const at::Tensor input_cast =
      stock_cast(input, dtype, autocast && !weight_in_out && !merge_input_heads);
  at::Tensor weight_cast, bias_cast;
  if (casts_in_node) {
    CastMemo* memo = cast_memo();
    weight_cast = node_cast(memo, weight, dtype);
    if (bias.defined()) bias_cast = node_cast(memo, bias, dtype);
  } else {
    weight_cast = stock_cast(weight, dtype, autocast);
    if (bias.defined()) bias_cast = stock_cast(bias, dtype, autocast);
  }
  // The tensors the node's edges go to: the parameters themselves where it cast them.
  const at::Tensor& weight_edge = casts_in_node ? weight : weight_cast;
  const at::Tensor& bias_edge = casts_in_node ? bias : bias_cast;
  // The input's cast is merged the same way (the edge and the saved input stay unmerged).
  const at::Tensor gemm_input_cast = merge_input_heads ? merged(input_cast) : input_cast;
  std::vector<at::Tensor> outputs;
  at::Tensor gemm_output;
  bool input_column_major = false;
  {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Everything is in `dtype` now: autocast's own wrapper of linear would find nothing to do.
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    gemm_output = linear_of(
        gemm_input_cast, weight_cast,
        bias_cast.defined() ? std::optional<at::Tensor>(bias_cast) : std::nullopt, weight_in_out);
    outputs = heads.of(gemm_output);
    const at::Tensor mat1 = input_2d(gemm_input_cast, weight_in_out);
    input_column_major = mat1.stride(0) == 1 && mat1.stride(1) == mat1.size(0);
  }
  if (!(at::GradMode::is_enabled() &&
        torch::autograd::compute_requires_grad(input_cast, weight_edge, bias_edge)))
    return outputs;
  auto node = std::shared_ptr<LinearCastBackward>(new LinearCastBackward(),
                                                  torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(input_cast, weight_edge, bias_edge));
  node->casts_in_node = casts_in_node;
  node->input_sizes = input.sizes().vec();
  node->in_features = weight.size(weight_in_out ? 0 : 1);
  node->out_features = out_features;
  if (head_dim > 0) node->output_sizes = gemm_output.sizes().vec();
  node->heads = heads;
  node->has_bias = bias.defined();
  node->weight_in_out = weight_in_out;
  node->input_column_major = input_column_major;
  // The GEMM's second operand: the weight's cast (Conv1D), or its transpose (Linear).
  node->mat2_column_major =
      weight_in_out ? weight_cast.stride(0) == 1 && weight_cast.stride(1) == weight_cast.size(0)
                    : weight_cast.stride(1) == 1 && weight_cast.stride(0) == weight_cast.size(1);
  if (node->should_compute_output(1)) node->input = SavedVariable(input_cast, false);
  if (node->should_compute_output(0)) node->weight_cast = SavedVariable(weight_cast, false);
  torch::autograd::set_history(outputs, node);
  return outputs;
}

at::Tensor linear_cast_autograd(const at::Tensor& input, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, at::ScalarType dtype,
                                bool weight_in_out, int64_t out_head_dim, bool merge_input_heads,
                                bool transpose_heads) {
  return linear_node(input, weight, bias, dtype, weight_in_out,
                     heads_of(out_head_dim, transpose_heads), merge_input_heads)[0];
}

std::vector<at::Tensor> linear_cast_split_autograd(const at::Tensor& input, const at::Tensor& weight,
                                                   const std::optional<at::Tensor>& bias,
                                                   at::ScalarType dtype, bool weight_in_out,
                                                   at::IntArrayRef split_sizes,
                                                   int64_t head_dim, bool sliced) {
  return linear_node(input, weight, bias, dtype, weight_in_out,
                     split_heads_of(split_sizes, head_dim, sliced), false);
}

}  // namespace

bool register_linear(uint32_t entry, const char* /*name*/, torch::Library* /*aten*/) {
  using c10::DispatchKey;
  switch (entry) {
    case TF_ENTRY_LINEAR_CAST:
      torchfuse_impl(DispatchKey::CompositeExplicitAutograd)
          .impl("linear_cast", TORCH_FN(linear_cast_stock))
          .impl("linear_cast_split", TORCH_FN(linear_cast_split_stock));
      torchfuse_impl(DispatchKey::Autograd)
          .impl("linear_cast", TORCH_FN(linear_cast_autograd))
          .impl("linear_cast_split", TORCH_FN(linear_cast_split_autograd));
      return true;
    default: return false;
  }
}

}  // namespace torchfuse_glue
