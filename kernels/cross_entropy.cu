// Cross-entropy over class-index targets, forward and backward: torch.ops.torchfuse.
// cross_entropy, which the rewrite layer sends HF's causal-LM loss to (logits read in their own
// dtype, computed in fp32: no fp32 copy of the logits is ever made).
//
//   lse_i  = log sum_j exp(x_ij)            (fp32, kept for the backward: 4 bytes a row)
//   loss_i = (1 - e) (lse_i - x_i,t_i) + e (lse_i - mean_j x_ij)   (0 where t_i == ignore_index;
//            e = label_smoothing, C classes: PyTorch's (1 - e) nll + (e / C) sum_j -log p_ij)
//   loss   = sum_i loss_i / W (mean, W = rows not ignored, fp32 as nll_loss's total_weight),
//            sum_i loss_i (sum), or loss_i (none)
//   dx_ij  = g_i (exp(x_ij - lse_i) - (1 - e) [j == t_i] - e / C),  g_i = dloss (/ W for mean;
//            dloss_i for none; 0 where ignored)
// With e = 0 the smoothing terms are exact zeros and ones: the same bits as without them.
//
// Passes over memory: the forward reads the logits once (ce_fwd), the backward reads them
// once and writes the gradient once (ce_bwd). One CTA owns a row (TF_THREADS threads; grids
// stride over rows); thread tx takes the row's 16-byte chunks tx, tx + TF_THREADS, ... of 8
// elements, counted from the row's first 16-byte boundary; the few elements before it and
// after the last whole chunk (rows of any width, GPT-2's 50257 classes: a row's offset within
// 16 bytes changes from row to row) one a thread (RowSplit). Where the host finds the logits
// and their gradient at different offsets within 16 bytes (the backward's `vectorized` 0),
// the backward takes every element alone.
//
// Forward, in registers: each thread keeps a running max m and sum s of exp(x - m) over its
// columns (an online softmax: one rescale of s per two chunks, whose loads are both in flight
// before either is folded; the exps on the SFU alone, ex2.approx) and their plain sum (for
// label smoothing), then the CTA combines the (m, s, sum) triples, warps by butterfly, then
// warp 0 over the warps' parts by butterfly while the other warps start the next row (thread
// 0 read the row's target and its logit before the scan, so those loads overlap it). The loss
// rows and the count of rows not ignored are summed by ce_reduce, one CTA, each thread a fixed
// stride of rows, then a fixed tree: every reduction runs in an order set by the shape alone,
// so results are bitwise reproducible.
//
// NaN logits give NaN (as stock's log_softmax): fmaxf skips a NaN max but its exp is NaN and
// enters the sum. An ignored row's gradient is 0 whatever its logits (stock: NaN there). A
// target outside [0, cols) that is not ignore_index traps the kernel, the device-side failure
// stock's nll_loss asserts with; nothing out of bounds is read.
//
// Dtypes: the logits (and their gradient) are TF_DTYPE. TF_WIDE = 1: the loss (forward) and
// its incoming gradient (backward) are fp32, the form HF's code gives (it casts the logits to
// fp32 first); otherwise they are TF_DTYPE too.
//
// Compile-time parameters: TF_DTYPE; the op's TF_CE_FWD / TF_CE_BWD (which kernels), TF_WIDE,
// TF_EW_CHUNK, TF_CE_REDUCE_THREADS, TF_REDUCTION_NONE / _MEAN (src/ops/cross_entropy.rs
// `defines`); the variant's TF_THREADS (registry/cross_entropy.toml).
#include "elementwise.cuh"

#if !defined(TF_CE_FWD) || !defined(TF_CE_BWD) || !defined(TF_WIDE)
#error "TF_CE_FWD, TF_CE_BWD and TF_WIDE must be defined"
#endif
#if !defined(TF_THREADS)
#error "every cross_entropy variant param (src/ops/cross_entropy.rs Params) must be defined"
#endif
#if TF_THREADS % 32 != 0 || TF_THREADS > 1024
#error "TF_THREADS: whole warps, at most 1024"
#endif

#define WARPS (TF_THREADS / 32)
// ce_reduce's CTA and at::Reduction's codes: src/ops/cross_entropy.rs passes them.
#if !defined(TF_CE_REDUCE_THREADS) || !defined(TF_REDUCTION_NONE) || !defined(TF_REDUCTION_MEAN)
#error "TF_CE_REDUCE_THREADS, TF_REDUCTION_NONE and TF_REDUCTION_MEAN must be defined"
#endif
#define REDUCE_THREADS TF_CE_REDUCE_THREADS
#define REDUCTION_NONE TF_REDUCTION_NONE
#define REDUCTION_MEAN TF_REDUCTION_MEAN

