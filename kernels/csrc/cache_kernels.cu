// Writing new K/V into their cache slots, and copying whole blocks (copy-on-write).
//
// Both are pure data movement, so the kernels move bytes in the widest unit the addresses allow (16 bytes
// on the normal path) and are compiled once for every dtype of the same element size.
#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "paged_attention.h"

namespace pagedserve {
namespace {

bool aligned(const void* ptr, int64_t unit) { return reinterpret_cast<uintptr_t>(ptr) % unit == 0; }

// The widest of 16, 4 and 2 bytes that divides every pointer and every byte count given.
template <typename... Bytes>
int copy_unit(std::initializer_list<const void*> ptrs, Bytes... bytes) {
  for (const int64_t unit : {int64_t{16}, int64_t{4}}) {
    const auto fits = [&](const void* p) { return aligned(p, unit); };
    if (std::all_of(ptrs.begin(), ptrs.end(), fits) && ((bytes % unit == 0) && ...)) {
      return static_cast<int>(unit);
    }
  }
  return 2;
}

int threads_for(int64_t units) {
  return static_cast<int>(std::clamp<int64_t>((units + 31) / 32 * 32, 32, 256));
}

// One CTA per token; each thread moves units of one (head, part of the head row) for K and for V.
template <typename unit_t>
__global__ void write_kv_cache_kernel(const WriteKVArgs args) {
  const int64_t slot = args.slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const int64_t es = args.element_size;
  const int units_per_head = static_cast<int>(args.head_size * es / sizeof(unit_t));
  // slot is already 64-bit, so block * stride cannot overflow.
  const int64_t block = slot / args.block_size, offset = slot % args.block_size;
  const int64_t dst_row = (block * args.cache_stride_block + offset * args.cache_stride_token) * es;
  const char* key = static_cast<const char*>(args.key) + blockIdx.x * args.key_stride_token * es;
  const char* value = static_cast<const char*>(args.value) + blockIdx.x * args.value_stride_token * es;
  char* k_cache = static_cast<char*>(args.k_cache) + dst_row;
  char* v_cache = static_cast<char*>(args.v_cache) + dst_row;
  for (int i = threadIdx.x; i < args.num_kv_heads * units_per_head; i += blockDim.x) {
    const int head = i / units_per_head;
    const int64_t byte = static_cast<int64_t>(i % units_per_head) * sizeof(unit_t);
    const int64_t dst = head * args.cache_stride_head * es + byte;
    *reinterpret_cast<unit_t*>(k_cache + dst) =
        *reinterpret_cast<const unit_t*>(key + head * args.key_stride_head * es + byte);
    *reinterpret_cast<unit_t*>(v_cache + dst) =
        *reinterpret_cast<const unit_t*>(value + head * args.value_stride_head * es + byte);
  }
}

// One CTA per (pair, layer, K or V). Pairs run in parallel, which is why no dst may also be a src.
template <typename unit_t>
__global__ void copy_blocks_kernel(const CopyBlocksArgs args) {
  const int pair = blockIdx.x;
  const int layer = blockIdx.y / 2, kv = blockIdx.y % 2;
  const int64_t src = args.block_mapping[2 * pair], dst = args.block_mapping[2 * pair + 1];
  char* base = static_cast<char*>(args.kv_cache) + layer * args.stride_layer + kv * args.stride_kv;
  const unit_t* from = reinterpret_cast<const unit_t*>(base + src * args.stride_block);
  unit_t* to = reinterpret_cast<unit_t*>(base + dst * args.stride_block);
  const int64_t n = args.block_bytes / static_cast<int64_t>(sizeof(unit_t));
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) to[i] = from[i];
}

template <typename unit_t>
void launch_write(const WriteKVArgs& args, cudaStream_t stream) {
  const int64_t units = static_cast<int64_t>(args.num_kv_heads) * args.head_size * args.element_size /
                        static_cast<int64_t>(sizeof(unit_t));
  write_kv_cache_kernel<unit_t><<<args.num_tokens, threads_for(units), 0, stream>>>(args);
}

template <typename unit_t>
void launch_copy(const CopyBlocksArgs& args, cudaStream_t stream) {
  const int64_t units = args.block_bytes / static_cast<int64_t>(sizeof(unit_t));
  const dim3 grid(args.num_pairs, 2 * args.num_layers);
  copy_blocks_kernel<unit_t><<<grid, threads_for(units), 0, stream>>>(args);
}

}  // namespace

cudaError_t write_kv_cache(const WriteKVArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  const int64_t es = args.element_size;
  const int unit = copy_unit({args.key, args.value, args.k_cache, args.v_cache}, args.head_size * es,
                             args.key_stride_token * es, args.key_stride_head * es,
                             args.value_stride_token * es, args.value_stride_head * es,
                             args.cache_stride_block * es, args.cache_stride_token * es,
                             args.cache_stride_head * es);
  switch (unit) {
    case 16: launch_write<uint4>(args, stream); break;
    case 4: launch_write<uint32_t>(args, stream); break;
    default: launch_write<uint16_t>(args, stream); break;
  }
  return cudaGetLastError();
}

cudaError_t copy_blocks(const CopyBlocksArgs& args, cudaStream_t stream) {
  if (args.num_pairs == 0 || args.num_layers == 0) return cudaSuccess;
  const int unit = copy_unit({args.kv_cache}, args.block_bytes, args.stride_layer, args.stride_kv,
                             args.stride_block);
  switch (unit) {
    case 16: launch_copy<uint4>(args, stream); break;
    case 4: launch_copy<uint32_t>(args, stream); break;
    default: launch_copy<uint16_t>(args, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace pagedserve
