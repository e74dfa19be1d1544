// LayerNorm and RMSNorm (TF_RMS=1), forward and backward: native_layer_norm[_backward],
// _fused_rms_norm[_backward].
//
// Layout: a row is owned by TF_THREADS_PER_ROW threads (one warp, or a whole CTA for wide
// rows), TF_ROWS_PER_BLOCK rows per CTA. Thread tx owns the columns (it*TPR + tx)*VEC + j, the
// same columns on every row, read with 16-byte loads. The grid is persistent (at most what
// fits on the GPU at once) and strides over groups of rows.
//
// Forward, one pass over memory: the row is kept in registers in its storage type (16 B per
// chunk), so x is read once and y written once. Statistics are exact two-level fp32 sums over
// the registers (mean, then the sum of squared deviations), not Welford: with the row in
// registers the second sum costs no memory traffic and is more accurate. With TF_PREFETCH the
// next row's loads are issued before the current row's reductions, so the memory system stays
// busy while a warp reduces.
//
// Backward, one pass over x and dy: each thread computes dx for its columns of a row and keeps
// running fp32 sums of dy*xhat (dgamma) and dy (dbeta) for the same columns across all rows it
// visits, in registers or (TF_SMEM_ACC) in shared memory, which leaves the registers for more
// CTAs per SM. At the end the CTA writes one fp32 partial row per quantity;
// norm_bwd_reduce sums the partial rows column by column in a fixed order. Variants with 64 or
// more accumulators per thread (BWD_WIDE) re-read the weight from L1 every row, rather than
// holding it in registers, and load x and dy past L1 so the weight stays there.
// Rows of at most VEC columns (all in one thread) take dx in fp64: there dx is a near-total
// cancellation of its terms, which fp32 would leave with a large relative error.
//
// Rows wider than one CTA holds (TF_CLUSTER > 1, sm_90): a thread-block cluster of TF_CLUSTER
// CTAs owns each row, CTA rank r the columns r * BLOCK_COLS + ..., each with its chunk in
// registers as above, so memory is still read and written once. A row sum adds the CTA totals
// through distributed shared memory: every CTA stores its totals into every CTA's shared memory
// (st.async, counted by an mbarrier), then every thread adds the CLUSTER totals in rank order,
// so all CTAs of the row get the same bits. LayerNorm's forward exchanges once per row: each
// CTA's sum and sum of squared deviations from its own mean, combined exactly (Chan et al.).
// The backward's partial rows are one per cluster (each CTA writes its columns).
//
// Determinism: every reduction (warp butterfly, per-warp partials from shared memory, the
// CTA's rows, the partial rows) runs in a fixed order that depends only on the shape and the
// grid size, which depends only on the shape, the variant and the GPU. Results are bitwise
// reproducible run to run.
//
// Narrowing (TF_Y_DTYPE, torchfuse::norm_cast): y (forward) and dy (backward) in a narrower
// dtype than x, the one the norm's consumers cast y to under autocast (fp32 x, bf16 y). The
// row's other tensors keep x's dtype; y is converted from the same fp32 value (one rounding,
// the cast's), and dy is widened to fp32 in registers, where the cast's kernel would have
// widened it in memory. A chunk of y or dy is VEC elements of its dtype (8 bytes for bf16 of an
// fp32 row), accessed in one instruction.
//
// Compile-time parameters (registry/norm.toml): TF_DTYPE (every tensor but the fp32 statistics), TF_RMS,
// TF_THREADS_PER_ROW (a multiple of 32), TF_ROWS_PER_BLOCK, TF_ELEMS_PER_THREAD (a multiple of
// TF_VEC), TF_PREFETCH (forward only), TF_STREAM, TF_MIN_BLOCKS (CTAs per SM the register budget must allow),
// TF_CLUSTER (CTAs per row; > 1 needs TF_ROWS_PER_BLOCK 1 and sm_90), TF_SMEM_ACC (backward
// only; the launch gives the accumulators' dynamic shared memory). The op
// picks the kernels: TF_NORM_FWD (norm_fwd) or TF_NORM_BWD (norm_bwd, norm_bwd_reduce). A variant serves rows of at most TF_CLUSTER * TF_THREADS_PER_ROW *
// TF_ELEMS_PER_THREAD elements. Run-time `vectorized` = every pointer 16-byte aligned and
// cols % TF_VEC == 0; otherwise the same columns are accessed element by element.
#include "common.cuh"

