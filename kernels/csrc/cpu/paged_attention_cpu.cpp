// Paged attention on the CPU: torch.ops.pagedserve_cpu.paged_attention_decode (the decodes) and
// torch.ops.pagedserve_cpu.paged_attention (the decodes and the prefill chunks up to a length, each new token a
// query over its context up to itself).
//
// The pure-torch twin gathers every decode sequence's context into a padded copy and runs SDPA over it, which
// on a CPU costs more than the attention itself. Here each (sequence, KV head) pair reads its K and V rows once,
// straight from the pool through the block table, for all query heads that share that KV head (and, in a
// prefill chunk, for a few tokens at once). float32 and bfloat16 (read as float, accumulated in float); the
// Python side keeps float16, and head sizes that are not a multiple of 8, on the twin. The passes over a
// sequence's rows are paged_attention_avx512.cpp's where the CPU has AVX-512 and the head size is a multiple of
// 16 up to 128 (their bf16 scores by AVX512_BF16's pair dot product where the CPU has it), else
// paged_attention_avx2.cpp's (PAGEDSERVE_AVX512=0 keeps these on an AVX-512 CPU); a build without AVX2 runs plain
// loops over the decodes alone.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "cpu_features.h"
#include "cpu_math.h"
#include "paged_attention_passes.h"

namespace {

using at::Tensor;
using namespace pagedserve_cpu_math;

#define PAGEDSERVE_CHECK(cond, ...) TORCH_CHECK(cond, "pagedserve: ", __VA_ARGS__)

constexpr int64_t kLanes = 8;  // one AVX2 register of floats; head_size must be a multiple of it

// Dot product in kLanes independent partial sums, so the compiler vectorizes it without reassociating floats.
// K rows of either dtype are widened to float as they are read.
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float partial[kLanes] = {};
  for (int64_t d = 0; d < n; d += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) partial[j] += a[d + j] * to_float(b[d + j]);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) sum += partial[j];
  return sum;
}

template <typename T>
inline void axpy(float* y, float alpha, const T* x, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += alpha * to_float(x[d]);
}

// Each of `heads` rows of scores (stride apart, padded with -inf to a multiple of kExpWidth) becomes its
// softmax's numerators e^(score - max); sums gets their totals over the first ctx.
inline void exponentiate(float* scores, int64_t heads, int64_t stride, int64_t ctx, float* sums) {
  for (int64_t h = 0; h < heads; ++h) {
    float* sc = scores + h * stride;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t pos = 0; pos < ctx; ++pos) max_score = std::max(max_score, sc[pos]);
    for (int64_t pos = 0; pos < ctx; ++pos) sc[pos] -= max_score;
    exp_in_place(sc, stride);
    float total = 0.f;
    for (int64_t pos = 0; pos < ctx; ++pos) total += sc[pos];
    sums[h] = total;
  }
}

// Items 0..items-1 dealt into `parts` shares of about equal total work (the longest first, each to the share
// with the least so far).
template <typename Work>
std::vector<std::vector<int64_t>> balance(int64_t items, int64_t parts, Work work) {
  std::vector<int64_t> order(items);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return work(a) > work(b); });
  std::vector<std::vector<int64_t>> shares(std::max<int64_t>(1, std::min(parts, items)));
  std::vector<int64_t> load(shares.size(), 0);
  for (const int64_t item : order) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    shares[least].push_back(item);
    load[least] += work(item);
  }
  return shares;
}

void check_index(const Tensor& t, const char* name, int64_t dim) {
  PAGEDSERVE_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  PAGEDSERVE_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  PAGEDSERVE_CHECK(t.dim() == dim && t.is_contiguous(), name, " must be a contiguous ", dim, "-d tensor");
}

void check_float(const Tensor& t, const char* name, at::ScalarType dtype) {
  PAGEDSERVE_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  PAGEDSERVE_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, " as query is, got ", t.scalar_type());
  PAGEDSERVE_CHECK(t.stride(-1) == 1, name, " must be contiguous in head_size");
}

// One query token: its sequence, its row of query and out, and the context it attends over (the sequence's
// tokens up to and including its own).
struct Query {
  int64_t seq, token, ctx;
};

