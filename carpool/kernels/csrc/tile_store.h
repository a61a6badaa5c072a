// A register tile's output into y: tiles hold out[(n * rv + r) * lanes + l] (column n, row (v + r) * lanes + l),
// y is row-major. Shared by the batched int8 kernel (ggml_gemm.cpp) and the AMX tiles (amx_gemm.cpp), whose
// accumulators both run along activation rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec.h"

#if defined(__AVX2__)
namespace carpool::kernels {

// copy(r, bytes) for each of `rows` rows, with bytes = count * kValueBytes a compile-time constant: one move each.
// A run-time size was a call to memmove per row, 10% of a 32-sequence decode step of the 1.5B on the forced avx2
// path (3-column tiles there; perf, Intel family 6 model 167).
template <int kValueBytes, typename Copy>
inline void copy_rows(int count, int rows, Copy copy) {
  auto each = [&]<int kCount>() {
    for (int r = 0; r < rows; ++r) copy(r, std::integral_constant<size_t, kCount * kValueBytes>{});
  };
  switch (count) {
    case 1: return each.template operator()<1>();
    case 2: return each.template operator()<2>();
    case 3: return each.template operator()<3>();
    default: return each.template operator()<4>();
  }
}

// Up to 4 columns (count) of up to 8 consecutive rows of a tile's output into y (row 0 at `first`, rows ldy apart):
// col[j] holds column j's 8 row values. Transposed in registers and stored a row's columns at a time, rounded as
// c10::BFloat16 rounds (bf16_bits): the loop of one converted value per store it replaces was 8-18% of a batched
// call (8960x1536 Q4_K and the 151936-row Q6_K head at 16-64 rows, one thread, Zen 4), mostly in its scalar rounding.
template <typename Y>
inline void store_rows(const float* const (&col)[4], int count, int rows, Y* first, int64_t ldy) {
  const __m256 c0 = _mm256_load_ps(col[0]), c1 = _mm256_load_ps(col[1]), c2 = _mm256_load_ps(col[2]),
               c3 = _mm256_load_ps(col[3]);
  if constexpr (std::is_same_v<Y, float>) {
    // rows r and r + 4 of the four columns in the two halves of row_pairs[r]
    const __m256 t0 = _mm256_unpacklo_ps(c0, c1), t1 = _mm256_unpackhi_ps(c0, c1);
    const __m256 t2 = _mm256_unpacklo_ps(c2, c3), t3 = _mm256_unpackhi_ps(c2, c3);
    alignas(32) float row_pairs[4][8];
    _mm256_store_ps(row_pairs[0], _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm256_store_ps(row_pairs[1], _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)));
    _mm256_store_ps(row_pairs[2], _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm256_store_ps(row_pairs[3], _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2)));
    auto row = [&](int r) { return &row_pairs[r % 4][4 * (r / 4)]; };
    copy_rows<4>(count, rows, [&](int r, auto bytes) { std::memcpy(first + r * ldy, row(r), bytes); });
  } else {
    // each 32-bit lane: columns 0 and 1 (or 2 and 3) of one row as bf16; interleaved, a row's four in 64 bits
    const __m256i c01 = _mm256_or_si256(bf16_bits(c0), _mm256_slli_epi32(bf16_bits(c1), 16));
    const __m256i c23 = _mm256_or_si256(bf16_bits(c2), _mm256_slli_epi32(bf16_bits(c3), 16));
    alignas(32) uint64_t row_bits[8];  // rows 0, 1, 4, 5, then 2, 3, 6, 7
    _mm256_store_si256(reinterpret_cast<__m256i*>(row_bits), _mm256_unpacklo_epi32(c01, c23));
    _mm256_store_si256(reinterpret_cast<__m256i*>(row_bits + 4), _mm256_unpackhi_epi32(c01, c23));
    constexpr int kSlot[8] = {0, 1, 4, 5, 2, 3, 6, 7};
    copy_rows<2>(count, rows, [&](int r, auto bytes) { std::memcpy(first + r * ldy, &row_bits[kSlot[r]], bytes); });
  }
}

// A tile's output (out[(n * rv + r) * lanes + l]: column n, row (v + r) * lanes + l) into y's rows below M.
template <int kLanes, typename Y>
inline void store_tile(const float* out, int rv, int tile_columns, int64_t v, int64_t M, Y* y, int64_t ldy) {
  alignas(32) static constexpr float kZeros[8] = {};
  for (int r = 0; r < rv; ++r)
    for (int l0 = 0; l0 < kLanes; l0 += 8) {
      const int64_t row = (v + r) * kLanes + l0;
      if (row >= M) return;
      for (int c = 0; c < tile_columns; c += 4) {
        const int count = std::min(4, tile_columns - c);
        const float* col[4];
        for (int j = 0; j < 4; ++j) col[j] = j < count ? out + ((c + j) * rv + r) * kLanes + l0 : kZeros;
        store_rows(col, count, static_cast<int>(std::min<int64_t>(8, M - row)), y + row * ldy + c, ldy);
      }
    }
}

}  // namespace carpool::kernels
#endif
