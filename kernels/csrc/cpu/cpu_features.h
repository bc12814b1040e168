// What the CPU kernels may use of this CPU, asked at run time.
#pragma once

#include <cstdlib>
#include <cstring>

namespace pagedserve_cpu_features {

// AVX-512 (AVX512F) where the CPU has it, unless PAGEDSERVE_AVX512=0 (to compare with the AVX2 paths on one
// machine, and to test them there; read at every call, a few nanoseconds). GCC only: the AVX-512 loops are
// compiled through its target pragma.
inline bool avx512_enabled() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  const char* flag = std::getenv("PAGEDSERVE_AVX512");
  return __builtin_cpu_supports("avx512f") && !(flag && std::strcmp(flag, "0") == 0);
#else
  return false;
#endif
}

// AVX512_BF16's pair dot product (VDPBF16PS) where the CPU has it; not turned off by PAGEDSERVE_AVX512, as
// nothing else multiplies bfloat16 panels.
inline bool avx512_bf16_supported() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

}  // namespace pagedserve_cpu_features
