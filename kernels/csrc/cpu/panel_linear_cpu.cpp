// A linear layer over a few rows, against a weight in oneDNN's packed layout read in place:
// torch.ops.pagedserve_cpu.packed_linear.
//
// A decode step multiplies a few rows (one per sequence) by each weight, so the product is bound by streaming
// the weight from memory. oneDNN's kernels for so few rows leave part of that bandwidth unused. Where oneDNN
// packs a float32 weight [N, K] as panels of P output columns, each panel [K][P] (gpu_worker/engine/
// packed_linear.py finds out, per weight, by comparing the packed bytes with the plain weight), this kernel
// reads the same bytes: no second copy of the weights. Each thread takes a run of column strips and, a block
// of K at a time, multiplies every row by them with the block in L1, so the weight is read from memory once
// whatever the number of rows. Each output is one float sum over k in order, so a row's result does not
// depend on how many rows share the call or on the thread count. The register tiles are AVX2 here, AVX-512
// where the CPU has it (panel_tiles_avx512.cpp, the same sums); bfloat16 weights, laid out by oneDNN in pairs
// of k, go through AMX's tiles where the CPU has AMX-BF16 (panel_tiles_amx.cpp, up to kPanelMaxRowsAMX rows),
// else through AVX512_BF16's pair dot product where the CPU has it. Elsewhere oneDNN only emulates bfloat16
// (converting to float32 at a fraction of its float32 rate), and its layout is not pairs: there
// gpu_worker/engine/packed_linear.py packs the panels of pairs itself and this kernel takes every row count,
// with each pair of weights widened to float32 in registers (the AVX-512 or AVX2 tiles): half the bytes of a
// float32 weight to stream, multiplied at close to the float32 rate.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_features.h"
#include "cpu_math.h"
#include "panel_linear.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace pagedserve_cpu_panel {

