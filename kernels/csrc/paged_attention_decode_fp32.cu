// The decode kernels for float: one translation unit per dtype, so the three compile in parallel.
#include "paged_attention_decode.cuh"

namespace pagedserve {
template cudaError_t decode_for_dtype<float>(const DecodeArgs& args, cudaStream_t stream);
}  // namespace pagedserve
