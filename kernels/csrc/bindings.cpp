// torch bindings of the paged KV-cache kernels: the only file that sees torch. Each op checks its tensors,
// fills the launcher's plain struct and launches on the current stream; results go into the given tensors.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>

#include "paged_attention.h"

namespace {

using at::Tensor;
using pagedserve::DType;

// Every message names the library, so an error from deep inside a model says where it came from.
#define PAGEDSERVE_CHECK(cond, ...) TORCH_CHECK(cond, "pagedserve: ", __VA_ARGS__)

DType dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: break;
  }
  PAGEDSERVE_CHECK(false, "unsupported dtype ", t.scalar_type(), " (float32, float16, bfloat16)");
}

void check_cuda(const Tensor& t, const Tensor& like, const char* name) {
  PAGEDSERVE_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  PAGEDSERVE_CHECK(t.device() == like.device(), name, " is on ", t.device(), ", expected ", like.device());
}

void check_index(const Tensor& t, const Tensor& like, const char* name, at::ScalarType type, int64_t dim) {
  check_cuda(t, like, name);
  PAGEDSERVE_CHECK(t.scalar_type() == type, name, " must be ", type, ", got ", t.scalar_type());
  PAGEDSERVE_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
  PAGEDSERVE_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// A per-layer K or V cache [num_blocks, block_size, num_kv_heads, head_size]; k and v share one layout.
void check_caches(const Tensor& k_cache, const Tensor& v_cache) {
  check_cuda(k_cache, k_cache, "k_cache");
  check_cuda(v_cache, k_cache, "v_cache");
  PAGEDSERVE_CHECK(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, num_kv_heads, head_size]");
  PAGEDSERVE_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
                   "k_cache and v_cache must have the same shape and strides");
  PAGEDSERVE_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  PAGEDSERVE_CHECK(k_cache.stride(3) == 1, "the cache must be contiguous in head_size");
  dtype_of(k_cache);
}

void check_int32(int64_t value, const char* name) {
  PAGEDSERVE_CHECK(value <= std::numeric_limits<int32_t>::max(), name, " too large: ", value);
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void check_launch(cudaError_t err, const char* op) {
  PAGEDSERVE_CHECK(err == cudaSuccess, op, " failed to launch: ", cudaGetErrorString(err));
}

void write_kv_cache(const Tensor& key, const Tensor& value, Tensor& k_cache, Tensor& v_cache,
                    const Tensor& slot_mapping) {
  check_caches(k_cache, v_cache);
  check_cuda(key, k_cache, "key");
  check_cuda(value, k_cache, "value");
  check_index(slot_mapping, k_cache, "slot_mapping", at::kLong, 1);
  PAGEDSERVE_CHECK(key.dim() == 3 && key.sizes() == value.sizes(),
                   "key and value must be [num_tokens, num_kv_heads, head_size]");
  PAGEDSERVE_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3), "key is ", key.sizes(),
                   " but the cache holds [*, *, ", k_cache.size(2), ", ", k_cache.size(3), "]");
  PAGEDSERVE_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type(),
                   "key/value dtype must match the cache's ", k_cache.scalar_type());
  PAGEDSERVE_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value must be contiguous in head_size");
  PAGEDSERVE_CHECK(slot_mapping.size(0) == key.size(0), "slot_mapping has ", slot_mapping.size(0),
                   " entries for ", key.size(0), " tokens");
  check_int32(key.size(0), "num_tokens");

  const c10::cuda::CUDAGuard guard(k_cache.device());
  pagedserve::WriteKVArgs args{};
  args.key = key.data_ptr();
  args.value = value.data_ptr();
  args.k_cache = k_cache.data_ptr();
  args.v_cache = v_cache.data_ptr();
  args.slot_mapping = slot_mapping.data_ptr<int64_t>();
  args.num_tokens = static_cast<int>(key.size(0));
  args.num_kv_heads = static_cast<int>(key.size(1));
  args.head_size = static_cast<int>(key.size(2));
  args.block_size = static_cast<int>(k_cache.size(1));
  args.element_size = static_cast<int>(k_cache.element_size());
  args.key_stride_token = key.stride(0);
  args.key_stride_head = key.stride(1);
  args.value_stride_token = value.stride(0);
  args.value_stride_head = value.stride(1);
  args.cache_stride_block = k_cache.stride(0);
  args.cache_stride_token = k_cache.stride(1);
  args.cache_stride_head = k_cache.stride(2);
  check_launch(pagedserve::write_kv_cache(args, current_stream()), "write_kv_cache");
}

