// The bfloat16 panel kernel on AMX tiles, where the CPU has AMX-BF16 (Sapphire Rapids and later).
//
// oneDNN lays a bfloat16 weight out as panels of [K / 2][P][2] (panel_tiles_avx512.cpp): row kp of a panel holds
// each output column's weights at k = 2 kp and 2 kp + 1, side by side. That is the layout AMX's TDPBF16PS takes
// for its second operand: a tile of 16 rows (pairs of k) by 16 columns (64 bytes) is 16 rows of a panel, 16
// columns wide, read with the panel's row stride. The rows of x are the first operand as they lie ([rows, K],
// 32 values of k a tile row), so nothing is copied but the rows of a partial group of 16, into zeros.
//
// One step takes 32 values of k for 32 rows by 32 columns: two tiles of rows, two of weights, four of sums, the
// eight AMX registers. A panel's sums go to a [rows, P] float32 scratch of the thread's, and each output is
// rounded once to bfloat16 from there (bias added first), as the AVX512_BF16 tiles' are. A row's sums do not
// depend on the rows beside it: a tile multiplies each of its rows by the weights alone.
//
// Compiled for every x86-64 build with GCC (the instructions are enabled for this file alone) and chosen at run
// time where the CPU has AMX-BF16 and Linux grants this process the tile state (arch_prctl).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_features.h"
#include "panel_linear.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && __GNUC__ >= 11
#define PAGEDSERVE_AMX_BUILT 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_math_avx512.h"
#endif