// The op's defines (src/ops/norm.rs `defines`): which kernels, and LayerNorm or RMSNorm; and
// every variant param (its `Params`, defaults included).
#if !defined(TF_NORM_FWD) || !defined(TF_NORM_BWD) || !defined(TF_RMS)
#error "TF_NORM_FWD, TF_NORM_BWD and TF_RMS must be defined"
#endif
#if !defined(TF_THREADS_PER_ROW) || !defined(TF_ROWS_PER_BLOCK) ||                  \
    !defined(TF_ELEMS_PER_THREAD) || !defined(TF_PREFETCH) || !defined(TF_STREAM) || \
    !defined(TF_MIN_BLOCKS) || !defined(TF_CLUSTER) || !defined(TF_SMEM_ACC)
#error "every norm variant param (src/ops/norm.rs Params) must be defined"
#endif
// TF_STREAM 1: x (and dy) are loaded past L1 and the weight and bias re-read from L1 every row
// (what the backward's wide variants always do, BWD_WIDE below); chosen per variant by
// measurement.

// weight, bias and their grads. Stock's CUDA norms require them in the activations' dtype
// (a float32 weight with bf16 input is an error there), so they share the storage type.
typedef tf_storage tf_param;

// y's and dy's dtype: x's, or (norm_cast, src/ops/norm.rs) a narrower one.
#ifndef TF_Y_DTYPE
#define TF_Y_DTYPE TF_DTYPE
#endif
typedef tf_type_of<TF_Y_DTYPE>::type tf_y;
#define Y_NARROW (TF_Y_DTYPE != TF_DTYPE)

#define TPR TF_THREADS_PER_ROW
#define RPB TF_ROWS_PER_BLOCK
#define VEC TF_VEC
#define ITERS (TF_ELEMS_PER_THREAD / VEC)
#define WARPS_PER_ROW (TPR / 32)
#define BLOCK_COLS (TPR * TF_ELEMS_PER_THREAD)

#if Y_NARROW
#if TF_DTYPE != 0
#error "TF_Y_DTYPE narrows fp32 rows only (TF_DTYPE 0)"
#endif
// A chunk of y or dy: VEC elements of the narrow dtype, as raw words for one access.
struct alignas(VEC * sizeof(tf_y)) y_raw {
  unsigned int w[VEC * sizeof(tf_y) / 4];
};
union y_chunk {
  y_raw raw;
  tf_y e[VEC];
};
static_assert(sizeof(y_raw) == 8, "a narrow chunk is 4 16-bit elements of an fp32 row");
#endif

#if TF_CLUSTER > 1 && RPB != 1
#error "TF_CLUSTER > 1 needs TF_ROWS_PER_BLOCK 1"
#endif

