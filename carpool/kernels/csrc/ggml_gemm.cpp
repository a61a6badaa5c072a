// The int8-dot path of ggml_linear for batches (ggml_dot.h: decode batches, speculative verify rows). The GEMV in
// ggml_dot.cpp dots each weight block with a few activation rows laid along the vector lanes of K; here the lanes
// are activation ROWS: x is quantized once per call and stored as x + 128 (u8; x itself against unsigned weights,
// kXBias) interleaved [rows / lanes][K / 4][lanes][4] (each vector of rows contiguous along K), so
// one vpdpbusd multiplies 4 weights of one output column (broadcast from an unpacked panel, or, for Q4_K row groups
// on AVX-512, from the group's nibbles in place: kNibbleTiles) with 16 rows at once.
// A sub-block's integer scale is then the same for every lane: one vpmulld per 32 (Q6_K: 16) weights instead of
// one vpdpwssd per 64, and each weight byte is unpacked once per call, not once per 4 rows. With weights w and
// row scales x_d, for each block of a column:
//   y += x_d d (sum_s sc_s sum_s((x_q + 128) w) - 128 sum_s sc_s sum_s(w))      (sc = 1 outside the K-quants)
//      + m (x_d sum(x_q))                                                       (Q4_1)
//      + x_d (-dmin) sum_g m_g sum_g(x_q)                                       (Q4_K, Q5_K: integer m_g)
// where the weights are the block's signed integers (Q4_0: q - 8, Q6_K: q - 32, ...), so the 128 bias is one integer
// per block and column, subtracted once for all rows. Register tile: NR columns x RV vectors of rows; each thread
// unpacks a panel of columns over all of K (Panel), prefetches the next panel's while it computes, and runs every
// row vector on them.
//
// AVX-512: vpdpbusd on 16 rows (zmm) or 8 (ymm, batches of up to 8); AVX-VNNI: vpdpbusd on 8 rows. AVX2: vpmaddubsw
// on 8 rows, its int16 pairs summed over a few steps before one vpmaddwd (GemmLayout::kPairSteps); Q8_0, signed on
// both sides, multiplies |w| by x with w's sign there (GemmLayout::kSignedPairs). The portable build has no GEMM:
// its GEMV runs every batch size the thresholds allow.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "ggml_blocks.h"
#include "ggml_dot.h"
#include "tile_store.h"
#include "vec.h"

namespace carpool::ggml {

#ifdef CARPOOL_SIMD
namespace {

using carpool::kernels::store_tile;

// How a format's blocks split for the GEMM: integer-scaled sub-blocks of kSub weights (one per block, scale 1,
// unless kScaled) and kMinGroups 32-weight groups per block with a float term on x's sums (0 without one).
// kUnsignedWeights: the format's integers are unsigned (its offset lives in the min terms).
// kPairSteps (AVX2 without VNNI): how many vpmaddubsw results of 4 weights an int16 lane holds before it must widen.
// With unsigned weights the pairs path takes them as the instruction's unsigned operand and x signed (|x_q| <= 127),
// 2 * 127 * max w each: 3810 for Q4_1's and Q4_K's [0, 15], 7874 for Q5_K's [0, 31]; the others take x + 128 <= 255
// and signed weights, 2 * 255 * max|w|: 4080 for Q4_0's [-8, 7], 8160 for Q5_0's [-16, 15], 16320 for Q6_K's
// [-32, 31].
// kSignedPairs: Q8_0's weights span [-128, 127], and x + 128 against them would saturate a pair at once, so the
// pairs path multiplies |w| (unsigned, <= 128) by x carrying w's sign (vpsignb; |x_q| <= 127 negates safely):
// 2 * 128 * 127 per step, widened every step. Two more instructions per vpmaddubsw than Q4_K's, yet ahead of the
// exact path's fp32 FMAs, which were Q8_0's only batched kernel on AVX2.
template <int64_t QT> struct GemmLayout;
struct SignedBlocks32 {
  static constexpr int kSub = 32, kMinGroups = 0;
  static constexpr bool kScaled = false, kUnsignedWeights = false, kSignedPairs = false, kIntegerMins = false;
};
template <> struct GemmLayout<kQ8_0> : SignedBlocks32 {
  static constexpr int kPairSteps = 1;
  static constexpr bool kSignedPairs = true;
};
template <> struct GemmLayout<kQ4_0> : SignedBlocks32 { static constexpr int kPairSteps = 8; };
template <> struct GemmLayout<kQ5_0> : SignedBlocks32 { static constexpr int kPairSteps = 4; };
template <> struct GemmLayout<kQ4_1> {
  static constexpr int kSub = 32, kMinGroups = 1, kPairSteps = 8;
  static constexpr bool kScaled = false, kUnsignedWeights = true, kSignedPairs = false, kIntegerMins = false;
};
template <> struct GemmLayout<kQ4_K> {
  static constexpr int kSub = 32, kMinGroups = 8, kPairSteps = 8;
  static constexpr bool kScaled = true, kUnsignedWeights = true, kSignedPairs = false, kIntegerMins = true;
};
template <> struct GemmLayout<kQ5_K> : GemmLayout<kQ4_K> { static constexpr int kPairSteps = 4; };
template <> struct GemmLayout<kQ6_K> {
  static constexpr int kSub = 16, kMinGroups = 0, kPairSteps = 2;
  static constexpr bool kScaled = true, kUnsignedWeights = false, kSignedPairs = false, kIntegerMins = false;
};

// 256-bit helpers (both SIMD builds) for unpacking: bytes of nibbles, sums of unsigned bytes.
inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store256(int8_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline __m256i bytes(int8_t v) { return _mm256_set1_epi8(v); }
// 16 bytes of nibbles -> 32 values: low nibbles (weights 0-15), then high nibbles (16-31).
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), bytes(0x0F));
}
// Sums of the unsigned bytes 0-15 and 16-31.
inline void byte_sums16(__m256i v, int32_t& first, int32_t& second) {
  const __m256i eights = _mm256_sad_epu8(v, _mm256_setzero_si256());  // four sums of 8 bytes, in 64-bit lanes
  first = static_cast<int32_t>(_mm256_extract_epi64(eights, 0) + _mm256_extract_epi64(eights, 1));
  second = static_cast<int32_t>(_mm256_extract_epi64(eights, 2) + _mm256_extract_epi64(eights, 3));
}
inline int32_t int_sum(__m256i v) {
  __m128i quad = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  quad = _mm_add_epi32(quad, _mm_unpackhi_epi64(quad, quad));
  return _mm_cvtsi128_si32(quad) + _mm_extract_epi32(quad, 1);
}
inline int32_t byte_sum32(__m256i v) {
  int32_t first, second;
  byte_sums16(v, first, second);
  return first + second;
}

// A Q4_K / Q5_K block's eight sub-block scales (bytes of `scales`) as integers, and its minimums (bytes of `mins`)
// as int16 pairs: four words, minimum 2j in the low half of word j and 2j + 1 in the high.
// kNibbles: even sub-blocks' scales times 16 (kNibbleTiles).
template <bool kNibbles = false>
inline void k_block_scales(uint64_t scales, uint64_t mins, int32_t* sc, int32_t* min_pairs) {
  const __m128i scale8 = _mm_cvtsi64_si128(static_cast<int64_t>(scales));
  const __m128i min8 = _mm_cvtsi64_si128(static_cast<int64_t>(mins));
  __m256i scale32 = _mm256_cvtepu8_epi32(scale8);
  if constexpr (kNibbles) scale32 = _mm256_sllv_epi32(scale32, _mm256_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc), scale32);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(min_pairs), _mm_cvtepu8_epi16(min8));
}

// Where a block's terms besides its weights go: its integer scale per sub-block (1 outside the K-quants), d, and its
// min terms: Q4_1's m (negdm), or the K-quants' integer minimums per 32 weights in int16 pairs (min_pairs) and -dmin
// (negdmin).
struct BlockTerms {
  int32_t* sc;
  float* d;
  float* negdm;
  int32_t* min_pairs;
  float* negdmin;
};

