// Linear layers straight from GGML weight blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K), so a decode step
// streams the file's 4.5-8.5 bits a weight instead of 16 or 32. ggml_blocks.h turns blocks into values exactly
// as gguf-py dequantizes them, so a model's outputs do not depend on which path ran.
//
// A panel of weight rows is dequantized into a buffer that stays in cache and multiplied with every activation
// row by a register-blocked microkernel, so weights cross the memory bus once per call in their packed form.
// fp32 activations use FMAs (AVX-512: 16 lanes, AVX2: 8; portable: independent partial sums the compiler
// vectorizes) and hand large batches to MKL's GEMM on a dequantized copy. bf16 activations use the AVX512-BF16
// dot-product units on a bf16 panel (what oneDNN's bf16 GEMM computes); builds without them widen the
// activations to fp32 (exact) and run the fp32 kernel on an fp32 panel, which skips rounding the weights to bf16
// (as cheap as fp32 activations; rounding the panel to bf16 in integer ops cost AVX2 70% at batch 1, measured).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_gemm.h"
#include "ggml_blocks.h"
#include "ggml_dot.h"
#include "row_kernels.h"
#include "vec.h"

namespace {

using namespace carpool::ggml;

constexpr int64_t kTileRows = 4;  // weight rows dequantized and dotted together; kExactPanelRows (row_kernels.h)
                                  // of them (4 tiles) are dequantized together, each x row block reused across them
using carpool::kernels::checked_in_features, carpool::kernels::kExactBf16Dot, carpool::kernels::kExactPanelRows,
    carpool::kernels::kFp32FusedMaxRows;

// ---- microkernels -------------------------------------------------------------------------------------------

#ifdef CARPOOL_SIMD
// fp32 FMAs over vec.h's lanes: 16 (AVX-512) or 8 (AVX2).
struct Fp32Lanes {
  using Scalar = float;
  using Vec = carpool::simd::Vec;
  static constexpr int kStep = carpool::simd::kLanes;
  static Vec zero() { return carpool::simd::zero(); }
  static Vec load(const float* p) { return carpool::simd::load(p); }
  static Vec madd(Vec acc, Vec x, Vec w) { return carpool::simd::fmadd(x, w, acc); }
};
using carpool::simd::reduce4;
#endif
#ifdef CARPOOL_AVX512
constexpr int kMaxMR = 4;  // activation rows per microkernel call: 16 accumulators of the 32 vector registers
// Pairs of bf16 products accumulated in fp32, what oneDNN's bf16 GEMM computes, over 32 weights a step.
struct Bf16Lanes {
  using Scalar = c10::BFloat16;
  using Vec = __m512bh;
  static constexpr int kStep = 32;
  static __m512 zero() { return _mm512_setzero_ps(); }
  static Vec load(const c10::BFloat16* p) {
    const __m512i v = _mm512_loadu_si512(p);
    return reinterpret_cast<const __m512bh&>(v);
  }
  static __m512 madd(__m512 acc, Vec x, Vec w) { return _mm512_dpbf16_ps(acc, x, w); }
};
#elif defined(CARPOOL_AVX2)
constexpr int kMaxMR = 3;  // 12 accumulators + 3 x + 1 weight vector: the 16 ymm registers
#else
constexpr int kMaxMR = 4;
#endif

template <typename X> struct LanesOf;
#ifdef CARPOOL_SIMD
template <> struct LanesOf<float> { using type = Fp32Lanes; };
#endif
#ifdef CARPOOL_AVX512
template <> struct LanesOf<c10::BFloat16> { using type = Bf16Lanes; };
#endif

// Register-blocked dot products: MR activation rows x four weight rows of the dequantized tile, out[m][r].
// Each loaded x chunk feeds four weight rows and each weight chunk MR activation rows, so the loop runs on
// the FMA (or bf16 dot-product) units rather than on loads.
template <int MR, typename X>
inline void dot_tile(const X* x, const X* w, int64_t K, float* out) {
  if constexpr (requires { typename LanesOf<X>::type; }) {
    using L = typename LanesOf<X>::type;
    decltype(L::zero()) acc[MR][kTileRows];
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < kTileRows; ++r) acc[i][r] = L::zero();
    for (int64_t k = 0; k < K; k += L::kStep) {
      typename L::Vec wv[kTileRows];
      for (int r = 0; r < kTileRows; ++r) wv[r] = L::load(w + r * K + k);
      for (int i = 0; i < MR; ++i) {
        const typename L::Vec xv = L::load(x + i * K + k);
        for (int r = 0; r < kTileRows; ++r) acc[i][r] = L::madd(acc[i][r], xv, wv[r]);
      }
    }
    for (int i = 0; i < MR; ++i) _mm_storeu_ps(out + i * kTileRows, reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
  } else {
    static_assert(std::is_same_v<X, float>, "the portable kernel multiplies fp32 (bf16 is widened first)");
    // Independent partial sums per dot product, so the adds vectorize in order. One activation row: 4 x 8 lanes
    // in 8 SSE registers; more rows: 4 lanes keep the accumulators near the 16 registers (measured, portable
    // build: 8 lanes 2x faster than 4 at batch 1, 4 lanes 1.4x faster than 8 at batch 32).
    constexpr int kLanes = MR == 1 ? 8 : 4;
    float acc[MR][kTileRows][kLanes] = {};
    for (int64_t k = 0; k < K; k += kLanes)
      for (int i = 0; i < MR; ++i)
        for (int r = 0; r < kTileRows; ++r)
          for (int l = 0; l < kLanes; ++l) acc[i][r][l] += x[i * K + k + l] * w[r * K + k + l];
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < kTileRows; ++r) {
        float sum = 0.0f;
        for (int l = 0; l < kLanes; ++l) sum += acc[i][r][l];
        out[i * kTileRows + r] = sum;
      }
  }
}

