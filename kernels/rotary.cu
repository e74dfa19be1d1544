// Rotary position embedding, forward and backward, q and k in one launch:
// torch.ops.torchfuse.rotary[_backward], which serve HF's apply_rotary_pos_emb (and its copies);
// and kv_copy (torch.ops.torchfuse.kv_copy: K or V copied into HF's KV cache, rows as here).
// HF's rotate-half form pairs element j with j+h (h = head_dim / 2):
//
//   forward   y[j]     = x[j] cos[j]         - x[j+h] sin[j]
//             y[j+h]   = x[j+h] cos[j+h]     + x[j] sin[j+h]
//   backward  dx[j]    = dy[j] cos[j]        + dy[j+h] sin[j+h]
//             dx[j+h]  = dy[j+h] cos[j+h]    - dy[j] sin[j]
//
// and the interleaved form (rope_pairs: GLM's, Cohere's, GPT-J's rotate_every_two) pairs
// element 2p with 2p+1, the same formulas with j = 2p and j+h = 2p+1.
//
// Stock (HF's code) runs five kernels for each of q and k (a multiply, a negation, a cat, a
// multiply, an add) and more in the backward; here each element is read and written once, in
// fp32, rounded once on the store. No reductions: results do not depend on the launch shape.
//
// Layout: rows (one head of one token) of q, then of k. Interleaved, a lane's chunk holds whole
// pairs (chunks have an even number of elements), taken j = lane's chunk, + group chunks, ...
// over the whole row; element by element, lane l takes the pair p = l, l + 32, .... Rotate-half: chunked (`group` > 0, where every row
// and both halves start 16-byte aligned: head dims that are multiples of 16): `group` lanes own
// a row (a power of two, the chunks of a half or fewer: 4 for head dim 64, 8 for 128; of the
// whole row where part of it passes through, so that a partial rotary's row is not one lane's),
// 32 / group rows a warp, and each lane takes the pairs of TF_EW_CHUNK consecutive elements at
// (j, j+h), j = lane's chunk, + group chunks, ..., with 16-byte loads and stores. Otherwise a
// warp owns a row, element by element: lane l takes j = l, l + 32, .... Either way a row's index
// is taken apart once (in 32 bits where the rows fit), not per element, and the grid strides
// over the rows. Every operand is 4-D with a contiguous last dim; the others may be strided (q
// and k are transposed views of the projections' outputs) and cos/sin are broadcast (stride 0)
// over the dims they lack. Strides come per operand from src/ops/rotary.rs (`RopeOperand`),
// and so does `group`.
//
// Partial rotary (GPT-NeoX's: `d`, the row's length, more than the rotated 2 * half): the rest
// of the row passes through in the same launch, converted to the output's dtype (`pass_row`),
// where the original splits the head dim and cats the rotated part with the rest.
//
// Dtypes: x (q, k, and the backward's dx) is TF_DTYPE. TF_WIDE = 1: cos, sin and the forward's
// output (the backward's dy) are fp32 while x is 16-bit, the form autocast gives HF's code
// (cos/sin follow the fp32 hidden states and the product promotes); otherwise all TF_DTYPE.
//
// Compile-time parameters: TF_DTYPE; TF_ROPE_BWD (which direction), TF_WIDE and TF_EW_CHUNK
// (src/ops/rotary.rs `defines`); the variant's TF_THREADS (registry/rotary.toml).
#include "elementwise.cuh"

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

// The (i0, i1, i2) of a row of a [n0, n1, n2, d] operand: 32-bit division where the operand's
// rows fit (64-bit division is a long instruction sequence).
__device__ __forceinline__ void split_row(const RopeOperand& op, tf_i64 row, tf_i64& i0,
                                          tf_i64& i1, tf_i64& i2) {
  if (op.rows <= 0x7fffffff) {
    const unsigned r = static_cast<unsigned>(row), n1 = static_cast<unsigned>(op.n1),
                   n2 = static_cast<unsigned>(op.n2);
    const unsigned i01 = r / n2;
    i2 = r - i01 * n2;
    i1 = i01 % n1;
    i0 = i01 / n1;
  } else {
    const tf_i64 i01 = row / op.n2;
    i2 = row - i01 * op.n2;
    i1 = i01 % op.n1;
    i0 = i01 / op.n1;
  }
}