typedef tf_storage tf_x;
#if TF_WIDE
typedef float tf_loss;  // the loss and its gradient
#else
typedef tf_storage tf_loss;
#endif


#define LOG2E 1.4426950408889634f
// NVRTC has no math.h: -inf from its bits.
#define NEG_INF __int_as_float(0xff800000)

// exp(x - m) through exp2: one FMA and ex2. m = -inf only while every x seen is -inf or NaN:
// a -inf term is 0 (not exp(nan)); a NaN stays NaN.
__device__ __forceinline__ float exp_shifted(float x, float m) {
  return (m == NEG_INF && x == NEG_INF) ? 0.f : exp2f((x - m) * LOG2E);
}

// (m, s) of two parts combined: max and rescaled sums.
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  s = s * exp_shifted(m, mm) + s2 * exp_shifted(m2, mm);
  m = mm;
}

// Checks a row's target: the class it names, or -1 for ignore_index.
__device__ __forceinline__ tf_i64 checked_target(const tf_i64* target, tf_i64 row, tf_i64 cols,
                                                 tf_i64 ignore_index) {
  const tf_i64 t = target[row];
  if (t == ignore_index) return -1;
  if (t < 0 || t >= cols) __trap();  // stock: device-side assert in nll_loss
  return t;
}

// exp2 of x by the SFU alone (ex2.approx.ftz: relative error about 2^-22; results below 2^-126
// flush to 0, terms that vanish beside the row's largest, which is 1). The forward's sums only.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A row's layout for 16-byte accesses where `vectorized` (always in the forward, which reads
// one tensor; in the backward where the host found the logits and their gradient at the same
// offset within 16 bytes): elements [0, head) before the row's first 16-byte boundary,
// `chunks` whole chunks of TF_EW_CHUNK from there, the tail after them. head + tail <
// 2 * TF_EW_CHUNK <= 32 elements: a thread each (`leftover`). Otherwise no chunk: every
// element is the caller's element loop's.
struct RowSplit {
  bool vec;
  tf_i64 head, chunks, tail_start;
  __device__ __forceinline__ RowSplit(const tf_x* x, tf_i64 cols, int vectorized)
      : vec(vectorized != 0), head(0), chunks(0), tail_start(cols) {
    if (!vec) return;
    const tf_i64 misaligned = static_cast<tf_i64>(reinterpret_cast<unsigned long long>(x) % 16);
    head = misaligned == 0 ? 0 : (16 - misaligned) / static_cast<tf_i64>(sizeof(tf_x));
    if (head > cols) head = cols;
    chunks = (cols - head) / TF_EW_CHUNK;
    tail_start = head + chunks * TF_EW_CHUNK;
  }
  // The column outside the chunks this thread takes, or -1.
  __device__ __forceinline__ tf_i64 leftover(tf_i64 cols) const {
    const tf_i64 tx = threadIdx.x;
    if (tx < head) return tx;
    const tf_i64 i = tx - head;
    return i < cols - tail_start ? tail_start + i : -1;
  }
};

#if TF_CE_FWD
// Folds W values into this thread's running (max m, sum s of exp(x - m), plain sum): one
// rescale of s a fold.
template <int W>
__device__ __forceinline__ void fold(const float (&v)[W], float& m, float& s, float& sum) {
  float cmax = v[0];
#pragma unroll
  for (int j = 1; j < W; ++j) cmax = fmaxf(cmax, v[j]);
  const float mm = fmaxf(m, cmax);
  float add = 0.f;
  if (mm != NEG_INF) {  // the common case: no -inf - -inf to guard
#pragma unroll
    for (int j = 0; j < W; ++j) add += fast_exp2((v[j] - mm) * LOG2E);
    s = s * fast_exp2((m - mm) * LOG2E) + add;
  } else {  // every value so far -inf or NaN: exp_shifted's guard (0 for -inf, NaN stays NaN)
#pragma unroll
    for (int j = 0; j < W; ++j) add += exp_shifted(v[j], mm);
    s = s * exp_shifted(m, mm) + add;
  }
  m = mm;
#pragma unroll
  for (int j = 0; j < W; ++j) sum += v[j];
}