template <typename T>
void attend(Tensor& out, const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
            const Tensor& block_table, const Tensor& seq_lens, const Tensor& query_start_loc, double scale,
            int64_t longest);

// Whether the AVX-512 passes take this head size (else the AVX2 ones).
bool avx512_loops(int64_t head_size) {
  return pagedserve_cpu_features::avx512_enabled() && head_size % 16 == 0 && head_size <= 128;
}

// Each query token of every sequence with at most `longest` new tokens attends over its context up to itself
// (causal); sequences with more are skipped (their rows of out are left as they are). longest 1: the decodes.
void paged_attention_upto(Tensor& out,                    // [num_tokens, num_heads, head_size]
                          const Tensor& query,            // [num_tokens, num_heads, head_size]
                          const Tensor& k_cache,          // [num_blocks, block_size, num_kv_heads, head_size]
                          const Tensor& v_cache,          // [num_blocks, block_size, num_kv_heads, head_size]
                          const Tensor& block_table,      // [num_seqs, max_num_blocks_per_seq] int32
                          const Tensor& seq_lens,         // [num_seqs] int32, cached context + new tokens
                          const Tensor& query_start_loc,  // [num_seqs + 1] int32
                          double scale, int64_t longest) {
  PAGEDSERVE_CHECK(longest >= 1, "longest must be at least 1, got ", longest);
  const auto dtype = query.scalar_type();
  PAGEDSERVE_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "query must be float32 or bfloat16, got ",
                   dtype);
  check_float(out, "out", dtype);
  check_float(query, "query", dtype);
  check_float(k_cache, "k_cache", dtype);
  check_float(v_cache, "v_cache", dtype);
  check_index(block_table, "block_table", 2);
  check_index(seq_lens, "seq_lens", 1);
  check_index(query_start_loc, "query_start_loc", 1);
  PAGEDSERVE_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
                   "query and out must be [num_tokens, num_heads, head_size]");
  PAGEDSERVE_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                       k_cache.strides() == v_cache.strides(),
                   "k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_size] alike");
  const int64_t num_seqs = seq_lens.size(0), num_heads = query.size(1);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2), head_size = k_cache.size(3);
  PAGEDSERVE_CHECK(query.size(2) == head_size, "query head_size ", query.size(2), ", cache ", head_size);
  PAGEDSERVE_CHECK(head_size % kLanes == 0, "head_size must be a multiple of ", kLanes, ", got ", head_size);
  PAGEDSERVE_CHECK(num_heads % num_kv_heads == 0, num_heads, " query heads over ", num_kv_heads, " KV heads");
  PAGEDSERVE_CHECK(block_table.size(0) == num_seqs && query_start_loc.size(0) == num_seqs + 1,
                   "block_table, seq_lens and query_start_loc disagree on the number of sequences");

  if (dtype == at::kFloat) {
    attend<float>(out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, longest);
  } else {
    attend<c10::BFloat16>(out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, longest);
  }
}

// Every sequence with exactly one new query token attends over its whole context; sequences with more are
// skipped.
void paged_attention_decode(Tensor& out, const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                            const Tensor& block_table, const Tensor& seq_lens, const Tensor& query_start_loc,
                            double scale) {
  paged_attention_upto(out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, 1);
}

// The longest prefill chunk the AVX2 passes take: past it SDPA over the gathered context catches up
// (benchmarks/cpu_kernel_bench.py --prefill-lengths on an AVX2 EPYC, fp32: 4.7x SDPA's speed in chunks of 32,
// 1.14x at 128, level at 512, 0.62x at 1024; 1.37x in chunks of 32 after 256 cached tokens, 0.86x at 256).
constexpr int64_t kAvx2PrefillTokens = 128;

// Every query token, of decodes and of prefill chunks of up to `longest` tokens, where the CPU has the AVX-512
// passes (up to kAvx2PrefillTokens in the AVX2 ones); the plain loops of a build without AVX2 take the decodes
// alone. Returns the longest chunk taken.
int64_t paged_attention_cpu(Tensor& out, const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                            const Tensor& block_table, const Tensor& seq_lens, const Tensor& query_start_loc,
                            double scale, int64_t longest) {
  PAGEDSERVE_CHECK(longest >= 1, "longest must be at least 1, got ", longest);
  int64_t taken = 1;  // the plain loops: the decodes alone
  if (avx512_loops(k_cache.size(-1))) {
    taken = longest;
  } else if (pagedserve_cpu_attention::avx2_passes()) {
    taken = std::min(longest, kAvx2PrefillTokens);
  }
  paged_attention_upto(out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, taken);
  return taken;
}

