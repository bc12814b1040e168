// The elementwise ops of llama_ops_cpu.cpp on 16 lanes (llama_ops_avx512.cpp): only where
// pagedserve_cpu_features::avx512_enabled().
#pragma once

#include <cstdint>

namespace pagedserve_cpu_llama {

// silu(gate) * up over a row's first n - n % 16 values, each with the bits of silu_and_mul's own loop (float32,
// or bfloat16 bits); returns how many it wrote.
int64_t silu_mul_avx512(const float* gate, const float* up, float* out, int64_t n);
int64_t silu_mul_avx512(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n);

}  // namespace pagedserve_cpu_llama