// This thread's part of one row's (max, sum of exp, plain sum): two chunks a step (both loads
// in flight before either is folded), then the row's head and tail, one element a thread.
__device__ __forceinline__ void scan_row(const tf_x* __restrict__ x, tf_i64 cols,
                                         const RowSplit& split, float& m, float& s, float& sum) {
  const tf_x* __restrict__ body = x + split.head;
  tf_i64 k = threadIdx.x;
  for (; k + TF_THREADS < split.chunks; k += 2 * TF_THREADS) {
    float v[2 * TF_EW_CHUNK];
    float a[TF_EW_CHUNK], b[TF_EW_CHUNK];
    tf_load_elems<TF_EW_CHUNK>(body + k * TF_EW_CHUNK, a);
    tf_load_elems<TF_EW_CHUNK>(body + (k + TF_THREADS) * TF_EW_CHUNK, b);
#pragma unroll
    for (int j = 0; j < TF_EW_CHUNK; ++j) {
      v[j] = a[j];
      v[TF_EW_CHUNK + j] = b[j];
    }
    fold<2 * TF_EW_CHUNK>(v, m, s, sum);
  }
  if (k < split.chunks) {
    float v[TF_EW_CHUNK];
    tf_load_elems<TF_EW_CHUNK>(body + k * TF_EW_CHUNK, v);
    fold<TF_EW_CHUNK>(v, m, s, sum);
  }
  const tf_i64 c = split.leftover(cols);
  if (c >= 0) {
    const float v[1] = {tf_float(x[c])};
    fold<1>(v, m, s, sum);
  }
}

// The warp's (m, s, sum) triples combined by butterfly, every lane left with the total: the
// order is set by the shape alone.
__device__ __forceinline__ void warp_combine(float& m, float& s, float& sum) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
    combine(m, s, m2, s2);
  }
  sum = tf_warp_sum(sum);
}

// loss_rows[i] = loss_i (fp32), lse[i] = lse_i, for rows blockIdx.x, + gridDim.x, ...
// Thread 0 reads the row's target (and its logit) before the scan, so those loads overlap it;
// warp 0 combines the warps' parts while the other warps start the next row (the parts are
// double-buffered by row parity: a buffer is written again only after the next row's barrier,
// which warp 0 reaches once its combine is done).
extern "C" __global__ void __launch_bounds__(TF_THREADS)
    ce_fwd(const tf_x* __restrict__ logits, const tf_i64* __restrict__ target,
           float* __restrict__ loss_rows, float* __restrict__ lse, tf_i64 rows, tf_i64 cols,
           tf_i64 ignore_index, float smoothing) {
  __shared__ float part_m[2][WARPS], part_s[2][WARPS], part_sum[2][WARPS];
  int parity = 0;
  for (tf_i64 row = blockIdx.x; row < rows; row += gridDim.x, parity ^= 1) {
    const tf_x* __restrict__ x = logits + row * cols;
    tf_i64 t = -1;
    float xt = 0.f;
    if (threadIdx.x == 0) {
      t = checked_target(target, row, cols, ignore_index);
      if (t >= 0) xt = tf_float(x[t]);
    }
    float m = NEG_INF, s = 0.f, sum = 0.f;
    scan_row(x, cols, RowSplit(x, cols, 1), m, s, sum);
    warp_combine(m, s, sum);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
      part_m[parity][warp] = m;
      part_s[parity][warp] = s;
      part_sum[parity][warp] = sum;
    }
    __syncthreads();
    if (warp != 0) continue;
    float tm = lane < WARPS ? part_m[parity][lane] : NEG_INF;
    float ts = lane < WARPS ? part_s[parity][lane] : 0.f;
    float tsum = lane < WARPS ? part_sum[parity][lane] : 0.f;
    warp_combine(tm, ts, tsum);
    if (lane == 0) {
      // All -inf: log(0) = -inf, and the loss -inf - -inf = NaN, as stock's log_softmax gives.
      const float row_lse = tm == NEG_INF ? NEG_INF : tm + logf(ts);
      lse[row] = row_lse;
      // (max - x_t) + log(sum) rather than lse - x_t: no cancellation in confident rows.
      float loss = t < 0 ? 0.f : (tm - xt) + logf(ts);
      if (smoothing != 0.f && t >= 0)
        loss = (1.f - smoothing) * loss +
               smoothing * ((tm - tsum / static_cast<float>(cols)) + logf(ts));
      loss_rows[row] = loss;
    }
  }
}

