// Linear layers straight from GGML weight blocks (Q4_0, Q4_1, Q8_0), so a decode step streams the file's
// 4.5-8.5 bits a weight instead of 16 or 32. Block layouts are llama.cpp's (what a GGUF file holds); values
// are computed exactly as gguf-py dequantizes them, so a model's outputs do not depend on which path ran.
//
// A panel of weight rows is dequantized into a buffer that stays in cache and multiplied with every activation
// row by a register-blocked microkernel, so weights cross the memory bus once per call in their packed form.
// bf16 activations use the AVX512-BF16 dot-product units (what oneDNN's bf16 GEMM computes); fp32 ones use
// FMAs, and hand large batches to MKL's GEMM on a dequantized copy.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#define CARPOOL_GGML_AVX512 1
#endif

namespace {

// GGML type ids, as in the GGUF file.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kBlock = 32;           // weights per block, all three formats
constexpr int64_t kTileRows = 4;         // weight rows dequantized and dotted together
// fp32 only: above this many activation rows, dequantize + MKL's GEMM beats the fused loop (measured).
// The bf16 fused loop runs on the bf16 dot-product units and keeps up with oneDNN at every size.
constexpr int64_t kFp32FusedMaxRows = 256;

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;  // f16 d, 16 bytes of nibbles; w = d * (q - 8)
    case kQ4_1: return 20;  // f16 d, f16 m, 16 bytes of nibbles; w = d * q + m
    case kQ8_0: return 34;  // f16 d, 32 int8; w = d * q
  }
  TORCH_CHECK(false, "qtype: unsupported GGML type ", qtype, " (supported: Q4_0=2, Q4_1=3, Q8_0=8)");
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef CARPOOL_GGML_AVX512
  return _cvtsh_ss(bits);  // one F16C instruction; c10::Half's portable conversion is a dozen
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

#ifdef CARPOOL_GGML_AVX512
// One block -> weights 0-15 in lo, 16-31 in hi. Nibble order: byte j holds weight j (low nibble) and j + 16
// (high nibble). d * q (+ m) in two roundings, as gguf-py computes it.
template <int64_t QT>
inline void dequantize_block(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(half_to_float(p));
  if constexpr (QT == kQ8_0) {
    const __m128i* qs = reinterpret_cast<const __m128i*>(p + 2);
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs + 1))));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (QT == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m512i qlo = _mm512_cvtepu8_epi32(_mm_and_si128(raw, mask));
    __m512i qhi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
    if constexpr (QT == kQ4_0) {
      const __m512i eight = _mm512_set1_epi32(8);
      qlo = _mm512_sub_epi32(qlo, eight);
      qhi = _mm512_sub_epi32(qhi, eight);
    }
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(qlo));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(qhi));
    if constexpr (QT == kQ4_1) {
      const __m512 m = _mm512_set1_ps(half_to_float(p + 2));
      lo = _mm512_add_ps(lo, m);
      hi = _mm512_add_ps(hi, m);
    }
  }
}

inline void store_block(__m512 lo, __m512 hi, float* out) {
  _mm512_storeu_ps(out, lo);
  _mm512_storeu_ps(out + 16, hi);
}

inline void store_block(__m512 lo, __m512 hi, c10::BFloat16* out) {
#ifdef __AVX512BF16__
  const __m512bh packed = _mm512_cvtne2ps_pbh(hi, lo);  // round to nearest even, as torch's .to(bfloat16)
  _mm512_storeu_si512(out, reinterpret_cast<const __m512i&>(packed));
#else
  alignas(64) float wide[kBlock];
  store_block(lo, hi, wide);
  for (int i = 0; i < kBlock; ++i) out[i] = c10::BFloat16(wide[i]);
#endif
}
#else
template <int64_t QT>
inline void dequantize_block(const uint8_t* p, float* out) {
  const float d = half_to_float(p);
  if constexpr (QT == kQ8_0) {
    for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(static_cast<int8_t>(p[2 + i]));
  } else {
    const uint8_t* qs = p + (QT == kQ4_1 ? 4 : 2);
    const float m = QT == kQ4_1 ? half_to_float(p + 2) : 0.0f;
    const int offset = QT == kQ4_0 ? 8 : 0;
    for (int i = 0; i < 16; ++i) {
      const float lo = static_cast<float>((qs[i] & 0x0F) - offset), hi = static_cast<float>((qs[i] >> 4) - offset);
      out[i] = QT == kQ4_1 ? d * lo + m : d * lo;
      out[i + 16] = QT == kQ4_1 ? d * hi + m : d * hi;
    }
  }
}
#endif

