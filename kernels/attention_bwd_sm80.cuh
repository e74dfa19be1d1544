// Attention backward on sm_80 and later: dK/dV and dQ on mma.sync (TF_BWD_WGMMA = 0).
//
// Included by attention.cu (which states the design, the parameters and the helpers used here);
// not a translation unit of its own.

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
