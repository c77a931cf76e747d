// verify_attention: causal attention of Lq <= 16 new query rows (a verify block, or the plain step's
// single row) over a KV cache, for GQA/MHA heads of dimension D <= 128. One body for Metal and CUDA
// (metal/dialect.h); verify_attention.metal / .cu only include it.
//
// Row-count invariant by construction, so a row's output is bit-identical whether it is computed
// alone (plain decoding at its position) or among a verify block:
// * keys are split into CHUNK-key chunks at fixed absolute positions (never sized by Lq or L), each
//   chunk in TILE-key tiles, also at fixed positions; a row's running softmax over a chunk's tiles
//   and the combine over chunks run in a fixed order;
// * a key past a row's position (causal) or past the cache is skipped exactly: it adds +0 to the
//   sums and never enters a max, so extra trailing keys/chunks of a longer verify change nothing;
// * a row's dot products, exponentials and sums read only its own query.
// Pass 1 (attn_partial): block = (chunk, kv head, row group of ROWS query rows); each warp / SIMD
// group owns rows; lane j owns key j of a tile for the scores, lanes split D for the values.
// Pass 2 (attn_combine): one warp per query row merges its chunks' (max, sum, unnormalised out).
#pragma once

namespace dflash_attn {

// params: [H, Hk, Lq, n_row_groups] (static per call signature: made once); the cache length L and the
// head strides of the K/V buffers come from the inputs' shapes and strides (no per-call host data).
template <typename T, int D, int TILE, int TILES, int ROWS, int WARPS>
DF_FN void attn_partial(const DF_DEVICE T* q, const DF_DEVICE T* k, const DF_DEVICE T* v, const DF_DEVICE int* params,
                        const DF_DEVICE float* scale_p, DF_DEVICE float* part_o, DF_DEVICE float* part_ml,
                        DF_TG float* tq, DF_TG float* tk, DF_TG float* tv, int chunk, int hk, int rg, int warp, int lane,
                        int L, long kstride, long vstride) {
  const int H = params[0], Hk = params[1], Lq = params[2];
  const int n_chunks = (L + TILE * TILES - 1) / (TILE * TILES);
  const int G = H / Hk;
  const int R = G * Lq;                    // query rows of this kv head: r = gi * Lq + i
  const int tid = warp * 32 + lane;
  const float scale = scale_p[0];
  constexpr int DL = D / 32;               // value dims per lane (D multiple of 32)
  constexpr int KS = D + 1;                // padded key row in threadgroup memory (no bank conflicts)
  // this block's query rows, as float
  for (int e = tid; e < ROWS * D; e += WARPS * 32) {
    const int rr = e / D, d = e % D, r = rg * ROWS + rr;
    float val = 0.0f;
    if (r < R) {
      const int gi = r / Lq, i = r % Lq, h = hk * G + gi;
      val = df_f(q[((long)h * Lq + i) * D + d]);
    }
    tq[rr * D + d] = val;
  }
  float m_run[ROWS / WARPS], l_run[ROWS / WARPS], o_run[ROWS / WARPS][DL];
  for (int a = 0; a < ROWS / WARPS; ++a) {
    m_run[a] = -DF_INF;
    l_run[a] = 0.0f;
    for (int c = 0; c < DL; ++c) o_run[a][c] = 0.0f;
  }
  const int key0 = chunk * TILE * TILES;
  // the next tile's keys and values are loaded into registers while the current one is computed
  constexpr int PER = TILE * D / (WARPS * 32);  // elements of K (and of V) per thread per tile
  float rk[PER], rv[PER];
  for (int p = 0; p < PER; ++p) {
    const int e = tid + p * WARPS * 32, j = e / D, d = e % D, key = key0 + j;
    const bool in = key < L;
    rk[p] = in ? df_f(k[(long)hk * kstride + (long)key * D + d]) : 0.0f;
    rv[p] = in ? df_f(v[(long)hk * vstride + (long)key * D + d]) : 0.0f;
  }
  for (int tile = 0; tile < TILES; ++tile) {
    const int kb = key0 + tile * TILE;
    if (kb >= L) break;                    // uniform: the rest of the chunk is past the cache
    DF_BARRIER();
    for (int p = 0; p < PER; ++p) {
      const int e = tid + p * WARPS * 32, j = e / D, d = e % D;
      tk[j * KS + d] = rk[p];
      tv[j * D + d] = rv[p];
    }
    DF_BARRIER();
    const int nb = kb + TILE;
    if (tile + 1 < TILES && nb < L) {
      for (int p = 0; p < PER; ++p) {
        const int e = tid + p * WARPS * 32, j = e / D, d = e % D, key = nb + j;
        const bool in = key < L;
        rk[p] = in ? df_f(k[(long)hk * kstride + (long)key * D + d]) : 0.0f;
        rv[p] = in ? df_f(v[(long)hk * vstride + (long)key * D + d]) : 0.0f;
      }
    }
    for (int a = 0; a < ROWS / WARPS; ++a) {
      const int rr = a * WARPS + warp, r = rg * ROWS + rr;
      if (r >= R) continue;
      const int pos = L - Lq + (r % Lq);   // absolute position of this query row
      const int key = kb + lane;
      float s = -DF_INF;
      if (lane < TILE && key <= pos && key < L) {
        float acc = 0.0f;
        for (int d = 0; d < D; ++d) acc += tq[rr * D + d] * tk[lane * KS + d];
        s = acc * scale;
      }
      float mt = s;
      for (int off = 16; off > 0; off >>= 1) mt = df_max(mt, DF_SHFL_XOR(mt, off));
      if (mt == -DF_INF) continue;         // no key of this tile is visible to the row
      const float m_new = df_max(m_run[a], mt);
      const float alpha = m_run[a] == -DF_INF ? 0.0f : df_exp(m_run[a] - m_new);
      const float p = s == -DF_INF ? 0.0f : df_exp(s - m_new);
      float ps = p;
      for (int off = 16; off > 0; off >>= 1) ps += DF_SHFL_XOR(ps, off);
      l_run[a] = l_run[a] * alpha + ps;
      for (int c = 0; c < DL; ++c) o_run[a][c] *= alpha;
      for (int j = 0; j < TILE; ++j) {
        const float pj = DF_SHFL(p, j);
        for (int c = 0; c < DL; ++c) o_run[a][c] += pj * tv[j * D + lane + 32 * c];
      }
      m_run[a] = m_new;
    }
  }
  for (int a = 0; a < ROWS / WARPS; ++a) {
    const int rr = a * WARPS + warp, r = rg * ROWS + rr;
    if (r >= R) continue;
    const long row = (long)hk * R + r;     // rows ordered (kv head, group member, query index)
    const long base = row * n_chunks + chunk;
    for (int c = 0; c < DL; ++c) part_o[base * D + lane + 32 * c] = o_run[a][c];
    if (lane == 0) {
      part_ml[base * 2] = m_run[a];
      part_ml[base * 2 + 1] = l_run[a];
    }
  }
}

template <typename T, int D>
DF_FN void attn_combine(const DF_DEVICE float* part_o, const DF_DEVICE float* part_ml, const DF_DEVICE int* params,
                        DF_DEVICE T* out, int row, int lane, int n_chunks) {
  const int H = params[0], Hk = params[1], Lq = params[2];
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
  for (int e = 0; e < DL; ++e) out[((long)h * Lq + i) * D + lane + 32 * e] = df_cast<T>(o[e] / l);
}

}  // namespace dflash_attn
