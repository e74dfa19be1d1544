// Attention backward on sm_90a: dK/dV and dQ on warpgroup MMA fed by TMA (TF_BWD_WGMMA = 1).
//
// Included by attention.cu (which states the design, the parameters and the helpers used here);
// not a translation unit of its own.

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

