// Rotary position embedding, HF's rotate-half form, forward and backward, q and k in one launch:
// torch.ops.torchfuse.rotary[_backward], which serve HF's apply_rotary_pos_emb (and its copies).
//
//   forward   y[j]     = x[j] cos[j]         - x[j+h] sin[j]           (h = head_dim / 2)
//             y[j+h]   = x[j+h] cos[j+h]     + x[j] sin[j+h]
//   backward  dx[j]    = dy[j] cos[j]        + dy[j+h] sin[j+h]
//             dx[j+h]  = dy[j+h] cos[j+h]    - dy[j] sin[j]
//
// Stock (HF's code) runs five kernels for each of q and k (a multiply, a negation, a cat, a
// multiply, an add) and more in the backward; here each element is read and written once, in
// fp32, rounded once on the store. No reductions: results do not depend on the launch shape.
//
// Layout: a warp owns a row (one head of one token) of q or k, q's rows first, then k's; lane l
// takes the pairs (j, j+h) for j = l, l + 32, ...: consecutive lanes read consecutive elements
// of each half, and a row's index is taken apart once, not per element. TF_THREADS / 32 rows a
// CTA, the grid strides over the rest. Every operand is 4-D with a contiguous last dim; the
// others may be strided (q and k are transposed views of the projections' outputs) and cos/sin
// are broadcast (stride 0) over the dims they lack. Strides come per operand from
// src/ops/rotary.rs (`RopeOperand`).
//
// Dtypes: x (q, k, and the backward's dx) is TF_DTYPE. TF_WIDE = 1: cos, sin and the forward's
// output (the backward's dy) are fp32 while x is 16-bit, the form autocast gives HF's code
// (cos/sin follow the fp32 hidden states and the product promotes); otherwise all TF_DTYPE.
//
// Compile-time parameters: TF_DTYPE; TF_ROPE_BWD (which direction) and TF_WIDE
// (src/ops/rotary.rs `defines`); the variant's TF_THREADS (registry/rotary.toml).
#include "common.cuh"

#if !defined(TF_ROPE_BWD) || !defined(TF_WIDE) || !defined(TF_THREADS)
#error "TF_ROPE_BWD, TF_WIDE and TF_THREADS must be defined (src/ops/rotary.rs)"
#endif

typedef tf_storage tf_x;
#if TF_WIDE
typedef float tf_y;  // cos, sin, the forward's output and the backward's incoming gradient
#else
typedef tf_storage tf_y;
#endif

// Element strides of a [n0, n1, n2, d] view; the last dim's is 1.
struct RopeStrides {
  tf_i64 s0, s1, s2;
};

// One of q, k: sizes, the input and output and their strides, and cos/sin's strides as
// broadcast to this operand's shape.
struct RopeOperand {
  const void* in;  // forward: x (tf_x); backward: dy (tf_y)
  void* out;       // forward: y (tf_y); backward: dx (tf_x)
  tf_i64 n1, n2, rows;  // rows = n0 * n1 * n2
  RopeStrides in_s, out_s, trig_s;
};

__device__ __forceinline__ tf_i64 offset(const RopeStrides& s, tf_i64 i0, tf_i64 i1, tf_i64 i2) {
  return i0 * s.s0 + i1 * s.s1 + i2 * s.s2;
}

template <typename TIn, typename TOut>
__device__ __forceinline__ void rotate_row(const RopeOperand& op, const tf_y* __restrict__ cos,
                                           const tf_y* __restrict__ sin, tf_i64 row, int half,
                                           int lane) {
  const tf_i64 i2 = row % op.n2, i01 = row / op.n2;
  const tf_i64 i1 = i01 % op.n1, i0 = i01 / op.n1;
  const TIn* in = static_cast<const TIn*>(op.in) + offset(op.in_s, i0, i1, i2);
  TOut* out = static_cast<TOut*>(op.out) + offset(op.out_s, i0, i1, i2);
  const tf_i64 t = offset(op.trig_s, i0, i1, i2);
  for (int j = lane; j < half; j += 32) {
    const float a = tf_float(in[j]), b = tf_float(in[j + half]);
    const float c_lo = tf_float(cos[t + j]), c_hi = tf_float(cos[t + j + half]);
    const float s_lo = tf_float(sin[t + j]), s_hi = tf_float(sin[t + j + half]);
#if TF_ROPE_BWD
    out[j] = tf_cast<TOut>(a * c_lo + b * s_hi);
    out[j + half] = tf_cast<TOut>(b * c_hi - a * s_lo);
#else
    out[j] = tf_cast<TOut>(a * c_lo - b * s_lo);
    out[j + half] = tf_cast<TOut>(b * c_hi + a * s_hi);
#endif
  }
}

// q's rows, then k's: a warp a row, a grid-stride loop over both.
extern "C" __global__ void __launch_bounds__(TF_THREADS)
    rope(RopeOperand q, RopeOperand k, const tf_y* __restrict__ cos,
         const tf_y* __restrict__ sin, int half) {
  constexpr int warps = TF_THREADS / 32;
  const int lane = threadIdx.x % 32;
  const tf_i64 total = q.rows + k.rows;
  for (tf_i64 r = static_cast<tf_i64>(blockIdx.x) * warps + threadIdx.x / 32; r < total;
       r += static_cast<tf_i64>(gridDim.x) * warps) {
    const bool is_q = r < q.rows;
#if TF_ROPE_BWD
    rotate_row<tf_y, tf_x>(is_q ? q : k, cos, sin, is_q ? r : r - q.rows, half, lane);
#else
    rotate_row<tf_x, tf_y>(is_q ? q : k, cos, sin, is_q ? r : r - q.rows, half, lane);
#endif
  }
}
