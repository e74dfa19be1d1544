// Fused attention (scaled_dot_product_attention as the flash backend): forward and backward,
// bf16/f16, head dims 64 and 128, causal (top-left, Lq == Lk) or not, GQA by head groups.
//
// Design (FlashAttention-2's algorithm, written for mma.sync m16n8k16 on sm_80+):
// - attn_fwd: a CTA owns 16 * FWD_M_TILES * FWD_WARPS query rows of one (batch, head), each
//   warp 16 * FWD_M_TILES rows whose Q fragments stay in registers (each K/V fragment read from
//   shared memory feeds FWD_M_TILES mma). K/V tiles of FWD_BLOCK_N keys stream through shared
//   memory, double buffered with cp.async. S = Q K^T and O += P V run on tensor cores with fp32
//   accumulators; the softmax is online in fp32 (base 2, the scale folded in). The S x S matrix
//   never exists. One pass over K and V per query block; O and the logsumexp (natural log, fp32,
//   as stock's flash returns it) are written once.
// - attn_bwd_prep: delta = rowsum(dO * O) in fp32, one 16-byte chunk per thread.
// - attn_bwd_dkdv: a CTA owns 16 * BWD_M_TILES * BWD_WARPS keys of one (batch, kv head) and walks every query
//   tile of every query head of its group, recomputing P from the logsumexp; dK and dV stay in
//   registers (fp32) for the whole walk and are written once. No atomics.
// - attn_bwd_dq: a CTA owns 16 * BWD_M_TILES * BWD_WARPS query rows and walks the key tiles, recomputing P and
//   dP; dQ stays in registers and is written once. No atomics.
// - With TF_FWD_WGMMA (sm_90a), attn_fwd is the same algorithm on Hopper's warpgroup MMA: a
//   CTA of 1-3 warpgroups of 64 query rows, both gemms reading their shared-memory operands
//   through wgmma descriptors (see its section below); with TF_FWD_TMA a producer warpgroup
//   loads the tiles with TMA copies and mbarriers, with TF_FWD_PINGPONG the two computing
//   warpgroups take turns at the tensor cores.
// - With TF_BWD_WGMMA (sm_90a, with TF_FWD_TMA), attn_bwd_dkdv and attn_bwd_dq are warpgroup-MMA
//   kernels of the same shape: two computing warpgroups (64 keys, or 64 query rows, each)
//   whose own operands stay in shared memory, a producer warpgroup streaming the other side's
//   tiles through a 2-stage ring; every product accumulates in fp32 registers, in a fixed
//   order, with no atomics.
// Every sum runs in a fixed order, so the backward is bitwise reproducible run to run.
// Shared-memory tiles are [rows][HEAD_DIM] with 16-byte chunks XOR-swizzled by row, so the
// ldmatrix reads of 8 rows hit 8 different bank groups.
#include "common.cuh"

#if TF_DTYPE != 1 && TF_DTYPE != 2
#error "attention kernels are bf16 (TF_DTYPE=1) or f16 (TF_DTYPE=2)"
#endif
// Shared with src/ops/attention.rs (`defines`): the warpgroup backward kernels' CTA tiles.
#if !defined(TF_ATTN_DKDV_WG_KEYS) || !defined(TF_ATTN_DQ_WG_ROWS)
#error "TF_ATTN_DKDV_WG_KEYS and TF_ATTN_DQ_WG_ROWS must be defined"
#endif
// Every variant param (src/ops/attention.rs Params, defaults included):
// - TF_FWD_WARPS, TF_FWD_BLOCK_N, TF_FWD_M_TILES; TF_BWD_WARPS, TF_BWD_BLOCK_Q, TF_DQ_BLOCK_N,
//   TF_BWD_M_TILES: the kernels' tiles.
// - TF_FWD_MIN_BLOCKS, TF_BWD_MIN_BLOCKS: CTAs per SM the register allocation must allow
//   (__launch_bounds__'s second argument).
// - TF_FWD_WGMMA: 1: the forward is the warpgroup-MMA kernel (sm_90a), 0: the mma.sync one.
// - TF_FWD_STAGES: K/V tiles in flight in the warpgroup forward (a ring of this many stages).
// - TF_FWD_TMA (with TF_FWD_WGMMA): a producer warpgroup loads Q, K and V with the tensor
//   memory accelerator (TMA) and mbarriers; the TF_FWD_WARPS warps only compute.
// - TF_FWD_PINGPONG (with TF_FWD_TMA and two computing warpgroups): they take turns issuing
//   their gemms, so one's softmax runs while the other's gemms do.
// - TF_BWD_WGMMA (with TF_FWD_TMA): attn_bwd_dkdv and attn_bwd_dq on warpgroup MMA, fed by
//   TMA like the forward.
// - TF_FWD_PERSISTENT (with TF_FWD_TMA): a persistent forward, below.
#if !defined(TF_FWD_WARPS) || !defined(TF_FWD_BLOCK_N) || !defined(TF_BWD_WARPS) ||         \
    !defined(TF_BWD_BLOCK_Q) || !defined(TF_DQ_BLOCK_N) || !defined(TF_FWD_M_TILES) ||      \
    !defined(TF_BWD_M_TILES) || !defined(TF_FWD_MIN_BLOCKS) || !defined(TF_BWD_MIN_BLOCKS) || \
    !defined(TF_FWD_WGMMA) || !defined(TF_FWD_STAGES) || !defined(TF_FWD_TMA) ||            \
    !defined(TF_FWD_PINGPONG) || !defined(TF_BWD_WGMMA) || !defined(TF_FWD_PERSISTENT)
#error "every attention variant param (src/ops/attention.rs Params) must be defined"
#endif
#if !defined(TF_HEAD_DIM) || (TF_HEAD_DIM != 64 && TF_HEAD_DIM != 128)
#error "TF_HEAD_DIM must be 64 or 128"
#endif
#if TF_BWD_WGMMA && !TF_FWD_TMA
#error "BWD_WGMMA takes FWD_TMA (its wgmma and TMA helpers)"
#endif
#if TF_FWD_PINGPONG && !(TF_FWD_TMA && TF_FWD_WARPS == 8)
#error "FWD_PINGPONG takes FWD_TMA and FWD_WARPS 8"
#endif
// TF_FWD_PERSISTENT: a persistent forward. The grid is at most what fits on the GPU; CTA c
// takes tile c first, then whichever comes next in grid_tile's order (gridDim.x plus an atomic
// counter the launch zeroes), so CTAs that drew light causal tiles take more. When every tile
// fits in one wave the launch passes no counter (and needs no memset): a grid of a CTA per
// tile, as without FWD_PERSISTENT. Its producer runs ahead across tiles: it draws the next
// tile and loads its Q (double-buffered) and first K/V stages while the consumers finish this
// one, and hands them the tile's number beside its Q. The output is staged in the tile's own
// Q buffer (the K/V ring holds the next tile's loads). Which CTA computes a tile does not
// change its arithmetic: results stay bitwise reproducible.
#if TF_FWD_PERSISTENT && !TF_FWD_TMA
#error "FWD_PERSISTENT takes FWD_TMA"
#endif

#define HD TF_HEAD_DIM
#define FWD_MT TF_FWD_M_TILES
#define BWD_MT TF_BWD_M_TILES
#define FWD_BLOCK_M (16 * FWD_MT * TF_FWD_WARPS)
#define BWD_BLOCK_K (16 * BWD_MT * TF_BWD_WARPS)
#define DQ_BLOCK_M (16 * BWD_MT * TF_BWD_WARPS)
#define CHUNKS_PER_ROW (HD / 8)

static_assert(TF_FWD_BLOCK_N % 16 == 0 && TF_BWD_BLOCK_Q % 16 == 0 && TF_DQ_BLOCK_N % 16 == 0,
              "tiles are whole k16 steps");

typedef unsigned int u32;
typedef unsigned short u16;

// The CTA's tile (query rows, or keys for dK/dV), head and batch. With a causal mask the grid
// is (heads, batch, tiles), the tile index slowest, so every head's heaviest tiles start before
// any light one and the light ones fill the last wave: query tiles are heavier the later they
// start (heavy_last), key tiles the earlier. Without a mask it is (tiles, heads, batch), so the
// CTAs of one head run together and share its K and V in L2 (tile-slowest measured 1.4x
// slower there: B8 H16 S1024 D128). src/attention.rs launches the same order.
struct GridTile {
  int tile, head, batch;
};
__device__ __forceinline__ GridTile grid_tile(int causal, bool heavy_last) {
  if (!causal) return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
  const int z = static_cast<int>(blockIdx.z);
  return {heavy_last ? static_cast<int>(gridDim.z) - 1 - z : z, static_cast<int>(blockIdx.x),
          static_cast<int>(blockIdx.y)};
}

// Bytes from the start of dynamic shared memory to its first 1024-byte boundary: the TMA
// swizzle repeats every 1024 bytes of shared address, so the tiles start there (the launch asks
// for 1024 bytes of slack).
__device__ __forceinline__ unsigned int swizzle_pad(const unsigned char* smem_bytes) {
  return (1024 - (smem_addr(smem_bytes) & 1023)) & 1023;
}

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define NEG_INF __int_as_float(0xff800000u)

// ------------------------------------------------------------------ PTX wrappers

// 16 bytes global -> shared, zero-filled when !valid (nothing is read then).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}
// Until at most N of this thread's cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32 (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32 (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a * b: a 16x16 (row), b 16x8 (col), fp32 accumulators.
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if TF_DTYPE == 1
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two floats as one register of two 16-bit values, `lo` in the low half (lower column).
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
#if TF_DTYPE == 1
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// ------------------------------------------------------------------ tiles in shared memory

// Element offset of (row, col) in a swizzled [rows][HD] tile; col is a multiple of 8.
__device__ __forceinline__ int swz(int row, int col) {
  return row * HD + ((((col >> 3) ^ (row & 7))) << 3);
}

// Element offset of (row, col) in a warpgroup-MMA tile of `rows` rows (the layout its
// descriptors describe): column blocks of 64 elements, each [rows][64] with 128-byte rows and
// the 128-byte swizzle. For HD = 64 it is swz's layout.
__device__ __forceinline__ int wg_off(int row, int col, int rows) {
  return (col >> 6) * rows * 64 + row * 64 + ((((col & 63) >> 3) ^ (row & 7)) << 3) + (col & 7);
}

// rows x HD elements from global (row r at base + r * row_stride) into a swizzled tile (the
// warpgroup layout with WG); rows at or beyond `valid_rows` are zero-filled.
template <int ROWS, int THREADS, bool WG = false>
__device__ __forceinline__ void load_tile(u16* tile, const u16* base, tf_i64 row_stride,
                                          int valid_rows, int tid) {
  const u32 tile_addr = smem_addr(tile);
#pragma unroll
  for (int i = tid; i < ROWS * CHUNKS_PER_ROW; i += THREADS) {
    const int row = i / CHUNKS_PER_ROW;
    const int col = (i % CHUNKS_PER_ROW) * 8;
    const bool valid = row < valid_rows;
    const u16* src = valid ? base + row * row_stride + col : base;
    cp_async16(tile_addr + (WG ? wg_off(row, col, ROWS) : swz(row, col)) * 2, src, valid);
  }
}