// What the decode loops read and write: the step's tensors as pointers and strides (elements).
template <typename T>
struct Pool {
  const T* q;
  T* out;
  const T* k;
  const T* v;
  const int32_t* table;
  int64_t max_blocks, block_size, num_kv_heads, head_size, group;
  int64_t q_token, q_head, o_token, o_head, c_block, c_token, c_head;
  float scale;

  // The query heads first_head.. first_head + heads - 1 of a token, as floats (q [heads][head_size]).
  void load_queries(int64_t token, int64_t first_head, int64_t heads, float* to) const {
    for (int64_t h = 0; h < heads; ++h) {
      const T* from = q + token * q_token + (first_head + h) * q_head;
      for (int64_t d = 0; d < head_size; ++d) to[h * head_size + d] = to_float(from[d]);
    }
  }

  // The same heads' outputs: each head's weighted sum over its softmax's total.
  void write_outputs(int64_t token, int64_t first_head, int64_t heads, const float* acc, const float* sums) const {
    for (int64_t h = 0; h < heads; ++h) {
      T* o = out + token * o_token + (first_head + h) * o_head;
      const float inv = 1.f / sums[h];
      for (int64_t d = 0; d < head_size; ++d) o[d] = from_float<T>(acc[h * head_size + d] * inv);
    }
  }
};

// Each head's scores padded to the exponential's width, the padding -inf (its weights come out 0).
inline int64_t padded(int64_t ctx) { return (ctx + kExpWidth - 1) / kExpWidth * kExpWidth; }

// Prefill tokens of one sequence that the passes take as one work item: their K and V rows are read once
// for all of them, the query heads of a token beside those of the next.
constexpr int64_t kTokensTogether = 4;

// A work item of the passes: `tokens` consecutive query tokens of a sequence from `token` on, the last
// over ctx positions and each one before it over one fewer, against `kv_heads` KV heads from first_kv. Either
// one token (a decode) or one KV head (a prefill run).
struct Item {
  int64_t seq, token, tokens, ctx, first_kv, kv_heads;
};

