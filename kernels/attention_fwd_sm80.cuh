// Attention forward on sm_80 and later: mma.sync, ldmatrix and cp.async (TF_FWD_WGMMA = 0).
//
// Included by attention.cu (which states the design, the parameters and the helpers used here);
// not a translation unit of its own.

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

