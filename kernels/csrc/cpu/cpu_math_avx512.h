// cpu_math.h's conversions and exponential on 16 lanes, for the loops compiled for AVX-512 (GCC on x86-64 only,
// called only where the CPU has AVX-512). Each lane gives the bits its scalar or eight-lane twin gives.
#pragma once

#include <cstdint>

#include <immintrin.h>

// Headers first: only these functions are compiled for AVX-512.
#pragma GCC push_options
#pragma GCC target("avx512f")

namespace pagedserve_cpu_math_avx512 {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const uint16_t* p) {  // bfloat16 bits
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// pagedserve_cpu_math::bf16_bits of each lane, in the lane's low half: to nearest, ties to even, a NaN as 0x7FC0.
inline __m512i bf16_lanes(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }

inline void store16(uint16_t* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_lanes(x)));
}

// pagedserve_cpu_math::stored<T> of each lane: the value a tensor of T would hold.
inline __m512 stored16(__m512 x, float) { return x; }
inline __m512 stored16(__m512 x, uint16_t) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_lanes(x), 16)); }

// e^x of 16 floats: exp_in_place's steps (cpu_math.h) on 16 lanes.
inline __m512 exp16(__m512 given) {
  const __m512 lo = _mm512_set1_ps(-87.0f), hi = _mm512_set1_ps(88.0f);
  const __m512 v = _mm512_min_ps(_mm512_max_ps(given, lo), hi);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f),
                                    _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), v));
  const float taylor[] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
  __m512 p = _mm512_set1_ps(taylor[0]);
#pragma GCC unroll 8
  for (int j = 1; j < 8; ++j) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(taylor[j]));
  const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(given, hi, _CMP_GT_OQ), _mm512_set1_ps(__builtin_inff()));
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(given, lo, _CMP_LT_OQ), _mm512_setzero_ps());
  return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(given, given, _CMP_UNORD_Q), given);
}

}  // namespace pagedserve_cpu_math_avx512

#pragma GCC pop_options

// The same roundings by AVX512_BF16's conversion (VCVTNEPS2BF16), where `hw` (the CPU has it): one instruction
// in place of seven, with bf16_lanes' bits wherever every lane is a normal number, a zero or an infinity. It
// flushes a subnormal to zero and keeps a NaN's payload, so a vector with either takes bf16_lanes. Only for
// loops compiled for these instructions too (the caller's target includes AVX512DQ and AVX512_BF16).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bf16")

namespace pagedserve_cpu_math_avx512 {

inline __m256i bf16_halves(__m512 x, bool hw) {
  constexpr int kNanOrSubnormal = 0x01 | 0x20 | 0x80;  // VFPCLASSPS: quiet NaN, subnormal, signalling NaN
  if (hw && _mm512_fpclass_ps_mask(x, kNanOrSubnormal) == 0) return (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_cvtepi32_epi16(bf16_lanes(x));
}

inline void store16(float* p, __m512 x, bool) { _mm512_storeu_ps(p, x); }

inline void store16(uint16_t* p, __m512 x, bool hw) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_halves(x, hw));
}

inline __m512 stored16(__m512 x, float, bool) { return x; }

inline __m512 stored16(__m512 x, uint16_t, bool hw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_halves(x, hw)), 16));
}

}  // namespace pagedserve_cpu_math_avx512

#pragma GCC pop_options
