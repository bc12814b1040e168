// Paged-attention decode: one query token per sequence attending over its paged K/V.
//
// One CTA per (sequence, KV head, group of up to GROUP_TILE query heads of that KV head[, partition]): each
// K/V row is loaded once and used by every query head that shares it (GQA). A lane group of LANES threads
// holds one token's row, one 16-byte vector per lane; the CTA's lane groups walk the context in tiles of
// TOKENS tokens, each keeping its own online softmax (running max, sum and fp32 output) in registers. The
// lane groups are then merged: first inside each warp by shuffles, then across warps in shared memory.
// Logits live in the log2 domain (the query is pre-multiplied by scale * log2(e)): one ex2 per exponential.
#pragma once

#include <type_traits>

#include "attention_utils.cuh"
#include "paged_attention.h"
#include "paged_attention_reduce.cuh"

namespace pagedserve {

constexpr int kDecodeThreads = 128;

// Query heads per CTA for a GQA group of group_size heads: the smallest compiled tile that holds the group,
// capped at 8 (the fp32 accumulators of 8 heads already take 64 registers per thread).
__host__ __device__ constexpr int decode_group_tile(int group_size) {
  return group_size <= 1 ? 1 : group_size <= 2 ? 2 : group_size <= 4 ? 4 : 8;
}

template <typename scalar_t, int HEAD_SIZE, int NUM_THREADS, int GROUP_TILE>
struct DecodeLayout {
  static constexpr int kVec = 16 / sizeof(scalar_t);        // elements per 16-byte load
  static constexpr int kNumVecs = HEAD_SIZE / kVec;         // 16-byte vectors in one head row
  static constexpr int kLanes = next_pow2(kNumVecs) < 32 ? next_pow2(kNumVecs) : 32;  // threads per token
  static constexpr int kVecsPerLane = ceil_div(kNumVecs, kLanes);
  static constexpr int kDims = kVecsPerLane * kVec;         // elements of a row held by one lane
  static constexpr bool kPadded = kNumVecs % kLanes != 0;   // head sizes like 80: some lanes sit idle
  static constexpr int kGroups = NUM_THREADS / kLanes;      // tokens in flight side by side
  static constexpr int kWarps = NUM_THREADS / 32;
  // Tokens per lane group per step: all their K and V loads (8 x 16 bytes a lane) are issued before the
  // first is used. With 8 heads that is about 235 registers and 2 CTAs per SM, still without spills.
  static constexpr int kTokens = 4;
  static_assert(HEAD_SIZE % kVec == 0, "a head row must be a whole number of 16-byte vectors");
  static_assert(NUM_THREADS % 32 == 0 && kLanes <= 32, "lane groups must not straddle warps");
  static_assert(kDecodePartitionSize % kTokens == 0, "a partition must be a whole number of token tiles");
};

template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, int GROUP_TILE>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_decode_kernel(const DecodeArgs args) {
  using L = DecodeLayout<scalar_t, HEAD_SIZE, NUM_THREADS, GROUP_TILE>;
  constexpr int VEC = L::kVec, LANES = L::kLanes, DIMS = L::kDims, TOKENS = L::kTokens;
  static_assert(BLOCK_SIZE % TOKENS == 0, "a token tile must not straddle two KV blocks");

  const int seq = blockIdx.y;
  const int q_token = args.query_start_loc[seq];
  if (args.query_start_loc[seq + 1] - q_token != 1) return;  // a prefill chunk: not this kernel's job
  const int seq_len = args.seq_lens[seq];
  const bool split = args.num_partitions > 0;
  const int begin = split ? blockIdx.z * kDecodePartitionSize : 0;
  if (begin >= seq_len) return;  // the whole CTA leaves together, before any barrier
  const int end = split ? min(seq_len, begin + kDecodePartitionSize) : seq_len;

  const int group_size = args.num_heads / args.num_kv_heads;
  const int num_head_tiles = ceil_div(group_size, GROUP_TILE);
  const int kv_head = blockIdx.x / num_head_tiles;
  const int head0 = kv_head * group_size + (blockIdx.x % num_head_tiles) * GROUP_TILE;
  const int num_active = min(GROUP_TILE, (kv_head + 1) * group_size - head0);  // same for the whole CTA

  const int lane = threadIdx.x % LANES;
  const int group = threadIdx.x / LANES;
  // This lane's vector i covers elements [(i * LANES + lane) * VEC, + VEC) of a head row.
  auto vec_offset = [&](int i) { return (i * LANES + lane) * VEC; };
  auto vec_active = [&](int i) { return !L::kPadded || i * LANES + lane < L::kNumVecs; };

  float q[GROUP_TILE][DIMS];
  {
    const scalar_t* query = static_cast<const scalar_t*>(args.query) + q_token * args.q_stride_token;
    const float q_scale = args.scale * 1.4426950408889634f;  // log2(e)
#pragma unroll
    for (int g = 0; g < GROUP_TILE; ++g) {
#pragma unroll
      for (int i = 0; i < L::kVecsPerLane; ++i) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          const bool ok = g < num_active && vec_active(i);
          const int64_t at = (head0 + g) * args.q_stride_head + vec_offset(i) + v;
          q[g][i * VEC + v] = ok ? to_float(query[at]) * q_scale : 0.f;
        }
      }
    }
  }

  float m[GROUP_TILE], l[GROUP_TILE], acc[GROUP_TILE][DIMS];
