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
// slower there: B8 H16 S1024 D128). src/ops/attention.rs launches the same order.
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

// The call's sizes and softmax constants (`Problem` in src/ops/attention.rs). `group` = query heads
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
#include "attention_fwd_sm90.cuh"
#else
#include "attention_fwd_sm80.cuh"
#endif

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

// dK, dV for BWD_BLOCK_K keys of one (batch, kv head), then dQ. lse and delta are [B, H, Lq]
// fp32.
#if TF_BWD_WGMMA
#include "attention_bwd_sm90.cuh"
#else
#include "attention_bwd_sm80.cuh"
#endif