// One block of one column as integers: w[kWeights] signed, and its terms (BlockTerms); returns sum_s sc_s sum_s(w)
// (the 128 bias of x's u8 form times this is what the dot products overcount), or 0 without kSums (x without a bias
// needs none; the sums were 7 of 13 instructions per 64 Q4_K weights). Sums are taken on the unsigned values before
// each format's offset (vpsadbw).
template <int64_t QT, bool kSums>
int32_t unpack_block(const uint8_t* p, int8_t* w, const BlockTerms& t) {
  if constexpr (QT == kQ8_0 || QT == kQ5_0) {
    *t.d = half_to_float(p);
    t.sc[0] = 1;
    __m256i q;
    int offset;
    if constexpr (QT == kQ8_0) {
      q = _mm256_xor_si256(load256(p + 2), bytes(static_cast<int8_t>(0x80)));  // + 128 as unsigned
      offset = 128;
    } else {  // Q5_0
      uint32_t high;
      std::memcpy(&high, p + 2, 4);
      const __m256i spread = _mm256_shuffle_epi8(
          _mm256_set1_epi32(static_cast<int>(high)),
          _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
      const __m256i mask = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
      q = _mm256_or_si256(nibbles32(p + 6), _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), bytes(0x10)));
      offset = 16;
    }
    store256(w, _mm256_sub_epi8(q, bytes(static_cast<int8_t>(offset))));
    return kSums ? byte_sum32(q) - 32 * offset : 0;
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    *t.d = half_to_float(p);
    *t.negdmin = -half_to_float(p + 2);
    uint64_t scales, mins;
    k_scales_mins_packed(p + 4, scales, mins);
    k_block_scales(scales, mins, t.sc, t.min_pairs);
    const __m256i scale_bytes = _mm256_broadcastsi128_si256(_mm_cvtsi64_si128(static_cast<int64_t>(scales)));
    const uint8_t* qs = p + (QT == kQ5_K ? 48 : 16);
    __m256i high;
    if constexpr (QT == kQ5_K) high = load256(p + 16);
    // sum_j sc_j sum_j(q): u8 q <= 31 times scales <= 63 in int16 pairs (<= 2 * 2 * 31 * 63), widened per group
    __m256i bias32 = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // byte i of group c: weight i of sub-block 2c (low nibble) and 2c + 1 (high)
      const __m256i raw = load256(qs + 32 * c);
      __m256i lo = _mm256_and_si256(raw, bytes(0x0F)), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), bytes(0x0F));
      if constexpr (QT == kQ5_K) {  // bit 2c of high byte i is bit 4 of weight i of sub-block 2c, bit 2c+1 of 2c+1
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(high, 4), bytes(0x10)));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(high, 3), bytes(0x10)));
        high = _mm256_srli_epi16(high, 2);
      }
      store256(w + 64 * c, lo);
      store256(w + 64 * c + 32, hi);
      if constexpr (kSums) {
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_shuffle_epi8(scale_bytes, bytes(2 * c))),
                                               _mm256_maddubs_epi16(hi, _mm256_shuffle_epi8(scale_bytes, bytes(2 * c + 1))));
        bias32 = _mm256_add_epi32(bias32, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
      }
    }
    return kSums ? int_sum(bias32) : 0;
  } else if constexpr (QT == kQ6_K) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
    *t.d = half_to_float(p + 208);
    const __m128i scale8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.sc), _mm256_cvtepi8_epi32(scale8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.sc + 8), _mm256_cvtepi8_epi32(_mm_srli_si128(scale8, 8)));
    __m256i bias32 = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i low0 = load256(p + 64 * h), low1 = load256(p + 64 * h + 32), high = load256(p + 128 + 32 * h);
      __m256i q[4];
      q6_k_weights(low0, low1, high, q);
      // Sub-blocks 8h + 2k and 8h + 2k + 1 are bytes 0-15 and 16-31 of q[k]: their scales, byte for byte.
      const __m256i scale_bytes = _mm256_broadcastsi128_si256(scale8);
      for (int k = 0; k < 4; ++k) {
        const int s = 8 * h + 2 * k;
        const __m256i pick = _mm256_set_m128i(_mm_set1_epi8(static_cast<char>(s + 1)), _mm_set1_epi8(static_cast<char>(s)));
        store256(w + 128 * h + 32 * k, _mm256_sub_epi8(q[k], bytes(32)));
        // u8 q <= 63 times s8 scales: pairs within int16
        bias32 = _mm256_add_epi32(bias32, _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], _mm256_shuffle_epi8(scale_bytes, pick)),
                                                            _mm256_set1_epi16(1)));
      }
    }
    // q - 32: minus 32 * 16 * sum_s sc_s
    const __m256i scale32 = _mm256_add_epi32(_mm256_cvtepi8_epi32(scale8), _mm256_cvtepi8_epi32(_mm_srli_si128(scale8, 8)));
    return int_sum(bias32) - 512 * int_sum(scale32);
  } else {
    static_assert(QT != QT, "not a GGML kernel type");
  }
}

// The same for a Q4_0 or Q4_1 block's parts where they lie (octet-major or not).
template <int64_t QT, bool kSums>
int32_t unpack_block(const Q4Parts& parts, int8_t* w, const BlockTerms& t) {
  static_assert(kHasOctetMajor<QT>);
  *t.d = half_to_float(parts.d);
  t.sc[0] = 1;
  if constexpr (QT == kQ4_1) *t.negdm = half_to_float(parts.m);
  const __m256i q = nibbles32(parts.nibbles);
  constexpr int offset = QT == kQ4_0 ? 8 : 0;
  store256(w, _mm256_sub_epi8(q, bytes(static_cast<int8_t>(offset))));
  return kSums ? byte_sum32(q) - 32 * offset : 0;
}

// ---- vector lanes over activation rows ----------------------------------------------------------------------

inline int32_t load4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
// A column's 8 or 16 weights from two or four steps of 4, `step` bytes apart (4: contiguous).
inline int64_t load_steps8(const int8_t* p, int64_t step) {
  int64_t v;
  if (step == 4) {
    std::memcpy(&v, p, 8);
    return v;
  }
  return static_cast<uint32_t>(load4(p)) | static_cast<int64_t>(load4(p + step)) << 32;
}
inline __m128i load_steps16(const int8_t* p, int64_t step) {
  if (step == 4) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm_setr_epi32(load4(p), load4(p + step), load4(p + 2 * step), load4(p + 3 * step));
}

#ifdef CARPOOL_AVX512
struct Rows16 {
  static constexpr int kLanes = 16;
  static constexpr bool kInt16Pairs = false;
  using I = __m512i;
  using F = __m512;
  static I izero() { return _mm512_setzero_si512(); }
  static F fzero() { return _mm512_setzero_ps(); }
  static I iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static I dot(I acc, I x, I w) { return _mm512_dpbusd_epi32(acc, x, w); }
  static I dot_unsigned(I acc, I x, I w) { return _mm512_dpbusd_epi32(acc, w, x); }
  // A column's kGroup weights at p (four of them each `step` bytes on: Panel), in every kGroup bytes of the vector
  // (each row's share of a step of x).
  template <int kGroup>
  static I weights(const int8_t* p, int64_t step) {
    if constexpr (kGroup == 4) return _mm512_set1_epi32(load4(p));
    else if constexpr (kGroup == 8) return _mm512_set1_epi64(load_steps8(p, step));
    else return _mm512_broadcast_i32x4(load_steps16(p, step));
  }
  // Each lane the total of its row's kGroup / 4 lanes (InterleavedRows' last vector).
  template <int kGroup>
  static I row_totals(I t) {
    if constexpr (kGroup >= 8) t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_CDAB));
    if constexpr (kGroup >= 16) t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));
    return t;
  }
  // Steps of 4 weights, each broadcast, as one broadcast of kGroup (the weights<kGroup> of a grouped vector)
  template <int kGroup>
  static I spread(const I (&w)[kGroup / 4]) {
    if constexpr (kGroup == 8) return _mm512_unpacklo_epi32(w[0], w[1]);
    else return _mm512_unpacklo_epi64(_mm512_unpacklo_epi32(w[0], w[1]), _mm512_unpacklo_epi32(w[2], w[3]));
  }
  static I and_bytes(I a, uint8_t mask) { return _mm512_and_si512(a, _mm512_set1_epi8(static_cast<char>(mask))); }
  static I mul(I a, int32_t s) { return _mm512_mullo_epi32(a, _mm512_set1_epi32(s)); }
  // acc + the int16 pairs of a times those of s, summed by pairs
  static I dot_pairs(I acc, I a, int32_t s) { return _mm512_dpwssd_epi32(acc, a, _mm512_set1_epi32(s)); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, int32_t s) { return _mm512_sub_epi32(a, _mm512_set1_epi32(s)); }
  static F scaled(F acc, I tot, F xd, float d) {
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(tot), xd), _mm512_set1_ps(d), acc);
  }
  // acc + xd (d tot + negdmin mins)
  static F scaled_with_mins(F acc, I tot, I mins, F xd, float d, float negdmin) {
    const F scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(tot), _mm512_set1_ps(d));
    const F terms = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_set1_ps(negdmin), scaled);
    return _mm512_fmadd_ps(terms, xd, acc);
  }
  // The 32-weight formats' step (ggml_dot.h's float step): acc + (tot xd) d, Q4_1's + sums m inside the term.
  static F added(F acc, I tot, F xd, float d) {
    return _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(tot), xd), _mm512_set1_ps(d)));
  }
  static F added(F acc, I tot, F xd, float d, F sums, float m) {
    const F term = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(tot), xd), _mm512_set1_ps(d));
    return _mm512_add_ps(acc, _mm512_fmadd_ps(sums, _mm512_set1_ps(m), term));
  }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif

