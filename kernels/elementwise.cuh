// Elementwise kernels' shared layout (gelu.cu; the next pointwise families reuse it).
//
// A thread owns CHUNKS chunks of TF_EW_CHUNK (8) consecutive elements (16 bytes of bf16/f16, 32
// of fp32: one or two 16-byte accesses), THREADS threads per CTA, chunks strided by the CTA
// width so a warp's accesses are contiguous. With `vectorized` (every pointer 16-byte aligned)
// whole chunks use 16-byte accesses and the last n % 8 elements go one per thread to the first
// CTA; otherwise every element is accessed alone. No reductions: results do not depend on the
// launch shape.
//
// An op is written once, for any width W (TF_EW_CHUNK or 1): a functor with
//   template <int W> __device__ void apply(tf_i64 i) const;
// that loads W elements at i with tf_load_elems, computes, and stores with tf_store_elems.
#pragma once
#include "common.cuh"

// The chunk's size has one source, src/ops/elementwise.rs, which passes it (8: the code below
// needs a multiple of 16 bytes for every dtype).
#if !defined(TF_EW_CHUNK) || TF_EW_CHUNK != 8
#error "TF_EW_CHUNK must be defined as 8 (src/ops/elementwise.rs)"
#endif

// W consecutive elements of T at p as floats: W == TF_EW_CHUNK needs p 16-byte aligned.
template <int W, typename T>
__device__ __forceinline__ void tf_load_elems(const T* p, float (&v)[W]) {
  if constexpr (W == 1) {
    v[0] = tf_float(*p);
  } else {
    static_assert(W == TF_EW_CHUNK, "a chunk or one element");
    constexpr int per = 16 / sizeof(T);
#pragma unroll
    for (int a = 0; a < W / per; ++a) {
      tf_pack<T> pk;
      pk.raw = reinterpret_cast<const tf_raw16*>(p)[a];
#pragma unroll
      for (int j = 0; j < per; ++j) v[a * per + j] = tf_float(pk.e[j]);
    }
  }
}

template <int W, typename T>
__device__ __forceinline__ void tf_store_elems(T* p, const float (&v)[W]) {
  if constexpr (W == 1) {
    *p = tf_cast<T>(v[0]);
  } else {
    static_assert(W == TF_EW_CHUNK, "a chunk or one element");
    constexpr int per = 16 / sizeof(T);
#pragma unroll
    for (int a = 0; a < W / per; ++a) {
      tf_pack<T> pk;
#pragma unroll
      for (int j = 0; j < per; ++j) pk.e[j] = tf_cast<T>(v[a * per + j]);
      reinterpret_cast<tf_raw16*>(p)[a] = pk.raw;
    }
  }
}

// Runs op over this thread's elements of [0, n).
template <int THREADS, int CHUNKS, typename Op>
__device__ __forceinline__ void tf_for_each_element(const Op& op, tf_i64 n, int vectorized) {
  const tf_i64 first = static_cast<tf_i64>(blockIdx.x) * CHUNKS * THREADS + threadIdx.x;
  if (vectorized) {
    const tf_i64 chunks = n / TF_EW_CHUNK;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      const tf_i64 k = first + static_cast<tf_i64>(c) * THREADS;
      if (k >= chunks) break;
      op.template apply<TF_EW_CHUNK>(k * TF_EW_CHUNK);
    }
    const tf_i64 tail = chunks * TF_EW_CHUNK + threadIdx.x;
    if (blockIdx.x == 0 && threadIdx.x < TF_EW_CHUNK && tail < n) op.template apply<1>(tail);
    return;
  }
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const tf_i64 k = first + static_cast<tf_i64>(c) * THREADS;
#pragma unroll
    for (int j = 0; j < TF_EW_CHUNK; ++j) {
      const tf_i64 i = k * TF_EW_CHUNK + j;
      if (i < n) op.template apply<1>(i);
    }
  }
}
