// GGML weight blocks -> float or bf16 values, for every block format the GGML kernels run (Q4_0, Q4_1, Q5_0,
// Q8_0, Q4_K, Q5_K, Q6_K). Layouts are llama.cpp's (what a GGUF file holds); every value is computed with the
// roundings gguf-py's dequantization uses (f16 scales widened to fp32, K-quant sub-scales as the fp32 products
// d * sc and dmin * m, then scale * q and, for formats with a minimum, one more rounded add), so a model's
// outputs do not depend on which path ran. Needs -ffp-contract=off: a fused multiply-add would round once.
//
// Each format is written once, as byte arithmetic on 32 quantized values at a time (Bytes32): SSE registers in
// the AVX2 and AVX-512 builds, plain byte loops in the portable one. A 32-value chunk then becomes weights as
// scale * q (+ bias) in vec.h's lanes: 16 (CARPOOL_AVX512), 8 (CARPOOL_AVX2) or one at a time.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace carpool::ggml {

// GGML type ids, as in the GGUF file.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;

// Weights per block and bytes per block.
template <int64_t QT> struct Format;
template <> struct Format<kQ4_0> { static constexpr int64_t kWeights = 32, kBytes = 18; };   // d, 16 B nibbles
template <> struct Format<kQ4_1> { static constexpr int64_t kWeights = 32, kBytes = 20; };   // d, m, 16 B nibbles
template <> struct Format<kQ5_0> { static constexpr int64_t kWeights = 32, kBytes = 22; };   // d, 4 B high bits, 16 B
template <> struct Format<kQ8_0> { static constexpr int64_t kWeights = 32, kBytes = 34; };   // d, 32 int8
template <> struct Format<kQ4_K> { static constexpr int64_t kWeights = 256, kBytes = 144; }; // d, dmin, 12 B scales, 128 B
template <> struct Format<kQ5_K> { static constexpr int64_t kWeights = 256, kBytes = 176; }; // Q4_K + 32 B high bits
template <> struct Format<kQ6_K> { static constexpr int64_t kWeights = 256, kBytes = 210; }; // 128 B low, 64 B high, 16 scales, d