void paged_attention_decode(Tensor& out, const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                            const Tensor& block_table, const Tensor& seq_lens, const Tensor& query_start_loc,
                            double scale, int64_t split) {
  check_caches(k_cache, v_cache);
  check_cuda(query, k_cache, "query");
  check_cuda(out, k_cache, "out");
  check_index(block_table, k_cache, "block_table", at::kInt, 2);
  check_index(seq_lens, k_cache, "seq_lens", at::kInt, 1);
  check_index(query_start_loc, k_cache, "query_start_loc", at::kInt, 1);
  PAGEDSERVE_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
                   "query and out must be [num_tokens, num_heads, head_size]");
  PAGEDSERVE_CHECK(query.scalar_type() == k_cache.scalar_type() && out.scalar_type() == k_cache.scalar_type(),
                   "query/out dtype must match the cache's ", k_cache.scalar_type());
  PAGEDSERVE_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query/out must be contiguous in head_size");
  const int64_t num_seqs = seq_lens.size(0), num_heads = query.size(1), num_kv_heads = k_cache.size(2);
  const int64_t head_size = k_cache.size(3), block_size = k_cache.size(1);
  PAGEDSERVE_CHECK(query.size(2) == head_size, "query head_size ", query.size(2), ", cache ", head_size);
  PAGEDSERVE_CHECK(num_heads % num_kv_heads == 0, num_heads, " query heads over ", num_kv_heads, " KV heads");
  PAGEDSERVE_CHECK(block_table.size(0) == num_seqs && query_start_loc.size(0) == num_seqs + 1,
                   "block_table, seq_lens and query_start_loc disagree on the number of sequences");
  PAGEDSERVE_CHECK(num_seqs <= 65535, "at most 65535 sequences per call, got ", num_seqs);
  PAGEDSERVE_CHECK(pagedserve::decode_supports_head_size(static_cast<int>(head_size)),
                   "paged_attention_decode is not compiled for head size ", head_size);
  PAGEDSERVE_CHECK(block_size == 8 || block_size == 16 || block_size == 32,
                   "paged_attention_decode supports block sizes 8, 16 and 32, got ", block_size);
  // The kernel reads K/V rows in 16-byte vectors.
  const int64_t es = k_cache.element_size();
  PAGEDSERVE_CHECK(reinterpret_cast<uintptr_t>(k_cache.data_ptr()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(v_cache.data_ptr()) % 16 == 0 &&
                       k_cache.stride(0) * es % 16 == 0 && k_cache.stride(1) * es % 16 == 0 &&
                       k_cache.stride(2) * es % 16 == 0,
                   "the cache must be 16-byte aligned in its rows");
  check_int32(block_size * k_cache.stride(1), "block_size * the cache's token stride");  // in-block offsets

  const c10::cuda::CUDAGuard guard(k_cache.device());
  const int64_t max_context = block_table.size(1) * block_size;
  check_int32(max_context, "max_num_blocks_per_seq * block_size");
  const int num_partitions = pagedserve::decode_num_partitions(
      static_cast<int>(num_seqs), static_cast<int>(num_heads), static_cast<int>(num_kv_heads),
      static_cast<int>(max_context), static_cast<int>(split));
  Tensor tmp_out, max_logits, exp_sums;
  if (num_partitions > 0) {
    const auto f32 = query.options().dtype(at::kFloat);
    tmp_out = at::empty({num_seqs, num_heads, num_partitions, head_size}, f32);
    max_logits = at::empty({num_seqs, num_heads, num_partitions}, f32);
    exp_sums = at::empty({num_seqs, num_heads, num_partitions}, f32);
  }

  pagedserve::DecodeArgs args{};
  args.out = out.data_ptr();
  args.query = query.data_ptr();
  args.k_cache = k_cache.data_ptr();
  args.v_cache = v_cache.data_ptr();
  args.block_table = block_table.data_ptr<int32_t>();
  args.seq_lens = seq_lens.data_ptr<int32_t>();
  args.query_start_loc = query_start_loc.data_ptr<int32_t>();
  args.tmp_out = num_partitions > 0 ? tmp_out.data_ptr<float>() : nullptr;
  args.max_logits = num_partitions > 0 ? max_logits.data_ptr<float>() : nullptr;
  args.exp_sums = num_partitions > 0 ? exp_sums.data_ptr<float>() : nullptr;
  args.num_seqs = static_cast<int>(num_seqs);
  args.num_heads = static_cast<int>(num_heads);
  args.num_kv_heads = static_cast<int>(num_kv_heads);
  args.head_size = static_cast<int>(head_size);
  args.block_size = static_cast<int>(block_size);
  args.num_partitions = num_partitions;
  args.q_stride_token = query.stride(0);
  args.q_stride_head = query.stride(1);
  args.out_stride_token = out.stride(0);
  args.out_stride_head = out.stride(1);
  args.cache_stride_block = k_cache.stride(0);
  args.cache_stride_token = k_cache.stride(1);
  args.cache_stride_head = k_cache.stride(2);
  args.block_table_stride = block_table.stride(0);
  args.scale = static_cast<float>(scale);
  check_launch(pagedserve::paged_attention_decode(args, dtype_of(k_cache), current_stream()),
               "paged_attention_decode");
}