// A weight row (K / 32 blocks) -> K values of T.
template <int64_t QT, typename T>
void dequantize_row(const uint8_t* row, int64_t K, T* out) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
#ifdef CARPOOL_GGML_AVX512
    __m512 lo, hi;
    dequantize_block<QT>(row + b * block_bytes(QT), lo, hi);
    store_block(lo, hi, out + b * kBlock);
#else
    float block[kBlock];
    dequantize_block<QT>(row + b * block_bytes(QT), block);
    for (int i = 0; i < kBlock; ++i) out[b * kBlock + i] = T(block[i]);
#endif
  }
}

#ifdef CARPOOL_GGML_AVX512
// The vector step of the microkernel per activation dtype: fp32 FMAs over 16 weights, or (AVX512-BF16) pairs of
// bf16 products accumulated in fp32, what oneDNN's bf16 GEMM computes, over 32.
struct Fp32Lanes {
  using Vec = __m512;
  static constexpr int kStep = 16;
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 madd(__m512 acc, Vec x, Vec w) { return _mm512_fmadd_ps(x, w, acc); }
};
#ifdef __AVX512BF16__
struct Bf16Lanes {
  using Vec = __m512bh;
  static constexpr int kStep = 32;
  static Vec load(const c10::BFloat16* p) {
    const __m512i v = _mm512_loadu_si512(p);
    return reinterpret_cast<const __m512bh&>(v);
  }
  static __m512 madd(__m512 acc, Vec x, Vec w) { return _mm512_dpbf16_ps(acc, x, w); }
};
#endif
template <typename T> struct LanesOf;
template <> struct LanesOf<float> { using type = Fp32Lanes; };
#ifdef __AVX512BF16__
template <> struct LanesOf<c10::BFloat16> { using type = Bf16Lanes; };
#endif
#endif

// Register-blocked dot products: MR activation rows x four weight rows of the dequantized tile, out[m][r].
// Each loaded x chunk feeds four weight rows and each weight chunk MR activation rows, so the loop runs on
// the FMA (or bf16 dot-product) units rather than on loads.
template <int MR, typename T>
inline void dot_tile(const T* x, const T* w, int64_t K, float* out) {
#ifdef CARPOOL_GGML_AVX512
  if constexpr (requires { typename LanesOf<T>::type; }) {
    using L = typename LanesOf<T>::type;
    __m512 acc[MR][kTileRows];
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < kTileRows; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += L::kStep) {
      typename L::Vec wv[kTileRows];
      for (int r = 0; r < kTileRows; ++r) wv[r] = L::load(w + r * K + k);
      for (int i = 0; i < MR; ++i) {
        const typename L::Vec xv = L::load(x + i * K + k);
        for (int r = 0; r < kTileRows; ++r) acc[i][r] = L::madd(acc[i][r], xv, wv[r]);
      }
    }
    for (int i = 0; i < MR; ++i)
      _mm_storeu_ps(out + i * kTileRows, carpool::reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    return;
  }
#endif
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < kTileRows; ++r) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += static_cast<float>(x[i * K + k]) * static_cast<float>(w[r * K + k]);
      out[i * kTileRows + r] = sum;
    }
}

constexpr int kMaxMR = 4;  // activation rows per microkernel call: 16 accumulators of the 32 vector registers
constexpr int64_t kPanelTiles = 4;  // weight tiles dequantized together; each x row block is reused across them

template <typename T>
inline void dot_rows(const T* x, const T* w, int64_t rows_left, int64_t K, float* out) {
  switch (rows_left) {
    case 1: return dot_tile<1>(x, w, K, out);
    case 2: return dot_tile<2>(x, w, K, out);
    case 3: return dot_tile<3>(x, w, K, out);
    default: return dot_tile<kMaxMR>(x, w, K, out);
  }
}