// A weight matrix's rows as GGUF holds them, or in one of carpool's two arrangements of the same bytes, made once at
// load for the GEMV (ggml_dot.cpp) of the SIMD builds. The qtype passed with rearranged rows carries the layout's
// flag; every kernel that reads blocks takes them (GgufBlocks below).
enum class Layout { kGguf, kOctetMajor, kRowGroups };
//
// Octet-major rows (torch.ops.carpool.ggml_octet_major; Q4_0 and Q4_1): the GEMV otherwise gathers each octet's
// eight f16 scales from 18 or 20 bytes apart and its nibbles from two places per register. Each run of eight blocks
// (an octet) holds their eight d, then (Q4_1) their eight m, as f16, then the 16 bytes of nibbles of blocks 0, 4,
// 1, 5, 2, 6, 3, 7; blocks past the row's last whole octet keep GGUF's layout. Same bytes per row.
constexpr int64_t kOctetMajor = 1 << 8;
template <int64_t QT>
constexpr bool kHasOctetMajor = QT == kQ4_0 || QT == kQ4_1;
template <int64_t QT>
constexpr int64_t kOctetScaleBytes = QT == kQ4_1 ? 32 : 16;  // d (and m) of an octet's eight blocks
//
// Row groups (torch.ops.carpool.ggml_row_groups; Q4_K and Q6_K matrices of a multiple of 8 rows): rows 8g to 8g + 7
// share bytes [8g, 8g + 8) x row bytes, block column by block column: the eight rows' f16 halves (Q4_K: d, then dmin;
// Q6_K: d), half h of row r at 16 h + 2 r, then the block's four-byte words, word t of row r at 16 kHalves +
// 32 slot(t) + 4 r (GroupLayout). One 32-byte load is then a word of all eight rows, so the GEMV unpacks eight
// blocks' scales at once and dots each four activation values (broadcast) with eight rows, summing a row in one lane
// instead of reducing a vector per row (llama.cpp repacks Q4_K alike for its AVX2 GEMV, q4_K_8x8).
constexpr int64_t kRowGroups = 1 << 9, kGroupRows = 8;
template <int64_t QT>
constexpr bool kHasRowGroups = QT == kQ4_K || QT == kQ6_K;
// Where a GGUF block's f16 halves and four-byte words lie, and the order (slot) the group holds word t in: Q4_K's
// d and dmin lead its 144 bytes, 35 words follow (12 bytes of scales, 128 of nibbles), kept in order; Q6_K's 52
// words (128 bytes of low bits, 64 of high bits, 16 int8 scales) come before its d, and the group holds them in the
// order its GEMV reads them, so a column streams front to back: the scales (words 48-51), then for each pass
// c = 2 h + s of the GEMV (half h of 128 weights, its sub-blocks 8 h + 2 j + s) the three runs of four words it
// reads together: low words 16 h + 4 s to + 3, the same + 8, high words 32 + 4 c to + 3. Zen 4, the 1.5B's LM head
// at one row from memory (1 and 2 threads): in GGUF's word order the row-group GEMV ran 1.35x and 1.21x its GGUF
// rows' speed, in this order 1.59-1.63x and 1.40-1.89x (39 GB/s); per half (its 16 low words, then 8 high), which
// puts groups back by eight-word transposes, 1.36x and 1.22x, for 2-4% more at 32 rows (the batched kernel).
template <int64_t QT> struct GroupLayout;
template <> struct GroupLayout<kQ4_K> {
  static constexpr int64_t kHalves = 2, kHalvesAt = 0, kWords = 35, kWordsAt = 4;
  static constexpr int64_t slot(int64_t t) { return t; }
};
template <> struct GroupLayout<kQ6_K> {
  static constexpr int64_t kHalves = 1, kHalvesAt = 208, kWords = 52, kWordsAt = 0;
  static constexpr int64_t slot(int64_t t) {
    if (t >= 48) return t - 48;                                          // scales
    if (t >= 32) return 4 + 12 * ((t - 32) / 4) + 8 + t % 4;               // high bits of pass (t - 32) / 4
    return 4 + 12 * (t / 16 * 2 + t % 8 / 4) + 4 * (t % 16 / 8) + t % 4;  // low bits of pass 2 h + s
  }
};
constexpr int64_t group_half_offset(int64_t h, int64_t r) { return 16 * h + 2 * r; }
template <int64_t QT>
constexpr int64_t group_word_offset(int64_t t, int64_t r) {
  return 16 * GroupLayout<QT>::kHalves + 32 * GroupLayout<QT>::slot(t) + 4 * r;
}

// Where a Q4_0/Q4_1 block's f16 d, f16 m (Q4_1) and 16 bytes of nibbles lie, as byte offsets: from a GGUF block's
// start, or (block j of 8) from an octet-major octet's. The one statement of the layout.
struct Q4Offsets {
  int64_t d, m, nibbles;
};
template <int64_t QT>
constexpr Q4Offsets kGgufQ4Offsets{0, 2, Format<QT>::kBytes - 16};
template <int64_t QT>
constexpr Q4Offsets octet_q4_offsets(int64_t j) {
  return {2 * j, 16 + 2 * j, kOctetScaleBytes<QT> + 32 * (j % 4) + 16 * (j / 4)};
}

// A qtype as the ops take it: the GGML type, and the layout its flag names.
struct RowFormat {
  int64_t qtype;
  Layout layout;
};
inline RowFormat row_format(int64_t qtype) {
  const int64_t type = qtype & ~(kOctetMajor | kRowGroups);
  const bool octet_major = (qtype & kOctetMajor) != 0, row_groups = (qtype & kRowGroups) != 0;
  TORCH_CHECK(!octet_major || type == kQ4_0 || type == kQ4_1,
              "qtype: only Q4_0 (2) and Q4_1 (3) rows are octet-major, got ", qtype);
  TORCH_CHECK(!row_groups || ((type == kQ4_K || type == kQ6_K) && !octet_major),
              "qtype: only Q4_K (12) and Q6_K (14) rows come in row groups, got ", qtype);
  return {type, octet_major ? Layout::kOctetMajor : row_groups ? Layout::kRowGroups : Layout::kGguf};
}

// A Q4_0/Q4_1 block's parts where they lie, from the start of its block or octet and their offsets.
struct Q4Parts {
  const uint8_t* d;
  const uint8_t* m;
  const uint8_t* nibbles;
};
inline Q4Parts q4_parts(const uint8_t* start, Q4Offsets at) {
  return {start + at.d, start + at.m, start + at.nibbles};
}

