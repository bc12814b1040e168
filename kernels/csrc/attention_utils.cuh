// Device helpers shared by the attention kernels: 16-byte loads, conversions to fp32, warp reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace pagedserve {

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

__host__ __device__ constexpr int next_pow2(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}

// A 16-byte global load. K/V are read-only for the whole kernel, so the non-coherent path is safe.
__device__ __forceinline__ uint4 load_16B(const void* ptr) {
  return __ldg(reinterpret_cast<const uint4*>(ptr));
}

template <typename scalar_t>
__device__ __forceinline__ float to_float(scalar_t x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return x;
  } else if constexpr (std::is_same_v<scalar_t, __half>) {
    return __half2float(x);
  } else {
    return __bfloat162float(x);
  }
}

template <typename scalar_t>
__device__ __forceinline__ scalar_t from_float(float x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return x;
  } else if constexpr (std::is_same_v<scalar_t, __half>) {
    return __float2half_rn(x);
  } else {
    return __float2bfloat16_rn(x);
  }
}

// Two packed 16-bit values (low half first in memory) to two floats.
template <typename scalar_t>
__device__ __forceinline__ float2 unpack_pair(uint32_t word) {
  if constexpr (std::is_same_v<scalar_t, __half>) {
    __half2 h;
    static_assert(sizeof(h) == sizeof(word));
    memcpy(&h, &word, sizeof(word));
    return __half22float2(h);
  } else {
    // bf16 is the top half of an fp32: a shift or a mask is the whole conversion.
    return make_float2(__uint_as_float(word << 16), __uint_as_float(word & 0xffff0000u));
  }
}

// The 16 / sizeof(scalar_t) elements of one 16-byte vector, as floats.
template <typename scalar_t>
__device__ __forceinline__ void unpack_16B(const uint4& raw, float* out) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
  } else {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = unpack_pair<scalar_t>(words[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
}

// Sum over the WIDTH lanes of an aligned lane group. The xor butterfly adds the same operands in every
// lane (a + b == b + a exactly), so all lanes of the group end up with bitwise identical totals.
template <int WIDTH>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int offset = WIDTH / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// 2^x in one MUFU instruction (exp2f adds range fix-ups for denormal results; softmax weights that small
// count for nothing). 2^-inf is 0.
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

// exp2(x - max) that is 0 instead of NaN when no finite logit has been seen (max is -inf).
__device__ __forceinline__ float exp2_diff(float x, float max) {
  return max == -INFINITY ? 0.f : fast_exp2(x - max);
}

// Max and sum over a whole CTA; every thread gets the result. scratch holds one float per warp.
template <int NUM_THREADS>
__device__ __forceinline__ float block_max(float x, float* scratch) {
  constexpr int kWarps = NUM_THREADS / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  __syncthreads();  // scratch may still be read by an earlier reduction
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  x = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) x = fmaxf(x, scratch[w]);
  return x;
}

template <int NUM_THREADS>
__device__ __forceinline__ float block_sum(float x, float* scratch) {
  constexpr int kWarps = NUM_THREADS / 32;
  x = group_sum<32>(x);
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  x = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) x += scratch[w];
  return x;
}

}  // namespace pagedserve