// `count` floats (index i at base[i]) into shared memory, zero beyond `valid`.
template <int COUNT, int THREADS>
__device__ __forceinline__ void load_row_values(float* dst, const float* base, int valid,
                                                int tid) {
  const u32 dst_addr = smem_addr(dst);
  for (int i = tid; i < COUNT; i += THREADS) {
    const bool ok = i < valid;
    cp_async4(dst_addr + i * 4, ok ? base + i : base, ok);
  }
}

// A lane's part of an ldmatrix.x4, as a byte offset into a swizzled tile whose first row is a
// multiple of 8: `a` for A fragments and for B stored k-major (both .x4 matrix order: rows
// 0-7, rows 8-15, then the next 8 columns), `nk` for B stored n-major (rows 0-7 at columns
// 0-7 and 8-15, then rows 8-15). Computed once per kernel: a fragment at (row0, 16-column
// chunk c) is then `tile + ((offset ^ (c << 5)) + row0 * row bytes)`, because the swizzle XORs
// chunk bits that the lane's row (row & 7 == lane & 7) fixes.
struct Lane {
  u32 a, nk;
};
__device__ __forceinline__ u32 lane_offset(int row, int sub_chunk) {
  return (row * HD + ((sub_chunk ^ (row & 7)) << 3)) * 2;
}
__device__ __forceinline__ Lane lane_offsets(int lane) {
  const int m = lane >> 3, r = lane & 7;
  return Lane{lane_offset(r + ((m & 1) << 3), m >> 1), lane_offset(r + ((m >> 1) << 3), m & 1)};
}
__device__ __forceinline__ u32 frag_addr(const u16* tile, u32 offset, int row0, int chunk16) {
  return smem_addr(tile) + ((offset ^ (chunk16 << 5)) + row0 * (HD * 2));
}

// A fragments (16 rows x 16 cols) of rows [row0, row0+16) at k-chunk kc.
__device__ __forceinline__ void load_a(const u16* tile, int row0, int kc, Lane lane, u32 (&a)[4]) {
  ldsm_x4(frag_addr(tile, lane.a, row0, kc), a);
}

// B fragments for two n8 tiles when the tile holds B^T (rows = n, cols = k): rows
// [n0, n0+16), k-chunk kc. b[0..1] serve n tile n0, b[2..3] n tile n0+8.
__device__ __forceinline__ void load_b_nk(const u16* tile, int n0, int kc, Lane lane, u32 (&b)[4]) {
  ldsm_x4(frag_addr(tile, lane.nk, n0, kc), b);
}

// B fragments when the tile holds B itself (rows = k, cols = n): k rows [k0, k0+16), n cols
// [n0, n0+16). b[0..1] serve n tile n0, b[2..3] n tile n0+8.
__device__ __forceinline__ void load_b_kn(const u16* tile, int k0, int n0, Lane lane, u32 (&b)[4]) {
  ldsm_x4_t(frag_addr(tile, lane.a, k0, n0 >> 4), b);
}

// The gemms below walk (k-chunk, n-pair) steps with the shared-memory fragments of step s + 2
// loaded while step s multiplies (a ring of 3), so ldmatrix latency hides behind the mma. A
// warp owns MT row tiles of 16: every B fragment feeds MT mma pairs.

// acc[MT][N/8][4] (+)= A[MT x 16 x HD] (fragments in registers) * B, the tile holding B^T [N][HD].
template <int MT, int N>
__device__ __forceinline__ void gemm_a_regs_nk(float (&acc)[MT][N / 8][4],
                                               const u32 (&a)[MT][HD / 16][4], const u16* tile,
                                               Lane lane) {
  constexpr int PAIRS = N / 16, STEPS = (HD / 16) * PAIRS;
  u32 b[3][4];
  load_b_nk(tile, 0, 0, lane, b[0]);
  if (STEPS > 1) load_b_nk(tile, (1 % PAIRS) * 16, 1 / PAIRS, lane, b[1]);
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    if (s + 2 < STEPS) load_b_nk(tile, ((s + 2) % PAIRS) * 16, (s + 2) / PAIRS, lane, b[(s + 2) % 3]);
    const int kc = s / PAIRS, n2 = s % PAIRS;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mma16816(acc[mt][2 * n2], a[mt][kc], b[s % 3][0], b[s % 3][1]);
      mma16816(acc[mt][2 * n2 + 1], a[mt][kc], b[s % 3][2], b[s % 3][3]);
    }
  }
}

// acc[MT][N/8][4] (+)= A (rows row0 + 16 mt.. of a_tile) * B, b_tile holding B^T [N][HD].
template <int MT, int N>
__device__ __forceinline__ void gemm_a_smem_nk(float (&acc)[MT][N / 8][4], const u16* a_tile,
                                               int row0, const u16* b_tile, Lane lane) {
  constexpr int PAIRS = N / 16, STEPS = (HD / 16) * PAIRS;
  u32 a[2][MT][4], b[3][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) load_a(a_tile, row0 + 16 * mt, 0, lane, a[0][mt]);
  load_b_nk(b_tile, 0, 0, lane, b[0]);
  if (STEPS > 1) load_b_nk(b_tile, (1 % PAIRS) * 16, 1 / PAIRS, lane, b[1]);
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    const int kc = s / PAIRS, n2 = s % PAIRS;
    if (n2 == 0 && kc + 1 < HD / 16) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        load_a(a_tile, row0 + 16 * mt, kc + 1, lane, a[(kc + 1) & 1][mt]);
    }
    if (s + 2 < STEPS)
      load_b_nk(b_tile, ((s + 2) % PAIRS) * 16, (s + 2) / PAIRS, lane, b[(s + 2) % 3]);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mma16816(acc[mt][2 * n2], a[kc & 1][mt], b[s % 3][0], b[s % 3][1]);
      mma16816(acc[mt][2 * n2 + 1], a[kc & 1][mt], b[s % 3][2], b[s % 3][3]);
    }
  }
}

// out[MT][HD/8][4] += P[MT x 16 x K] (fp32 accumulator layout, converted to 16-bit A
// fragments) * B, where the tile holds B [K][HD] (rows = the k dimension).
template <int MT, int K>
__device__ __forceinline__ void gemm_p_kn(float (&out)[MT][HD / 8][4],
                                          const float (&p)[MT][K / 8][4], const u16* tile,
                                          Lane lane) {
  constexpr int PAIRS = HD / 16, STEPS = (K / 16) * PAIRS;
  u32 b[3][4];
  load_b_kn(tile, 0, 0, lane, b[0]);
  if (STEPS > 1) load_b_kn(tile, (1 / PAIRS) * 16, (1 % PAIRS) * 16, lane, b[1]);
  u32 a[MT][4];
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    const int kc = s / PAIRS, n2 = s % PAIRS;
    if (n2 == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = pack2(p[mt][2 * kc][0], p[mt][2 * kc][1]);
        a[mt][1] = pack2(p[mt][2 * kc][2], p[mt][2 * kc][3]);
        a[mt][2] = pack2(p[mt][2 * kc + 1][0], p[mt][2 * kc + 1][1]);
        a[mt][3] = pack2(p[mt][2 * kc + 1][2], p[mt][2 * kc + 1][3]);
      }
    }
    if (s + 2 < STEPS)
      load_b_kn(tile, ((s + 2) / PAIRS) * 16, ((s + 2) % PAIRS) * 16, lane, b[(s + 2) % 3]);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mma16816(out[mt][2 * n2], a[mt], b[s % 3][0], b[s % 3][1]);
      mma16816(out[mt][2 * n2 + 1], a[mt], b[s % 3][2], b[s % 3][3]);
    }
  }
}

template <int MT, int N>
__device__ __forceinline__ void zero(float (&acc)[MT][N][4]) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int i = 0; i < N; ++i) acc[m][i][0] = acc[m][i][1] = acc[m][i][2] = acc[m][i][3] = 0.f;
}

// A warp's 16 x HD fp32 accumulator, times `mul`, as 16-bit values into global rows
// [row0, row0 + 16) (those below `valid_rows`), staged through the warp's own 16 rows of
// `stage` (a swizzled tile) so global stores are 16 bytes wide.
template <int WG_ROWS = 0>
__device__ __forceinline__ void store_rows(const float (&acc)[HD / 8][4], float mul, u16* stage,
                                           int stage_row0, u16* out, tf_i64 row_stride,
                                           int valid_rows, int lane) {
  const int g = lane >> 2, t = lane & 3;
  // The stage's layout: swizzled [rows][HD], or with WG_ROWS a warpgroup-MMA tile of that
  // many rows (the Q tile the persistent forward stages in).
  auto stage_off = [](int row, int col) {
    return WG_ROWS ? wg_off(row, col, WG_ROWS) : swz(row, col);
  };
#pragma unroll
  for (int nt = 0; nt < HD / 8; ++nt) {
    const int col = nt * 8;
    u32* lo = reinterpret_cast<u32*>(stage + stage_off(stage_row0 + g, col) + 2 * t);
    u32* hi = reinterpret_cast<u32*>(stage + stage_off(stage_row0 + g + 8, col) + 2 * t);
    *lo = pack2(acc[nt][0] * mul, acc[nt][1] * mul);
    *hi = pack2(acc[nt][2] * mul, acc[nt][3] * mul);
  }
  __syncwarp();
#pragma unroll
  for (int i = lane; i < 16 * CHUNKS_PER_ROW; i += 32) {
    const int r = i / CHUNKS_PER_ROW;
    const int col = (i % CHUNKS_PER_ROW) * 8;
    if (r < valid_rows) {
      const tf_raw16 v =
          *reinterpret_cast<const tf_raw16*>(stage + stage_off(stage_row0 + r, col));
      *reinterpret_cast<tf_raw16*>(out + r * row_stride + col) = v;
    }
  }
}

// store_rows for a warp's MT row tiles.
template <int MT>
__device__ __forceinline__ void store_tiles(const float (&acc)[MT][HD / 8][4], float mul,
                                            u16* stage, int stage_row0, u16* out,
                                            tf_i64 row_stride, int valid_rows, int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    store_rows(acc[mt], mul, stage, stage_row0 + 16 * mt, out + 16 * mt * row_stride, row_stride,
               valid_rows - 16 * mt, lane);
}

// Strides (elements) of a [B, H, L, HD] operand whose last dimension is contiguous.
struct Strides {
  tf_i64 batch, head, row;
};

// The call's sizes and softmax constants (`Problem` in src/attention.rs). `group` = query heads
// per kv head; `scale_log2` = scale * log2(e).
struct Problem {
  int heads, lq, lk, group;
  float scale_log2, scale;
  int causal, batch;
};