#if TF_CLUSTER > 1
#define TF_ROW_CTAS __cluster_dims__(TF_CLUSTER, 1, 1)
// The CTA's place in its row's cluster, the cluster's number, and how many clusters run.
__device__ __forceinline__ int cluster_rank() { return cluster_ctarank(); }
__device__ __forceinline__ tf_i64 cluster_index() {
  unsigned r;
  asm("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}
__device__ __forceinline__ tf_i64 cluster_count() {
  unsigned r;
  asm("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
  return r;
}
// Stores v at a cluster shared-memory address; its 4 bytes complete a transaction on the
// mbarrier at `bar` (in the same CTA as the address).
__device__ __forceinline__ void store_to_cta(unsigned int addr, float v, unsigned int bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
               ::"r"(addr), "f"(v), "r"(bar) : "memory");
}

// The row totals' exchange between the cluster's CTAs. Each CTA's first thread stores its K
// values into every CTA's `received[parity][its rank]` (st.async), and every thread waits on
// its own CTA's mbarrier for the CLUSTER * K * 4 bytes: no cluster-wide barrier, which would
// also wait for the CTA's outstanding global loads and stores (a release at cluster scope),
// and cost a memory latency per row. Two slots alternate: a CTA can send the next exchange
// only after every CTA has sent this one's, which each does after its threads have read
// the slot's previous contents (a CTA barrier, in cta_row_sum, lies between).
struct ClusterSums {
  float (*received)[TF_CLUSTER][2];  // __shared__ [2][TF_CLUSTER][2]
  unsigned long long* bars;          // __shared__ [2] mbarriers
  int exchanges;                     // per thread: exchanges so far
};
#if WARPS_PER_ROW < 2
#error "TF_CLUSTER > 1 needs TF_THREADS_PER_ROW >= 64 (cta_row_sum's barrier orders the slots' reuse)"
#endif

// Called by every thread at the kernel's start.
__device__ __forceinline__ ClusterSums cluster_sums() {
  __shared__ float received[2][TF_CLUSTER][2];
  __shared__ __align__(8) unsigned long long bars[2];
  if (threadIdx.x == 0) {
    mbar_init(smem_addr(&bars[0]), 1);
    mbar_init(smem_addr(&bars[1]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_barrier();  // every CTA's mbarriers are ready before any CTA sends
  return ClusterSums{received, bars, 0};
}
#else
#define TF_ROW_CTAS
__device__ __forceinline__ int cluster_rank() { return 0; }
__device__ __forceinline__ tf_i64 cluster_index() { return blockIdx.x; }
__device__ __forceinline__ tf_i64 cluster_count() { return gridDim.x; }
struct ClusterSums {};
__device__ __forceinline__ ClusterSums cluster_sums() { return ClusterSums{}; }
#endif

__device__ __forceinline__ int chunk_col(int it) {
  return cluster_rank() * BLOCK_COLS + (it * TPR + static_cast<int>(threadIdx.x)) * VEC;
}

// Columns of the row that CTA `rank` of its cluster holds (all of them without clusters).
__device__ __forceinline__ int cta_cols(int rank, int cols) {
  return min(max(cols - rank * BLOCK_COLS, 0), BLOCK_COLS);
}

// Sums K values over the threads of one row (one CTA's part of it, with clusters); every
// thread of the row gets the totals.
template <int K>
__device__ __forceinline__ void cta_row_sum(float (&v)[K], float (*scratch)[WARPS_PER_ROW][2]) {
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = tf_warp_sum(v[k]);
#if WARPS_PER_ROW > 1
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) scratch[threadIdx.y][warp][k] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS_PER_ROW; ++w) total += scratch[threadIdx.y][w][k];
    v[k] = total;
  }
  __syncthreads();  // scratch is reused by the next reduction
#endif
}

#if TF_CLUSTER > 1
// Every CTA's K values of the row (after cta_row_sum), by rank, in every thread.
template <int K>
__device__ __forceinline__ void cluster_gather(const float (&v)[K], ClusterSums& cluster,
                                               float (&by_rank)[TF_CLUSTER][K]) {
  const int slot = cluster.exchanges & 1;
  const unsigned int phase = (cluster.exchanges >> 1) & 1;
  ++cluster.exchanges;
  const unsigned int bar = smem_addr(&cluster.bars[slot]);
  if (threadIdx.x == 0) {
    mbar_expect_bytes(bar, TF_CLUSTER * K * 4);
    const unsigned int mine = smem_addr(&cluster.received[slot][cluster_rank()][0]);
#pragma unroll
    for (int r = 0; r < TF_CLUSTER; ++r)
#pragma unroll
      for (int k = 0; k < K; ++k)
        store_to_cta(cluster_addr(mine + 4 * k, r), v[k], cluster_addr(bar, r));
  }
  mbar_wait(bar, phase);
#pragma unroll
  for (int r = 0; r < TF_CLUSTER; ++r)
#pragma unroll
    for (int k = 0; k < K; ++k) by_rank[r][k] = cluster.received[slot][r][k];
}
#endif

// cta_row_sum over the whole row: with clusters, the CTAs' totals added in rank order.
template <int K>
__device__ __forceinline__ void row_sum(float (&v)[K], float (*scratch)[WARPS_PER_ROW][2],
                                        ClusterSums& cluster) {
  cta_row_sum(v, scratch);
#if TF_CLUSTER > 1
  float by_rank[TF_CLUSTER][K];
  cluster_gather(v, cluster, by_rank);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float total = 0.f;
#pragma unroll
    for (int r = 0; r < TF_CLUSTER; ++r) total += by_rank[r][k];
    v[k] = total;
  }
#else
  (void)cluster;
#endif
}

// 16 bytes that are read once (a row of x or dy): not kept in L1, where they would evict the
// weight and bias every row reads again.
__device__ __forceinline__ tf_raw16 load_once16(const void* p) {
  tf_raw16 r;
  asm("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.w[0]), "=r"(r.w[1]), "=r"(r.w[2]), "=r"(r.w[3])
      : "l"(p));
  return r;
}

// 16 bytes of weight or bias, read again for every row from L1. Volatile, so the compiler
// does not hoist every row's loads out of the row loop and keep all of them in registers
// (the backward's wide variants spilled for that).
__device__ __forceinline__ tf_raw16 load_param16(const void* p) {
  tf_raw16 r;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.w[0]), "=r"(r.w[1]), "=r"(r.w[2]), "=r"(r.w[3])
               : "l"(p));
  return r;
}

// The VEC elements of type T at col0.. as raw bits; zero bits (0.0) past the end of the row.
// ONCE: the data is read once (no L1 allocation); PARAM: weight or bias (load_param16).
template <bool ONCE = false, bool PARAM = false, typename T>
__device__ __forceinline__ tf_raw16 load_raw(const T* __restrict__ p, int col0, int cols,
                                             bool vectorized) {
  tf_pack<T> u;
  if (vectorized && col0 < cols) {
    if constexpr (ONCE) {
      u.raw = load_once16(p + col0);
    } else if constexpr (PARAM) {
      u.raw = load_param16(p + col0);
    } else {
      u.raw = *reinterpret_cast<const tf_raw16*>(p + col0);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 16 / static_cast<int>(sizeof(T)); ++j) {
      if (col0 + j < cols) {
        u.e[j] = p[col0 + j];
      } else {
        u.e[j] = T{};
      }
    }
  }
  return u.raw;
}

