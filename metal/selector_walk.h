// selector_walk: DFlash2's candidate-selector greedy walk (spec §5.5) for M blocks in one launch:
// the T sequential steps over the top-K candidates of each slot, each step scoring slot t's K
// candidates given the token chosen at slot t-1 (the anchor for t = 0) and taking the argmax:
//   S_t(a, b) = U_t(b) + sum_r A[a, r] * (Bc[cand_t(b), r] * H_t[r])
// (A = predecessor codebook, Bc = successor codebook, H_t = the hidden projection of slot t).
// One body for Metal and CUDA (metal/dialect.h); selector_walk.metal / .cu only include it.
//
// The choice equals the MLX reference's (mlx_dflash2/kernels/selector_walk.py: lattice_scores, then
// argmax per step) token for token, because every score is the same float32 number:
// * products rounded as the reference rounds them: s = Bc * H first, then A * s (df_mul_rn);
// * the sum over r in the reference's fixed tree (tree_sum): r padded with zeros to P = 2^p, then
//   halving levels x[i] + x[i + n/2]. Lane l holds x[l + 32 j]: the levels with n > 32 are the lane's
//   own y[j] + y[j + NJ/2], ..., the last five are the xor butterfly 16, 8, 4, 2, 1 (x[i] + x[i^off]
//   equals x[i] + x[i + off] for i < off: float addition is commutative). Every add is df_add_rn;
// * U + pair in float32, then the argmax of MLX: the first index of the maximum; NaN counts as the
//   maximum (the first NaN wins), a row of -inf gives index 0.
// Block = one walk (block m), K warps / SIMD groups: warp b scores candidate b; thread 0 takes the
// argmax and publishes the chosen token in threadgroup memory for the next step.
#pragma once

namespace dflash_sel {

// params: [M, T, K]; cand, unary [M, T, K]; hproj [M, T, R]; pred, succ [V, R]; anchor [M]; tokens [M, T].
// P: the power of two >= R (the tree's width).
template <typename TC, int R, int P>
DF_FN void selector_walk(const DF_DEVICE int* cand, const DF_DEVICE float* unary, const DF_DEVICE float* hproj,
                         const DF_DEVICE TC* pred, const DF_DEVICE TC* succ, const DF_DEVICE int* anchor,
                         const DF_DEVICE int* params, DF_DEVICE int* tokens, DF_TG float* sc, DF_TG int* prev,
                         int m, int warp, int lane) {
  constexpr int NJ = P > 32 ? P / 32 : 1;  // tree leaves per lane
  constexpr int W = P < 32 ? P : 32;       // lanes in the butterfly
  const int T = params[1], K = params[2];
  if (warp == 0 && lane == 0) prev[0] = anchor[m];
  DF_BARRIER();
  for (int t = 0; t < T; ++t) {
    const long mt = (long)m * T + t;
    const int a = prev[0];
    if (warp < K) {
      const int c = cand[mt * K + warp];
      float y[NJ];
      for (int j = 0; j < NJ; ++j) {
        const int r = lane + 32 * j;
        float v = 0.0f;
        if (r < R) {
          const float s = df_mul_rn(df_f(succ[(long)c * R + r]), hproj[mt * R + r]);
          v = df_mul_rn(df_f(pred[(long)a * R + r]), s);
        }
        y[j] = v;
      }
      for (int h = NJ / 2; h > 0; h >>= 1)
        for (int j = 0; j < h; ++j) y[j] = df_add_rn(y[j], y[j + h]);
      float acc = y[0];
      for (int off = W / 2; off > 0; off >>= 1) {
        const float other = DF_SHFL_XOR(acc, off);
        acc = df_add_rn(acc, other);
      }
      if (lane == 0) sc[warp] = df_add_rn(unary[mt * K + warp], acc);
    }
    DF_BARRIER();
    if (warp == 0 && lane == 0) {
      int best = 0;
      float bv = sc[0];
      for (int b = 1; b < K; ++b) {
        const float v = sc[b];
        if (v > bv || (df_isnan(v) && !df_isnan(bv))) {
          bv = v;
          best = b;
        }
      }
      const int tok = cand[mt * K + best];
      tokens[mt] = tok;
      prev[0] = tok;
    }
    DF_BARRIER();
  }
}

}  // namespace dflash_sel
