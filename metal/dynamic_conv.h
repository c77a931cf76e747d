// dynamic_conv: DFlash2's grouped dynamic causal convolution (spec §5.4), one side applied to a block:
//   y[n, t, c] = sum_{k < min(K, B)} T(TC(base[side, k, c] + delta[n, t, side, k, c / gs])) * x[n, t - k, c]
// with x[n, t - k] = 0 before the block start. One body for Metal and CUDA (metal/dialect.h);
// dynamic_conv.metal / .cu only include it. One thread per output element: K (two) taps, no reduction.
//
// The arithmetic is the MLX reference's (GroupedDynamicCausalConv.apply, mlx_dflash2/kernels/dynamic_conv.py),
// step by step: the coefficient in TC (the promoted type of base and delta), cast to x's type T, the
// product and the running sum of the taps rounded to T after each operation, taps added in order
// k = 0, 1, ..., and a tap that reads before the block start multiplies a zero (not skipped: 0 * c
// and its sign flow into the sum as in the reference). With T = TC = float every step is one
// df_mul_rn / df_add_rn, so the result equals the reference bit for bit; in half types each step is
// computed in float and rounded to T (the numerics gate's tolerance covers half-precision rounding).
#pragma once

namespace dflash_dconv {

// params: [N, B, D, K, G, group_size, side]
template <typename T, typename TD, typename TB, typename TC>
DF_FN void dynamic_conv(const DF_DEVICE T* x, const DF_DEVICE TD* delta, const DF_DEVICE TB* base,
                        const DF_DEVICE int* params, DF_DEVICE T* out, int e) {
  const int N = params[0], B = params[1], D = params[2], K = params[3], G = params[4], gs = params[5];
  const int side = params[6];
  if (e >= N * B * D) return;
  const int c = e % D, t = (e / D) % B, n = e / (D * B), g = c / gs;
  const int taps = df_min(K, B);
  float acc = 0.0f;
  for (int k = 0; k < taps; ++k) {
    const float b = df_f(base[(side * K + k) * D + c]);
    const float d = df_f(delta[((((long)n * B + t) * 2 + side) * K + k) * G + g]);
    const float coef = df_f(df_cast<T>(df_f(df_cast<TC>(df_add_rn(b, d)))));
    const float xv = t >= k ? df_f(x[((long)n * B + t - k) * D + c]) : 0.0f;
    const float term = df_f(df_cast<T>(df_mul_rn(coef, xv)));
    acc = k == 0 ? term : df_f(df_cast<T>(df_add_rn(acc, term)));
  }
  out[e] = df_cast<T>(acc);
}

}  // namespace dflash_dconv
