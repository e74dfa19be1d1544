// Embedding forward and backward: torch's `embedding` (a gather of table rows) and
// `embedding_dense_backward` (the scatter-add of grad rows into a dense table gradient).
//
// Forward (emb_fwd), one pass: every gathered table element is read once and every output
// element written once. The output is cut into vectors of TF_VEC elements (16 bytes); each
// thread loads TF_UNROLL vectors before it stores any, so a warp keeps TF_UNROLL x 512 bytes
// in flight.
//
// Backward, deterministic by construction (no floating-point atomics; every sum has an order
// fixed by the indices alone, so the result is bitwise identical run to run):
//  1. A stable LSD radix sort of the (index, token) pairs by index, 1 to 4 passes of up to
//     9-bit digits (as many bits as the table has rows). A pass is emb_sort_count (a digit
//     histogram per tile of 1024 or 2048 tokens) then emb_sort_scatter (each tile recomputes its
//     digits' global offsets from the histograms, ranks its tokens per warp with ballots, and
//     writes them to their sorted places). Tokens of one index stay in token order. Keys are
//     loaded before any is used, so a tile waits for memory once, not once per token.
//     On sm_90, up to 32768 tokens are sorted by emb_sort_cluster instead: one launch of one
//     thread-block cluster, the pairs kept in the CTAs' shared memory between passes (see
//     there).
//  2. The first emb_sort_count also marks every row some token has in a bitmap; once the sort
//     is done, emb_zero_rows_by_word writes the zero rows (unmarked, or padding_idx) on a
//     second stream, beside the reduction, so the two share the memory bandwidth. With the
//     cluster sort, emb_mark_rows makes the bitmap first and emb_zero_rows (a fill in
//     grid-stride order) runs beside the sort, which keeps to eight SMs and to shared memory.
//  3. emb_bwd_reduce cuts the sorted tokens into chunks of 32; a warp takes one chunk x 32
//     column vectors and walks its tokens in order (8 rows' loads in flight), summing each run
//     of equal indices in fp32: a run that holds all of its row's tokens is written to
//     grad_weight; a run cut by a chunk edge is written as an fp32 partial (slot 0: the
//     chunk's first run, slot 1: its last), and its row goes on a work list. The work per
//     warp does not depend on how the indices are distributed.
//  4. emb_bwd_finish sums each cut row's partials in chunk order and writes the row: a warp
//     per row with few partials, a whole CTA per tile of 128 columns for rows with many
//     (warps take fixed strides of partials, then a fixed-order sum over warps).
// Every row of grad_weight is written exactly once, grad is read once; besides that the sort
// moves 16 bytes per token per pass and the partials 8 bytes per column per cut row.
//
// Bad indices: outside [0, num_weights) they stop the kernel with a device-side assert (the
// forward, and the first sort pass of the backward), as stock's kernels do. Nothing out of
// bounds is read or written even if the assert were compiled out: such a token is skipped.
//
// Compile-time parameters (registry/embedding.toml): TF_DTYPE (table, output, grads),
// TF_THREADS and TF_UNROLL (emb_fwd), TF_SORT_CLUSTER (the launch's choice; no kernel reads
// it). Run time: `idx64` (int64 or int32 indices),
// `vectorized` (rows are whole 16-byte vectors and every row pointer 16-byte aligned;
// otherwise element by element).
#include "common.cuh"

// Every variant param (src/ops/embedding.rs Params, defaults included).
#if !defined(TF_THREADS) || !defined(TF_UNROLL) || !defined(TF_SORT_CLUSTER)
#error "TF_THREADS, TF_UNROLL and TF_SORT_CLUSTER must be defined"
#endif

// The launch shapes and tile sizes the launches share with these kernels: one source, the
// table in src/ops/embedding.rs (`SHARED`), passed as TF_EMB_<NAME>.
#if !defined(TF_EMB_SORT_THREADS) || !defined(TF_EMB_SORT_ITEMS_SMALL) ||                   \
    !defined(TF_EMB_SORT_ITEMS_LARGE) || !defined(TF_EMB_MAX_DIGIT_BITS) ||                 \
    !defined(TF_EMB_CHUNK) || !defined(TF_EMB_REDUCE_THREADS) ||                            \
    !defined(TF_EMB_FINISH_THREADS) || !defined(TF_EMB_ZERO_UNROLL) ||                      \
    !defined(TF_EMB_ZERO_SLICE) || !defined(TF_EMB_CLUSTER_SORT_CTAS) ||                    \
    !defined(TF_EMB_CLUSTER_SORT_THREADS) || !defined(TF_EMB_CLUSTER_SORT_ITEMS_MAX) ||     \
    !defined(TF_EMB_CLUSTER_SORT_SMEM) || !defined(TF_EMB_MARK_THREADS) ||                  \
    !defined(TF_EMB_MARK_ITEMS)
#error "the TF_EMB_* constants of src/ops/embedding.rs must be defined"
#endif

#define VEC TF_VEC
#define SORT_THREADS TF_EMB_SORT_THREADS
#define SORT_WARPS (SORT_THREADS / 32)
// Tokens per thread of a sort tile (the launch picks one: smaller tiles for fewer tokens, so
// that more CTAs share the latency-bound passes).
#define SORT_ITEMS_SMALL TF_EMB_SORT_ITEMS_SMALL
#define SORT_ITEMS_LARGE TF_EMB_SORT_ITEMS_LARGE
#define RADIX_MAX (1 << TF_EMB_MAX_DIGIT_BITS)
#define CHUNK TF_EMB_CHUNK
#define REDUCE_THREADS TF_EMB_REDUCE_THREADS
#define REDUCE_WARPS (REDUCE_THREADS / 32)
#define FINISH_THREADS TF_EMB_FINISH_THREADS
#define FINISH_WARPS (FINISH_THREADS / 32)

extern "C" __device__ void __assertfail(const char* message, const char* file, unsigned int line,
                                        const char* function, unsigned long char_size);

__device__ __noinline__ void index_out_of_range() {
  __assertfail("index out of range in self (torchfuse embedding: every index must be in "
               "[0, num_weights))",
               "embedding.cu", __LINE__, "embedding", 1);
}

__device__ __forceinline__ long long raw_index(const void* indices, int idx64, tf_i64 i) {
  return idx64 ? static_cast<const long long*>(indices)[i]
               : static_cast<long long>(static_cast<const int*>(indices)[i]);
}

// V elements of tf_storage from fp32: one 16-byte store when V == VEC, otherwise element by
// element.
template <int V>
__device__ __forceinline__ void store_vec(tf_storage* p, const float (&v)[V]) {
  if constexpr (V == VEC) {
    tf_pack<tf_storage> u;
#pragma unroll
    for (int j = 0; j < V; ++j) u.e[j] = tf_cast<tf_storage>(v[j]);
    *reinterpret_cast<tf_raw16*>(p) = u.raw;
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) p[j] = tf_cast<tf_storage>(v[j]);
  }
}

// V fp32 values (partials): 16-byte accesses when the vector is a whole number of them.
template <int V>
__device__ __forceinline__ void load_f32(const float* p, float (&v)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 4) {
      const float4 q = *reinterpret_cast<const float4*>(p + j);
      v[j] = q.x;
      v[j + 1] = q.y;
      v[j + 2] = q.z;
      v[j + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = p[j];
  }
}

