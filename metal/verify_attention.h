// verify_attention: causal attention of Lq <= 16 new query rows (a verify block, or the plain step's
// single row) over a KV cache, for GQA/MHA heads of dimension D <= 256. One body for Metal and CUDA
// (metal/dialect.h); verify_attention.metal / .cu only include it.
//
// Row-count invariant by construction, so a row's output is bit-identical whether it is computed
// alone (plain decoding at its position) or among a verify block:
// * keys are split into CHUNK-key chunks at fixed absolute positions (never sized by Lq or L), each
//   chunk in TILES tiles of TILE = 32 keys, also at fixed positions; a row's softmax over a tile, the
//   merge of a chunk's tiles and the combine over chunks run in a fixed order;
// * a key past a row's position (causal) or past the cache is skipped exactly: it adds +0 to the
//   sums and never enters a max, so extra trailing keys/chunks of a longer verify change nothing;
// * a row's dot products, exponentials and sums read only its own query (the launch geometry, e.g.
//   ROWS, may differ with the number of rows: no row's arithmetic depends on it).
// Pass 1 (attn_partial): block = (chunk, kv head, row group of ROWS query rows). Its WARPS warps are
// TILES x RW: warp w takes tile w % TILES of the chunk for the RPW = ROWS / RW rows of subgroup w / TILES,
// all of them at once (every key read from threadgroup memory feeds RPW independent dot products;
// session 20's H200 trace: the earlier body, one row at a time over the chunk's tiles in turn, took
// 99.6 us per call at 16 rows against ~20 us of MLX's attention). Scores: lane j owns key j of the tile,
// its key row staged KD dims at a time in the warp's own threadgroup scratch (padded: no bank
// conflicts); values: lanes split D and read V straight from the cache (coalesced). Then the block
// merges its TILES tiles per row (fixed order) and writes the chunk's (max, sum, unnormalised out).
// Pass 2 (attn_combine): one warp per query row merges its chunks' (max, sum, unnormalised out).
#pragma once