// One row: this lane's W-element pieces of each half, `first` and every `lanes`-th after it.
template <int W, typename TIn, typename TOut>
__device__ __forceinline__ void rotate_row(const RopeOperand& op, const tf_y* __restrict__ cos,
                                           const tf_y* __restrict__ sin, tf_i64 row, int half,
                                           int first, int lanes) {
  tf_i64 i0, i1, i2;
  split_row(op, row, i0, i1, i2);
  const TIn* in = static_cast<const TIn*>(op.in) + offset(op.in_s, i0, i1, i2);
  TOut* out = static_cast<TOut*>(op.out) + offset(op.out_s, i0, i1, i2);
  const tf_y* c = cos + offset(op.trig_s, i0, i1, i2);
  const tf_y* s = sin + offset(op.trig_s, i0, i1, i2);
  for (int j = first * W; j < half; j += lanes * W) {
    float a[W], b[W], c_lo[W], c_hi[W], s_lo[W], s_hi[W], lo[W], hi[W];
    tf_load_elems<W>(in + j, a);
    tf_load_elems<W>(in + j + half, b);
    tf_load_elems<W>(c + j, c_lo);
    tf_load_elems<W>(c + j + half, c_hi);
    tf_load_elems<W>(s + j, s_lo);
    tf_load_elems<W>(s + j + half, s_hi);
#pragma unroll
    for (int e = 0; e < W; ++e) {
#if TF_ROPE_BWD
      lo[e] = a[e] * c_lo[e] + b[e] * s_hi[e];
      hi[e] = b[e] * c_hi[e] - a[e] * s_lo[e];
#else
      lo[e] = a[e] * c_lo[e] - b[e] * s_lo[e];
      hi[e] = b[e] * c_hi[e] + a[e] * s_hi[e];
#endif
    }
    tf_store_elems<W>(out + j, lo);
    tf_store_elems<W>(out + j + half, hi);
  }
}

// One row, interleaved: this lane's W-element pieces of the row (whole pairs), `first` and every
// `lanes`-th after it; W = 1 takes one pair (two elements) at a time.
template <int W, typename TIn, typename TOut>
__device__ __forceinline__ void rotate_pairs(const RopeOperand& op, const tf_y* __restrict__ cos,
                                             const tf_y* __restrict__ sin, tf_i64 row, int half,
                                             int first, int lanes) {
  constexpr int N = W > 1 ? W : 2;  // elements a step: a chunk, or one pair
  static_assert(N % 2 == 0, "whole pairs");
  // The row's pointers as rotate_row sets them up, written out again: a helper returning them
  // changed NVRTC's code for rope (72 registers instead of 64 in the wide backward).
  tf_i64 i0, i1, i2;
  split_row(op, row, i0, i1, i2);
  const TIn* in = static_cast<const TIn*>(op.in) + offset(op.in_s, i0, i1, i2);
  TOut* out = static_cast<TOut*>(op.out) + offset(op.out_s, i0, i1, i2);
  const tf_y* c = cos + offset(op.trig_s, i0, i1, i2);
  const tf_y* s = sin + offset(op.trig_s, i0, i1, i2);
  for (int j = first * N; j < 2 * half; j += lanes * N) {
    float a[N], cj[N], sj[N], o[N];
    if constexpr (W > 1) {
      tf_load_elems<W>(in + j, a);
      tf_load_elems<W>(c + j, cj);
      tf_load_elems<W>(s + j, sj);
    } else {
#pragma unroll
      for (int e = 0; e < N; ++e) {
        a[e] = tf_float(in[j + e]);
        cj[e] = tf_float(c[j + e]);
        sj[e] = tf_float(s[j + e]);
      }
    }
#pragma unroll
    for (int e = 0; e < N; e += 2) {
#if TF_ROPE_BWD
      o[e] = a[e] * cj[e] + a[e + 1] * sj[e + 1];
      o[e + 1] = a[e + 1] * cj[e + 1] - a[e] * sj[e];
#else
      o[e] = a[e] * cj[e] - a[e + 1] * sj[e];
      o[e + 1] = a[e + 1] * cj[e + 1] + a[e] * sj[e + 1];
#endif
    }
    if constexpr (W > 1) {
      tf_store_elems<W>(out + j, o);
    } else {
#pragma unroll
      for (int e = 0; e < N; ++e) out[j + e] = tf_cast<TOut>(o[e]);
    }
  }
}

