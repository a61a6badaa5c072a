// Integer-dot linear layers (a few activation rows: the GEMV in ggml_dot.cpp; decode batches and verify rows up to
// 64, and under int8-dot-all prompt chunks of any size: the batched kernel in ggml_gemm.cpp): each activation row is quantized once per call to
// int8 (per 32 values for the 32-weight formats, per 256 with sums per 16 for the K-quants, as llama.cpp's Q8_0 and
// Q8_K), then every weight block is dotted in integers and scaled once. The exact path dequantizes every weight to
// floats first, which made single-stream decode compute-bound (Q4_K 8.9 GB/s on one Zen 5 core, measured).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace carpool::ggml {

// How ggml_linear multiplies: what `matmul` names in the engine's config. kInt8Dot runs the integer kernels on calls
// of up to int8_dot_max_rows(qtype) rows (decode), kInt8DotAll on every call, prompt chunks included.
enum class MatmulMode : int64_t { kExact = 0, kInt8Dot = 1, kInt8DotAll = 2 };

// The calling thread's mode (kExact unless set_matmul_mode said otherwise on this thread): each engine sets its own
// at the start of every step, so two engines on two threads never see each other's choice.
MatmulMode matmul_mode();

// Activation rows up to which the GEMV below dots each weight block with every row (four rows a pass over the block);
// above it int8-dot mode runs the batched kernel (ggml_gemm.cpp), which unpacks each weight once per call for all
// rows. 5: a verify step of one sequence with the default 4 drafts; the batched kernel's tile costs 16 rows there
// (SmolLM2's matmuls, 1 thread, loaded machine: 5 rows 16.2 ms batched, 12.9 ms as two GEMV calls of 4 + 1 rows on
// AVX-512, 15.6 vs 13.0 on AVX2; at 6-8 rows the GEMV gained at most 16% there and lost 6% on AVX2 at 8).
constexpr int64_t kInt8GemvMaxRows = 5;
// Q4_K and Q6_K row groups (ggml_blocks.h) run the GEMV up to 8 rows: its passes read the groups in place, while the
// batched kernel first puts each group back in GGUF's layout (Qwen2.5-Coder-1.5B's 8960x1536 Q4_K at 8 rows, Zen 4,
// avx512: the GEMV's two passes 0.94-1.13x the batched kernel on GGUF rows, the batched kernel on row groups
// 0.77-0.95x; at 6 rows 1.30x; its Q6_K LM head at 8 rows 1.07-1.12x).
constexpr int64_t kRowGroupGemvMaxRows = 8;

// Activation rows up to which int8-dot mode runs the GEMV for `qtype` (its layout flag included); above it the
// batched kernel.
int64_t int8_gemv_max_rows(int64_t qtype);
// The most rows int8-dot mode takes for a format whose integer kernels beat the exact path on decode batches and
// verify rows only: its prompts stay exact (unless the mode is int8-dot-all); measured up to here.
constexpr int64_t kInt8GemmMaxRows = 64;
// The row limit of a format whose integer kernels beat the exact path at every row count, prompt chunks included.
constexpr int64_t kEveryRow = std::numeric_limits<int64_t>::max();

// Activation rows up to which int8-dot mode takes the integer path for `qtype`; more rows run the exact path.
// Per format and per build, measured against the exact path (ggml_dot.cpp); set_int8_dot_max_rows (an op) moves
// one, for benchmarks and tests.
int64_t int8_dot_max_rows(int64_t qtype);

// Whether a call of M activation rows of `qtype` on this thread runs the integer kernels (its matmul mode and, in
// kInt8Dot, the format's row limit): ggml_linear and the fused decode step decide by this one rule.
bool int8_dot_applies(int64_t qtype, int64_t M);

// y[M, N] = x[M, K] W^T with x quantized to int8 as described above; y in x's dtype.
at::Tensor int8_dot_linear(const at::Tensor& x, const uint8_t* weight, int64_t qtype, int64_t N);

// x rows quantized to int8: q [M, K], a scale per `block` values, sums of q per 16 values and per block.
struct Int8Rows {
  int64_t M = 0, K = 0, block = 0, blocks_per_row = 0;  // the division once, not per weight row
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> sums;
  std::vector<int32_t> block_sums;
  std::vector<int8_t> q_octets;  // q's whole 256-value octets in the order of paired Q4_0/Q4_1 octets (ggml_dot.cpp)

  const int8_t* q_row(int64_t m) const { return q.data() + m * K; }
  const int8_t* octet_row(int64_t m) const { return q_octets.data() + m * (K / 256 * 256); }
  const float* d_row(int64_t m) const { return d.data() + m * blocks_per_row; }
  const int16_t* sums_row(int64_t m) const { return sums.data() + m * (K / 16); }
  const int32_t* block_sums_row(int64_t m) const { return block_sums.data() + m * blocks_per_row; }
};

// The float step of every SIMD int8 kernel, per weight block and activation row, blocks in order along K, so that a
// row's output is the same bits whichever kernel computed it and whatever rows shared its call (issue 53): the GEMV
// here, the batched kernel (ggml_gemm.cpp's V::scaled, V::scaled_with_mins and V::added, on a vector of rows) and
// the row groups (on a vector of weight rows). tot and mins are the block's exact integer sums. The K-quants (a step
// per 256 weights) fuse it into acc: acc + (tot x_d) d (Q6_K), acc + (tot d + mins (-dmin)) x_d (Q4_K, Q5_K). The
// 32-weight formats add a whole term, (tot x_d) d, Q4_1's fma(x_d sum(q_x), m, that): the GEMV computes the terms
// of eight blocks side by side and adds them to eight weight rows' sums in their lanes (a transpose), where a fused
// step would chain eight scalar multiply-adds per octet (SmolLM2's Q4_1 GEMV took 1.6-2x as long so). The portable
// build, whose GEMV runs every batch, keeps its own plain-C order.
inline float block_step(float acc, int32_t tot, float x_d, float d) {
  return std::fma(static_cast<float>(tot) * x_d, d, acc);
}
inline float block_step_with_mins(float acc, int32_t tot, int32_t mins, float x_d, float d, float negdmin) {
  return std::fma(std::fma(static_cast<float>(mins), negdmin, static_cast<float>(tot) * d), x_d, acc);
}

// Weights per block of `qtype` (32, or 256 for the K-quants): the block its activations quantize by.
int64_t block_weights(int64_t qtype);

// Symmetric int8 of n values (a multiple of 32), the one rounding of every int8 kernel: d = max|x| / 127,
// q = round-half-even(x / d) (all 0 where d is 0); returns d. Vector code where the build has it, the same values.
float quantize_int8(const float* x, int64_t n, int8_t* q);

// x [M, K] (float) quantized into `out` (its buffers reused): symmetric int8 per `block` values.
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t block, Int8Rows& out);

// The GEMV on one range of weight rows, on the calling thread: y[m * ldy + n] for n in [first, last) and every
// row m of x (quantized by block_weights(qtype)); Y float or bf16. The fused decode step splits one projection's
// rows over the threads of its own parallel region with it; int8_dot_linear splits them by at::parallel_for.
template <typename Y>
void int8_gemv_rows(const Int8Rows& x, const uint8_t* weight, int64_t qtype, int64_t first, int64_t last, Y* y,
                    int64_t ldy);

// The batched kernel: y[M, N] (float or bf16, allocated) from x (float or bf16, contiguous [M, K]). False, with y untouched,
// where this build has none for `qtype` (the portable build; Q8_0 on AVX2).
bool int8_gemm_linear(const at::Tensor& x, const uint8_t* weight, int64_t qtype, int64_t N, at::Tensor& y);

}  // namespace carpool::ggml