template <typename X>
inline void dot_rows(const X* x, const X* w, int64_t rows_left, int64_t K, float* out) {
  if (rows_left >= kMaxMR) return dot_tile<kMaxMR>(x, w, K, out);
  switch (rows_left) {
    case 1: return dot_tile<1>(x, w, K, out);
    case 2: return dot_tile<2>(x, w, K, out);
    default: return dot_tile<3>(x, w, K, out);
  }
}

// y[m * ldy + n] = x[m] . W[n] for weight rows [first, last): per panel of weight rows, dequantize into X (the
// activations' kernel type), then every activation row block against every tile of the panel. `panel` is scratch
// of kExactPanelRows * K values. A row's result does not depend on which panel or range it falls in.
template <int64_t QT, typename X, typename Y>
void fused_linear_rows(const X* x, const uint8_t* weight, Layout layout, int64_t M, int64_t K, int64_t first,
                       int64_t last, Y* y, int64_t ldy, X* panel) {
  RowReader<QT> reader(weight, gguf_row_bytes<QT>(K), layout);
  alignas(16) float dots[kMaxMR * kTileRows];
  for (int64_t n0 = first; n0 < last; n0 += kExactPanelRows) {
    const int64_t rows = std::min(kExactPanelRows, last - n0);
    for (int64_t r = 0; r < rows; ++r)
      dequantize_row<QT>(reader(n0 + r), K, layout, panel + r * K);
    std::fill(panel + rows * K, panel + kExactPanelRows * K, X(0));
    for (int64_t m = 0; m < M; m += kMaxMR) {
      const int64_t mr = std::min<int64_t>(kMaxMR, M - m);
      for (int64_t t = 0; t * kTileRows < rows; ++t) {
        dot_rows(x + m * K, panel + t * kTileRows * K, mr, K, dots);
        const int64_t tile_rows = std::min(kTileRows, rows - t * kTileRows);
        for (int64_t i = 0; i < mr; ++i)
          for (int64_t r = 0; r < tile_rows; ++r) y[(m + i) * ldy + n0 + t * kTileRows + r] = Y(dots[i * kTileRows + r]);
      }
    }
  }
}