// The forwards' softmax factor. The scale is at least 0 (attention.rs sends negative ones to
// stock), so both forwards take the max of the unscaled scores and apply the scale in the
// exponent's FFMA: one instruction per score fewer. A zero scale runs as the smallest normal
// float: every score's product rounds to 0 as with 0, and a masked -inf stays -inf instead of
// becoming NaN.
__device__ __forceinline__ float softmax_scale(const Problem& pb) {
  return fmaxf(pb.scale_log2, 1.17549435e-38f);  // FLT_MIN
}

// Keys [n0, n0 + BN) of K and V into `stage` of the double-buffered K/V tiles (keys at or
// beyond kv_end zero-filled), as one cp.async group.
template <int BN, int THREADS>
__device__ __forceinline__ void issue_kv_tile(u16* k_tile, u16* v_tile, int stage, const u16* kb,
                                              tf_i64 k_row, const u16* vb, tf_i64 v_row, int n0,
                                              int kv_end, int tid) {
  load_tile<BN, THREADS>(k_tile + stage * BN * HD, kb + n0 * k_row, k_row, kv_end - n0, tid);
  load_tile<BN, THREADS>(v_tile + stage * BN * HD, vb + n0 * v_row, v_row, kv_end - n0, tid);
  cp_async_commit();
}

// The start of key tile j in the mma.sync forward and dQ kernels' loops over double-buffered
// K/V tiles: waits until tile j has landed (then runs first_tile() on tile 0, once the CTA's
// other tiles are in place too), issues tile j + 1, and says whether tile j reaches the warp's
// rows (keys wholly above a causal diagonal add nothing).
template <int BN, int THREADS, class FirstTile>
__device__ __forceinline__ bool begin_kv_tile(int j, int tiles, u16* k_tile, u16* v_tile,
                                              const u16* kb, tf_i64 k_row, const u16* vb,
                                              tf_i64 v_row, int kv_end, int tid, int causal,
                                              int warp_last_row, FirstTile first_tile) {
  cp_async_wait_all();
  __syncthreads();
  if (j == 0) first_tile();
  const int n0 = j * BN;
  if (j + 1 < tiles)
    issue_kv_tile<BN, THREADS>(k_tile, v_tile, (j + 1) & 1, kb, k_row, vb, v_row, n0 + BN, kv_end,
                               tid);
  return !(causal && n0 > warp_last_row);
}

__device__ __forceinline__ const u16* at(const void* base, Strides s, int b, int h) {
  return static_cast<const u16*>(base) + b * s.batch + h * s.head;
}

#if TF_FWD_WGMMA
// ------------------------------------------------------------------ forward, warpgroup MMA
//
// sm_90a only. A CTA is TF_FWD_WARPS / 4 warpgroups, each owning 64 query rows. Both gemms
// are wgmma.mma_async with operands in shared memory: S = Q K^T reads Q and K (k-major), and
// O += P V takes P from registers (the S accumulators converted to 16-bit, the same lane
// layout as mma.sync's A fragments) and V from shared memory (n-major, transposed by the
// instruction). Tiles use the layout the descriptors describe (wg_off): column blocks of 64
// elements, each [rows][64] with 128-byte rows and the 128-byte swizzle, on 1024-byte
// boundaries. Measured with a probe on the H100: k-major operands take SBO = 1024 (the stride
// of 8-row groups), LBO unused, and a k16 step adds 32 bytes to the start address; the n-major
// V takes LBO = the stride of its 64-column blocks and SBO = 1024, a k16 step is 16 rows.
// K/V tiles stream through a ring of TF_FWD_STAGES stages (cp.async by every thread, one CTA
// barrier per key tile); the two gemms of consecutive tiles overlap the softmax (below).
// Softmax (softmax_scale), masking, the logsumexp and the output stores are the mma.sync
// kernel's.
// With TF_FWD_TMA, one more warpgroup is the producer: one of its threads issues a TMA copy
// per 64-column block of each tile (tensor maps made on the host, the 128-byte swizzle done by
// the copy), each stage has a "full" mbarrier (the copy's bytes arrived) and an "empty" one
// (every consumer warpgroup's wgmma reading it completed); the consumers never wait for each
// other, and the producer gives its registers to them (setmaxnreg).

#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "TF_FWD_WGMMA needs sm_90a (warpgroup MMA)"
#endif
#if TF_FWD_M_TILES != 1 || !(TF_FWD_WARPS == 4 || TF_FWD_WARPS == 8 || TF_FWD_WARPS == 12)
#error "a warpgroup forward has one 64-row tile per warpgroup (FWD_WARPS 4, 8 or 12, FWD_M_TILES 1)"
#endif
#if TF_FWD_WARPS == 12 && !TF_FWD_TMA
#error "FWD_WARPS 12 takes FWD_TMA (the producer's registers go to the three consumers)"
#endif
#if TF_DTYPE == 1
#define WG_AB "bf16"
#else
#define WG_AB "f16"
#endif
typedef unsigned long long u64;

// A shared-memory matrix descriptor with the 128-byte swizzle.
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 lbo, u32 sbo) {
  return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>(lbo >> 4) << 16) |
         (static_cast<u64>(sbo >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Until at most N of this warpgroup's committed groups are still running (in commit order).
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Registers a wgmma wrote, pinned after the wait: no use of them moves above it.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// This thread's cp.async writes, complete, made visible to wgmma's (async proxy) reads.
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

#if TF_FWD_TMA
// A CUtensorMap, passed by value as a __grid_constant__ kernel parameter.
struct __align__(64) TmaMap {
  unsigned long long words[16];
};
// One box of a 4-d tensor map (coordinates innermost first) into shared memory at dst; its
// bytes complete a transaction on `bar`.
__device__ __forceinline__ void tma_load(u32 dst, const TmaMap& map, int c0, int c1, int c2,
                                         int c3, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(bar)
      : "memory");
}
// A warpgroup tile of ROWS x HD elements (its 64-column blocks, one copy each) from rows
// row0.. of head `head`, batch b of a [B, H, L, HD] tensor map; the bytes complete on `bar`.
template <int ROWS>
__device__ __forceinline__ void tma_tile(u16* tile, const TmaMap& map, int row0, int head, int b,
                                         u32 bar) {
#pragma unroll
  for (int c = 0; c < HD / 64; ++c)
    tma_load(smem_addr(tile + c * ROWS * 64), map, c * 64, row0, head, b, bar);
}
// Two such tiles at the same rows of two tensor maps (block by block, both on `bar`).
template <int ROWS>
__device__ __forceinline__ void tma_tile_pair(u16* tile_a, const TmaMap& map_a, u16* tile_b,
                                              const TmaMap& map_b, int row0, int head, int b,
                                              u32 bar) {
#pragma unroll
  for (int c = 0; c < HD / 64; ++c) {
    tma_load(smem_addr(tile_a + c * ROWS * 64), map_a, c * 64, row0, head, b, bar);
    tma_load(smem_addr(tile_b + c * ROWS * 64), map_b, c * 64, row0, head, b, bar);
  }
}
#endif

// d (+)= A * B^T, m64nNk16: A and B k-major in shared memory (accumulate = 0 overwrites d).
template <int N>
__device__ void wg_ss(float (&d)[N / 2], u64 a, u64 b, int accumulate);
// d += A * B, m64nNk16: A in registers (mma.sync A-fragment layout), B n-major in shared memory.
template <int N>
__device__ void wg_rs_mn(float (&d)[N / 2], const u32 (&a)[4], u64 b);

// The accumulators of an m64nN wgmma: N / 2 registers per thread, as asm operands 0.. and as
// the register list of the instruction text.
#define WG_F4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WG_F16(i) WG_F4(i), WG_F4(i + 4), WG_F4(i + 8), WG_F4(i + 12)
#define WG_ACC32 WG_F16(0), WG_F16(16)
#define WG_ACC64 WG_ACC32, WG_F16(32), WG_F16(48)
#define WG_REGS32                                                                          \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23," \
  "%24,%25,%26,%27,%28,%29,%30,%31"
#define WG_REGS64                                                                          \
  WG_REGS32 ",%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,"   \
            "%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
// One specialization per N: operand numbers after the accumulators are literal in the text.
#define WG_SS(N, ACC, REGS, A, B, P)                                                       \
  template <>                                                                              \
  __device__ __forceinline__ void wg_ss<N>(float (&d)[N / 2], u64 a, u64 b, int accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n"                           \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." WG_AB "." WG_AB " {" REGS \
                 "}, %" A ", %" B ", p, 1, 1, 0, 0;\n}\n"                                  \
                 : ACC                                                                     \
                 : "l"(a), "l"(b), "r"(accumulate));                                       \
  }
#define WG_RS_MN(N, ACC, REGS, A0, A1, A2, A3, B, P)                                        \
  template <>                                                                              \
  __device__ __forceinline__ void wg_rs_mn<N>(float (&d)[N / 2], const u32 (&a)[4], u64 b) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n"                           \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." WG_AB "." WG_AB " {" REGS \
                 "}, {%" A0 ",%" A1 ",%" A2 ",%" A3 "}, %" B ", p, 1, 1, 1;\n}\n"          \
                 : ACC                                                                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));           \
  }
WG_SS(64, WG_ACC32, WG_REGS32, "32", "33", "34")
WG_SS(128, WG_ACC64, WG_REGS64, "64", "65", "66")
WG_RS_MN(64, WG_ACC32, WG_REGS32, "32", "33", "34", "35", "36", "37")
WG_RS_MN(128, WG_ACC64, WG_REGS64, "64", "65", "66", "67", "68", "69")

// d = A B^T over the head dim (HD / 16 k16 steps), m64nN: A is the 64 rows at a_addr of a
// warpgroup tile of a_rows rows, B a whole tile of N rows at b_addr, both k-major. Not
// committed.
template <int N>
__device__ __forceinline__ void wg_gemm_hd(float (&d)[N / 2], u32 a_addr, int a_rows,
                                           u32 b_addr) {
#pragma unroll
  for (int kc = 0; kc < HD / 16; ++kc) {
    const u32 step = (kc & 3) * 32;  // k16 steps within a 64-column block
    wg_ss<N>(d, wg_desc(a_addr + (kc >> 2) * a_rows * 128 + step, 16, 1024),
             wg_desc(b_addr + (kc >> 2) * N * 128 + step, 16, 1024), kc > 0);
  }
}

// The backward's two products of one streamed tile, d0 = A0 B0^T and d1 = A1 B1^T (as
// wg_gemm_hd, both A of a_rows rows), issued together and waited for.
template <int N>
__device__ __forceinline__ void wg_gemm_hd_pair(float (&d0)[N / 2], u32 a0, u32 b0,
                                                float (&d1)[N / 2], u32 a1, u32 b1, int a_rows) {
  wg_fence();
  wg_gemm_hd<N>(d0, a0, a_rows, b0);
  wg_gemm_hd<N>(d1, a1, a_rows, b1);
  wg_commit();
  wg_wait<0>();
  fence_regs(d0);
  fence_regs(d1);
}