__device__ __forceinline__ float unpack(const tf_raw16& raw, int j) {
  tf_pack<tf_storage> u;
  u.raw = raw;
  return tf_float(u.e[j]);
}

// VEC parameters (weight or bias) at col0.. as floats; `fill` where absent, 0 past the end.
// RELOAD: read from L1 for every row (load_param16) instead of being kept in registers.
template <bool RELOAD = false>
__device__ __forceinline__ void load_params(const tf_param* __restrict__ p, int col0, int cols,
                                            bool vectorized, float fill, float (&out)[VEC]) {
  if (p == nullptr) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = fill;
    return;
  }
  tf_pack<tf_param> u;
  u.raw = load_raw<false, RELOAD>(p, col0, cols, vectorized);
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = tf_float(u.e[j]);
}

template <typename T>
__device__ __forceinline__ void store_row_chunk(T* __restrict__ p, int col0, int cols,
                                                bool vectorized, const float (&v)[VEC]) {
  tf_pack<T> u;
#pragma unroll
  for (int j = 0; j < VEC; ++j) u.e[j] = tf_cast<T>(v[j]);
  if (vectorized) {
    *reinterpret_cast<tf_raw16*>(p + col0) = u.raw;
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      if (col0 + j < cols) p[col0 + j] = u.e[j];
  }
}

// A chunk of y: store_row_chunk's, in y's dtype.
__device__ __forceinline__ void store_y_chunk(tf_y* __restrict__ p, int col0, int cols,
                                              bool vectorized, const float (&v)[VEC]) {
#if Y_NARROW
  y_chunk u;
#pragma unroll
  for (int j = 0; j < VEC; ++j) u.e[j] = tf_cast<tf_y>(v[j]);
  if (vectorized) {
    *reinterpret_cast<y_raw*>(p + col0) = u.raw;
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      if (col0 + j < cols) p[col0 + j] = u.e[j];
  }
#else
  store_row_chunk(p, col0, cols, vectorized, v);
#endif
}

// ONCE: the row bypasses L1 (load_once16).
template <bool ONCE = false>
__device__ __forceinline__ void load_row(tf_raw16 (&chunks)[ITERS], const tf_storage* __restrict__ p,
                                         int cols, bool vectorized) {
#pragma unroll
  for (int it = 0; it < ITERS; ++it) chunks[it] = load_raw<ONCE>(p, chunk_col(it), cols, vectorized);
}

// Row `row` of x into `chunks`, or zeros (and no memory access) when the row does not exist:
// threads of a missing row still take part in the CTA's barriers.
__device__ __forceinline__ void load_row_or_zeros(tf_raw16 (&chunks)[ITERS],
                                                  const tf_storage* __restrict__ x, tf_i64 row,
                                                  tf_i64 rows, int cols, bool vectorized) {
  const bool exists = row < rows;
  load_row<TF_STREAM>(chunks, x + (exists ? row * cols : 0), exists ? cols : 0, vectorized);
}

#if TF_NORM_BWD
// A row of dy in chunks (load_row's), and element j of a chunk as fp32.
#if Y_NARROW
typedef y_chunk dy_chunk;

// load_once16's 8 bytes.
__device__ __forceinline__ y_raw load_once8(const void* p) {
  y_raw r;
  asm("ld.global.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.w[0]), "=r"(r.w[1]) : "l"(p));
  return r;
}

template <bool ONCE>
__device__ __forceinline__ void load_dy_row(dy_chunk (&chunks)[ITERS], const tf_y* __restrict__ p,
                                            int cols, bool vectorized) {
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int col0 = chunk_col(it);
    if (vectorized && col0 < cols) {
      if constexpr (ONCE) {
        chunks[it].raw = load_once8(p + col0);
      } else {
        chunks[it].raw = *reinterpret_cast<const y_raw*>(p + col0);
      }
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) chunks[it].e[j] = col0 + j < cols ? p[col0 + j] : tf_y{};
    }
  }
}

__device__ __forceinline__ float dy_at(const dy_chunk& c, int j) { return tf_float(c.e[j]); }
#else
typedef tf_raw16 dy_chunk;

template <bool ONCE>
__device__ __forceinline__ void load_dy_row(dy_chunk (&chunks)[ITERS], const tf_y* __restrict__ p,
                                            int cols, bool vectorized) {
  load_row<ONCE>(chunks, p, cols, vectorized);
}

