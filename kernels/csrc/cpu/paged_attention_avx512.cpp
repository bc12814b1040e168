// Paged attention in AVX-512, for one sequence's query token (or a few of a prefill chunk's) and some of its KV
// heads at a time: the scores of the query heads against the K rows, their softmax's numerators, and the
// weighted sum of the V rows. Compiled for every x86-64 build with GCC (the instructions are enabled for this
// file's loops alone) and chosen at run time where the CPU has them (paged_attention_cpu.cpp).
//
// Both passes over the cache go a block at a time, the next block's lines prefetched a few at a time as the rows
// are worked on, and within a block a KV head at a time: its rows come from L2 or memory for the first of its
// query heads and from L1 for the others. A score is the dot product of the query and the K row, 16 lanes of
// partial sums over the head's 16-float chunks (bf16 rows, where the CPU has AVX512_BF16: over its chunks of 32,
// a pair of products a lane); 16 rows' partial sums are added across their lanes together, in one transposing
// tree, into one vector of 16 scores. The weighted sum adds each V row, times each head's weight, into float32
// accumulators, up to four query heads sharing each row's loads. bfloat16 rows are otherwise widened to float as
// they load.
#include <cstdint>
#include <type_traits>

#include "paged_attention_passes.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

#include "cpu_math_avx512.h"

namespace pagedserve_cpu_attention {

// Headers first: only the loops below are compiled for AVX-512.
#pragma GCC push_options
#pragma GCC target("avx512f")

namespace {

using pagedserve_cpu_math_avx512::exp16;

template <typename T>
inline __m512 load(const T* p) {
  return pagedserve_cpu_math_avx512::load16(p);
}

// A row's NC chunks of 16.
template <int NC, typename T>
inline void load_row(__m512 (&to)[NC], const T* row) {
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) to[c] = load(row + c * 16);
}

// HG heads' vectors of NC chunks, from HG x NC x 16 floats in a row.
template <int HG, int NC>
inline void load_heads(__m512 (&to)[HG][NC], const float* from) {
#pragma GCC unroll 4
  for (int h = 0; h < HG; ++h) {
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) to[h][c] = load(from + (h * NC + c) * 16);
  }
}