struct Rows8 {
  static constexpr int kLanes = 8;
  using I = __m256i;
  using F = __m256;
#ifdef CARPOOL_VNNI256
  static constexpr bool kInt16Pairs = false;
  static I dot(I acc, I x, I w) { return dpbusd256(acc, x, w); }
  static I dot_unsigned(I acc, I x, I w) { return dpbusd256(acc, w, x); }
#else
  // vpmaddubsw's int16 pairs summed with vpaddw over GemmLayout::kPairSteps steps, then one vpmaddwd by the
  // sub-block's scale widens them: per 4 weights x 8 rows 1 + 1/steps multiplies instead of 2 (and no vpmulld).
  // block_totals_pairs does it.
  static constexpr bool kInt16Pairs = true;
#endif
  template <int kGroup>  // as Rows16's
  static I weights(const int8_t* p, int64_t step) {
    if constexpr (kGroup == 4) return _mm256_set1_epi32(load4(p));
    else if constexpr (kGroup == 8) return _mm256_set1_epi64x(load_steps8(p, step));
    else return _mm256_broadcastsi128_si256(load_steps16(p, step));
  }
  template <int kGroup>  // as Rows16's
  static I spread(const I (&w)[kGroup / 4]) {
    if constexpr (kGroup == 8) return _mm256_unpacklo_epi32(w[0], w[1]);
    else return _mm256_unpacklo_epi64(_mm256_unpacklo_epi32(w[0], w[1]), _mm256_unpacklo_epi32(w[2], w[3]));
  }
  template <int kGroup>  // as Rows16's
  static I row_totals(I t) {
    if constexpr (kGroup >= 8) t = _mm256_add_epi32(t, _mm256_shuffle_epi32(t, 0xB1));
    if constexpr (kGroup >= 16) t = _mm256_add_epi32(t, _mm256_shuffle_epi32(t, 0x4E));
    return t;
  }
  static I izero() { return _mm256_setzero_si256(); }
  static F fzero() { return _mm256_setzero_ps(); }
  static I iload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F fload(const float* p) { return _mm256_loadu_ps(p); }
  static I mul(I a, int32_t s) { return _mm256_mullo_epi32(a, _mm256_set1_epi32(s)); }
  static I dot_pairs(I acc, I a, int32_t s) {  // as Rows16's
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, _mm256_set1_epi32(s)));
  }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, int32_t s) { return _mm256_sub_epi32(a, _mm256_set1_epi32(s)); }
  static F scaled(F acc, I tot, F xd, float d) {
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(tot), xd), _mm256_set1_ps(d), acc);
  }
  // acc + xd (d tot + negdmin mins)
  static F scaled_with_mins(F acc, I tot, I mins, F xd, float d, float negdmin) {
    const F scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(tot), _mm256_set1_ps(d));
    const F terms = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(negdmin), scaled);
    return _mm256_fmadd_ps(terms, xd, acc);
  }
  static F added(F acc, I tot, F xd, float d) {  // as Rows16's
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(tot), xd), _mm256_set1_ps(d)));
  }
  static F added(F acc, I tot, F xd, float d, F sums, float m) {
    const F term = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(tot), xd), _mm256_set1_ps(d));
    return _mm256_add_ps(acc, _mm256_fmadd_ps(sums, _mm256_set1_ps(m), term));
  }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};

// What x's bytes hold: x_q + 128 (u8, the multiplies' unsigned operand), or x_q itself where a format's unsigned
// weights are that operand (GemmLayout), or Q8_0's |w| on the int16-pairs path. The bias, times a block's sum of
// weights, is what the dot products overcount; without it unpacking skips those sums (vpsadbw, or the K-quants'
// scaled vpmaddubsw: 7 of 13 instructions per 64 Q4_K weights). With VNNI, unsigned weights as vpdpbusd's unsigned
// operand made SmolLM2's (Q4_1) 32-sequence step 1.03-1.05x on avx512 and on avxvnni, 8-row calls of Q4_1 and Q4_K
// 1.05-1.2x (Intel family 6 model 167, 2 threads, outputs bit-identical).
template <int64_t QT, typename V>
constexpr int32_t kXBias =
    GemmLayout<QT>::kUnsignedWeights || (V::kInt16Pairs && GemmLayout<QT>::kSignedPairs) ? 0 : 128;

// x quantized once per call as the tile reads it (see the top); rows padded to whole vectors with x = 0.
// The last vector may hold fewer rows, each over more lanes (tail_group bytes of K per row and step instead of 4:
// lanes * 4 / tail_group rows, each over tail_group / 4 int32 lanes), so a call's last few rows do not cost a whole
// vector's multiplies: 17 rows ran as long as 24 (the 1.5B's decode step, forced avx2, 286 vs 283 ms). A row's
// scale and sums fill each of its lanes; its lanes' integer totals are added before they are scaled (V::row_totals),
// so every lane holds what one lane of a full vector would, to the bit.
struct InterleavedRows {
  int64_t rows = 0;            // padded
  int tail_group = 4;          // bytes of K per row and step in the last vector
  // [rows / lanes][K / 4][lanes][4]: x_q + bias (the last vector [K / tail_group][..][tail_group]). One vector of
  // rows is contiguous: with [K / 4][rows][4], a 512-row prompt chunk put 2 KiB between a vector's consecutive loads,
  // a power-of-two stride that kept a row block in a few cache sets (1536x8960 Q4_1 at 512 rows: 1.05x the exact
  // path, 1.6x at 16 rows, forced AVX2).
  std::unique_ptr<uint8_t[]> u;  // x_q + bias (kXBias); lanes no row writes hold the bias
  std::vector<float> d;        // [K / block][rows], by lane
  std::vector<float> sums;     // [K / 32][rows], by lane: d * sum of x_q over each 32 values (Q4_1)
  std::vector<int16_t> qsum_pairs;  // [K / 64][rows][2], by lane: sums of x_q over each 32 values (the K-quants)
};

// Which sums of x a format's min terms take (GemmLayout): none, Q4_1's scaled ones, or the K-quants' integers.
enum class XSums { kNone, kScaled, kInteger };
template <int64_t QT>
constexpr XSums kXSums = !GemmLayout<QT>::kMinGroups   ? XSums::kNone
                         : GemmLayout<QT>::kIntegerMins ? XSums::kInteger
                                                        : XSums::kScaled;

// The widest group (fewest lanes per row of the last vector) that still holds its rows, from 4 bytes (every lane a
// row) to 16: a step of 16 bytes stays inside Q6_K's sub-block of 16 weights, whose scale multiplies whole lanes.
// None (4) where the vectors before the last do not fill whole tiles of tile_vectors (the int16-pairs tiles, whose
// vectors share one group): the odd one would run a tile of one vector beside the grouped last one's, two passes over
// the panel, where the last vector padded with zeros makes one whole tile (forced avx2 on Zen 4, the 1.5B's decode
// step at 12 rows 1.05x, steps alternating in one process). VNNI tiles take a grouped last vector beside a whole one
// (block_totals): their calls pass tile_vectors 1.
inline int tail_group(int64_t M, int lanes, int tile_vectors) {
  const int64_t full_vectors = (M - 1) / lanes, last = M - full_vectors * lanes;
  int group = 4;
  while (full_vectors % tile_vectors == 0 && group < 16 && last <= lanes * 2 / group) group *= 2;
  return group;
}

// A thread's run of panels, staged as [M][run_width], into y's rows: whole cache lines a row (runs cover them).
template <typename Y>
void copy_run(const Y* staged, int64_t run_width, int64_t M, Y* y, int64_t ldy, int64_t columns) {
  const int64_t bytes = columns * static_cast<int64_t>(sizeof(Y));
  for (int64_t m = 0; m < M; ++m) {
    auto* to = reinterpret_cast<char*>(y + m * ldy);
    const auto* from = reinterpret_cast<const char*>(staged + m * run_width);
    int64_t o = 0;
    for (; o + 64 <= bytes; o += 64) std::memcpy(to + o, from + o, 64);
    if (o < bytes) std::memcpy(to + o, from + o, bytes - o);
  }
}

