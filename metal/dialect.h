// dialect.h: the few macros that let one kernel body compile as Metal (mx.fast.metal_kernel) and as
// CUDA (mx.fast.cuda_kernel, NVRTC). Shared bodies (verify_attention.h, qk_norm_rope.h, dynamic_conv.h,
// selector_walk.h, greedy_accept.h, gated_delta_steps.h) use only these: functions, address spaces, barriers, 32-wide
// SIMD-group / warp shuffles (float and int), a SIMD-group barrier over threadgroup memory (DF_SIMD_TG_SYNC: a warp's
// own scratch written by some lanes and read by others), a full-unroll hint for constant-trip loops (DF_UNROLL: a
// small array indexed by the loop stays in registers), float conversions, NaN tests, and df_add_rn / df_mul_rn.
//
// df_add_rn / df_mul_rn: one IEEE single-precision add / multiply, rounded once, never fused with a
// neighbour into an FMA. Bodies whose results must equal an MLX reference bit for bit (the selector's
// pair scores, the fp32 dynamic convolution) use them. CUDA: __fadd_rn / __fmul_rn (NVRTC fuses a
// plain a * b + c by default, --fmad=true, even across statements). Metal has no such intrinsic: plain
// operators, relying on MLX building custom kernels with fast math off (mlx/backend/metal/device.cpp,
// build_library_: setFastMathEnabled(false)); the bodies also keep every multiply and add in a statement
// of its own (a clang-based compiler without fast math fuses only inside one expression). Not
// verifiable off a Mac: the numerics gate checks the compiled kernel there. CPU emulation: plain
// operators (baseline x86-64 has no FMA instructions; the emulator builds without -ffast-math).
// The op's Python code prepends this text to the body's text (MLX's `header`), so no include paths.
#pragma once