// d += A B over K rows (K / 16 k16 steps), m64nHD: A in registers (frags, as pack_frags
// leaves them), B the K x HD tile at b_addr, n-major. Not committed.
template <int K>
__device__ __forceinline__ void wg_gemm_rs(float (&d)[HD / 2], const u32 (&a)[K / 16][4],
                                           u32 b_addr) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk)
    wg_rs_mn<HD>(d, a[kk], wg_desc(b_addr + kk * 16 * 128, K * 128, 1024));
}

// An m64nN accumulator as 16-bit A operands of the next wgmma: columns 8i.. are the low
// (i even) or high (i odd) half of k16 step i / 2.
template <int N>
__device__ __forceinline__ void pack_frags(const float (&acc)[N / 2], u32 (&frag)[N / 16][4]) {
#pragma unroll
  for (int i = 0; i < N / 8; ++i) {
    frag[i >> 1][(i & 1) * 2] = pack2(acc[4 * i], acc[4 * i + 1]);
    frag[i >> 1][(i & 1) * 2 + 1] = pack2(acc[4 * i + 2], acc[4 * i + 3]);
  }
}
// Two accumulators in one pass (the order ptxas schedules the dK/dV kernel best in).
template <int N>
__device__ __forceinline__ void pack_frags(const float (&a)[N / 2], u32 (&a_frag)[N / 16][4],
                                           const float (&b)[N / 2], u32 (&b_frag)[N / 16][4]) {
#pragma unroll
  for (int i = 0; i < N / 8; ++i) {
    a_frag[i >> 1][(i & 1) * 2] = pack2(a[4 * i], a[4 * i + 1]);
    a_frag[i >> 1][(i & 1) * 2 + 1] = pack2(a[4 * i + 2], a[4 * i + 3]);
    b_frag[i >> 1][(i & 1) * 2] = pack2(b[4 * i], b[4 * i + 1]);
    b_frag[i >> 1][(i & 1) * 2 + 1] = pack2(b[4 * i + 2], b[4 * i + 3]);
  }
}

#if TF_FWD_TMA
#define FWD_CTA_THREADS (TF_FWD_WARPS * 32 + 128)
#else
#define FWD_CTA_THREADS (TF_FWD_WARPS * 32)
#endif

// id = lo + first * (mid + second * hi).
template <class I>
__device__ __forceinline__ void split_tile_id(I id, I first, I second, int& lo, int& mid,
                                              int& hi) {
  lo = static_cast<int>(id % first);
  mid = static_cast<int>((id / first) % second);
  hi = static_cast<int>(id / first / second);
}