// Symmetric int8 per `block` values, as ggml_dot.cpp's GEMV quantizes: d = max|x| / 127, q = round-half-even(x / d).
// x is float or bf16, widened a block at a time in L1: a float copy of a bf16 x first, and filling all of x_q with the
// bias on the calling thread while the others waited, were 2.2% of a 32-sequence step of the 1.5B (Zen 4, perf).
template <typename T>
InterleavedRows quantize_interleaved(const T* x, int64_t M, int64_t K, int64_t block, int lanes, int32_t bias,
                                     XSums with_sums, int tile_vectors) {
  InterleavedRows out;
  out.rows = (M + lanes - 1) / lanes * lanes;
  // a call of one vector takes no groups (int8_gemm_tiles' one-vector tile)
  out.tail_group = M > lanes ? tail_group(M, lanes, tile_vectors) : 4;
  out.u = std::make_unique_for_overwrite<uint8_t[]>(K * out.rows);
  const int64_t last_vector = out.rows - lanes;
  if ((M - last_vector) * out.tail_group / 4 < lanes)  // lanes past the last row: the bias, as x_q = 0 would be
    std::fill_n(out.u.get() + last_vector * K, lanes * K, static_cast<uint8_t>(bias));
  out.d.assign(K / block * out.rows, 0.0f);
  if (with_sums == XSums::kScaled) out.sums.assign(K / 32 * out.rows, 0.0f);
  if (with_sums == XSums::kInteger) out.qsum_pairs.assign(K / 32 * out.rows, 0);
  // Split over the threads (a 512-row prompt chunk is 0.3-4.6 M values, every call) in units of one block of K for a
  // vector's rows, the rows inside: the block's slice of the vector (4 KiB for the K-quants) takes every row's
  // scattered 4-byte groups while it is in L1. Row by row over all of K, each row's stores went to every line of the
  // vector (143 KiB at K = 8960) in L2, and quantizing was 3% of the step above. Both changes: the 1.5B's 32-sequence
  // step 1.02-1.03x, 26 sequences 1.04x, a 1000-token prefill 1.02x (Zen 4, 2 threads, alternating in one process).
  const int64_t blocks = K / block;
  at::parallel_for(0, out.rows / lanes * blocks, 4, [&](int64_t first_unit, int64_t last_unit) {
    alignas(32) int8_t q[256];
    alignas(32) float wide[256];
    for (int64_t unit = first_unit; unit < last_unit; ++unit) {
      const int64_t vector = unit / blocks * lanes, b = unit % blocks;
      const int group = vector == last_vector ? out.tail_group : 4, spread = group / 4;
      for (int64_t m = vector; m < std::min(M, vector + lanes); ++m) {
        const int64_t lane = vector + m % lanes * spread;  // its first lane
        // Row m's groups of K, lanes * 4 bytes apart in its vector of rows.
        uint8_t* groups = out.u.get() + vector * K + m % lanes * group;
        const T* from = x + m * K + b * block;
        if constexpr (!std::is_same_v<T, float>) std::copy_n(from, block, wide);
        const float d = quantize_int8(std::is_same_v<T, float> ? reinterpret_cast<const float*>(from) : wide, block, q);
        std::fill_n(out.d.begin() + b * out.rows + lane, spread, d);
        for (int64_t g = 0; g < block; g += 32) {
          const __m256i biased = _mm256_xor_si256(load256(reinterpret_cast<const uint8_t*>(q + g)), bytes(-128));
          alignas(32) uint8_t u[32];
          const __m256i stored = bias ? biased : load256(reinterpret_cast<const uint8_t*>(q + g));
          _mm256_store_si256(reinterpret_cast<__m256i*>(u), stored);
          uint8_t* to = groups + (b * block + g) / group * lanes * 4;
          // the 32 / group groups, lanes * 4 bytes apart, each copied with a constant size (copy_rows): a run-time
          // size made each a call to memmove, and quantizing x 4% of a 32-sequence step of the 1.5B (Zen 4, perf;
          // the step ran 1.027x as fast without it, one process, alternating steps)
          carpool::kernels::copy_rows<4>(group / 4, 32 / group, [&](int j, auto size) {
            std::memcpy(to + j * lanes * 4, u + size * j, size);
          });
          const int64_t at = (b * block + g) / 32 * out.rows + lane;
          if (with_sums == XSums::kScaled)
            std::fill_n(out.sums.begin() + at, spread, d * static_cast<float>(byte_sum32(biased) - 32 * 128));
          if (with_sums == XSums::kInteger) {
            const int64_t group = (b * block + g) / 32;  // |sum| <= 32 * 127
            for (int l = 0; l < spread; ++l)
              out.qsum_pairs[((group / 2) * out.rows + lane + l) * 2 + group % 2] =
                  static_cast<int16_t>(byte_sum32(biased) - 32 * 128);
          }
        }
      }
    }
  });
  return out;
}

// Q4_K row groups on AVX-512: the tiles read each column's nibbles from its row group in place, and the panel
// unpacks only the scales. A step's four weights are one vpandd with a 32-bit broadcast from memory: low nibbles q
// (mask 0x0F), high nibbles 16 q (0xF0), so the panel holds the low sub-blocks' scales times 16 and d / 16; the
// totals are 16 times as large (|total| <= 8 x 8 x 4 x 240 x 127 x 63 < 2^31) and the floats bit-identical. The
// unpack's loads and stores of every weight were 7.5% of the 1.5B's 32-sequence step; reading the nibbles, whose
// vpandd is free beside vpdpbusd (Zen 4, scratch loop), the 8960x1536 call at 32 rows ran 3.12-3.16 -> 2.83-2.88 ms
// (one thread) and the step 1.04-1.07x (2 threads, alternating in one process). AVX2's int16 pairs would need a
// shift for the high nibbles too (on its four busy pipes), so it unpacks.
template <int64_t QT, typename V>
constexpr bool kNibbleTiles = QT == kQ4_K && V::kLanes == 16;

// `width` columns unpacked over all of K: what the tiles' broadcasts read, once per call. A column's weights are
// column-major ([width][K]), or, for row groups, interleaved ([K / 4][width][4]: each step of four weights holds
// every column's, as a group holds its eight rows' words), so that a group unpacks in place: one 32-byte load is a
// word of eight columns, unpacked and stored whole, where putting each group back in GGUF's layout first (RowReader,
// 8 x 8 transposes) and unpacking row by row had made the unpack ~13% of a 32-row call (Zen 4, perf; from L2 or L3
// alike). Panels of row groups hold whole groups. `step` is the bytes from a column's four weights to its next four.
// The 1.5B's matrices, one call, int8, the old unpack against this in one process (docs/benchmarks.md): Q4_K
// 8960x1536 at 16 / 32 / 64 rows 1.06x / 1.03x / 1.02x, the Q6_K LM head at 16 / 32 rows 1.18x / 1.15x (2
// threads), 512 rows unchanged.
template <int64_t QT>
struct Panel {
  using L = GemmLayout<QT>;
  static constexpr int64_t kW = Format<QT>::kWeights;
  int64_t K, width;
  bool interleaved;
  int64_t step;
  std::vector<int8_t> w;       // [width][K] or [K / 4][width][4] (none with nibbles)
  std::vector<int32_t> sc;     // [width][K / kSub]
  std::vector<int32_t> bias;   // [width][K / kW]
  std::vector<float> d;        // [width][K / kW]
  std::vector<float> negdm;    // [width][K / 32] (Q4_1)
  std::vector<int32_t> min_pairs;  // [width][K / 64] (K-quants: k_block_scales)
  std::vector<float> negdmin;  // [width][K / kW] (K-quants)
  std::vector<const uint8_t*> groups;  // [width / kGroupRows]: each group in place (nibble tiles: kNibbleTiles)

  Panel(int64_t K, int64_t width, bool interleaved, bool nibbles)
      : K(K), width(width), interleaved(interleaved), step(interleaved ? 4 * width : 4), w(nibbles ? 0 : width * K),
        sc(width * K / L::kSub), bias(width * K / kW), d(width * K / kW),
        negdm(L::kMinGroups && !L::kIntegerMins ? width * K / 32 : 0),
        min_pairs(L::kIntegerMins ? width * K / 64 : 0), negdmin(L::kIntegerMins ? width * K / kW : 0) {}

  const int8_t* column(int64_t n) const { return w.data() + n * (interleaved ? 4 : K); }
  // Column n in its row group (kNibbleTiles): its word t of block b lies group_word_offset(t, 0) on from here plus
  // b blocks of the group.
  const int8_t* nibbles(int64_t n) const {
    const int64_t r = n % kGroupRows;
    return reinterpret_cast<const int8_t*>(groups[n / kGroupRows] + group_word_offset<QT>(0, r) -
                                           group_word_offset<QT>(0, 0));
  }
  // Column n's block b: where its terms go.
  BlockTerms terms(int64_t n, int64_t b) {
    const int64_t k = n * K + b * kW;
    auto at = [](auto& v, int64_t i) { return v.empty() ? nullptr : v.data() + i; };
    return {sc.data() + k / L::kSub, d.data() + k / kW, at(negdm, k / 32), at(min_pairs, k / 64), at(negdmin, k / kW)};
  }

  template <bool kSums, bool kNibbles = false>
  void unpack(RowReader<QT>& rows, Layout layout, int64_t n0, int64_t columns) {
    const int64_t blocks = K / kW;
    if (columns < width) {  // past the last column: zeros, whose outputs are dropped
      if (!w.empty())
        std::fill_n(w.begin() + (interleaved ? 0 : columns * K), interleaved ? width * K : (width - columns) * K, 0);
      std::fill(sc.begin() + columns * K / L::kSub, sc.end(), 0);
      std::fill(bias.begin() + columns * blocks, bias.end(), 0);
      std::fill(d.begin() + columns * blocks, d.end(), 0.0f);
      std::fill(negdm.begin() + std::min<int64_t>(negdm.size(), columns * K / 32), negdm.end(), 0.0f);
      std::fill(min_pairs.begin() + std::min<int64_t>(min_pairs.size(), columns * K / 64), min_pairs.end(), 0);
      std::fill(negdmin.begin() + std::min<int64_t>(negdmin.size(), columns * blocks), negdmin.end(), 0.0f);
    }
    if constexpr (kHasRowGroups<QT>)
      if (interleaved) {
        groups.resize(width / kGroupRows);
        for (int64_t n = 0; n < width; n += kGroupRows) {  // past the last column: any group, its outputs dropped
          groups[n / kGroupRows] = rows.group(n0 + std::min(n, columns - 1));
          if (n < columns) unpack_group<kSums, kNibbles>(groups[n / kGroupRows], n);
        }
        return;
      }
    for (int64_t n = 0; n < columns; ++n) {
      auto unpack_one = [&](int64_t b, const auto& block) {
        bias[n * blocks + b] = unpack_block<QT, kSums>(block, w.data() + n * K + b * kW, terms(n, b));
      };
      GgufBlocks<QT> row(rows(n0 + n), K, layout);
      if constexpr (kHasOctetMajor<QT>)
        row.for_each_q4(blocks, unpack_one);
      else
        for (int64_t b = 0; b < blocks; ++b) unpack_one(b, row[b]);
    }
  }

