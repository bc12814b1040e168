// The elementwise ops of a Llama-family layer on the CPU, each one pass over its rows where the transformers
// code runs several ops and writes a tensor between each: torch.ops.pagedserve_cpu.{rms_norm, add_rms_norm,
// silu_and_mul, rotary_write_kv}.
//
// Each rounds where transformers' modules round, so the results are the same numbers up to float summation
// order: float32 throughout, and for bfloat16 a value rounded to bfloat16 wherever transformers keeps a
// bfloat16 tensor (the residual sum, the normalized row before the weight, silu before the product, each
// product of the rotary). Products and sums are kept apart (no fused multiply-add), as torch's own ops keep
// them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_features.h"
#include "cpu_math.h"
#include "llama_ops_avx512.h"
#include "panel_linear.h"

namespace {

using at::Tensor;
using namespace pagedserve_cpu_math;
using pagedserve_cpu_panel::packed_linear;

#define PAGEDSERVE_CHECK(cond, ...) TORCH_CHECK(cond, "pagedserve: ", __VA_ARGS__)
#define PAGEDSERVE_EXACT __attribute__((optimize("fp-contract=off")))

// Rows are spread over threads only when there are enough of them to pay for waking the threads.
constexpr int64_t kRowsPerTask = 4;

void check_rows(const Tensor& t, const char* name, at::ScalarType dtype) {
  PAGEDSERVE_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  PAGEDSERVE_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  PAGEDSERVE_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// The bits of a row: float32 as it is, bfloat16 as uint16.
inline const float* bits(const float* p) { return p; }
inline float* bits(float* p) { return p; }
inline const uint16_t* bits(const c10::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); }
inline uint16_t* bits(c10::BFloat16* p) { return reinterpret_cast<uint16_t*>(p); }

// Where `wide`, the loops start with their AVX-512 twins (llama_ops_avx512.h), which leave the same bits.
template <typename T>
PAGEDSERVE_EXACT void norm_row(T* out, const float* row, const T* weight, int64_t n, float eps, bool wide) {
  // In double (each square exact in it): closer to the exact mean than any float order. Eight running sums, not
  // one: one sum's chain of dependent adds took longer than the rest of the norm.
  constexpr int64_t kSums = 8;
  double sums[kSums] = {};
  int64_t d = wide ? pagedserve_cpu_llama::sum_squares_avx512(row, n, sums) : 0;
  for (; d + kSums <= n; d += kSums) {
    for (int64_t j = 0; j < kSums; ++j) sums[j] += static_cast<double>(row[d + j]) * row[d + j];
  }
  for (; d < n; ++d) sums[0] += static_cast<double>(row[d]) * row[d];
  double squares = 0.0;
  for (const double s : sums) squares += s;
  const float variance = static_cast<float>(squares / static_cast<double>(n));
  const float inv = 1.f / std::sqrt(variance + eps);
  d = wide ? pagedserve_cpu_llama::scale_row_avx512(bits(out), row, bits(weight), inv, n) : 0;
  for (; d < n; ++d) out[d] = from_float<T>(to_float(weight[d]) * stored<T>(row[d] * inv));
}

// residual is null for the first norm of a model (no sum before it).
template <typename T>
PAGEDSERVE_EXACT void norm_rows(Tensor& out, const Tensor& x, Tensor* residual, const Tensor& weight,
                                double eps) {
  const int64_t rows = x.numel() / x.size(-1), n = x.size(-1);
  const T* w = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const T* in = x.data_ptr<T>();
  T* r = residual ? residual->data_ptr<T>() : nullptr;
  const auto feps = static_cast<float>(eps);
  const bool wide = pagedserve_cpu_features::avx512_enabled();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> row(n);
    for (int64_t i = begin; i < end; ++i) {
      const T* xi = in + i * n;
      if (r) {
        T* ri = r + i * n;
        const int64_t done = wide ? pagedserve_cpu_llama::add_residual_avx512(bits(ri), bits(xi), row.data(), n) : 0;
        for (int64_t d = done; d < n; ++d) {
          ri[d] = from_float<T>(to_float(ri[d]) + to_float(xi[d]));
          row[d] = to_float(ri[d]);
        }
      } else {
        for (int64_t d = 0; d < n; ++d) row[d] = to_float(xi[d]);
      }
      norm_row(o + i * n, row.data(), w, n, feps, wide);
    }
  });
}

