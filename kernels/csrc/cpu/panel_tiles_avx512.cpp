// The panel kernel's register tiles in AVX-512: float32 panels, and bfloat16 panels multiplied by AVX512_BF16's
// pair dot product or, on CPUs without it, with the pairs widened to float32. Compiled for every x86-64 build
// (the instructions are enabled for this file's tiles alone) and chosen at run time where the CPU has them
// (panel_linear_cpu.cpp). GCC only (its target pragma); other compilers build the AVX2 tiles alone.
//
// A tile computes rows x (16 * S) outputs of one strip of a panel, one zmm register of 16 outputs per row and
// step of S. In float32 a step of k is one fused multiply-add per output, k in order, as the AVX2 tile does, so
// both give the same bits. In bfloat16 oneDNN lays a weight out as panels of [K / 2][P][2]: each 32-bit lane
// holds one output's weights at k and k + 1, which is what VDPBF16PS multiplies by the row's pair (x[k],
// x[k + 1]) broadcast to every lane, adding both products to the output's float32 sum. Without it, a lane's
// pair is widened into two float32 registers (k: the lane shifted up 16 bits; k + 1: its low half cleared) and
// multiplied by the row's two values as the float32 tile does: the same sums, k in order, as float32 weights and
// rows holding the same values give (a product of two bfloat16 values is exact in float32). The widened tiles
// use no AVX512_BF16 instruction (`objdump -d` of the built extension shows none under them).
#include <cstdint>
#include <type_traits>

#include "panel_linear.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

namespace pagedserve_cpu_panel {

// Headers first: only the tiles below are compiled for AVX-512.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16")

namespace {

// One step of k for each element type: the weights' registers, each row's value (or pair) broadcast to every
// lane, and the products added to the float32 sums.
struct Floats {
  using Row = float;
  using Weights = __m512;
  static Weights load(const float* p) { return _mm512_loadu_ps(p); }
  static Weights broadcast(float a) { return _mm512_set1_ps(a); }
  static __m512 add(__m512 sums, Weights x, Weights w) { return _mm512_fmadd_ps(x, w, sums); }
};

struct Pairs {  // a uint32 holds two bfloat16, at k and k + 1
  using Row = uint32_t;
  using Weights = __m512bh;
  static Weights load(const uint32_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Weights broadcast(uint32_t a) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(a)); }
  static __m512 add(__m512 sums, Weights x, Weights w) { return _mm512_dpbf16_ps(sums, x, w); }
};

// rows x S registers of sums, one step of k (a pair of k for the pairs): every row's value times each register
// of the weights.
template <typename Step, int R, int S>
inline void multiply_step(__m512 (&acc)[R][S], const typename Step::Row* a, int64_t lda,
                          const typename Step::Row* bk) {
  typename Step::Weights w[S];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) w[s] = Step::load(bk + 16 * s);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const auto x = Step::broadcast(a[r * lda]);
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) acc[r][s] = Step::add(acc[r][s], x, w[s]);
  }
}

struct WidenedPairs {  // the weights a uint32 pair of bfloat16 each, the rows already widened
  using Row = FloatPair;
};

// The pairs' k values, then their k + 1 values: all rows by each, so at most S registers of weights are live.
template <int R, int S>
inline void multiply_widened(__m512 (&acc)[R][S], const FloatPair* a, int64_t lda, const uint32_t* bk) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 w[S];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) w[s] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(bk + 16 * s), 16));
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 x = _mm512_set1_ps(a[r * lda].lo);
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) acc[r][s] = _mm512_fmadd_ps(x, w[s], acc[r][s]);
  }
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) w[s] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(bk + 16 * s), high));
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 x = _mm512_set1_ps(a[r * lda].hi);
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) acc[r][s] = _mm512_fmadd_ps(x, w[s], acc[r][s]);
  }
}

// The lines prefetched into L1 are a block ahead. A core has few L1 fill buffers, which caps its stream below
// the memory's bandwidth when few rows leave little work per line; the lines this far past them are asked of
// L2, which keeps more in flight (benchmarks/panel_linear_bench.py: 8 to 16 rows 10 to 15% faster).
constexpr int64_t kFar = 64 * 1024;  // bytes