template <int V>
__device__ __forceinline__ void store_f32(float* p, const float (&v)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 4)
      *reinterpret_cast<float4*>(p + j) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) p[j] = v[j];
  }
}

// ------------------------------------------------------------------------------ forward

template <int V>
__device__ __forceinline__ void gather(const tf_storage* __restrict__ weight, tf_i64 row_stride,
                                       const void* __restrict__ indices, int idx64,
                                       tf_i64 tokens, int cols, tf_i64 num_weights,
                                       tf_storage* __restrict__ out) {
  const tf_i64 per_row = cols / V;
  const tf_i64 units = tokens * per_row;
  const tf_i64 stride = static_cast<tf_i64>(gridDim.x) * blockDim.x;
  const bool narrow = units <= 0xffffffffll;
  for (tf_i64 base = static_cast<tf_i64>(blockIdx.x) * blockDim.x + threadIdx.x; base < units;
       base += stride * TF_UNROLL) {
    // Indices, then their check, then the rows: every load of a stage is in flight at once
    // (the assert is a call, which no load may be moved across).
    long long rows[TF_UNROLL];
    tf_i64 cs[TF_UNROLL];
#pragma unroll
    for (int k = 0; k < TF_UNROLL; ++k) {
      const tf_i64 u = base + k * stride;
      rows[k] = 0;
      cs[k] = 0;
      if (u < units) {
        // 32-bit division when it can be: this is the only arithmetic per 16 bytes moved.
        const tf_i64 t = narrow ? static_cast<tf_i64>(static_cast<unsigned int>(u) /
                                                      static_cast<unsigned int>(per_row))
                                : u / per_row;
        cs[k] = u - t * per_row;
        rows[k] = raw_index(indices, idx64, t);
      }
    }
    bool bad = false;
#pragma unroll
    for (int k = 0; k < TF_UNROLL; ++k) bad |= rows[k] < 0 || rows[k] >= num_weights;
    if (bad) {
      index_out_of_range();
      return;
    }
    tf_storage vals[TF_UNROLL][V];
#pragma unroll
    for (int k = 0; k < TF_UNROLL; ++k) {
      if (base + k * stride < units) {
        const tf_storage* src = weight + rows[k] * row_stride + cs[k] * V;
        if constexpr (V == VEC) {
          *reinterpret_cast<tf_raw16*>(vals[k]) = *reinterpret_cast<const tf_raw16*>(src);
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) vals[k][j] = src[j];
        }
      }
    }
#pragma unroll
    for (int k = 0; k < TF_UNROLL; ++k) {
      const tf_i64 u = base + k * stride;
      if (u < units) {
        tf_storage* dst = out + u * V;
        if constexpr (V == VEC) {
          *reinterpret_cast<tf_raw16*>(dst) = *reinterpret_cast<const tf_raw16*>(vals[k]);
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) dst[j] = vals[k][j];
        }
      }
    }
  }
}

// out[t, :] = weight[indices[t], :] for t < tokens; out is contiguous, weight rows are
// `row_stride` elements apart (its columns contiguous).
extern "C" __global__ void __launch_bounds__(TF_THREADS)
    emb_fwd(const tf_storage* __restrict__ weight, tf_i64 row_stride,
            const void* __restrict__ indices, int idx64, tf_i64 tokens, int cols,
            tf_i64 num_weights, tf_storage* __restrict__ out, int vectorized) {
  if (vectorized) {
    gather<VEC>(weight, row_stride, indices, idx64, tokens, cols, num_weights, out);
  } else {
    gather<1>(weight, row_stride, indices, idx64, tokens, cols, num_weights, out);
  }
}

// ------------------------------------------------------------------------------ sort

__device__ __forceinline__ unsigned int lanemask_lt() {
  unsigned int m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// The sort keys of a thread's ITEMS tokens first + k * step in this pass: the raw
// indices on the first pass (checked: an index outside the table asserts), the previous
// pass's keys after that. All loads are issued before the check. NOT_COUNTED: past the end.
#define NOT_COUNTED 0xffffffffu
template <int ITEMS>
__device__ __forceinline__ void load_keys(const void* indices, int idx64,
                                          const unsigned int* keys_in, tf_i64 first, int step,
                                          tf_i64 n, tf_i64 num_weights,
                                          unsigned int (&keys)[ITEMS]) {
  if (keys_in != nullptr) {
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const tf_i64 i = first + k * step;
      keys[k] = i < n ? keys_in[i] : NOT_COUNTED;
    }
    return;
  }
  long long raw[ITEMS];
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const tf_i64 i = first + k * step;
    raw[k] = i < n ? raw_index(indices, idx64, i) : 0;
  }
  bool bad = false;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const bool out_of_table = raw[k] < 0 || raw[k] >= num_weights;
    bad |= out_of_table;
    keys[k] = first + k * step < n && !out_of_table ? static_cast<unsigned int>(raw[k])
                                                     : NOT_COUNTED;
  }
  if (bad) index_out_of_range();
}

// The lanes of the warp whose key has the same digit (bits [shift, shift + bits)), and
// whether this lane's key counts at all: one ballot per digit bit (full-rate instructions;
// __match_any_sync is much slower when the digits are all different).
__device__ __forceinline__ unsigned int same_digit(unsigned int key, int shift, int bits,
                                                   bool& counted) {
  counted = key != NOT_COUNTED;
  const unsigned int valid = __ballot_sync(0xffffffffu, counted);
  unsigned int peers = counted ? valid : ~valid;
  for (int b = 0; b < bits; ++b) {
    const bool set = (key >> (shift + b)) & 1u;
    const unsigned int m = __ballot_sync(0xffffffffu, set);
    peers &= set ? m : ~m;
  }
  return peers;
}

__device__ __forceinline__ int digit_of(unsigned int key, int shift, int radix) {
  return static_cast<int>((key >> shift) & (radix - 1));
}

// Each token's place among the warp's tokens of the same digit (warp order: item k, then
// lane), counted on from warp_counts[digit], which ends as the warp's count per digit (zeroed
// by the caller); NOT_COUNTED for a token that does not count.
template <int ITEMS>
__device__ __forceinline__ void rank_in_warp(const unsigned int (&keys)[ITEMS], int shift,
                                             int bits, unsigned int* warp_counts,
                                             unsigned int (&rank)[ITEMS]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    bool counted;
    const unsigned int peers = same_digit(keys[k], shift, bits, counted);
    const int digit = digit_of(keys[k], shift, 1 << bits);
    rank[k] = counted ? __popc(peers & lanemask_lt()) : NOT_COUNTED;
    unsigned int before = 0;
    if (counted) before = warp_counts[digit];
    __syncwarp();
    if (counted && lane == __ffs(peers) - 1) warp_counts[digit] = before + __popc(peers);
    if (counted) rank[k] += before;
    __syncwarp();  // the next leader of this digit may be another lane
  }
}

// Digit d's per-warp counts (next[w][d]) -> each warp's first place for it, warps in order
// from `place`.
template <int WARPS>
__device__ __forceinline__ void first_places(unsigned int (*next)[RADIX_MAX], int d,
                                             unsigned int place) {
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    const unsigned int c = next[w][d];
    next[w][d] = place;
    place += c;
  }
}

