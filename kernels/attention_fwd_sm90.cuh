// Attention forward on sm_90a: warpgroup MMA (wgmma), TMA loads by a producer warpgroup, ping-pong and the persistent grid (TF_FWD_WGMMA = 1).
//
// Included by attention.cu (which states the design, the parameters and the helpers used here);
// not a translation unit of its own.

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