  // Row group `group` (its eight rows' blocks, kernels/csrc/ggml_blocks.h) into columns n to n + 7, each 32-byte
  // word of the group a step of eight columns' weights once unpacked (kNibbles: the scales only).
  template <bool kSums, bool kNibbles>
  void unpack_group(const uint8_t* group, int64_t n) {
    const int64_t blocks = K / kW, at_step = step;  // held: the int8 stores below may alias every member
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* column = group + b * kGroupRows * Format<QT>::kBytes;
      const auto word = [&](int64_t t) { return load256(column + group_word_offset<QT>(t, 0)); };
      int8_t* at = w.data() + b * kW / 4 * at_step + 4 * n;  // step 0 of this block, column n
      if constexpr (QT == kQ4_K) {
        using Words = uint32_t __attribute__((vector_size(32)));
        Words scale_words[2], min_words[2];
        k_scale_min_words(reinterpret_cast<Words>(word(0)), reinterpret_cast<Words>(word(1)),
                          reinterpret_cast<Words>(word(2)), scale_words, min_words);
        // The eight rows' d and dmin in one conversion each, and each row's scale and minimum bytes as one 64-bit
        // lane (unpacked by pairs of rows, then put in order): a row at a time, the scalar extractions and
        // conversions were 7% of a 32-row call once the tiles read the nibbles (Zen 4, one thread: 2.95 -> 2.85 ms).
        alignas(32) float d8[kGroupRows], negdmin8[kGroupRows];
        alignas(32) uint64_t scale8[kGroupRows], min8[kGroupRows];
        const __m128i halves_d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(column + group_half_offset(0, 0)));
        const __m128i halves_dmin = _mm_loadu_si128(reinterpret_cast<const __m128i*>(column + group_half_offset(1, 0)));
        _mm256_store_ps(d8, _mm256_mul_ps(_mm256_cvtph_ps(halves_d), _mm256_set1_ps(kNibbles ? 1.0f / 16 : 1.0f)));
        _mm256_store_ps(negdmin8, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(halves_dmin)));
        const auto rows_of = [](Words first, Words second, uint64_t* to) {
          const __m256i a = reinterpret_cast<__m256i>(first), c = reinterpret_cast<__m256i>(second);
          const __m256i lo = _mm256_unpacklo_epi32(a, c), hi = _mm256_unpackhi_epi32(a, c);
          _mm256_store_si256(reinterpret_cast<__m256i*>(to), _mm256_permute2x128_si256(lo, hi, 0x20));
          _mm256_store_si256(reinterpret_cast<__m256i*>(to + 4), _mm256_permute2x128_si256(lo, hi, 0x31));
        };
        rows_of(scale_words[0], scale_words[1], scale8);
        rows_of(min_words[0], min_words[1], min8);
        for (int64_t r = 0; r < kGroupRows; ++r) {
          const int64_t c = n + r;
          d[c * blocks + b] = d8[r];
          negdmin[c * blocks + b] = negdmin8[r];
          k_block_scales<kNibbles>(scale8[r], min8[r], sc.data() + (c * K + b * kW) / L::kSub,
                                   min_pairs.data() + (c * K + b * kW) / 64);
        }
        if constexpr (kNibbles) continue;
        // word 3 + 8 run + i: nibbles 4 i to + 3 of 32-byte run `run`, weights 64 run + 4 i to + 3 (low nibbles) and
        // 32 on (high)
        for (int64_t run = 0; run < 4; ++run)
#pragma GCC unroll 8
          for (int64_t i = 0; i < 8; ++i) {
            const __m256i nibbles = word(3 + 8 * run + i);
            int8_t* low = at + (16 * run + i) * at_step;
            store256(low, _mm256_and_si256(nibbles, bytes(0x0F)));
            store256(low + 8 * at_step, _mm256_and_si256(_mm256_srli_epi16(nibbles, 4), bytes(0x0F)));
          }
      } else {  // Q6_K, as its row-group GEMV reads it (ggml_dot.cpp)
        // Sub-block s's scale in each row's lane for the sums: with VNNI in all four bytes (one vpdpbusd of u8 q
        // by it per word, where vpmaddubsw, vpmaddwd and vpaddd took three), else in both int16 halves. Zen 4, the
        // 1.5B's Q6_K LM head at 32 rows, one thread, alternating builds: 55.0-56.0 -> 53.1-53.4 ms; its 32-sequence
        // step 1.01x. (One chain of vpdpbusd instead of four: 1.02x slower than before.)
        __m256i scale_factors[16];
        __m256i scale_total = _mm256_setzero_si256(), sums[4] = {};  // one chain per j: vpdpbusd's latency is 4
        if constexpr (kSums) {
          const __m256i scale_words[4] = {word(48), word(49), word(50), word(51)};
          for (int s = 0; s < 16; ++s) {
            const __m256i scale = q6_k_group_scale(scale_words, s);
            scale_total = _mm256_add_epi32(scale_total, scale);
#ifdef CARPOOL_VNNI256
            const int32_t pick = 0x01010101 * (s % 4);  // byte s % 4 of each lane's word, four times
            scale_factors[s] = _mm256_shuffle_epi8(
                scale_words[s / 4], _mm256_setr_epi32(pick, pick + 0x04040404, pick + 0x08080808, pick + 0x0C0C0C0C,
                                                      pick, pick + 0x04040404, pick + 0x08080808, pick + 0x0C0C0C0C));
#else
            scale_factors[s] = int16_in_both_halves(scale);
#endif
          }
        }
        for (int64_t r = 0; r < kGroupRows; ++r) {
          const int64_t c = n + r;
          d[c * blocks + b] = half_to_float(column + group_half_offset(0, r));
          const uint8_t* scales = column + group_word_offset<QT>(48, r);  // row r's 16 scales, four a word
          const __m128i scale8 = _mm_setr_epi32(load4(scales), load4(scales + 32), load4(scales + 64),
                                                load4(scales + 96));
          int32_t* to = sc.data() + (c * K + b * kW) / L::kSub;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), _mm256_cvtepi8_epi32(scale8));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 8), _mm256_cvtepi8_epi32(_mm_srli_si128(scale8, 8)));
        }
        // pass (h, l): weights 128 h + 4 l + 32 j to + 3 (j = 0-3) of every row, sub-block 8 h + 2 j + l / 4
        for (int h = 0; h < 2; ++h)
#pragma GCC unroll 8
          for (int l = 0; l < 8; ++l) {
            __m256i q[4];
            q6_k_weights(word(16 * h + l), word(16 * h + 8 + l), word(32 + 8 * h + l), q);
            for (int j = 0; j < 4; ++j) {
              store256(at + (32 * h + l + 8 * j) * at_step, _mm256_sub_epi8(q[j], bytes(32)));
              if constexpr (kSums) {  // u8 q <= 63 (AVX2: pairs within int16, times the scale in both halves)
                const __m256i factor = scale_factors[8 * h + 2 * j + l / 4];
#ifdef CARPOOL_VNNI256
                sums[j] = dpbusd256(sums[j], q[j], factor);
#else
                sums[j] = _mm256_add_epi32(sums[j], _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], bytes(1)), factor));
#endif
              }
            }
          }
        if constexpr (kSums) {  // q - 32: minus 32 * 16 * sum_s sc_s
          alignas(32) int32_t row_bias[kGroupRows];
          _mm256_store_si256(reinterpret_cast<__m256i*>(row_bias),
                             _mm256_sub_epi32(_mm256_add_epi32(_mm256_add_epi32(sums[0], sums[1]),
                                                               _mm256_add_epi32(sums[2], sums[3])),
                                              _mm256_slli_epi32(scale_total, 9)));
          for (int64_t r = 0; r < kGroupRows; ++r) bias[(n + r) * blocks + b] = row_bias[r];
        }
      }
    }
  }
};

// Holds v in a register at this point: without it GCC re-associates the AVX2 tile's int16 sums into trees of
// products, which need more than the 16 ymm registers (x reloaded and sums spilled in the inner loop, seen in the
// disassembly of the 2x2 tile).
template <typename T>
inline void keep_in_register(T& v) {
  asm("" : "+x"(v));
}