// hist[tile * radix + digit] = how many of the tile's tokens have that digit. The first pass
// also sets each token's row bit in `touched` (cleared before the launch).
template <int ITEMS>
__device__ __forceinline__ void sort_count(const void* __restrict__ indices, int idx64,
                                           const unsigned int* __restrict__ keys_in, tf_i64 n,
                                           tf_i64 num_weights, int shift, int bits,
                                           unsigned int* __restrict__ hist,
                                           unsigned int* __restrict__ touched) {
  __shared__ unsigned int counts[RADIX_MAX];
  const int radix = 1 << bits;
  for (int d = threadIdx.x; d < radix; d += SORT_THREADS) counts[d] = 0;
  unsigned int keys[ITEMS];
  load_keys(indices, idx64, keys_in, static_cast<tf_i64>(blockIdx.x) * ITEMS * SORT_THREADS + threadIdx.x,
            SORT_THREADS, n, num_weights, keys);
  __syncthreads();
  const int lane = threadIdx.x % 32;
  // The first pass reads the bitmap words of its rows up front (all loads in flight at once):
  // a bit already set (the hot rows of skewed indices) skips the atomic.
  unsigned int seen[ITEMS];
  if (touched != nullptr) {
#pragma unroll
    for (int k = 0; k < ITEMS; ++k)
      seen[k] = __ldcg(&touched[keys[k] != NOT_COUNTED ? keys[k] >> 5 : 0u]);
  }
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    bool counted;
    const unsigned int peers = same_digit(keys[k], shift, bits, counted);
    // One shared-memory add per distinct digit in the warp (all-equal indices would
    // otherwise serialize 32 adds on one address).
    if (counted && lane == __ffs(peers) - 1)
      atomicAdd(&counts[digit_of(keys[k], shift, radix)], __popc(peers));
    if (touched != nullptr) {
      // Runs of one row skip the atomic too (all-equal indices would serialize on one word).
      const unsigned int left = __shfl_up_sync(0xffffffffu, keys[k], 1);
      const unsigned int bit = 1u << (keys[k] & 31);
      if (counted && (lane == 0 || left != keys[k]) && !(seen[k] & bit))
        atomicOr(&touched[keys[k] >> 5], bit);
    }
  }
  __syncthreads();
  for (int d = threadIdx.x; d < radix; d += SORT_THREADS)
    hist[static_cast<tf_i64>(blockIdx.x) * radix + d] = counts[d];
}

extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    emb_sort_count(const void* __restrict__ indices, int idx64,
                   const unsigned int* __restrict__ keys_in, tf_i64 n, tf_i64 num_weights,
                   int shift, int bits, unsigned int* __restrict__ hist,
                   unsigned int* __restrict__ touched, int items) {
  if (items == SORT_ITEMS_SMALL) {
    sort_count<SORT_ITEMS_SMALL>(indices, idx64, keys_in, n, num_weights, shift, bits, hist,
                                 touched);
  } else {
    sort_count<SORT_ITEMS_LARGE>(indices, idx64, keys_in, n, num_weights, shift, bits, hist,
                                 touched);
  }
}

// Writes the tile's tokens to their places in the order (digit, token): keys_out/pos_out.
// pos_in null: the first pass, positions are token numbers.
template <int ITEMS>
__device__ __forceinline__ void sort_scatter(const void* __restrict__ indices, int idx64,
                     const unsigned int* __restrict__ keys_in,
                     const unsigned int* __restrict__ pos_in, tf_i64 n, tf_i64 num_weights,
                     int shift, int bits, const unsigned int* __restrict__ hist, int tiles,
                     unsigned int* __restrict__ keys_out, unsigned int* __restrict__ pos_out) {
  // next[w][d]: where warp w writes its next token of digit d.
  __shared__ unsigned int next[SORT_WARPS][RADIX_MAX];
  __shared__ unsigned int digit_start[RADIX_MAX];
  __shared__ unsigned int warp_totals[SORT_WARPS];
  const int radix = 1 << bits;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int tile = blockIdx.x;

  // Each warp owns a contiguous stretch of the tile, ITEMS tokens per lane, all loaded
  // up front.
  const tf_i64 warp_start =
      static_cast<tf_i64>(tile) * ITEMS * SORT_THREADS + static_cast<tf_i64>(warp) * ITEMS * 32;
  unsigned int keys[ITEMS];
  unsigned int pos[ITEMS];
  load_keys(indices, idx64, keys_in, warp_start + lane, 32, n, num_weights, keys);
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const tf_i64 i = warp_start + k * 32 + lane;
    pos[k] = pos_in == nullptr ? static_cast<unsigned int>(i) : (i < n ? pos_in[i] : 0u);
  }

  // 1. The digits' global order: all tokens of smaller digits, then this digit's tokens of
  //    earlier tiles. Digits are spread over threads two per thread (radix <= 512).
  unsigned int before_tile[2] = {0, 0};
  unsigned int total[2] = {0, 0};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int d = threadIdx.x * 2 + h;
    if (d < radix) {
#pragma unroll 8
      for (int j = 0; j < tiles; ++j) {
        const unsigned int c = hist[static_cast<tf_i64>(j) * radix + d];
        before_tile[h] += j < tile ? c : 0u;
        total[h] += c;
      }
    }
  }
  // Exclusive scan of the totals over digits (thread order = digit order).
  const unsigned int pair = total[0] + total[1];
  unsigned int inclusive = pair;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const unsigned int up = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  for (int d = lane; d < radix; d += 32) next[warp][d] = 0;
  __syncthreads();
  unsigned int warp_base = 0;
  for (int w = 0; w < warp; ++w) warp_base += warp_totals[w];
  const unsigned int first = warp_base + inclusive - pair;
  if (threadIdx.x * 2 < radix) digit_start[threadIdx.x * 2] = first + before_tile[0];
  if (threadIdx.x * 2 + 1 < radix)
    digit_start[threadIdx.x * 2 + 1] = first + total[0] + before_tile[1];

  // 2. Count the warp's digits, and keep each token's rank among its warp-mates of the same
  //    digit.
  unsigned int rank[ITEMS];
  rank_in_warp(keys, shift, bits, next[warp], rank);
  __syncthreads();

  // 3. Counts -> each warp's first place per digit (warps in order).
  for (int d = threadIdx.x; d < radix; d += SORT_THREADS)
    first_places<SORT_WARPS>(next, d, digit_start[d]);
  __syncthreads();

  // 4. Scatter: the warp's first place for the digit plus the rank within the warp.
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    if (rank[k] != NOT_COUNTED) {
      const unsigned int place = next[warp][digit_of(keys[k], shift, radix)] + rank[k];
      keys_out[place] = keys[k];
      pos_out[place] = pos[k];
    }
  }
}

// Column vectors each thread of emb_zero_rows stores per round (all bitmap loads first), and
// the CTAs per SM its registers allow (8: at most 32 registers a thread, so that beside its
// 4 CTAs per SM a CTA of emb_bwd_reduce fits in the register file; at 40 it did not. Measured:
// the same at GPT-2's shape, 175 -> 171 us at 131072 bf16 tokens).
#define ZERO_UNROLL TF_EMB_ZERO_UNROLL
#define ZERO_MIN_BLOCKS 8