// Partial rotary (`d` > 2 * half): the row's features from `from` to d pass through, converted
// from the input's dtype to the output's (the forward's cat promotes a 16-bit x to fp32 beside
// fp32 rotated features; the backward's gradient goes back to x's dtype): this lane's W-element
// pieces, `first` and every `lanes`-th after it.
template <int W, typename TIn, typename TOut>
__device__ __forceinline__ void pass_row(const RopeOperand& op, tf_i64 row, int from, int d,
                                         int first, int lanes) {
  tf_i64 i0, i1, i2;
  split_row(op, row, i0, i1, i2);
  const TIn* in = static_cast<const TIn*>(op.in) + offset(op.in_s, i0, i1, i2);
  TOut* out = static_cast<TOut*>(op.out) + offset(op.out_s, i0, i1, i2);
  for (int j = from + first * W; j < d; j += lanes * W) {
    float v[W];
    tf_load_elems<W>(in + j, v);
    tf_store_elems<W>(out + j, v);
  }
}

#if TF_ROPE_BWD
typedef tf_y tf_in;  // dy
typedef tf_x tf_out;  // dx
#else
typedef tf_x tf_in;
typedef tf_y tf_out;
#endif

template <bool PAIRS>
__device__ __forceinline__ void rope_row(const RopeOperand& op, const tf_y* __restrict__ cos,
                                         const tf_y* __restrict__ sin, tf_i64 row, int half,
                                         int d, int group, int lane, int lanes) {
  if (d > 2 * half) {
    if (group > 0)
      pass_row<TF_EW_CHUNK, tf_in, tf_out>(op, row, 2 * half, d, lane % lanes, lanes);
    else
      pass_row<1, tf_in, tf_out>(op, row, 2 * half, d, lane, 32);
  }
  if constexpr (PAIRS) {
    if (group > 0)
      rotate_pairs<TF_EW_CHUNK, tf_in, tf_out>(op, cos, sin, row, half, lane % lanes, lanes);
    else
      rotate_pairs<1, tf_in, tf_out>(op, cos, sin, row, half, lane, 32);
  } else {
    if (group > 0)
      rotate_row<TF_EW_CHUNK, tf_in, tf_out>(op, cos, sin, row, half, lane % lanes, lanes);
    else
      rotate_row<1, tf_in, tf_out>(op, cos, sin, row, half, lane, 32);
  }
}

