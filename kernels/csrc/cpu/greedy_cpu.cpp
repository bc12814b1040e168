// Greedy decoding's pick on the CPU: each row's index of its first largest value, read from the logits as the LM
// head left them (float32 or bfloat16): torch.ops.pagedserve_cpu.first_max_ids.
//
// The sampler took torch.max over a float32 copy of the logits: in W2 in bfloat16 on a 2-core Intel Xeon
// (benchmarks/profile_steps.py --dtype bfloat16) 0.23 s of torch.max and most of 0.16 s of copies, where this
// takes 0.07 s. Each row is read twice in place: once for its largest value, once for the first index that
// holds it. A row with a NaN gives its first NaN, as torch.max and argmax do.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_math.h"

namespace {

using at::Tensor;
using namespace pagedserve_cpu_math;

#define PAGEDSERVE_CHECK(cond, ...) TORCH_CHECK(cond, "pagedserve: ", __VA_ARGS__)

// Rows a thread takes at least: a row of a large vocabulary is some microseconds of work.
constexpr int64_t kRowsPerTask = 2;

template <typename T>
int64_t first_max(const T* row, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  constexpr int64_t kLanes = 8;
  __m256 bests = _mm256_set1_ps(best);
  __m256 nans = _mm256_setzero_ps();
  for (; d + kLanes <= n; d += kLanes) {
    const __m256 v = load8(row + d);
    bests = _mm256_max_ps(bests, v);  // a NaN may take a lane's place; the row's answer is then its first NaN
    nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, bests);
  for (const float x : lanes) best = x > best ? x : best;
  nan = _mm256_movemask_ps(nans) != 0;
#endif
  for (; d < n; ++d) {
    const float x = to_float(row[d]);
    nan = nan || std::isnan(x);
    best = x > best ? x : best;
  }
  d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 wanted = _mm256_set1_ps(best);
  for (; d + kLanes <= n; d += kLanes) {
    const __m256 v = load8(row + d);
    const int hits = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, wanted, _CMP_EQ_OQ));
    if (hits) return d + __builtin_ctz(static_cast<unsigned>(hits));
  }
#endif
  for (; d < n; ++d) {
    const float x = to_float(row[d]);
    if (nan ? std::isnan(x) : x == best) return d;
  }
  return 0;  // not reached: the row holds its own largest value
}

template <typename T>
void pick_rows(const Tensor& logits, Tensor& ids) {
  const int64_t n = logits.size(1), stride = logits.stride(0);
  const T* base = logits.data_ptr<T>();
  int64_t* out = ids.data_ptr<int64_t>();
  at::parallel_for(0, logits.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = first_max(base + i * stride, n);
  });
}

Tensor first_max_ids(const Tensor& logits) {
  const auto dtype = logits.scalar_type();
  PAGEDSERVE_CHECK(logits.device().is_cpu(), "logits must be a CPU tensor");
  PAGEDSERVE_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16 logits, got ", dtype);
  PAGEDSERVE_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1,
                   "logits must be [rows, vocab], contiguous in the vocabulary");
  Tensor ids = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  if (dtype == at::kFloat) {
    pick_rows<float>(logits, ids);
  } else {
    pick_rows<c10::BFloat16>(logits, ids);
  }
  return ids;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) { m.def("first_max_ids(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("first_max_ids", &first_max_ids); }