extern "C" __global__ void __launch_bounds__(FWD_CTA_THREADS, TF_FWD_MIN_BLOCKS)
    attn_fwd(const void* q, Strides qs, const void* k, Strides ks, const void* v, Strides vs,
             void* o, Strides os, float* lse, Problem pb, int* tile_counter
#if TF_FWD_TMA
             , const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap k_map,
             const __grid_constant__ TmaMap v_map
#endif
    ) {
  const int heads = pb.heads, lq = pb.lq, lk = pb.lk, group = pb.group, causal = pb.causal;
  const float scale_mag = softmax_scale(pb);
  constexpr int BM = FWD_BLOCK_M, BN = TF_FWD_BLOCK_N;
  extern __shared__ __align__(1024) unsigned char smem_bytes[];
  constexpr int NS = TF_FWD_STAGES;
  constexpr int Q_BUFS = TF_FWD_PERSISTENT ? 2 : 1;
  u16* q_tiles = reinterpret_cast<u16*>(smem_bytes + swizzle_pad(smem_bytes));  // [Q_BUFS]
  u16* k_tile = q_tiles + Q_BUFS * BM * HD;  // [NS][BN * HD]
  u16* v_tile = k_tile + NS * BN * HD;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wg_warp = warp & 3;
  const int g = lane >> 2, t = lane & 3;
#if TF_FWD_PERSISTENT
  const int m_tiles = (lq + BM - 1) / BM;
  const tf_i64 end_id = static_cast<tf_i64>(m_tiles) * heads * pb.batch;
  // grid_tile's order, tile number id. In 32 bits where the tiles fit: 64-bit divisions are
  // long subroutines, and they sit before the producer's first copy and the consumers' first
  // gemm (1.2 us more per single-tile CTA, measured).
  // No counter: the launch is a grid of one CTA per tile (they fit in one wave), in
  // grid_tile's order.
  const bool one_wave = tile_counter == nullptr;
  auto coords = [&](tf_i64 id) {
    if (one_wave) return grid_tile(causal, true);
    GridTile c;
    int lo, mid, hi;
    const int first = causal ? heads : m_tiles, second = causal ? pb.batch : heads;
    if (end_id <= 0x7fffffff) {
      split_tile_id(static_cast<unsigned>(id), static_cast<unsigned>(first),
            static_cast<unsigned>(second), lo, mid, hi);
    } else {
      split_tile_id(id, static_cast<tf_i64>(first), static_cast<tf_i64>(second), lo, mid, hi);
    }
    if (causal) {
      c.head = lo;
      c.batch = mid;
      c.tile = m_tiles - 1 - hi;
    } else {
      c.tile = lo;
      c.head = mid;
      c.batch = hi;
    }
    return c;
  };
#else
  u16* o_stage = k_tile;  // the K/V ring is free once every warpgroup is past its last tile
  auto coords = [&](tf_i64) { return grid_tile(causal, true); };
#endif
#if TF_FWD_TMA
  // Barriers after the V ring: Q full (and Q empty) per Q buffer, then per stage K full,
  // V full, K empty, V empty.
  const u32 bars = smem_addr(v_tile + NS * BN * HD);
  constexpr int Q_BARS = TF_FWD_PERSISTENT ? 2 * Q_BUFS : 1;  // Q full (and Q empty) per buffer
  auto q_full = [&](int buf) { return bars + 8 * buf; };
  auto q_empty = [&](int buf) { return bars + 8 * (Q_BUFS + buf); };
  auto k_full = [&](int stage) { return bars + 8 * (Q_BARS + stage); };
  auto v_full = [&](int stage) { return bars + 8 * (Q_BARS + NS + stage); };
  auto k_empty = [&](int stage) { return bars + 8 * (Q_BARS + 2 * NS + stage); };
  auto v_empty = [&](int stage) { return bars + 8 * (Q_BARS + 3 * NS + stage); };
  constexpr int CONSUMER_WGS = TF_FWD_WARPS / 4;
#if TF_FWD_PERSISTENT
  // After the barriers: the tile number of each Q buffer (-1: no more tiles).
  volatile tf_i64* buf_tile = reinterpret_cast<volatile tf_i64*>(
      reinterpret_cast<unsigned char*>(v_tile + NS * BN * HD) + 8 * (Q_BARS + 4 * NS));
#endif
  if (tid == 0) {
    for (int buf = 0; buf < Q_BUFS; ++buf) {
      mbar_init(q_full(buf), 1);
      // A Q buffer is free once every consumer warp has staged its output rows in it.
      if (Q_BARS > 1) mbar_init(q_empty(buf), TF_FWD_WARPS);
    }
    for (int st = 0; st < NS; ++st) {
      mbar_init(k_full(st), 1);
      mbar_init(v_full(st), 1);
      mbar_init(k_empty(st), CONSUMER_WGS);
      mbar_init(v_empty(st), CONSUMER_WGS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (wg == CONSUMER_WGS) {
    // The producer warpgroup: one thread issues every copy; stage st of tile j is reused once
    // both consumers are done with tile j - NS.
#if TF_FWD_WARPS >= 8
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
#endif
    if (wg_warp == 0 && lane == 0) {
      constexpr u32 TILE_BYTES = BN * HD * 2;
      int ring = 0;  // K/V steps issued so far, over all of the CTA's tiles
#if TF_FWD_PERSISTENT
      tf_i64 id = blockIdx.x;
      for (int local = 0;; ++local) {
        const int qbuf = local % Q_BUFS;
        if (local >= Q_BUFS) mbar_wait(q_empty(qbuf), ((local / Q_BUFS) - 1) & 1);
        if (id >= end_id) {  // no more tiles: tell the consumers
          buf_tile[qbuf] = -1;
          mbar_arrive(q_full(qbuf));
          break;
        }
        buf_tile[qbuf] = id;
#else
      {
        const tf_i64 id = 0;
        const int qbuf = 0;
#endif
        const GridTile c = coords(id);
        const int q0 = c.tile * BM, hk = c.head / group, b = c.batch;
        const int kv_end = causal ? min(lk, q0 + BM) : lk;
        const int tiles = (kv_end + BN - 1) / BN;
        mbar_expect_bytes(q_full(qbuf), BM * HD * 2);
        tma_tile<BM>(q_tiles + qbuf * BM * HD, q_map, q0, c.head, b, q_full(qbuf));
#if TF_FWD_PERSISTENT
        // Drawn early: its latency hides behind K/V.
        if (!one_wave) id = gridDim.x + atomicAdd(tile_counter, 1);
#endif
        for (int j = 0; j < tiles; ++j, ++ring) {
          const int st = ring % NS;
          const u32 reuse = ((ring / NS) - 1) & 1;
          if (ring >= NS) mbar_wait(k_empty(st), reuse);
          mbar_expect_bytes(k_full(st), TILE_BYTES);
          tma_tile<BN>(k_tile + st * BN * HD, k_map, j * BN, hk, b, k_full(st));
          if (ring >= NS) mbar_wait(v_empty(st), reuse);
          mbar_expect_bytes(v_full(st), TILE_BYTES);
          tma_tile<BN>(v_tile + st * BN * HD, v_map, j * BN, hk, b, v_full(st));
        }
#if TF_FWD_PERSISTENT
        if (one_wave) break;
#endif
      }
    }
    return;
  }
#if TF_FWD_WARPS == 8
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
#elif TF_FWD_WARPS == 12
  // 128 * 24 + 384 * 160 registers: within the SM's 64K.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 160;\n");
#endif
  // One thread per consumer warpgroup tells the producer a stage is free.
  auto release = [&](u32 bar) {
    if (wg_warp == 0 && lane == 0) mbar_arrive(bar);
  };
#endif
  int ring = 0;  // K/V steps consumed so far, over all of the CTA's tiles
#if TF_FWD_PERSISTENT
  for (int local = 0;; ++local) {
  const int qbuf = local % Q_BUFS;
  // The first tile is the CTA's own: its coordinates are worked out while its Q loads.
  tf_i64 id = blockIdx.x;
  if (local > 0) {
    mbar_wait(q_full(qbuf), (local / Q_BUFS) & 1);
    id = buf_tile[qbuf];
    if (id < 0) break;
  }
#else
  {
  const tf_i64 id = 0;
  const int qbuf = 0;
#endif
  const GridTile cta = coords(id);
  const int mb = cta.tile, h = cta.head, b = cta.batch;
  const int q0 = mb * BM, w0 = q0 + wg * 64;        // first row of the CTA, of the warpgroup
  const int r0 = w0 + 16 * wg_warp + g;             // this thread's rows: r0 and r0 + 8
  const int kv_end = causal ? min(lk, q0 + BM) : lk;
  const int tiles = (kv_end + BN - 1) / BN;
  u16* q_tile = q_tiles + qbuf * BM * HD;
#if TF_FWD_PERSISTENT
  if (local == 0) mbar_wait(q_full(qbuf), 0);
#elif TF_FWD_TMA
  mbar_wait(q_full(qbuf), 0);
#else
  constexpr int THREADS = TF_FWD_WARPS * 32;
  const int hk = h / group;
  const u16* qb = at(q, qs, b, h) + q0 * qs.row;
  const u16* kb = at(k, ks, b, hk);
  const u16* vb = at(v, vs, b, hk);
  load_tile<BM, THREADS, true>(q_tile, qb, qs.row, lq - q0, tid);
  auto load_k = [&](int stage, int n0) {
    load_tile<BN, THREADS, true>(k_tile + stage * BN * HD, kb + n0 * ks.row, ks.row,
                                 kv_end - n0, tid);
  };
  auto load_v = [&](int stage, int n0) {
    load_tile<BN, THREADS, true>(v_tile + stage * BN * HD, vb + n0 * vs.row, vs.row,
                                 kv_end - n0, tid);
  };
  // The loads of step s (below) for s = 1 - NS .. -1: K_0 .. K_{NS-2}, V_0 .. V_{NS-3}.
  for (int step = 1 - NS; step < 0; ++step) {
    if (step - 1 + NS < tiles) load_k((step - 1 + NS) % NS, (step - 1 + NS) * BN);
    if (step - 2 + NS >= 0 && step - 2 + NS < tiles) load_v((step - 2 + NS) % NS, (step - 2 + NS) * BN);
    cp_async_commit();
  }
#endif

  const u32 q_addr = smem_addr(q_tile) + wg * 64 * 128;
  const u32 k_addr = smem_addr(k_tile), v_addr = smem_addr(v_tile);
  float o_acc[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o_acc[i] = 0.f;
  float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};

  // Software pipeline (FlashAttention-3's intra-warpgroup overlap): step j issues
  // S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back, so the tensor cores work on the
  // second while the warpgroup runs the softmax of the first; O is rescaled and P_j packed
  // once O += P_{j-1} V_{j-1} has completed. Every wgmma sits on control flow that depends on
  // the CTA alone: ptxas serializes all of them otherwise (C7520). So a warpgroup also takes
  // the key tiles wholly above its diagonal (the mask zeroes them): at most one per CTA.
  float s[BN / 2];
  u32 p[BN / 16][4];
  float alpha[2];
  // Step j's start: K_j and V_{j-1} (loaded during step j + 1 - NS, one group per step) are
  // in place. After the barrier every warpgroup is past step j - 1, so K_{j-1}'s and
  // V_{j-2}'s stages are free for K_{j-1+NS} and V_{j-2+NS}.
#if TF_FWD_TMA
  // Step j's start: K_j and V_{j-1} have arrived.
  auto begin_step = [&](int j) {
    if (j < tiles) mbar_wait(k_full((ring + j) % NS), ((ring + j) / NS) & 1);
    if (j >= 1) mbar_wait(v_full((ring + j - 1) % NS), ((ring + j - 1) / NS) & 1);
  };
#else
  auto begin_step = [&](int j) {
    cp_async_wait<NS - 2>();
    fence_async_shared();
    __syncthreads();
    if (j - 1 + NS < tiles) load_k((j - 1 + NS) % NS, (j - 1 + NS) * BN);
    if (j - 2 + NS < tiles) load_v((j - 2 + NS) % NS, (j - 2 + NS) * BN);
    cp_async_commit();
  };
#endif
  auto issue_s = [&](int j) {
    wg_gemm_hd<BN>(s, q_addr, BM, k_addr + ((ring + j) % NS) * BN * HD * 2);
    wg_commit();
  };
  auto issue_pv = [&](int j) {  // O += P_j V_j
    wg_gemm_rs<BN>(o_acc, p, v_addr + ((ring + j) % NS) * BN * HD * 2);
    wg_commit();
  };
  // Masks S_j, updates the running max and sum (base 2, scaled), leaves
  // exp2(S_j * scale - max) in s and the O rescale factor in alpha.
  auto softmax = [&](int j) {
    const int n0 = j * BN;
    const bool edge = n0 + BN > kv_end || (causal && n0 + BN - 1 > w0);
    float tile_max[2] = {NEG_INF, NEG_INF};
    auto mask_and_max = [&](bool mask) {
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n0 + 8 * i + 2 * t + (e & 1);
          const int row = r0 + (e >> 1) * 8;
          if (mask && (col >= kv_end || (causal && col > row))) s[4 * i + e] = NEG_INF;
          tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[4 * i + e]);
        }
      }
    };
    // Two copies, so the tiles without masked elements (most) skip the per-element compares
    // and selects: with the mask under `if (edge)` inside one loop ptxas predicated them onto
    // every tile (ncu, GPT-2's shape: 2.4x cuDNN's ALU instructions).
    if (edge) {
      mask_and_max(true);
    } else {
      mask_and_max(false);
    }
    float m_use[2], row_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      // A positive factor keeps the max (rounding is monotonic); -inf stays -inf.
      const float m_new = fmaxf(m_run[r], tile_max[r] * scale_mag);
      m_use[r] = m_new == NEG_INF ? 0.f : m_new;
      alpha[r] = fast_exp2(m_run[r] - m_use[r]);
      m_run[r] = m_new;
    }
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      s[i] = fast_exp2(fmaf(s[i], scale_mag, -m_use[(i >> 1) & 1]));
      row_sum[(i >> 1) & 1] += s[i];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + row_sum[r];
  };
  auto pack_p = [&]() { pack_frags<BN>(s, p); };

#if TF_FWD_PINGPONG
  // Named barriers 2 + w: warpgroup w's turn. A turn begins when the other warpgroup has
  // issued its previous gemms (warpgroup 1 lets warpgroup 0 go first) and ends by letting the
  // other go; warpgroup 0 takes one more turn at the end, so no arrival is left over.
  auto turn_begin = [&]() {
    asm volatile("bar.sync %0, 256;\n" ::"r"(2 + wg) : "memory");
  };
  auto turn_end = [&]() {
    asm volatile("bar.arrive %0, 256;\n" ::"r"(3 - wg) : "memory");
  };
  if (wg == 1) turn_end();
#else
  auto turn_begin = [&]() {};
  auto turn_end = [&]() {};
#endif
  begin_step(0);
  turn_begin();
  wg_fence();
  issue_s(0);
  turn_end();
  wg_wait<0>();
  fence_regs(s);
#if TF_FWD_TMA
  release(k_empty(ring % NS));
#endif
  softmax(0);
  pack_p();
  for (int j = 1; j < tiles; ++j) {
    begin_step(j);
    turn_begin();
    wg_fence();
    issue_s(j);
    issue_pv(j - 1);
    turn_end();
    wg_wait<1>();
    fence_regs(s);
#if TF_FWD_TMA
    release(k_empty((ring + j) % NS));
#endif
    softmax(j);
    wg_wait<0>();
    fence_regs(o_acc);
#if TF_FWD_TMA
    release(v_empty((ring + j - 1) % NS));
#endif
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) {
      o_acc[4 * i] *= alpha[0];
      o_acc[4 * i + 1] *= alpha[0];
      o_acc[4 * i + 2] *= alpha[1];
      o_acc[4 * i + 3] *= alpha[1];
    }
    pack_p();
  }
  begin_step(tiles);
  turn_begin();
  wg_fence();
  issue_pv(tiles - 1);
  turn_end();
#if TF_FWD_PINGPONG
  if (wg == 0) turn_begin();
#endif
  wg_wait<0>();
  fence_regs(o_acc);
#if TF_FWD_PERSISTENT
  release(v_empty((ring + tiles - 1) % NS));  // the last V stage, for the next tile's loads
#endif

  float* lse_row = lse + (static_cast<tf_i64>(b) * heads + h) * lq;
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
    inv[r] = 1.f / l_run[r];
    const int row = r0 + r * 8;
    if (t == 0 && row < lq) lse_row[row] = (m_run[r] + log2f(l_run[r])) * LN2;
  }
  float out[HD / 8][4];
#pragma unroll
  for (int i = 0; i < HD / 8; ++i) {
    out[i][0] = o_acc[4 * i] * inv[0];
    out[i][1] = o_acc[4 * i + 1] * inv[0];
    out[i][2] = o_acc[4 * i + 2] * inv[1];
    out[i][3] = o_acc[4 * i + 3] * inv[1];
  }
#if TF_FWD_PERSISTENT
  // Each warp stages its own rows in its own rows of the Q tile (the K/V ring holds the next
  // tile's loads): its warpgroup's gemms reading them have completed.
#elif TF_FWD_TMA
  // Every warpgroup is past its last read of the K/V tiles: they stage the output rows.
  // (The producer has left; every copy it issued has landed: the consumers waited for all.)
  asm volatile("bar.sync 1, %0;\n" ::"n"(TF_FWD_WARPS * 32) : "memory");
#else
  __syncthreads();
#endif
  const int warp_row0 = w0 + 16 * wg_warp;
  u16* ob = static_cast<u16*>(o) + b * os.batch + h * os.head + warp_row0 * os.row;
#if TF_FWD_PERSISTENT
  store_rows<BM>(out, 1.f, q_tile, warp * 16, ob, os.row, lq - warp_row0, lane);
  __syncwarp();
  if (lane == 0) mbar_arrive(q_empty(qbuf));  // the warp's reads of its rows are done
  if (one_wave) break;
#else
  store_rows(out, 1.f, o_stage, warp * 16, ob, os.row, lq - warp_row0, lane);
#endif
  ring += tiles;
  }  // the CTA's tiles
}

#else  // mma.sync forward

// ------------------------------------------------------------------ forward