// The passes over the rows: AVX-512's, or AVX2's (paged_attention_avx512.cpp, paged_attention_avx2.cpp). A
// decode is one work item over all its KV heads (each block's rows read whole), or one per KV head when there are
// too few tokens to keep every thread busy (a single long context). A prefill chunk is one item per KV head and
// run of kTokensTogether tokens: the run's query heads go through the passes as the heads of one query over the
// last token's context, and each earlier token's scores past its own context are set to -inf before the softmax,
// so their weights come out 0 (the same sums, bit for bit, as the token alone over its own context). Each thread
// takes a share of the items of about equal work.
template <typename T>
void attend_passes(const Pool<T>& p, const std::vector<Query>& queries, bool avx512) {
  const int64_t threads = at::get_num_threads(), num_kv_heads = p.num_kv_heads, head_size = p.head_size;
  const int64_t per_decode = static_cast<int64_t>(queries.size()) >= 2 * threads ? num_kv_heads : 1;
  std::vector<Item> items;
  for (size_t i = 0; i < queries.size();) {
    size_t end = i + 1;  // the sequence's queries, one after the other
    while (end < queries.size() && queries[end].seq == queries[i].seq) ++end;
    const Query& first = queries[i];
    if (end - i == 1) {
      for (int64_t g = 0; g < num_kv_heads; g += per_decode) {
        items.push_back({first.seq, first.token, 1, first.ctx, g, per_decode});
      }
    }
    for (size_t j = i; end - i > 1 && j < end; j += kTokensTogether) {
      const int64_t tokens = std::min<int64_t>(kTokensTogether, static_cast<int64_t>(end - j));
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        items.push_back({first.seq, queries[j].token, tokens, queries[j + tokens - 1].ctx, g, 1});
      }
    }
    i = end;
  }
  const int64_t most_heads = std::max(num_kv_heads, kTokensTogether) * p.group;
  const bool bf16 = std::is_same_v<T, c10::BFloat16>;
  const bool pairs = avx512 && bf16 && pagedserve_cpu_features::cpu_has_avx512_bf16();
  // The three passes of one instruction set, chosen once for the call.
  struct Passes {
    decltype(&pagedserve_cpu_attention::scores_avx512) scores;
    decltype(&pagedserve_cpu_attention::exponentiate_avx512) exponentiate;
    decltype(&pagedserve_cpu_attention::weighted_sum_avx512) weighted_sum;
  };
  const Passes passes = avx512 ? Passes{pagedserve_cpu_attention::scores_avx512,
                                        pagedserve_cpu_attention::exponentiate_avx512,
                                        pagedserve_cpu_attention::weighted_sum_avx512}
                               : Passes{pagedserve_cpu_attention::scores_avx2,
                                        pagedserve_cpu_attention::exponentiate_avx2,
                                        pagedserve_cpu_attention::weighted_sum_avx2};
  const std::vector<std::vector<int64_t>> shares = balance(
      static_cast<int64_t>(items.size()), threads,
      [&](int64_t i) { return items[i].ctx * items[i].tokens * items[i].kv_heads; });
  at::parallel_for(0, static_cast<int64_t>(shares.size()), 1, [&](int64_t first_share, int64_t last_share) {
    std::vector<float> scores, sums(most_heads), acc(most_heads * head_size), q(most_heads * head_size);
    // An item's first K block (the next item's is asked for ahead).
    const auto first_k = [&](const Item& item) {
      return p.k + item.first_kv * p.c_head + static_cast<int64_t>(p.table[item.seq * p.max_blocks]) * p.c_block;
    };
    for (int64_t share = first_share; share < last_share; ++share) {
      const std::vector<int64_t>& mine = shares[share];
      for (size_t i = 0; i < mine.size(); ++i) {
        const Item& item = items[mine[i]];
        const int64_t ctx = item.ctx, stride = padded(ctx), heads = item.kv_heads * p.group;  // a token's
        const int64_t head = item.first_kv * p.group, all = item.tokens * heads;
        for (int64_t t = 0; t < item.tokens; ++t) {
          p.load_queries(item.token + t, head, heads, &q[t * heads * head_size]);
        }
        scores.assign(all * stride, -std::numeric_limits<float>::infinity());
        const pagedserve_cpu_attention::Rows rows{p.k + item.first_kv * p.c_head,
                                                  p.v + item.first_kv * p.c_head,
                                                  bf16,
                                                  pairs,
                                                  p.table + item.seq * p.max_blocks,
                                                  ctx,
                                                  p.block_size,
                                                  p.c_block,
                                                  p.c_token,
                                                  p.c_head,
                                                  item.kv_heads,
                                                  head_size,
                                                  item.tokens * p.group,
                                                  p.scale,
                                                  i + 1 < mine.size() ? first_k(items[mine[i + 1]]) : nullptr};
        passes.scores(rows, q.data(), scores.data(), stride);
        for (int64_t t = 0; t + 1 < item.tokens; ++t) {  // past each earlier token's own context
          const int64_t own = ctx - (item.tokens - 1 - t);
          for (int64_t h = t * heads; h < (t + 1) * heads; ++h) {
            std::fill(&scores[h * stride + own], &scores[h * stride + ctx], -std::numeric_limits<float>::infinity());
          }
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        passes.exponentiate(scores.data(), all, stride, ctx, sums.data());
        passes.weighted_sum(rows, scores.data(), stride, acc.data());
        for (int64_t t = 0; t < item.tokens; ++t) {
          p.write_outputs(item.token + t, head, heads, &acc[t * heads * head_size], &sums[t * heads]);
        }
      }
    }
  });
}