// One block's integer sums for NR columns x RV row vectors: total = sum_s sc_s sum_s((x_q + kXBias) w). The last
// vector's rows may be grouped (kGroup bytes of K per row and step, InterleavedRows), the others' are not: per kGroup
// weights a column takes kGroup / 4 broadcasts of 4 for them, and the last vector their shuffle into one (V::spread,
// free beside vpdpbusd in a scratch loop on Zen 4), so 17-24 rows cost 1.25-1.5 vectors' multiplies, not 2. Zen 4,
// the 1.5B's decode step at 20 / 24 rows, steps alternating in one process: 173.9 / 183.0 ms against 195.0 / 200.2
// with the last vector padded to a whole tile (which, in its own pairing, ran 1.04x / 1.17x the two one-vector tiles
// before it). A broadcast of kGroup built from two or four loads, as a grouped vector alone takes it, made this tile
// slower than padding (24 rows: 221 vs 204 ms).
// VNNI: vpdpbusd into a partial sum per sub-block, times its scale (vpmulld) for the K-quants. Unsigned weights are
// its unsigned operand and x the signed one, which an instruction may take from memory: x held in registers, or GCC
// folded its loads into every column's vpdpbusd (NR loads per vector instead of one; Q4_K at 32 rows 5% slower).
// The totals build in a local array, copied out once per block: built in the caller's array (by reference), GCC
// kept them on the stack, a load, add and store of each after every sub-block. Zen 4: the Q4_K tile on cached
// operands 65-69% -> 73-75% of the vpdpbusd peak (scratch harness); the 1.5B's 32-sequence step 1.022-1.024x
// (2 threads, alternating steps in one process).
template <int64_t QT, typename V, int NR, int RV, int kGroup, bool kNibbles>
inline void block_totals(const uint8_t* xu, int64_t vector_bytes, const int8_t* const* w, int64_t step,
                         const int32_t* const* sc, int64_t b, typename V::I (&block_total)[NR][RV]) {
  using L = GemmLayout<QT>;
  constexpr int64_t kW = Format<QT>::kWeights;
  constexpr int64_t stride = V::kLanes * 4;
  constexpr int kSteps = kGroup / 4;  // steps of 4 weights per step of the last vector
  // Column n's `group` weights from weight k on, broadcast (nibbles: sub-block s's in its row group, words 3 + 8 run
  // + i: see kNibbleTiles).
  const auto weights = [&]<int group>(int n, int s, int64_t k) {
    if constexpr (kNibbles) {
      constexpr int64_t kWordStep = group_word_offset<QT>(1, 0) - group_word_offset<QT>(0, 0);
      const int8_t* at = w[n] + b * kGroupRows * Format<QT>::kBytes +
                         group_word_offset<QT>(3 + s / 2 * 8 + (k % L::kSub) / 4, 0);
      return V::and_bytes(V::template weights<group>(at, kWordStep), s % 2 ? 0xF0 : 0x0F);
    } else {
      return V::template weights<group>(w[n] + k / 4 * step, step);
    }
  };
  const auto dot = [](typename V::I acc, typename V::I x, typename V::I wv) {
    if constexpr (L::kUnsignedWeights)
      return V::dot_unsigned(acc, x, wv);
    else
      return V::dot(acc, x, wv);
  };
  typename V::I total[NR][RV];
  for (int s = 0; s < kW / L::kSub; ++s) {
    const int64_t k0 = b * kW + s * L::kSub;
    typename V::I part[NR][RV];
    for (int n = 0; n < NR; ++n)
      for (int r = 0; r < RV; ++r) part[n][r] = V::izero();
#pragma GCC unroll 8
    for (int g = 0; g < L::kSub / kGroup; ++g) {
      const int64_t k = k0 + kGroup * g;
      typename V::I xv[RV][kSteps];
      for (int r = 0; r + 1 < RV; ++r)
        for (int j = 0; j < kSteps; ++j) xv[r][j] = V::iload(xu + r * vector_bytes + (k / 4 + j) * stride);
      xv[RV - 1][0] = V::iload(xu + (RV - 1) * vector_bytes + k / kGroup * stride);
      if constexpr (L::kUnsignedWeights)
        for (int r = 0; r < RV; ++r)
          for (int j = 0; j < (r + 1 < RV ? kSteps : 1); ++j) keep_in_register(xv[r][j]);
      for (int n = 0; n < NR; ++n) {
        if constexpr (kGroup == 4) {
          const typename V::I wv = weights.template operator()<4>(n, s, k);
          for (int r = 0; r < RV; ++r) part[n][r] = dot(part[n][r], xv[r][0], wv);
        } else if constexpr (RV > 1) {
          typename V::I wv[kSteps];
          for (int j = 0; j < kSteps; ++j) {
            wv[j] = weights.template operator()<4>(n, s, k + 4 * j);
            for (int r = 0; r + 1 < RV; ++r) part[n][r] = dot(part[n][r], xv[r][j], wv[j]);
          }
          part[n][RV - 1] = dot(part[n][RV - 1], xv[RV - 1][0], V::template spread<kGroup>(wv));
        } else {
          part[n][0] = dot(part[n][0], xv[0][0], weights.template operator()<kGroup>(n, s, k));
        }
      }
    }
    for (int n = 0; n < NR; ++n)
      for (int r = 0; r < RV; ++r) {
        if constexpr (!L::kScaled) {
          total[n][r] = part[n][r];
        } else {
          const typename V::I scaled = V::mul(part[n][r], sc[n][k0 / L::kSub]);
          total[n][r] = s == 0 ? scaled : V::add(total[n][r], scaled);
        }
      }
  }
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < RV; ++r) block_total[n][r] = total[n][r];
}

// AVX2 (int16 pairs): per step RV x loads serve all NR columns and each column's broadcast serves all RV vectors;
// each (column, vector) adds its vpmaddubsw into its own int16 sums, widened by the sub-block's scale every
// kPairSteps steps. Unsigned weights are the instruction's unsigned operand, x (then signed) the other; Q8_0's
// |w| is, against x with w's sign (kSignedPairs).
template <int64_t QT, int NR, int RV, int kGroup>
inline void block_totals_pairs(const uint8_t* xu, int64_t vector_bytes, const int8_t* const* w, int64_t step,
                               const int32_t* const* sc, int64_t b, __m256i (&total)[NR][RV]) {
  using L = GemmLayout<QT>;
  constexpr int64_t kW = Format<QT>::kWeights;
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < RV; ++r) total[n][r] = _mm256_setzero_si256();
  for (int s = 0; s < kW / L::kSub; ++s) {
    const int64_t k0 = b * kW + s * L::kSub;
    constexpr int kSteps = L::kSub / kGroup, kPairSteps = std::min(L::kPairSteps, kSteps);
    for (int g0 = 0; g0 < kSteps; g0 += kPairSteps) {
      const uint8_t* xp = xu + (k0 / kGroup + g0) * 32;
      __m256i pairs[NR][RV];
#pragma GCC unroll 8
      for (int g = 0; g < kPairSteps; ++g) {
        __m256i xv[RV];
        for (int r = 0; r < RV; ++r) xv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32 * g + r * vector_bytes));
        for (int n = 0; n < NR; ++n) {
          const __m256i wv = Rows8::weights<kGroup>(w[n] + (k0 + kGroup * (g0 + g)) / 4 * step, step);
          [[maybe_unused]] const __m256i magnitude = L::kSignedPairs ? _mm256_abs_epi8(wv) : wv;
          for (int r = 0; r < RV; ++r) {
            __m256i product;
            if constexpr (L::kUnsignedWeights)
              product = _mm256_maddubs_epi16(wv, xv[r]);
            else if constexpr (L::kSignedPairs)
              product = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv[r], wv));
            else
              product = _mm256_maddubs_epi16(xv[r], wv);
            pairs[n][r] = g == 0 ? product : _mm256_add_epi16(pairs[n][r], product);
            keep_in_register(pairs[n][r]);
          }
        }
      }
      for (int n = 0; n < NR; ++n) {
        const __m256i scale = _mm256_set1_epi16(L::kScaled ? static_cast<int16_t>(sc[n][k0 / L::kSub]) : 1);
        for (int r = 0; r < RV; ++r) {
          total[n][r] = _mm256_add_epi32(total[n][r], _mm256_madd_epi16(pairs[n][r], scale));
          keep_in_register(total[n][r]);
        }
      }
    }
  }
}

