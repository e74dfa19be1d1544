// Adam and AdamW: one multi-tensor optimizer step (torch's _fused_adam_ / _fused_adamw_).
//
// Design. One pass over memory: every element of param, grad, exp_avg, exp_avg_sq (and
// max_exp_avg_sq under amsgrad) is read once and param and the moments written once (grad
// too when a GradScaler's scale is applied, as stock does). Nothing is reduced, so results do
// not depend on scheduling.
//
// The tensor list travels in the launch's parameter space (`__grid_constant__`, up to 32 KB
// since CUDA 12.1): up to TF_ADAM_MAX_TENSORS tensors per launch (adam_step_small: 32, for
// short lists, so they do not pay for copying 32 KB of parameters), no device metadata to
// allocate or copy, so a step needs no host sync and is CUDA-graph capturable. Each tensor is
// cut into units of 32 * TF_VEC * TF_UNROLL elements (one warp, TF_UNROLL 16-byte accesses
// per lane per array); a persistent grid of warps strides over the units of all tensors, and
// a warp finds its unit's tensor by binary search over the tensors' first units. Per lane,
// TF_UNROLL vectors of every array are loaded before any math, so each warp keeps
// 4-5 x TF_UNROLL x 512 bytes in flight.
//
// The element math is stock's, operation for operation and rounding for rounding (fp32
// whatever the storage type; the same fused multiply-adds, IEEE division and square root):
// AdamW, and Adam without weight decay, give stock's fused kernel's bits (a GPU test checks);
// Adam's L2 term differs from stock by a few ulps in a fraction of elements (see there).

#include "common.cuh"

// Every variant param (src/ops/adam.rs Params, defaults included).
#if !defined(TF_THREADS) || !defined(TF_UNROLL) || !defined(TF_MIN_BLOCKS) || !defined(TF_STREAMING)
#error "TF_THREADS, TF_UNROLL, TF_MIN_BLOCKS and TF_STREAMING must be defined"
#endif
// Shared with src/ops/adam.rs, which passes them (`defines`): the launches' capacities and
// the bits of AdamStep::flags.
#if !defined(TF_ADAM_MAX_TENSORS) || !defined(TF_ADAM_SMALL_TENSORS) || \
    !defined(TF_ADAM_DECOUPLED) || !defined(TF_ADAM_AMSGRAD) || !defined(TF_ADAM_MAXIMIZE)
#error "TF_ADAM_MAX_TENSORS, TF_ADAM_SMALL_TENSORS and TF_ADAM_{DECOUPLED,AMSGRAD,MAXIMIZE} must be defined"
#endif
// 1: 16-byte accesses carry the streaming cache hint (.cs: data used once, evict first).


// One tensor of the step; layout must match `AdamTensor` in src/ops/adam.rs.
struct AdamTensor {
  tf_storage* param;
  tf_storage* grad;
  tf_storage* exp_avg;
  tf_storage* exp_avg_sq;
  tf_storage* max_exp_avg_sq;  // null unless amsgrad
  const float* step;           // the optimizer's step count (already incremented), fp32
  tf_i64 numel;
  unsigned int first_unit;  // this tensor's first work unit in the launch
  unsigned int unused;
};

// What every launch of a step shares; layout must match `StepScalars` in src/ops/adam.rs.
struct AdamStep {
  float lr;
  float beta1;
  float beta2;
  float weight_decay;
  float eps;
  unsigned int flags;
  const float* lr_ptr;      // device lr (the .tensor_lr overloads); null: `lr`
  const float* grad_scale;  // GradScaler's scale; null: none
  const float* found_inf;   // 1.0 skips the whole step; null: none
};

// The kernel's only parameter; layout must match `AdamArgs` in src/ops/adam.rs (sizes are
// checked on both sides). Two capacities: a small step should not pay for copying 32 KB of
// parameters at launch.
template <int CAPACITY>
struct AdamArgs {
  AdamStep step;
  unsigned int tensors;
  unsigned int units;
  AdamTensor t[CAPACITY];
};
static_assert(sizeof(AdamTensor) == 64, "AdamTensor layout");
static_assert(sizeof(AdamStep) == 48, "AdamStep layout");
static_assert(sizeof(AdamArgs<TF_ADAM_MAX_TENSORS>) == 56 + 64 * TF_ADAM_MAX_TENSORS,
              "AdamArgs layout");
static_assert(sizeof(AdamArgs<TF_ADAM_SMALL_TENSORS>) == 56 + 64 * TF_ADAM_SMALL_TENSORS,
              "AdamArgs layout");

#define TF_UNIT (32 * TF_VEC * TF_UNROLL)

// What one tensor's elements share: stock computes these per tensor from its step count.
struct AdamScalars {
  float lr;
  float beta1;
  float beta2;
  float weight_decay;
  float eps;
  float grad_scale;
  float step_size;
  float bias_correction2_sqrt;
  bool scale_grad;
  bool decoupled;
  bool amsgrad;
  bool maximize;
};

