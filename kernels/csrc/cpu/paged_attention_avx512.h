// The AVX-512 passes of the CPU decode attention (paged_attention_avx512.cpp), for paged_attention_cpu.cpp.
#pragma once

#include <cstdint>

namespace pagedserve_cpu_attention {

// One sequence's context in the pool, seen from num_kv_heads KV heads side by side: the rows the passes read.
struct Rows {
  const void* k;         // the cache's first element of the first KV head: float, or bfloat16 bits when bf16
  const void* v;
  bool bf16;
  bool pairs;            // bf16 scores by AVX512_BF16's pair dot product (where the CPU has it)
  const int32_t* row;    // the sequence's block table row
  int64_t ctx;           // tokens of context
  int64_t block_size;
  int64_t c_block;       // cache strides, in elements: block, token
  int64_t c_token;
  int64_t c_head;
  int64_t num_kv_heads;  // KV heads taken, from the first
  int64_t head_size;     // a multiple of 16, at most 128
  int64_t group;         // query heads that share a KV head (num_kv_heads x group query heads in all)
  float scale;
  const void* after;     // the first K block of the thread's next item (at its first KV head), or null
};

// Only where pagedserve_cpu_features::avx512_enabled() (cpu_features.h).
// scores [heads][stride]: each query head's (q [heads][head_size], float) dot product with every K row of its
// KV head, times scale; positions past ctx are left as they are. Query head i is of KV head i / group. With
// pairs (bf16 rows, a bf16 query, head_size a multiple of 32, only where the CPU has AVX512_BF16), by the pair
// dot product: the same products, summed in another order.
void scores_avx512(const Rows& rows, const float* q, float* scores, int64_t stride);

// Each of `heads` rows of scores (stride apart) over its first ctx positions becomes its softmax's numerators
// e^(score - max) (the exponential of cpu_math.h's exp_in_place, lane for lane); sums gets their totals.
void exponentiate_avx512(float* scores, int64_t heads, int64_t stride, int64_t ctx, float* sums);

// acc [heads][head_size] += each V row of its KV head times the query head's weight at its position (weights
// [heads][stride]).
void weighted_sum_avx512(const Rows& rows, const float* weights, int64_t stride, float* acc);

}  // namespace pagedserve_cpu_attention