// y[M, N] = x[M, K] W^T, panels split over the threads.
template <int64_t QT, typename X, typename Y>
void fused_linear(const X* x, const uint8_t* weight, Layout layout, int64_t M, int64_t N, int64_t K, Y* y) {
  const int64_t panels = (N + kExactPanelRows - 1) / kExactPanelRows;
  at::parallel_for(0, panels, 2, [&](int64_t first, int64_t last) {
    std::vector<X> panel(kExactPanelRows * K);
    fused_linear_rows<QT>(x, weight, layout, M, K, first * kExactPanelRows, std::min(N, last * kExactPanelRows),
                          y, N, panel.data());
  });
}

template <int64_t QT, typename T>
void dequantize_rows(const uint8_t* weight, Layout layout, int64_t N, int64_t K, T* out) {
  at::parallel_for(0, N, 16, [&](int64_t first, int64_t last) {
    RowReader<QT> rows(weight, gguf_row_bytes<QT>(K), layout);
    for (int64_t n = first; n < last; ++n) dequantize_row<QT>(rows(n), K, layout, out + n * K);
  });
}

at::Tensor ggml_dequantize(const at::Tensor& qweight, int64_t qtype, at::ScalarType dtype) {
  const int64_t K = checked_in_features(qweight, qtype), N = qweight.size(0);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype: expected float32 or bfloat16");
  at::Tensor out = at::empty({N, K}, qweight.options().dtype(dtype));
  const RowFormat format = row_format(qtype);
  dispatch_qtype(format.qtype, [&]<int64_t QT>() {
    const uint8_t* blocks = qweight.data_ptr<uint8_t>();
    if (dtype == at::kFloat)
      dequantize_rows<QT>(blocks, format.layout, N, K, out.data_ptr<float>());
    else
      dequantize_rows<QT>(blocks, format.layout, N, K, out.data_ptr<c10::BFloat16>());
  });
  return out;
}

// Q4_0 or Q4_1 rows -> the same rows octet-major (ggml_blocks.h), whose qtype is then qtype | kOctetMajor.
at::Tensor ggml_octet_major(const at::Tensor& qweight, int64_t qtype) {
  const int64_t K = checked_in_features(qweight, qtype), N = qweight.size(0);
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1, "qtype: only Q4_0 (2) and Q4_1 (3) rows become octet-major, got ",
              qtype);
  at::Tensor out = qweight.clone();
  dispatch_qtype(qtype, [&]<int64_t QT>() {
    if constexpr (kHasOctetMajor<QT>) {
      constexpr int64_t kBytes = Format<QT>::kBytes;
      const int64_t octets = K / Format<QT>::kWeights / 8, row_bytes = qweight.size(1);
      const uint8_t* from = qweight.data_ptr<uint8_t>();
      uint8_t* to = out.data_ptr<uint8_t>();
      for (int64_t n = 0; n < N; ++n)
        for (int64_t o = 0; o < octets; ++o) {
          const int64_t octet = n * row_bytes + 8 * o * kBytes;
          for (int64_t j = 0; j < 8; ++j) {
            const uint8_t* block = from + octet + j * kBytes;
            constexpr Q4Offsets kFrom = kGgufQ4Offsets<QT>;
            const Q4Offsets at = octet_q4_offsets<QT>(j);
            std::memcpy(to + octet + at.d, block + kFrom.d, 2);
            if constexpr (QT == kQ4_1) std::memcpy(to + octet + at.m, block + kFrom.m, 2);
            std::memcpy(to + octet + at.nibbles, block + kFrom.nibbles, 16);
          }
        }
    }
  });
  return out;
}