// Block b of a weight row in GGUF's layout: the row's own bytes, or, in an octet-major row's octets, the block
// gathered into scratch (the portable GEMV). for_each_q4 gives where each block's parts lie instead, for readers
// that take a Q4 block apart anyway (gathering the blocks cost the batched int8 kernel 10% at 8 rows, the exact
// path 2-7%).
template <int64_t QT>
class GgufBlocks {
  static constexpr int64_t kBytes = Format<QT>::kBytes;

 public:
  GgufBlocks(const uint8_t* row, int64_t K, Layout layout)
      : row_(row),
        octet_blocks_(kHasOctetMajor<QT> && layout == Layout::kOctetMajor ? K / Format<QT>::kWeights / 8 * 8 : 0) {}

  // f(b, parts of block b) for the row's `blocks` blocks in order; an octet's eight at constant offsets.
  template <typename F>
  void for_each_q4(int64_t blocks, F&& f) const {
    int64_t b = 0;
    for (; b < octet_blocks_; b += 8) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) f(b + j, q4_parts(row_ + b * kBytes, octet_q4_offsets<QT>(j)));
    }
    for (; b < blocks; ++b) f(b, q4_parts(row_ + b * kBytes, kGgufQ4Offsets<QT>));
  }

  const uint8_t* operator[](int64_t b) {
    if constexpr (kHasOctetMajor<QT>) {
      if (b < octet_blocks_) {
        const Q4Parts parts = q4_parts(row_ + b / 8 * 8 * kBytes, octet_q4_offsets<QT>(b % 8));
        std::memcpy(scratch_, parts.d, 2);
        if constexpr (QT == kQ4_1) std::memcpy(scratch_ + 2, parts.m, 2);
        std::memcpy(scratch_ + kBytes - 16, parts.nibbles, 16);
        return scratch_;
      }
    }
    return row_ + b * kBytes;
  }

 private:
  const uint8_t* row_;
  int64_t octet_blocks_;
  uint8_t scratch_[Format<QT>::kBytes];
};

#ifdef CARPOOL_SIMD
// Q6_K's six-bit weights (0-63, before the - 32) from 32 bytes of low bits each of a half's two runs (low0: weights
// 0-31 and 64-95 in its nibbles, low1: 32-63 and 96-127) and their 32 bytes of high bits (two bits a weight):
// q[j] holds weights 32 j to 32 j + 31 of each byte position (llama.cpp's order), as GGUF rows and row groups alike.
inline void q6_k_weights(__m256i low0, __m256i low1, __m256i high, __m256i (&q)[4]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
  q[0] = _mm256_or_si256(_mm256_and_si256(low0, low4), _mm256_and_si256(_mm256_slli_epi16(high, 4), high2));
  q[1] = _mm256_or_si256(_mm256_and_si256(low1, low4), _mm256_and_si256(_mm256_slli_epi16(high, 2), high2));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low0, 4), low4), _mm256_and_si256(high, high2));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low1, 4), low4),
                         _mm256_and_si256(_mm256_srli_epi16(high, 2), high2));
}

// A Q6_K row group's sub-block s scale in each row's 32-bit lane (int8 s of the row's 16, sign-extended), from the
// group's four scale words (48-51, lane r row r's); the row-group GEMV and the batched kernel's unpack read them so.
inline __m256i q6_k_group_scale(const __m256i (&scale_words)[4], int s) {
  return _mm256_srai_epi32(_mm256_slli_epi32(scale_words[s / 4], 24 - 8 * (s % 4)), 24);
}

// Each 32-bit lane's low int16 in both its halves: a per-lane factor for vpmaddwd's pairs.
inline __m256i int16_in_both_halves(__m256i v) {
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}

// Four 32-bit words of eight rows (w[k]: word k of rows 0-7, lane r) -> each row's 16 bytes at out + r * row_bytes.
inline void store_rows4(const __m256i (&w)[4], uint8_t* out, int64_t row_bytes) {
  const __m256i a = _mm256_unpacklo_epi32(w[0], w[1]), b = _mm256_unpackhi_epi32(w[0], w[1]);
  const __m256i c = _mm256_unpacklo_epi32(w[2], w[3]), e = _mm256_unpackhi_epi32(w[2], w[3]);
  const __m256i rows[4] = {_mm256_unpacklo_epi64(a, c), _mm256_unpackhi_epi64(a, c), _mm256_unpacklo_epi64(b, e),
                           _mm256_unpackhi_epi64(b, e)};  // rows r (low half) and r + 4 (high)
  for (int r = 0; r < 4; ++r) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * row_bytes), _mm256_castsi256_si128(rows[r]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (r + 4) * row_bytes), _mm256_extracti128_si256(rows[r], 1));
  }
}