// Zeros for every row no token touches (its bit in `touched` is clear) and for the padding
// row: a fill of the whole table's column vectors in grid-stride order, consecutive threads on
// consecutive vectors, that skips the vectors of touched rows (the bitmap is small and stays
// in cache). Rows per work item were measured slower: a warp per 32 rows spreads the writes
// over as many streams as warps (2.3 TB/s alone; this order is a plain fill's).
// Index type I: 32-bit where the table's vectors number below 2^32 (registers: see above).
template <int V, typename I>
__device__ __forceinline__ void zero_rows(const unsigned int* __restrict__ touched, int cols,
                                          I num_weights, tf_i64 padding_idx,
                                          tf_storage* __restrict__ out) {
  const I per_row = static_cast<I>(cols / V);
  const I total = num_weights * per_row;
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  float zero[V];
#pragma unroll
  for (int j = 0; j < V; ++j) zero[j] = 0.f;
  for (I base = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; base < total;
       base += stride * ZERO_UNROLL) {
    unsigned int words[ZERO_UNROLL];
#pragma unroll
    for (int k = 0; k < ZERO_UNROLL; ++k) {
      const I u = base + k * stride;
      words[k] = u < total ? touched[(u / per_row) >> 5] : ~0u;
    }
#pragma unroll
    for (int k = 0; k < ZERO_UNROLL; ++k) {
      const I u = base + k * stride;
      const I row = u / per_row;
      if (u < total && (static_cast<tf_i64>(row) == padding_idx || !((words[k] >> (row & 31)) & 1u)))
        store_vec<V>(out + static_cast<tf_i64>(row) * cols + (u - row * per_row) * V, zero);
    }
  }
}

template <int V>
__device__ __forceinline__ void zero_rows(const unsigned int* __restrict__ touched, int cols,
                                          tf_i64 num_weights, tf_i64 padding_idx,
                                          tf_storage* __restrict__ out) {
  if (num_weights * (cols / V) <= 0xffffffffll) {
    zero_rows<V, unsigned int>(touched, cols, static_cast<unsigned int>(num_weights),
                               padding_idx, out);
  } else {
    zero_rows<V, tf_i64>(touched, cols, num_weights, padding_idx, out);
  }
}

// Column vectors of a row one warp zeroes per work item (4 stores per lane).
#define ZERO_SLICE TF_EMB_ZERO_SLICE

// The same zeros, a work item per warp: 32 consecutive rows (one bitmap word) x a slice of
// ZERO_SLICE column vectors, so wide rows spread over many warps; the grid's warps take items
// in turn. Beside the reduction after the launch sort this order is faster than the fill's
// (measured in one run: 32000 x 4096 x 16384 bf16 169 against 172 us, f32 303 against 312).
template <int V>
__device__ __forceinline__ void zero_rows_by_word(const unsigned int* __restrict__ touched, int cols,
                                          tf_i64 num_weights, tf_i64 padding_idx,
                                          tf_storage* __restrict__ out) {
  __shared__ unsigned char zero_list[SORT_WARPS][32];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const tf_i64 warps = static_cast<tf_i64>(gridDim.x) * SORT_WARPS;
  const tf_i64 my_warp = static_cast<tf_i64>(blockIdx.x) * SORT_WARPS + warp;
  const tf_i64 per_row = cols / V;
  const tf_i64 slices = (per_row + ZERO_SLICE - 1) / ZERO_SLICE;
  const tf_i64 items = (num_weights + 31) / 32 * slices;
  float zero[V];
#pragma unroll
  for (int j = 0; j < V; ++j) zero[j] = 0.f;
  for (tf_i64 item = my_warp; item < items; item += warps) {
    const tf_i64 group = item / slices;
    const tf_i64 c_begin = (item - group * slices) * ZERO_SLICE;
    const tf_i64 c_end = min(per_row, c_begin + ZERO_SLICE);
    const tf_i64 r0 = group * 32;
    const tf_i64 r = r0 + lane;
    const unsigned int word = touched[group];
    const bool zero_row = r < num_weights && (r == padding_idx || !((word >> lane) & 1u));
    const unsigned int mask = __ballot_sync(0xffffffffu, zero_row);
    if (zero_row) zero_list[warp][__popc(mask & lanemask_lt())] = static_cast<unsigned char>(lane);
    __syncwarp();
    const int rows = __popc(mask);
    if (per_row >= 32) {
      for (int k = 0; k < rows; ++k) {
        tf_storage* row = out + (r0 + zero_list[warp][k]) * cols;
        for (tf_i64 c = c_begin + lane; c < c_end; c += 32) store_vec<V>(row + c * V, zero);
      }
    } else {
      // Narrow rows (one slice): the warp's lanes spread over several rows at once.
      const int narrow = static_cast<int>(per_row);
      for (int u = lane; u < rows * narrow; u += 32) {
        const int k = u / narrow;
        store_vec<V>(out + (r0 + zero_list[warp][k]) * cols + (u - k * narrow) * V, zero);
      }
    }
    __syncwarp();
  }
}

// Pass p of the sort: one block per tile.
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    emb_sort_scatter(const void* __restrict__ indices, int idx64,
                     const unsigned int* __restrict__ keys_in,
                     const unsigned int* __restrict__ pos_in, tf_i64 n, tf_i64 num_weights,
                     int shift, int bits, const unsigned int* __restrict__ hist, int tiles,
                     unsigned int* __restrict__ keys_out, unsigned int* __restrict__ pos_out,
                     int items) {
  if (items == SORT_ITEMS_SMALL) {
    sort_scatter<SORT_ITEMS_SMALL>(indices, idx64, keys_in, pos_in, n, num_weights, shift, bits,
                                   hist, tiles, keys_out, pos_out);
  } else {
    sort_scatter<SORT_ITEMS_LARGE>(indices, idx64, keys_in, pos_in, n, num_weights, shift, bits,
                                   hist, tiles, keys_out, pos_out);
  }
}

// ------------------------------------------------------------------------------ cluster sort

// Up to CSORT_CLUSTER * CSORT_TILE_MAX tokens on sm_90: the whole sort in one launch of one
// thread-block cluster, on chip. Each CTA holds a tile of the (key, token) pairs in shared
// memory. A pass ranks the tile's tokens per warp (as emb_sort_scatter does) and sends the
// tile's digit counts to every CTA of the cluster; each CTA then has all the tiles' counts,
// finds its tokens' places in the order (digit, tile, warp, token) and stores each pair
// straight into the shared memory of the CTA that owns that place. Both exchanges are st.async
// stores counted by an mbarrier in the receiving CTA (which knows how many bytes it gets), not
// cluster barriers: a barrier.cluster release waits for the whole memory system (MEMBAR.GPU).
// So a pass touches no global memory; the indices are read once and the sorted pairs written
// once (the launch sort moves 16 bytes per token per pass, in four or more latency-bound
// launches). The sort is stable like the other: tokens of one index stay in token order. Its
// eight SMs leave the rest of the GPU to the zero rows, which run beside it (their bitmap comes
// from emb_mark_rows, before both).
//
// Reuse without barriers: a CTA sends pass p + 1's counts only once pass p's pairs have all
// reached it, which needs every CTA's pass p counts, so the counts alternate between two slots
// (and two mbarriers), and a pass's pairs never land in a buffer still being read.
#define CSORT_CLUSTER TF_EMB_CLUSTER_SORT_CTAS
#define CSORT_THREADS TF_EMB_CLUSTER_SORT_THREADS
#define CSORT_WARPS (CSORT_THREADS / 32)
#define CSORT_ITEMS_MAX TF_EMB_CLUSTER_SORT_ITEMS_MAX
#define CSORT_TILE_MAX (CSORT_THREADS * CSORT_ITEMS_MAX)