// out[n][r * lanes + l] = y of row (first_vector + r) * lanes + l, column c0 + n of the panel (kGroup > 4, the last
// vector's layout: y of its row l / (kGroup / 4), in each of that row's lanes). `ahead` (ahead_bytes from it, none
// if 0): the blocks the thread unpacks next, prefetched a slice per block.
template <int64_t QT, typename V, int NR, int RV, bool kNibbles, int kGroup = 4>
void gemm_tile(const Panel<QT>& panel, int64_t c0, const InterleavedRows& x, int64_t first_vector, float* out,
               const uint8_t* ahead, int64_t ahead_bytes) {
  using L = GemmLayout<QT>;
  constexpr int64_t kW = Format<QT>::kWeights;
  const int64_t K = panel.K, blocks = K / kW, vector_bytes = K * V::kLanes;
  const uint8_t* xu = x.u.get() + first_vector * vector_bytes;
  const int8_t* w[NR];
  const int32_t* sc[NR];
  for (int n = 0; n < NR; ++n) {
    if constexpr (kNibbles)
      w[n] = panel.nibbles(c0 + n);
    else
      w[n] = panel.column(c0 + n);
    sc[n] = panel.sc.data() + (c0 + n) * (K / L::kSub);
  }
  typename V::F acc[NR][RV];
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < RV; ++r) acc[n][r] = V::fzero();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t offset = b * ahead_bytes / blocks / 64 * 64; offset < (b + 1) * ahead_bytes / blocks; offset += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + offset), _MM_HINT_T0);
    typename V::I total[NR][RV];
    if constexpr (V::kInt16Pairs) {
      block_totals_pairs<QT, NR, RV, kGroup>(xu, vector_bytes, w, panel.step, sc, b, total);
    } else {
      block_totals<QT, V, NR, RV, kGroup, kNibbles>(xu, vector_bytes, w, panel.step, sc, b, total);
    }
    if constexpr (kGroup > 4)
      for (int n = 0; n < NR; ++n) total[n][RV - 1] = V::template row_totals<kGroup>(total[n][RV - 1]);
    for (int r = 0; r < RV; ++r) {
      const typename V::F xd = V::fload(x.d.data() + b * x.rows + (first_vector + r) * V::kLanes);
      for (int n = 0; n < NR; ++n) {
        const typename V::I tot = V::sub(total[n][r], kXBias<QT, V> * panel.bias[(c0 + n) * blocks + b]);
        if constexpr (L::kIntegerMins) {
          // The K-quants' minimum terms in integers: per 64 weights one vpdpwssd of the int16 pairs (m_2j, m_2j+1)
          // with x's sums over 32 values (|sum| <= 32 * 127), and two float operations a block, where they took an
          // FMA per 32 weights on vpdpbusd's pipes. Zen 4, 2 threads, alternating steps in one process: the 1.5B's
          // 32-sequence step 1.079x (forced avx2, vpmaddwd + vpaddd: 1.042x); a Q4_K tile on L1-resident operands
          // (scratch harness) ran at 75% of the vpdpbusd peak instead of 67%. vpmulld per 32 weights instead: 1.010x.
          const int32_t* m = panel.min_pairs.data() + ((c0 + n) * K + b * kW) / 64;
          const int16_t* qs = x.qsum_pairs.data() + (b * kW / 64 * x.rows + (first_vector + r) * V::kLanes) * 2;
          typename V::I mins = V::izero();
          for (int j = 0; j < kW / 64; ++j)
            mins = V::dot_pairs(mins, V::iload(reinterpret_cast<const uint8_t*>(qs + j * x.rows * 2)), m[j]);
          acc[n][r] = V::scaled_with_mins(acc[n][r], tot, mins, xd, panel.d[(c0 + n) * blocks + b],
                                          panel.negdmin[(c0 + n) * blocks + b]);
        } else if constexpr (L::kScaled) {  // Q6_K
          acc[n][r] = V::scaled(acc[n][r], tot, xd, panel.d[(c0 + n) * blocks + b]);
        } else if constexpr (L::kMinGroups == 1) {  // Q4_1: its block's m (d_x sum(q_x)) in the same step
          const typename V::F sums = V::fload(x.sums.data() + b * x.rows + (first_vector + r) * V::kLanes);
          acc[n][r] = V::added(acc[n][r], tot, xd, panel.d[(c0 + n) * blocks + b], sums, panel.negdm[(c0 + n) * blocks + b]);
        } else {
          acc[n][r] = V::added(acc[n][r], tot, xd, panel.d[(c0 + n) * blocks + b]);
        }
      }
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < RV; ++r) V::store(out + (n * RV + r) * V::kLanes, acc[n][r]);
}

// Columns per tile and row vectors per tile: NR * RV accumulators three times over (partial, total, float) plus RV
// x vectors within the register file (AVX-512: 32 registers, AVX2: 16). On AVX-512 a call of one row vector (up to
// 16 rows) takes twice the columns instead: its NR partial sums are the independent vpdpbusd chains that hide the
// instruction's latency (4 cycles at 2 a cycle on Zen 5, so 4 chains run it at half rate; 8960x1536 at 6-16 rows,
// 2 threads, `python -m carpool.bench.gemv --rows 6 8 12 16`: Q4_K 1.15-1.19x, Q4_1 1.12-1.17x, Q8_0 and Q6_K within
// 5%). AVX2: 3 x 2 keeps 6 int16 sums, 2 x vectors and a broadcast in registers (3 of the 6 int32 totals spill
// once per kPairSteps steps); every vector instruction takes one of the 4 FP pipes, and per vpmaddubsw a tile pays
// one vpaddw and 1 / RV broadcasts (llvm-mca -mcpu=znver3 on the 4 x 1 loop: broadcasts as many as multiplies, 27
// cycles for 32 of them). Zen 3, one thread, CPU time, min of 3 interleaved runs, 32 / 128 rows, 8960x1536, against
// the old 2 x 2 tile (which GCC compiled with x reloaded and sums spilled in the inner loop) and its scalar
// quantization (~4% of these calls): Q4_K 1.52x / 1.56x, Q4_0 1.63x / 1.52x, Q4_1 1.44x / 1.69x, Q5_0 1.15x /
// 1.33x, Q6_K 1.13x / 1.23x. 4 x 1 and 6 x 1 were behind; a pinned 2 x 2 was 12-13% slower on Q4_K (the bulk of a
// Q4_K_M model) and 1-12% faster on Q6_K, Q5_0 and Q4_1 at 32 rows (docs/benchmarks.md). One-vector calls (up to
// 8 rows) spend as long unpacking as multiplying, and 2-6 columns there were within the noise.
// AVX-VNNI (the avxvnni build, 16 ymm registers): 4 x 2 and 6 columns for one vector; against 3 x 2 / 3 and 5 x 2 / 8
// (Intel family 6 model 167, 2 threads, the 1.5B's shapes, two alternations), equal or 2-8% faster at 32 rows, 4-17%
// at 8. Its sub-block scales are one vpmulld per 32 weights, on the same two ports as vpdpbusd: Q4_K at 32 rows is
// within 5% of AVX2's int16 pairs, the formats without scales 1.1-1.8x (docs/benchmarks.md).
#ifdef CARPOOL_AVX512
constexpr int kTileColumns = 4, kTileVectors = 2, kOneVectorColumns = 8;
#elif defined(CARPOOL_VNNI256)
constexpr int kTileColumns = 4, kTileVectors = 2, kOneVectorColumns = 6;
#else
constexpr int kTileColumns = 3, kTileVectors = 2, kOneVectorColumns = 3;
#endif

// Prompt chunks (hundreds of rows): x in row blocks of about kRowBlockBytes (L2-resident while a panel's tiles run
// over them) and panels of kPanelTiles tiles unpacked together, so x streams from L3 once per panel instead of once
// per tile, and each unpacked weight still serves every row of the call. A call whose x fits one row block (decode
// batches) unpacks one tile at a time, as before. Each output is the same sum whatever the blocking.
constexpr int64_t kRowBlockBytes = 128 << 10, kPanelTiles = 8;

