// The decode kernels for __nv_bfloat16: one translation unit per dtype, so the three compile in parallel.
#include "paged_attention_decode.cuh"

namespace pagedserve {
template cudaError_t decode_for_dtype<__nv_bfloat16>(const DecodeArgs& args, cudaStream_t stream);
}  // namespace pagedserve