struct ClusterSortSmem {
  uint2 pairs[2][CSORT_TILE_MAX];  // (key, token): a pass's input and output, alternating
  unsigned int next[CSORT_WARPS][RADIX_MAX];
  unsigned int received[2][CSORT_CLUSTER][RADIX_MAX];  // [pass parity][sending tile][digit]
  unsigned int tile_counts[RADIX_MAX];
  unsigned int warp_totals[CSORT_WARPS];
  unsigned long long counts_arrived[2];  // mbarriers, by pass parity
  unsigned long long pairs_arrived;
};
// The launch's dynamic shared memory, as src/ops/embedding.rs sizes it.
#define CSORT_SMEM_BYTES TF_EMB_CLUSTER_SORT_SMEM
static_assert(sizeof(ClusterSortSmem) == CSORT_SMEM_BYTES, "cluster sort shared memory");
static_assert(RADIX_MAX == CSORT_THREADS, "the cluster sort takes one digit per thread");

#if __CUDA_ARCH__ >= 900
#define CSORT_DIMS __cluster_dims__(CSORT_CLUSTER, 1, 1)

// st.async into (possibly) another CTA's shared memory, completing bytes on its mbarrier.
__device__ __forceinline__ void send_counts(unsigned int addr, uint4 v, unsigned int bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.u32 [%0], {%1, %2, %3, %4}, [%5];"
      ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(bar) : "memory");
}
__device__ __forceinline__ void send_pair(unsigned int addr, unsigned int key, unsigned int pos,
                                          unsigned int bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.u32 [%0], {%1, %2}, [%3];"
               ::"r"(addr), "r"(key), "r"(pos), "r"(bar) : "memory");
}
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}

// ITEMS tokens per thread: the tile is ITEMS * CSORT_THREADS tokens, warp w holding a
// contiguous stretch of ITEMS * 32 of them (item k at lane + 32k).
template <int ITEMS>
__device__ __forceinline__ void cluster_sort(const void* __restrict__ indices, int idx64,
                                             tf_i64 n, tf_i64 num_weights, int passes,
                                             int digit_bits, int bits,
                                             unsigned int* __restrict__ keys_out,
                                             unsigned int* __restrict__ pos_out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ClusterSortSmem& s = *reinterpret_cast<ClusterSortSmem*>(smem_raw);
  const int cta = cluster_ctarank();
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int tile = ITEMS * CSORT_THREADS;
  const tf_i64 tile_first = static_cast<tf_i64>(cta) * tile;
  const int warp_first = warp * ITEMS * 32;
  const unsigned int pairs_bar = smem_addr(&s.pairs_arrived);

  if (threadIdx.x == 0) {
    mbar_init(smem_addr(&s.counts_arrived[0]), 1);
    mbar_init(smem_addr(&s.counts_arrived[1]), 1);
    mbar_init(pairs_bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // Waited for before the first send: every CTA's mbarriers are ready.
  cluster_arrive();

  unsigned int keys[ITEMS];
  unsigned int pos[ITEMS];
  load_keys(indices, idx64, nullptr, tile_first + warp_first + lane, 32, n, num_weights, keys);
#pragma unroll
  for (int k = 0; k < ITEMS; ++k)
    pos[k] = static_cast<unsigned int>(tile_first + warp_first + k * 32 + lane);

  // Tokens that count (every index in the table): the sorted order's length, the same for all
  // passes. Places past it are never filled.
  unsigned int sorted_len = 0;
  int tile_len = 0;
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = pass * digit_bits;
    const int pass_bits = min(digit_bits, bits - shift);
    const int radix = 1 << pass_bits;
    const int parity = pass & 1;
    if (pass > 0) {
#pragma unroll
      for (int k = 0; k < ITEMS; ++k) {
        const int j = warp_first + k * 32 + lane;
        const uint2 p = s.pairs[parity][j];
        keys[k] = j < tile_len ? p.x : NOT_COUNTED;
        pos[k] = p.y;
      }
    }
    __syncwarp();  // the warp's lanes are done with the last pass's places
    for (int d = lane; d < radix; d += 32) s.next[warp][d] = 0;
    __syncwarp();
    unsigned int rank[ITEMS];
    rank_in_warp(keys, shift, pass_bits, s.next[warp], rank);
    __syncthreads();
    const int d = threadIdx.x;  // RADIX_MAX == CSORT_THREADS: one digit per thread
    unsigned int tile_count = 0;
    if (d < radix)
#pragma unroll
      for (int w = 0; w < CSORT_WARPS; ++w) tile_count += s.next[w][d];
    s.tile_counts[d] = tile_count;
    __syncthreads();

    // The tile's counts to every CTA, four digits per store.
    if (pass == 0) cluster_wait();
    const int vectors = (radix + 3) / 4;
    const unsigned int counts_bar = smem_addr(&s.counts_arrived[parity]);
    for (int i = threadIdx.x; i < vectors * CSORT_CLUSTER; i += CSORT_THREADS) {
      const int to = i / vectors;
      const int v = i - to * vectors;
      const uint4 c = *reinterpret_cast<const uint4*>(&s.tile_counts[4 * v]);
      send_counts(cluster_addr(smem_addr(&s.received[parity][cta][4 * v]), to), c,
                  cluster_addr(counts_bar, to));
    }
    if (threadIdx.x == 0) mbar_expect_bytes(counts_bar, CSORT_CLUSTER * vectors * 16);
    mbar_wait(counts_bar, (pass >> 1) & 1);

    // This digit's tokens in all tiles (total) and in the tiles before this one.
    unsigned int total = 0, before = 0;
    if (d < radix) {
#pragma unroll
      for (int r = 0; r < CSORT_CLUSTER; ++r) {
        const unsigned int c = s.received[parity][r][d];
        total += c;
        before += r < cta ? c : 0u;
      }
    }
    // Exclusive scan of the totals over digits (thread order = digit order).
    unsigned int inclusive = total;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const unsigned int up = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += up;
    }
    if (lane == 31) s.warp_totals[warp] = inclusive;
    __syncthreads();
    unsigned int warp_base = 0;
    if (pass == 0) {
#pragma unroll
      for (int w = 0; w < CSORT_WARPS; ++w) {
        warp_base += w < warp ? s.warp_totals[w] : 0u;
        sorted_len += s.warp_totals[w];
      }
      tile_len = static_cast<int>(min(max(static_cast<tf_i64>(sorted_len) - tile_first, 0ll),
                                      static_cast<tf_i64>(tile)));
    } else {
#pragma unroll
      for (int w = 0; w < CSORT_WARPS; ++w) warp_base += w < warp ? s.warp_totals[w] : 0u;
    }
    if (d < radix)
      first_places<CSORT_WARPS>(s.next, d, warp_base + inclusive - total + before);
    __syncthreads();

    // The pairs: this CTA receives tile_len of them, 8 bytes each.
    if (threadIdx.x == 0) mbar_expect_bytes(pairs_bar, tile_len * 8);
    const int target = parity ^ 1;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (rank[k] != NOT_COUNTED) {
        const unsigned int place = s.next[warp][digit_of(keys[k], shift, radix)] + rank[k];
        const unsigned int owner = place / tile;
        send_pair(cluster_addr(smem_addr(&s.pairs[target][place - owner * tile]), owner),
                  keys[k], pos[k], cluster_addr(pairs_bar, owner));
      }
    }
    mbar_wait(pairs_bar, parity);
  }

  // No CTA leaves while another may still access its shared memory.
  cluster_arrive();
  const uint2* sorted = s.pairs[passes & 1];
  for (int j = threadIdx.x; j < tile; j += CSORT_THREADS) {
    const tf_i64 i = tile_first + j;
    if (i >= n) break;
    const uint2 p = sorted[j];
    keys_out[i] = j < tile_len ? p.x : NOT_COUNTED;
    pos_out[i] = j < tile_len ? p.y : NOT_COUNTED;
  }
  cluster_wait();
}
#else
#define CSORT_DIMS
#endif

