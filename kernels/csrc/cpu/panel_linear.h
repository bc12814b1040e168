// The linear layers of panel_linear_cpu.cpp, for the other CPU ops (the decode layers' loop).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace pagedserve_cpu_panel {

using at::Tensor;

// Whether this build multiplies with AVX2 and FMA, or this CPU with AVX-512 (else a plain loop, correct but slow).
bool panel_linear_vectorized();

// Whether this CPU multiplies bfloat16 panels (AVX512_BF16); elsewhere bfloat16 weights stay with oneDNN.
bool panel_linear_bf16();

// AVX-512 register tiles: rows (at most 6) x width (16 to 64) outputs over kn steps of k (panel_tiles_avx512.cpp).
// out [rows][ldo] gets init (the bias, or zeros) or its own values plus the sums over the steps; ahead: lines to
// prefetch, one per register of the width every `every` steps, or null. The bfloat16 tile's a and b are pairs of
// bfloat16, and kn, lda and ld count pairs.
void tile_f32_avx512(int64_t rows, int64_t width, const float* a, int64_t lda, const float* b, int64_t ld,
                     int64_t kn, float* out, int64_t ldo, const float* init, const float* ahead, int64_t every);
void tile_bf16_avx512(int64_t rows, int64_t width, const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ld,
                      int64_t kn, float* out, int64_t ldo, const float* init, const uint32_t* ahead,
                      int64_t every);

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
// none): through the panel kernel where the weight is float32 panels of `panel` columns and x has at most
// kPanelMaxRows rows, else through oneDNN. panel 0: oneDNN always.
Tensor packed_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t panel);

}  // namespace pagedserve_cpu_panel