namespace {

using pagedserve_cpu_features::cpu_has_avx512_bf16;
using pagedserve_cpu_features::avx512_enabled;

#define PAGEDSERVE_CHECK(cond, ...) TORCH_CHECK(cond, "pagedserve: ", __VA_ARGS__)

constexpr int64_t kStrip = 16;       // output columns a tile computes: two AVX2 registers of floats
constexpr int64_t kTileRows = 6;     // rows a tile computes: 12 accumulators, the rest of the registers free
constexpr int64_t kBlockK = 64;      // rows of a panel kept in L1 (with the next) while every row tile uses them
// From this many rows on, the AVX-512 tiles take k in blocks of up to kLongBlock values (288 rows of a bfloat16
// panel of pairs): a block that stays in L2, not L1. Each row of such a tile does enough work a line to be fed from
// L2, and each tile call, which loads and stores its sums, runs longer. The layers' matmuls of
// benchmarks/panel_linear_bench.py on an AVX-512 EPYC, timed against blocks of 64 in one process (a switch since
// removed): 4 to 7% faster from 20 to 64 rows in both dtypes; slower at 8 rows, where the weight's stream bounds
// the product; no faster on the AVX2 tiles (16 to 32 rows).
constexpr int64_t kLongBlocksFromRows = 16;
constexpr int64_t kLongBlock = 576;

// Whether the AVX-512 tiles take long blocks of K for `rows` rows of float32 (T a float) or bfloat16 pairs. On
// Intel's cores float32 takes them only past 64 rows: on a 2-core Xeon with AMX, the layers' matmuls of
// benchmarks/panel_linear_bench.py took 4 to 20% less time from 16 to 48 rows with blocks of 64 than with blocks
// of 576, decode steps of 16 rows 12 to 16% less and of 32 rows 4 to 7% (benchmarks/roofline.py); at 128 rows
// the long blocks were the faster ones, at 80 the short ones, at 96 neither (docs/benchmarks.md: where the short
// blocks stop paying is not settled). bfloat16's tiles (AVX512_BF16's or widened) were not timed against blocks
// of 64 there, and keep the long blocks measured on AMD's cores.
constexpr int64_t kLongBlocksFromRowsIntelF32 = 65;

template <typename T>
bool long_blocks(int64_t rows, int64_t widest) {
  static const bool intel = pagedserve_cpu_features::cpu_is_intel();
  const int64_t from = std::is_same_v<T, float> && intel ? kLongBlocksFromRowsIntelF32 : kLongBlocksFromRows;
  return widest > kStrip && rows >= from;
}

// A tile's rows and weights: float32 both, or (bfloat16 weights on CPUs without AVX512_BF16) rows widened to
// FloatPair and weights in pairs of k, b's rows ld pairs apart.
template <typename A>
using WeightOf = std::conditional_t<std::is_same_v<A, float>, float, uint32_t>;

#if defined(__AVX2__) && defined(__FMA__)

// rows x 16 outputs: out[r][j] (+)= sum over k of a[r][k] * b[k][j], b's rows ld floats apart. For pairs, each
// step takes the pairs' k values (shifted up 16 bits: float32) times every row's a[k], then their k + 1 values
// (low half cleared): the float32 tile's sums, k in order (a product of two bfloat16 values is exact in float32).
template <int R, typename A>
inline void tile(const A* a, int64_t lda, const WeightOf<A>* b, int64_t ld, int64_t kn, float* out, int64_t ldo,
                 const float* init, const WeightOf<A>* ahead, int64_t every) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const float* from = init ? init : out + r * ldo;
    lo[r] = _mm256_loadu_ps(from);
    hi[r] = _mm256_loadu_ps(from + 8);
  }
  // Every row's value (at `at`: a[r][k], or a half of its pair) times two registers of weights.
  const auto multiply = [&](const float* at, __m256 b0, __m256 b1) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(at + r * lda * (sizeof(A) / sizeof(float)));
      lo[r] = _mm256_fmadd_ps(x, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(x, b1, hi[r]);
    }
  };
  int64_t wait = 0;
  for (int64_t k = 0; k < kn; ++k) {
    const WeightOf<A>* bk = b + k * ld;
    if (ahead && wait-- == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
      ahead += kStrip;
      wait = every - 1;
    }
    if constexpr (std::is_same_v<A, float>) {
      multiply(a + k, _mm256_loadu_ps(bk), _mm256_loadu_ps(bk + 8));
    } else {
      const auto* pairs = reinterpret_cast<const __m256i*>(bk);
      const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
      multiply(&a[k].lo, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(pairs), 16)),
               _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(pairs + 1), 16)));
      multiply(&a[k].hi, _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(pairs), high)),
               _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(pairs + 1), high)));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * ldo, lo[r]);
    _mm256_storeu_ps(out + r * ldo + 8, hi[r]);
  }
}

#else