// The whole sort for up to CSORT_CLUSTER * CSORT_TILE_MAX tokens (sm_90 only; the launch is
// one cluster, `items` tokens per thread: 1, 2, 4 or 8).
extern "C" __global__ void CSORT_DIMS __launch_bounds__(CSORT_THREADS)
    emb_sort_cluster(const void* __restrict__ indices, int idx64, tf_i64 n, tf_i64 num_weights,
                     int passes, int digit_bits, int bits, unsigned int* __restrict__ keys_out,
                     unsigned int* __restrict__ pos_out, int items) {
#if __CUDA_ARCH__ >= 900
  switch (items) {
    case 1:
      cluster_sort<1>(indices, idx64, n, num_weights, passes, digit_bits, bits, keys_out,
                      pos_out);
      break;
    case 2:
      cluster_sort<2>(indices, idx64, n, num_weights, passes, digit_bits, bits, keys_out,
                      pos_out);
      break;
    case 4:
      cluster_sort<4>(indices, idx64, n, num_weights, passes, digit_bits, bits, keys_out,
                      pos_out);
      break;
    default:
      cluster_sort<CSORT_ITEMS_MAX>(indices, idx64, n, num_weights, passes, digit_bits, bits,
                                    keys_out, pos_out);
      break;
  }
#else
  __trap();  // never launched below sm_90
#endif
}

// The touched rows' bitmap for the cluster sort's path, in one launch of one cluster (sm_90,
// up to CSORT_CLUSTER * MARK_THREADS * MARK_ITEMS tokens): the CTAs clear the flags (bitmap
// and the work list's two lengths), a cluster barrier orders that before any mark, then each
// token sets its row's bit. A memset node before a separate marking kernel cost about 3 us of
// dependency latency in a CUDA graph. The indices are loaded before the barrier, so its wait
// overlaps theirs. A lane whose left neighbour has the same row skips its atomic (all-equal
// indices would otherwise serialize on one word); out-of-range indices are left to the sort's
// check.
#define MARK_THREADS TF_EMB_MARK_THREADS
#define MARK_ITEMS TF_EMB_MARK_ITEMS
extern "C" __global__ void CSORT_DIMS __launch_bounds__(MARK_THREADS)
    emb_mark_rows(const void* __restrict__ indices, int idx64, tf_i64 n, tf_i64 num_weights,
                  unsigned int* __restrict__ flags, tf_i64 flag_words) {
#if __CUDA_ARCH__ >= 900
  const tf_i64 first = static_cast<tf_i64>(cluster_ctarank()) * MARK_THREADS + threadIdx.x;
  const tf_i64 stride = static_cast<tf_i64>(CSORT_CLUSTER) * MARK_THREADS;
  long long rows[MARK_ITEMS];
#pragma unroll
  for (int k = 0; k < MARK_ITEMS; ++k) {
    const tf_i64 i = first + k * stride;
    rows[k] = i < n ? raw_index(indices, idx64, i) : -1;
  }
  for (tf_i64 i = first; i < flag_words; i += stride) flags[i] = 0;
  cluster_barrier();
#pragma unroll
  for (int k = 0; k < MARK_ITEMS; ++k) {
    const long long row = rows[k];
    const long long left = __shfl_up_sync(0xffffffffu, row, 1);
    if (row >= 0 && row < num_weights && (threadIdx.x % 32 == 0 || left != row))
      atomicOr(&flags[row >> 5], 1u << (row & 31));
  }
#else
  __trap();  // never launched below sm_90
#endif
}

// The zero rows from emb_mark_rows' bitmap, on a second stream beside the cluster sort and the
// reduction, with a few CTAs per SM (they keep the rest).
extern "C" __global__ void __launch_bounds__(SORT_THREADS, ZERO_MIN_BLOCKS)
    emb_zero_rows(const unsigned int* __restrict__ touched, int cols, tf_i64 num_weights,
                  tf_i64 padding_idx, tf_storage* __restrict__ out, int vectorized) {
  if (vectorized) {
    zero_rows<VEC>(touched, cols, num_weights, padding_idx, out);
  } else {
    zero_rows<1>(touched, cols, num_weights, padding_idx, out);
  }
}

// The zero rows from the first emb_sort_count's bitmap, on a second stream beside the
// reduction after the launch sort, with a few CTAs per SM (the reduction keeps the rest).
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    emb_zero_rows_by_word(const unsigned int* __restrict__ touched, int cols,
                          tf_i64 num_weights, tf_i64 padding_idx, tf_storage* __restrict__ out,
                          int vectorized) {
  if (vectorized) {
    zero_rows_by_word<VEC>(touched, cols, num_weights, padding_idx, out);
  } else {
    zero_rows_by_word<1>(touched, cols, num_weights, padding_idx, out);
  }
}

// ------------------------------------------------------------------------------ backward

// Sorted tokens a warp of emb_bwd_reduce loads before adding any: one 16-byte vector of each
// token's grad row per lane.
#define RUN_LOADS 8
#define NO_KEY 0xffffffffffffffffull
// Rows cut by chunk edges with more partials than this are summed by a whole CTA per column
// tile in emb_bwd_finish, the others by one warp each.
#define HEAVY_PARTIALS 16

// One run of equal keys ends in a chunk: where its sum goes. A run wholly inside the chunk is
// written to its row of grad_weight; one cut by a chunk edge becomes the fp32 partial of slot
// 0 (the chunk's first run) or 1 (its last), and the row's bookkeeping is done once per chunk
// (column slice 0): row_first[row] = its first partial (chunk * 2 + slot), written by the run
// that starts the row, and the row's last chunk appended to the work list by the run that
// ends it. The list has room for one entry per chunk: light rows (HEAVY_PARTIALS partials or
// fewer) fill it from the front (work[0] of them, at work[2..]), heavy ones from the back
// (work[1] of them, at work[2 + chunks - 1] downwards), so the finish finds the heavy rows
// without reading every entry. A row is heavy when its run already covered the last token of
// the chunk HEAVY_PARTIALS before this one.
template <int V>
__device__ __forceinline__ void flush_run(unsigned long long key, bool valid, int start, int end,
                                          int len, unsigned long long key_before,
                                          unsigned long long key_after, tf_i64 chunk, int col,
                                          bool in_row, bool bookkeeper, int cols,
                                          tf_i64 num_weights, tf_i64 padding_idx,
                                          const float (&acc)[V], float* __restrict__ partials,
                                          tf_storage* __restrict__ out,
                                          const unsigned int* __restrict__ keys,
                                          tf_i64 chunks, unsigned int* __restrict__ row_first,
                                          unsigned int* __restrict__ work) {
  if (!valid || key >= static_cast<unsigned long long>(num_weights) ||
      static_cast<long long>(key) == padding_idx)
    return;
  const bool from_before = start == 0 && key_before == key;
  const bool to_after = end == len && len == CHUNK && key_after == key;
  if (!from_before && !to_after) {
    if (in_row) store_vec<V>(out + static_cast<tf_i64>(key) * cols + col * V, acc);
    return;
  }
  const int slot = start == 0 ? 0 : 1;
  if (in_row) store_f32<V>(partials + (chunk * 2 + slot) * static_cast<tf_i64>(cols) + col * V, acc);
  if (bookkeeper) {
    if (!from_before && to_after) row_first[key] = static_cast<unsigned int>(chunk * 2 + slot);
    // The list's order varies run to run; what each entry computes does not.
    if (from_before && !to_after) {
      const bool heavy = chunk >= HEAVY_PARTIALS &&
                         keys[(chunk - HEAVY_PARTIALS) * CHUNK + CHUNK - 1] == key;
      if (heavy) {
        work[2 + chunks - 1 - atomicAdd(&work[1], 1u)] = static_cast<unsigned int>(chunk);
      } else {
        work[2 + atomicAdd(&work[0], 1u)] = static_cast<unsigned int>(chunk);
      }
    }
  }
}

