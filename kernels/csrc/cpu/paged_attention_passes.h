// The passes of the CPU paged attention over one sequence's rows, for paged_attention_cpu.cpp: in AVX-512
// (paged_attention_avx512.cpp) and in AVX2 (paged_attention_avx2.cpp), the same sums in 16 or 8 lanes.
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
  int64_t head_size;     // a multiple of 16, at most 128 (AVX-512); a multiple of 8 (AVX2)
  int64_t group;         // query heads that share a KV head (num_kv_heads x group query heads in all)
  float scale;
  const void* after;     // the first K block of the thread's next item (at its first KV head), or null
};

// The lines of the block a pass reads next, asked of L2 a few at a time while the pass works on this one. A
// sequence's blocks lie anywhere in the pool and the hardware prefetcher does not follow the jump from one to
// the next, so without this each block's first lines wait on memory; and asked all at once, the lines fill the
// core's few outstanding misses and the pass waits until most of them arrive, memory and arithmetic one after
// the other. Spread over the block's work, they arrive while it is done, in address order, which the hardware
// prefetcher follows too (benchmarks/cpu_kernel_bench.py --pool-gib 2: on an AMD EPYC with AVX-512, 32 and 64
// sequences of 256 tokens take 20-40% less time than with the whole block asked at the block's start).
struct Ahead {
  const int64_t row_bytes;    // the item's bytes of a row (its KV heads side by side)
  const int64_t stride;       // bytes from a row to the next
  const char* row = nullptr;  // the row the next line is in
  int64_t offset = 0;         // the next line's bytes into it
  int64_t lines = 0;          // lines not yet asked
  int64_t quota = 0;          // of which the pass at work may ask
  int64_t each = 0;           // lines a step of the pass asks for (pace), and one more while `extra` lasts
  int64_t extra = 0;

  // Asks for a block's first `rows` rows, from `first`.
  void start(const void* first, int64_t rows) {
    row = static_cast<const char*>(first);
    offset = 0;
    lines = rows * ((row_bytes + 63) / 64);
  }

  // The next pass's share of what is left, when `passes` passes (this one included) are left in the block.
  void give(int64_t passes) { quota = (lines + passes - 1) / passes; }

  // Up to n lines of the pass's quota. The fields are worked on in registers and stored once.
  void ask(int64_t n) {
    n = n < quota ? n : quota;
    if (n <= 0) return;
    const char* at = row;
    int64_t into = offset;
    for (int64_t i = 0; i < n; ++i) {
      __builtin_prefetch(at + into, 0, 2);  // to L2 (prefetcht1)
      into += 64;
      if (into >= row_bytes) {
        into = 0;
        at += stride;
      }
    }
    row = at;
    offset = into;
    quota -= n;
    lines -= n;
  }

  // The pass's quota spread evenly over its `steps` steps (the first quota % steps ask one line more), worked
  // out once a pass: a step then asks without dividing.
  void pace(int64_t steps) {
    each = quota / steps;
    extra = quota % steps;
  }

  // One step's part of the quota (pace).
  void step() { ask(extra-- > 0 ? each + 1 : each); }
};

// The Ahead of an item's rows of T (elements of `element` bytes).
inline Ahead ahead_of(const Rows& r, int64_t element) {
  return Ahead{r.num_kv_heads * r.head_size * element, r.c_token * element};
}

// Every block of the item's context from `base` (K or V), in turn: pass(block, first position, rows), with the
// next block's lines (after the last, `then`'s, where given) started in `ahead` for the pass to ask for over the
// block's work. Always inlined, so that each ISA's caller compiles it for its own instructions and inlines its
// pass into it.
template <typename T, typename Pass>
__attribute__((always_inline)) inline void over_blocks(const Rows& r, const T* base, const T* then, Ahead& ahead,
                                                       Pass pass) {
  for (int64_t first = 0; first < r.ctx; first += r.block_size) {
    const T* block = base + static_cast<int64_t>(r.row[first / r.block_size]) * r.c_block;  // widened first
    const int64_t rows = r.ctx - first < r.block_size ? r.ctx - first : r.block_size;
    const int64_t next = first + r.block_size;
    if (next < r.ctx) {
      ahead.start(base + static_cast<int64_t>(r.row[next / r.block_size]) * r.c_block,
                  r.ctx - next < r.block_size ? r.ctx - next : r.block_size);
    } else if (then) {
      ahead.start(then, r.block_size);  // rows past a context are the block's own bytes
    }
    pass(block, first, rows);
  }
}

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

// The same three passes in AVX2 and FMA, where the build has them (avx2_passes(); else they do nothing): eight
// lanes of partial sums a score, the eight rows' sums added across together; the softmax's exponential is
// cpu_math.h's exp8; the weighted sum's multiply-adds go in the order of the AVX-512 ones.
bool avx2_passes();
void scores_avx2(const Rows& rows, const float* q, float* scores, int64_t stride);
void exponentiate_avx2(float* scores, int64_t heads, int64_t stride, int64_t ctx, float* sums);
void weighted_sum_avx2(const Rows& rows, const float* weights, int64_t stride, float* acc);

}  // namespace pagedserve_cpu_attention