// The loops of a build without AVX2. One work item per query token: its K rows, then its V rows, are read in
// order, all KV heads of a token at once. Each thread takes a share of the tokens of about equal context.
template <typename T>
void attend_plain(const Pool<T>& p, const std::vector<Query>& queries) {
  const int64_t num_heads = p.num_kv_heads * p.group, head_size = p.head_size;
  const std::vector<std::vector<int64_t>> shares = balance(static_cast<int64_t>(queries.size()),
                                                           at::get_num_threads(),
                                                           [&](int64_t i) { return queries[i].ctx; });
  at::parallel_for(0, static_cast<int64_t>(shares.size()), 1, [&](int64_t first_share, int64_t last_share) {
    std::vector<float> scores, sums(num_heads), acc(num_heads * head_size), q(num_heads * head_size);
    for (int64_t share = first_share; share < last_share; ++share) {
      for (const int64_t item : shares[share]) {
        const Query& query = queries[item];
        const int64_t ctx = query.ctx, stride = padded(ctx);
        const int32_t* row = p.table + query.seq * p.max_blocks;
        p.load_queries(query.token, 0, num_heads, q.data());
        scores.assign(num_heads * stride, -std::numeric_limits<float>::infinity());
        for (int64_t pos = 0; pos < ctx; ++pos) {
          const T* k_row = p.k + static_cast<int64_t>(row[pos / p.block_size]) * p.c_block +
                           (pos % p.block_size) * p.c_token;
          for (int64_t h = 0; h < num_heads; ++h) {
            scores[h * stride + pos] =
                dot(q.data() + h * head_size, k_row + (h / p.group) * p.c_head, head_size) * p.scale;
          }
        }
        exponentiate(scores.data(), num_heads, stride, ctx, sums.data());
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t pos = 0; pos < ctx; ++pos) {
          const T* v_row = p.v + static_cast<int64_t>(row[pos / p.block_size]) * p.c_block +
                           (pos % p.block_size) * p.c_token;
          for (int64_t h = 0; h < num_heads; ++h) {
            axpy(acc.data() + h * head_size, scores[h * stride + pos], v_row + (h / p.group) * p.c_head,
                 head_size);
          }
        }
        p.write_outputs(query.token, 0, num_heads, acc.data(), sums.data());
      }
    }
  });
}

template <typename T>
void attend(Tensor& out, const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
            const Tensor& block_table, const Tensor& seq_lens, const Tensor& query_start_loc, double scale,
            int64_t longest) {
  const int64_t num_seqs = seq_lens.size(0), num_heads = query.size(1);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2), head_size = k_cache.size(3);
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t max_blocks = block_table.size(1);
  PAGEDSERVE_CHECK(starts[0] == 0 && starts[num_seqs] <= query.size(0),
                   "query_start_loc must run from 0 to at most ", query.size(0), " tokens");
  std::vector<Query> queries;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t new_tokens = starts[s + 1] - starts[s];
    if (new_tokens < 1 || new_tokens > longest) continue;
    PAGEDSERVE_CHECK(lens[s] >= new_tokens && lens[s] <= max_blocks * block_size, "sequence ", s, " has context ",
                     lens[s], " for ", new_tokens, " new tokens and ", max_blocks, " blocks of ", block_size);
    for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b) {
      const int32_t block = table[s * max_blocks + b];
      PAGEDSERVE_CHECK(block >= 0 && block < num_blocks, "sequence ", s, " maps to block ", block);
    }
    // The i-th new token sees the cached context and the new tokens up to itself.
    for (int64_t i = 0; i < new_tokens; ++i) queries.push_back({s, starts[s] + i, lens[s] - new_tokens + 1 + i});
  }
  const Pool<T> pool{query.data_ptr<T>(), out.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                     table, max_blocks, block_size, num_kv_heads, head_size,
                     num_heads / num_kv_heads, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                     k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), static_cast<float>(scale)};
  const bool avx512 = avx512_loops(head_size);
  if (avx512 || pagedserve_cpu_attention::avx2_passes()) {
    attend_passes(pool, queries, avx512);
  } else {
    attend_plain(pool, queries);
  }
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def(
      "paged_attention_decode(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor seq_lens, Tensor query_start_loc, float scale) -> ()");
  // The same for every query token of the decodes and of the prefill chunks of up to `longest` tokens (where
  // the passes run; in a build without AVX2, the decodes alone), each over its context up to itself; longer
  // chunks' rows of out are left as they are. Returns the longest chunk it took.
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, int longest) -> int");
  // The kernels' AVX-512 loops on or off (cpu_features.h); returns whether they were on.
  m.def("set_avx512(bool enabled) -> bool", TORCH_FN(pagedserve_cpu_features::set_avx512));
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("paged_attention_decode", &paged_attention_decode);
  m.impl("paged_attention", &paged_attention_cpu);
}
