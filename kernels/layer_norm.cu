// LayerNorm forward (native_layer_norm): y = (x - mean) * rstd * weight + bias, per row.
//
// Design: one pass over memory. A row is owned by TF_THREADS_PER_ROW threads (one warp, or a
// whole CTA for wide rows); each thread loads its TF_ELEMS_PER_THREAD elements with 16-byte
// loads into registers, so x is read once and y written once. Statistics are exact two-level
// fp32 sums over those registers (sum -> mean, then sum of squared deviations -> variance),
// not Welford: with the row in registers the second pass costs no memory traffic and is more
// accurate. Reductions are a warp butterfly plus, for CTA rows, per-warp partials summed in
// a fixed order from shared memory: the result never depends on timing (deterministic).
// mean and rstd are written as fp32, as stock does for f32/bf16/f16 inputs.
//
// Compile-time parameters (registry/layer_norm.toml): TF_DTYPE, TF_THREADS_PER_ROW (a
// multiple of 32), TF_ROWS_PER_BLOCK, TF_ELEMS_PER_THREAD (a multiple of 8); a variant
// serves rows of at most TF_THREADS_PER_ROW * TF_ELEMS_PER_THREAD elements.
// Run-time `vectorized` = all pointers 16-byte aligned and cols % TF_VEC == 0; otherwise the
// same element layout is accessed with scalar loads.
#include "common.cuh"

#define TPR TF_THREADS_PER_ROW
#define ROWS_PER_BLOCK TF_ROWS_PER_BLOCK
#define ITERS (TF_ELEMS_PER_THREAD / TF_VEC)
#define WARPS_PER_ROW (TPR / 32)

// Sum over the threads of one row; every thread of the row gets the same total.
__device__ __forceinline__ float row_sum(float v, float (*scratch)[WARPS_PER_ROW]) {
  v = tf_warp_sum(v);
#if WARPS_PER_ROW > 1
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) scratch[threadIdx.y][warp] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS_PER_ROW; ++w) total += scratch[threadIdx.y][w];
  __syncthreads();  // scratch is reused by the next reduction
  return total;
#else
  return v;
#endif
}

// Loads TF_VEC consecutive elements starting at col0 (zeros past the end of the row).
__device__ __forceinline__ void load_chunk(const tf_storage* __restrict__ p, int col0, int cols,
                                           bool vectorized, float* out) {
  if (vectorized && col0 < cols) {
    tf_vec r;
    r.raw = *reinterpret_cast<const tf_raw16*>(p + col0);
#pragma unroll
    for (int j = 0; j < TF_VEC; ++j) out[j] = tf_to_float(r.e[j]);
  } else {
#pragma unroll
    for (int j = 0; j < TF_VEC; ++j) out[j] = (col0 + j < cols) ? tf_to_float(p[col0 + j]) : 0.f;
  }
}

extern "C" __global__ void __launch_bounds__(TPR * ROWS_PER_BLOCK)
    layer_norm_fwd(const tf_storage* __restrict__ x, const tf_storage* __restrict__ weight,
                   const tf_storage* __restrict__ bias, tf_storage* __restrict__ y,
                   float* __restrict__ mean_out, float* __restrict__ rstd_out, tf_i64 rows,
                   int cols, float eps, int vectorized) {
  __shared__ float scratch[ROWS_PER_BLOCK][WARPS_PER_ROW];
  const tf_i64 row = static_cast<tf_i64>(blockIdx.x) * ROWS_PER_BLOCK + threadIdx.y;
  // Threads of a missing row still take part in the CTA barriers; they read and write nothing.
  const bool row_ok = row < rows;
  const int active_cols = row_ok ? cols : 0;
  const tf_i64 offset = row_ok ? row * static_cast<tf_i64>(cols) : 0;
  const tf_storage* __restrict__ xr = x + offset;

  float v[ITERS][TF_VEC];
  float sum = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int col0 = (it * TPR + static_cast<int>(threadIdx.x)) * TF_VEC;
    load_chunk(xr, col0, active_cols, vectorized, v[it]);
#pragma unroll
    for (int j = 0; j < TF_VEC; ++j) sum += v[it][j];
  }
  const float inv_cols = 1.f / static_cast<float>(cols);
  const float mean = row_sum(sum, scratch) * inv_cols;

  float squares = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int col0 = (it * TPR + static_cast<int>(threadIdx.x)) * TF_VEC;
#pragma unroll
    for (int j = 0; j < TF_VEC; ++j) {
      const float d = v[it][j] - mean;
      squares += (col0 + j < active_cols) ? d * d : 0.f;
    }
  }
  const float variance = row_sum(squares, scratch) * inv_cols;
  const float rstd = rsqrtf(variance + eps);

  if (!row_ok) return;
  tf_storage* __restrict__ yr = y + offset;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int col0 = (it * TPR + static_cast<int>(threadIdx.x)) * TF_VEC;
    if (col0 >= cols) break;
    float w[TF_VEC], b[TF_VEC];
    if (weight != nullptr) {
      load_chunk(weight, col0, cols, vectorized, w);
    } else {
#pragma unroll
      for (int j = 0; j < TF_VEC; ++j) w[j] = 1.f;
    }
    if (bias != nullptr) {
      load_chunk(bias, col0, cols, vectorized, b);
    } else {
#pragma unroll
      for (int j = 0; j < TF_VEC; ++j) b[j] = 0.f;
    }
    tf_vec out;
#pragma unroll
    for (int j = 0; j < TF_VEC; ++j) out.e[j] = tf_from_float((v[it][j] - mean) * rstd * w[j] + b[j]);
    if (vectorized) {
      *reinterpret_cast<tf_raw16*>(yr + col0) = out.raw;
    } else {
#pragma unroll
      for (int j = 0; j < TF_VEC; ++j)
        if (col0 + j < cols) yr[col0 + j] = out.e[j];
    }
  }
  if (threadIdx.x == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}