// a's rows are Step::Row, b's weights T (a float, or a pair of bfloat16).
template <typename Step, typename T, int R, int S>
inline void tile(const typename Step::Row* a, int64_t lda, const T* b, int64_t ld, int64_t kn, float* out,
                 int64_t ldo, const float* init, const T* ahead, int64_t every) {
  __m512 acc[R][S];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const float* from = init ? init : out + r * ldo;
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) acc[r][s] = _mm512_loadu_ps(from + 16 * s);
  }
  int64_t wait = 0;
  for (int64_t k = 0; k < kn; ++k) {
    const T* bk = b + k * ld;
    if (ahead && wait-- == 0) {
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 16 * s), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 16 * s + kFar / sizeof(T)), _MM_HINT_T1);
      }
      ahead += 16 * S;
      wait = every - 1;
    }
    if constexpr (std::is_same_v<Step, WidenedPairs>) {
      multiply_widened<R, S>(acc, a + k, lda, bk);
    } else {
      multiply_step<Step, R, S>(acc, a + k, lda, bk);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) _mm512_storeu_ps(out + r * ldo + 16 * s, acc[r][s]);
  }
}

template <typename Step, typename T, int S>
inline void by_rows(int64_t rows, const typename Step::Row* a, int64_t lda, const T* b, int64_t ld, int64_t kn,
                    float* out, int64_t ldo, const float* init, const T* ahead, int64_t every) {
  switch (rows) {
    case 1: return tile<Step, T, 1, S>(a, lda, b, ld, kn, out, ldo, init, ahead, every);
    case 2: return tile<Step, T, 2, S>(a, lda, b, ld, kn, out, ldo, init, ahead, every);
    case 3: return tile<Step, T, 3, S>(a, lda, b, ld, kn, out, ldo, init, ahead, every);
    case 4: return tile<Step, T, 4, S>(a, lda, b, ld, kn, out, ldo, init, ahead, every);
    case 5: return tile<Step, T, 5, S>(a, lda, b, ld, kn, out, ldo, init, ahead, every);
    default: return tile<Step, T, 6, S>(a, lda, b, ld, kn, out, ldo, init, ahead, every);
  }
}

template <typename Step, typename T>
void dispatch(int64_t rows, int64_t width, const typename Step::Row* a, int64_t lda, const T* b, int64_t ld,
              int64_t kn, float* out, int64_t ldo, const float* init, const T* ahead, int64_t every) {
  switch (width / 16) {
    case 1: return by_rows<Step, T, 1>(rows, a, lda, b, ld, kn, out, ldo, init, ahead, every);
    case 2: return by_rows<Step, T, 2>(rows, a, lda, b, ld, kn, out, ldo, init, ahead, every);
    case 3: return by_rows<Step, T, 3>(rows, a, lda, b, ld, kn, out, ldo, init, ahead, every);
    default: return by_rows<Step, T, 4>(rows, a, lda, b, ld, kn, out, ldo, init, ahead, every);
  }
}

}  // namespace

void tile_f32_avx512(int64_t rows, int64_t width, const float* a, int64_t lda, const float* b, int64_t ld,
                     int64_t kn, float* out, int64_t ldo, const float* init, const float* ahead, int64_t every) {
  dispatch<Floats, float>(rows, width, a, lda, b, ld, kn, out, ldo, init, ahead, every);
}

void tile_bf16_avx512(int64_t rows, int64_t width, const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ld,
                      int64_t kn, float* out, int64_t ldo, const float* init, const uint32_t* ahead,
                      int64_t every) {
  dispatch<Pairs, uint32_t>(rows, width, a, lda, b, ld, kn, out, ldo, init, ahead, every);
}

void tile_bf16_widened_avx512(int64_t rows, int64_t width, const FloatPair* a, int64_t lda, const uint32_t* b,
                              int64_t ld, int64_t kn, float* out, int64_t ldo, const float* init,
                              const uint32_t* ahead, int64_t every) {
  dispatch<WidenedPairs, uint32_t>(rows, width, a, lda, b, ld, kn, out, ldo, init, ahead, every);
}

#pragma GCC pop_options

}  // namespace pagedserve_cpu_panel

#else

namespace pagedserve_cpu_panel {

void tile_f32_avx512(int64_t, int64_t, const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t,
                     const float*, const float*, int64_t) {}
void tile_bf16_avx512(int64_t, int64_t, const uint32_t*, int64_t, const uint32_t*, int64_t, int64_t, float*,
                      int64_t, const float*, const uint32_t*, int64_t) {}
void tile_bf16_widened_avx512(int64_t, int64_t, const FloatPair*, int64_t, const uint32_t*, int64_t, int64_t,
                              float*, int64_t, const float*, const uint32_t*, int64_t) {}

}  // namespace pagedserve_cpu_panel

#endif
