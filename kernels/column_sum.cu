// Column sums: out[c] = sum over r of x[r, c] for a row-major x of `rows` x `cols`. This is
// aten::sum.dim_IntList over a contiguous tensor's leading dims, which is how autograd makes
// every biased Linear's bias gradient (the output's gradient summed over its rows); stock's
// reduction reaches about half of copy bandwidth on those shapes.
//
// Two kernels; x is read once, at full 16-byte width:
//   column_sum_partial: grid (column tiles, row splits), TF_WARPS warps a CTA. A lane owns
//     TF_VEC consecutive columns (one 16-byte access a row), so a warp covers a tile of
//     32 * TF_VEC columns. The split's rows (TF_ROWS_PER_SPLIT of them) go to the CTA's warps
//     round-robin (warp w: rows w, w + TF_WARPS, ...); each lane adds its rows in increasing
//     order in fp32 registers (TF_UNROLL rows loaded before they are added, in that order).
//     The warps' sums are then added in warp order through shared memory and written as the
//     split's fp32 partial sums [split, col].
//   column_sum_finish: one thread a column adds the splits' partials in split order and
//     stores the sum, rounded once to the output's dtype.
// Deterministic: every order of addition depends on the shape and the variant's params only,
// not on the GPU's size or the scheduling. A call whose pointer or columns do not allow 16-byte
// accesses (`vectorized` = 0) loads the same elements one by one: the same sums, bit for bit.
//
// Compile-time parameters: TF_DTYPE (x's and the output's dtype); TF_FINISH_THREADS
// (src/ops/column_sum.rs `defines`, which launches it); the variant's TF_WARPS,
// TF_ROWS_PER_SPLIT, TF_UNROLL (registry/column_sum.toml, src/ops/column_sum.rs Params).
#include "common.cuh"

#if !defined(TF_FINISH_THREADS)
#error "TF_FINISH_THREADS must be defined (src/ops/column_sum.rs)"
#endif
#if !defined(TF_WARPS) || !defined(TF_ROWS_PER_SPLIT) || !defined(TF_UNROLL)
#error "every column_sum variant param (src/ops/column_sum.rs Params) must be defined"
#endif

#define TF_TILE (32 * TF_VEC)  // columns a warp (and a CTA) covers

// This lane's TF_VEC elements of one row at column `col` (the first of its columns).
__device__ __forceinline__ void load_row(const tf_storage* __restrict__ row, tf_i64 col,
                                         tf_i64 cols, int vectorized, float (&v)[TF_VEC]) {
  if (vectorized) {
    tf_pack<tf_storage> pk;
    pk.raw = *reinterpret_cast<const tf_raw16*>(row + col);
#pragma unroll
    for (int j = 0; j < TF_VEC; ++j) v[j] = tf_float(pk.e[j]);
  } else {
#pragma unroll
    for (int j = 0; j < TF_VEC; ++j) v[j] = col + j < cols ? tf_float(row[col + j]) : 0.0f;
  }
}

// partial[split, c] = the sum of x[r, c] over the split's rows.
extern "C" __global__ void __launch_bounds__(TF_WARPS * 32)
    column_sum_partial(const tf_storage* __restrict__ x, float* __restrict__ partial,
                       tf_i64 rows, tf_i64 cols, int vectorized) {
  __shared__ float sums[TF_WARPS][TF_TILE];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const tf_i64 tile = static_cast<tf_i64>(blockIdx.x) * TF_TILE;
  const tf_i64 col = tile + lane * TF_VEC;
  const tf_i64 split = blockIdx.y;
  const tf_i64 first = split * TF_ROWS_PER_SPLIT;
  const tf_i64 end = min(rows, first + TF_ROWS_PER_SPLIT);
  float acc[TF_VEC];
#pragma unroll
  for (int j = 0; j < TF_VEC; ++j) acc[j] = 0.0f;
  if (col < cols) {
    tf_i64 r = first + warp;
    // Whole groups of TF_UNROLL rows: all loads first, then the adds in row order.
    for (; r + (TF_UNROLL - 1) * TF_WARPS < end; r += TF_UNROLL * TF_WARPS) {
      float v[TF_UNROLL][TF_VEC];
#pragma unroll
      for (int u = 0; u < TF_UNROLL; ++u)
        load_row(x + (r + u * TF_WARPS) * cols, col, cols, vectorized, v[u]);
#pragma unroll
      for (int u = 0; u < TF_UNROLL; ++u)
#pragma unroll
        for (int j = 0; j < TF_VEC; ++j) acc[j] += v[u][j];
    }
    for (; r < end; r += TF_WARPS) {
      float v[TF_VEC];
      load_row(x + r * cols, col, cols, vectorized, v);
#pragma unroll
      for (int j = 0; j < TF_VEC; ++j) acc[j] += v[j];
    }
  }
#pragma unroll
  for (int j = 0; j < TF_VEC; ++j) sums[warp][lane * TF_VEC + j] = acc[j];
  __syncthreads();
  for (int t = threadIdx.x; t < TF_TILE; t += TF_WARPS * 32) {
    if (tile + t >= cols) break;
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < TF_WARPS; ++w) s += sums[w][t];
    partial[split * cols + tile + t] = s;
  }
}

// out[c] = the sum of partial[s, c] over the splits, in split order.
extern "C" __global__ void __launch_bounds__(TF_FINISH_THREADS)
    column_sum_finish(const float* __restrict__ partial, tf_storage* __restrict__ out,
                      tf_i64 splits, tf_i64 cols) {
  const tf_i64 c = static_cast<tf_i64>(blockIdx.x) * TF_FINISH_THREADS + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
  for (tf_i64 k = 0; k < splits; ++k) s += partial[k * cols + c];
  out[c] = tf_cast<tf_storage>(s);
}