// Eight 32-bit words of eight rows, loaded from `words` (32 bytes apart) -> each row's 32 bytes at out + r * row_bytes.
inline void store_rows8(const uint8_t* words, uint8_t* out, int64_t row_bytes) {
  __m256i pairs[8], quads[8];
  for (int k = 0; k < 8; k += 2) {
    const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 32 * k));
    const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 32 * k + 32));
    pairs[k] = _mm256_unpacklo_epi32(first, second);
    pairs[k + 1] = _mm256_unpackhi_epi32(first, second);
  }
  for (int k = 0; k < 8; k += 4)
    for (int h = 0; h < 2; ++h) {
      quads[k + h] = _mm256_unpacklo_epi64(pairs[k + h], pairs[k + h + 2]);
      quads[k + h + 2] = _mm256_unpackhi_epi64(pairs[k + h], pairs[k + h + 2]);
    }
  // quads[kQuadOfRow[r]]: words 0 to 3 of rows r (low half) and r + 4 (high); 4 quads on, words 4 to 7
  constexpr int kQuadOfRow[4] = {0, 2, 1, 3};
  for (int r = 0; r < 4; ++r) {
    const int quad = kQuadOfRow[r];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * row_bytes),
                        _mm256_permute2x128_si256(quads[quad], quads[quad + 4], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r + 4) * row_bytes),
                        _mm256_permute2x128_si256(quads[quad], quads[quad + 4], 0x31));
  }
}
#endif

// One block column of a row group (kGroupRows blocks) -> the eight rows' GGUF blocks, row r's at out + r * row_bytes,
// by transposes of 32-bit lanes (copying the words one by one took the batched int8 kernel's 32-row calls 1.4x as
// long on Q4_K).
template <int64_t QT>
inline void ungroup_column(const uint8_t* column, uint8_t* out, int64_t row_bytes) {
  using G = GroupLayout<QT>;
#ifdef CARPOOL_SIMD
  const auto word = [&](int64_t t) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(column + group_word_offset<QT>(t, 0)));
  };
  if constexpr (QT == kQ4_K) {  // d and dmin as each row's first word, before words 0-2 (the scales)
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(column + group_half_offset(0, 0)));
    const __m128i dmin = _mm_loadu_si128(reinterpret_cast<const __m128i*>(column + group_half_offset(1, 0)));
    store_rows4({_mm256_set_m128i(_mm_unpackhi_epi16(d, dmin), _mm_unpacklo_epi16(d, dmin)), word(0), word(1), word(2)},
                out, row_bytes);
    for (int64_t t = 3; t < G::kWords; t += 8)
      store_rows8(column + group_word_offset<QT>(t, 0), out + G::kWordsAt + 4 * t, row_bytes);
  } else {  // Q6_K: its runs of four words (each in four slots in a row), then d
    for (int64_t t = 0; t < G::kWords; t += 4)
      store_rows4({word(t), word(t + 1), word(t + 2), word(t + 3)}, out + G::kWordsAt + 4 * t, row_bytes);
    for (int64_t r = 0; r < kGroupRows; ++r) std::memcpy(out + r * row_bytes + G::kHalvesAt, column + 2 * r, 2);
  }
#else
  for (int64_t r = 0; r < kGroupRows; ++r) {
    uint8_t* block = out + r * row_bytes;
    for (int64_t h = 0; h < G::kHalves; ++h)
      std::memcpy(block + G::kHalvesAt + 2 * h, column + group_half_offset(h, r), 2);
    for (int64_t t = 0; t < G::kWords; ++t)
      std::memcpy(block + G::kWordsAt + 4 * t, column + group_word_offset<QT>(t, r), 4);
  }
#endif
}

// Eight rows' GGUF blocks (row r's at blocks + r * row_bytes) -> one block column of a row group: the inverse, at load.
template <int64_t QT>
inline void group_column(const uint8_t* blocks, int64_t row_bytes, uint8_t* column) {
  using G = GroupLayout<QT>;
  for (int64_t r = 0; r < kGroupRows; ++r) {
    const uint8_t* block = blocks + r * row_bytes;
    for (int64_t h = 0; h < G::kHalves; ++h)
      std::memcpy(column + group_half_offset(h, r), block + G::kHalvesAt + 2 * h, 2);
    for (int64_t t = 0; t < G::kWords; ++t)
      std::memcpy(column + group_word_offset<QT>(t, r), block + G::kWordsAt + 4 * t, 4);
  }
}