void check_norm(const Tensor& out, const Tensor& x, const Tensor& weight) {
  const auto dtype = x.scalar_type();
  PAGEDSERVE_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16 rows, got ", dtype);
  check_rows(x, "x", dtype);
  check_rows(out, "out", dtype);
  check_rows(weight, "weight", dtype);
  PAGEDSERVE_CHECK(x.is_contiguous() && out.is_contiguous() && out.sizes() == x.sizes(),
                   "x and out must be contiguous tensors of one shape");
  PAGEDSERVE_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "weight must be [hidden_size]");
}

// Each op below names itself for the profiler, as packed_linear does: the decode layers' loop calls them directly,
// not through the dispatcher, and a profile of a step (benchmarks/roofline.py, benchmarks/profile_steps.py) then
// gives each its own row rather than one sum under llama_decode_layers. A call from Python still makes one event.

// out = weight * x / rms(x), in rows of x's last dimension.
void rms_norm(Tensor& out, const Tensor& x, const Tensor& weight, double eps) {
  RECORD_FUNCTION("pagedserve_cpu::rms_norm", std::vector<c10::IValue>());
  check_norm(out, x, weight);
  if (x.scalar_type() == at::kFloat) {
    norm_rows<float>(out, x, nullptr, weight, eps);
  } else {
    norm_rows<c10::BFloat16>(out, x, nullptr, weight, eps);
  }
}

// residual += x, then x = weight * residual / rms(residual): a layer's sum and the next norm in one pass.
void add_rms_norm(Tensor& x, Tensor& residual, const Tensor& weight, double eps) {
  RECORD_FUNCTION("pagedserve_cpu::add_rms_norm", std::vector<c10::IValue>());
  check_norm(x, x, weight);
  check_rows(residual, "residual", x.scalar_type());
  PAGEDSERVE_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes(), "residual must be shaped as x");
  if (x.scalar_type() == at::kFloat) {
    norm_rows<float>(x, x, &residual, weight, eps);
  } else {
    norm_rows<c10::BFloat16>(x, x, &residual, weight, eps);
  }
}

template <typename T>
PAGEDSERVE_EXACT void silu_mul_rows(Tensor& out, const Tensor& gate_up) {
  const int64_t rows = out.size(0), n = out.size(1);
  const T* in = gate_up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t in_row = gate_up.stride(0), out_row = out.stride(0);
  const bool wide = pagedserve_cpu_features::avx512_enabled();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    const int64_t padded = (n + kExpWidth - 1) / kExpWidth * kExpWidth;
    std::vector<float> e(padded, 0.f);
    for (int64_t i = begin; i < end; ++i) {
      const T* gate = in + i * in_row;
      const T* up = gate + n;
      T* oi = o + i * out_row;
      // The row's first values 16 at a time where the CPU has AVX-512 (the same bits); the rest below.
      const int64_t done = wide ? pagedserve_cpu_llama::silu_mul_avx512(bits(gate), bits(up), bits(oi), n) : 0;
      if (done == n) continue;
      for (int64_t d = done; d < n; ++d) e[d] = -to_float(gate[d]);
      exp_in_place(e.data() + done, padded - done);
      for (int64_t d = done; d < n; ++d) {
        const float act = stored<T>(to_float(gate[d]) / (1.f + e[d]));
        oi[d] = from_float<T>(act * to_float(up[d]));
      }
    }
  });
}

// out = silu(gate) * up, where gate_up holds [gate | up] in each row (one matmul's output).
void silu_and_mul(Tensor& out, const Tensor& gate_up) {
  RECORD_FUNCTION("pagedserve_cpu::silu_and_mul", std::vector<c10::IValue>());
  const auto dtype = gate_up.scalar_type();
  PAGEDSERVE_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16 rows, got ", dtype);
  check_rows(gate_up, "gate_up", dtype);
  check_rows(out, "out", dtype);
  PAGEDSERVE_CHECK(gate_up.dim() == 2 && out.dim() == 2 && gate_up.size(0) == out.size(0) &&
                       gate_up.size(1) == 2 * out.size(1),
                   "gate_up must be [rows, 2 * n] and out [rows, n]");
  if (dtype == at::kFloat) {
    silu_mul_rows<float>(out, gate_up);
  } else {
    silu_mul_rows<c10::BFloat16>(out, gate_up);
  }
}

// x * cos + rotate_half(x) * sin of one head, rotate_half(x) = [-x2, x1] over the halves of the head.
template <typename T>
PAGEDSERVE_EXACT inline void rotate(T* out, const T* x, const T* cos, const T* sin, int64_t dim, bool wide) {
  if (wide && pagedserve_cpu_llama::rotate_avx512(bits(out), bits(x), bits(cos), bits(sin), dim)) return;
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float a = stored<T>(to_float(x[d]) * to_float(cos[d]));
    const float b = stored<T>(-to_float(x[d + half]) * to_float(sin[d]));
    out[d] = from_float<T>(a + b);
  }
  for (int64_t d = half; d < dim; ++d) {
    const float a = stored<T>(to_float(x[d]) * to_float(cos[d]));
    const float b = stored<T>(to_float(x[d - half]) * to_float(sin[d]));
    out[d] = from_float<T>(a + b);
  }
}