void copy_blocks(Tensor& kv_cache, const Tensor& block_mapping) {
  check_cuda(kv_cache, kv_cache, "kv_cache");
  check_index(block_mapping, kv_cache, "block_mapping", at::kLong, 2);
  PAGEDSERVE_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2,
                   "kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]");
  PAGEDSERVE_CHECK(kv_cache.stride(5) == 1 && kv_cache.stride(4) == kv_cache.size(5) &&
                       kv_cache.stride(3) == kv_cache.size(4) * kv_cache.size(5),
                   "each block of kv_cache must be contiguous");
  PAGEDSERVE_CHECK(block_mapping.size(1) == 2, "block_mapping must be [num_pairs, 2]");
  check_int32(block_mapping.size(0), "num_pairs");
  dtype_of(kv_cache);

  const c10::cuda::CUDAGuard guard(kv_cache.device());
  const Tensor mapping = block_mapping.contiguous();
  const int64_t es = kv_cache.element_size();
  pagedserve::CopyBlocksArgs args{};
  args.kv_cache = kv_cache.data_ptr();
  args.block_mapping = mapping.data_ptr<int64_t>();
  args.num_pairs = static_cast<int>(mapping.size(0));
  args.num_layers = static_cast<int>(kv_cache.size(0));
  args.block_bytes = kv_cache.size(3) * kv_cache.size(4) * kv_cache.size(5) * es;
  args.stride_layer = kv_cache.stride(0) * es;
  args.stride_kv = kv_cache.stride(1) * es;
  args.stride_block = kv_cache.stride(2) * es;
  check_launch(pagedserve::copy_blocks(args, current_stream()), "copy_blocks");
}

}  // namespace

TORCH_LIBRARY(pagedserve, m) {
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
  // split: -1 decides by occupancy and context length, 0 never splits the context, 1 always does.
  m.def(
      "paged_attention_decode(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor block_table, Tensor seq_lens, Tensor query_start_loc, float scale, int split=-1) -> ()");
  m.def("copy_blocks(Tensor(a!) kv_cache, Tensor block_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CUDA, m) {
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("paged_attention_decode", &paged_attention_decode);
  m.impl("copy_blocks", &copy_blocks);
}
