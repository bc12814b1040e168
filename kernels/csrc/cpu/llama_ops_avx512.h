// The elementwise ops of llama_ops_cpu.cpp on 16 lanes (llama_ops_avx512.cpp): only where
// pagedserve_cpu_features::avx512_enabled().
#pragma once

#include <cstdint>

namespace pagedserve_cpu_llama {

// silu(gate) * up over a row's first n - n % 16 values, each with the bits of silu_and_mul's own loop (float32,
// or bfloat16 bits); returns how many it wrote.
int64_t silu_mul_avx512(const float* gate, const float* up, float* out, int64_t n);
int64_t silu_mul_avx512(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n);

// The RMS norm's passes over a row of n values (norm_rows), each over the first n - n % 16 values; each returns
// how many it took. residual += x, rounded, and the sum as stored into row; the eight running sums of squares
// (in double) added to over the first n - n % 8 values; out = weight * (row * inv as stored), rounded.
int64_t add_residual_avx512(float* residual, const float* x, float* row, int64_t n);
int64_t add_residual_avx512(uint16_t* residual, const uint16_t* x, float* row, int64_t n);
int64_t sum_squares_avx512(const float* row, int64_t n, double* sums);
int64_t scale_row_avx512(float* out, const float* row, const float* weight, float inv, int64_t n);
int64_t scale_row_avx512(uint16_t* out, const float* row, const uint16_t* weight, float inv, int64_t n);

// One head's rotary embedding, as rotate in llama_ops_cpu.cpp; false (nothing written) where half the head is
// not a multiple of 16.
bool rotate_avx512(float* out, const float* x, const float* cos, const float* sin, int64_t dim);
bool rotate_avx512(uint16_t* out, const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t dim);

}  // namespace pagedserve_cpu_llama