#pragma unroll
  for (int g = 0; g < GROUP_TILE; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < DIMS; ++e) acc[g][e] = 0.f;
  }

  const scalar_t* k_cache = static_cast<const scalar_t*>(args.k_cache) + kv_head * args.cache_stride_head;
  const scalar_t* v_cache = static_cast<const scalar_t*>(args.v_cache) + kv_head * args.cache_stride_head;
  // Offsets inside one block fit in 32 bits (the binding checks), which keeps the address math short.
  const int token_stride = static_cast<int>(args.cache_stride_token);
  const int32_t* block_row = args.block_table + seq * args.block_table_stride;
  const int tile_end = ceil_div(end, TOKENS);

  // The block number of this lane group's next tile, read a step ahead so that the K/V loads never wait
  // on the block table.
  auto block_of = [&](int token0) { return token0 < end ? block_row[token0 / BLOCK_SIZE] : 0; };
  int32_t next_block = block_of((begin / TOKENS + group) * TOKENS);

  // One step: every lane group takes its tile of TOKENS tokens and folds it into its online softmax. Only
  // the last step of the range can hold tokens past its end (std::true_type): it checks each token, reads
  // nothing for those past the end, and counts them as -inf. The steps before it run without checks.
  auto step = [&](int tile0, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    const int token0 = (tile0 + group) * TOKENS;
    // Widen the block number before it meets the strides: block * stride overflows 32 bits on big pools.
    const int64_t block_start = static_cast<int64_t>(next_block) * args.cache_stride_block;
    next_block = block_of(token0 + L::kGroups * TOKENS);
    const scalar_t* k_block = k_cache + block_start;
    const scalar_t* v_block = v_cache + block_start;
    const int row0 = (token0 % BLOCK_SIZE) * token_stride;
    uint4 k_raw[TOKENS][L::kVecsPerLane], v_raw[TOKENS][L::kVecsPerLane];
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
#pragma unroll
      for (int i = 0; i < L::kVecsPerLane; ++i) {
        // Slots past the context are never read: they may hold stale or never-written memory.
        const bool ok = (!kMasked || token0 + t < end) && vec_active(i);
        const int at = row0 + t * token_stride + vec_offset(i);
        k_raw[t][i] = ok ? load_16B(k_block + at) : make_uint4(0, 0, 0, 0);
        v_raw[t][i] = ok ? load_16B(v_block + at) : make_uint4(0, 0, 0, 0);
      }
    }

    float s[GROUP_TILE][TOKENS];  // logits, then probabilities
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
      float k[DIMS];
#pragma unroll
      for (int i = 0; i < L::kVecsPerLane; ++i) unpack_16B<scalar_t>(k_raw[t][i], &k[i * VEC]);
      // Heads past num_active (a group that does not fill the tile) have q = 0 and are computed anyway:
      // cheaper than branching around them, and never written out.
