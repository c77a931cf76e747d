// qk_norm_rope: the attention's per-head work between the fused q/k/v projection and the cache, in one launch:
// from y = [q | k | v] (one row per token, [L, (H + 2 Hk) * D], what the fused projection writes), every query and
// key head's RMS norm (q_norm / k_norm, when the layer has them) and RoPE at its token's position, and the
// heads laid out for the cache and the attention: q [H, L, D], k and v [Hk, L, D]. One body for Metal and CUDA
// (metal/dialect.h); qk_norm_rope.metal / .cu only include it.
//
// Replaces, per layer and forward, two RMS norms, two RoPE launches and (for L > 1) the copies that made the
// strided head slices contiguous: ~6 of a routed layer's ~21 launches (session 20's H200 trace), a host cost
// (MLX encodes every launch on the calling thread) and a GPU cost (each a latency-bound ~2-5 us kernel).
//
// One warp per (token row, head); lane owns dims lane + 32 c. Row-count invariant: a (row, head) reads only its
// own inputs and its position (positions come as an int array, one per row, a view of a persistent table).
// RoPE is mlx's non-traditional form (mx.fast.rope): pairs (i, i + D/2), theta = pos * 2^(-(i / (D/2)) * log2(base)),
// in float; D a multiple of 64 so a pair sits in one lane. The norm follows MLX's rms_norm: w * T(x * rsqrt(mean(x^2)
// + eps)), the sum of squares in float over a fixed warp tree.
#pragma once

namespace dflash_qkr {

// params: [H, Hk, L, has_norm]; fparams: [eps, log2(base)]
template <typename T, int D>
DF_FN void qk_norm_rope(const DF_DEVICE T* y, const DF_DEVICE T* qw, const DF_DEVICE T* kw, const DF_DEVICE int* pos,
                        const DF_DEVICE int* params, const DF_DEVICE float* fparams, DF_DEVICE T* qo, DF_DEVICE T* ko,
                        DF_DEVICE T* vo, int gw, int lane) {
  constexpr int DL = D / 32, HALF = DL / 2;
  static_assert(D % 64 == 0, "qk_norm_rope: D a multiple of 64");
  const int H = params[0], Hk = params[1], L = params[2], has_norm = params[3];
  const int NH = H + 2 * Hk;
  if (gw >= L * NH) return;               // whole warps: the grid is rounded up to them
  const int row = gw / NH, h = gw % NH;
  const DF_DEVICE T* src = y + (long)row * NH * D + (long)h * D;
  if (h >= H + Hk) {                      // a value head: laid out [Hk, L, D]
    DF_DEVICE T* dst = vo + ((long)(h - H - Hk) * L + row) * D;
    for (int c = 0; c < DL; ++c) dst[lane + 32 * c] = src[lane + 32 * c];
    return;
  }
  const bool isq = h < H;
  float x[DL];
  for (int c = 0; c < DL; ++c) x[c] = df_f(src[lane + 32 * c]);
  if (has_norm) {
    float ss = 0.0f;
    for (int c = 0; c < DL; ++c) ss += x[c] * x[c];
    for (int off = 16; off > 0; off >>= 1) ss += DF_SHFL_XOR(ss, off);
    const float r = df_rsqrt(ss / float(D) + fparams[0]);
    const DF_DEVICE T* w = isq ? qw : kw;
    for (int c = 0; c < DL; ++c) x[c] = df_f(df_cast<T>(df_f(w[lane + 32 * c]) * df_f(df_cast<T>(x[c] * r))));
  }
  const float p = float(pos[row]);
  const float lbase = fparams[1];
  for (int c = 0; c < HALF; ++c) {
    const int i = lane + 32 * c;
    const float theta = p * df_exp2(-(float(i) / float(D / 2)) * lbase);
    const float cs = df_cos(theta), sn = df_sin(theta);
    const float a = x[c], b = x[c + HALF];
    x[c] = a * cs - b * sn;
    x[c + HALF] = a * sn + b * cs;
  }
  DF_DEVICE T* dst = isq ? qo + ((long)h * L + row) * D : ko + ((long)(h - H) * L + row) * D;
  for (int c = 0; c < DL; ++c) dst[lane + 32 * c] = df_cast<T>(x[c]);
}

}  // namespace dflash_qkr