__device__ __forceinline__ float dy_at(const dy_chunk& c, int j) { return unpack(c, j); }
#endif
#endif  // TF_NORM_BWD

#if TF_NORM_FWD
// This thread's sum of its elements of the row (zeros past the row's end).
__device__ __forceinline__ float chunk_sum(const tf_raw16 (&chunks)[ITERS]) {
  float sum = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it)
#pragma unroll
    for (int j = 0; j < VEC; ++j) sum += unpack(chunks[it], j);
  return sum;
}

// This thread's sum of squared deviations from `mean` over its columns inside the row.
__device__ __forceinline__ float squared_deviations(const tf_raw16 (&chunks)[ITERS], float mean,
                                                    int cols) {
  float sum = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int col0 = chunk_col(it);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float d = unpack(chunks[it], j) - mean;
      sum += (col0 + j < cols) ? d * d : 0.f;
    }
  }
  return sum;
}

extern "C" __global__ void TF_ROW_CTAS __launch_bounds__(TPR * RPB, TF_MIN_BLOCKS)
    norm_fwd(const tf_storage* __restrict__ x, const tf_param* __restrict__ weight,
             const tf_param* __restrict__ bias, tf_y* __restrict__ y,
             float* __restrict__ mean_out, float* __restrict__ rstd_out, tf_i64 rows, int cols,
             float eps, int vectorized) {
  __shared__ float scratch[RPB][WARPS_PER_ROW][2];
  ClusterSums cluster = cluster_sums();
  const tf_i64 groups = (rows + RPB - 1) / RPB;
  const tf_i64 stride = cluster_count();
  const float inv_cols = 1.f / static_cast<float>(cols);
  const bool vec = vectorized != 0;

  tf_raw16 cur[ITERS];
  tf_i64 row = cluster_index() * RPB + threadIdx.y;
  load_row_or_zeros(cur, x, row, rows, cols, vec);

  for (tf_i64 group = cluster_index(); group < groups; group += stride) {
    row = group * RPB + threadIdx.y;
    const bool row_ok = row < rows;
    const tf_i64 offset = row_ok ? row * cols : 0;
#if TF_PREFETCH
    tf_raw16 next[ITERS];
    const tf_i64 next_row = row + stride * RPB;
    load_row_or_zeros(next, x, next_row, rows, cols, vec);
#endif

#if TF_RMS
    const float mean = 0.f;
    float sums[1] = {0.f};
#pragma unroll
    for (int it = 0; it < ITERS; ++it)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float v = unpack(cur[it], j);
        sums[0] += v * v;
      }
    row_sum(sums, scratch, cluster);
    const float rstd = rsqrtf(sums[0] * inv_cols + eps);
#elif TF_CLUSTER > 1
    // Each CTA's exact two-pass statistics of its columns, combined across the cluster in one
    // exchange (Chan et al.): M2 = sum over CTAs of M2_c + n_c (mean_c - mean)^2.
    float local_sum[1] = {chunk_sum(cur)};
    cta_row_sum(local_sum, scratch);
    const int local_cols = cta_cols(cluster_rank(), cols);
    const float local_mean = local_cols > 0 ? local_sum[0] / static_cast<float>(local_cols) : 0.f;
    float local_m2[1] = {squared_deviations(cur, local_mean, cols)};
    cta_row_sum(local_m2, scratch);
    const float part[2] = {local_sum[0], local_m2[0]};
    float by_rank[TF_CLUSTER][2];
    cluster_gather(part, cluster, by_rank);
    float total = 0.f;
#pragma unroll
    for (int r = 0; r < TF_CLUSTER; ++r) total += by_rank[r][0];
    const float mean = total * inv_cols;
    float m2 = 0.f;
#pragma unroll
    for (int r = 0; r < TF_CLUSTER; ++r) {
      const int n = cta_cols(r, cols);
      const float d = by_rank[r][0] - static_cast<float>(n) * mean;  // n (mean_r - mean)
      m2 += n > 0 ? by_rank[r][1] + d * d / static_cast<float>(n) : 0.f;
    }
    const float rstd = rsqrtf(m2 * inv_cols + eps);
#else
    float sums[1] = {chunk_sum(cur)};
    row_sum(sums, scratch, cluster);
    const float mean = sums[0] * inv_cols;
    float squares[1] = {squared_deviations(cur, mean, cols)};
    row_sum(squares, scratch, cluster);
    const float rstd = rsqrtf(squares[0] * inv_cols + eps);
#endif

    if (row_ok) {
      tf_y* __restrict__ yr = y + offset;
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int col0 = chunk_col(it);
        if (col0 >= cols) break;
        float w[VEC], b[VEC], out[VEC];
        load_params<TF_STREAM>(weight, col0, cols, vec, 1.f, w);
        load_params<TF_STREAM>(bias, col0, cols, vec, 0.f, b);
#pragma unroll
        for (int j = 0; j < VEC; ++j) out[j] = (unpack(cur[it], j) - mean) * rstd * w[j] + b[j];
        store_y_chunk(yr, col0, cols, vec, out);
      }
      if (threadIdx.x == 0 && cluster_rank() == 0) {
#if !TF_RMS
        mean_out[row] = mean;
#endif
        rstd_out[row] = rstd;
      }
    }