template <typename T>
void rotary_rows(Tensor& query, const Tensor& key, const Tensor& value, const Tensor& cos, const Tensor& sin,
                 Tensor& k_cache, Tensor& v_cache, const Tensor& slot_mapping) {
  const int64_t tokens = query.size(0), heads = query.size(1), kv_heads = key.size(1), dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_slots = k_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  T* q = query.data_ptr<T>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t c_block = k_cache.stride(0), c_token = k_cache.stride(1), c_head = k_cache.stride(2);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t];
    PAGEDSERVE_CHECK(slot >= -1 && slot < num_slots, "token ", t, " maps to slot ", slot);
  }
  const bool wide = pagedserve_cpu_features::avx512_enabled();
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<T> turned(dim);
    for (int64_t t = begin; t < end; ++t) {
      const T* ct = c + t * cos.stride(0);
      const T* st = s + t * sin.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        T* qh = q + t * query.stride(0) + h * query.stride(1);
        rotate(turned.data(), qh, ct, st, dim, wide);
        std::copy(turned.begin(), turned.end(), qh);
      }
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      const int64_t base = (slot / block_size) * c_block + (slot % block_size) * c_token;
      for (int64_t h = 0; h < kv_heads; ++h) {
        rotate(kc + base + h * c_head, k + t * key.stride(0) + h * key.stride(1), ct, st, dim, wide);
        const T* vh = v + t * value.stride(0) + h * value.stride(1);
        std::copy(vh, vh + dim, vc + base + h * c_head);
      }
    }
  });
}

// Rotary position embedding of the query (in place) and of the key as it is written into its cache slot, the
// value written beside it; a token whose slot is -1 is rotated and not written. cos and sin are
// [tokens, head_size], as transformers' rotary embedding gives them.
void rotary_write_kv(Tensor& query,        // [tokens, heads, head_size]
                     const Tensor& key,    // [tokens, kv_heads, head_size]
                     const Tensor& value,  // [tokens, kv_heads, head_size]
                     const Tensor& cos, const Tensor& sin,
                     Tensor& k_cache,  // [num_blocks, block_size, kv_heads, head_size]
                     Tensor& v_cache, const Tensor& slot_mapping) {
  RECORD_FUNCTION("pagedserve_cpu::rotary_write_kv", std::vector<c10::IValue>());
  const auto dtype = query.scalar_type();
  PAGEDSERVE_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16 heads, got ", dtype);
  const Tensor* all[] = {&query, &key, &value, &cos, &sin, &k_cache, &v_cache};
  for (const Tensor* t : all) check_rows(*t, "every tensor", dtype);
  PAGEDSERVE_CHECK(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes(),
                   "query, key and value must be [tokens, heads, head_size]");
  const int64_t tokens = query.size(0), dim = query.size(2);
  PAGEDSERVE_CHECK(key.size(0) == tokens && key.size(2) == dim && dim % 2 == 0, "key must match query");
  PAGEDSERVE_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == tokens && cos.size(1) == dim,
                   "cos and sin must be [tokens, head_size]");
  PAGEDSERVE_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                       k_cache.strides() == v_cache.strides() && k_cache.size(2) == key.size(1) &&
                       k_cache.size(3) == dim,
                   "k_cache and v_cache must be [num_blocks, block_size, kv_heads, head_size] alike");
  PAGEDSERVE_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                       slot_mapping.is_contiguous() && slot_mapping.size(0) == tokens,
                   "slot_mapping must be a contiguous int64 [tokens]");
  if (dtype == at::kFloat) {
    rotary_rows<float>(query, key, value, cos, sin, k_cache, v_cache, slot_mapping);
  } else {
    rotary_rows<c10::BFloat16>(query, key, value, cos, sin, k_cache, v_cache, slot_mapping);
  }
}

void decode_attention(Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                      const Tensor& block_table, const Tensor& seq_lens, const Tensor& query_start_loc,
                      double scale) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pagedserve_cpu::paged_attention_decode", "");
  torch::jit::Stack stack{out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale};
  op.callBoxed(&stack);
}