// q's rows, then k's, a grid-stride loop over both: `group` lanes a row chunk by chunk, or
// (group 0) a warp a row element by element. One kernel per layout (rope: rotate-half;
// rope_pairs: interleaved), so that each keeps the registers its own path needs.
template <bool PAIRS>
__device__ __forceinline__ void rope_rows(const RopeOperand& q, const RopeOperand& k,
                                          const tf_y* __restrict__ cos,
                                          const tf_y* __restrict__ sin, int half, int d,
                                          int group) {
  constexpr int warps = TF_THREADS / 32;
  const int lane = threadIdx.x % 32;
  const int lanes = group > 0 ? group : 32;  // a row's lanes
  const int rows_per_warp = 32 / lanes;
  const tf_i64 total = q.rows + k.rows;
  const tf_i64 step = static_cast<tf_i64>(gridDim.x) * warps * rows_per_warp;
  for (tf_i64 r = (static_cast<tf_i64>(blockIdx.x) * warps + threadIdx.x / 32) * rows_per_warp +
                  lane / lanes;
       r < total; r += step) {
    // Each call names its operand: `is_q ? q : k` would copy the chosen one to the stack
    // (local memory) on every row, where the parameters' constant bank serves them directly.
    if (r < q.rows)
      rope_row<PAIRS>(q, cos, sin, r, half, d, group, lane, lanes);
    else
      rope_row<PAIRS>(k, cos, sin, r - q.rows, half, d, group, lane, lanes);
  }
}

extern "C" __global__ void __launch_bounds__(TF_THREADS)
    rope(RopeOperand q, RopeOperand k, const tf_y* __restrict__ cos,
         const tf_y* __restrict__ sin, int half, int d, int group) {
  rope_rows<false>(q, k, cos, sin, half, d, group);
}

extern "C" __global__ void __launch_bounds__(TF_THREADS)
    rope_pairs(RopeOperand q, RopeOperand k, const tf_y* __restrict__ cos,
               const tf_y* __restrict__ sin, int half, int d, int group) {
  rope_rows<true>(q, k, cos, sin, half, d, group);
}

// kv_copy: each row of x (a [n0, n1, n2, d] view with a contiguous last dim: HF's K or V, often a
// transposed view of a projection's output) copied to the row-major output, as the cat of HF's
// first cache append makes it: bit for bit in x's dtype, or (TF_WIDE) widened to fp32 (cat's
// promotion of a 16-bit V to the fp32 cache an fp32 K made; exact). One pass: each element read
// and written once. Rows as rope's: `group` lanes a row, chunks of TF_EW_CHUNK elements with
// 16-byte accesses (every row start 16-byte aligned; the caller sends rows that are not to
// PyTorch's copy); a grid-stride loop over the rows. The operand's trig strides are not read.
template <int W>
__device__ __forceinline__ void copy_row(const RopeOperand& op, tf_i64 row, int d, int first,
                                         int lanes) {
  tf_i64 i0, i1, i2;
  split_row(op, row, i0, i1, i2);
  const tf_x* in = static_cast<const tf_x*>(op.in) + offset(op.in_s, i0, i1, i2);
  tf_y* out = static_cast<tf_y*>(op.out) + offset(op.out_s, i0, i1, i2);
  for (int j = first * W; j < d; j += lanes * W) {
#if TF_WIDE
    float v[W];
    tf_load_elems<W>(in + j, v);
    tf_store_elems<W>(out + j, v);
#else
    constexpr int raws = W * static_cast<int>(sizeof(tf_x)) / 16;
#pragma unroll
    for (int a = 0; a < raws; ++a)
      reinterpret_cast<tf_raw16*>(out + j)[a] = reinterpret_cast<const tf_raw16*>(in + j)[a];
#endif
  }
}

extern "C" __global__ void __launch_bounds__(TF_THREADS) kv_copy(RopeOperand x, int d, int group) {
  constexpr int warps = TF_THREADS / 32;
  const int lane = threadIdx.x % 32;
  const int rows_per_warp = 32 / group;  // group: a row's lanes, 1 to 32
  const tf_i64 step = static_cast<tf_i64>(gridDim.x) * warps * rows_per_warp;
  for (tf_i64 r = (static_cast<tf_i64>(blockIdx.x) * warps + threadIdx.x / 32) * rows_per_warp +
                  lane / group;
       r < x.rows; r += step)
    copy_row<TF_EW_CHUNK>(x, r, d, lane % group, group);
}
