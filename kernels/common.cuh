// Helpers shared by torchfuse kernels.
//
// NVRTC 13 ships no CUDA headers, so nothing here includes one: the storage type and its
// fp32 conversions are chosen by TF_DTYPE (0 = f32, 1 = bf16, 2 = f16) and written with the
// PTX conversions of sm_80+ (round to nearest even, as PyTorch's own casts do). 16-byte
// accesses go through tf_raw16 so every vector load/store is a single 128-bit instruction.
#pragma once

typedef long long tf_i64;
typedef unsigned short tf_u16;

struct alignas(16) tf_raw16 {
  unsigned int w[4];
};

#if TF_DTYPE == 0
typedef float tf_storage;
__device__ __forceinline__ float tf_to_float(tf_storage v) { return v; }
__device__ __forceinline__ tf_storage tf_from_float(float v) { return v; }
#elif TF_DTYPE == 1
typedef tf_u16 tf_storage;
__device__ __forceinline__ float tf_to_float(tf_storage v) {
  return __uint_as_float(static_cast<unsigned int>(v) << 16);
}
__device__ __forceinline__ tf_storage tf_from_float(float v) {
  tf_u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}
#elif TF_DTYPE == 2
typedef tf_u16 tf_storage;
__device__ __forceinline__ float tf_to_float(tf_storage v) {
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(v));
  return r;
}
__device__ __forceinline__ tf_storage tf_from_float(float v) {
  tf_u16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}
#else
#error "TF_DTYPE must be 0 (f32), 1 (bf16) or 2 (f16)"
#endif

// Elements of the storage type in one 16-byte access.
#define TF_VEC (16 / static_cast<int>(sizeof(tf_storage)))

union tf_vec {
  tf_raw16 raw;
  tf_storage e[TF_VEC];
};

// Butterfly sum over a full warp: the same order on every call, every lane gets the total.
__device__ __forceinline__ float tf_warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