// Weight rows of format QT as GGUF holds them (octet-major rows stay octet-major), asked for in increasing order by
// one thread: a row group is put back in GGUF's layout once, whole, for its eight rows (scratch of eight rows).
template <int64_t QT>
class RowReader {
 public:
  RowReader(const uint8_t* weight, int64_t row_bytes, Layout layout)
      : weight_(weight), row_bytes_(row_bytes), grouped_(layout == Layout::kRowGroups) {
    TORCH_CHECK(!grouped_ || kHasRowGroups<QT>, "RowReader: GGML type ", QT, " has no row groups");
  }

  const uint8_t* operator()(int64_t n) {
    if (!grouped_) return weight_ + n * row_bytes_;
    if constexpr (kHasRowGroups<QT>) {
      const int64_t group = n / kGroupRows;
      if (group != held_) {
        const uint8_t* from = weight_ + group * kGroupRows * row_bytes_;
        constexpr int64_t kBytes = Format<QT>::kBytes;
        scratch_.resize(kGroupRows * row_bytes_);
        for (int64_t b = 0; b < row_bytes_ / kBytes; ++b)
          ungroup_column<QT>(from + b * kGroupRows * kBytes, scratch_.data() + b * kBytes, row_bytes_);
        held_ = group;
      }
    }
    return scratch_.data() + n % kGroupRows * row_bytes_;
  }

  // The row group holding row n, in place (row groups only).
  const uint8_t* group(int64_t n) const { return weight_ + n / kGroupRows * kGroupRows * row_bytes_; }

 private:
  const uint8_t* weight_;
  int64_t row_bytes_;
  bool grouped_;
  int64_t held_ = -1;
  std::vector<uint8_t> scratch_;
};

// Calls fn.template operator()<QT>() for the runtime qtype.
template <typename Fn>
void dispatch_qtype(int64_t qtype, Fn&& fn) {
  switch (qtype) {
    case kQ4_0: return fn.template operator()<kQ4_0>();
    case kQ4_1: return fn.template operator()<kQ4_1>();
    case kQ5_0: return fn.template operator()<kQ5_0>();
    case kQ8_0: return fn.template operator()<kQ8_0>();
    case kQ4_K: return fn.template operator()<kQ4_K>();
    case kQ5_K: return fn.template operator()<kQ5_K>();
    case kQ6_K: return fn.template operator()<kQ6_K>();
  }
  TORCH_CHECK(false, "qtype: unsupported GGML type ", qtype,
              " (supported: Q4_0=2, Q4_1=3, Q5_0=6, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)");
}

// Bytes of a row of K weights in QT's blocks, and the same for a runtime qtype.
template <int64_t QT>
constexpr int64_t gguf_row_bytes(int64_t K) {
  return K / Format<QT>::kWeights * Format<QT>::kBytes;
}
inline int64_t gguf_row_bytes(int64_t qtype, int64_t K) {
  int64_t bytes = 0;
  dispatch_qtype(qtype, [&]<int64_t QT>() { bytes = gguf_row_bytes<QT>(K); });
  return bytes;
}

// Q4_K / Q5_K sub-block scales and minimums, 6 bits each in the 12 bytes' three 32-bit words u, as bytes: scales[0]
// holds sub-blocks 0-3's scales, scales[1] 4-7's, mins alike (llama.cpp's get_scale_min_k4 for every j at once, in
// 32-bit operations). W is uint32_t, or a GCC vector of them: the words of eight blocks at once (Q4_K row groups).
template <typename W>
inline void k_scale_min_words(W u0, W u1, W u2, W (&scales)[2], W (&mins)[2]) {
  constexpr uint32_t kLow6 = 0x3F3F3F3F, kLow4 = 0x0F0F0F0F, kLow2 = 0x03030303;
  scales[0] = u0 & kLow6;
  scales[1] = (u2 & kLow4) | (((u0 >> 6) & kLow2) << 4);
  mins[0] = u1 & kLow6;
  mins[1] = ((u2 >> 4) & kLow4) | (((u1 >> 6) & kLow2) << 4);
}

