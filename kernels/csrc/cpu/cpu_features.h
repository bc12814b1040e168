// What the CPU kernels may use of this CPU, asked at run time.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace pagedserve_cpu_features {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// GCC only: the AVX-512 loops are compiled through its target pragma. AVX512DQ as well, which every AVX-512 CPU
// but the Xeon Phi has: the elementwise ops' loops are compiled for it (llama_ops_avx512.cpp).
inline bool cpu_has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq"); }
// AVX512_BF16's pair dot product (VDPBF16PS). The bfloat16 panel kernel's tiles that take it are not turned off
// with the AVX-512 loops (set_avx512) but by set_avx512_bf16_tiles (panel_linear.h), to its widened tiles.
inline bool cpu_has_avx512_bf16() { return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16"); }
// An Intel core: where a kernel's best choice was measured to differ between Intel's cores and AMD's.
inline bool cpu_is_intel() { return __builtin_cpu_is("intel"); }
#else
inline bool cpu_has_avx512() { return false; }
inline bool cpu_has_avx512_bf16() { return false; }
inline bool cpu_is_intel() { return false; }
#endif

// Whether the environment leaves a switch on: anything but `name`=0.
inline bool env_allows(const char* name) {
  const char* flag = std::getenv(name);
  return !(flag && std::strcmp(flag, "0") == 0);
}

// Whether the kernels take their AVX-512 loops: where the CPU has AVX512F, unless PAGEDSERVE_AVX512=0 when
// first asked (to compare with the AVX2 loops on one machine); set_avx512 switches it (the tests run both).
inline std::atomic<bool>& avx512_switch() {
  static std::atomic<bool> on{cpu_has_avx512() && env_allows("PAGEDSERVE_AVX512")};
  return on;
}

inline bool avx512_enabled() { return avx512_switch().load(std::memory_order_relaxed); }

// Turns the AVX-512 loops on (where the CPU has them) or off; returns whether they were on.
inline bool set_avx512(bool enabled) { return avx512_switch().exchange(enabled && cpu_has_avx512()); }

}  // namespace pagedserve_cpu_features
