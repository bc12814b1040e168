// Host side of the decode: which head sizes exist, whether to split the context, and the dtype switch. The
// kernels themselves are instantiated in paged_attention_decode_{fp32,fp16,bf16}.cu.
#include <algorithm>
#include <atomic>
#include <cstdint>

#include "paged_attention.h"
#include "paged_attention_decode.cuh"

namespace pagedserve {
namespace {

// Multiprocessor count of the current device, read once per device.
int num_sms() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  if (device < kMaxDevices && cached[device].load() > 0) return cached[device].load();
  int count = 1;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) count = 1;
  if (device < kMaxDevices) cached[device].store(count);
  return count;
}

}  // namespace

bool decode_supports_head_size(int head_size) {
  switch (head_size) {
#define PAGEDSERVE_HEAD_SIZE_CASE(N) case N:
    PAGEDSERVE_FOR_EACH_HEAD_SIZE(PAGEDSERVE_HEAD_SIZE_CASE)
#undef PAGEDSERVE_HEAD_SIZE_CASE
    return true;
    default: return false;
  }
}

int decode_num_partitions(int num_seqs, int num_heads, int num_kv_heads, int max_context_len, int split) {
  const int max_parts = std::max(1, ceil_div(max_context_len, kDecodePartitionSize));
  if (split == 0) return 0;
  if (split > 0) return max_parts;
  if (max_parts < 2) return 0;  // one partition: splitting would only add the reduce pass
  const int group_size = num_heads / num_kv_heads;
  const int64_t ctas =
      static_cast<int64_t>(num_seqs) * num_kv_heads * ceil_div(group_size, decode_group_tile(group_size));
  // Fewer CTAs than the GPU runs at once (about four per SM at this kernel's register use) leave SMs idle
  // for the whole of a long context; partitions give them work.
  return ctas < 4LL * num_sms() ? max_parts : 0;
}

cudaError_t paged_attention_decode(const DecodeArgs& args, DType dtype, cudaStream_t stream) {
  if (args.num_seqs == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: return decode_for_dtype<float>(args, stream);
    case DType::kFloat16: return decode_for_dtype<__half>(args, stream);
    case DType::kBFloat16: return decode_for_dtype<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagedserve
