// The linear layers of panel_linear_cpu.cpp, for the other CPU ops (the decode layers' loop).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace pagedserve_cpu_panel {

using at::Tensor;

// Whether this build multiplies with AVX2 and FMA (else a plain loop, correct but slow).
bool panel_linear_vectorized();

// The base address of a oneDNN tensor's packed bytes.
const float* packed_data(const Tensor& weight);

// out [rows, n] = x [rows, K] times the weight packed as n / panel panels of [K][panel] floats, plus bias.
void panel_linear_into(Tensor& out, const Tensor& x, const float* weight, int64_t n, int64_t panel,
                       const Tensor& bias);

// Up to this many rows the panel kernel outruns oneDNN's (about 1.1x at 128 rows, and oneDNN is ahead by 256).
constexpr int64_t kPanelMaxRows = 128;

// x [..., K] times a weight packed for oneDNN (gpu_worker/engine/packed_linear.py), plus bias (undefined for
// none): through the panel kernel where the weight is float32 panels of `panel` columns and x has at most
// kPanelMaxRows rows, else through oneDNN. panel 0: oneDNN always.
Tensor packed_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t panel);

}  // namespace pagedserve_cpu_panel
