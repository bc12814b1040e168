// Float arithmetic the CPU kernels share: bfloat16 conversions that vectorize, and a vectorized exponential.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace pagedserve_cpu_math {

// bfloat16 from float and back as plain integer arithmetic (so that loops over a row vectorize), rounded as
// c10::BFloat16 rounds: to the nearest even, a NaN kept a NaN.
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

inline float bf16_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return bf16_float(x.x); }

template <typename T>
inline T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return c10::BFloat16(bf16_bits(x), c10::BFloat16::from_bits());
  }
}

// A value as transformers would have it stored in a tensor of T: a no-op for float.
template <typename T>
inline float stored(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return bf16_float(bf16_bits(x));
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight values of a row in float32 lanes: to_float, eight at a time.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif

// e^x of eight floats (exp8), and of n floats in place (n a multiple of 8 where AVX2 is built in). x = k ln2 + r
// with |r| <= ln2 / 2: e^r from its Taylor series up to r^7 (the rest is under 1e-8 of it), scaled by 2^k
// through the exponent bits; within a float's rounding of std::exp, as torch's own vectorized exp is.
constexpr int64_t kExpWidth = 8;
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp8(__m256 given) {
  const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  // ln2 in two parts: the first has few bits, so k times it is exact.
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  const float taylor[] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
  const __m256 v = _mm256_min_ps(_mm256_max_ps(given, lo), hi);
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(k, ln2_lo, _mm256_fnmadd_ps(k, ln2_hi, v));
  __m256 p = _mm256_set1_ps(taylor[0]);
  for (int j = 1; j < 8; ++j) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(taylor[j]));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
  // Past the clamps: e^x overflows to infinity, or is (nearly) nothing; a NaN stays a NaN.
  e = _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(given, hi, _CMP_GT_OQ));
  e = _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(given, lo, _CMP_LT_OQ));
  return _mm256_blendv_ps(e, given, _mm256_cmp_ps(given, given, _CMP_UNORD_Q));
}
#endif

inline void exp_in_place(float* x, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  for (int64_t i = 0; i < n; i += kExpWidth) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
#else
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
#endif
}

}  // namespace pagedserve_cpu_math