#pragma unroll
      for (int g = 0; g < GROUP_TILE; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < DIMS; ++e) dot = fmaf(q[g][e], k[e], dot);
        dot = group_sum<LANES>(dot);
        s[g][t] = !kMasked || token0 + t < end ? dot : -INFINITY;
      }
    }

#pragma unroll
    for (int g = 0; g < GROUP_TILE; ++g) {
      float tile_max = s[g][0];
#pragma unroll
      for (int t = 1; t < TOKENS; ++t) tile_max = fmaxf(tile_max, s[g][t]);
      // Unmasked, the new maximum is finite and exp2(-inf - max) is the 0 that the first step needs.
      const float new_m = fmaxf(m[g], tile_max);
      const float rescale = kMasked ? exp2_diff(m[g], new_m) : fast_exp2(m[g] - new_m);
      m[g] = new_m;
      l[g] *= rescale;
#pragma unroll
      for (int e = 0; e < DIMS; ++e) acc[g][e] *= rescale;
#pragma unroll
      for (int t = 0; t < TOKENS; ++t) {
        s[g][t] = kMasked ? exp2_diff(s[g][t], new_m) : fast_exp2(s[g][t] - new_m);
        l[g] += s[g][t];
      }
    }

#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
      float v[DIMS];
#pragma unroll
      for (int i = 0; i < L::kVecsPerLane; ++i) unpack_16B<scalar_t>(v_raw[t][i], &v[i * VEC]);
#pragma unroll
      for (int g = 0; g < GROUP_TILE; ++g) {
#pragma unroll
        for (int e = 0; e < DIMS; ++e) acc[g][e] = fmaf(s[g][t], v[e], acc[g][e]);
      }
    }
  };

  // Every thread runs the same steps (the shuffles need the whole warp). At most one step is left after
  // the full ones: those end at the last whole tile, and one step covers kGroups tiles.
  int tile0 = begin / TOKENS;
  for (; tile0 + L::kGroups <= end / TOKENS; tile0 += L::kGroups) step(tile0, std::false_type{});
  if (tile0 < tile_end) step(tile0, std::true_type{});

  // Merge the lane groups of each warp: after the butterfly every group holds the warp's state.
#pragma unroll
  for (int offset = LANES; offset < 32; offset *= 2) {
#pragma unroll
    for (int g = 0; g < GROUP_TILE; ++g) {
      const float m_other = __shfl_xor_sync(0xffffffffu, m[g], offset);
      const float l_other = __shfl_xor_sync(0xffffffffu, l[g], offset);
      const float new_m = fmaxf(m[g], m_other);
      const float mine = exp2_diff(m[g], new_m), theirs = exp2_diff(m_other, new_m);
      l[g] = l[g] * mine + l_other * theirs;
#pragma unroll
      for (int e = 0; e < DIMS; ++e) {
        acc[g][e] = acc[g][e] * mine + __shfl_xor_sync(0xffffffffu, acc[g][e], offset) * theirs;
      }
      m[g] = new_m;
    }
  }

  // Merge the warps through shared memory; the first lane group of each warp speaks for it.
  __shared__ float warp_m[L::kWarps][GROUP_TILE];
  __shared__ float warp_l[L::kWarps][GROUP_TILE];
  __shared__ float warp_acc[L::kWarps][GROUP_TILE][HEAD_SIZE];
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 < LANES) {
#pragma unroll
    for (int g = 0; g < GROUP_TILE; ++g) {
      if (lane == 0) {
        warp_m[warp][g] = m[g];
        warp_l[warp][g] = l[g];
      }
#pragma unroll
      for (int i = 0; i < L::kVecsPerLane; ++i) {
        if (!vec_active(i)) continue;
#pragma unroll
        for (int v = 0; v < VEC; ++v) warp_acc[warp][g][vec_offset(i) + v] = acc[g][i * VEC + v];
      }
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < num_active * HEAD_SIZE; idx += NUM_THREADS) {
    const int g = idx / HEAD_SIZE, d = idx % HEAD_SIZE;
    float max_logit = -INFINITY;
#pragma unroll
    for (int w = 0; w < L::kWarps; ++w) max_logit = fmaxf(max_logit, warp_m[w][g]);
    float sum = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < L::kWarps; ++w) {
      const float c = exp2_diff(warp_m[w][g], max_logit);  // 0 for a warp that saw no token
      sum += warp_l[w][g] * c;
      o += warp_acc[w][g][d] * c;
    }
    o /= sum;  // sum >= 1: the token holding the maximum contributes exp2(0)
    const int head = head0 + g;
    if (split) {
      const int64_t row =
          (static_cast<int64_t>(seq) * args.num_heads + head) * args.num_partitions + blockIdx.z;
      args.tmp_out[row * HEAD_SIZE + d] = o;
      if (d == 0) {
        args.max_logits[row] = max_logit;
        args.exp_sums[row] = sum;
      }
    } else {
      scalar_t* out = static_cast<scalar_t*>(args.out);
      out[q_token * args.out_stride_token + head * args.out_stride_head + d] = from_float<scalar_t>(o);
    }
  }
}

