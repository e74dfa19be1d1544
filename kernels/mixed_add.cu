// add.Tensor of an fp32 tensor and a 16-bit one of the same shape, alpha 1: what a residual
// stream kept in fp32 (the parameters are fp32) meets under autocast, `residual + layer(x)` with
// the layer's output in bf16. PyTorch's add takes its unvectorized path for two dtypes; here
//
//   out = a + float(b)      (fp32; the 16-bit value widened exactly, one rounding: stock's)
//
// in one pass: a and b read once, out written once, with 16-byte accesses.
//
// mixed_copy: copy_ of a 16-bit tensor into an fp32 one of the same layout (autocast's casts
// back in the backward: a weight's gradient to its fp32 parameter's dtype, ToCopyBackward0 of
// an fp32 q or k the attention took in bf16). PyTorch's copy of two dtypes is unvectorized too;
// here out = float(b), exact (a shift of the bits, NaN payloads too), b read once, out written
// once.
//
// Layout: elementwise.cuh's (chunks of 8 elements, 16-byte accesses where every pointer is
// aligned) over the tensors' common row-major order (the glue passes contiguous tensors of one
// shape). No reductions: results do not depend on the launch shape.
//
// Compile-time parameters: TF_DTYPE (b's), TF_EW_CHUNK (src/ops/mixed_add.rs `defines`); the
// variant's TF_THREADS, TF_CHUNKS (registry/mixed_add.toml).
#include "elementwise.cuh"

#if !defined(TF_THREADS) || !defined(TF_CHUNKS)
#error "every mixed_add variant param (src/ops/elementwise.rs Params) must be defined"
#endif

struct MixedAdd {
  const float* __restrict__ a;
  const tf_storage* __restrict__ b;
  float* __restrict__ out;
  template <int W>
  __device__ __forceinline__ void apply(tf_i64 i) const {
    float x[W], y[W];
    tf_load_elems<W>(a + i, x);
    tf_load_elems<W>(b + i, y);
#pragma unroll
    for (int j = 0; j < W; ++j) x[j] += y[j];
    tf_store_elems<W>(out + i, x);
  }
};

struct MixedCopy {
  const tf_storage* __restrict__ b;
  float* __restrict__ out;
  template <int W>
  __device__ __forceinline__ void apply(tf_i64 i) const {
    float y[W];
    tf_load_elems<W>(b + i, y);
    tf_store_elems<W>(out + i, y);
  }
};

// out = b over n elements: out fp32, b TF_DTYPE.
extern "C" __global__ void __launch_bounds__(TF_THREADS)
    mixed_copy(const tf_storage* __restrict__ b, float* __restrict__ out, tf_i64 n,
               int vectorized) {
  tf_for_each_element<TF_THREADS, TF_CHUNKS>(MixedCopy{b, out}, n, vectorized);
}

// out = a + b over n elements: a and out fp32, b TF_DTYPE.
extern "C" __global__ void __launch_bounds__(TF_THREADS)
    mixed_add(const float* __restrict__ a, const tf_storage* __restrict__ b,
              float* __restrict__ out, tf_i64 n, int vectorized) {
  tf_for_each_element<TF_THREADS, TF_CHUNKS>(MixedAdd{a, b, out}, n, vectorized);
}
