// dflash_qmm: small-M affine quantized matmul y[m, n] = sum_k x[m, k] * (s[n, g] * q[n, k] + b[n, g])
// for M <= 16 rows (verify widths 1..16). Metal twin of metal/qmm.cu. The bodies differ because the
// matrix units do: CUDA feeds mma.sync m16n8k16 fragments, Apple GPUs 8x8 simdgroup matrices; the
// arithmetic contract is the same (exact codes and activations in fp32 matrices, per-group affine
// map factored out: y += s * sum_k x q + b * sum_k x; fixed-order split-K reduction; row-count
// invariant: rows past M are zeros and a row never reads another row).
//
// Layout (as mlx-dspark's skinny qmm): the weights are the A operand. One simdgroup computes
// C[n, m] = W[n, k] . X^T[k, m] for NT tiles of 8 weight rows and 2 tiles of 8 activation rows, over
// its share of K (each lane loads its own packed word, no threadgroup staging in the K loop); the S
// simdgroups of a threadgroup split K and are summed in threadgroup memory in a fixed order.
// An 8x8 simdgroup matrix gives lane l the elements (fm, fn) and (fm, fn + 1) with
// qid = l / 4, fm = (qid & 4) + (l / 2) % 4, fn = (qid & 2) * 2 + (l % 2) * 2.

#include <metal_stdlib>
#include <metal_simdgroup>
#include <metal_simdgroup_matrix>
using namespace metal;

namespace dflash_qmm {

// code of weight row `row` at k (4 or 8 bits, LSB-first packing as mx.quantize)
template <int BITS>
inline float code(const device uint* w, uint wrow, uint row, uint k) {
  const uint word = w[row * wrow + k * BITS / 32];
  return float((word >> ((k % (32 / BITS)) * BITS)) & ((1u << BITS) - 1u));
}

// RES: y = x W^T + res, the residual added to the fp32 sum before the one rounding (the layer's residual add: no add
// launch after the matmul; per element: a row still reads only its own inputs).
template <typename T, int BITS, int GS, int NT, int S, int RES>
inline void qmm_block(const device T* x, const device uint* w, const device T* scales, const device T* biases,
                      const device T* res, const device int* params, device T* y, threadgroup float* part,
                      uint tg, uint sg, uint lane) {
  const int M = params[0], N = params[1], K = params[2];
  const int G = K / GS;
  const uint wrow = uint(K) * BITS / 32;
  const int n_base = int(tg) * 8 * NT;
  const int per = (G + S - 1) / S;
  const int g0 = min(G, int(sg) * per), g1 = min(G, g0 + per);
  const ushort qid = lane / 4;
  const ushort fm = (qid & 4) + (lane / 2) % 4;
  const ushort fn = (qid & 2) * 2 + (lane % 2) * 2;

  simdgroup_matrix<float, 8, 8> acc[NT][2];
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < 2; ++r) acc[j][r] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (int g = g0; g < g1; ++g) {
    simdgroup_matrix<float, 8, 8> cg[NT][2];
    for (int j = 0; j < NT; ++j)
      for (int r = 0; r < 2; ++r) cg[j][r] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int c = 0; c < GS; c += 8) {
      const int k = g * GS + c;
      // B = X^T tile: (row fm = k offset, cols fn, fn + 1 = activation rows), zeros past M
      simdgroup_matrix<float, 8, 8> b[2];
      for (int r = 0; r < 2; ++r) {
        const int m = 8 * r + fn;
        b[r].thread_elements()[0] = m < M ? float(x[m * K + k + fm]) : 0.0f;
        b[r].thread_elements()[1] = m + 1 < M ? float(x[(m + 1) * K + k + fm]) : 0.0f;
      }
      for (int j = 0; j < NT; ++j) {
        const int n = n_base + 8 * j + fm;
        simdgroup_matrix<float, 8, 8> a;
        a.thread_elements()[0] = n < N ? code<BITS>(w, wrow, uint(n), uint(k + fn)) : 0.0f;
        a.thread_elements()[1] = n < N ? code<BITS>(w, wrow, uint(n), uint(k + fn + 1)) : 0.0f;
        for (int r = 0; r < 2; ++r) simdgroup_multiply_accumulate(cg[j][r], a, b[r], cg[j][r]);
      }
    }
    // sum of x over the group for rows 0..15 (zeros past M): lane l sums half (l / 16) of row l % 16,
    // the halves are added by a shuffle; then each lane fetches the rows of its elements
    float xh = 0.0f;
    {
      const int m = int(lane % 16), h = int(lane / 16);
      if (m < M)
        for (int kk = 0; kk < GS / 2; ++kk) xh += float(x[m * K + g * GS + h * (GS / 2) + kk]);
      xh += simd_shuffle_xor(xh, ushort(16));
    }
    // epilogue: element (fm, fn + e) of tile (j, r) is output (m = 8r + fn + e, n = n_base + 8j + fm)
    for (int j = 0; j < NT; ++j) {
      const int n = n_base + 8 * j + fm;
      const float s = n < N ? float(scales[n * G + g]) : 0.0f;
      const float bb = n < N ? float(biases[n * G + g]) : 0.0f;
      for (int r = 0; r < 2; ++r)
        for (int e = 0; e < 2; ++e) {
          const int m = 8 * r + fn + e;
          const float xs = simd_shuffle(xh, ushort(m));
          acc[j][r].thread_elements()[e] += s * cg[j][r].thread_elements()[e] + bb * xs;
        }
    }
  }
  // fixed-order split-K reduction over the S simdgroups
  for (int j = 0; j < NT; ++j)
    for (int r = 0; r < 2; ++r)
      for (int e = 0; e < 2; ++e) part[((sg * NT + j) * 2 + r) * 64 + lane * 2 + e] = acc[j][r].thread_elements()[e];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint tid = sg * 32 + lane;
  for (uint i = tid; i < uint(NT * 2 * 64); i += S * 32) {
    float v = 0.0f;
    for (int q = 0; q < S; ++q) v += part[q * NT * 2 * 64 + i];
    const uint j = i / 128, r = (i / 64) % 2, l = (i % 64) / 2, e = i % 2;
    const uint lq = l / 4;
    const int row_n = n_base + 8 * int(j) + int((lq & 4) + (l / 2) % 4);
    const int col_m = 8 * int(r) + int((lq & 2) * 2 + (l % 2) * 2 + e);
    if (col_m < M && row_n < N) y[col_m * N + row_n] = T(RES ? v + float(res[col_m * N + row_n]) : v);
  }
}

}  // namespace dflash_qmm