// Weights of one layer in the order the Python side gives them (gpu_worker/engine/llama_forward.py).
enum LayerWeight { kQkv, kQkvBias, kO, kGateUp, kDown, kInputNorm, kPostNorm, kQNorm, kKNorm, kPerLayer };
// A layer's linear weights, in the order of their panel widths.
enum LayerLinear { kQkvLinear, kOLinear, kGateUpLinear, kDownLinear, kLinears };

// Every layer of a decode step (one query token per sequence) in one call: the loop of LlamaForward._layer,
// with no Python between the ops. hidden is the step's embeddings [tokens, hidden_size]; returns the last
// hidden state, summed and normed by final_norm. An undefined tensor stands for a bias or a head norm the
// model does not have. panels: for each layer's qkv, o, gate_up and down weights, the width of the panels it is
// packed in, for the panel kernel (panel_linear.h), 0 for oneDNN alone; empty: oneDNN for every weight.
Tensor llama_decode_layers(const Tensor& hidden, const c10::List<std::optional<Tensor>>& given,
                           const Tensor& final_norm,
                           const Tensor& cos, const Tensor& sin, at::TensorList k_caches,
                           at::TensorList v_caches, const Tensor& slot_mapping, const Tensor& block_table,
                           const Tensor& seq_lens, const Tensor& query_start_loc, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                           at::IntArrayRef panels) {
  std::vector<Tensor> weights;
  weights.reserve(given.size());
  for (size_t j = 0; j < given.size(); ++j) {
    const std::optional<Tensor> w = given.get(j);
    weights.push_back(w.has_value() ? *w : Tensor());
  }
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  PAGEDSERVE_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer &&
                       static_cast<int64_t>(v_caches.size()) == layers,
                   "weights must hold ", static_cast<int>(kPerLayer), " tensors a layer, one cache pair each");
  PAGEDSERVE_CHECK(panels.empty() || static_cast<int64_t>(panels.size()) == layers * kLinears,
                   "panels must give ", static_cast<int>(kLinears), " widths a layer, or none");
  PAGEDSERVE_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be a contiguous [tokens, hidden]");
  const int64_t tokens = hidden.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  PAGEDSERVE_CHECK(seq_lens.size(0) == tokens, "every sequence of a decode step has one query token");
  Tensor residual = hidden.clone();
  Tensor x = at::empty_like(hidden);
  rms_norm(x, residual, weights[kInputNorm], eps);
  Tensor out;
  for (int64_t i = 0; i < layers; ++i) {
    const Tensor* w = weights.data() + i * kPerLayer;
    const auto panel = [&](LayerLinear which) { return panels.empty() ? 0 : panels[i * kLinears + which]; };
    const Tensor qkv = packed_linear(x, w[kQkv], w[kQkvBias], panel(kQkvLinear));
    Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    if (w[kQNorm].defined()) {
      Tensor q_normed = at::empty({tokens, num_heads, head_dim}, q.options());
      rms_norm(q_normed, q.contiguous(), w[kQNorm], eps);
      Tensor k_normed = at::empty({tokens, num_kv_heads, head_dim}, k.options());
      rms_norm(k_normed, k.contiguous(), w[kKNorm], eps);
      q = q_normed;
      k = k_normed;
    }
    Tensor k_cache = k_caches[i], v_cache = v_caches[i];
    rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping);
    Tensor attended = at::empty({tokens, num_heads, head_dim}, q.options());
    decode_attention(attended, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale);
    Tensor h = packed_linear(attended.view({tokens, q_size}), w[kO], Tensor(), panel(kOLinear));
    add_rms_norm(h, residual, w[kPostNorm], eps);
    const Tensor gate_up = packed_linear(h, w[kGateUp], Tensor(), panel(kGateUpLinear));
    Tensor act = at::empty({tokens, gate_up.size(1) / 2}, gate_up.options());
    silu_and_mul(act, gate_up);
    out = packed_linear(act, w[kDown], Tensor(), panel(kDownLinear));
    const Tensor& next_norm = i + 1 < layers ? weights[(i + 1) * kPerLayer + kInputNorm] : final_norm;
    add_rms_norm(out, residual, next_norm, eps);
    x = out;
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def(
      "llama_decode_layers(Tensor hidden, Tensor?[] weights, Tensor final_norm, Tensor cos, Tensor sin, "
      "Tensor[] k_caches, Tensor[] v_caches, Tensor slot_mapping, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, int num_heads, int num_kv_heads, int head_dim, float eps, float scale, "
      "int[] panels=[]) -> Tensor",
      // For every dispatch key: the packed weights are oneDNN tensors, the rest plain CPU ones.
      TORCH_FN(llama_decode_layers));
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def(
      "rotary_write_kv(Tensor(a!) query, Tensor key, Tensor value, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_write_kv", &rotary_write_kv);
}
