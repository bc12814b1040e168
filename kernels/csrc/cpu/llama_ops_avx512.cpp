// The elementwise ops of a Llama-family layer in AVX-512 (llama_ops_avx512.h): sixteen values a step where the
// loops of llama_ops_cpu.cpp take eight (or one), the same operations in the same order. Compiled for every
// x86-64 build with GCC (the instructions are enabled for this file's loops alone) and chosen at run time where
// the CPU has them (AVX512F and AVX512DQ). bfloat16 values are rounded by AVX512_BF16's conversion where the CPU
// has it too (HW, the same bits: cpu_math_avx512.h), else by integer operations.
#include "llama_ops_avx512.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

#include "cpu_features.h"
#include "cpu_math_avx512.h"

namespace pagedserve_cpu_llama {

// Headers first: only the loops below are compiled for AVX-512.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bf16")

namespace {

using namespace pagedserve_cpu_math_avx512;

// a + b as its own rounding: GCC fuses a plain vector add with the product before it (fp-contract), which torch's
// separate ops do not.
inline __m512 added(__m512 a, __m512 b) {
  return _mm512_add_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

inline __m512 negated(__m512 x) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}

// Whether to round by AVX512_BF16's conversion.
bool hw_rounding() {
  static const bool hw = pagedserve_cpu_features::cpu_has_avx512_bf16();
  return hw;
}

template <bool HW, typename T>
int64_t silu_mul(const T* gate, const T* up, T* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const __m512 g = load16(gate + d);
    const __m512 act = stored16(_mm512_div_ps(g, _mm512_add_ps(one, exp16(negated(g)))), T{}, HW);
    store16(out + d, _mm512_mul_ps(act, load16(up + d)), HW);
  }
  return d;
}

template <bool HW, typename T>
int64_t add_residual(T* residual, const T* x, float* row, int64_t n) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const __m512 sum = _mm512_add_ps(load16(residual + d), load16(x + d));
    store16(residual + d, sum, HW);
    _mm512_storeu_ps(row + d, stored16(sum, T{}, HW));
  }
  return d;
}

template <bool HW, typename T>
int64_t scale_row(T* out, const float* row, const T* weight, float inv, int64_t n) {
  const __m512 by = _mm512_set1_ps(inv);
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const __m512 scaled = stored16(_mm512_mul_ps(_mm512_loadu_ps(row + d), by), T{}, HW);
    store16(out + d, _mm512_mul_ps(load16(weight + d), scaled), HW);
  }
  return d;
}

template <bool HW, typename T>
bool rotate(T* out, const T* x, const T* cos, const T* sin, int64_t dim) {
  const int64_t half = dim / 2;
  if (half % 16 != 0) return false;
  for (int64_t d = 0; d < half; d += 16) {
    const __m512 first = load16(x + d), second = load16(x + d + half);
    const __m512 a = stored16(_mm512_mul_ps(first, load16(cos + d)), T{}, HW);
    const __m512 b = stored16(_mm512_mul_ps(negated(second), load16(sin + d)), T{}, HW);
    store16(out + d, added(a, b), HW);
    const __m512 c = stored16(_mm512_mul_ps(second, load16(cos + d + half)), T{}, HW);
    const __m512 e = stored16(_mm512_mul_ps(first, load16(sin + d + half)), T{}, HW);
    store16(out + d + half, added(c, e), HW);
  }
  return true;
}

}  // namespace

int64_t silu_mul_avx512(const float* gate, const float* up, float* out, int64_t n) {
  return silu_mul<false>(gate, up, out, n);
}

int64_t silu_mul_avx512(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
  return hw_rounding() ? silu_mul<true>(gate, up, out, n) : silu_mul<false>(gate, up, out, n);
}

int64_t add_residual_avx512(float* residual, const float* x, float* row, int64_t n) {
  return add_residual<false>(residual, x, row, n);
}

int64_t add_residual_avx512(uint16_t* residual, const uint16_t* x, float* row, int64_t n) {
  return hw_rounding() ? add_residual<true>(residual, x, row, n) : add_residual<false>(residual, x, row, n);
}

int64_t sum_squares_avx512(const float* row, int64_t n, double* sums) {
  // Lane j holds sums[j]: each square added to it in the order of the eight-at-a-time loop.
  __m512d acc = _mm512_loadu_pd(sums);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(row + d));
    acc = _mm512_add_pd(acc, _mm512_mul_pd(v, v));  // a float's square is exact in double: fused or not alike
  }
  _mm512_storeu_pd(sums, acc);
  return d;
}

int64_t scale_row_avx512(float* out, const float* row, const float* weight, float inv, int64_t n) {
  return scale_row<false>(out, row, weight, inv, n);
}

int64_t scale_row_avx512(uint16_t* out, const float* row, const uint16_t* weight, float inv, int64_t n) {
  return hw_rounding() ? scale_row<true>(out, row, weight, inv, n) : scale_row<false>(out, row, weight, inv, n);
}

bool rotate_avx512(float* out, const float* x, const float* cos, const float* sin, int64_t dim) {
  return rotate<false>(out, x, cos, sin, dim);
}

bool rotate_avx512(uint16_t* out, const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t dim) {
  return hw_rounding() ? rotate<true>(out, x, cos, sin, dim) : rotate<false>(out, x, cos, sin, dim);
}

#pragma GCC pop_options

}  // namespace pagedserve_cpu_llama

#else

namespace pagedserve_cpu_llama {

int64_t silu_mul_avx512(const float*, const float*, float*, int64_t) { return 0; }
int64_t silu_mul_avx512(const uint16_t*, const uint16_t*, uint16_t*, int64_t) { return 0; }
int64_t add_residual_avx512(float*, const float*, float*, int64_t) { return 0; }
int64_t add_residual_avx512(uint16_t*, const uint16_t*, float*, int64_t) { return 0; }
int64_t sum_squares_avx512(const float*, int64_t, double*) { return 0; }
int64_t scale_row_avx512(float*, const float*, const float*, float, int64_t) { return 0; }
int64_t scale_row_avx512(uint16_t*, const float*, const uint16_t*, float, int64_t) { return 0; }
bool rotate_avx512(float*, const float*, const float*, const float*, int64_t) { return false; }
bool rotate_avx512(uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, int64_t) { return false; }

}  // namespace pagedserve_cpu_llama

#endif