// Q4_K or Q6_K rows (a multiple of 8 of them) -> the same rows in groups of eight (ggml_blocks.h), whose qtype is
// then qtype | kRowGroups.
at::Tensor ggml_row_groups(const at::Tensor& qweight, int64_t qtype) {
  const int64_t K = checked_in_features(qweight, qtype), N = qweight.size(0);
  TORCH_CHECK(qtype == kQ4_K || qtype == kQ6_K, "qtype: only Q4_K (12) and Q6_K (14) rows go in row groups, got ",
              qtype);
  TORCH_CHECK(N % kGroupRows == 0, "qweight: ", N, " rows do not split into groups of ", kGroupRows);
  at::Tensor out = at::empty_like(qweight);
  dispatch_qtype(qtype, [&]<int64_t QT>() {
    if constexpr (kHasRowGroups<QT>) {
      constexpr int64_t kBytes = Format<QT>::kBytes;
      const int64_t blocks = K / Format<QT>::kWeights, row_bytes = qweight.size(1);
      const uint8_t* from = qweight.data_ptr<uint8_t>();
      uint8_t* to = out.data_ptr<uint8_t>();
      at::parallel_for(0, N / kGroupRows, 1, [&](int64_t first, int64_t last) {
        for (int64_t g = first; g < last; ++g)
          for (int64_t b = 0; b < blocks; ++b)
            group_column<QT>(from + g * kGroupRows * row_bytes + b * kBytes, row_bytes,
                             to + g * kGroupRows * row_bytes + b * kGroupRows * kBytes);
      });
    }
  });
  return out;
}

// Rows in any layout (qtype with its layout's flag) -> the same rows as GGUF holds them.
at::Tensor ggml_gguf_rows(const at::Tensor& qweight, int64_t qtype) {
  const int64_t K = checked_in_features(qweight, qtype), N = qweight.size(0);
  const RowFormat format = row_format(qtype);
  at::Tensor out = at::empty_like(qweight);
  dispatch_qtype(format.qtype, [&]<int64_t QT>() {
    constexpr int64_t kBytes = Format<QT>::kBytes;
    const int64_t blocks = K / Format<QT>::kWeights;
    uint8_t* to = out.data_ptr<uint8_t>();
    RowReader<QT> rows(qweight.data_ptr<uint8_t>(), qweight.size(1), format.layout);
    for (int64_t n = 0; n < N; ++n) {
      GgufBlocks<QT> row(rows(n), K, format.layout);
      for (int64_t b = 0; b < blocks; ++b) std::memcpy(to + (n * blocks + b) * kBytes, row[b], kBytes);
    }
  });
  return out;
}

at::Tensor ggml_linear(const at::Tensor& input, const at::Tensor& qweight, int64_t qtype) {
  const int64_t K = checked_in_features(qweight, qtype), N = qweight.size(0);
  TORCH_CHECK(input.device().is_cpu(), "input: GGML kernels run on the CPU, got ", input.device());
  TORCH_CHECK(input.size(-1) == K, "input: last dimension ", input.size(-1), " != in_features ", K);
  const at::ScalarType dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "input: expected float32 or bfloat16, got ", dtype);
  const at::Tensor x = input.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = N;
  if (int8_dot_applies(qtype, M))
    return int8_dot_linear(x, qweight.data_ptr<uint8_t>(), qtype, N).view(out_shape);
  if (dtype == at::kFloat && M > kFp32FusedMaxRows) return at::mm(x, ggml_dequantize(qweight, qtype, dtype).t()).view(out_shape);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* blocks = qweight.data_ptr<uint8_t>();
  if (dtype == at::kBFloat16 && amx_exact_applies(M)) {
    amx_exact_linear(x.data_ptr<c10::BFloat16>(), blocks, qtype, M, N, K, y.data_ptr<c10::BFloat16>());
    return y.view(out_shape);
  }
  const RowFormat format = row_format(qtype);
  dispatch_qtype(format.qtype, [&]<int64_t QT>() {
    const Layout layout = format.layout;
    if (dtype == at::kFloat) {
      fused_linear<QT>(x.data_ptr<float>(), blocks, layout, M, N, K, y.data_ptr<float>());
    } else if constexpr (kExactBf16Dot) {
      fused_linear<QT>(x.data_ptr<c10::BFloat16>(), blocks, layout, M, N, K, y.data_ptr<c10::BFloat16>());
    } else {
      const at::Tensor wide = x.to(at::kFloat);  // exact: the fp32 kernel on bf16 inputs and fp32 weights
      fused_linear<QT>(wide.data_ptr<float>(), blocks, layout, M, N, K, y.data_ptr<c10::BFloat16>());
    }
  });
  return y.view(out_shape);
}

}  // namespace