__device__ __forceinline__ void adam_update(float& param, float& grad, float& exp_avg,
                                            float& exp_avg_sq, float& max_exp_avg_sq,
                                            const AdamScalars& s) {
  if (s.scale_grad) grad = __fdiv_rn(grad, s.grad_scale);
  // `grad` keeps the unscaled gradient (written back under a GradScaler); `d` is the update's.
  float d = s.maximize ? -grad : grad;
  if (s.weight_decay != 0.0f) {
    if (s.decoupled) {
      param = __fmaf_rn(-__fmul_rn(s.lr, s.weight_decay), param, param);
    } else {
      // Stock's compiled `grad += param * weight_decay` rounds like neither one FMA nor a
      // multiply and an add (0.4% and 1.2% of elements differ by a few ulps, measured on the
      // H100); the single rounding of an FMA is the closer and the more accurate.
      d = __fmaf_rn(param, s.weight_decay, d);
    }
  }
  exp_avg = __fmaf_rn(s.beta1, exp_avg, __fmaf_rn(-s.beta1, d, d));
  const float d2 = __fmul_rn(d, d);
  exp_avg_sq = __fmaf_rn(s.beta2, exp_avg_sq, __fmaf_rn(-s.beta2, d2, d2));
  float second = exp_avg_sq;
  if (s.amsgrad) {
    // std::max's NaN behaviour: keeps the old value unless it compares below.
    max_exp_avg_sq = (max_exp_avg_sq < exp_avg_sq) ? exp_avg_sq : max_exp_avg_sq;
    second = max_exp_avg_sq;
  }
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(second), s.bias_correction2_sqrt), s.eps);
  param = __fsub_rn(param, __fdiv_rn(__fmul_rn(s.step_size, exp_avg), denom));
}

__device__ __forceinline__ tf_raw16 load16(const void* p) {
#if TF_STREAMING
  tf_raw16 r;
  asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.w[0]), "=r"(r.w[1]), "=r"(r.w[2]), "=r"(r.w[3])
               : "l"(p));
  return r;
#else
  return *reinterpret_cast<const tf_raw16*>(p);
#endif
}

__device__ __forceinline__ void store16(void* p, const tf_raw16& v) {
#if TF_STREAMING
  asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.w[0]), "r"(v.w[1]),
               "r"(v.w[2]), "r"(v.w[3])
               : "memory");
#else
  *reinterpret_cast<tf_raw16*>(p) = v;
#endif
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// A whole unit of 16-byte-aligned tensors: TF_UNROLL vectors per lane per array.
__device__ __forceinline__ void adam_unit_vectorized(const AdamTensor& t, tf_i64 base,
                                                     unsigned lane, const AdamScalars& s) {
  tf_pack<tf_storage> p[TF_UNROLL], g[TF_UNROLL], m[TF_UNROLL], v[TF_UNROLL], vm[TF_UNROLL];
#pragma unroll
  for (int k = 0; k < TF_UNROLL; ++k) {
    const tf_i64 i = base + static_cast<tf_i64>(k * 32 + lane) * TF_VEC;
    p[k].raw = load16(t.param + i);
    g[k].raw = load16(t.grad + i);
    m[k].raw = load16(t.exp_avg + i);
    v[k].raw = load16(t.exp_avg_sq + i);
    if (s.amsgrad) vm[k].raw = load16(t.max_exp_avg_sq + i);
  }
#pragma unroll
  for (int k = 0; k < TF_UNROLL; ++k) {
#pragma unroll
    for (int e = 0; e < TF_VEC; ++e) {
      float param = tf_float(p[k].e[e]);
      float grad = tf_float(g[k].e[e]);
      float exp_avg = tf_float(m[k].e[e]);
      float exp_avg_sq = tf_float(v[k].e[e]);
      float max_sq = s.amsgrad ? tf_float(vm[k].e[e]) : 0.0f;
      adam_update(param, grad, exp_avg, exp_avg_sq, max_sq, s);
      p[k].e[e] = tf_cast<tf_storage>(param);
      g[k].e[e] = tf_cast<tf_storage>(grad);
      m[k].e[e] = tf_cast<tf_storage>(exp_avg);
      v[k].e[e] = tf_cast<tf_storage>(exp_avg_sq);
      if (s.amsgrad) vm[k].e[e] = tf_cast<tf_storage>(max_sq);
    }
  }
#pragma unroll
  for (int k = 0; k < TF_UNROLL; ++k) {
    const tf_i64 i = base + static_cast<tf_i64>(k * 32 + lane) * TF_VEC;
    store16(t.param + i, p[k].raw);
    if (s.scale_grad) store16(t.grad + i, g[k].raw);
    store16(t.exp_avg + i, m[k].raw);
    store16(t.exp_avg_sq + i, v[k].raw);
    if (s.amsgrad) store16(t.max_exp_avg_sq + i, vm[k].raw);
  }
}