extern "C" __global__ void __launch_bounds__(TF_FWD_WARPS * 32, TF_FWD_MIN_BLOCKS)
    attn_fwd(const void* q, Strides qs, const void* k, Strides ks, const void* v, Strides vs,
             void* o, Strides os, float* lse, Problem pb) {
  const int heads = pb.heads, lq = pb.lq, lk = pb.lk, group = pb.group, causal = pb.causal;
  const float scale_mag = softmax_scale(pb);
  constexpr int BM = FWD_BLOCK_M, BN = TF_FWD_BLOCK_N, THREADS = TF_FWD_WARPS * 32;
  constexpr int MT = FWD_MT, WARP_ROWS = 16 * MT;
  extern __shared__ __align__(128) u16 smem[];
  u16* q_tile = smem;
  u16* k_tile = q_tile + BM * HD;  // [2][BN][HD]
  u16* v_tile = k_tile + 2 * BN * HD;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const Lane fl = lane_offsets(lane);
  // Causal: the longest query blocks first, so the short ones fill the tail.
  const GridTile cta = grid_tile(causal, true);
  const int mb = cta.tile, h = cta.head, b = cta.batch, hk = h / group;
  const int q0 = mb * BM, w0 = q0 + warp * WARP_ROWS;  // first row of the CTA, of the warp

  const u16* qb = at(q, qs, b, h) + q0 * qs.row;
  const u16* kb = at(k, ks, b, hk);
  const u16* vb = at(v, vs, b, hk);
  load_tile<BM, THREADS>(q_tile, qb, qs.row, lq - q0, tid);
  const int kv_end = causal ? min(lk, q0 + BM) : lk;
  const int tiles = (kv_end + BN - 1) / BN;
  issue_kv_tile<BN, THREADS>(k_tile, v_tile, 0, kb, ks.row, vb, vs.row, 0, kv_end, tid);

  float o_acc[MT][HD / 8][4];
  zero(o_acc);
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    m_run[mt][0] = m_run[mt][1] = NEG_INF, l_run[mt][0] = l_run[mt][1] = 0.f;
  u32 qf[MT][HD / 16][4];

  auto load_q = [&]() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kc = 0; kc < HD / 16; ++kc)
        load_a(q_tile, warp * WARP_ROWS + 16 * mt, kc, fl, qf[mt][kc]);
  };
  for (int j = 0; j < tiles; ++j) {
    if (!begin_kv_tile<BN, THREADS>(j, tiles, k_tile, v_tile, kb, ks.row, vb, vs.row, kv_end, tid,
                                    causal, w0 + WARP_ROWS - 1, load_q))
      continue;
    const int n0 = j * BN;
    const u16* kt = k_tile + (j & 1) * BN * HD;
    const u16* vt = v_tile + (j & 1) * BN * HD;

    float s[MT][BN / 8][4];
    zero(s);
    gemm_a_regs_nk<MT, BN>(s, qf, kt, fl);

    const bool edge = n0 + BN > kv_end || (causal && n0 + BN - 1 > w0);
    float tile_max[MT][2];
    auto mask_and_max = [&](bool mask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        tile_max[mt][0] = tile_max[mt][1] = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = n0 + nt * 8 + 2 * t + (e & 1);
            const int row = w0 + 16 * mt + g + (e >> 1) * 8;
            if (mask && (col >= kv_end || (causal && col > row))) s[mt][nt][e] = NEG_INF;
            tile_max[mt][e >> 1] = fmaxf(tile_max[mt][e >> 1], s[mt][nt][e]);
          }
        }
      }
    };
    // Two copies, so tiles without masked elements skip the per-element mask (see the sm 90
    // forward: ptxas predicates a mask under `if (edge)` onto every tile).
    if (edge) {
      mask_and_max(true);
    } else {
      mask_and_max(false);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float alpha[2], m_use[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float row_max = tile_max[mt][r];
        row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
        row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
        // A positive factor keeps the max (rounding is monotonic); -inf stays -inf.
        const float m_new = fmaxf(m_run[mt][r], row_max * scale_mag);
        m_use[r] = m_new == NEG_INF ? 0.f : m_new;
        alpha[r] = fast_exp2(m_run[mt][r] - m_use[r]);
        m_run[mt][r] = m_new;
      }
      float row_sum[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = fast_exp2(fmaf(s[mt][nt][e], scale_mag, -m_use[e >> 1]));
          s[mt][nt][e] = p;
          row_sum[e >> 1] += p;
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) l_run[mt][r] = l_run[mt][r] * alpha[r] + row_sum[r];
#pragma unroll
      for (int nt = 0; nt < HD / 8; ++nt) {
        o_acc[mt][nt][0] *= alpha[0];
        o_acc[mt][nt][1] *= alpha[0];
        o_acc[mt][nt][2] *= alpha[1];
        o_acc[mt][nt][3] *= alpha[1];
      }
    }
    gemm_p_kn<MT, BN>(o_acc, s, vt, fl);
  }

  float* lse_row = lse + (static_cast<tf_i64>(b) * heads + h) * lq;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l_run[mt][r] += __shfl_xor_sync(0xffffffffu, l_run[mt][r], 1);
      l_run[mt][r] += __shfl_xor_sync(0xffffffffu, l_run[mt][r], 2);
      inv[r] = 1.f / l_run[mt][r];
      const int row = w0 + 16 * mt + g + r * 8;
      if (t == 0 && row < lq) lse_row[row] = (m_run[mt][r] + log2f(l_run[mt][r])) * LN2;
    }
#pragma unroll
    for (int nt = 0; nt < HD / 8; ++nt) {
      o_acc[mt][nt][0] *= inv[0];
      o_acc[mt][nt][1] *= inv[0];
      o_acc[mt][nt][2] *= inv[1];
      o_acc[mt][nt][3] *= inv[1];
    }
  }
  // The warp's own rows of the Q tile are free now (its Q fragments are in registers).
  u16* ob = static_cast<u16*>(o) + b * os.batch + h * os.head + w0 * os.row;
  store_tiles<MT>(o_acc, 1.f, q_tile, warp * WARP_ROWS, ob, os.row, lq - w0, lane);
}

#endif  // TF_FWD_WGMMA

// ------------------------------------------------------------------ backward

// delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] in fp32; `rows` = B * H * Lq.
extern "C" __global__ void __launch_bounds__(256)
    attn_bwd_prep(const void* o, Strides os, const void* dout, Strides ds, float* delta,
                  int heads, int lq, tf_i64 rows) {
  const tf_i64 chunk = static_cast<tf_i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  const tf_i64 row = chunk / CHUNKS_PER_ROW;
  const int col = static_cast<int>(chunk % CHUNKS_PER_ROW) * 8;
  float acc = 0.f;
  if (row < rows) {
    const int i = static_cast<int>(row % lq);
    const tf_i64 bh = row / lq;
    const int h = static_cast<int>(bh % heads);
    const int b = static_cast<int>(bh / heads);
    tf_pack<tf_storage> a, c;
    a.raw = *reinterpret_cast<const tf_raw16*>(at(o, os, b, h) + i * os.row + col);
    c.raw = *reinterpret_cast<const tf_raw16*>(at(dout, ds, b, h) + i * ds.row + col);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += tf_float(a.e[e]) * tf_float(c.e[e]);
  }
  // The chunks of one row are adjacent lanes (CHUNKS_PER_ROW divides 32).
#pragma unroll
  for (int offset = CHUNKS_PER_ROW / 2; offset > 0; offset >>= 1)
    acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  if (row < rows && col == 0) delta[row] = acc;
}

// dK, dV for BWD_BLOCK_K keys of one (batch, kv head). lse and delta are [B, H, Lq] fp32.
#if TF_BWD_WGMMA
// ------------------------------------------------------------------ dK/dV, warpgroup MMA
//
// sm_90a. A CTA owns 128 keys of one (batch, kv head): two computing warpgroups of 64 keys
// each, whose K and V rows stay in shared memory, plus a producer warpgroup. The producer's
// first warp brings K and V once, then each query tile's Q and dO (TMA, a ring of
// BWD_STAGES stages); its second warp copies the tile's logsumexp and delta rows. Per query
// tile a computing warpgroup issues S^T = K Q^T and dP^T = V dO^T (shared-memory operands),
// turns them into P^T and dS^T = P^T (dP^T - delta) in registers, then dV += P^T dO and
// dK += dS^T Q with P^T and dS^T as register operands; dK and dV stay in fp32 registers
// for the whole walk and are written once. Query rows past Lq are zeros in Q and dO (TMA
// fills them), their logsumexp and delta zeros: they add nothing. The order of every sum is
// fixed: bitwise reproducible.
#define BWD_STAGES 2
#define BWD_WG_KEYS TF_ATTN_DKDV_WG_KEYS