// Warp w of the grid takes sorted tokens [32c, 32c + 32) (chunk c) x 32 column vectors (slice
// s, one per lane): it walks the chunk's tokens in order with RUN_LOADS rows' loads in flight,
// summing each run of equal keys in fp32 in token order, and hands each finished run to
// flush_run. The work per warp is the same whatever the runs are, so skewed indices (long
// runs) keep every warp as busy as uniform ones.
template <int V>
__device__ __forceinline__ void reduce_slice(const tf_storage* __restrict__ grad,
                                             const unsigned int* __restrict__ keys,
                                             const unsigned int* __restrict__ pos, tf_i64 n,
                                             int cols, tf_i64 num_weights, tf_i64 padding_idx,
                                             float* __restrict__ partials,
                                             tf_storage* __restrict__ out,
                                             unsigned int* __restrict__ row_first,
                                             unsigned int* __restrict__ work) {
  const int lane = threadIdx.x % 32;
  const int per_row = cols / V;
  const tf_i64 slices = (per_row + 31) / 32;
  const tf_i64 unit = static_cast<tf_i64>(blockIdx.x) * REDUCE_WARPS + threadIdx.x / 32;
  const tf_i64 chunk = unit / slices;
  const int slice = static_cast<int>(unit - chunk * slices);
  const tf_i64 a0 = chunk * CHUNK;
  const tf_i64 chunks = (n + CHUNK - 1) / CHUNK;
  if (a0 >= n) return;
  const int len = static_cast<int>(min(static_cast<tf_i64>(CHUNK), n - a0));
  const int col = slice * 32 + lane;
  const bool in_row = col < per_row;
  const bool bookkeeper = slice == 0 && lane == 0;
  const unsigned int my_key = lane < len ? keys[a0 + lane] : 0u;
  const unsigned int my_pos = lane < len ? pos[a0 + lane] : 0u;
  const unsigned long long key_before = a0 > 0 ? keys[a0 - 1] : NO_KEY;
  const unsigned long long key_after = a0 + CHUNK < n ? keys[a0 + CHUNK] : NO_KEY;

  float acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.f;
  unsigned long long run_key = __shfl_sync(0xffffffffu, my_key, 0);
  int run_start = 0;
  // A token number outside the batch can only come from a failed sort: its run is dropped.
  bool run_valid = true;
  for (int i0 = 0; i0 < len; i0 += RUN_LOADS) {
    tf_storage raw[RUN_LOADS][V];
    bool loaded[RUN_LOADS];
#pragma unroll
    for (int t = 0; t < RUN_LOADS; ++t) {
      const unsigned int p = __shfl_sync(0xffffffffu, my_pos, (i0 + t) % 32);
      loaded[t] = i0 + t < len && static_cast<tf_i64>(p) < n;
      // Every load is issued, from grad's first vector where there is nothing to load: ptxas
      // copies a predicated load's result out of its register as soon as it lands when the
      // destination is otherwise left unset, which keeps one load in flight at a time.
      const tf_i64 at = loaded[t] && in_row ? static_cast<tf_i64>(p) * cols + col * V : 0;
      if constexpr (V == VEC) {
        *reinterpret_cast<tf_raw16*>(raw[t]) = *reinterpret_cast<const tf_raw16*>(grad + at);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) raw[t][j] = grad[at + j];
      }
    }
#pragma unroll
    for (int t = 0; t < RUN_LOADS; ++t) {
      const int i = i0 + t;
      const unsigned long long key = __shfl_sync(0xffffffffu, my_key, i % 32);
      if (i < len) {
        if (key != run_key) {
          flush_run<V>(run_key, run_valid, run_start, i, len, key_before, key_after, chunk, col,
                       in_row, bookkeeper, cols, num_weights, padding_idx, acc, partials, out,
                       keys, chunks, row_first, work);
#pragma unroll
          for (int j = 0; j < V; ++j) acc[j] = 0.f;
          run_key = key;
          run_start = i;
          run_valid = true;
        }
        run_valid = run_valid && loaded[t];
        if (in_row)
#pragma unroll
          for (int j = 0; j < V; ++j) acc[j] += tf_float(raw[t][j]);
      }
    }
  }
  flush_run<V>(run_key, run_valid, run_start, len, len, key_before, key_after, chunk, col, in_row,
               bookkeeper, cols, num_weights, padding_idx, acc, partials, out, keys, chunks,
               row_first, work);
}

extern "C" __global__ void __launch_bounds__(REDUCE_THREADS)
    emb_bwd_reduce(const tf_storage* __restrict__ grad, const unsigned int* __restrict__ keys,
                   const unsigned int* __restrict__ pos, tf_i64 n, int cols, tf_i64 num_weights,
                   tf_i64 padding_idx, float* __restrict__ partials, tf_storage* __restrict__ out,
                   unsigned int* __restrict__ row_first,
                   unsigned int* __restrict__ work, int vectorized) {
  if (vectorized) {
    reduce_slice<VEC>(grad, keys, pos, n, cols, num_weights, padding_idx, partials, out, row_first,
                      work);
  } else {
    reduce_slice<1>(grad, keys, pos, n, cols, num_weights, padding_idx, partials, out, row_first,
                    work);
  }
}

// Partials a lane of a heavy row's CTA loads before adding any.
#define FINISH_LOADS 4
// Column tiles a warp summing a light row loads at once (two partials each).
#define LIGHT_TILES 4

// The address of partial q of a cut row whose first partial is `first`: after the row's first
// chunk, its partial is each chunk's first run (slot 0).
__device__ __forceinline__ tf_i64 partial_slot(unsigned int first, tf_i64 q) {
  return q == 0 ? first : (static_cast<tf_i64>(first >> 1) + q) * 2;
}