#if TF_PREFETCH
#pragma unroll
    for (int it = 0; it < ITERS; ++it) cur[it] = next[it];
#else
    const tf_i64 next_row = row + stride * RPB;
    if (group + stride < groups)
      load_row_or_zeros(cur, x, next_row, rows, cols, vec);
#endif
  }
#if TF_CLUSTER > 1
  cluster_barrier();  // the last totals are read from this CTA's shared memory until here
#endif
}

#endif  // TF_NORM_FWD

#if TF_NORM_BWD
// Variants whose fp32 dgamma (and dbeta) accumulators reach 64 per thread: ptxas hoisted the
// weight loads out of the row loop and spilled (LayerNorm at 16384 columns ran at 44% of copy).
// They read the weight from L1 every row and stream x and dy past L1 so the weight stays there.
#define BWD_WIDE (TF_ELEMS_PER_THREAD * (TF_RMS ? 1 : 2) >= 64)
// The same loads for a variant that asks for them (TF_STREAM, chosen by measurement).
#define BWD_STREAM (BWD_WIDE || TF_STREAM)

// TF_SMEM_ACC = 1: the dgamma/dbeta accumulators live in dynamic shared memory instead of
// registers (2 x ELEMS_PER_THREAD fp32 values a thread for LayerNorm), which frees the
// registers for more CTAs per SM; each row adds into them with 16-byte accesses, consecutive
// threads on consecutive vectors (no bank conflicts). Layout [quantity][RPB][ITERS * VEC / 4]
// [TPR] float4.
#define ACC_QUANTITIES (TF_RMS ? 1 : 2)
#define ACC_PARTS (VEC / 4)
#if TF_SMEM_ACC
// This thread's float4 `part` of chunk `it` of accumulator `quantity` (0 dgamma, 1 dbeta).
__device__ __forceinline__ float4* acc_slot(float4* base, int quantity, int it, int part) {
  const int row = quantity * RPB + static_cast<int>(threadIdx.y);
  return base + ((row * ITERS + it) * ACC_PARTS + part) * TPR + threadIdx.x;
}

// That float4 as v[4 * part .. 4 * part + 3] of this thread's VEC values of the chunk, from
// and to shared memory. (Callers loop over the parts outside, dgamma's and dbeta's part by
// part: that order is what the kernel was measured with.)
__device__ __forceinline__ void load_acc(float4* base, int quantity, int it, int part,
                                         float (&v)[VEC]) {
  const float4 a = *acc_slot(base, quantity, it, part);
  v[part * 4 + 0] = a.x;
  v[part * 4 + 1] = a.y;
  v[part * 4 + 2] = a.z;
  v[part * 4 + 3] = a.w;
}

__device__ __forceinline__ void store_acc(float4* base, int quantity, int it, int part,
                                          const float (&v)[VEC]) {
  *acc_slot(base, quantity, it, part) =
      make_float4(v[part * 4], v[part * 4 + 1], v[part * 4 + 2], v[part * 4 + 3]);
}
#endif

// Sums the CTA's rows of `acc` in a fixed order (row 0 of the CTA, then 1, ...) and writes
// them (its columns) as row cluster_index() of `partial`. Called by every thread of the CTA.
__device__ __forceinline__ void write_partial(float (&acc)[ITERS][VEC], float* __restrict__ partial,
                                              int cols, bool vec, float (*block_sum)[BLOCK_COLS]) {
#if RPB > 1
#pragma unroll
  for (int it = 0; it < ITERS; ++it)
#pragma unroll
    for (int j = 0; j < VEC; ++j) block_sum[threadIdx.y][chunk_col(it) + j] = acc[it][j];
  __syncthreads();
  if (threadIdx.y == 0) {
#pragma unroll
    for (int it = 0; it < ITERS; ++it)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float total = 0.f;
#pragma unroll
        for (int r = 0; r < RPB; ++r) total += block_sum[r][chunk_col(it) + j];
        acc[it][j] = total;
      }
  }
  __syncthreads();  // block_sum is reused for the next quantity
