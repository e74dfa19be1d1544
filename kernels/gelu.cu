// The tanh GELU, forward and backward: torch.ops.torchfuse.gelu_tanh[_backward], which serve
// HF's NewGELUActivation / FastGELUActivation (and any equal composition) in one pass each.
//
//   y  = gelu(x),  dx = dy gelu'(x)      (gelu_tanh.cuh: the expressions and their rounding)
//
// Everything is computed in fp32 from the stored values and rounded once on the store.
//
// Dtypes: x (and dx) are TF_DTYPE. With TF_WIDE = 1 the other tensor (the forward's y, the
// backward's dy) is fp32: the form autocast produces for HF's code, where torch.pow runs in
// fp32, so a bf16 activation gives an fp32 result. The cast is part of the one pass.
//
// Layout: elementwise.cuh's (chunks of 8 elements, 16-byte accesses where every pointer is
// aligned) over the tensors' common storage order (the glue passes dense tensors of one
// layout). No reductions: results do not depend on the launch shape.
//
// Compile-time parameters: TF_DTYPE; the op's TF_GELU_FWD / TF_GELU_BWD (which kernel),
// TF_WIDE and TF_EW_CHUNK (src/ops/gelu.rs `defines`); the variant's TF_THREADS, TF_CHUNKS
// (registry/gelu.toml).
#include "elementwise.cuh"
#include "gelu_tanh.cuh"

#if !defined(TF_GELU_FWD) || !defined(TF_GELU_BWD) || !defined(TF_WIDE)
#error "TF_GELU_FWD, TF_GELU_BWD and TF_WIDE must be defined"
#endif
#if !defined(TF_THREADS) || !defined(TF_CHUNKS)
#error "every gelu variant param (src/ops/elementwise.rs Params) must be defined"
#endif

typedef tf_storage tf_x;
#if TF_WIDE
typedef float tf_other;  // the forward's y, the backward's dy
#else
typedef tf_storage tf_other;
#endif

#if TF_GELU_FWD
struct GeluFwd {
  const tf_x* __restrict__ x;
  tf_other* __restrict__ y;
  template <int W>
  __device__ __forceinline__ void apply(tf_i64 i) const {
    float v[W];
    tf_load_elems<W>(x + i, v);
#pragma unroll
    for (int j = 0; j < W; ++j) v[j] = tf_gelu_tanh(v[j]);
    tf_store_elems<W>(y + i, v);
  }
};

// y = gelu(x) over n elements.
extern "C" __global__ void __launch_bounds__(TF_THREADS)
    gelu_tanh_fwd(const tf_x* __restrict__ x, tf_other* __restrict__ y, tf_i64 n, int vectorized) {
  tf_for_each_element<TF_THREADS, TF_CHUNKS>(GeluFwd{x, y}, n, vectorized);
}
#endif

#if TF_GELU_BWD
struct GeluBwd {
  const tf_other* __restrict__ dy;
  const tf_x* __restrict__ x;
  tf_x* __restrict__ dx;
  template <int W>
  __device__ __forceinline__ void apply(tf_i64 i) const {
    float g[W], v[W];
    tf_load_elems<W>(dy + i, g);
    tf_load_elems<W>(x + i, v);
#pragma unroll
    for (int j = 0; j < W; ++j) v[j] = g[j] * tf_gelu_tanh_grad(v[j]);
    tf_store_elems<W>(dx + i, v);
  }
};

// dx = dy * gelu'(x) over n elements.
extern "C" __global__ void __launch_bounds__(TF_THREADS)
    gelu_tanh_bwd(const tf_other* __restrict__ dy, const tf_x* __restrict__ x,
                  tf_x* __restrict__ dx, tf_i64 n, int vectorized) {
  tf_for_each_element<TF_THREADS, TF_CHUNKS>(GeluBwd{dy, x, dx}, n, vectorized);
}
#endif