// The lane sums of four vectors: in each 128-bit lane L, element i is the sum of v_i's four elements in lane L.
inline __m512 quad_sums(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  const __m512 w01 = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
  const __m512 w23 = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
  return _mm512_add_ps(_mm512_shuffle_ps(w01, w23, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(w01, w23, _MM_SHUFFLE(3, 2, 3, 2)));
}

// Sixteen vectors' sums in one: element 4 j + i is the sum of vector 4 j + i, from x_j = quad_sums of vectors
// 4 j .. 4 j + 3 (their lanes' sums, added across the four lanes here).
inline __m512 lane_sums(__m512 x0, __m512 x1, __m512 x2, __m512 x3) {
  const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(x2, x3, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(x2, x3, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// A query's products with a K row, added chunk by chunk: 16 partial sums.
template <typename T, int NC>
inline __m512 row_products(const __m512 (&q)[NC], const T* row) {
  __m512 sum = _mm512_mul_ps(q[0], load(row));
#pragma GCC unroll 8
  for (int c = 1; c < NC; ++c) sum = _mm512_fmadd_ps(q[c], load(row + c * 16), sum);
  return sum;
}

// The first n of 16 rows' scores, from each row's 16 partial sums (v): the 16 sums in one vector (lane_sums),
// not one horizontal sum a row, times scale (by).
inline void store_scores(const __m512 (&v)[16], int64_t n, __m512 by, float* out) {
  const __m512 scores = _mm512_mul_ps(lane_sums(quad_sums(v[0], v[1], v[2], v[3]), quad_sums(v[4], v[5], v[6], v[7]),
                                                quad_sums(v[8], v[9], v[10], v[11]),
                                                quad_sums(v[12], v[13], v[14], v[15])),
                                      by);
  if (n == 16) {
    _mm512_storeu_ps(out, scores);
  } else {
    _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1), scores);
  }
}

// HG query heads over a block's rows, 16 rows at a time (store_scores). The rows come from memory for the first
// head and from L1 for the others.
template <typename T, int NC, int HG>
void score_rows(const float* q, const T* block, int64_t rows, int64_t c_token, float scale, float* out,
                int64_t stride, Ahead& ahead) {
  const __m512 by = _mm512_set1_ps(scale);
  ahead.pace(HG);
  for (int h = 0; h < HG; ++h) {
    ahead.step();
    __m512 qh[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) qh[c] = load(q + (h * NC + c) * 16);
    for (int64_t p0 = 0; p0 < rows; p0 += 16) {
      const int64_t n = rows - p0 < 16 ? rows - p0 : 16;
      const T* first = block + p0 * c_token;
      __m512 v[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) v[i] = i < n ? row_products<T, NC>(qh, first + i * c_token) : _mm512_setzero_ps();
      store_scores(v, n, by, out + h * stride + p0);
    }
  }
}

// Query heads handled together: their registers (HG x NC for the queries or the accumulators) at most 12.
template <int NC>
constexpr int heads_together() {
  return NC <= 3 ? 4 : NC <= 4 ? 3 : NC <= 6 ? 2 : 1;
}

// Every KV head of the item, a block at a time (over_blocks): kHeads query heads of one KV head at a time (the
// last few one by one) read the block's rows of that head, from memory for the first of them and from L1 for the
// others. The next block's lines are shared out among the passes; `then`, where given, is the block read after
// the last one (the V pass's first block after the K pass, the next item's first K block after the V pass).
// pass(heads, first query head, first position, the head's rows of the block, rows, ahead), heads an
// integral_constant.
template <typename T, int NC, typename Pass>
void by_head_groups(const Rows& r, const T* base, const T* then, Pass pass) {
  constexpr int kHeads = heads_together<NC>();
  const int64_t passes = r.num_kv_heads * (r.group / kHeads + r.group % kHeads);
  Ahead ahead = ahead_of(r, sizeof(T));
  over_blocks(r, base, then, ahead, [&](const T* block, int64_t first, int64_t rows) {
    int64_t left = passes;
    for (int64_t g = 0; g < r.num_kv_heads; ++g) {
      const T* rows_of_head = block + g * r.c_head;
      int64_t h = 0;
      for (; h + kHeads <= r.group; h += kHeads) {
        ahead.give(left--);
        pass(std::integral_constant<int, kHeads>{}, g * r.group + h, first, rows_of_head, rows, ahead);
        ahead.ask(ahead.quota);
      }
      for (; h < r.group; ++h) {
        ahead.give(left--);
        pass(std::integral_constant<int, 1>{}, g * r.group + h, first, rows_of_head, rows, ahead);
        ahead.ask(ahead.quota);
      }
    }
  });
}

template <typename T, int NC>
void scores_of(const Rows& r, const float* q, float* scores, int64_t stride) {
  const T* v_first = static_cast<const T*>(r.v) + static_cast<int64_t>(r.row[0]) * r.c_block;
  by_head_groups<T, NC>(r, static_cast<const T*>(r.k), v_first,
                        [&](auto heads, int64_t head, int64_t first, const T* block, int64_t rows, Ahead& ahead) {
                          score_rows<T, NC, decltype(heads)::value>(q + head * NC * 16, block, rows, r.c_token,
                                                                    r.scale, scores + head * stride + first,
                                                                    stride, ahead);
                        });
}

// bfloat16 K rows against a bfloat16 query by AVX512_BF16's pair dot product, where the CPU has it: a chunk of
// 32 is one instruction, each lane adding the products at 2j + 1 and 2j (exact, as bfloat16 products are in
// float) to its partial sum, against two multiply-adds and the rows' widening to float. A bfloat16 query's
// values come back to the same bits from their float copy. Compiled for AVX512_BF16 (these functions only).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16")

template <int NC>  // NC even: NC / 2 chunks of 32
inline __m512 pair_products(const __m512bh (&q)[NC / 2], const uint16_t* row) {
  __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(row));
#pragma GCC unroll 4
  for (int c = 1; c < NC / 2; ++c) sum = _mm512_dpbf16_ps(sum, q[c], (__m512bh)_mm512_loadu_si512(row + 32 * c));
  return sum;
}

template <int NC, int HG>
void pair_score_rows(const float* q, const uint16_t* block, int64_t rows, int64_t c_token, float scale,
                     float* out, int64_t stride, Ahead& ahead) {
  const __m512 by = _mm512_set1_ps(scale);
  ahead.pace(HG);
  for (int h = 0; h < HG; ++h) {
    ahead.step();
    __m512bh qh[NC / 2];
#pragma GCC unroll 4
    for (int c = 0; c < NC / 2; ++c) {
      const float* from = q + (h * NC + 2 * c) * 16;
      qh[c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(from + 16), _mm512_loadu_ps(from));
    }
    for (int64_t p0 = 0; p0 < rows; p0 += 16) {
      const int64_t n = rows - p0 < 16 ? rows - p0 : 16;
      const uint16_t* first = block + p0 * c_token;
      __m512 v[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) v[i] = i < n ? pair_products<NC>(qh, first + i * c_token) : _mm512_setzero_ps();
      store_scores(v, n, by, out + h * stride + p0);
    }
  }
}

template <int NC>
void pair_scores_of(const Rows& r, const float* q, float* scores, int64_t stride) {
  const auto* k = static_cast<const uint16_t*>(r.k);
  const uint16_t* v_first = static_cast<const uint16_t*>(r.v) + static_cast<int64_t>(r.row[0]) * r.c_block;
  by_head_groups<uint16_t, NC>(r, k, v_first, [&](auto heads, int64_t head, int64_t first, const uint16_t* block,
                                                  int64_t rows, Ahead& ahead) {
    pair_score_rows<NC, decltype(heads)::value>(q + head * NC * 16, block, rows, r.c_token, r.scale,
                                                scores + head * stride + first, stride, ahead);
  });
}

#pragma GCC pop_options

// HG query heads at a time: their accumulators stay in registers over a block's rows.
template <typename T, int NC, int HG>
void add_rows(const float* weights, int64_t stride, const T* block, int64_t rows, int64_t c_token, float* acc,
              Ahead& ahead) {
  __m512 a[HG][NC];
  load_heads(a, acc);
  ahead.pace(rows);
  for (int64_t p = 0; p < rows; ++p) {
    ahead.step();
    __m512 v[NC];
    load_row(v, block + p * c_token);
#pragma GCC unroll 4
    for (int h = 0; h < HG; ++h) {
      const __m512 w = _mm512_set1_ps(weights[h * stride + p]);
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) a[h][c] = _mm512_fmadd_ps(w, v[c], a[h][c]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < HG; ++h) {
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + (h * NC + c) * 16, a[h][c]);
  }
}

template <typename T, int NC>
void weighted_sum(const Rows& r, const float* weights, int64_t stride, float* acc) {
  by_head_groups<T, NC>(r, static_cast<const T*>(r.v), static_cast<const T*>(r.after),
                        [&](auto heads, int64_t head, int64_t first, const T* block, int64_t rows, Ahead& ahead) {
                          add_rows<T, NC, decltype(heads)::value>(weights + head * stride + first, stride, block,
                                                                  rows, r.c_token, acc + head * NC * 16, ahead);
                        });
}

// f(an element, the width) with the rows' element type (float, or bfloat16 bits) and their head size in chunks
// of 16 as types: the one place a pass is instantiated for every shape.
template <typename F>
void by_shape(const Rows& r, F f) {
  const auto widths = [&](auto element) {
    switch (r.head_size / 16) {
      case 1: return f(element, std::integral_constant<int, 1>{});
      case 2: return f(element, std::integral_constant<int, 2>{});
      case 3: return f(element, std::integral_constant<int, 3>{});
      case 4: return f(element, std::integral_constant<int, 4>{});
      case 5: return f(element, std::integral_constant<int, 5>{});
      case 6: return f(element, std::integral_constant<int, 6>{});
      case 7: return f(element, std::integral_constant<int, 7>{});
      default: return f(element, std::integral_constant<int, 8>{});
    }
  };
  if (r.bf16) {
    widths(uint16_t{});
  } else {
    widths(float{});
  }
}

}  // namespace

