// greedy_accept: greedy verification of a draft (DFlash2 spec §2.3) in two small launches, so the
// round's one host read gets (num_accepted, tokens) with no further ops:
// * row_argmax: tokens[i] = argmax(logits[i]) for the n + 1 verify rows, one threadgroup / block of
//   TPB threads per row (V up to ~152K: each thread scans a strided, coalesced share of the row, then
//   a warp butterfly and one warp over the warps' winners);
// * accept: num = the length of the longest prefix with draft[i] == tokens[i] (one thread; n <= 64).
// One body for Metal and CUDA (metal/dialect.h); greedy_accept.metal / .cu only include it.
//
// The argmax is MLX's (mx.argmax, the MLX reference GreedyVerifier used): the first index of the
// maximum; NaN counts as the maximum (the first NaN wins); a row of -inf gives index 0. Comparisons
// only: the tokens equal the reference's exactly, in every dtype.
#pragma once

namespace dflash_acc {

// whether (ov, oi) beats (bv, bi) in MLX's argmax order; index -1: no element
DF_FN bool takes(float bv, int bi, float ov, int oi) {
  if (oi < 0) return false;
  if (bi < 0) return true;
  const bool on = df_isnan(ov), bn = df_isnan(bv);
  if (on != bn) return on;
  if (on || ov == bv) return oi < bi;
  return ov > bv;
}

// params: [V, n]; logits [n + 1, V]; tokens [n + 1]
template <typename T, int TPB>
DF_FN void row_argmax(const DF_DEVICE T* logits, const DF_DEVICE int* params, DF_DEVICE int* tokens,
                      DF_TG float* wv, DF_TG int* wi, int row, int warp, int lane) {
  const int V = params[0];
  const DF_DEVICE T* x = logits + (long)row * V;
  const int tid = warp * 32 + lane;
  float bv = 0.0f;
  int bi = -1;
  if (tid < V) {
    bv = df_f(x[tid]);
    bi = tid;
  }
  for (int i = tid + TPB; i < V; i += TPB) {  // increasing indices: strictly greater keeps the first
    const float v = df_f(x[i]);
    if (v > bv || (df_isnan(v) && !df_isnan(bv))) {
      bv = v;
      bi = i;
    }
  }
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = DF_SHFL_XOR(bv, off);
    const int oi = DF_SHFL_XOR(bi, off);
    if (takes(bv, bi, ov, oi)) {
      bv = ov;
      bi = oi;
    }
  }
  if (lane == 0) {
    wv[warp] = bv;
    wi[warp] = bi;
  }
  DF_BARRIER();
  if (warp == 0) {
    bv = lane < TPB / 32 ? wv[lane] : 0.0f;
    bi = lane < TPB / 32 ? wi[lane] : -1;
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = DF_SHFL_XOR(bv, off);
      const int oi = DF_SHFL_XOR(bi, off);
      if (takes(bv, bi, ov, oi)) {
        bv = ov;
        bi = oi;
      }
    }
    if (lane == 0) tokens[row] = bi;
  }
}

// params: [V, n]; draft [max(n, 1)]; num [1]
DF_FN void accept(const DF_DEVICE int* tokens, const DF_DEVICE int* draft, const DF_DEVICE int* params,
                  DF_DEVICE int* num, int tid) {
  if (tid != 0) return;
  const int n = params[1];
  int a = 0;
  while (a < n && draft[a] == tokens[a]) ++a;
  num[0] = a;
}

}  // namespace dflash_acc