namespace carpool::kernels {

using namespace carpool::ggml;

int64_t checked_in_features(const at::Tensor& qweight, int64_t qtype) {
  TORCH_CHECK(qweight.device().is_cpu(), "qweight: GGML kernels run on the CPU, got ", qweight.device());
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "qweight: expected a contiguous uint8 [rows, bytes per row] tensor");
  int64_t weights = 0, bytes = 0;
  dispatch_qtype(row_format(qtype).qtype, [&]<int64_t QT>() {
    weights = Format<QT>::kWeights;
    bytes = Format<QT>::kBytes;
  });
  TORCH_CHECK(qweight.size(1) % bytes == 0, "qweight: ", qweight.size(1), " bytes per row is not whole blocks of ",
              bytes);
  TORCH_CHECK(row_format(qtype).layout != Layout::kRowGroups || qweight.size(0) % kGroupRows == 0, "qweight: ",
              qweight.size(0), " rows in row groups is not whole groups of ", kGroupRows);
  return qweight.size(1) / bytes * weights;
}

template <typename X, typename Y>
void exact_gemv_rows(const X* x, int64_t M, const uint8_t* weight, int64_t qtype, int64_t K, int64_t first,
                     int64_t last, Y* y, int64_t ldy, X* panel) {
  if constexpr (std::is_same_v<X, float> || kExactBf16Dot) {
    const carpool::ggml::RowFormat format = carpool::ggml::row_format(qtype);
    carpool::ggml::dispatch_qtype(format.qtype, [&]<int64_t QT>() {
      fused_linear_rows<QT>(x, weight, format.layout, M, K, first, last, y, ldy, panel);
    });
  } else {
    TORCH_CHECK(false, "exact_gemv_rows: bf16 activations need the AVX-512 build (widen them to float elsewhere)");
  }
}
template void exact_gemv_rows(const float*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, int64_t, float*,
                              int64_t, float*);
template void exact_gemv_rows(const float*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, int64_t,
                              c10::BFloat16*, int64_t, float*);
template void exact_gemv_rows(const c10::BFloat16*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, int64_t,
                              c10::BFloat16*, int64_t, c10::BFloat16*);

}  // namespace carpool::kernels

TORCH_LIBRARY_FRAGMENT(carpool, m) {
  m.def("ggml_dequantize(Tensor qweight, int qtype, ScalarType dtype) -> Tensor");
  m.def("ggml_linear(Tensor input, Tensor qweight, int qtype) -> Tensor");
  m.def("ggml_octet_major(Tensor qweight, int qtype) -> Tensor");
  m.def("ggml_row_groups(Tensor qweight, int qtype) -> Tensor");
  m.def("ggml_gguf_rows(Tensor qweight, int qtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(carpool, CPU, m) {
  m.impl("ggml_dequantize", &ggml_dequantize);
  m.impl("ggml_linear", &ggml_linear);
  m.impl("ggml_octet_major", &ggml_octet_major);
  m.impl("ggml_row_groups", &ggml_row_groups);
  m.impl("ggml_gguf_rows", &ggml_gguf_rows);
}