namespace dflash_attn {

// TILE = 32 keys per tile (one per lane for the scores), a constant of each function: Metal allows no program-scope
// variable outside the `constant` address space, constexpr ones included.

// params: [H, Hk, Lq, n_row_groups, rows_layout] (static per call signature: made once); the cache length L and the
// head strides of the K/V buffers come from the inputs' shapes and strides (no per-call host data).
// Threadgroup memory: tq[ROWS * D] (the block's queries, float) and scr[SCR] floats, SCR >= both the warps' key
// sub-tiles (WARPS * 32 * (KD + 1)) and the merge's tile results (TILES * ROWS * (D + 2)), which reuse it.
template <typename T, int D, int TILES, int ROWS, int WARPS, int KD, int SCR, int VB, int PF>
DF_FN void attn_partial(const DF_DEVICE T* q, const DF_DEVICE T* k, const DF_DEVICE T* v, const DF_DEVICE int* params,
                        const DF_DEVICE float* scale_p, DF_DEVICE float* part_o, DF_DEVICE float* part_ml,
                        DF_TG float* tq, DF_TG float* scr, int chunk, int hk, int rg, int warp, int lane,
                        int L, long kstride, long vstride) {
  constexpr int TILE = 32;                 // keys per tile
  constexpr int RW = WARPS / TILES;        // row subgroups
  constexpr int RPW = ROWS / RW;           // rows per warp
  constexpr int DL = D / 32;               // value dims per lane
  constexpr int KS = KD + 1;               // padded key row of a sub-tile
  static_assert(WARPS % TILES == 0 && ROWS % RW == 0 && D % KD == 0 && D % 32 == 0 && TILE % VB == 0,
                "verify_attention geometry");
  static_assert(SCR >= WARPS * 32 * KS && SCR >= TILES * ROWS * (D + 2), "verify_attention scratch");
  const int H = params[0], Hk = params[1], Lq = params[2];
  const int n_chunks = (L + TILE * TILES - 1) / (TILE * TILES);
  const int G = H / Hk;
  const int R = G * Lq;                    // query rows of this kv head: r = gi * Lq + i
  const int tid = warp * 32 + lane;
  const float scale = scale_p[0];
  for (int e = tid; e < ROWS * D; e += WARPS * 32) {
    const int rr = e / D, d = e % D, r = rg * ROWS + rr;
    float val = 0.0f;
    if (r < R) {
      const int gi = r / Lq, i = r % Lq, h = hk * G + gi;
      val = df_f(q[((long)h * Lq + i) * D + d]);
    }
    tq[rr * D + d] = val;
  }
  DF_BARRIER();
  const int t = warp % TILES, sg = warp / TILES;
  const int kb = chunk * TILE * TILES + t * TILE;  // the tile's first key
  const int nk = df_min(TILE, L - kb);              // its keys in the cache (<= 0: none; warp-uniform)
  // scores: two accumulators per row (even / odd dims), summed once: a fixed order
  float acc0[RPW], acc1[RPW];
  for (int a = 0; a < RPW; ++a) acc0[a] = acc1[a] = 0.0f;
  if (nk > 0) {
    DF_TG float* ks = scr + warp * 32 * KS;
    const DF_DEVICE T* kt = k + (long)hk * kstride + (long)kb * D;
    // the lane's share of a sub-tile: element e = lane + 32 i is key e / KD, dim e % KD (coalesced rows). PF = 1:
    // the next sub-tile's loads are issued before this one's dot products (their latency hidden behind them)
    float kr[KD];
    DF_UNROLL for (int i = 0; i < KD; ++i) {
      const int e = lane + 32 * i, j = e / KD, dd = e % KD;
      kr[i] = j < nk ? df_f(kt[(long)j * D + dd]) : 0.0f;
    }
    for (int d0 = 0; d0 < D; d0 += KD) {
      DF_UNROLL for (int i = 0; i < KD; ++i) {
        const int e = lane + 32 * i;
        ks[(e / KD) * KS + e % KD] = kr[i];
      }
      DF_SIMD_TG_SYNC();
      if (PF && d0 + KD < D) {
        DF_UNROLL for (int i = 0; i < KD; ++i) {
          const int e = lane + 32 * i, j = e / KD, dd = e % KD;
          kr[i] = j < nk ? df_f(kt[(long)j * D + d0 + KD + dd]) : 0.0f;
        }
      }
      for (int dd = 0; dd < KD; dd += 2) {
        const float k0 = ks[lane * KS + dd], k1 = ks[lane * KS + dd + 1];
        for (int a = 0; a < RPW; ++a) {
          const DF_TG float* qa = tq + (sg * RPW + a) * D + d0 + dd;
          acc0[a] += qa[0] * k0;
          acc1[a] += qa[1] * k1;
        }
      }
      DF_SIMD_TG_SYNC();
      if (!PF && d0 + KD < D) {
        DF_UNROLL for (int i = 0; i < KD; ++i) {
          const int e = lane + 32 * i, j = e / KD, dd = e % KD;
          kr[i] = j < nk ? df_f(kt[(long)j * D + d0 + KD + dd]) : 0.0f;
        }
      }
    }
  }
  float p[RPW], m[RPW], l[RPW];
  for (int a = 0; a < RPW; ++a) {
    const int r = rg * ROWS + sg * RPW + a;
    const int pos = L - Lq + (r % Lq);   // absolute position of this query row (r < R)
    const int key = kb + lane;
    const float s = (r < R && lane < nk && key <= pos) ? (acc0[a] + acc1[a]) * scale : -DF_INF;
    float mt = s;
    for (int off = 16; off > 0; off >>= 1) mt = df_max(mt, DF_SHFL_XOR(mt, off));
    p[a] = s == -DF_INF ? 0.0f : df_exp(s - mt);
    float ps = p[a];
    for (int off = 16; off > 0; off >>= 1) ps += DF_SHFL_XOR(ps, off);
    m[a] = mt;
    l[a] = ps;
  }
  // values: lane owns dims lane + 32 c; a masked key's p is 0 (its value is a cache row: finite)
  float o[RPW][DL];
  for (int a = 0; a < RPW; ++a)
    for (int c = 0; c < DL; ++c) o[a][c] = 0.0f;
  // VB keys' value rows loaded at once (one memory latency per VB keys, not per key); the sums run key by key as
  // before, over the tile's keys in the cache only (the same additions whatever VB)
  const DF_DEVICE T* vt = v + (long)hk * vstride + (long)kb * D + lane;
  for (int j0 = 0; j0 < nk; j0 += VB) {
    float vv[VB][DL];
    DF_UNROLL for (int jj = 0; jj < VB; ++jj) {
      const bool in = j0 + jj < nk;
      DF_UNROLL for (int c = 0; c < DL; ++c) vv[jj][c] = in ? df_f(vt[(long)(j0 + jj) * D + 32 * c]) : 0.0f;
    }
    DF_UNROLL for (int jj = 0; jj < VB; ++jj) {
      if (j0 + jj < nk) {                  // warp-uniform
        for (int a = 0; a < RPW; ++a) {
          const float pj = DF_SHFL(p[a], j0 + jj);
          for (int c = 0; c < DL; ++c) o[a][c] += pj * vv[jj][c];
        }
      }
    }
  }
  // merge the chunk's tiles per row, in tile order (the scratch now holds every tile's results)
  DF_BARRIER();
  DF_TG float* mo = scr;                          // [TILES][ROWS][D]
  DF_TG float* mml = scr + TILES * ROWS * D;      // [TILES][ROWS][2]
  for (int a = 0; a < RPW; ++a) {
    const int rr = sg * RPW + a;
    for (int c = 0; c < DL; ++c) mo[(t * ROWS + rr) * D + lane + 32 * c] = o[a][c];
    if (lane == 0) {
      mml[(t * ROWS + rr) * 2] = m[a];
      mml[(t * ROWS + rr) * 2 + 1] = l[a];
    }
  }
  DF_BARRIER();
  for (int rr = warp; rr < ROWS; rr += WARPS) {
    const int r = rg * ROWS + rr;
    if (r >= R) continue;
    float mx = -DF_INF;
    for (int tt = 0; tt < TILES; ++tt) mx = df_max(mx, mml[(tt * ROWS + rr) * 2]);
    float ls = 0.0f, os[DL];
    for (int c = 0; c < DL; ++c) os[c] = 0.0f;
    for (int tt = 0; tt < TILES; ++tt) {
      const float mt = mml[(tt * ROWS + rr) * 2];
      if (mt == -DF_INF) continue;         // a tile with no visible key adds nothing (exactly)
      const float w = df_exp(mt - mx);
      ls += w * mml[(tt * ROWS + rr) * 2 + 1];
      for (int c = 0; c < DL; ++c) os[c] += w * mo[(tt * ROWS + rr) * D + lane + 32 * c];
    }
    const long row = (long)hk * R + r;     // rows ordered (kv head, group member, query index)
    const long base = row * n_chunks + chunk;
    for (int c = 0; c < DL; ++c) part_o[base * D + lane + 32 * c] = os[c];
    if (lane == 0) {
      part_ml[base * 2] = mx;
      part_ml[base * 2 + 1] = ls;
    }
  }
}

template <typename T, int D>
DF_FN void attn_combine(const DF_DEVICE float* part_o, const DF_DEVICE float* part_ml, const DF_DEVICE int* params,
                        DF_DEVICE T* out, int row, int lane, int n_chunks) {
  const int H = params[0], Hk = params[1], Lq = params[2], rows_layout = params[4];
  const int G = H / Hk, R = G * Lq;
  if (row >= Hk * R) return;
  constexpr int DL = D / 32;
  float m = -DF_INF;
  for (int c = 0; c < n_chunks; ++c) m = df_max(m, part_ml[((long)row * n_chunks + c) * 2]);
  float l = 0.0f, o[DL];
  for (int e = 0; e < DL; ++e) o[e] = 0.0f;
  for (int c = 0; c < n_chunks; ++c) {
    const long base = (long)row * n_chunks + c;
    const float mc = part_ml[base * 2];
    if (mc == -DF_INF) continue;           // an empty chunk adds nothing (exactly)
    const float w = df_exp(mc - m);
    l += w * part_ml[base * 2 + 1];
    for (int e = 0; e < DL; ++e) o[e] += w * part_o[base * D + lane + 32 * e];
  }
  const int hk = row / R, r = row % R, gi = r / Lq, i = r % Lq, h = hk * G + gi;
  // [H, Lq, D], or [Lq, H, D] (rows_layout: o_proj's input, no transpose copy after the kernel)
  const long ob = rows_layout ? ((long)i * H + h) * D : ((long)h * Lq + i) * D;
  for (int e = 0; e < DL; ++e) out[ob + lane + 32 * e] = df_cast<T>(o[e] / l);
}

}  // namespace dflash_attn
