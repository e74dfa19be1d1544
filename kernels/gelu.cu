// The tanh GELU, forward and backward: torch.ops.torchfuse.gelu_tanh[_backward], which serve
// HF's NewGELUActivation / FastGELUActivation (and any equal composition) in one pass each.
//
//   y  = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   dx = dy (0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2))
//
// Everything is computed in fp32 from the stored values, with the accurate tanhf (PyTorch's
// own gelu(approximate="tanh") computes the same expressions in the same precision), and
// rounded once on the store.
//
// Dtypes: x (and dx) are TF_DTYPE. With TF_WIDE = 1 the other tensor (the forward's y, the
// backward's dy) is fp32: the form autocast produces for HF's code, where torch.pow runs in
// fp32, so a bf16 activation gives an fp32 result. The cast is part of the one pass.
//
// Layout: elementwise over the tensors' common storage order (the glue passes dense tensors of
// one layout). A thread owns TF_CHUNKS chunks of 8 consecutive elements (16 bytes of bf16/f16,
// 32 of fp32: one or two 16-byte accesses), TF_THREADS threads per CTA, chunks strided by the
// CTA width so a warp's accesses are contiguous. Run-time `vectorized` = every pointer
// 16-byte aligned; otherwise, and for the last n % 8 elements, element by element. No
// reductions: results do not depend on the launch shape.
//
// Compile-time parameters: TF_DTYPE; the op's TF_GELU_FWD / TF_GELU_BWD (which kernel) and
// TF_WIDE (src/ops/gelu.rs `defines`); the variant's TF_THREADS, TF_CHUNKS (registry/gelu.toml).
#include "common.cuh"

#if !defined(TF_GELU_FWD) || !defined(TF_GELU_BWD) || !defined(TF_WIDE)
#error "TF_GELU_FWD, TF_GELU_BWD and TF_WIDE must be defined"
#endif
#if !defined(TF_THREADS) || !defined(TF_CHUNKS)
#error "every gelu variant param (src/ops/gelu.rs Params) must be defined"
#endif

#define CHUNK 8

typedef tf_storage tf_x;
#if TF_WIDE
typedef float tf_other;  // the forward's y, the backward's dy
#else
typedef tf_storage tf_other;
#endif

// sqrt(2 / pi) and the cubic's coefficient, as PyTorch's kernel writes them (fp32).
#define GELU_BETA 0.7978845608028654f
#define GELU_KAPPA 0.044715f

// 8 consecutive elements of T at `p` (16-byte aligned), as floats.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[CHUNK]) {
  constexpr int per = 16 / sizeof(T);
#pragma unroll
  for (int a = 0; a < CHUNK / per; ++a) {
    tf_pack<T> pk;
    pk.raw = reinterpret_cast<const tf_raw16*>(p)[a];
#pragma unroll
    for (int j = 0; j < per; ++j) v[a * per + j] = tf_float(pk.e[j]);
  }
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&v)[CHUNK]) {
  constexpr int per = 16 / sizeof(T);
#pragma unroll
  for (int a = 0; a < CHUNK / per; ++a) {
    tf_pack<T> pk;
#pragma unroll
    for (int j = 0; j < per; ++j) pk.e[j] = tf_cast<T>(v[a * per + j]);
    reinterpret_cast<tf_raw16*>(p)[a] = pk.raw;
  }
}

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
// y = gelu(x) over n elements.
extern "C" __global__ void __launch_bounds__(TF_THREADS)
    gelu_tanh_fwd(const tf_x* __restrict__ x, tf_other* __restrict__ y, tf_i64 n, int vectorized) {
  const tf_i64 first = static_cast<tf_i64>(blockIdx.x) * TF_CHUNKS * TF_THREADS + threadIdx.x;
  if (vectorized) {
    const tf_i64 chunks = n / CHUNK;
#pragma unroll
    for (int c = 0; c < TF_CHUNKS; ++c) {
      const tf_i64 k = first + static_cast<tf_i64>(c) * TF_THREADS;
      if (k >= chunks) break;
      float v[CHUNK];
      load8(x + k * CHUNK, v);
#pragma unroll
      for (int j = 0; j < CHUNK; ++j) v[j] = gelu_fwd(v[j]);
      store8(y + k * CHUNK, v);
    }
    // The tail of fewer than 8 elements: one thread each, of the first CTA.
    const tf_i64 tail = chunks * CHUNK + threadIdx.x;
    if (blockIdx.x == 0 && threadIdx.x < CHUNK && tail < n)
      y[tail] = tf_cast<tf_other>(gelu_fwd(tf_float(x[tail])));
    return;
  }
#pragma unroll
  for (int c = 0; c < TF_CHUNKS; ++c) {
    const tf_i64 k = first + static_cast<tf_i64>(c) * TF_THREADS;
#pragma unroll
    for (int j = 0; j < CHUNK; ++j) {
      const tf_i64 i = k * CHUNK + j;
      if (i < n) y[i] = tf_cast<tf_other>(gelu_fwd(tf_float(x[i])));
    }
  }
}
#endif

#if TF_GELU_BWD
// dx = dy * gelu'(x) over n elements.
extern "C" __global__ void __launch_bounds__(TF_THREADS)
    gelu_tanh_bwd(const tf_other* __restrict__ dy, const tf_x* __restrict__ x,
                  tf_x* __restrict__ dx, tf_i64 n, int vectorized) {
  const tf_i64 first = static_cast<tf_i64>(blockIdx.x) * TF_CHUNKS * TF_THREADS + threadIdx.x;
  if (vectorized) {
    const tf_i64 chunks = n / CHUNK;
#pragma unroll
    for (int c = 0; c < TF_CHUNKS; ++c) {
      const tf_i64 k = first + static_cast<tf_i64>(c) * TF_THREADS;
      if (k >= chunks) break;
      float g[CHUNK], v[CHUNK];
      load8(dy + k * CHUNK, g);
      load8(x + k * CHUNK, v);
#pragma unroll
      for (int j = 0; j < CHUNK; ++j) v[j] = gelu_bwd(g[j], v[j]);
      store8(dx + k * CHUNK, v);
    }
    const tf_i64 tail = chunks * CHUNK + threadIdx.x;
    if (blockIdx.x == 0 && threadIdx.x < CHUNK && tail < n)
      dx[tail] = tf_cast<tf_x>(gelu_bwd(tf_float(dy[tail]), tf_float(x[tail])));
    return;
  }
#pragma unroll
  for (int c = 0; c < TF_CHUNKS; ++c) {
    const tf_i64 k = first + static_cast<tf_i64>(c) * TF_THREADS;
#pragma unroll
    for (int j = 0; j < CHUNK; ++j) {
      const tf_i64 i = k * CHUNK + j;
      if (i < n) dx[i] = tf_cast<tf_x>(gelu_bwd(tf_float(dy[i]), tf_float(x[i])));
    }
  }
}
#endif
