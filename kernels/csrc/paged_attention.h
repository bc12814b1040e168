// Plain C++ launchers of the paged KV-cache kernels: raw pointers, element strides and a stream, no torch.
// bindings.cpp checks tensors and fills these structs; the .cu files launch the kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pagedserve {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// Tokens per partition of the split-K decode. A multiple of every token tile the decode kernel uses.
constexpr int kDecodePartitionSize = 512;

struct DecodeArgs {
  void* out;                       // [num_tokens, num_heads, head_size]
  const void* query;               // [num_tokens, num_heads, head_size]
  const void* k_cache;             // [num_blocks, block_size, num_kv_heads, head_size]
  const void* v_cache;             // [num_blocks, block_size, num_kv_heads, head_size]
  const int32_t* block_table;      // [num_seqs, max_num_blocks_per_seq], -1 padded
  const int32_t* seq_lens;         // [num_seqs], context including this step's token
  const int32_t* query_start_loc;  // [num_seqs + 1]; sequences whose query length is not 1 are skipped
  // Split-K workspace, used only when num_partitions > 0.
  float* tmp_out;     // [num_seqs, num_heads, num_partitions, head_size], normalized per partition
  float* max_logits;  // [num_seqs, num_heads, num_partitions], log2 domain
  float* exp_sums;    // [num_seqs, num_heads, num_partitions]
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int head_size;
  int block_size;
  int num_partitions;  // 0: one CTA covers a whole context and writes out directly
  int64_t q_stride_token, q_stride_head;
  int64_t out_stride_token, out_stride_head;
  int64_t cache_stride_block, cache_stride_token, cache_stride_head;  // shared by k_cache and v_cache
  int64_t block_table_stride;
  float scale;
};

struct WriteKVArgs {
  const void* key;              // [num_tokens, num_kv_heads, head_size]
  const void* value;            // [num_tokens, num_kv_heads, head_size]
  void* k_cache;                // [num_blocks, block_size, num_kv_heads, head_size]
  void* v_cache;                // [num_blocks, block_size, num_kv_heads, head_size]
  const int64_t* slot_mapping;  // [num_tokens], -1 = skip
  int num_tokens;
  int num_kv_heads;
  int head_size;
  int block_size;
  int element_size;  // bytes
  int64_t key_stride_token, key_stride_head;
  int64_t value_stride_token, value_stride_head;
  int64_t cache_stride_block, cache_stride_token, cache_stride_head;  // shared by k_cache and v_cache
};

struct CopyBlocksArgs {
  void* kv_cache;                // [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]
  const int64_t* block_mapping;  // [num_pairs, 2] of (src, dst); no dst may also be a src
  int num_pairs;
  int num_layers;
  int64_t block_bytes;  // one block of one layer's K or V, contiguous
  int64_t stride_layer, stride_kv, stride_block;  // bytes
};

// Head sizes the decode kernel is compiled for; anything else is rejected before launch. Each one adds
// 3 block sizes x 4 GQA tiles kernels per dtype to the build.
#define PAGEDSERVE_FOR_EACH_HEAD_SIZE(X) X(64) X(80) X(96) X(112) X(128) X(256)
bool decode_supports_head_size(int head_size);

// How many partitions the split-K decode uses: 0 for the single-pass kernel. split: -1 picks by occupancy
// and context length, 0 never splits, 1 always does. max_context_len bounds every sequence's length.
int decode_num_partitions(int num_seqs, int num_heads, int num_kv_heads, int max_context_len, int split);

cudaError_t paged_attention_decode(const DecodeArgs& args, DType dtype, cudaStream_t stream);
cudaError_t write_kv_cache(const WriteKVArgs& args, cudaStream_t stream);
cudaError_t copy_blocks(const CopyBlocksArgs& args, cudaStream_t stream);

}  // namespace pagedserve