template <int R, typename A>
inline void tile(const A* a, int64_t lda, const WeightOf<A>* b, int64_t ld, int64_t kn, float* out, int64_t ldo,
                 const float* init, const WeightOf<A>*, int64_t) {
  float acc[R][kStrip];
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < kStrip; ++j) acc[r][j] = init ? init[j] : out[r * ldo + j];
  }
  for (int64_t k = 0; k < kn; ++k) {
    for (int r = 0; r < R; ++r) {
      for (int64_t j = 0; j < kStrip; ++j) {
        if constexpr (std::is_same_v<A, float>) {
          acc[r][j] = std::fma(a[r * lda + k], b[k * ld + j], acc[r][j]);
        } else {
          const uint32_t pair = b[k * ld + j];
          acc[r][j] = std::fma(a[r * lda + k].lo, pagedserve_cpu_math::bf16_float(pair & 0xFFFFu), acc[r][j]);
          acc[r][j] = std::fma(a[r * lda + k].hi, pagedserve_cpu_math::bf16_float(pair >> 16), acc[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < kStrip; ++j) out[r * ldo + j] = acc[r][j];
  }
}

#endif

template <typename A>
void tile_rows(int64_t rows, int64_t, const A* a, int64_t lda, const WeightOf<A>* b, int64_t ld, int64_t kn,
               float* out, int64_t ldo, const float* init, const WeightOf<A>* ahead, int64_t every) {
  switch (rows) {
    case 1: return tile<1>(a, lda, b, ld, kn, out, ldo, init, ahead, every);
    case 2: return tile<2>(a, lda, b, ld, kn, out, ldo, init, ahead, every);
    case 3: return tile<3>(a, lda, b, ld, kn, out, ldo, init, ahead, every);
    case 4: return tile<4>(a, lda, b, ld, kn, out, ldo, init, ahead, every);
    case 5: return tile<5>(a, lda, b, ld, kn, out, ldo, init, ahead, every);
    default: return tile<6>(a, lda, b, ld, kn, out, ldo, init, ahead, every);
  }
}

// The widest strip a tile of at most `widest` columns takes (up to four AVX-512 registers of 16) that divides
// `width`.
int64_t strip_of(int64_t width, int64_t widest) {
  for (int64_t strip : {64, 48, 32}) {
    if (strip <= widest && width % strip == 0) return strip;
  }
  return 16;
}

// From this many rows on, where the panels do not share out evenly among the threads (9 panels on 2 threads: 4.5
// each, not 5 and 4), a panel's rows may be split in halves between two threads. Below it the product is bound
// by the weight's stream, which each panel read once keeps fastest. Halves of the rows, not of the columns, keep
// the tiles as wide as the panel (the same matmuls, timed the same way: 1 to 2% faster in bfloat16 from 16 to 64
// rows; level in float32).
constexpr int64_t kHalvesFromRows = 16;
constexpr int64_t kScratchFromRows = 16;

// Whether the sums of `rows` rows n floats apart, kept in place in the output, would evict each other from L1
// between one block of K and the next: L1 picks a line's set by its address within 4 KiB (64 sets of 8 lines
// on the CPUs measured), so rows a multiple of 4 KiB apart (n of 1024, SmolLM2's gate_up of 3072, its
// vocabulary of 49152) all land in the same few sets. Those panels are summed in a scratch of the thread's,
// rows a panel apart, and copied out when done: the same sums. On a Zen 3 EPYC (AVX2 tiles) the layers' matmuls
// at 32 rows 2 to 3% faster (benchmarks/panel_linear_bench.py), a decode step of 32 rows 1.47x and 1.77x its
// bound before, 1.41x and 1.32x after (benchmarks/roofline.py, docs/benchmarks.md). The AVX-512 tiles go the
// same way (not measured on those CPUs).
bool rows_share_sets(int64_t n, int64_t rows) {
  const int64_t offsets = 4096 / std::gcd<int64_t>(n * static_cast<int64_t>(sizeof(float)), 4096);
  return rows >= kScratchFromRows && offsets * 8 < rows;
}

// a [rows, k_size] times the weight as n / panel panels [k_size][panel] of T (a float, or a pair of bfloat16),
// plus bias, as float32 sums; a's rows hold A (T, or a pair widened to FloatPair), k_size and lda count them.
// tile(rows, strip, ...) computes rows x strip outputs, strip at most `widest`. The sums go to `out` [rows, n]
// when it is given (through the scratch below, copied, where rows_share_sets); else each thread sums a panel at
// a time into a [rows, panel] scratch of its own. Either way finish(col, r0, r1, sums, ld) is called once rows
// r0 to r1 of the panel that starts at column col are done (all its rows, or half of them), its sums (from row
// 0, row stride ld) in cache.
template <typename A, typename T, typename Tile, typename Finish>
void multiply_panels(float* out, int64_t rows, const A* a, int64_t lda, const T* weight, int64_t n, int64_t k_size,
                     int64_t panel, int64_t widest, const float* bias, Tile tile, Finish finish) {
  static const float zeros[64] = {};
  const int64_t panels = n / panel;
  const bool halves = rows >= kHalvesFromRows && panels % at::get_num_threads() != 0;
  constexpr int64_t kValues = std::is_same_v<T, float> ? 1 : 2;  // values of k a T holds
  const int64_t block = long_blocks<T>(rows, widest) ? kLongBlock / kValues : kBlockK;
  const int64_t strip = strip_of(panel, widest);
  // Rows r0 to r1 of panel p into sums (the panel's, row stride ld). Each block of the panel, [block] of its rows,
  // is prefetched while the block before it is multiplied, and found in cache by every row tile.
  const auto multiply = [&](int64_t p, int64_t r0, int64_t r1, float* sums, int64_t ld) {
    // Rows shared evenly among the fewest tiles that take them (32 rows: 6, 6, 5, 5, 5, 5, not five of 6 and one
    // of 2): a tile of few rows has too few sums in flight to keep the multipliers busy.
    const int64_t count = r1 - r0, row_tiles = (count + kTileRows - 1) / kTileRows;
    const T* base = weight + p * panel * k_size;
    for (int64_t k0 = 0; k0 < k_size; k0 += block) {
      const int64_t kn = std::min(block, k_size - k0);
      const int64_t share = (kn + row_tiles - 1) / row_tiles * strip;  // a row tile's prefetched values
      for (int64_t c = 0; c < panel; c += strip) {
        const T* bs = base + k0 * panel + c;
        const float* init = k0 > 0 ? nullptr : (bias ? bias + p * panel + c : zeros);
        // The strip's share of the next block, kn * strip values, is prefetched spread over its row tiles,
        // each taking every row_tiles-th step: memory streams while the tiles multiply.
        const T* ahead = base + (k0 + block) * panel + c * kn;
        for (int64_t t = 0, r = r0; t < row_tiles; ++t) {
          const int64_t m = count / row_tiles + (t < count % row_tiles ? 1 : 0);
          tile(m, strip, a + r * lda + k0, lda, bs, panel, kn, sums + r * ld + c, ld, init, ahead, row_tiles);
          ahead += share;
          r += m;
        }
      }
    }
  };
  // Each thread takes a run of parts: whole panels, and the first or last rows of one at either end of its run.
  // Both threads that share a panel read all of its weights; the tiles stay as wide as the panel.
  const int64_t parts = halves ? 2 : 1, half = rows / 2;
  const bool in_place = out && !rows_share_sets(n, rows);
  at::parallel_for(0, panels * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(in_place ? 0 : rows * panel);
    const int64_t ld = in_place ? n : panel;
    for (int64_t u = begin; u < end;) {
      const int64_t p = u / parts, h = u % parts;
      const bool whole = h == 0 && u + parts <= end;
      const int64_t r0 = whole || h == 0 ? 0 : half, r1 = whole || h == 1 || !halves ? rows : half;
      float* sums = in_place ? out + p * panel : scratch.data();
      multiply(p, r0, r1, sums, ld);
      if (out && !in_place) {
        for (int64_t r = r0; r < r1; ++r) std::copy_n(sums + r * ld, panel, out + r * n + p * panel);
      }
      finish(p * panel, r0, r1, sums, ld);
      u += whole ? parts : 1;
    }
  });
}

void nothing_left(int64_t, int64_t, int64_t, const float*, int64_t) {}

std::atomic<bool>& avx512_bf16_tiles_switch() {
  static std::atomic<bool> on{cpu_has_avx512_bf16()};
  return on;
}

}  // namespace

bool panel_linear_vectorized() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return pagedserve_cpu_features::cpu_has_avx512();
#endif
}

