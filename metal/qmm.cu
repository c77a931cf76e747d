// dflash_qmm: small-M affine quantized matmul  y[m, n] = sum_k x[m, k] * (s[n, g] * q[n, k] + b[n, g])
// for M <= 16 rows (verify widths 1..16). CUDA twin of metal/qmm.metal (the bodies differ: this one
// feeds Hopper/Ampere tensor cores through mma.sync m16n8k16, the Metal one 8x8 simdgroup matrices).
//
// Exact operands, fp32 accumulation: the codes (4-bit nibbles; 8-bit as a low and a x16 high nibble
// plane) are exact in bf16 and the activations are split into NA exact bf16 terms (bf16 1, fp16 2,
// fp32 3), so every product is exact; per group C_g = sum_k x q on the tensor cores, then
// y += s * C_g + b * sum_k x in fp32 (the group's affine map factored out).
// Row-count invariant: rows past M are zeros and a row's arithmetic never reads another row; the
// split-K reduction over a block's warps runs in a fixed order.
//
// Fragment mapping (PTX ISA, mma.m16n8k16 .bf16): lane = 4 * gr + t. A: reg0 = (row gr, k 2t, 2t+1),
// reg1 = (row gr+8, same k), reg2 = (row gr, k 2t+8, 2t+9), reg3 = (row gr+8, same); B: reg0 =
// (k 2t, 2t+1; col gr), reg1 = (k 2t+8, 2t+9; col gr); C: c0, c1 = (row gr, cols 2t, 2t+1), c2, c3 =
// (row gr+8). The sum over k is order-free, so logical k maps to physical k so that each lane reads
// its own contiguous slice of a weight row: per group lane t owns k in [t*GS/4, (t+1)*GS/4) and
// - 4-bit, word q of the slice (8 nibbles), MMA h = 0, 1: logical (2t, 2t+1, 2t+8, 2t+9) <- nibbles
//   (2h, 2h+4, 2h+1, 2h+5);
// - 8-bit, word q (4 bytes): logical (2t, 2t+1, 2t+8, 2t+9) <- bytes (0, 2, 1, 3), once per plane.

namespace dflash_qmm {

typedef unsigned int u32;

__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<u32*>(&v);
}

// Nibble pair (bits [s, s+4) and [s+16, s+20) of w) as two exact bf16 values, times 16 for PLANE 1.
template <int PLANE>
__device__ __forceinline__ u32 nibble_pair(u32 w, int s) {
  const u32 magic = PLANE == 0 ? 0x43004300u : 0x45004500u;  // 128 (ulp 1) or 2048 (ulp 16)
  u32 v = ((w >> s) & 0x000F000Fu) | magic;
  __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&v), *reinterpret_cast<const __nv_bfloat162*>(&magic));
  return *reinterpret_cast<u32*>(&r);
}

template <typename T> struct Act;
template <> struct Act<__nv_bfloat16> {
  static constexpr int NA = 1, PER_WORD = 2;
  __device__ static float get(const u32* wd, int i) {
    u32 v = (i & 1) ? (wd[i >> 1] & 0xFFFF0000u) : (wd[i >> 1] << 16);
    return __uint_as_float(v);
  }
  __device__ static __nv_bfloat16 out(float v) { return __float2bfloat16(v); }
};
template <> struct Act<__half> {
  static constexpr int NA = 2, PER_WORD = 2;
  __device__ static float get(const u32* wd, int i) {
    unsigned short b = (i & 1) ? (unsigned short)(wd[i >> 1] >> 16) : (unsigned short)(wd[i >> 1] & 0xFFFFu);
    return __half2float(__ushort_as_half(b));
  }
  __device__ static __half out(float v) { return __float2half(v); }
};
template <> struct Act<float> {
  static constexpr int NA = 3, PER_WORD = 1;
  __device__ static float get(const u32* wd, int i) { return __uint_as_float(wd[i]); }
  __device__ static float out(float v) { return v; }
};

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// The NA-term exact bf16 split of v: term e of the split (the last term takes the remainder).
template <int NA>
__device__ __forceinline__ float term(float v, int e) {
  float r = v;
  for (int i = 0; i < e; ++i) r -= __bfloat162float(__float2bfloat16_rn(r));
  return (e == NA - 1) ? r : __bfloat162float(__float2bfloat16_rn(r));
}