// The mbarriers of a warpgroup backward kernel, from `base`: one for the tiles the CTA keeps,
// then per stage of the ring "full" (its tiles have landed) and "empty" (both computing
// warpgroups are done with it).
struct BwdRing {
  u32 base;
  __device__ __forceinline__ u32 resident() const { return base; }
  __device__ __forceinline__ u32 full(int stage) const { return base + 8 * (1 + stage); }
  __device__ __forceinline__ u32 empty(int stage) const {
    return base + 8 * (1 + BWD_STAGES + stage);
  }
  // By one thread, before the CTA's barrier: a full barrier's phase takes `full_arrivals`.
  __device__ __forceinline__ void init(u32 full_arrivals) const {
    mbar_init(resident(), 1);
    for (int st = 0; st < BWD_STAGES; ++st) {
      mbar_init(full(st), full_arrivals);
      mbar_init(empty(st), 2);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // Producer: until iteration it's stage is free (both warpgroups released iteration
  // it - BWD_STAGES).
  __device__ __forceinline__ void wait_free(int it) const {
    if (it >= BWD_STAGES) mbar_wait(empty(it % BWD_STAGES), ((it / BWD_STAGES) - 1) & 1);
  }
  // Consumer: until iteration it's tiles have landed.
  __device__ __forceinline__ void wait_full(int it) const {
    mbar_wait(full(it % BWD_STAGES), (it / BWD_STAGES) & 1);
  }
};

extern "C" __global__ void __launch_bounds__(384, 1)
    attn_bwd_dkdv(const void* q, Strides qs, const void* k, Strides ks, const void* v, Strides vs,
                  const void* dout, Strides dos, const float* lse, const float* delta,
                  void* dk, Strides dks, void* dv, Strides dvs, Problem pb,
                  const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap k_map,
                  const __grid_constant__ TmaMap v_map, const __grid_constant__ TmaMap do_map) {
  const int heads = pb.heads, lq = pb.lq, lk = pb.lk, group = pb.group, causal = pb.causal;
  const float scale_log2 = pb.scale_log2;
  constexpr int BK = BWD_WG_KEYS, BQ = TF_BWD_BLOCK_Q, NS = BWD_STAGES;
  extern __shared__ __align__(1024) unsigned char smem_bytes[];
  u16* k_tile = reinterpret_cast<u16*>(smem_bytes + swizzle_pad(smem_bytes));
  u16* v_tile = k_tile + BK * HD;
  u16* q_ring = v_tile + BK * HD;         // [NS][BQ * HD]
  u16* do_ring = q_ring + NS * BQ * HD;   // [NS][BQ * HD]
  float* lse_ring = reinterpret_cast<float*>(do_ring + NS * BQ * HD);  // [NS][BQ]
  float* delta_ring = lse_ring + NS * BQ;                              // [NS][BQ]
  const BwdRing ring{smem_addr(delta_ring + NS * BQ)};  // resident: K and V

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wg_warp = warp & 3;
  const int g = lane >> 2, t = lane & 3;
  const GridTile cta = grid_tile(causal, false);
  const int nb = cta.tile, hk = cta.head, b = cta.batch;
  const int k0 = nb * BK;
  // Query tiles: every head of the group, from the first tile that reaches this key block.
  const int q_first = causal ? (k0 / BQ) : 0;
  const int q_tiles_per_head = max(0, (lq + BQ - 1) / BQ - q_first);
  const int tiles = q_tiles_per_head * group;
  auto tile_head = [&](int it) { return hk * group + it / q_tiles_per_head; };
  auto tile_row = [&](int it) { return (q_first + it % q_tiles_per_head) * BQ; };

  if (tid == 0) ring.init(2);  // the copies' arrival, and the rows' warp
  __syncthreads();

  if (wg == 2) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (wg_warp == 0 && lane == 0) {
      mbar_expect_bytes(ring.resident(), 2 * BK * HD * 2);
      tma_tile_pair<BK>(k_tile, k_map, v_tile, v_map, k0, hk, b, ring.resident());
      for (int it = 0; it < tiles; ++it) {
        const int st = it % NS, h = tile_head(it), qt0 = tile_row(it);
        ring.wait_free(it);
        mbar_expect_bytes(ring.full(st), 2 * BQ * HD * 2);
        tma_tile_pair<BQ>(q_ring + st * BQ * HD, q_map, do_ring + st * BQ * HD, do_map, qt0, h, b,
                          ring.full(st));
      }
    } else if (wg_warp == 1) {
      for (int it = 0; it < tiles; ++it) {
        const int st = it % NS, h = tile_head(it), qt0 = tile_row(it);
        ring.wait_free(it);
        const tf_i64 row_base = (static_cast<tf_i64>(b) * heads + h) * lq + qt0;
        for (int r = lane; r < BQ; r += 32) {
          const bool ok = qt0 + r < lq;
          lse_ring[st * BQ + r] = ok ? lse[row_base + r] * LOG2E : 0.f;
          delta_ring[st * BQ + r] = ok ? delta[row_base + r] : 0.f;
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(ring.full(st));
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");

  const int w0 = k0 + wg * 64;  // this warpgroup's first key
  const u32 k_addr = smem_addr(k_tile) + wg * 64 * 128, v_addr = smem_addr(v_tile) + wg * 64 * 128;
  float dk_acc[HD / 2], dv_acc[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) dk_acc[i] = dv_acc[i] = 0.f;
  float st_acc[BQ / 2], dp_acc[BQ / 2];
  u32 p_frag[BQ / 16][4], ds_frag[BQ / 16][4];
  mbar_wait(ring.resident(), 0);

  for (int it = 0; it < tiles; ++it) {
    const int st = it % NS, qt0 = tile_row(it);
    ring.wait_full(it);
    const u32 q_stage = smem_addr(q_ring + st * BQ * HD);
    const u32 do_stage = smem_addr(do_ring + st * BQ * HD);
    wg_gemm_hd_pair<BQ>(st_acc, k_addr, q_stage, dp_acc, v_addr, do_stage, BK);

    // Rows: keys w0 + 16 wg_warp + g (+ 8); columns: queries qt0 + 8 i + 2 t (+ 1).
    const float* lse_s = lse_ring + st * BQ;
    const float* delta_s = delta_ring + st * BQ;
    const bool edge = causal && qt0 < w0 + 63;
    const int key0 = w0 + 16 * wg_warp + g;
    auto probabilities = [&](bool mask) {
#pragma unroll
      for (int i = 0; i < BQ / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qc = 8 * i + 2 * t + (e & 1);
          float p = fast_exp2(fmaf(st_acc[4 * i + e], scale_log2, -lse_s[qc]));
          if (mask && key0 + (e >> 1) * 8 > qt0 + qc) p = 0.f;
          st_acc[4 * i + e] = p;
          dp_acc[4 * i + e] = p * (dp_acc[4 * i + e] - delta_s[qc]);
        }
      }
    };
    // Two copies: the tiles off the diagonal skip the per-element mask (see attn_fwd).
    if (edge) {
      probabilities(true);
    } else {
      probabilities(false);
    }
    pack_frags<BQ>(st_acc, p_frag, dp_acc, ds_frag);
    wg_fence();
    wg_gemm_rs<BQ>(dv_acc, p_frag, do_stage);
    wg_gemm_rs<BQ>(dk_acc, ds_frag, q_stage);
    wg_commit();
    wg_wait<0>();
    fence_regs(dv_acc);
    fence_regs(dk_acc);
    if (wg_warp == 0 && lane == 0) mbar_arrive(ring.empty(st));
  }

  // Both computing warpgroups are past their last read of K and V: the tiles stage the rows.
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  float out_k[HD / 8][4], out_v[HD / 8][4];
#pragma unroll
  for (int i = 0; i < HD / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      out_k[i][e] = dk_acc[4 * i + e];
      out_v[i][e] = dv_acc[4 * i + e];
    }
  const int warp_key0 = w0 + 16 * wg_warp;
  const int valid = lk - warp_key0;
  u16* dkb = static_cast<u16*>(dk) + b * dks.batch + hk * dks.head + warp_key0 * dks.row;
  u16* dvb = static_cast<u16*>(dv) + b * dvs.batch + hk * dvs.head + warp_key0 * dvs.row;
  store_rows(out_k, pb.scale, k_tile, warp * 16, dkb, dks.row, valid, lane);
  store_rows(out_v, 1.f, v_tile, warp * 16, dvb, dvs.row, valid, lane);
}

#else

extern "C" __global__ void __launch_bounds__(TF_BWD_WARPS * 32, TF_BWD_MIN_BLOCKS)
    attn_bwd_dkdv(const void* q, Strides qs, const void* k, Strides ks, const void* v, Strides vs,
                  const void* dout, Strides dos, const float* lse, const float* delta,
                  void* dk, Strides dks, void* dv, Strides dvs, Problem pb) {
  const int heads = pb.heads, lq = pb.lq, lk = pb.lk, group = pb.group, causal = pb.causal;
  const float scale_log2 = pb.scale_log2;
  constexpr int BK = BWD_BLOCK_K, BQ = TF_BWD_BLOCK_Q, THREADS = TF_BWD_WARPS * 32;
  constexpr int MT = BWD_MT, WARP_KEYS = 16 * MT;
  extern __shared__ __align__(128) u16 smem[];
  u16* k_tile = smem;                   // [BK][HD]
  u16* v_tile = k_tile + BK * HD;       // [BK][HD]
  u16* q_tile = v_tile + BK * HD;       // [2][BQ][HD]
  u16* do_tile = q_tile + 2 * BQ * HD;  // [2][BQ][HD]
  float* lse_tile = reinterpret_cast<float*>(do_tile + 2 * BQ * HD);  // [2][BQ]
  float* delta_tile = lse_tile + 2 * BQ;                              // [2][BQ]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const Lane fl = lane_offsets(lane);
  const GridTile cta = grid_tile(causal, false);
  const int nb = cta.tile, hk = cta.head, b = cta.batch;
  const int k0 = nb * BK, w0 = k0 + warp * WARP_KEYS;  // first key of the CTA, of the warp

  load_tile<BK, THREADS>(k_tile, at(k, ks, b, hk) + k0 * ks.row, ks.row, lk - k0, tid);
  load_tile<BK, THREADS>(v_tile, at(v, vs, b, hk) + k0 * vs.row, vs.row, lk - k0, tid);

  // Query tiles: every head of the group, from the first tile that reaches this key block.
  const int q_first = causal ? (k0 / BQ) : 0;
  const int q_tiles_per_head = max(0, (lq + BQ - 1) / BQ - q_first);
  const int tiles = q_tiles_per_head * group;
  auto issue = [&](int it, int stage) {
    const int h = hk * group + it / q_tiles_per_head;
    const int qt0 = (q_first + it % q_tiles_per_head) * BQ;
    load_tile<BQ, THREADS>(q_tile + stage * BQ * HD, at(q, qs, b, h) + qt0 * qs.row, qs.row,
                           lq - qt0, tid);
    load_tile<BQ, THREADS>(do_tile + stage * BQ * HD, at(dout, dos, b, h) + qt0 * dos.row,
                           dos.row, lq - qt0, tid);
    const tf_i64 row_base = (static_cast<tf_i64>(b) * heads + h) * lq + qt0;
    load_row_values<BQ, THREADS>(lse_tile + stage * BQ, lse + row_base, lq - qt0, tid);
    load_row_values<BQ, THREADS>(delta_tile + stage * BQ, delta + row_base, lq - qt0, tid);
  };
  if (tiles > 0) issue(0, 0);
  cp_async_commit();

  float dk_acc[MT][HD / 8][4], dv_acc[MT][HD / 8][4];
  zero(dk_acc);
  zero(dv_acc);

  for (int it = 0; it < tiles; ++it) {
    cp_async_wait_all();
    __syncthreads();
    const int stage = it & 1;
    if (it + 1 < tiles) {
      issue(it + 1, stage ^ 1);
      cp_async_commit();
    }
    const int qt0 = (q_first + it % q_tiles_per_head) * BQ;
    if (causal && qt0 + BQ - 1 < w0) continue;  // all these queries come before the warp's keys
    const u16* qt = q_tile + stage * BQ * HD;
    const u16* dot = do_tile + stage * BQ * HD;
    const float* lse_s = lse_tile + stage * BQ;
    const float* delta_s = delta_tile + stage * BQ;

    // S^T = K Q^T and dP^T = V dO^T: rows = the warp's keys, cols = BQ queries. Query rows at
    // or beyond lq are zero in Q and dO (and their lse, delta), so they add nothing below.
    float st[MT][BQ / 8][4], dpt[MT][BQ / 8][4];
    zero(st);
    zero(dpt);
    gemm_a_smem_nk<MT, BQ>(st, k_tile, warp * WARP_KEYS, qt, fl);
    gemm_a_smem_nk<MT, BQ>(dpt, v_tile, warp * WARP_KEYS, dot, fl);

    const bool edge = causal && qt0 < w0 + WARP_KEYS - 1;
    auto probabilities = [&](bool mask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < BQ / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int qc = nt * 8 + 2 * t + (e & 1);
            float p = fast_exp2(fmaf(st[mt][nt][e], scale_log2, -lse_s[qc] * LOG2E));
            if (mask && w0 + 16 * mt + g + (e >> 1) * 8 > qt0 + qc) p = 0.f;
            st[mt][nt][e] = p;
            dpt[mt][nt][e] = p * (dpt[mt][nt][e] - delta_s[qc]);
          }
        }
      }
    };
    // Two copies: the tiles off the diagonal skip the per-element mask (see the forward).
    if (edge) {
      probabilities(true);
    } else {
      probabilities(false);
    }
    gemm_p_kn<MT, BQ>(dv_acc, st, dot, fl);
    gemm_p_kn<MT, BQ>(dk_acc, dpt, qt, fl);
  }
  cp_async_wait_all();  // nothing in flight lands on the K/V tiles below

  // K and V tiles: each warp's own rows are free once its last gemm is done.
  const int valid = lk - w0;
  u16* dkb = static_cast<u16*>(dk) + b * dks.batch + hk * dks.head + w0 * dks.row;
  u16* dvb = static_cast<u16*>(dv) + b * dvs.batch + hk * dvs.head + w0 * dvs.row;
  store_tiles<MT>(dk_acc, pb.scale, k_tile, warp * WARP_KEYS, dkb, dks.row, valid, lane);
  store_tiles<MT>(dv_acc, 1.f, v_tile, warp * WARP_KEYS, dvb, dvs.row, valid, lane);
}

// dQ for DQ_BLOCK_M query rows of one (batch, head).
#endif  // TF_BWD_WGMMA

#if TF_BWD_WGMMA
// ------------------------------------------------------------------ dQ, warpgroup MMA
//
// sm_90a. A CTA owns 128 query rows of one (batch, head): two computing warpgroups of 64 rows
// whose Q and dO stay in shared memory, plus a producer warpgroup streaming the K/V tiles of
// the kv head (TMA, a ring of BWD_STAGES stages). Per key tile a computing warpgroup issues
// S = Q K^T and dP = dO V^T, forms dS = P (dP - delta) in registers, then dQ += dS K with dS
// as the register operand; dQ stays in fp32 registers and is written once. No atomics.
#define DQ_WG_ROWS TF_ATTN_DQ_WG_ROWS

extern "C" __global__ void __launch_bounds__(384, 1)
    attn_bwd_dq(const void* q, Strides qs, const void* k, Strides ks, const void* v, Strides vs,
                const void* dout, Strides dos, const float* lse, const float* delta, void* dq,
                Strides dqs, Problem pb, const __grid_constant__ TmaMap q_map,
                const __grid_constant__ TmaMap k_map, const __grid_constant__ TmaMap v_map,
                const __grid_constant__ TmaMap do_map) {
  const int heads = pb.heads, lq = pb.lq, lk = pb.lk, group = pb.group, causal = pb.causal;
  const float scale_log2 = pb.scale_log2;
  constexpr int BM = DQ_WG_ROWS, BN = TF_DQ_BLOCK_N, NS = BWD_STAGES;
  extern __shared__ __align__(1024) unsigned char smem_bytes[];
  u16* q_tile = reinterpret_cast<u16*>(smem_bytes + swizzle_pad(smem_bytes));
  u16* do_tile = q_tile + BM * HD;
  u16* k_ring = do_tile + BM * HD;       // [NS][BN * HD]
  u16* v_ring = k_ring + NS * BN * HD;   // [NS][BN * HD]
  const BwdRing ring{smem_addr(v_ring + NS * BN * HD)};  // resident: Q and dO

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wg_warp = warp & 3;
  const int g = lane >> 2, t = lane & 3;
  const GridTile cta = grid_tile(causal, true);
  const int mb = cta.tile, h = cta.head, b = cta.batch, hk = h / group;
  const int q0 = mb * BM;
  const int kv_end = causal ? min(lk, q0 + BM) : lk;
  const int tiles = (kv_end + BN - 1) / BN;

  if (tid == 0) ring.init(1);
  __syncthreads();

  if (wg == 2) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (wg_warp == 0 && lane == 0) {
      mbar_expect_bytes(ring.resident(), 2 * BM * HD * 2);
      tma_tile_pair<BM>(q_tile, q_map, do_tile, do_map, q0, h, b, ring.resident());
      for (int j = 0; j < tiles; ++j) {
        const int st = j % NS;
        ring.wait_free(j);
        mbar_expect_bytes(ring.full(st), 2 * BN * HD * 2);
        tma_tile_pair<BN>(k_ring + st * BN * HD, k_map, v_ring + st * BN * HD, v_map, j * BN, hk, b,
                          ring.full(st));
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");

  const int w0 = q0 + wg * 64;               // this warpgroup's first row
  const int r0 = w0 + 16 * wg_warp + g;      // this thread's rows: r0 and r0 + 8
  const tf_i64 row_base = (static_cast<tf_i64>(b) * heads + h) * lq;
  float lse2[2], dlt[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r0 + r * 8;
    lse2[r] = row < lq ? lse[row_base + row] * LOG2E : 0.f;
    dlt[r] = row < lq ? delta[row_base + row] : 0.f;
  }
  const u32 q_addr = smem_addr(q_tile) + wg * 64 * 128, do_addr = smem_addr(do_tile) + wg * 64 * 128;
  float dq_acc[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) dq_acc[i] = 0.f;
  float s_acc[BN / 2], dp_acc[BN / 2];
  u32 ds_frag[BN / 16][4];
  mbar_wait(ring.resident(), 0);

  for (int j = 0; j < tiles; ++j) {
    const int st = j % NS, n0 = j * BN;
    ring.wait_full(j);
    const u32 k_stage = smem_addr(k_ring + st * BN * HD);
    const u32 v_stage = smem_addr(v_ring + st * BN * HD);
    wg_gemm_hd_pair<BN>(s_acc, q_addr, k_stage, dp_acc, do_addr, v_stage, BM);
    const bool edge = n0 + BN > kv_end || (causal && n0 + BN - 1 > w0);
    auto gradient_of_scores = [&](bool mask) {
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          float p = fast_exp2(fmaf(s_acc[4 * i + e], scale_log2, -lse2[r]));
          const int col = n0 + 8 * i + 2 * t + (e & 1);
          if (mask && (col >= kv_end || (causal && col > r0 + r * 8))) p = 0.f;
          s_acc[4 * i + e] = p * (dp_acc[4 * i + e] - dlt[r]);
        }
      }
    };
    // Two copies: the tiles off the diagonal skip the per-element mask (see attn_fwd).
    if (edge) {
      gradient_of_scores(true);
    } else {
      gradient_of_scores(false);
    }
    pack_frags<BN>(s_acc, ds_frag);
    wg_fence();
    wg_gemm_rs<BN>(dq_acc, ds_frag, k_stage);
    wg_commit();
    wg_wait<0>();
    fence_regs(dq_acc);
    if (wg_warp == 0 && lane == 0) mbar_arrive(ring.empty(st));
  }

  // Both computing warpgroups are past their last read of Q: its tile stages the rows.
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  float out[HD / 8][4];
#pragma unroll
  for (int i = 0; i < HD / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) out[i][e] = dq_acc[4 * i + e];
  const int warp_row0 = w0 + 16 * wg_warp;
  u16* dqb = static_cast<u16*>(dq) + b * dqs.batch + h * dqs.head + warp_row0 * dqs.row;
  store_rows(out, pb.scale, q_tile, warp * 16, dqb, dqs.row, lq - warp_row0, lane);
}

#else

extern "C" __global__ void __launch_bounds__(TF_BWD_WARPS * 32, TF_BWD_MIN_BLOCKS)
    attn_bwd_dq(const void* q, Strides qs, const void* k, Strides ks, const void* v, Strides vs,
                const void* dout, Strides dos, const float* lse, const float* delta, void* dq,
                Strides dqs, Problem pb) {
  const int heads = pb.heads, lq = pb.lq, lk = pb.lk, group = pb.group, causal = pb.causal;
  const float scale_log2 = pb.scale_log2;
  constexpr int BM = DQ_BLOCK_M, BN = TF_DQ_BLOCK_N, THREADS = TF_BWD_WARPS * 32;
  constexpr int MT = BWD_MT, WARP_ROWS = 16 * MT;
  extern __shared__ __align__(128) u16 smem[];
  u16* q_tile = smem;                  // [BM][HD]
  u16* do_tile = q_tile + BM * HD;     // [BM][HD]
  u16* k_tile = do_tile + BM * HD;     // [2][BN][HD]
  u16* v_tile = k_tile + 2 * BN * HD;  // [2][BN][HD]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const Lane fl = lane_offsets(lane);
  const GridTile cta = grid_tile(causal, true);
  const int mb = cta.tile, h = cta.head, b = cta.batch, hk = h / group;
  const int q0 = mb * BM, w0 = q0 + warp * WARP_ROWS;

  load_tile<BM, THREADS>(q_tile, at(q, qs, b, h) + q0 * qs.row, qs.row, lq - q0, tid);
  load_tile<BM, THREADS>(do_tile, at(dout, dos, b, h) + q0 * dos.row, dos.row, lq - q0, tid);
  const int kv_end = causal ? min(lk, q0 + BM) : lk;
  const int tiles = (kv_end + BN - 1) / BN;
  const u16* kb = at(k, ks, b, hk);
  const u16* vb = at(v, vs, b, hk);
  issue_kv_tile<BN, THREADS>(k_tile, v_tile, 0, kb, ks.row, vb, vs.row, 0, kv_end, tid);

  const tf_i64 row_base = (static_cast<tf_i64>(b) * heads + h) * lq;
  float lse2[MT][2], dlt[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = w0 + 16 * mt + g + r * 8;
      lse2[mt][r] = row < lq ? lse[row_base + row] * LOG2E : 0.f;
      dlt[mt][r] = row < lq ? delta[row_base + row] : 0.f;
    }
  }
  float dq_acc[MT][HD / 8][4];
  zero(dq_acc);
  u32 qf[MT][HD / 16][4], dof[MT][HD / 16][4];