bool panel_linear_bf16() { return cpu_has_avx512_bf16() || panel_linear_vectorized(); }

bool avx512_bf16_tiles_enabled() { return avx512_bf16_tiles_switch().load(std::memory_order_relaxed); }

bool set_avx512_bf16_tiles(bool enabled) {
  return avx512_bf16_tiles_switch().exchange(enabled && cpu_has_avx512_bf16());
}

namespace {

// Whether bfloat16 rows go to AMX's tiles: turned off with the AVX512_BF16 tiles too.
bool amx_taken() { return avx512_bf16_tiles_enabled() && amx_enabled(); }

}  // namespace

void panel_linear_into(Tensor& out, const Tensor& x, const float* weight, int64_t n, int64_t panel,
                       const Tensor& bias) {
  PAGEDSERVE_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "x must be float32 [rows, K]");
  PAGEDSERVE_CHECK(panel > 0 && panel % kStrip == 0 && n % panel == 0, "panels of ", panel,
                   " columns cannot tile ", n, " outputs");
  PAGEDSERVE_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == x.size(0) &&
                       out.size(1) == n,
                   "out must be a contiguous float32 [rows, N]");
  PAGEDSERVE_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.is_contiguous() &&
                                       bias.numel() == n),
                   "bias must be a contiguous float32 [N]");
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int64_t rows = x.size(0), k_size = x.size(1), lda = x.stride(0);
  if (avx512_enabled()) {
    multiply_panels(out.data_ptr<float>(), rows, x.data_ptr<float>(), lda, weight, n, k_size, panel,
                    64, b, tile_f32_avx512, nothing_left);
  } else {
    multiply_panels(out.data_ptr<float>(), rows, x.data_ptr<float>(), lda, weight, n, k_size, panel, kStrip, b,
                    tile_rows<float>, nothing_left);
  }
}

