// 16-lane fp32 helpers shared by the CPU kernels (paged_decode.cpp, paged_prefill.cpp, elementwise.cpp): a
// Cephes-style exp for x <= 0 (scalar and 16 lanes), a prefetch, the GCC vector types v16/v16i with their
// loads and stores, and horizontal sums and max. All inline in an anonymous namespace: each kernel file
// compiles its own copy.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-5 polynomial, 2^n by exponent bits).
// Relative error ~1e-7; exp16 below is the same on 16 lanes.
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  float fx = x * 1.44269504088896341f + 0.5f;
  float fl = static_cast<float>(static_cast<int32_t>(fx));
  fl = fl > fx ? fl - 1.0f : fl;  // floor
  float r = x - fl * 0.693359375f + fl * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(fl) + 127) << 23;
  return y * __builtin_bit_cast(float, bits);
}

// Prefetch n floats from p (one cache line per 16).
inline void prefetch(const float* p, int64_t n) {
  for (int64_t d = 0; d < n; d += 16) __builtin_prefetch(p + d);
}

// 16 floats as one GCC vector-extension value (native on AVX-512; two halves on AVX2).
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// exp_nonpos on any GCC float vector V (VI: its int32 twin); lanes below -87 (incl. -inf padding) give 0.
template <typename V, typename VI>
inline V exp_lanes(V x) {
  const V lo = x < -87.0f ? (V){} + 1.0f : (V){};
  x = x < -87.0f ? (V){} - 87.0f : x;
  V fx = x * 1.44269504088896341f + 0.5f;
  VI fi = __builtin_convertvector(fx, VI);
  V fl = __builtin_convertvector(fi, V);
  fl = fl > fx ? fl - 1.0f : fl;
  V r = x - fl * 0.693359375f + fl * 2.12194440e-4f;
  V y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  VI bits = (__builtin_convertvector(fl, VI) + 127) << 23;
  y = y * (V)bits;
  return lo > 0.5f ? (V){} : y;
}

// 8 floats: one AVX2 register. Without AVX-512, GCC lowers the 16-lane exp badly (silu_mul over 16 x 1408 took
// 103 us where the same code on 8 lanes took 14, AMD EPYC with AVX2, 2026-11-29), so exp16 runs as two halves.
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

// The native vector: one register, 16 lanes on AVX-512, else 8 (code that does not need 16 lanes uses it).
#if defined(__AVX512F__)
typedef v16 vnat;
typedef v16i vnati;
#else
typedef v8 vnat;
typedef v8i vnati;
#endif
constexpr int64_t NAT_LANES = sizeof(vnat) / sizeof(float);
inline vnat load_nat(const float* p) { vnat v; std::memcpy(&v, p, sizeof v); return v; }
inline void store_nat(float* p, vnat v) { std::memcpy(p, &v, sizeof v); }

inline v16 exp16(v16 x) {  // exp_nonpos on 16 lanes
#if defined(__AVX512F__)
  return exp_lanes<v16, v16i>(x);
#else
  v8 lo, hi;
  std::memcpy(&lo, &x, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof lo, sizeof hi);
  lo = exp_lanes<v8, v8i>(lo);
  hi = exp_lanes<v8, v8i>(hi);
  std::memcpy(&x, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&x) + sizeof lo, &hi, sizeof hi);
  return x;
#endif
}

// [sum(a), sum(b), sum(c), sum(d)] in lanes 0, 4, 8, 12.
inline v16 hsum4(v16 a, v16 b, v16 c, v16 d) {
  v16 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
         + __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  v16 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
         + __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  v16 e = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
        + __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  e = e + __builtin_shufflevector(e, e, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return e + __builtin_shufflevector(e, e, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
}

inline float hmax16(v16 x) {  // max over the 16 lanes, by halving
  v16 y = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x = x > y ? x : y;
  y = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x = x > y ? x : y;
  y = __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x = x > y ? x : y;
  y = __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return std::max(x[0], y[0]);
}

inline float hsum16(v16 x) {  // sum over the 16 lanes, by halving
  x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return x[0] + x[1];
}

}  // namespace