template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE, int GROUP_TILE>
void launch_decode_tile(const DecodeArgs& args, dim3 grid, cudaStream_t stream) {
  paged_attention_decode_kernel<scalar_t, HEAD_SIZE, BLOCK_SIZE, kDecodeThreads, GROUP_TILE>
      <<<grid, kDecodeThreads, 0, stream>>>(args);
}

template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE>
cudaError_t launch_decode(const DecodeArgs& args, cudaStream_t stream) {
  const int group_size = args.num_heads / args.num_kv_heads;
  const int tile = decode_group_tile(group_size);
  const dim3 grid(args.num_kv_heads * ceil_div(group_size, tile), args.num_seqs, max(args.num_partitions, 1));
  switch (tile) {
    case 1: launch_decode_tile<scalar_t, HEAD_SIZE, BLOCK_SIZE, 1>(args, grid, stream); break;
    case 2: launch_decode_tile<scalar_t, HEAD_SIZE, BLOCK_SIZE, 2>(args, grid, stream); break;
    case 4: launch_decode_tile<scalar_t, HEAD_SIZE, BLOCK_SIZE, 4>(args, grid, stream); break;
    default: launch_decode_tile<scalar_t, HEAD_SIZE, BLOCK_SIZE, 8>(args, grid, stream); break;
  }
  if (args.num_partitions > 0) {
    const size_t smem = args.num_partitions * sizeof(float);
    if (smem > 48 * 1024) return cudaErrorInvalidValue;  // a context of over six million tokens
    paged_attention_reduce_kernel<scalar_t, HEAD_SIZE, kDecodeThreads>
        <<<dim3(args.num_heads, args.num_seqs), kDecodeThreads, smem, stream>>>(args);
  }
  return cudaGetLastError();
}

// dtype -> head size -> block size. Defined here, instantiated once per dtype in its own .cu file so the
// three build in parallel.
template <typename scalar_t>
cudaError_t decode_for_dtype(const DecodeArgs& args, cudaStream_t stream) {
  switch (args.head_size) {
#define PAGEDSERVE_HEAD_SIZE_CASE(N)                                                    \
  case N:                                                                               \
    switch (args.block_size) {                                                          \
      case 8: return launch_decode<scalar_t, N, 8>(args, stream);                      \
      case 16: return launch_decode<scalar_t, N, 16>(args, stream);                    \
      case 32: return launch_decode<scalar_t, N, 32>(args, stream);                    \
      default: return cudaErrorInvalidValue;                                            \
    }
    PAGEDSERVE_FOR_EACH_HEAD_SIZE(PAGEDSERVE_HEAD_SIZE_CASE)
#undef PAGEDSERVE_HEAD_SIZE_CASE
    default: return cudaErrorInvalidValue;
  }
}

extern template cudaError_t decode_for_dtype<float>(const DecodeArgs&, cudaStream_t);
extern template cudaError_t decode_for_dtype<__half>(const DecodeArgs&, cudaStream_t);
extern template cudaError_t decode_for_dtype<__nv_bfloat16>(const DecodeArgs&, cudaStream_t);

}  // namespace pagedserve