// A fragment (term e) of one MMA: positions p0..p3 of the lane's slice, rows gr (xa) and gr+8 (xb).
template <typename T>
__device__ __forceinline__ void a_frag(u32* a, const u32* xa, const u32* xb, int p0, int p1, int p2, int p3, int e) {
  constexpr int NA = Act<T>::NA;
  a[0] = pack_bf16(term<NA>(Act<T>::get(xa, p0), e), term<NA>(Act<T>::get(xa, p1), e));
  a[1] = pack_bf16(term<NA>(Act<T>::get(xb, p0), e), term<NA>(Act<T>::get(xb, p1), e));
  a[2] = pack_bf16(term<NA>(Act<T>::get(xa, p2), e), term<NA>(Act<T>::get(xa, p3), e));
  a[3] = pack_bf16(term<NA>(Act<T>::get(xb, p2), e), term<NA>(Act<T>::get(xb, p3), e));
}

// bf16 activations: the A registers are byte permutations of the loaded words (no conversion).
template <>
__device__ __forceinline__ void a_frag<__nv_bfloat16>(u32* a, const u32* xa, const u32* xb, int p0, int p1, int p2,
                                                     int p3, int e) {
  // p1 = p0 + d (d = 4 or 2), p2 = p0 + 1, p3 = p1 + 1, p0 even: words p0/2 and p1/2
  const int w0 = p0 >> 1, w1 = p1 >> 1;
  a[0] = __byte_perm(xa[w0], xa[w1], 0x5410);
  a[1] = __byte_perm(xb[w0], xb[w1], 0x5410);
  a[2] = __byte_perm(xa[w0], xa[w1], 0x7632);
  a[3] = __byte_perm(xb[w0], xb[w1], 0x7632);
}

// Loads of one group for one lane: weight words of NT rows and activation words of rows gr, gr+8.
template <typename T, int BITS, int GS, int NT>
struct Stage {
  static constexpr int KL = GS / 4;                      // k per lane per group
  static constexpr int WPL = KL * BITS / 32;             // weight words per lane per group
  static constexpr int XW = KL / Act<T>::PER_WORD;       // activation words per row per lane per group
  u32 w[NT][WPL];
  u32 xa[XW], xb[XW];
  float sc[NT][2], bi[NT][2];  // scale and bias of this lane's two C-fragment columns per tile

  __device__ __forceinline__ void load(const T* __restrict__ x, const u32* __restrict__ w_,
                                       const T* __restrict__ scales, const T* __restrict__ biases, int M, int N,
                                       int K, int n_base, int g, int gr, int t, bool live) {
    const int k0 = g * GS + t * KL;
    const int wrow = K * BITS / 32;
    const int G = K / GS;
    // the epilogue's scales and biases are loaded with the weights (one latency for both)
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int n = n_base + 8 * j + 2 * t + c;
        const bool ok = live && n < N;
        sc[j][c] = ok ? to_f<T>(scales[(size_t)n * G + g]) : 0.f;
        bi[j][c] = ok ? to_f<T>(biases[(size_t)n * G + g]) : 0.f;
      }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int n = n_base + 8 * j + gr;
      const u32* src = w_ + (size_t)n * wrow + (size_t)k0 * BITS / 32;
      const bool ok = live && n < N;
      if (WPL % 4 == 0) {
#pragma unroll
        for (int q = 0; q < WPL; q += 4) {
          uint4 v = ok ? __ldg(reinterpret_cast<const uint4*>(src + q)) : make_uint4(0, 0, 0, 0);
          w[j][q] = v.x; w[j][q + 1] = v.y; w[j][q + 2] = v.z; w[j][q + 3] = v.w;
        }
      } else if (WPL == 2) {
        uint2 v = ok ? __ldg(reinterpret_cast<const uint2*>(src)) : make_uint2(0, 0);
        w[j][0] = v.x; w[j][1] = v.y;
      } else {
#pragma unroll
        for (int q = 0; q < WPL; ++q) w[j][q] = ok ? __ldg(src + q) : 0u;
      }
    }
    const u32* xr0 = reinterpret_cast<const u32*>(x + (size_t)gr * K + k0);
    const u32* xr1 = reinterpret_cast<const u32*>(x + (size_t)(gr + 8) * K + k0);
    const bool ok0 = live && gr < M, ok1 = live && gr + 8 < M;
#pragma unroll
    for (int q = 0; q < XW; q += 4) {
      uint4 a = ok0 ? __ldg(reinterpret_cast<const uint4*>(xr0 + q)) : make_uint4(0, 0, 0, 0);
      uint4 b = ok1 ? __ldg(reinterpret_cast<const uint4*>(xr1 + q)) : make_uint4(0, 0, 0, 0);
      xa[q] = a.x; xa[q + 1] = a.y; xa[q + 2] = a.z; xa[q + 3] = a.w;
      xb[q] = b.x; xb[q + 1] = b.y; xb[q + 2] = b.z; xb[q + 3] = b.w;
    }
  }
};

