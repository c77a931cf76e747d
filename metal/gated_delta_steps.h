// gated_delta_steps: the gated delta rule (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks:
// Improving Mamba2 with Delta Rule"; the recurrence of mlx-lm's mlx_lm/models/gated_delta.py,
// _gated_delta_step_ops) over a block of S steps that also writes the recurrent state after EVERY
// step, so that a speculative round can keep the state after any accepted prefix. Per step t, for
// each value head hv (key head hk = hv / (Hv / Hk), mlx-lm's head repeat) and value row dv:
//   s      = g[t] * s                         (s: the row's Dk floats of the state [Hv, Dv, Dk])
//   kv     = sum_j s[j] * k[t, j]
//   delta  = (v[t, dv] - kv) * beta[t]
//   s      = s + k[t] * delta
//   y[t]   = T(sum_j s[j] * q[t, j]);  states[t] = s
// ALL = 0 (the prefill's variant, op gated_delta_final) writes only the state after the last step, to
// states[B, 1, Hv, Dv, DK]: a prompt chunk of thousands of rows needs no per-step states, and MLX's
// CUDA backend has no fused kernel for mlx-lm's recurrence (its Python loop of small ops per step ran a
// 27B hybrid's prefill at ~36 tok/s on the H200).
// One body for Metal and CUDA (metal/dialect.h); gated_delta_steps.metal / .cu only include it.
//
// Layout as mlx-lm's generic kernel: one 32-wide SIMD-group / warp per (b, hv, dv) row, each lane
// holding DK / 32 state floats in registers (lane-strided: element j = i * 32 + lane, so the loads of
// q and k and the per-step state stores are coalesced), the two sums as a xor butterfly (every lane
// gets the same total, so delta is the same on all lanes). The grid's rows past Dv (padding to whole
// threadgroups) return as whole warps before any shuffle. No threadgroup memory, no barriers.
// Arithmetic in float32 (inputs converted exactly); the sums' order differs from MLX's reductions, so
// the results equal the reference within float tolerance, not bit for bit (the numerics gate's job).
#pragma once

namespace dflash_gdn {

DF_FN float warp_sum(float x) {
  for (int m = 16; m > 0; m >>= 1) x += DF_SHFL_XOR(x, m);
  return x;
}

// params: [B, S, Hk, Hv, Dv]; q, k [B, S, Hk, DK]; v, y [B, S, Hv, Dv]; g, beta float [B, S, Hv];
// state_in float [B, Hv, Dv, DK]; states float [B, S, Hv, Dv, DK] (ALL) or [B, 1, Hv, Dv, DK] (not ALL).
// n = b * Hv + hv.
template <typename T, int DK, int ALL>
DF_FN void gated_delta_steps(const DF_DEVICE T* q, const DF_DEVICE T* k, const DF_DEVICE T* v,
                             const DF_DEVICE float* g, const DF_DEVICE float* beta,
                             const DF_DEVICE float* state_in, const DF_DEVICE int* params, DF_DEVICE T* y,
                             DF_DEVICE float* states, int n, int dv, int lane) {
  constexpr int PER = DK / 32;
  const int B = params[0], S = params[1], Hk = params[2], Hv = params[3], Dv = params[4];
  if (n >= B * Hv || dv >= Dv) return;  // a whole warp: lanes share n and dv
  const int b = n / Hv, hv = n % Hv, hk = hv / (Hv / Hk);
  float st[PER];
  const DF_DEVICE float* s0 = state_in + ((long)n * Dv + dv) * DK;
  for (int i = 0; i < PER; ++i) st[i] = s0[i * 32 + lane];
  for (int t = 0; t < S; ++t) {
    const long bt = (long)b * S + t;
    const long row = bt * Hv + hv;  // [b, t, hv]
    const DF_DEVICE T* qt = q + (bt * Hk + hk) * DK;
    const DF_DEVICE T* kt = k + (bt * Hk + hk) * DK;
    const float gt = g[row], bt_ = beta[row];
    const float vt = df_f(v[row * Dv + dv]);
    float kr[PER];
    float kv = 0.0f;
    for (int i = 0; i < PER; ++i) {
      kr[i] = df_f(kt[i * 32 + lane]);
      st[i] = st[i] * gt;
      kv += st[i] * kr[i];
    }
    kv = warp_sum(kv);
    const float delta = (vt - kv) * bt_;
    float o = 0.0f;
    DF_DEVICE float* so = states + ((ALL ? row : (long)n) * Dv + dv) * DK;
    const bool keep = ALL || t == S - 1;
    for (int i = 0; i < PER; ++i) {
      st[i] = st[i] + kr[i] * delta;
      o += st[i] * df_f(qt[i * 32 + lane]);
      if (keep) so[i * 32 + lane] = st[i];
    }
    o = warp_sum(o);
    if (lane == 0) y[row * Dv + dv] = df_cast<T>(o);
  }
}

}  // namespace dflash_gdn
