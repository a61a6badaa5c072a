// Integer-dot linear layers for few activation rows (decode): each activation row is quantized once per call to
// int8 (per 32 values for the 32-weight formats, per 256 with sums per 16 for the K-quants, as llama.cpp's Q8_0 and
// Q8_K), then every weight block is dotted in integers and scaled once. The exact path dequantizes every weight to
// floats first, which made single-stream decode compute-bound (Q4_K 8.9 GB/s on one Zen 5 core, measured).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace carpool::ggml {

// How ggml_linear multiplies: what `matmul` names in the engine's config.
enum class MatmulMode : int64_t { kExact = 0, kInt8Dot = 1 };

// The calling thread's mode (kExact unless set_matmul_mode said otherwise on this thread): each engine sets its own
// at the start of every step, so two engines on two threads never see each other's choice.
MatmulMode matmul_mode();

// Activation rows up to which int8-dot mode takes the integer path; more rows reuse each dequantized weight panel
// enough that the exact path keeps up (measured, see ggml_dot.cpp).
constexpr int64_t kInt8DotMaxRows = 4;

// y[M, N] = x[M, K] W^T with x quantized to int8 as described above; y in x's dtype.
at::Tensor int8_dot_linear(const at::Tensor& x, const uint8_t* weight, int64_t qtype, int64_t N);

}  // namespace carpool::ggml