// The same for one block's 12 bytes, as 8 scale bytes and 8 minimum bytes in two words, for the GEMV
// (ggml_dot.cpp) and the batched kernel (ggml_gemm.cpp) alike (no byte stores to reload).
inline void k_scales_mins_packed(const uint8_t* packed, uint64_t& scales, uint64_t& mins) {
  uint32_t u[3], s[2], m[2];
  std::memcpy(u, packed, 12);
  k_scale_min_words(u[0], u[1], u[2], s, m);
  scales = s[0] | static_cast<uint64_t>(s[1]) << 32;
  mins = m[0] | static_cast<uint64_t>(m[1]) << 32;
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef CARPOOL_SIMD
  return _cvtsh_ss(bits);  // one F16C instruction; c10::Half's portable conversion is a dozen
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// ---- Bytes32: 32 quantized values, one byte each ----------------------------------------------------------------

#ifdef CARPOOL_SIMD
// Two 16-byte halves rather than one 32-byte register: the int8 -> int32 widening reads 16 (or 8) bytes of an
// xmm register, so halves need no 128-bit insert and extract per chunk, and 128-bit byte ops run on every vector
// port where 512-bit work has two.
struct Bytes32 {
  __m128i lo, hi;
};
inline __m128i bytes16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline Bytes32 load32(const uint8_t* p) { return {bytes16(p), bytes16(p + 16)}; }
// 16 bytes of nibbles -> their low nibbles, then their high nibbles (weights 0-15 and 16-31 of a 32-weight block).
inline Bytes32 nibbles16(const uint8_t* p) {
  const __m128i raw = bytes16(p), mask = _mm_set1_epi8(0x0F);
  return {_mm_and_si128(raw, mask), _mm_and_si128(_mm_srli_epi16(raw, 4), mask)};
}
// Per byte: (x >> kShift) & kMask (kShift < 0 shifts left). Shifts run on 16-bit lanes; the static_assert keeps
// the bits that cross between a lane's two bytes outside kMask, so the result is the per-byte one.
template <int kShift, int kMask>
inline __m128i bits(__m128i v) {
  static_assert(kShift >= 0 ? (kMask >> (8 - kShift)) == 0 : (kMask & ((1 << -kShift) - 1)) == 0);
  if constexpr (kShift > 0) v = _mm_srli_epi16(v, kShift);
  if constexpr (kShift < 0) v = _mm_slli_epi16(v, -kShift);
  return _mm_and_si128(v, _mm_set1_epi8(static_cast<char>(kMask)));
}
template <int kShift, int kMask>
inline Bytes32 bits(Bytes32 x) {
  return {bits<kShift, kMask>(x.lo), bits<kShift, kMask>(x.hi)};
}
inline Bytes32 operator|(Bytes32 a, Bytes32 b) { return {_mm_or_si128(a.lo, b.lo), _mm_or_si128(a.hi, b.hi)}; }
inline Bytes32 minus(Bytes32 a, int8_t k) {
  const __m128i kk = _mm_set1_epi8(k);
  return {_mm_sub_epi8(a.lo, kk), _mm_sub_epi8(a.hi, kk)};
}
// Byte i = 0xFF where bit i of `mask` is set, else 0 (llama.cpp's bytes_from_bits_32, in two halves).
inline Bytes32 spread_bits(uint32_t mask) {
  const __m128i all = _mm_set1_epi32(static_cast<int>(mask));
  const __m128i other_bits = _mm_set1_epi64x(0x7fbfdfeff7fbfdfe);  // all but bit (i % 8) of byte i
  const auto spread = [&](int64_t which_bytes) {
    const __m128i bytes = _mm_shuffle_epi8(all, _mm_set_epi64x(which_bytes + 0x0101010101010101, which_bytes));
    return _mm_cmpeq_epi8(_mm_or_si128(bytes, other_bits), _mm_set1_epi64x(-1));
  };
  return {spread(0), spread(0x0202020202020202)};
}
#else
struct Bytes32 {
  uint8_t v[32];
};
inline Bytes32 load32(const uint8_t* p) {
  Bytes32 x;
  std::memcpy(x.v, p, 32);
  return x;
}
inline Bytes32 nibbles16(const uint8_t* p) {
  Bytes32 x;
  for (int i = 0; i < 16; ++i) {
    x.v[i] = p[i] & 0x0F;
    x.v[i + 16] = p[i] >> 4;
  }
  return x;
}
template <int kShift, int kMask>
inline Bytes32 bits(Bytes32 x) {
  for (auto& b : x.v) {
    if constexpr (kShift >= 0) b = static_cast<uint8_t>((b >> kShift) & kMask);
    else b = static_cast<uint8_t>((b << -kShift) & kMask);
  }
  return x;
}
inline Bytes32 operator|(Bytes32 a, Bytes32 b) {
  for (int i = 0; i < 32; ++i) a.v[i] |= b.v[i];
  return a;
}
inline Bytes32 minus(Bytes32 a, int8_t k) {
  for (auto& b : a.v) b = static_cast<uint8_t>(b - k);
  return a;
}
inline Bytes32 spread_bits(uint32_t mask) {
  Bytes32 x;
  for (int i = 0; i < 32; ++i) x.v[i] = (mask >> i) & 1 ? 0xFF : 0;
  return x;
}
#endif

#ifdef CARPOOL_AVX512
// 32 values from two 16-lane halves (vec.h's store16), bf16 in one conversion for both.
template <typename Out>
inline void store32(Out* out, __m512 lo, __m512 hi) {
  carpool::store16(out, lo);
  carpool::store16(out + 16, hi);
}
inline void store32(c10::BFloat16* out, __m512 lo, __m512 hi) {
  const __m512bh packed = _mm512_cvtne2ps_pbh(hi, lo);  // round to nearest even, as torch's .to(bfloat16)
  _mm512_storeu_si512(out, reinterpret_cast<const __m512i&>(packed));
}
#endif

// Weights i of a 32-value chunk: scale * q[i] (+ bias), q as int8, with one scale for i < 16 and one for i >= 16.
template <bool kBias, typename Out>
inline void emit(Bytes32 q, float scale_lo, float scale_hi, float bias, Out* out) {
#ifdef CARPOOL_AVX512
  const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q.lo));
  const __m512 q_hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q.hi));
  __m512 lo = _mm512_mul_ps(_mm512_set1_ps(scale_lo), q_lo), hi = _mm512_mul_ps(_mm512_set1_ps(scale_hi), q_hi);
  if constexpr (kBias) {
    lo = _mm512_add_ps(lo, _mm512_set1_ps(bias));
    hi = _mm512_add_ps(hi, _mm512_set1_ps(bias));
  }
  store32(out, lo, hi);