Tensor panel_linear_bf16_rows(const Tensor& x, const uint32_t* weight, int64_t n, int64_t panel, const Tensor& bias) {
  PAGEDSERVE_CHECK(panel_linear_bf16(), "the bfloat16 panel kernel needs AVX512_BF16, AVX-512, or AVX2 and FMA");
  PAGEDSERVE_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0 &&
                       x.stride(0) % 2 == 0,
                   "x must be bfloat16 [rows, K], K even");
  PAGEDSERVE_CHECK(panel > 0 && panel % kStrip == 0 && n % panel == 0, "panels of ", panel,
                   " columns cannot tile ", n, " outputs");
  PAGEDSERVE_CHECK(!bias.defined() || bias.numel() == n, "bias must have ", n, " values");
  const int64_t rows = x.size(0);
  Tensor out = at::empty({rows, n}, x.options());
  const Tensor b = bias.defined() ? bias.to(at::kFloat).contiguous() : Tensor();
  const float* bias_sums = b.defined() ? b.data_ptr<float>() : nullptr;
  auto* to = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  if (amx_taken() && x.size(1) % 32 == 0) {  // AMX tiles take k 32 at a time
    panel_linear_bf16_amx(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), rows, x.size(1),
                          x.stride(0), reinterpret_cast<const uint16_t*>(weight), n, panel, bias_sums, to);
    return out;
  }
  const auto* pairs = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const int64_t k_pairs = x.size(1) / 2, lda = x.stride(0) / 2;
  // Each output rounded once, from its float32 sum (bias included), as oneDNN rounds: a panel as soon as it is
  // done, from its thread's scratch.
  const auto round_panel = [&](int64_t col, int64_t r0, int64_t r1, const float* sums, int64_t ld) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t j = 0; j < panel; ++j) to[r * n + col + j] = pagedserve_cpu_math::bf16_bits(sums[r * ld + j]);
    }
  };
  if (avx512_bf16_tiles_enabled()) {
    multiply_panels(static_cast<float*>(nullptr), rows, pairs, lda, weight, n, k_pairs, panel, 64, bias_sums,
                    tile_bf16_avx512, round_panel);
    return out;
  }
  // The rows widened once, side by side: a float32 row [K] is its FloatPairs [K / 2].
  const Tensor widened_rows = x.to(at::kFloat).contiguous();
  const auto* widened = reinterpret_cast<const FloatPair*>(widened_rows.data_ptr<float>());
  if (avx512_enabled()) {
    multiply_panels(static_cast<float*>(nullptr), rows, widened, k_pairs, weight, n, k_pairs, panel, 64,
                    bias_sums, tile_bf16_widened_avx512, round_panel);
  } else {
    multiply_panels(static_cast<float*>(nullptr), rows, widened, k_pairs, weight, n, k_pairs, panel,
                    kStrip, bias_sums, tile_rows<FloatPair>, round_panel);
  }
  return out;
}