// Tensor-core work and epilogue of one loaded group.
template <typename T, int BITS, int GS, int NT>
__device__ __forceinline__ void compute(const Stage<T, BITS, GS, NT>& st, float (&acc)[NT][4]) {
  typedef Stage<T, BITS, GS, NT> S;
  constexpr int NA = Act<T>::NA;
  // sum of x over the group (rows gr, gr+8): the lane's slice in order, then lanes t by xor 1, 2
  float xs0 = 0.f, xs1 = 0.f;
#pragma unroll
  for (int i = 0; i < S::KL; ++i) {
    xs0 += Act<T>::get(st.xa, i);
    xs1 += Act<T>::get(st.xb, i);
  }
  xs0 += __shfl_xor_sync(0xffffffffu, xs0, 1);
  xs1 += __shfl_xor_sync(0xffffffffu, xs1, 1);
  xs0 += __shfl_xor_sync(0xffffffffu, xs0, 2);
  xs1 += __shfl_xor_sync(0xffffffffu, xs1, 2);
  float cg[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) cg[j][0] = cg[j][1] = cg[j][2] = cg[j][3] = 0.f;
  constexpr int MMAS = BITS == 4 ? 2 * S::WPL : S::WPL;
#pragma unroll
  for (int u = 0; u < MMAS; ++u) {
    const int q = BITS == 4 ? (u >> 1) : u;
    const int h = BITS == 4 ? (u & 1) : 0;
    const int p0 = BITS == 4 ? 8 * q + 2 * h : 4 * q;
    const int p1 = p0 + (BITS == 4 ? 4 : 2);
#pragma unroll
    for (int e = 0; e < NA; ++e) {
      u32 a[4];
      a_frag<T>(a, st.xa, st.xb, p0, p1, p0 + 1, p1 + 1, e);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const u32 wq = st.w[j][q];
        if (BITS == 4) {
          mma16816(cg[j], a, nibble_pair<0>(wq, 8 * h), nibble_pair<0>(wq, 8 * h + 4));
        } else {
          mma16816(cg[j], a, nibble_pair<0>(wq, 0), nibble_pair<0>(wq, 8));
          mma16816(cg[j], a, nibble_pair<1>(wq, 4), nibble_pair<1>(wq, 12));
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const float s0 = st.sc[j][0], s1 = st.sc[j][1], b0 = st.bi[j][0], b1 = st.bi[j][1];
    acc[j][0] += s0 * cg[j][0] + b0 * xs0;
    acc[j][1] += s1 * cg[j][1] + b1 * xs0;
    acc[j][2] += s0 * cg[j][2] + b0 * xs1;
    acc[j][3] += s1 * cg[j][3] + b1 * xs1;
  }
}

// One block: NT n-tiles (8 * NT output columns) over all of K, split over WARPS warps; each warp
// walks its groups U at a time (all U groups' loads issued before their math).
// RES: y = x W^T + res, the residual added to the fp32 sum before the one rounding (the layer's residual add: no add
// launch after the matmul; per element: a row still reads only its own inputs).
template <typename T, int BITS, int GS, int NT, int WARPS, int U, int RES>
__device__ __forceinline__ void qmm_block(const T* __restrict__ x, const u32* __restrict__ w,
                                          const T* __restrict__ scales, const T* __restrict__ biases,
                                          const T* __restrict__ res, const int* __restrict__ params,
                                          T* __restrict__ y, float (*part)[NT * 4][32]) {
  const int M = params[0], N = params[1], K = params[2];
  const int G = K / GS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gr = lane >> 2, t = lane & 3;
  const int n_base = blockIdx.x * (8 * NT);
  const int per = (G + WARPS - 1) / WARPS;
  const int g0 = min(G, warp * per), g1 = min(G, g0 + per);
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  for (int g = g0; g < g1; g += U) {
    Stage<T, BITS, GS, NT> st[U];
#pragma unroll
    for (int u = 0; u < U; ++u) st[u].load(x, w, scales, biases, M, N, K, n_base, g + u, gr, t, g + u < g1);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (g + u < g1) compute<T, BITS, GS, NT>(st[u], acc);
  }
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) part[warp][j * 4 + c][lane] = acc[j][c];
  __syncthreads();
  for (int i = threadIdx.x; i < NT * 4 * 32; i += WARPS * 32) {
    const int slot = i >> 5, l = i & 31, j = slot >> 2, c = slot & 3;
    float v = 0.f;
    for (int q = 0; q < WARPS; ++q) v += part[q][slot][l];
    const int row = (l >> 2) + (c >= 2 ? 8 : 0);
    const int col = n_base + 8 * j + 2 * (l & 3) + (c & 1);
    if (row < M && col < N) y[(size_t)row * N + col] = Act<T>::out(RES ? v + to_f<T>(res[(size_t)row * N + col]) : v);
  }
}

}  // namespace dflash_qmm
