// The split-K decode's second pass: each partition left its softmax maximum, its sum and its normalized
// output; this kernel weighs the partitions by their share of the softmax mass and writes the result.
#pragma once

#include "attention_utils.cuh"
#include "paged_attention.h"

namespace pagedserve {

// One CTA per (query head, sequence).
template <typename scalar_t, int HEAD_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_reduce_kernel(const DecodeArgs args) {
  const int head = blockIdx.x, seq = blockIdx.y;
  const int q_token = args.query_start_loc[seq];
  if (args.query_start_loc[seq + 1] - q_token != 1) return;
  const int num_parts = min(ceil_div(args.seq_lens[seq], kDecodePartitionSize), args.num_partitions);
  const int64_t row = (static_cast<int64_t>(seq) * args.num_heads + head) * args.num_partitions;
  const float* max_logits = args.max_logits + row;
  const float* exp_sums = args.exp_sums + row;
  const float* tmp_out = args.tmp_out + row * HEAD_SIZE;

  extern __shared__ float weights[];  // [num_partitions]
  __shared__ float scratch[NUM_THREADS / 32];
  float max_logit = -INFINITY;
  for (int p = threadIdx.x; p < num_parts; p += NUM_THREADS) max_logit = fmaxf(max_logit, max_logits[p]);
  max_logit = block_max<NUM_THREADS>(max_logit, scratch);
  float sum = 0.f;
  for (int p = threadIdx.x; p < num_parts; p += NUM_THREADS) {
    weights[p] = exp_sums[p] * exp2f(max_logits[p] - max_logit);
    sum += weights[p];
  }
  sum = block_sum<NUM_THREADS>(sum, scratch);  // its barriers also publish weights[]

  scalar_t* out =
      static_cast<scalar_t*>(args.out) + q_token * args.out_stride_token + head * args.out_stride_head;
  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) {
    float o = 0.f;
    for (int p = 0; p < num_parts; ++p) o = fmaf(weights[p], tmp_out[p * HEAD_SIZE + d], o);
    out[d] = from_float<scalar_t>(o / sum);
  }
}

}  // namespace pagedserve