template <int64_t QT, typename T>
void fused_linear(const T* x, const uint8_t* weight, int64_t M, int64_t N, int64_t K, T* y) {
  const int64_t row_bytes = K / kBlock * block_bytes(QT);
  const int64_t panel_rows = kPanelTiles * kTileRows;
  const int64_t panels = (N + panel_rows - 1) / panel_rows;
  at::parallel_for(0, panels, 2, [&](int64_t first, int64_t last) {
    std::vector<T> w(panel_rows * K);
    alignas(16) float dots[kMaxMR * kTileRows];
    for (int64_t panel = first; panel < last; ++panel) {
      const int64_t n0 = panel * panel_rows, rows = std::min(panel_rows, N - n0);
      for (int64_t r = 0; r < rows; ++r) dequantize_row<QT>(weight + (n0 + r) * row_bytes, K, w.data() + r * K);
      std::fill(w.begin() + rows * K, w.end(), T(0));
      for (int64_t m = 0; m < M; m += kMaxMR) {
        const int64_t mr = std::min<int64_t>(kMaxMR, M - m);
        for (int64_t t = 0; t * kTileRows < rows; ++t) {
          dot_rows(x + m * K, w.data() + t * kTileRows * K, mr, K, dots);
          const int64_t tile_rows = std::min(kTileRows, rows - t * kTileRows);
          for (int64_t i = 0; i < mr; ++i)
            for (int64_t r = 0; r < tile_rows; ++r) y[(m + i) * N + n0 + t * kTileRows + r] = T(dots[i * kTileRows + r]);
        }
      }
    }
  });
}

template <int64_t QT, typename T>
void dequantize_rows(const uint8_t* weight, int64_t N, int64_t K, T* out) {
  const int64_t row_bytes = K / kBlock * block_bytes(QT);
  at::parallel_for(0, N, 16, [&](int64_t first, int64_t last) {
    for (int64_t n = first; n < last; ++n) dequantize_row<QT>(weight + n * row_bytes, K, out + n * K);
  });
}

// Calls fn.template operator()<QT>() for the runtime qtype.
template <typename Fn>
void dispatch_qtype(int64_t qtype, Fn&& fn) {
  switch (qtype) {
    case kQ4_0: return fn.template operator()<kQ4_0>();
    case kQ4_1: return fn.template operator()<kQ4_1>();
    case kQ8_0: return fn.template operator()<kQ8_0>();
  }
  block_bytes(qtype);  // raises the error naming the type
}

int64_t checked_in_features(const at::Tensor& qweight, int64_t qtype) {
  TORCH_CHECK(qweight.device().is_cpu(), "qweight: GGML kernels run on the CPU, got ", qweight.device());
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "qweight: expected a contiguous uint8 [rows, bytes per row] tensor");
  const int64_t bytes = block_bytes(qtype);
  TORCH_CHECK(qweight.size(1) % bytes == 0, "qweight: ", qweight.size(1), " bytes per row is not whole blocks");
  return qweight.size(1) / bytes * kBlock;
}

at::Tensor ggml_dequantize(const at::Tensor& qweight, int64_t qtype, at::ScalarType dtype) {
  const int64_t K = checked_in_features(qweight, qtype), N = qweight.size(0);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype: expected float32 or bfloat16");
  at::Tensor out = at::empty({N, K}, qweight.options().dtype(dtype));
  dispatch_qtype(qtype, [&]<int64_t QT>() {
    if (dtype == at::kFloat)
      dequantize_rows<QT>(qweight.data_ptr<uint8_t>(), N, K, out.data_ptr<float>());
    else
      dequantize_rows<QT>(qweight.data_ptr<uint8_t>(), N, K, out.data_ptr<c10::BFloat16>());
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
  if (dtype == at::kFloat && M > kFp32FusedMaxRows) return at::mm(x, ggml_dequantize(qweight, qtype, dtype).t()).view(out_shape);
  at::Tensor y = at::empty({M, N}, x.options());
  dispatch_qtype(qtype, [&]<int64_t QT>() {
    if (dtype == at::kFloat)
      fused_linear<QT>(x.data_ptr<float>(), qweight.data_ptr<uint8_t>(), M, N, K, y.data_ptr<float>());
    else
      fused_linear<QT>(x.data_ptr<c10::BFloat16>(), qweight.data_ptr<uint8_t>(), M, N, K,
                       y.data_ptr<c10::BFloat16>());
  });
  return y.view(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(carpool, m) {
  m.def("ggml_dequantize(Tensor qweight, int qtype, ScalarType dtype) -> Tensor");
  m.def("ggml_linear(Tensor input, Tensor qweight, int qtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(carpool, CPU, m) {
  m.impl("ggml_dequantize", &ggml_dequantize);
  m.impl("ggml_linear", &ggml_linear);
}
