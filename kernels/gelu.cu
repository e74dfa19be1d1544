// The tanh GELU, forward and backward: torch.ops.torchfuse.gelu_tanh[_backward], which serve
// HF's NewGELUActivation / FastGELUActivation (and any equal composition) in one pass each.
//
//   y  = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   dx = dy (0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2))
//
// Everything is computed in fp32 from the stored values, with the accurate tanhf, and rounded
// once on the store. PyTorch's own gelu(approximate="tanh") computes the same expressions in
// fp32 with its products in another order (kappa (x x x) where this file has ((kappa x) x) x):
// the two agree to fp32 rounding, not bit for bit.
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

#if !defined(TF_GELU_FWD) || !defined(TF_GELU_BWD) || !defined(TF_WIDE)
#error "TF_GELU_FWD, TF_GELU_BWD and TF_WIDE must be defined"
#endif
#if !defined(TF_THREADS) || !defined(TF_CHUNKS)
#error "every gelu variant param (src/ops/gelu.rs Params) must be defined"
#endif

typedef tf_storage tf_x;
#if TF_WIDE
typedef float tf_other;  // the forward's y, the backward's dy
#else
typedef tf_storage tf_other;
#endif

// sqrt(2 / pi) and the cubic's coefficient, as PyTorch's kernel writes them (fp32).
#define GELU_BETA 0.7978845608028654f
#define GELU_KAPPA 0.044715f

__device__ __forceinline__ float gelu_fwd(float x) {
  const float u = GELU_BETA * (x + GELU_KAPPA * x * x * x);
  return 0.5f * x * (1.f + tanhf(u));
}

__device__ __forceinline__ float gelu_bwd(float dy, float x) {
  const float x2 = x * x;
  const float t = tanhf(GELU_BETA * (x + GELU_KAPPA * x2 * x));
  const float left = 0.5f * (1.f + t);
  const float right = 0.5f * x * (1.f - t * t) * GELU_BETA * (1.f + 3.f * GELU_KAPPA * x2);
  return dy * (left + right);
}

#if TF_GELU_FWD
struct GeluFwd {
  const tf_x* __restrict__ x;
  tf_other* __restrict__ y;
  template <int W>
  __device__ __forceinline__ void apply(tf_i64 i) const {
    float v[W];
    tf_load_elems<W>(x + i, v);
#pragma unroll
    for (int j = 0; j < W; ++j) v[j] = gelu_fwd(v[j]);
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
    for (int j = 0; j < W; ++j) v[j] = gelu_bwd(g[j], v[j]);
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