#elif defined(CARPOOL_AVX2)
  const __m128i halves[2] = {q.lo, q.hi};
  for (int h = 0; h < 2; ++h) {
    const __m256 scale = _mm256_set1_ps(h == 0 ? scale_lo : scale_hi);
    const __m128i eights[2] = {halves[h], _mm_unpackhi_epi64(halves[h], halves[h])};
    for (int e = 0; e < 2; ++e) {
      __m256 w = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eights[e])));
      if constexpr (kBias) w = _mm256_add_ps(w, _mm256_set1_ps(bias));
      carpool::store8(out + 16 * h + 8 * e, w);
    }
  }
#else
  for (int i = 0; i < 32; ++i) {
    float w = (i < 16 ? scale_lo : scale_hi) * static_cast<float>(static_cast<int8_t>(q.v[i]));
    if constexpr (kBias) w = w + bias;
    out[i] = Out(w);  // c10::BFloat16 rounds to nearest even, as torch's .to(bfloat16)
  }
#endif
}

// ---- the formats --------------------------------------------------------------------------------------------

// K-quant sub-block j's 6-bit scale and minimum, from the 12 packed bytes (llama.cpp's get_scale_min_k4).
inline void k_scale_min(const uint8_t* packed, int j, int& scale, int& min) {
  if (j < 4) {
    scale = packed[j] & 63;
    min = packed[j + 4] & 63;
  } else {
    scale = (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4);
    min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
  }
}

// A Q4_0 or Q4_1 block from its parts -> 32 values at out.
template <int64_t QT, typename Out>
inline void dequantize_q4(const Q4Parts& parts, Out* out) {
  const float d = half_to_float(parts.d);
  if constexpr (QT == kQ4_0)
    emit<false>(minus(nibbles16(parts.nibbles), 8), d, d, 0.0f, out);  // w = d * (q - 8)
  else
    emit<true>(nibbles16(parts.nibbles), d, d, half_to_float(parts.m), out);  // w = d * q + m
}

