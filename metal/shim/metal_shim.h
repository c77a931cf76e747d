// metal_shim.h: just enough of the Metal Shading Language, as plain C++17, to syntax- and
// type-check this project's Metal kernel sources on machines without a Metal compiler
// (mlx_dflash2.kernels.check; tests/test_kernel_sources.py). It is not an emulator: functions do
// nothing useful. On a Mac, `mlx_dflash2.selftest` compiles and runs the real thing.
#pragma once
#include <cmath>
#include <cstdint>

#define device
#define threadgroup
#define thread
#define constant
#define kernel
#define INFINITY_F (1.0f / 0.0f)

typedef unsigned int uint;
typedef unsigned short ushort;
struct uint3 { uint x, y, z; };
struct half { half() {} half(float) {} operator float() const { return 0.f; } };
struct bfloat16_t { bfloat16_t() {} bfloat16_t(float) {} operator float() const { return 0.f; } };
typedef bfloat16_t bfloat;

namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
inline void threadgroup_barrier(mem_flags) {}
inline void simdgroup_barrier(mem_flags) {}
template <typename T> T simd_shuffle_xor(T v, ushort) { return v; }
template <typename T> T simd_shuffle(T v, ushort) { return v; }
template <typename T> T simd_sum(T v) { return v; }
template <typename T> T simd_max(T v) { return v; }
template <typename T> T max(T a, T b) { return a > b ? a : b; }
template <typename T> T min(T a, T b) { return a < b ? a : b; }
inline float exp(float v) { return std::exp(v); }
inline bool isnan(float v) { return std::isnan(v); }
namespace precise {
inline float exp(float v) { return std::exp(v); }
inline float exp2(float v) { return std::exp2(v); }
inline float rsqrt(float v) { return 1.0f / std::sqrt(v); }
inline float cos(float v) { return std::cos(v); }
inline float sin(float v) { return std::sin(v); }
}
template <typename T, int N> struct vec {
  T v[N];
  T& operator[](int i) { return v[i]; }
  const T& operator[](int i) const { return v[i]; }
};
template <typename T, int R, int C> struct simdgroup_matrix {
  vec<T, 2> e;
  simdgroup_matrix() {}
  explicit simdgroup_matrix(T) {}
  vec<T, 2>& thread_elements() { return e; }
  const vec<T, 2>& thread_elements() const { return e; }
};
template <typename T, int R, int C> simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T) { return {}; }
template <typename T, int R, int C>
void simdgroup_multiply_accumulate(simdgroup_matrix<T, R, C>& d, const simdgroup_matrix<T, R, C>&,
                                   const simdgroup_matrix<T, R, C>&, const simdgroup_matrix<T, R, C>&) {}
}  // namespace metal
#ifndef INFINITY
#define INFINITY INFINITY_F
#endif
