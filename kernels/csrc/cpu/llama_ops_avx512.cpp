// The elementwise ops of a Llama-family layer in AVX-512 (llama_ops_avx512.h): sixteen values a step where the
// loops of llama_ops_cpu.cpp take eight (or one), the same operations in the same order. Compiled for every
// x86-64 build with GCC (the instructions are enabled for this file's loops alone) and chosen at run time where
// the CPU has them.
#include "llama_ops_avx512.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

#include "cpu_math_avx512.h"

namespace pagedserve_cpu_llama {

// Headers first: only the loops below are compiled for AVX-512.
#pragma GCC push_options
#pragma GCC target("avx512f")

namespace {

using namespace pagedserve_cpu_math_avx512;

inline __m512 negated(__m512 x) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}

template <typename T>
int64_t silu_mul(const T* gate, const T* up, T* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const __m512 g = load16(gate + d);
    const __m512 act = stored16(_mm512_div_ps(g, _mm512_add_ps(one, exp16(negated(g)))), T{});
    store16(out + d, _mm512_mul_ps(act, load16(up + d)));
  }
  return d;
}

}  // namespace

int64_t silu_mul_avx512(const float* gate, const float* up, float* out, int64_t n) {
  return silu_mul(gate, up, out, n);
}

int64_t silu_mul_avx512(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
  return silu_mul(gate, up, out, n);
}

#pragma GCC pop_options

}  // namespace pagedserve_cpu_llama

#else

namespace pagedserve_cpu_llama {

int64_t silu_mul_avx512(const float*, const float*, float*, int64_t) { return 0; }
int64_t silu_mul_avx512(const uint16_t*, const uint16_t*, uint16_t*, int64_t) { return 0; }

}  // namespace pagedserve_cpu_llama

#endif