template <int64_t QT, typename V, int NR, int RV, typename Y>
void int8_gemm_tiles(const InterleavedRows& q, const uint8_t* weight, Layout layout, int64_t M, int64_t N,
                     int64_t K, Y* y) {
  const int64_t row_bytes = gguf_row_bytes<QT>(K), vectors = q.rows / V::kLanes;
  // Vectors with every lane a row (quantize_interleaved never groups a call of one vector, whose tile has RV 1).
  const int64_t full_vectors = q.tail_group > 4 ? vectors - 1 : vectors;
  TORCH_CHECK(!V::kInt16Pairs || q.tail_group == 4 || full_vectors % RV == 0, "int8 GEMM: a grouped last vector after ",
              full_vectors, " whole ones, which int16-pairs tiles cannot take beside one (tail_group pads it)");
  const int64_t block_vectors = std::max<int64_t>(RV, kRowBlockBytes / (K * V::kLanes) / RV * RV);
  // Row groups unpack in place into panels of whole groups (Panel) where a tile's columns divide a group or groups
  // divide them. AVX2's 3-column tiles would need 24-column panels, 36 KiB of weights for a row of 1536, past L1
  // beside the rows' x: a 32-row Q4_K call ran 5.7-5.9 -> 6.2-7.9 ms (Zen 4, forced avx2, one thread); they put
  // groups back (RowReader) instead.
  const bool interleaved = layout == Layout::kRowGroups && (kGroupRows % NR == 0 || NR % kGroupRows == 0);
  const bool nibbles = kNibbleTiles<QT, V> && interleaved;
  int64_t panel_tiles = vectors > block_vectors ? kPanelTiles : 1;
  while (interleaved && panel_tiles * NR % kGroupRows) ++panel_tiles;
  const int64_t width = panel_tiles * NR;
  const int64_t panels = (N + width - 1) / width;
  // Each thread claims runs of `chunk` panels as it goes instead of a fixed share: a fixed split waits at the call's
  // end on whichever thread ran slower. 32-sequence decode steps of the 1.5B (Zen 4, alternating steps in one
  // process): 1.02x on a quiet machine, 1.28x with a busy process sharing one of the two cores.
  // A run also covers whole cache lines of y's rows: threads whose runs shared a line passed it back and forth
  // at every tile's store (AVX2's 3-column panels, 4 a run: 12 floats, so nearly every line of y was shared).
  int64_t chunk = std::max<int64_t>(1, 4 / panel_tiles);
  while (chunk * width % (64 / static_cast<int64_t>(sizeof(Y)))) ++chunk;
  // Tiles store into the thread's run, staged ([M][run_width]), which goes to y a whole line a row when the run ends:
  // storing each tile's 4 columns (8 bytes a row) into y itself touched every line of y 8 times (bf16), between
  // panels whose weights stream through L1. Zen 4, 2 threads, in one process against direct stores: 8960x1536 Q4_K
  // at 32 rows 1.027x, the 1.5B's Q6_K LM head at 32 rows 1.04x, its 32-sequence step 1.012x; one thread and
  // prompt-sized calls unchanged (0.99-1.01x).
  const int64_t run_width = chunk * width;
  std::atomic<int64_t> next_panel{0};
  auto run_panels = [&] {
    Panel<QT> panel(K, width, interleaved, nibbles);
    RowReader<QT> rows(weight, row_bytes, layout);
    alignas(64) float out[NR * RV * V::kLanes];
    std::vector<Y> staged(M * run_width);
    int64_t p = next_panel.fetch_add(chunk), end = std::min(p + chunk, panels), run = p;
    while (p < end) {
      // the panel this thread runs after p: the next of its run, or the first of the run it claims now
      int64_t following = p + 1;
      const bool run_ends = following == end;
      if (run_ends) {
        following = next_panel.fetch_add(chunk);
        end = std::min(following + chunk, panels);
      }
      const int64_t n0 = p * width, columns = std::min<int64_t>(width, N - n0);
      Y* to = staged.data() + (p - run) * width;
      if constexpr (kNibbleTiles<QT, V>)
        if (nibbles) panel.template unpack<kXBias<QT, V> != 0, true>(rows, layout, n0, columns);
      if (!nibbles) panel.template unpack<kXBias<QT, V> != 0>(rows, layout, n0, columns);
      // The next panel's blocks (contiguous rows) on their way from memory while this one computes: unpacking is
      // where the weights first arrive, and it waited on them (40% of a 32-row Q4_K call, measured). Spread over
      // the blocks of every tile of the panel's first row block: issued all at once they stalled on the core's
      // outstanding misses (the loop of them was 2.6% of a 32-sequence step of the 1.5B on Zen 4; spread over a
      // tile, the step ran 1.13-1.17x as fast), and a row-group panel of two tiles that prefetched in its first tile
      // only ran the 1.5B's Q6_K LM head at 32 rows from memory 0.94x as fast as over both (Zen 4, one thread).
      // A row group put back whole with its first row (RowReader) is read then, so a panel narrower than a group
      // prefetches the bytes kGroupRows - width rows past the next panel's: a group arrives in parts over the panels
      // before the one that reads it. (Whole groups, each before the panel it starts in, came all at once every other
      // panel of 4 rows: the 1.5B's Q6_K LM head at 32 rows ran 0.84-0.86x its GGUF rows' speed, 0.88-0.90x since.)
      const int64_t shift = layout == Layout::kRowGroups ? std::max<int64_t>(0, kGroupRows - width) : 0;
      const int64_t ahead_row = std::min(N, following * width + shift);
      const int64_t ahead_end = std::min(N, following * width + width + shift);
      const uint8_t* ahead = following < end ? weight + ahead_row * row_bytes : nullptr;
      int64_t ahead_bytes = ahead ? std::max<int64_t>(0, ahead_end - ahead_row) * row_bytes : 0;
      const int64_t tiles = (columns + NR - 1) / NR;
      const int64_t slice = (ahead_bytes + tiles - 1) / tiles;
      auto tile = [&]<int kRV, int kGroup>(int64_t c0, int64_t v, int64_t tile_ahead) {
        if (nibbles)
          gemm_tile<QT, V, NR, kRV, kNibbleTiles<QT, V>, kGroup>(panel, c0, q, v, out, ahead, tile_ahead);
        else
          gemm_tile<QT, V, NR, kRV, false, kGroup>(panel, c0, q, v, out, ahead, tile_ahead);
      };
      for (int64_t v0 = 0; v0 < vectors; v0 += block_vectors) {
        const int64_t v1 = std::min(vectors, v0 + block_vectors), full_end = std::min(v1, full_vectors);
        for (int64_t c0 = 0; c0 < columns; c0 += NR) {
          const int64_t tile_columns = std::min<int64_t>(NR, columns - c0);
          int64_t tile_ahead = std::min(slice, ahead_bytes);
          ahead_bytes -= tile_ahead;
          int64_t v = v0;
          for (; v + RV <= full_end; v += RV) {
            tile.template operator()<RV, 4>(c0, v, tile_ahead);
            tile_ahead = 0;
            store_tile<V::kLanes>(out, RV, static_cast<int>(tile_columns), v, M, to + c0, run_width);
          }
          if (v < v1) {  // fewer than RV vectors left, the last of them maybe grouped: one tile of them all
            const int rv = static_cast<int>(v1 - v);
            if (full_end == v1) {
              tile.template operator()<1, 4>(c0, v, tile_ahead);
            } else if constexpr (RV > 1) {
              const auto grouped = [&]<int kRV>() {
                if (q.tail_group == 8)
                  tile.template operator()<kRV, 8>(c0, v, tile_ahead);
                else
                  tile.template operator()<kRV, 16>(c0, v, tile_ahead);
                const int spread = q.tail_group / 4;  // each row's first lane into lane `row`, as store_tile reads
                for (int n = 0; n < NR; ++n) {
                  float* last = out + (n * kRV + kRV - 1) * V::kLanes;
                  for (int row = 1; row < V::kLanes / spread; ++row) last[row] = last[row * spread];
                }
              };
              if (rv == 1)
                grouped.template operator()<1>();
              else if constexpr (!V::kInt16Pairs)  // int16-pairs calls pad the last vector here instead (tail_group)
                grouped.template operator()<2>();
            }
            tile_ahead = 0;
            store_tile<V::kLanes>(out, rv, static_cast<int>(tile_columns), v, M, to + c0, run_width);
          }
          ahead += slice;
        }
      }
      if (run_ends) {
        copy_run(staged.data(), run_width, M, y + run * width, N, std::min(N, (p + 1) * width) - run * width);
        run = following;
      }
      p = following;
    }
  };
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { run_panels(); });
}

template <int64_t QT, typename V, typename X, typename Y>
void int8_gemm(const X* x, const uint8_t* weight, Layout layout, int64_t M, int64_t N, int64_t K, Y* y) {
  const InterleavedRows q =
      quantize_interleaved(x, M, K, Format<QT>::kWeights, V::kLanes, kXBias<QT, V>, kXSums<QT>,
                           V::kInt16Pairs ? kTileVectors : 1);  // see tail_group
  if (q.rows == V::kLanes)
    int8_gemm_tiles<QT, V, kOneVectorColumns, 1>(q, weight, layout, M, N, K, y);
  else
    int8_gemm_tiles<QT, V, kTileColumns, kTileVectors>(q, weight, layout, M, N, K, y);
}

}  // namespace

bool int8_gemm_linear(const at::Tensor& x, const uint8_t* weight, int64_t qtype, int64_t N, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1);
  const RowFormat format = row_format(qtype);
  bool ran = false;
  auto with_x = [&]<int64_t QT, typename V, typename X>(const X* xs) {
    if (y.scalar_type() == at::kFloat)
      int8_gemm<QT, V>(xs, weight, format.layout, M, N, K, y.data_ptr<float>());
    else
      int8_gemm<QT, V>(xs, weight, format.layout, M, N, K, y.data_ptr<c10::BFloat16>());
  };
  auto run = [&]<int64_t QT, typename V>() {
    if (x.scalar_type() == at::kBFloat16)
      with_x.template operator()<QT, V>(x.data_ptr<c10::BFloat16>());
    else
      with_x.template operator()<QT, V>(x.data_ptr<float>());
    ran = true;
  };
  auto lanes = [&]<int64_t QT>() {
#ifdef CARPOOL_AVX512
    if (M > Rows8::kLanes) return run.template operator()<QT, Rows16>();
#endif
    run.template operator()<QT, Rows8>();
  };
  switch (format.qtype) {
    case kQ4_0: lanes.template operator()<kQ4_0>(); break;
    case kQ4_1: lanes.template operator()<kQ4_1>(); break;
    case kQ5_0: lanes.template operator()<kQ5_0>(); break;
    case kQ8_0: lanes.template operator()<kQ8_0>(); break;
    case kQ4_K: lanes.template operator()<kQ4_K>(); break;
    case kQ5_K: lanes.template operator()<kQ5_K>(); break;
    case kQ6_K: lanes.template operator()<kQ6_K>(); break;
  }
  return ran;
}

#else

bool int8_gemm_linear(const at::Tensor&, const uint8_t*, int64_t, int64_t, at::Tensor&) { return false; }

#endif

}  // namespace carpool::ggml