// The sum of a cut row's partials for one lane's LC columns at col0, in a fixed order: lanes
// of `parts` warps (number `part`) take partials part, part + parts, ..., in that order.
template <int LC>
__device__ __forceinline__ void sum_partials(const float* __restrict__ partials, int cols,
                                             int col0, unsigned int first, tf_i64 count,
                                             int part, int parts, float (&acc)[LC]) {
  for (tf_i64 q0 = part; q0 < count; q0 += FINISH_LOADS * static_cast<tf_i64>(parts)) {
    float v[FINISH_LOADS][LC];
#pragma unroll
    for (int f = 0; f < FINISH_LOADS; ++f) {
      // Past the last partial the first is loaded again, unused: see reduce_slice on
      // predicated loads.
      const tf_i64 q = q0 + static_cast<tf_i64>(f) * parts;
      load_f32<LC>(partials + partial_slot(first, q < count ? q : 0) * cols + col0, v[f]);
    }
#pragma unroll
    for (int f = 0; f < FINISH_LOADS; ++f)
      if (q0 + static_cast<tf_i64>(f) * parts < count)
#pragma unroll
        for (int j = 0; j < LC; ++j) acc[j] += v[f][j];
  }
}

// e / per for a work item number e: 32-bit division where it fits (the entries and the items
// per entry are each below 2^31, their product need not be).
__device__ __forceinline__ tf_i64 item_quotient(tf_i64 e, tf_i64 per) {
  return e <= 0xffffffffll ? static_cast<unsigned int>(e) / static_cast<unsigned int>(per)
                           : e / per;
}

// Entry e of the work list: its row, the row's first partial and how many it has (below 1
// only after a failed sort: a first partial past the last chunk).
struct CutRow {
  unsigned int key, first;
  tf_i64 count;
};

__device__ __forceinline__ CutRow cut_row(const unsigned int* __restrict__ keys,
                                          const unsigned int* __restrict__ row_first,
                                          const unsigned int* __restrict__ work, tf_i64 e) {
  const tf_i64 c = work[2 + e];
  CutRow r;
  r.key = keys[c * CHUNK];
  r.first = row_first[r.key];
  r.count = c - static_cast<tf_i64>(r.first >> 1) + 1;
  return r;
}

// After emb_bwd_reduce: each row cut by chunk edges (the work list) is the sum of its partials
// in chunk order. A light row is split into groups of LIGHT_TILES column tiles, each one
// warp's, with two partials of every tile in flight (a whole wide row per warp was 8 x 8
// dependent rounds at 4096 columns). A heavy row is split into (row, tile of 32 x LC columns)
// items, each a whole CTA's: warps take fixed strides of partials, then a fixed-order sum over
// warps.
template <int LC>
__device__ __forceinline__ void finish(const unsigned int* __restrict__ keys, tf_i64 n, int cols,
                                       const float* __restrict__ partials,
                                       const unsigned int* __restrict__ row_first,
                                       const unsigned int* __restrict__ work,
                                       tf_storage* __restrict__ out) {
  __shared__ float sums[FINISH_WARPS][32][LC];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int tile_cols = 32 * LC;
  const tf_i64 tiles = (cols + tile_cols - 1) / tile_cols;
  const tf_i64 light_rows = work[0];
  const tf_i64 heavy_rows = work[1];
  const tf_i64 last_entry = (n + CHUNK - 1) / CHUNK - 1;
  const tf_i64 items = heavy_rows * tiles;
  for (tf_i64 e = blockIdx.x; e < items; e += gridDim.x) {
    const tf_i64 h = item_quotient(e, tiles);
    const CutRow r = cut_row(keys, row_first, work, last_entry - h);
    if (r.count < 1) continue;  // the same for the whole CTA
    const int col0 = static_cast<int>((e - h * tiles) * tile_cols) + lane * LC;
    float acc[LC];
#pragma unroll
    for (int j = 0; j < LC; ++j) acc[j] = 0.f;
    if (col0 < cols) sum_partials<LC>(partials, cols, col0, r.first, r.count, warp, FINISH_WARPS, acc);
#pragma unroll
    for (int j = 0; j < LC; ++j) sums[warp][lane][j] = acc[j];
    __syncthreads();
    if (warp == 0 && col0 < cols) {
      tf_storage* row = out + static_cast<tf_i64>(r.key) * cols;
#pragma unroll
      for (int j = 0; j < LC; ++j) {
        float total = sums[0][lane][j];
        for (int w = 1; w < FINISH_WARPS; ++w) total += sums[w][lane][j];
        row[col0 + j] = tf_cast<tf_storage>(total);
      }
    }
    __syncthreads();
  }
  // Light rows: (row, group of LIGHT_TILES column tiles) items, one warp each.
  const int group_cols = LIGHT_TILES * tile_cols;
  const tf_i64 groups = (cols + group_cols - 1) / group_cols;
  const tf_i64 light_items = light_rows * groups;
  const tf_i64 warps = static_cast<tf_i64>(gridDim.x) * FINISH_WARPS;
  for (tf_i64 e = static_cast<tf_i64>(blockIdx.x) * FINISH_WARPS + warp; e < light_items;
       e += warps) {
    const tf_i64 entry = item_quotient(e, groups);
    const CutRow r = cut_row(keys, row_first, work, entry);
    if (r.count < 1) continue;
    tf_storage* row = out + static_cast<tf_i64>(r.key) * cols;
    const int t0 = static_cast<int>((e - entry * groups) * group_cols) + lane * LC;
    float acc[LIGHT_TILES][LC];
#pragma unroll
    for (int t = 0; t < LIGHT_TILES; ++t)
#pragma unroll
      for (int j = 0; j < LC; ++j) acc[t][j] = 0.f;
    for (tf_i64 q0 = 0; q0 < r.count; q0 += 2) {
      float v[2][LIGHT_TILES][LC];
#pragma unroll
      for (int f = 0; f < 2; ++f)
#pragma unroll
        for (int t = 0; t < LIGHT_TILES; ++t) {
          // Every load issued (see reduce_slice): a column past the row reads column 0, a
          // partial past the last reads the first; neither is added.
          const int col = t0 + t * tile_cols;
          const tf_i64 q = q0 + f < r.count ? q0 + f : 0;
          load_f32<LC>(partials + partial_slot(r.first, q) * cols + (col < cols ? col : 0), v[f][t]);
        }
#pragma unroll
      for (int f = 0; f < 2; ++f)
        if (q0 + f < r.count)
#pragma unroll
          for (int t = 0; t < LIGHT_TILES; ++t)
#pragma unroll
            for (int j = 0; j < LC; ++j) acc[t][j] += v[f][t][j];
    }
#pragma unroll
    for (int t = 0; t < LIGHT_TILES; ++t) {
      const int col = t0 + t * tile_cols;
      if (col < cols)
#pragma unroll
        for (int j = 0; j < LC; ++j) row[col + j] = tf_cast<tf_storage>(acc[t][j]);
    }
  }
}

extern "C" __global__ void __launch_bounds__(FINISH_THREADS, 1)
    emb_bwd_finish(const unsigned int* __restrict__ keys, tf_i64 n, int cols,
                   const float* __restrict__ partials, const unsigned int* __restrict__ row_first,
                   const unsigned int* __restrict__ work, tf_storage* __restrict__ out,
                   int vectorized) {
  // Vectorized: cols is a multiple of VEC (so of 4): a lane's 4 columns are all in the row.
  if (vectorized) {
    finish<4>(keys, n, cols, partials, row_first, work, out);
  } else {
    finish<1>(keys, n, cols, partials, row_first, work, out);
  }
}