// The reduced loss (mean or sum over rows) and W, the count of rows not ignored: one CTA.
// `none`: out[i] = loss_rows[i] in the loss dtype, over a grid.
extern "C" __global__ void __launch_bounds__(REDUCE_THREADS)
    ce_reduce(const float* __restrict__ loss_rows, const tf_i64* __restrict__ target,
              tf_loss* __restrict__ out, float* __restrict__ total_weight, tf_i64 rows,
              tf_i64 ignore_index, int reduction) {
  if (reduction == REDUCTION_NONE) {
    for (tf_i64 i = static_cast<tf_i64>(blockIdx.x) * REDUCE_THREADS + threadIdx.x; i < rows;
         i += static_cast<tf_i64>(gridDim.x) * REDUCE_THREADS)
      out[i] = tf_cast<tf_loss>(loss_rows[i]);
    return;
  }
  __shared__ float part_sum[REDUCE_THREADS / 32], part_count[REDUCE_THREADS / 32];
  float sum = 0.f, count = 0.f;
  for (tf_i64 i = threadIdx.x; i < rows; i += REDUCE_THREADS) {
    sum += loss_rows[i];
    count += target[i] != ignore_index ? 1.f : 0.f;
  }
  sum = tf_warp_sum(sum);
  count = tf_warp_sum(count);
  if (threadIdx.x % 32 == 0) {
    part_sum[threadIdx.x / 32] = sum;
    part_count[threadIdx.x / 32] = count;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f, weight = 0.f;
    for (int w = 0; w < REDUCE_THREADS / 32; ++w) {
      total += part_sum[w];
      weight += part_count[w];
    }
    total_weight[0] = weight;
    // mean of no rows: 0 / 0 = NaN, as stock.
    out[0] = tf_cast<tf_loss>(reduction == REDUCTION_MEAN ? total / weight : total);
  }
}
#endif

#if TF_CE_BWD
struct RowGrad {
  const tf_x* __restrict__ x;
  tf_x* __restrict__ dx;
  float lse, g;
  float on, off;  // 1 - e at the target, e / C everywhere (label smoothing e; 1 and 0 without)
  tf_i64 t;       // the target class, -1 when ignored (g is then 0)
  template <int W>
  __device__ __forceinline__ void apply(tf_i64 c) const {
    float v[W];
    tf_load_elems<W>(x + c, v);
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float p = exp2f((v[j] - lse) * LOG2E);
      v[j] = g * ((c + j == t ? p - on : p) - off);
    }
    tf_store_elems<W>(dx + c, v);
  }
};

// grad_logits for rows blockIdx.x, + gridDim.x, ...; grad_loss holds one value (mean, sum) or
// one a row (none).
extern "C" __global__ void __launch_bounds__(TF_THREADS)
    ce_bwd(const tf_x* __restrict__ logits, const tf_i64* __restrict__ target,
           const float* __restrict__ lse, const float* __restrict__ total_weight,
           const tf_loss* __restrict__ grad_loss, tf_x* __restrict__ grad_logits, tf_i64 rows,
           tf_i64 cols, tf_i64 ignore_index, float smoothing, int reduction, int vectorized) {
  const float on = 1.f - smoothing, off = smoothing / static_cast<float>(cols);
  for (tf_i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const tf_i64 t = checked_target(target, row, cols, ignore_index);
    float g = 0.f;
    if (t >= 0) {
      g = tf_float(grad_loss[reduction == REDUCTION_NONE ? row : 0]);
      if (reduction == REDUCTION_MEAN) g /= total_weight[0];
    }
    const tf_i64 offset = row * cols;
    tf_x* __restrict__ dx = grad_logits + offset;
    if (t < 0) {  // an ignored row's gradient is 0 whatever its logits (also inf or NaN)
      for (tf_i64 c = threadIdx.x; c < cols; c += TF_THREADS) dx[c] = tf_cast<tf_x>(0.f);
      continue;
    }
    const RowGrad op{logits + offset, dx, lse[row], g, on, off, t};
    const RowSplit split(logits + offset, cols, vectorized);
    if (split.vec) {
      for (tf_i64 k = threadIdx.x; k < split.chunks; k += TF_THREADS)
        op.template apply<TF_EW_CHUNK>(split.head + k * TF_EW_CHUNK);
      const tf_i64 c = split.leftover(cols);
      if (c >= 0) op.template apply<1>(c);
    } else {
      for (tf_i64 c = threadIdx.x; c < cols; c += TF_THREADS) op.template apply<1>(c);
    }
  }
}
#endif