// A tensor's last, partial unit, or any unit of a tensor some array of which is not 16-byte
// aligned: element by element, bounds-checked.
__device__ __forceinline__ void adam_unit_scalar(const AdamTensor& t, tf_i64 base, unsigned lane,
                                                 const AdamScalars& s) {
  const tf_i64 end = min(base + static_cast<tf_i64>(TF_UNIT), t.numel);
  for (tf_i64 i = base + lane; i < end; i += 32) {
    float param = tf_float(t.param[i]);
    float grad = tf_float(t.grad[i]);
    float exp_avg = tf_float(t.exp_avg[i]);
    float exp_avg_sq = tf_float(t.exp_avg_sq[i]);
    float max_sq = s.amsgrad ? tf_float(t.max_exp_avg_sq[i]) : 0.0f;
    adam_update(param, grad, exp_avg, exp_avg_sq, max_sq, s);
    t.param[i] = tf_cast<tf_storage>(param);
    if (s.scale_grad) t.grad[i] = tf_cast<tf_storage>(grad);
    t.exp_avg[i] = tf_cast<tf_storage>(exp_avg);
    t.exp_avg_sq[i] = tf_cast<tf_storage>(exp_avg_sq);
    if (s.amsgrad) t.max_exp_avg_sq[i] = tf_cast<tf_storage>(max_sq);
  }
}

template <int CAPACITY>
__device__ __forceinline__ void adam_step_body(const AdamArgs<CAPACITY>& args) {
  // AMP: a step whose gradients overflowed changes nothing (stock's exact test).
  if (args.step.found_inf != nullptr && *args.step.found_inf == 1.0f) return;

  AdamScalars s;
  s.lr = args.step.lr_ptr != nullptr ? *args.step.lr_ptr : args.step.lr;
  s.beta1 = args.step.beta1;
  s.beta2 = args.step.beta2;
  s.weight_decay = args.step.weight_decay;
  s.eps = args.step.eps;
  s.scale_grad = args.step.grad_scale != nullptr;
  s.grad_scale = s.scale_grad ? *args.step.grad_scale : 1.0f;
  s.decoupled = (args.step.flags & TF_ADAM_DECOUPLED) != 0;
  s.amsgrad = (args.step.flags & TF_ADAM_AMSGRAD) != 0;
  s.maximize = (args.step.flags & TF_ADAM_MAXIMIZE) != 0;

  const unsigned lane = threadIdx.x & 31u;
  const unsigned warps_per_block = TF_THREADS / 32;
  const unsigned total_warps = gridDim.x * warps_per_block;
  unsigned tensor = 0;
  unsigned scalars_of = 0xffffffffu;  // the tensor `s`'s bias corrections belong to
  for (unsigned unit = blockIdx.x * warps_per_block + threadIdx.x / 32u; unit < args.units;
       unit += total_warps) {
    // Units only grow, so the search starts at the last tensor found.
    unsigned lo = tensor, hi = args.tensors - 1;
    while (lo < hi) {
      const unsigned mid = (lo + hi + 1) / 2;
      if (args.t[mid].first_unit <= unit) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    tensor = lo;
    const AdamTensor& t = args.t[tensor];
    if (scalars_of != tensor) {
      const float step = *t.step;
      const float bias_correction1 = 1.0f - powf(s.beta1, step);
      s.step_size = __fdiv_rn(s.lr, bias_correction1);
      s.bias_correction2_sqrt = __fsqrt_rn(1.0f - powf(s.beta2, step));
      scalars_of = tensor;
    }
    const tf_i64 base = static_cast<tf_i64>(unit - t.first_unit) * TF_UNIT;
    const bool aligned = aligned16(t.param) && aligned16(t.grad) && aligned16(t.exp_avg) &&
                         aligned16(t.exp_avg_sq) && (!s.amsgrad || aligned16(t.max_exp_avg_sq));
    if (aligned && t.numel - base >= TF_UNIT) {
      adam_unit_vectorized(t, base, lane, s);
    } else {
      adam_unit_scalar(t, base, lane, s);
    }
  }
}

extern "C" __global__ void __launch_bounds__(TF_THREADS, TF_MIN_BLOCKS)
    adam_step(const __grid_constant__ AdamArgs<TF_ADAM_MAX_TENSORS> args) {
  adam_step_body(args);
}

extern "C" __global__ void __launch_bounds__(TF_THREADS, TF_MIN_BLOCKS)
    adam_step_small(const __grid_constant__ AdamArgs<TF_ADAM_SMALL_TENSORS> args) {
  adam_step_body(args);
}
