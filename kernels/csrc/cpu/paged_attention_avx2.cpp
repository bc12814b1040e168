// Paged attention in AVX2 and FMA, the passes of paged_attention_avx512.cpp in eight lanes, for the CPUs without
// AVX-512 (and for PAGEDSERVE_AVX512=0): one sequence's query token (or a few of a prefill chunk's) against some
// of its KV heads at a time.
//
// Both passes over the cache go a block at a time, the next block's lines asked for a few at a time over the
// block's work (Ahead, paged_attention_passes.h). A score is the dot product of a query head and a K row, eight
// lanes of partial sums over the head's chunks of 8; eight rows' partial sums are added across together
// (eight_sums), not one horizontal sum a row. Each query head goes over its KV head's rows of the block eight
// at a time: the rows come from L2 or memory for the first query head of a KV head and from L1 for the others.
// The weighted sum keeps up to 3 query heads by 24 outputs in registers over the block's rows, each V row loaded
// once for the heads that share it. bfloat16 rows are widened to float as they load.
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu_math.h"
#include "paged_attention_passes.h"

namespace pagedserve_cpu_attention {

#if defined(__AVX2__) && defined(__FMA__)

namespace {

using pagedserve_cpu_math::exp8;
using pagedserve_cpu_math::load8;

constexpr int64_t kLanes = 8;

// Eight vectors' sums in one: element i is the sum of v[i]'s lanes.
inline __m256 eight_sums(const __m256 (&v)[8]) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // ab: the sums of v[0..3]'s low halves, then of their high halves; cd the same of v[4..7].
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// One query head's scores (q, head_size floats) against n <= 8 rows from `first` (c_token apart), times scale
// (by), into out[0, n).
template <typename T>
inline void score_eight(const float* q, const T* first, int64_t c_token, int64_t n, int64_t head_size, __m256 by,
                        float* out) {
  const T* rows[8];
  for (int i = 0; i < 8; ++i) rows[i] = first + (i < n ? i : n - 1) * c_token;
  __m256 v[8];
  for (int i = 0; i < 8; ++i) v[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_size; d += kLanes) {
    const __m256 qd = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) v[i] = _mm256_fmadd_ps(qd, load8(rows[i] + d), v[i]);
  }
  const __m256 scores = _mm256_mul_ps(eight_sums(v), by);
  if (n == 8) {
    _mm256_storeu_ps(out, scores);
  } else {
    float all[8];
    _mm256_storeu_ps(all, scores);
    std::copy(all, all + n, out);
  }
}

// H query heads' accumulators of W chunks of 8 (head h's from acc + h * head_size) plus each of `rows` V rows
// from `first` (c_token apart) times the head's weight at its position (weights + h * stride): in registers over
// the rows, one multiply-add an output a row, positions in order.
template <int H, int W, typename T>
void add_rows(const float* weights, int64_t stride, const T* first, int64_t rows, int64_t c_token, float* acc,
              int64_t head_size, Ahead& ahead) {
  __m256 a[H][W];
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h) {
#pragma GCC unroll 4
    for (int j = 0; j < W; ++j) a[h][j] = _mm256_loadu_ps(acc + h * head_size + j * kLanes);
  }
  ahead.pace(rows);
  for (int64_t p = 0; p < rows; ++p) {
    ahead.step();
    __m256 w[H];
#pragma GCC unroll 4
    for (int h = 0; h < H; ++h) w[h] = _mm256_broadcast_ss(weights + h * stride + p);
    const T* row = first + p * c_token;
#pragma GCC unroll 4
    for (int j = 0; j < W; ++j) {
      const __m256 v = load8(row + j * kLanes);
#pragma GCC unroll 4
      for (int h = 0; h < H; ++h) a[h][j] = _mm256_fmadd_ps(w[h], v, a[h][j]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h) {
#pragma GCC unroll 4
    for (int j = 0; j < W; ++j) _mm256_storeu_ps(acc + h * head_size + j * kLanes, a[h][j]);
  }
}

// add_rows for 1 to 3 heads by 1 to 3 chunks (at most 9 accumulators).
template <typename T>
void add_rows_of(int64_t heads, int64_t chunks, const float* weights, int64_t stride, const T* first, int64_t rows,
                 int64_t c_token, float* acc, int64_t head_size, Ahead& ahead) {
  using Add = void (*)(const float*, int64_t, const T*, int64_t, int64_t, float*, int64_t, Ahead&);
  static constexpr Add kAdds[3][3] = {{add_rows<1, 1, T>, add_rows<1, 2, T>, add_rows<1, 3, T>},
                                      {add_rows<2, 1, T>, add_rows<2, 2, T>, add_rows<2, 3, T>},
                                      {add_rows<3, 1, T>, add_rows<3, 2, T>, add_rows<3, 3, T>}};
  kAdds[heads - 1][chunks - 1](weights, stride, first, rows, c_token, acc, head_size, ahead);
}

template <typename T>
void scores_of(const Rows& r, const float* q, float* scores, int64_t stride) {
  const T* k = static_cast<const T*>(r.k);
  const T* v_first = static_cast<const T*>(r.v) + static_cast<int64_t>(r.row[0]) * r.c_block;
  const int64_t heads = r.num_kv_heads * r.group;
  const __m256 by = _mm256_set1_ps(r.scale);
  Ahead ahead = ahead_of(r, sizeof(T));
  over_blocks(r, k, v_first, ahead, [&](const T* block, int64_t first, int64_t rows) {
    for (int64_t h = 0; h < heads; ++h) {
      ahead.give(heads - h);
      ahead.pace((rows + 7) / 8);
      const T* of_head = block + (h / r.group) * r.c_head;
      for (int64_t p = 0; p < rows; p += 8) {
        ahead.step();
        score_eight(q + h * r.head_size, of_head + p * r.c_token, r.c_token, std::min<int64_t>(8, rows - p),
                    r.head_size, by, scores + h * stride + first + p);
      }
      ahead.ask(ahead.quota);
    }
  });
}

template <typename T>
void weighted_sum_of(const Rows& r, const float* weights, int64_t stride, float* acc) {
  const int64_t chunks = r.head_size / kLanes;
  const int64_t passes = r.num_kv_heads * ((r.group + 2) / 3) * ((chunks + 2) / 3);
  Ahead ahead = ahead_of(r, sizeof(T));
  over_blocks(r, static_cast<const T*>(r.v), static_cast<const T*>(r.after), ahead,
              [&](const T* block, int64_t first, int64_t rows) {
                int64_t left = passes;
                for (int64_t g = 0; g < r.num_kv_heads; ++g) {
                  for (int64_t h = 0; h < r.group; h += 3) {
                    const int64_t head = g * r.group + h;
                    for (int64_t c = 0; c < chunks; c += 3) {
                      ahead.give(left--);
                      add_rows_of(std::min<int64_t>(3, r.group - h), std::min<int64_t>(3, chunks - c),
                                  weights + head * stride + first, stride, block + g * r.c_head + c * kLanes, rows,
                                  r.c_token, acc + head * r.head_size + c * kLanes, r.head_size, ahead);
                      ahead.ask(ahead.quota);
                    }
                  }
                }
              });
}

}  // namespace

bool avx2_passes() { return true; }

void scores_avx2(const Rows& rows, const float* q, float* scores, int64_t stride) {
  if (rows.bf16) {
    scores_of<c10::BFloat16>(rows, q, scores, stride);
  } else {
    scores_of<float>(rows, q, scores, stride);
  }
}

void weighted_sum_avx2(const Rows& rows, const float* weights, int64_t stride, float* acc) {
  if (rows.bf16) {
    weighted_sum_of<c10::BFloat16>(rows, weights, stride, acc);
  } else {
    weighted_sum_of<float>(rows, weights, stride, acc);
  }
}

void exponentiate_avx2(float* scores, int64_t heads, int64_t stride, int64_t ctx, float* sums) {
  const int64_t width = (ctx + kLanes - 1) / kLanes * kLanes;  // within the row's padding of -inf
  for (int64_t h = 0; h < heads; ++h) {
    float* sc = scores + h * stride;
    __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t pos = 0; pos < width; pos += kLanes) top = _mm256_max_ps(top, _mm256_loadu_ps(sc + pos));
    top = _mm256_max_ps(top, _mm256_permute2f128_ps(top, top, 1));
    top = _mm256_max_ps(top, _mm256_shuffle_ps(top, top, _MM_SHUFFLE(1, 0, 3, 2)));
    top = _mm256_max_ps(top, _mm256_shuffle_ps(top, top, _MM_SHUFFLE(2, 3, 0, 1)));
    __m256 total = _mm256_setzero_ps();
    for (int64_t pos = 0; pos < width; pos += kLanes) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + pos), top));
      _mm256_storeu_ps(sc + pos, e);
      total = _mm256_add_ps(total, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, total);
    sums[h] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  }
}

#else

bool avx2_passes() { return false; }
void scores_avx2(const Rows&, const float*, float*, int64_t) {}
void weighted_sum_avx2(const Rows&, const float*, int64_t, float*) {}
void exponentiate_avx2(float*, int64_t, int64_t, int64_t, float*) {}

#endif

}  // namespace pagedserve_cpu_attention
