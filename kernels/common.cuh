// Helpers shared by torchfuse kernels.
//
// NVRTC 13 ships no CUDA headers, so nothing here includes one. Storage types are tagged
// structs (tf_bf16, tf_f16 hold the raw bits) so overloads tell them apart; conversions are the
// PTX instructions of sm_80+ (round to nearest even, as PyTorch's own casts do). A kernel's
// element type is chosen at compile time by a type code (0 = f32, 1 = bf16, 2 = f16).
// 16-byte accesses go through tf_raw16 so every vector load/store is one 128-bit instruction.
#pragma once

typedef long long tf_i64;

struct alignas(16) tf_raw16 {
  unsigned int w[4];
};

struct tf_bf16 {
  unsigned short bits;
};
struct tf_f16 {
  unsigned short bits;
};

__device__ __forceinline__ float tf_float(float v) { return v; }
__device__ __forceinline__ float tf_float(tf_bf16 v) {
  return __uint_as_float(static_cast<unsigned int>(v.bits) << 16);
}
__device__ __forceinline__ float tf_float(tf_f16 v) {
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(v.bits));
  return r;
}

template <typename T>
struct tf_convert;
template <>
struct tf_convert<float> {
  static __device__ __forceinline__ float from(float v) { return v; }
};
template <>
struct tf_convert<tf_bf16> {
  static __device__ __forceinline__ tf_bf16 from(float v) {
    tf_bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
    return r;
  }
};
template <>
struct tf_convert<tf_f16> {
  static __device__ __forceinline__ tf_f16 from(float v) {
    tf_f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
    return r;
  }
};
template <typename T>
__device__ __forceinline__ T tf_cast(float v) {
  return tf_convert<T>::from(v);
}

template <int CODE>
struct tf_type_of;
template <>
struct tf_type_of<0> {
  typedef float type;
};
template <>
struct tf_type_of<1> {
  typedef tf_bf16 type;
};
template <>
struct tf_type_of<2> {
  typedef tf_f16 type;
};

#if !defined(TF_DTYPE) || TF_DTYPE < 0 || TF_DTYPE > 2
#error "TF_DTYPE must be 0 (f32), 1 (bf16) or 2 (f16)"
#endif
// The kernel's main element type (activations).
typedef tf_type_of<TF_DTYPE>::type tf_storage;

// Elements of the main type in one 16-byte access.
#define TF_VEC (16 / static_cast<int>(sizeof(tf_storage)))

// 16 bytes seen as elements of T.
template <typename T>
union tf_pack {
  tf_raw16 raw;
  T e[16 / sizeof(T)];
};

// Butterfly sum over a full warp: the same order on every call, every lane gets the total.
__device__ __forceinline__ float tf_warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The shared-memory address of a generic pointer into shared memory (what PTX's .shared
// operands take).
__device__ __forceinline__ unsigned int smem_addr(const void* p) {
  unsigned int r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// mbarriers (sm_90 for the transaction counts), by shared-memory address.
__device__ __forceinline__ void mbar_init(unsigned int bar, unsigned int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// An arrival that announces the bytes that transactions (copies, remote stores) will bring.
__device__ __forceinline__ void mbar_expect_bytes(unsigned int bar, unsigned int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned int bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(unsigned int bar, unsigned int parity) {
  unsigned int done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// Thread-block clusters (sm_90).
__device__ __forceinline__ int cluster_ctarank() {
  unsigned r;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return static_cast<int>(r);
}
// Every thread of every CTA of the cluster arrives and waits (with release/acquire: also an
// ordering point for memory, shared and global, at cluster scope). It waits for the CTA's
// outstanding global loads and stores too, so it costs about a memory latency.
__device__ __forceinline__ void cluster_barrier() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
               ::: "memory");
}
// A shared-memory address of this CTA (smem_addr) as seen from CTA `rank` of the cluster.
__device__ __forceinline__ unsigned int cluster_addr(unsigned int local, int rank) {
  unsigned int remote;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
