// The linear layers of panel_linear_cpu.cpp, for the other CPU ops (the decode layers' loop).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace pagedserve_cpu_panel {

using at::Tensor;

// Whether this build multiplies with AVX2 and FMA, or this CPU with AVX-512 (else a plain loop, correct but slow).
bool panel_linear_vectorized();

// Whether this CPU multiplies bfloat16 panels: by AVX512_BF16's pair dot product, or else with each pair of
// weights widened to float32 (AVX-512 or AVX2 and FMA). Elsewhere bfloat16 weights stay with oneDNN.
bool panel_linear_bf16();

// Whether the bfloat16 panel kernel takes AVX512_BF16's tiles (and AMX's, where on): where the CPU has them,
// unless set_avx512_bf16_tiles turned them off (the tests run the widened tiles on such CPUs too); returns
// whether they were on.
bool avx512_bf16_tiles_enabled();
bool set_avx512_bf16_tiles(bool enabled);

// A row's values at k and k + 1 widened to float32: the rows of a bfloat16 product on CPUs without AVX512_BF16,
// widened once a call (a float32 copy of the rows), so a tile broadcasts each value straight from memory.
struct FloatPair {
  float lo, hi;  // k, k + 1
};
static_assert(sizeof(FloatPair) == 2 * sizeof(float), "a float32 row [K] is read as its FloatPairs [K / 2]");

// AVX-512 register tiles: rows (at most 6) x width (16 to 64) outputs over kn steps of k (panel_tiles_avx512.cpp).
// out [rows][ldo] gets init (the bias, or zeros) or its own values plus the sums over the steps; ahead: lines to
// prefetch, one per register of the width every `every` steps, or null. The bfloat16 tile's a and b are pairs of
// bfloat16, and kn, lda and ld count pairs.
void tile_f32_avx512(int64_t rows, int64_t width, const float* a, int64_t lda, const float* b, int64_t ld,
                     int64_t kn, float* out, int64_t ldo, const float* init, const float* ahead, int64_t every);
void tile_bf16_avx512(int64_t rows, int64_t width, const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ld,
                      int64_t kn, float* out, int64_t ldo, const float* init, const uint32_t* ahead,
                      int64_t every);
// The bfloat16 tile without AVX512_BF16: b's pairs widened in registers, a's already (FloatPair). The sums are
// the float32 tile's, k in order: each product of two bfloat16 values is exact in float32.
void tile_bf16_widened_avx512(int64_t rows, int64_t width, const FloatPair* a, int64_t lda, const uint32_t* b,
                              int64_t ld, int64_t kn, float* out, int64_t ldo, const float* init,
                              const uint32_t* ahead, int64_t every);

// AMX's tiles for bfloat16 panels (panel_tiles_amx.cpp): whether this CPU has them and Linux grants their state
// to this process; whether panel_linear_bf16_rows takes them (unless PAGEDSERVE_AMX=0 when first asked);
// set_amx turns them on (where ready) or off and returns whether they were on.
bool amx_bf16_ready();
bool amx_enabled();
bool set_amx(bool enabled);

// x [rows, K] (bfloat16, rows lda values apart, K a multiple of 32) times the weight packed as n / panel panels
// of [K / 2][panel] pairs, plus bias (float32, or null): out [rows, n], each output rounded once to bfloat16.
void panel_linear_bf16_amx(const uint16_t* x, int64_t rows, int64_t k_size, int64_t lda, const uint16_t* weight,
                           int64_t n, int64_t panel, const float* bias, uint16_t* out);

// The base address of a oneDNN tensor's packed bytes.
const float* packed_data(const Tensor& weight);

// out [rows, n] = x [rows, K] times the weight packed as n / panel panels of [K][panel] floats, plus bias.
void panel_linear_into(Tensor& out, const Tensor& x, const float* weight, int64_t n, int64_t panel,
                       const Tensor& bias);

// x [rows, K] (bfloat16) times the weight packed as n / panel panels of [K / 2][panel] pairs of bfloat16, plus
// bias: float32 sums, each rounded once to bfloat16. Only where panel_linear_bf16().
Tensor panel_linear_bf16_rows(const Tensor& x, const uint32_t* weight, int64_t n, int64_t panel, const Tensor& bias);

// Up to this many rows the panel kernel outruns oneDNN's (about 1.1x at 128 rows, and oneDNN is ahead by 256).
constexpr int64_t kPanelMaxRows = 128;
// The same for bfloat16 weights (benchmarks/panel_linear_bench.py --dtype bfloat16).
constexpr int64_t kPanelMaxRowsBF16 = 128;
// On AMX tiles (panel_tiles_amx.cpp), where oneDNN runs AMX too: 5-10% ahead of it from 33 to 64 rows (in chunks
// of K), not measured past.
constexpr int64_t kPanelMaxRowsAMX = 64;

// x [..., K] times a weight packed for oneDNN (gpu_worker/engine/packed_linear.py), plus bias (undefined for
// none): through the panel kernel where the weight is panels of `panel` columns and x has at most
// kPanelMaxRows rows, else through oneDNN. panel 0: oneDNN always. A weight that is a plain bfloat16 tensor
// [N / panel, K / 2, panel, 2] holds panels of pairs packed without oneDNN (on CPUs where oneDNN only emulates
// bfloat16) and goes through the panel kernel for any number of rows.
Tensor packed_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t panel);

}  // namespace pagedserve_cpu_panel