#if defined(__CUDACC__)
// ---- CUDA (NVRTC; MLX's default header already includes cuda_bf16.h / cuda_fp16.h) ----
#define DF_FN __device__ __forceinline__
#define DF_DEVICE
#define DF_TG
#define DF_TG_DECL __shared__
#define DF_BARRIER() __syncthreads()
#define DF_SIMD_SYNC() __syncwarp()
#define DF_SIMD_TG_SYNC() __syncwarp()
#define DF_UNROLL _Pragma("unroll")
#define DF_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#define DF_SHFL(v, l) __shfl_sync(0xffffffffu, (v), (l))
#define DF_INF __int_as_float(0x7f800000)
typedef unsigned int df_uint;
DF_FN float df_f(float v) { return v; }
DF_FN float df_f(__half v) { return __half2float(v); }
DF_FN float df_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> DF_FN T df_cast(float v);
template <> DF_FN float df_cast<float>(float v) { return v; }
template <> DF_FN __half df_cast<__half>(float v) { return __float2half(v); }
template <> DF_FN __nv_bfloat16 df_cast<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
DF_FN float df_exp(float v) { return expf(v); }
DF_FN float df_exp2(float v) { return exp2f(v); }
DF_FN float df_rsqrt(float v) { return rsqrtf(v); }
DF_FN float df_cos(float v) { return cosf(v); }
DF_FN float df_sin(float v) { return sinf(v); }
DF_FN float df_max(float a, float b) { return fmaxf(a, b); }
DF_FN int df_min(int a, int b) { return a < b ? a : b; }
DF_FN bool df_isnan(float v) { return isnan(v); }
DF_FN float df_add_rn(float a, float b) { return __fadd_rn(a, b); }
DF_FN float df_mul_rn(float a, float b) { return __fmul_rn(a, b); }
#elif defined(DF_CPU_EMU)
// ---- CPU emulation (tests only: mlx_dflash2.kernels.emulate runs a shared body with one std::thread
// per GPU thread, so its logic is tested where no GPU exists) ----
#include <barrier>
#include <cmath>
#include <cstring>
struct df_ctx {
  int lane;
  float* xch;                 // the warp's exchange slots (32)
  std::barrier<>* warp_bar;   // the warp's 32 threads
  std::barrier<>* block_bar;  // the block's threads
};
inline thread_local df_ctx* df_tls = nullptr;
inline float df_shfl_idx(float v, int src) {
  df_tls->xch[df_tls->lane] = v;
  df_tls->warp_bar->arrive_and_wait();
  float r = df_tls->xch[src & 31];
  df_tls->warp_bar->arrive_and_wait();
  return r;
}
inline int df_shfl_idx(int v, int src) {  // an int through the same slots, bit for bit
  float f;
  std::memcpy(&f, &v, 4);
  f = df_shfl_idx(f, src);
  std::memcpy(&v, &f, 4);
  return v;
}
#define DF_FN inline
#define DF_DEVICE
#define DF_TG
#define DF_TG_DECL
#define DF_BARRIER() df_tls->block_bar->arrive_and_wait()
#define DF_SIMD_SYNC() df_tls->warp_bar->arrive_and_wait()
#define DF_SIMD_TG_SYNC() df_tls->warp_bar->arrive_and_wait()
#define DF_UNROLL
#define DF_SHFL_XOR(v, m) df_shfl_idx((v), df_tls->lane ^ (m))
#define DF_SHFL(v, l) df_shfl_idx((v), (l))
#define DF_INF INFINITY
typedef unsigned int df_uint;
DF_FN float df_f(float v) { return v; }
template <typename T> DF_FN T df_cast(float v) { return T(v); }
DF_FN float df_exp(float v) { return std::exp(v); }
DF_FN float df_exp2(float v) { return std::exp2(v); }
DF_FN float df_rsqrt(float v) { return 1.0f / std::sqrt(v); }
DF_FN float df_cos(float v) { return std::cos(v); }
DF_FN float df_sin(float v) { return std::sin(v); }
DF_FN float df_max(float a, float b) { return std::fmax(a, b); }
DF_FN int df_min(int a, int b) { return a < b ? a : b; }
DF_FN bool df_isnan(float v) { return std::isnan(v); }
DF_FN float df_add_rn(float a, float b) { return a + b; }
DF_FN float df_mul_rn(float a, float b) { return a * b; }
#else
// ---- Metal ----
#include <metal_stdlib>
using namespace metal;
#define DF_FN inline
#define DF_DEVICE device
#define DF_TG threadgroup
#define DF_TG_DECL threadgroup
#define DF_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define DF_SIMD_SYNC() simdgroup_barrier(mem_flags::mem_none)
#define DF_SIMD_TG_SYNC() simdgroup_barrier(mem_flags::mem_threadgroup)
#define DF_UNROLL _Pragma("clang loop unroll(full)")
#define DF_SHFL_XOR(v, m) simd_shuffle_xor((v), ushort(m))
#define DF_SHFL(v, l) simd_shuffle((v), ushort(l))
#define DF_INF INFINITY
typedef uint df_uint;
template <typename T> DF_FN float df_f(T v) { return float(v); }
template <typename T> DF_FN T df_cast(float v) { return T(v); }
DF_FN float df_exp(float v) { return metal::precise::exp(v); }
DF_FN float df_exp2(float v) { return metal::precise::exp2(v); }
DF_FN float df_rsqrt(float v) { return metal::precise::rsqrt(v); }
DF_FN float df_cos(float v) { return metal::precise::cos(v); }
DF_FN float df_sin(float v) { return metal::precise::sin(v); }
DF_FN float df_max(float a, float b) { return metal::max(a, b); }
DF_FN int df_min(int a, int b) { return metal::min(a, b); }
DF_FN bool df_isnan(float v) { return metal::isnan(v); }
DF_FN float df_add_rn(float a, float b) { return a + b; }
DF_FN float df_mul_rn(float a, float b) { return a * b; }
#endif