namespace pagedserve_cpu_panel {

#ifdef PAGEDSERVE_AMX_BUILT

namespace {

// Linux hands a process AMX's tile data state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

bool amx_granted() {
  static const bool granted = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

std::atomic<bool>& amx_switch() {
  static std::atomic<bool> on{amx_granted() && pagedserve_cpu_features::env_allows("PAGEDSERVE_AMX")};
  return on;
}

constexpr int64_t kTile = 16;        // rows of a tile, and columns of a weights' or sums' tile
constexpr int64_t kPairsStep = 16;   // pairs of k a step: a tile row of 64 bytes
// Pairs of k every pass takes before the next chunk, where a panel takes more than one pass (33 to 64 rows): 8
// KiB of a 32-column panel, in L1 for the passes after the first (benchmarks/panel_linear_bench.py --dtype
// bfloat16 on an Intel Xeon with AMX: 33 to 64 rows 5-10% faster than oneDNN with chunks of 64, 128 or 256
// pairs no better; whole, the passes after the first read the panel from L2 and were no faster than oneDNN).
constexpr int64_t kChunkPairs = 64;

// Tile registers: sums 0-3 (row tile r, column tile c at 2 r + c), rows 4-5, weights 6-7.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,sse")

// The thread's next panel, asked of L2 a few lines at each step of this panel's tiles. A panel is one contiguous
// run, which the hardware prefetcher follows; but from 17 rows a step's tile products take long enough that the
// memory and the arithmetic take turns, and the next panel's lines, spread over this panel's steps, arrive while
// it is multiplied (benchmarks/panel_linear_bench.py --dtype bfloat16, on an Intel Xeon with AMX: 24 and 32 rows
// 13-18% faster, 1 to 16 rows level). Asked into L1 instead, a line at a time 12 steps ahead, 5 to 32 rows ran
// 12-15% slower.
struct NextPanel {
  const char* line = nullptr;  // the next line to ask for
  const char* end = nullptr;
  int64_t per_step = 0;

  void step() {
    for (int64_t i = 0; i < per_step && line < end; ++i, line += 64) _mm_prefetch(line, _MM_HINT_T1);
  }
};

// R row tiles by C column tiles of sums over k_pairs pairs of k: row tile r's rows from a[r] (rows lda[r] bytes
// apart), a weights' tile from `b` (panel rows ldb bytes apart, column tile c at 64 c bytes), stored to `out`
// (floats, ldo bytes apart), added to the sums there where `add`. `stream`: the weights are read for the last
// time, and their tiles are loaded past L1 (TILELOADDT1), which leaves L1 to the rows' tiles that every panel
// reads again (1 to 32 rows 2-8% faster).
template <int R, int C>
void tiles(const uint16_t* const (&a)[2], const int64_t (&lda)[2], const uint16_t* b, int64_t ldb, int64_t k_pairs,
           float* out, int64_t ldo, bool add, bool stream, NextPanel& next) {
  auto* o = reinterpret_cast<char*>(out);
  if (add) {
    _tile_loadd(0, o, ldo);
    if (C > 1) _tile_loadd(1, o + 64, ldo);
    if (R > 1) _tile_loadd(2, o + kTile * ldo, ldo);
    if (R > 1 && C > 1) _tile_loadd(3, o + kTile * ldo + 64, ldo);
  } else {
    _tile_zero(0);
    if (C > 1) _tile_zero(1);
    if (R > 1) _tile_zero(2);
    if (R > 1 && C > 1) _tile_zero(3);
  }
  const auto* wa0 = reinterpret_cast<const char*>(a[0]);
  const auto* wa1 = reinterpret_cast<const char*>(a[1]);
  const auto* wb = reinterpret_cast<const char*>(b);
  for (int64_t kp = 0; kp < k_pairs; kp += kPairsStep) {
    next.step();
    const char* bk = wb + kp * ldb;
    _tile_loadd(4, wa0 + kp * 4, lda[0]);  // two bfloat16 a pair
    if (R > 1) _tile_loadd(5, wa1 + kp * 4, lda[1]);
    if (stream) {
      _tile_stream_loadd(6, bk, ldb);
      if (C > 1) _tile_stream_loadd(7, bk + 64, ldb);
    } else {
      _tile_loadd(6, bk, ldb);
      if (C > 1) _tile_loadd(7, bk + 64, ldb);
    }
    _tile_dpbf16ps(0, 4, 6);
    if (C > 1) _tile_dpbf16ps(1, 4, 7);
    if (R > 1) _tile_dpbf16ps(2, 5, 6);
    if (R > 1 && C > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, o, ldo);
  if (C > 1) _tile_stored(1, o + 64, ldo);
  if (R > 1) _tile_stored(2, o + kTile * ldo, ldo);
  if (R > 1 && C > 1) _tile_stored(3, o + kTile * ldo + 64, ldo);
}

void load_config() {
  // Static: GCC does not count LDTILECFG as reading its operand, and drops a local's stores.
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = kTile;
      c.colsb[t] = 64;
    }
    return c;
  }();
  _tile_loadconfig(&config);
}

void release() { _tile_release(); }

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")

// to[j] = sums[j] (+ bias[j]) rounded to bfloat16 for j < count (a multiple of 16), with the bits of
// pagedserve_cpu_math::bf16_bits: to nearest, ties to even, any NaN as the quiet 0x7FC0.
void round_row(const float* sums, const float* bias, int64_t count, uint16_t* to) {
  for (int64_t j = 0; j < count; j += 16) {
    __m512 v = pagedserve_cpu_math_avx512::load16(sums + j);
    if (bias) v = _mm512_add_ps(v, pagedserve_cpu_math_avx512::load16(bias + j));
    pagedserve_cpu_math_avx512::store16(to + j, v);
  }
}

#pragma GCC pop_options

}  // namespace

bool amx_bf16_ready() { return amx_granted(); }

bool amx_enabled() { return amx_switch().load(std::memory_order_relaxed); }

bool set_amx(bool enabled) { return amx_switch().exchange(enabled && amx_granted()); }

void panel_linear_bf16_amx(const uint16_t* x, int64_t rows, int64_t k_size, int64_t lda, const uint16_t* weight,
                           int64_t n, int64_t panel, const float* bias, uint16_t* out) {
  // The rows as whole tiles: the last partial group of 16 copied beside zeros (a tile reads 16 rows).
  const int64_t full = rows / kTile * kTile;
  const int64_t padded = (rows + kTile - 1) / kTile * kTile;
  std::vector<uint16_t> tail((padded - full) * k_size, 0);
  for (int64_t r = full; r < rows; ++r) std::memcpy(&tail[(r - full) * k_size], x + r * lda, k_size * 2);
  const auto row_group = [&](int64_t r0, int64_t* ld) -> const uint16_t* {
    if (r0 < full) {
      *ld = lda * 2;
      return x + r0 * lda;
    }
    *ld = k_size * 2;
    return tail.data() + (r0 - full) * k_size;
  };
  const int64_t col_tiles = panel / kTile;
  const int64_t k_pairs = k_size / 2;
  const int64_t ldb = panel * 4;  // bytes a panel row: P columns of a pair of bfloat16
  // The tiles' steps over a panel: a pass of up to two row tiles, a pair of column tiles, 32 values of k at a time.
  const int64_t panel_lines = panel * k_size * 2 / 64;
  const int64_t passes = (padded + 2 * kTile - 1) / (2 * kTile);
  const int64_t steps = passes * ((col_tiles + 1) / 2) * (k_pairs / kPairsStep);
  // Past 32 rows a panel takes more than one pass: K a chunk at a time, every pass over the chunk while its
  // weights are in L1, the sums stored between chunks. One pass takes K whole.
  const int64_t chunk = passes > 1 ? kChunkPairs : k_pairs;
  at::parallel_for(0, n / panel, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(padded * panel);
    const int64_t ldo = panel * 4;
    load_config();
    for (int64_t unit = begin; unit < end; ++unit) {
      const uint16_t* base = weight + unit * panel * k_size;
      const auto* following = reinterpret_cast<const char*>(base + panel * k_size);
      NextPanel next{following, unit + 1 < end ? following + panel_lines * 64 : following,
                     (panel_lines + steps - 1) / steps};
      for (int64_t kp0 = 0; kp0 < k_pairs; kp0 += chunk) {
        const int64_t kn = std::min(chunk, k_pairs - kp0);
        for (int64_t r0 = 0; r0 < padded;) {
          // Two row tiles a pass where two are left (each in x or in the tail: 17 rows as 16 in place and 1
          // copied, in one pass over the weights), else one.
          const uint16_t* a[2] = {};
          int64_t lda_of[2] = {};
          a[0] = row_group(r0, &lda_of[0]) + kp0 * 2;
          const bool two = r0 + kTile < padded;
          if (two) a[1] = row_group(r0 + kTile, &lda_of[1]) + kp0 * 2;
          const bool last = r0 + (two ? 2 : 1) * kTile >= padded;
          for (int64_t c = 0; c < col_tiles; c += 2) {
            const uint16_t* b = base + kp0 * panel * 2 + c * kTile * 2;
            float* o = sums.data() + r0 * panel + c * kTile;
            const bool pair = c + 1 < col_tiles, add = kp0 > 0;
            if (two && pair) tiles<2, 2>(a, lda_of, b, ldb, kn, o, ldo, add, last, next);
            else if (two) tiles<2, 1>(a, lda_of, b, ldb, kn, o, ldo, add, last, next);
            else if (pair) tiles<1, 2>(a, lda_of, b, ldb, kn, o, ldo, add, last, next);
            else tiles<1, 1>(a, lda_of, b, ldb, kn, o, ldo, add, last, next);
          }
          r0 += two ? 2 * kTile : kTile;
        }
      }
      const int64_t col = unit * panel;
      for (int64_t r = 0; r < rows; ++r) {
        round_row(sums.data() + r * panel, bias ? bias + col : nullptr, panel, out + r * n + col);
      }
    }
    release();
  });
}

#else

bool amx_bf16_ready() { return false; }
bool amx_enabled() { return false; }
bool set_amx(bool) { return false; }
void panel_linear_bf16_amx(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                           const float*, uint16_t*) {}

#endif

}  // namespace pagedserve_cpu_panel