const float* packed_data(const Tensor& weight) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::data_ptr", "");
  torch::jit::Stack stack{weight};
  op.callBoxed(&stack);
  return reinterpret_cast<const float*>(stack[0].toInt());
}

Tensor onednn_linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x,
                          weight,
                          bias.defined() ? c10::IValue(bias) : c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

Tensor packed_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t panel) {
  // A plain weight is panels of pairs packed without oneDNN, [N / panel, K / 2, panel, 2]: the panel kernel
  // takes any number of rows.
  const bool own = !weight.is_mkldnn();
  const at::ScalarType dtype = x.scalar_type();
  PAGEDSERVE_CHECK(!own || (dtype == at::kBFloat16 && weight.scalar_type() == dtype && weight.dim() == 4 &&
                            weight.size(2) == panel && weight.size(3) == 2 && weight.is_contiguous()),
                   "a weight not packed by oneDNN must be bfloat16 panels of pairs [N / ", panel, ", K / 2, ",
                   panel, ", 2], for bfloat16 rows");
  const int64_t n = own ? weight.size(0) * weight.size(2) : weight.size(0);
  const int64_t k_size = own ? weight.size(1) * 2 : weight.size(1);
  const int64_t rows = x.dim() == 0 ? 0 : x.numel() / std::max<int64_t>(k_size, 1);
  const bool f32 = dtype == at::kFloat && rows <= kPanelMaxRows;
  const int64_t bf16_rows = own ? rows : amx_taken() ? kPanelMaxRowsAMX : kPanelMaxRowsBF16;
  const bool bf16 = dtype == at::kBFloat16 && rows <= bf16_rows;
  if (!own && (panel == 0 || rows == 0 || !(f32 || bf16))) {
    return onednn_linear(x, weight, bias);
  }
  PAGEDSERVE_CHECK(own || (weight.scalar_type() == dtype && weight.dim() == 2),
                   "weight must be a [N, K] of the rows' dtype packed for oneDNN");
  PAGEDSERVE_CHECK(x.size(-1) == k_size, "x must end in ", k_size, " features, got ", x.size(-1));
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n;
  if (rows == 0) return at::empty(sizes, x.options());
  // Named for the profiler as the op is, also where the decode layers' loop calls it directly.
  RECORD_FUNCTION("pagedserve_cpu::packed_linear", std::vector<c10::IValue>({x}));
  const Tensor flat = x.reshape({rows, k_size});
  const Tensor rows_in = flat.stride(1) == 1 ? flat : flat.contiguous();
  if (bf16) {
    const auto* pairs = reinterpret_cast<const uint32_t*>(own ? weight.data_ptr() : packed_data(weight));
    return panel_linear_bf16_rows(rows_in, pairs, n, panel, bias).view(sizes);
  }
  Tensor out = at::empty({rows, n}, x.options());
  panel_linear_into(out, rows_in, packed_data(weight), n, panel, bias);
  return out.view(sizes);
}

namespace {

Tensor packed_linear_op(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                        int64_t panel) {
  return packed_linear(x, weight, bias.has_value() ? *bias : Tensor(), panel);
}

}  // namespace

}  // namespace pagedserve_cpu_panel

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  // For every dispatch key: the weight is a oneDNN tensor, the rows a plain CPU one.
  m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias, int panel) -> Tensor",
        TORCH_FN(pagedserve_cpu_panel::packed_linear_op));
  m.def("panel_linear_vectorized() -> bool", TORCH_FN(pagedserve_cpu_panel::panel_linear_vectorized));
  m.def("panel_linear_bf16() -> bool", TORCH_FN(pagedserve_cpu_panel::panel_linear_bf16));
  m.def("amx_bf16_ready() -> bool", TORCH_FN(pagedserve_cpu_panel::amx_bf16_ready));
  m.def("set_amx(bool enabled) -> bool", TORCH_FN(pagedserve_cpu_panel::set_amx));
  m.def("set_avx512_bf16_tiles(bool enabled) -> bool", TORCH_FN(pagedserve_cpu_panel::set_avx512_bf16_tiles));
}