#endif
  if (threadIdx.y != 0) return;
  float* __restrict__ dst = partial + cluster_index() * cols;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int col0 = chunk_col(it);
    if (col0 >= cols) break;
    if (vec) {
#pragma unroll
      for (int part = 0; part < VEC / 4; ++part) {
        tf_pack<float> u;
#pragma unroll
        for (int j = 0; j < 4; ++j) u.e[j] = acc[it][part * 4 + j];
        *reinterpret_cast<tf_raw16*>(dst + col0 + part * 4) = u.raw;
      }
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if (col0 + j < cols) dst[col0 + j] = acc[it][j];
    }
  }
}

// dx (when dx != nullptr) and this CTA's partial sums of dgamma (dw_partial) and dbeta
// (db_partial, LayerNorm only), one fp32 row of `cols` each at row cluster_index().
extern "C" __global__ void TF_ROW_CTAS __launch_bounds__(TPR * RPB, TF_MIN_BLOCKS)
    norm_bwd(const tf_y* __restrict__ dy, const tf_storage* __restrict__ x,
             const float* __restrict__ mean, const float* __restrict__ rstd,
             const tf_param* __restrict__ weight, tf_storage* __restrict__ dx,
             float* __restrict__ dw_partial, float* __restrict__ db_partial, tf_i64 rows,
             int cols, int vectorized) {
  __shared__ float scratch[RPB][WARPS_PER_ROW][2];
  ClusterSums cluster = cluster_sums();
  const tf_i64 groups = (rows + RPB - 1) / RPB;
  const float inv_cols = 1.f / static_cast<float>(cols);
  const bool vec = vectorized != 0;

#if TF_SMEM_ACC
  extern __shared__ float4 acc_smem[];
#pragma unroll
  for (int q = 0; q < ACC_QUANTITIES; ++q)
#pragma unroll
    for (int it = 0; it < ITERS; ++it)
#pragma unroll
      for (int part = 0; part < ACC_PARTS; ++part)
        *acc_slot(acc_smem, q, it, part) = make_float4(0.f, 0.f, 0.f, 0.f);
#else
  float acc_w[ITERS][VEC];
#if !TF_RMS
  float acc_b[ITERS][VEC];
#endif
#pragma unroll
  for (int it = 0; it < ITERS; ++it)
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      acc_w[it][j] = 0.f;
#if !TF_RMS
      acc_b[it][j] = 0.f;
#endif
    }
#endif

  for (tf_i64 group = cluster_index(); group < groups; group += cluster_count()) {
    const tf_i64 row = group * RPB + threadIdx.y;
    const bool row_ok = row < rows;
    const int active_cols = row_ok ? cols : 0;
    const tf_i64 offset = row_ok ? row * cols : 0;
    tf_raw16 xs[ITERS];
    dy_chunk dys[ITERS];
    load_row<BWD_STREAM>(xs, x + offset, active_cols, vec);
    load_dy_row<BWD_STREAM>(dys, dy + offset, active_cols, vec);
    // Past the row's end dy is 0, so every product below that involves dy is 0 there too.
#if TF_RMS
    const float mu = 0.f;
#else
    const float mu = row_ok ? mean[row] : 0.f;
#endif
    const float rs = row_ok ? rstd[row] : 0.f;

    float sums[2] = {0.f, 0.f};  // sum(g), sum(g * xhat), g = dy * w
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int col0 = chunk_col(it);
      float w[VEC];
      load_params<BWD_STREAM>(weight, col0, active_cols, vec, 1.f, w);
#if TF_SMEM_ACC
      float acc_w[1][VEC];
#if !TF_RMS
      float acc_b[1][VEC];
#endif
#pragma unroll
      for (int part = 0; part < ACC_PARTS; ++part) {
        load_acc(acc_smem, 0, it, part, acc_w[0]);
#if !TF_RMS
        load_acc(acc_smem, 1, it, part, acc_b[0]);
#endif
      }
      const int slot = 0;
#else
      const int slot = it;
#endif
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = dy_at(dys[it], j);
        const float xhat = (unpack(xs[it], j) - mu) * rs;
        // Rounded once and reused below, never fused into an FMA there: a row of one element
        // must give dx = 0 exactly, as stock does (g - mean(g) cancels only if g is the same).
        const float g = __fmul_rn(d, w[j]);
        sums[0] += g;
        sums[1] += g * xhat;
        // One rounding, written out: whether the compiler contracts the product into the sum
        // may differ between compilations of this kernel (norm_cast's narrowed dy), and the
        // dgamma sums must be the same bits in each.
        acc_w[slot][j] = __fmaf_rn(d, xhat, acc_w[slot][j]);
#if !TF_RMS
        acc_b[slot][j] += d;
#endif
      }