  auto load_q_do = [&]() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int kc = 0; kc < HD / 16; ++kc) {
        load_a(q_tile, warp * WARP_ROWS + 16 * mt, kc, fl, qf[mt][kc]);
        load_a(do_tile, warp * WARP_ROWS + 16 * mt, kc, fl, dof[mt][kc]);
      }
    }
  };
  for (int j = 0; j < tiles; ++j) {
    if (!begin_kv_tile<BN, THREADS>(j, tiles, k_tile, v_tile, kb, ks.row, vb, vs.row, kv_end, tid,
                                    causal, w0 + WARP_ROWS - 1, load_q_do))
      continue;
    const int n0 = j * BN;
    const u16* kt = k_tile + (j & 1) * BN * HD;
    const u16* vt = v_tile + (j & 1) * BN * HD;

    float s[MT][BN / 8][4], dp[MT][BN / 8][4];
    zero(s);
    zero(dp);
    gemm_a_regs_nk<MT, BN>(s, qf, kt, fl);
    gemm_a_regs_nk<MT, BN>(dp, dof, vt, fl);
    const bool edge = n0 + BN > kv_end || (causal && n0 + BN - 1 > w0);
    auto gradient_of_scores = [&](bool mask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            float p = fast_exp2(fmaf(s[mt][nt][e], scale_log2, -lse2[mt][r]));
            const int col = n0 + nt * 8 + 2 * t + (e & 1);
            if (mask && (col >= kv_end || (causal && col > w0 + 16 * mt + g + r * 8))) p = 0.f;
            s[mt][nt][e] = p * (dp[mt][nt][e] - dlt[mt][r]);
          }
        }
      }
    };
    // Two copies: the tiles off the diagonal skip the per-element mask (see the forward).
    if (edge) {
      gradient_of_scores(true);
    } else {
      gradient_of_scores(false);
    }
    gemm_p_kn<MT, BN>(dq_acc, s, kt, fl);
  }

  u16* dqb = static_cast<u16*>(dq) + b * dqs.batch + h * dqs.head + w0 * dqs.row;
  store_tiles<MT>(dq_acc, pb.scale, q_tile, warp * WARP_ROWS, dqb, dqs.row, lq - w0, lane);
}
#endif  // TF_BWD_WGMMA
