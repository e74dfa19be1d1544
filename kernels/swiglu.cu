// The pointwise part of HF's gated MLPs, forward and backward, between the matmuls (which stay
// with cuBLAS): torch.ops.torchfuse.silu_mul[_backward] and silu_mul_packed[_backward] (SwiGLU:
// LlamaMLP and its copies, down(silu(gate(x)) * up(x)), and Phi-3's and its copies, one
// gate_up_proj chunked in two), and gelu_tanh_mul[_backward] (GeGLU: Gemma's MLP, the same
// with a tanh-GELU gate).
//
//   SwiGLU  y = silu(g) u,   silu(g) = g sigmoid(g)
//           dg = dy u sigmoid(g) (1 + g (1 - sigmoid(g))),   du = dy silu(g)
//   GeGLU   y = gelu(g) u    (gelu_tanh.cuh's tanh GELU)
//           dg = dy u gelu'(g),   du = dy gelu(g)
//
// One pass each: the forward reads g and u and writes y (stock: silu, then a multiply, five
// passes over memory, and autograd keeps silu(g) as well); the backward reads dy, g and u and
// writes dg and du (stock: three kernels, nine passes). Everything is computed in fp32 from the
// stored values, sigmoid with the accurate expf, and rounded once on the store.
//
// Layout: elementwise.cuh's (chunks of 8 elements, 16-byte accesses where every pointer is
// aligned) over y's (and dy's) dense order. gate and up (and dgate and dup) lie in rows of
// `width` elements `stride` apart: dense tensors (stride == width) for torchfuse::silu_mul,
// the two halves of one [.., 2 width] tensor (stride == 2 width; up, dup start `width` after
// gate, dgate) for torchfuse::silu_mul_packed, Phi-3's gate_up_proj output and its gradient,
// which the backward writes whole (no chunk backward's concatenation). Vectorized launches
// have width % 8 == 0, so a chunk never crosses a row. No reductions: results do not depend
// on the launch shape.
//
// Compile-time parameters: TF_DTYPE (every tensor); the op's TF_SWIGLU_FWD / TF_SWIGLU_BWD
// (which kernel), TF_GATE_GELU (1: GeGLU's gate, named gelu_tanh_mul_*; 0: SwiGLU's,
// silu_mul_*) and TF_EW_CHUNK (src/ops/swiglu.rs `defines`); the variant's TF_THREADS,
// TF_CHUNKS (registry/swiglu.toml).
#include "elementwise.cuh"
#include "gelu_tanh.cuh"

#if !defined(TF_SWIGLU_FWD) || !defined(TF_SWIGLU_BWD) || !defined(TF_GATE_GELU)
#error "TF_SWIGLU_FWD, TF_SWIGLU_BWD and TF_GATE_GELU must be defined"
#endif
#if !defined(TF_THREADS) || !defined(TF_CHUNKS)
#error "every swiglu variant param (src/ops/elementwise.rs Params) must be defined"
#endif

#if TF_GATE_GELU
#define TF_GATED_FWD gelu_tanh_mul_fwd
#define TF_GATED_BWD gelu_tanh_mul_bwd

__device__ __forceinline__ float gated(float g, float u) { return tf_gelu_tanh(g) * u; }

// dg and du in place of g and u.
__device__ __forceinline__ void gated_grads(float d, float& g, float& u) {
  const float dgate = d * u * tf_gelu_tanh_grad(g);
  u = d * tf_gelu_tanh(g);
  g = dgate;
}
#else
#define TF_GATED_FWD silu_mul_fwd
#define TF_GATED_BWD silu_mul_bwd

__device__ __forceinline__ float sigmoid(float g) { return 1.f / (1.f + expf(-g)); }

__device__ __forceinline__ float gated(float g, float u) { return g * sigmoid(g) * u; }

// dg and du in place of g and u.
__device__ __forceinline__ void gated_grads(float d, float& g, float& u) {
  const float s = sigmoid(g);
  const float silu = g * s;
  const float dsilu = d * u;
  u = d * silu;
  g = dsilu * s * (1.f + g * (1.f - s));
}
#endif

// Where element i of the dense order lies in rows of `width` elements `stride` apart.
__device__ __forceinline__ tf_i64 row_offset(tf_i64 i, tf_i64 width, tf_i64 stride) {
  return stride == width ? i : i + (i / width) * (stride - width);
}

#if TF_SWIGLU_FWD
struct GatedFwd {
  const tf_storage* __restrict__ gate;
  const tf_storage* __restrict__ up;
  tf_storage* __restrict__ y;
  tf_i64 width, stride;
  template <int W>
  __device__ __forceinline__ void apply(tf_i64 i) const {
    float g[W], u[W];
    const tf_i64 at = row_offset(i, width, stride);
    tf_load_elems<W>(gate + at, g);
    tf_load_elems<W>(up + at, u);
#pragma unroll
    for (int j = 0; j < W; ++j) g[j] = gated(g[j], u[j]);
    tf_store_elems<W>(y + i, g);
  }
};

// y = act(gate) * up over n elements (y dense; gate, up in rows of width, stride apart).
extern "C" __global__ void __launch_bounds__(TF_THREADS)
    TF_GATED_FWD(const tf_storage* __restrict__ gate, const tf_storage* __restrict__ up,
                 tf_storage* __restrict__ y, tf_i64 n, int vectorized, tf_i64 width,
                 tf_i64 stride) {
  tf_for_each_element<TF_THREADS, TF_CHUNKS>(GatedFwd{gate, up, y, width, stride}, n,
                                             vectorized);
}
#endif

#if TF_SWIGLU_BWD
struct GatedBwd {
  const tf_storage* __restrict__ dy;
  const tf_storage* __restrict__ gate;
  const tf_storage* __restrict__ up;
  tf_storage* __restrict__ dgate;
  tf_storage* __restrict__ dup;
  tf_i64 width, stride;
  template <int W>
  __device__ __forceinline__ void apply(tf_i64 i) const {
    float d[W], g[W], u[W];
    const tf_i64 at = row_offset(i, width, stride);
    tf_load_elems<W>(dy + i, d);
    tf_load_elems<W>(gate + at, g);
    tf_load_elems<W>(up + at, u);
#pragma unroll
    for (int j = 0; j < W; ++j) gated_grads(d[j], g[j], u[j]);
    tf_store_elems<W>(dgate + at, g);
    tf_store_elems<W>(dup + at, u);
  }
};

// dgate, dup from dy, gate, up over n elements (dy dense; the others in rows of width, stride
// apart).
extern "C" __global__ void __launch_bounds__(TF_THREADS)
    TF_GATED_BWD(const tf_storage* __restrict__ dy, const tf_storage* __restrict__ gate,
                 const tf_storage* __restrict__ up, tf_storage* __restrict__ dgate,
                 tf_storage* __restrict__ dup, tf_i64 n, int vectorized, tf_i64 width,
                 tf_i64 stride) {
  tf_for_each_element<TF_THREADS, TF_CHUNKS>(GatedBwd{dy, gate, up, dgate, dup, width, stride},
                                             n, vectorized);
}
#endif