// One block at p -> Format<QT>::kWeights values at out.
template <int64_t QT, typename Out>
inline void dequantize_block(const uint8_t* p, Out* out) {
  if constexpr (kHasOctetMajor<QT>) {
    dequantize_q4<QT>(q4_parts(p, kGgufQ4Offsets<QT>), out);
  } else if constexpr (QT == kQ5_0) {
    const float d = half_to_float(p);  // w = d * (q - 16), bit 4 of q i is bit i of the 32-bit qh
    uint32_t high;
    std::memcpy(&high, p + 2, 4);
    emit<false>(minus(nibbles16(p + 6) | bits<0, 0x10>(spread_bits(high)), 16), d, d, 0.0f, out);
  } else if constexpr (QT == kQ8_0) {
    const float d = half_to_float(p);  // w = d * q
    emit<false>(load32(p + 2), d, d, 0.0f, out);
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    // 8 sub-blocks of 32: w = (d * scale_j) * q - (dmin * min_j). Byte i of 32-byte group c holds weight i of
    // sub-block 2c (low nibble) and of 2c + 1 (high nibble); Q5_K's q bit 4 is bit j of high-bits byte i.
    const float d = half_to_float(p), dmin = half_to_float(p + 2);
    const uint8_t* packed = p + 4;
    const uint8_t* qs = p + (QT == kQ5_K ? 48 : 16);
    Bytes32 high;
    if constexpr (QT == kQ5_K) high = load32(p + 16);
    for (int c = 0; c < 4; ++c) {
      const Bytes32 raw = load32(qs + 32 * c);
      Bytes32 q[2] = {bits<0, 0x0F>(raw), bits<4, 0x0F>(raw)};
      if constexpr (QT == kQ5_K) {
        q[0] = q[0] | bits<-4, 0x10>(high);
        q[1] = q[1] | bits<-3, 0x10>(high);
        high = bits<2, 0x3F>(high);
      }
      for (int h = 0; h < 2; ++h) {
        int scale, min;
        k_scale_min(packed, 2 * c + h, scale, min);
        const float sub_d = d * static_cast<float>(scale), sub_min = dmin * static_cast<float>(min);
        emit<true>(q[h], sub_d, sub_d, -sub_min, out + 64 * c + 32 * h);  // x + (-m) rounds as x - m
      }
    }
  } else if constexpr (QT == kQ6_K) {
    // 16 sub-blocks of 16: w = (d * scale_s) * (q - 32), q 6 bits. Each half of 128 weights takes 64 low-nibble
    // bytes (weights 0-31 and 32-63 in their low nibbles, 64-95 and 96-127 in their high) and 32 bytes of high
    // bit pairs (bits 0-1, 2-3, 4-5, 6-7 of byte i for weights i, 32 + i, 64 + i, 96 + i).
    const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
    const float d = half_to_float(p + 208);
    for (int h = 0; h < 2; ++h) {
      const Bytes32 low0 = load32(p + 64 * h), low1 = load32(p + 64 * h + 32), high = load32(p + 128 + 32 * h);
      const Bytes32 q[4] = {
          bits<0, 0x0F>(low0) | bits<-4, 0x30>(high),
          bits<0, 0x0F>(low1) | bits<-2, 0x30>(high),
          bits<4, 0x0F>(low0) | bits<0, 0x30>(high),
          bits<4, 0x0F>(low1) | bits<2, 0x30>(high),
      };
      for (int s = 0; s < 4; ++s) {
        const int sub = 8 * h + 2 * s;
        emit<false>(minus(q[s], 32), d * static_cast<float>(scales[sub]), d * static_cast<float>(scales[sub + 1]),
                    0.0f, out + 128 * h + 32 * s);
      }
    }
  } else {
    static_assert(QT != QT, "not a GGML kernel type");
  }
}

// A weight row of K values (from RowReader: GGUF's layout or octet-major) -> K values at out.
template <int64_t QT, typename Out>
void dequantize_row(const uint8_t* row, int64_t K, Layout layout, Out* out) {
  GgufBlocks<QT> blocks(row, K, layout);
  if constexpr (kHasOctetMajor<QT>)
    blocks.for_each_q4(K / 32, [&](int64_t b, const Q4Parts& parts) { dequantize_q4<QT>(parts, out + 32 * b); });
  else
    for (int64_t b = 0; b < K / Format<QT>::kWeights; ++b)
      dequantize_block<QT>(blocks[b], out + b * Format<QT>::kWeights);
}

}  // namespace carpool::ggml