void scores_avx512(const Rows& rows, const float* q, float* scores, int64_t stride) {
  if (rows.pairs && rows.bf16 && rows.head_size % 32 == 0) {
    switch (rows.head_size / 32) {
      case 1: return pair_scores_of<2>(rows, q, scores, stride);
      case 2: return pair_scores_of<4>(rows, q, scores, stride);
      case 3: return pair_scores_of<6>(rows, q, scores, stride);
      default: return pair_scores_of<8>(rows, q, scores, stride);
    }
  }
  by_shape(rows, [&](auto element, auto width) {
    scores_of<decltype(element), decltype(width)::value>(rows, q, scores, stride);
  });
}

void weighted_sum_avx512(const Rows& rows, const float* weights, int64_t stride, float* acc) {
  by_shape(rows, [&](auto element, auto width) {
    weighted_sum<decltype(element), decltype(width)::value>(rows, weights, stride, acc);
  });
}

void exponentiate_avx512(float* scores, int64_t heads, int64_t stride, int64_t ctx, float* sums) {
  const int64_t full = ctx / 16 * 16;
  for (int64_t h = 0; h < heads; ++h) {
    float* sc = scores + h * stride;
    __m512 top = _mm512_set1_ps(-__builtin_inff());
    for (int64_t pos = 0; pos < full; pos += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(sc + pos));
    float max_score = _mm512_reduce_max_ps(top);
    for (int64_t pos = full; pos < ctx; ++pos) max_score = sc[pos] > max_score ? sc[pos] : max_score;
    const __m512 m = _mm512_set1_ps(max_score);
    __m512 total = _mm512_setzero_ps();
    int64_t pos = 0;
    for (; pos < full; pos += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + pos), m));
      _mm512_storeu_ps(sc + pos, e);
      total = _mm512_add_ps(total, e);
    }
    if (pos < ctx) {  // the last few, in a masked load and store
      const __mmask16 live = static_cast<__mmask16>((1u << (ctx - pos)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sc + pos), m));
      _mm512_mask_storeu_ps(sc + pos, live, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(live, e));
    }
    sums[h] = _mm512_reduce_add_ps(total);
  }
}

#pragma GCC pop_options

}  // namespace pagedserve_cpu_attention

#else

namespace pagedserve_cpu_attention {

void scores_avx512(const Rows&, const float*, float*, int64_t) {}
void weighted_sum_avx512(const Rows&, const float*, int64_t, float*) {}
void exponentiate_avx512(float*, int64_t, int64_t, int64_t, float*) {}

}  // namespace pagedserve_cpu_attention

#endif