#if TF_SMEM_ACC
#pragma unroll
      for (int part = 0; part < ACC_PARTS; ++part) {
        store_acc(acc_smem, 0, it, part, acc_w[0]);
#if !TF_RMS
        store_acc(acc_smem, 1, it, part, acc_b[0]);
#endif
      }
#endif
    }
    if (dx == nullptr) continue;  // uniform across the CTA: no barrier is skipped by some only
    row_sum(sums, scratch, cluster);
#if TF_RMS
    const float mean_g = 0.f;
#else
    const float mean_g = sums[0] * inv_cols;
#endif
    const float mean_gx = sums[1] * inv_cols;
    if (!row_ok) continue;
    tf_storage* __restrict__ dxr = dx + offset;
    if (cols <= VEC) {
      // The row is thread 0's first chunk. In rows this short dx is nearly all cancellation
      // (two columns: dx is eps / (var + eps) of its terms, since g - mean(g) and xhat's
      // component are almost the same vector), so fp32 rounding of the terms would be amplified
      // by (var + eps) / eps. The inputs are exact in fp64: evaluate the row there, from the
      // unrounded products; the fp32 row sums above are not used.
      if (chunk_col(0) == 0) {
        float w[VEC], out[VEC];
        load_params<BWD_STREAM>(weight, 0, cols, vec, 1.f, w);
        double g[VEC], xhat[VEC], sum_g = 0.0, sum_gx = 0.0;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          g[j] = j < cols ? static_cast<double>(dy_at(dys[0], j)) * w[j] : 0.0;
          xhat[j] = (static_cast<double>(unpack(xs[0], j)) - mu) * rs;
          sum_g += g[j];
          sum_gx += g[j] * xhat[j];
        }
        const double mean_g64 = TF_RMS ? 0.0 : sum_g / cols, mean_gx64 = sum_gx / cols;
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          out[j] = static_cast<float>(rs * (g[j] - mean_g64 - xhat[j] * mean_gx64));
        store_row_chunk(dxr, 0, cols, vec, out);
      }
      continue;
    }
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int col0 = chunk_col(it);
      if (col0 >= cols) break;
      float w[VEC], out[VEC];
      load_params<BWD_STREAM>(weight, col0, cols, vec, 1.f, w);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float xhat = (unpack(xs[it], j) - mu) * rs;
        out[j] = rs * (__fmul_rn(dy_at(dys[it], j), w[j]) - mean_g - xhat * mean_gx);
      }
      store_row_chunk(dxr, col0, cols, vec, out);
    }
  }

#if TF_CLUSTER > 1
  cluster_barrier();  // the last totals are read from this CTA's shared memory until here
#endif
#if RPB > 1
  __shared__ float block_sum[RPB][BLOCK_COLS];
#else
  float (*block_sum)[BLOCK_COLS] = nullptr;
#endif
#if TF_SMEM_ACC
  // Each thread reads back only the slots it wrote: no barrier needed.
  float acc_w[ITERS][VEC];
#if !TF_RMS
  float acc_b[ITERS][VEC];
#endif
#pragma unroll
  for (int it = 0; it < ITERS; ++it)
#pragma unroll
    for (int part = 0; part < ACC_PARTS; ++part) {
      load_acc(acc_smem, 0, it, part, acc_w[it]);
#if !TF_RMS
      load_acc(acc_smem, 1, it, part, acc_b[it]);
#endif
    }
#endif
  if (dw_partial != nullptr) write_partial(acc_w, dw_partial, cols, vec, block_sum);
#if !TF_RMS
  if (db_partial != nullptr) write_partial(acc_b, db_partial, cols, vec, block_sum);
#endif
}

// dweight / dbias from the partial rows of norm_bwd: column c sums partial rows 0..groups-1 in
// a fixed order (thread slice y takes rows y, y + 32, ...; the slices are then added 0..31).
// Block (32, 32); grid ceil(cols / 32). Either output may be null.
extern "C" __global__ void __launch_bounds__(1024)
    norm_bwd_reduce(const float* __restrict__ dw_partial, const float* __restrict__ db_partial,
                    int groups, int cols, tf_param* __restrict__ dw, tf_param* __restrict__ db) {
  __shared__ float slices[32][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  const float* partials[2] = {dw_partial, db_partial};
  tf_param* outs[2] = {dw, db};
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    if (outs[q] == nullptr) continue;  // uniform across the CTA
    float s = 0.f;
    if (col < cols) {
      for (int g = threadIdx.y; g < groups; g += 32)
        s += partials[q][static_cast<tf_i64>(g) * cols + col];
    }
    slices[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < cols) {
      float total = 0.f;
#pragma unroll
      for (int y = 0; y < 32; ++y) total += slices[y][threadIdx.x];
      outs[q][col] = tf_cast<tf_param>(total);
    }
    __syncthreads();
  }
}
#endif  // TF_NORM_BWD
