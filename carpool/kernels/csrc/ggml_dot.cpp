// The int8-dot path of ggml_linear (ggml_dot.h). Per weight block, with x quantized as q_x * d_x:
//   Q8_0  d d_x sum(q q_x)                      Q4_0, Q5_0  d d_x sum((q - 8 or 16) q_x)
//   Q4_1  d d_x sum(q q_x) + m d_x sum(q_x)
//   Q4_K, Q5_K  d d_x sum_j sc_j sum(q q_x) - dmin d_x sum_j m_j sum_j(q_x)   (8 sub-blocks j of 32)
//   Q6_K  d d_x (sum_s sc_s sum(q q_x) - 32 sum_s sc_s sum_s(q_x))           (16 sub-blocks s of 16)
// The sums over sub-blocks stay in int32 (at most 2^29 for Q6_K's int8 scales), so each block costs one float
// multiply-add per activation row. Weights are unpacked once per block and dotted with every activation row.
//
// AVX-512 and AVX2 share 256-bit code: u8 x s8 products summed in fours by VNNI's vpdpbusd (AVX512-VNNI's or
// AVX-VNNI's, vec.h's dpbusd256; plain AVX2: vpmaddubsw + vpmaddwd), int16 x scale pairs by vpdpwssd (AVX2:
// vpmaddwd + add). The signed formats use abs(w) and x with w's sign, as u8 x s8 needs. The AVX-512 build runs the
// K-quants' products on 512-bit registers (a chunk's two sub-blocks at once); the 32-weight formats go eight blocks
// at a time (dot_octets). The portable build computes the same integer sums in plain loops.
#include "ggml_dot.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "ggml_blocks.h"
#include "vec.h"
#include "work_shares.h"

namespace carpool::ggml {

namespace {

thread_local MatmulMode current_mode = MatmulMode::kExact;

// Activation rows one pass of the GEMV dots with an unpacked weight block.
constexpr int64_t kGemvPassRows = 4;

// How far ahead of the row it dots the GEMV asks for weights (a prefetch per cache line, past `last` too: a
// prefetch never faults). The hardware prefetchers alone left the 1.5B's Q4_K matmuls at 8.3 GB/s from DRAM on an
// Intel VM (family 6 model 167), 24 GB/s from its L3 (likely why: the weights are 4 KiB pages of a file mapping,
// and those prefetchers stop at a page's end); 2-64 KiB ahead all gave 13-14 GB/s, 16 KiB the most: every matmul of
// a decode step, 1 row 118 -> 75 ms, 4 rows 157 -> 101 ms (scratch loop of ggml_linear over the model's weights, 2
// threads). Not measured on AMD.
constexpr int64_t kGemvPrefetchBytes = 16 << 10;

// Every SIMD build dots Q4_0 and Q4_1 octets two blocks a register: blocks k and k + 4 side by side, as 16 bytes of
// nibbles each, load and unpack in 5 ops a pair instead of 4 a block, and the eight blocks' integer sums reduce in 3
// hadds instead of 6, 2 permutes and an add. x must come in the same order: quantize_rows keeps a copy so arranged
// (Int8Rows::q_octets). Octet-major rows (ggml_blocks.h) hold each pair's nibbles together (one load, three ops) and
// an octet's scales side by side. On Zen 3 (AVX2, the GEMV compute-bound: a cache-resident matrix ran no faster than
// one from DRAM), pairing took SmolLM2's Q4_1 matrices at one row and one thread 1.11-1.23x less time (gate/up
// 1536x576 65.2 -> 56.7 us, down 576x1536 52.9 -> 43.1, q 576x576 27.2 -> 24.3; min of 5 alternations) and its
// decode step 1.09x (2 threads: 6.69 -> 6.11 ms). On Zen 4 (avx512: each pair's products by two 256-bit vpdpbusd),
// 1536x576 at one row, one thread, weights from memory: GGUF rows paired 1.35x faster than the 512-bit code below
// (each block unpacked alone, two a register; Q5_0 and Q8_0 keep it), octet-major rows 1.18-1.20x faster again;
// SmolLM2's step 1.11-1.19x against the old code.
#ifdef CARPOOL_SIMD
constexpr bool kPairedOctets = true;
#else
constexpr bool kPairedOctets = false;
#endif

#ifdef CARPOOL_SIMD

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i bytes(int8_t v) { return _mm256_set1_epi8(v); }

// acc + sums of four u8 x s8 products per int32 lane.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#ifdef CARPOOL_VNNI256
  return dpbusd256(acc, u, s);
#else  // pairs fit int16: |u| <= 128 and |s| <= 127 here, so vpmaddubsw never saturates
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
// acc + sums of two int16 x int16 products per int32 lane.
inline __m256i dot_i16(__m256i acc, __m256i a, __m256i b) {
#ifdef CARPOOL_VNNI256
  return dpwssd256(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
// Signed weights: |w| as u8 and x with w's sign.
inline __m256i dot_s8s8(__m256i acc, __m256i w, __m256i x) {
  return dot_u8s8(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}
// 16 bytes of nibbles -> 32 values: low nibbles (weights 0-15), then high nibbles (16-31).
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), bytes(0x0F));
}
// Byte i = 0x10 where bit i of the 32 bits is set (Q5_0's fifth bits).
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i mask = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), bytes(0x10));
}
// The sum of v's int32 lanes, exact: a block's integer total from its partial sums.
inline int32_t hsum_i32(__m128i v) {
  const __m128i pairs = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(pairs, _mm_shuffle_epi32(pairs, _MM_SHUFFLE(2, 3, 0, 1))));
}
inline int32_t hsum_i32(__m256i v) {
  return hsum_i32(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
// r[i][j] -> r[j][i]: eight weight rows' vectors of eight blocks into eight blocks' vectors of the rows.
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], s[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 2; ++k) {
      s[4 * h + 2 * k] = _mm256_shuffle_ps(t[4 * h + k], t[4 * h + 2 + k], _MM_SHUFFLE(1, 0, 1, 0));
      s[4 * h + 2 * k + 1] = _mm256_shuffle_ps(t[4 * h + k], t[4 * h + 2 + k], _MM_SHUFFLE(3, 2, 3, 2));
    }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x20);
    r[4 + j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x31);
  }
}

// ---- the 32-weight formats eight blocks at a time ----
// Per block and row the integer dot is one vpdpbusd; converting each block's eight partial sums to float and
// scaling them apart (the per-block loop below) cost 3-4 more vector ops and a scalar multiply per block and row,
// which left Q4_1 compute-bound at 16 GB/s a core and made every extra row cost nearly a whole extra GEMV. Here the
// partial sums of eight blocks are reduced together into one vector, lane j = block j's integer dot (a hadd tree:
// 9 ops for 8 blocks), then made the eight blocks' terms (ggml_dot.h) with their d (f16 words in one vector) and
// x's scales in two multiplies. The weights are unpacked as unsigned bytes (q, or q + 128 for Q8_0 with VNNI) and the offset
// comes off as offset * sum(q_x) per block, exact in int32: the same integer dot as the signed form.

// Octet<QT>: the offset subtracted from the unsigned weights (kShift: log2 of it; -1: none), and either where a
// block's 16 bytes of nibbles start (kNibbles: Q4_0 and Q4_1, whose octets go paired, above) or block p's weights.
template <int64_t QT> struct Octet {};  // none: the per-block loop
template <> struct Octet<kQ4_0> {
  static constexpr int kShift = 3;
  static constexpr int kNibbles = 2;
};
template <> struct Octet<kQ4_1> {
  static constexpr int kShift = -1;
  static constexpr int kNibbles = 4;
};
template <> struct Octet<kQ5_0> {
  static constexpr int kShift = 4;
  static __m256i weights(const uint8_t* p) { return _mm256_or_si256(nibbles32(p + 6), fifth_bits(p + 2)); }
};
#ifdef CARPOOL_VNNI256  // vpdpbusd sums u8 x s8 products in int32; AVX2's vpmaddubsw would saturate at q + 128
template <> struct Octet<kQ8_0> {
  static constexpr int kShift = 7;
  static __m256i weights(const uint8_t* p) {
    return _mm256_xor_si256(load256(p + 2), bytes(static_cast<int8_t>(0x80)));
  }
};
#endif
template <int64_t QT>
concept HasOctet = requires { Octet<QT>::kShift; };
template <int64_t QT>
concept PairedOctet = kPairedOctets && requires { Octet<QT>::kNibbles; };  // Q4_0, Q4_1

// acc + u1 x s1 + u2 x s2 summed in fours per int32 lane, for nibbles (u <= 15): two vpdpbusd with VNNI; AVX2 adds
// the two vpmaddubsw's int16 pairs (at most 2 x 2 x 15 x 127) before widening them once.
inline __m256i dot_nibble_pairs(__m256i u1, __m256i s1, __m256i u2, __m256i s2) {
#ifdef CARPOOL_VNNI256
  return dpbusd256(dpbusd256(_mm256_setzero_si256(), u1, s1), u2, s2);
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u1, s1), _mm256_maddubs_epi16(u2, s2)),
                           _mm256_set1_epi16(1));
#endif
}

// [sum(v0), ..., sum(v7)] of eight int32 vectors.
inline __m256i sum8(__m256i v0, __m256i v1, __m256i v2, __m256i v3, __m256i v4, __m256i v5, __m256i v6, __m256i v7) {
  const __m256i low = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
  const __m256i high = _mm256_hadd_epi32(_mm256_hadd_epi32(v4, v5), _mm256_hadd_epi32(v6, v7));
  return _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20), _mm256_permute2x128_si256(low, high, 0x31));
}

#if defined(CARPOOL_AVX512) && defined(__AVX512VNNI__)
// The same from four 512-bit vectors, z_k = blocks 2k (lanes 0-7) and 2k + 1 (lanes 8-15): a row's eight blocks
// take four vpdpbusd instead of eight and a 32-bit transpose instead of the hadd tree (Q4_1 at 4 rows 1.37x, at 1 row
// 1.09x, a stand-alone loop on Zen 5).
inline __m256i sum8(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  // 128-bit lane L: the sums of lane L's four values of a, b, c, d; L = 0, 1 a pair's first block, 2, 3 its second
  const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  const __m512i v = _mm512_add_epi32(_mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 3, 1)));
  // v's low half: blocks 0, 2, 4, 6, 1, 3, 5, 7
  return _mm256_permutevar8x32_epi32(_mm512_castsi512_si256(v), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

// Blocks [0, 8 * octets) of one weight row against MR activation rows: each block's term (ggml_dot.h: (tot x_d) d,
// Q4_1's fma(x_d sum(q_x), m, that)) into terms[i][b]. xo: x's rows in the paired order (Int8Rows::octet_row),
// where PairedOctet<QT>. kOctetMajor: the row is octet-major (ggml_blocks.h).
template <int64_t QT, int MR, bool kOctetMajor>
void dot_octets(const uint8_t* row, int64_t octets, const int8_t* const* xq, const int8_t* const* xo,
                const float* const* xd, const int32_t* const* xbs, float* const* terms) {
  constexpr int64_t kBytes = Format<QT>::kBytes;
  for (int64_t o = 0; o < octets; ++o) {
    const uint8_t* p = row + 8 * o * kBytes;
    __m256 d, m;
    if constexpr (kOctetMajor) {
      d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + octet_q4_offsets<QT>(0).d)));
      if constexpr (QT == kQ4_1)
        m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + octet_q4_offsets<QT>(0).m)));
    } else {
      // Each block's first 4 bytes: d (and Q4_1's m) as f16, split into eight d and eight m. Eight scalar loads and
      // one vector load of them, not vpgatherdd: the gather alone held Q4_1 at 17.6 GB/s a core, 28.9 without it
      // (Zen 5, one row, a stand-alone loop).
      alignas(32) uint32_t first_words[8];
      for (int j = 0; j < 8; ++j) std::memcpy(&first_words[j], p + j * kBytes, 4);
      const __m256i words = _mm256_load_si256(reinterpret_cast<const __m256i*>(first_words));
      const __m256i halves = _mm256_permute4x64_epi64(
          _mm256_packus_epi32(_mm256_and_si256(words, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(words, 16)),
          0xD8);
      d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
      if constexpr (QT == kQ4_1) m = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
    }
    __m256i w[8];
    if constexpr (PairedOctet<QT>) {  // w[k]: low nibbles of blocks k | k + 4, w[k + 4]: high ones
      for (int k = 0; k < 4; ++k) {
        __m256i raw;
        if constexpr (kOctetMajor) {
          raw = load256(p + octet_q4_offsets<QT>(k).nibbles);  // block k's nibbles, then block k + 4's
        } else {
          const uint8_t* nibbles = p + k * kBytes + Octet<QT>::kNibbles;
          raw = _mm256_inserti128_si256(
              _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles))),
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles + 4 * kBytes)), 1);
        }
        w[k] = _mm256_and_si256(raw, bytes(0x0F));
        w[k + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), bytes(0x0F));
      }
    } else {
      static_assert(!kOctetMajor, "octet-major rows run paired on every SIMD build");
      for (int j = 0; j < 8; ++j) w[j] = Octet<QT>::weights(p + j * kBytes);
    }
#if defined(CARPOOL_AVX512) && defined(__AVX512VNNI__)
    __m512i pairs[4];
    if constexpr (!PairedOctet<QT>)
      for (int k = 0; k < 4; ++k) pairs[k] = _mm512_inserti64x4(_mm512_castsi256_si512(w[2 * k]), w[2 * k + 1], 1);
#endif
    for (int i = 0; i < MR; ++i) {
      const int8_t* q = xq[i] + 256 * o;
      __m256i sums;
      if constexpr (PairedOctet<QT>) {
        // Pair k's lanes 0-3 sum block k, 4-7 block k + 4: hadd(hadd(0, 1), hadd(2, 3)) is blocks 0-7 in order.
        const int8_t* paired = xo[i] + 256 * o;
        __m256i dots[4];
        for (int k = 0; k < 4; ++k)
          dots[k] = dot_nibble_pairs(w[k], load256(paired + 64 * k), w[k + 4], load256(paired + 64 * k + 32));
        sums = _mm256_hadd_epi32(_mm256_hadd_epi32(dots[0], dots[1]), _mm256_hadd_epi32(dots[2], dots[3]));
      } else {
#if defined(CARPOOL_AVX512) && defined(__AVX512VNNI__)
        __m512i dots[4];
        for (int k = 0; k < 4; ++k)
          dots[k] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), pairs[k], _mm512_loadu_si512(q + 64 * k));
        sums = sum8(dots[0], dots[1], dots[2], dots[3]);
#else
        __m256i dots[8];
        for (int j = 0; j < 8; ++j) dots[j] = dot_u8s8(_mm256_setzero_si256(), w[j], load256(q + 32 * j));
        sums = sum8(dots[0], dots[1], dots[2], dots[3], dots[4], dots[5], dots[6], dots[7]);
#endif
      }
      const __m256 x_scale = _mm256_loadu_ps(xd[i] + 8 * o);
      const __m256i x_sums = load256(xbs[i] + 8 * o);
      if constexpr (Octet<QT>::kShift >= 0)
        sums = _mm256_sub_epi32(sums, _mm256_slli_epi32(x_sums, Octet<QT>::kShift));
      __m256 term = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums), x_scale), d);
      if constexpr (QT == kQ4_1)  // + m d_x sum(q_x)
        term = _mm256_fmadd_ps(_mm256_mul_ps(x_scale, _mm256_cvtepi32_ps(x_sums)), m, term);
      _mm256_storeu_ps(terms[i] + 8 * o, term);
    }
  }
}

// The rows of x that MR activation rows from m0 read (each Int8Rows array at row m0 + i).
template <int MR>
struct RowViews {
  const int8_t* xq[MR];
  const float* xd[MR];
  const int16_t* xs[MR];
  const int32_t* xbs[MR];
  const int8_t* xo[MR];
  RowViews(const Int8Rows& x, int64_t m0) {
    for (int i = 0; i < MR; ++i) {
      xo[i] = kPairedOctets && x.block == 32 ? x.octet_row(m0 + i) : nullptr;
      xq[i] = x.q_row(m0 + i);
      xd[i] = x.d_row(m0 + i);
      xs[i] = x.sums_row(m0 + i);
      xbs[i] = x.block_sums_row(m0 + i);
    }
  }
};

// The blocks a 32-weight row dots eight at a time (dot_octets); the rest are its tail.
template <int64_t QT>
int64_t octet_blocks(int64_t blocks) {
  if constexpr (HasOctet<QT>) return blocks / 8 * 8;
  return 0;
}

// One weight row of a 32-weight format against MR activation rows: every block's term (ggml_dot.h) into terms[i][b]
// for the octets' blocks, into tails[i][8 (b - octet_blocks)] for the tail's (a weight row's tail terms 8 floats
// apart, so that eight rows' make one vector); combine_columns then adds eight weight rows' terms in order, in their
// lanes. Tail terms gathered lane by lane cost SmolLM2's 576-wide rows (two tail blocks to two octets) more than
// their octets did.
template <int64_t QT, int MR, Layout kLayout>
void block_terms(const uint8_t* row, const Int8Rows& x, int64_t m0, float* const* terms, float* const* tails) {
  static_assert(kLayout != Layout::kRowGroups, "row groups run int8_dot_row_groups");
  constexpr bool kOctetMajor = kLayout == Layout::kOctetMajor;
  const int64_t blocks = x.K / Format<QT>::kWeights;
  const RowViews<MR> v(x, m0);
  const int64_t tail = octet_blocks<QT>(blocks);
  if constexpr (HasOctet<QT>) dot_octets<QT, MR, kOctetMajor>(row, blocks / 8, v.xq, v.xo, v.xd, v.xbs, terms);
  int64_t first_block = tail;
  if constexpr (PairedOctet<QT>) {
    // The blocks past the last octet two at a time, paired as the octets pair theirs (x's halves swapped into place
    // here): lanes 0-3 of the products are block b's, 4-7 block b + 1's. One block at a time, SmolLM2's two tail
    // blocks a 576-wide row cost 2.6 octet blocks' time each, 20% of the row; two at a time, 1536x576 took 57.8 ->
    // 54.1 us (Zen 3, one thread).
    constexpr int64_t kBytes = Format<QT>::kBytes;
    for (; first_block + 2 <= blocks; first_block += 2) {
      const int64_t b = first_block;
      const uint8_t* p = row + b * kBytes;
      const __m256i raw = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + Octet<QT>::kNibbles))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kBytes + Octet<QT>::kNibbles)), 1);
      const __m256i low = _mm256_and_si256(raw, bytes(0x0F));
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), bytes(0x0F));
      const float d0 = half_to_float(p), d1 = half_to_float(p + kBytes);
      for (int i = 0; i < MR; ++i) {
        const __m256i first = load256(v.xq[i] + 32 * b), second = load256(v.xq[i] + 32 * b + 32);
        __m256i dot = dot_nibble_pairs(low, _mm256_permute2x128_si256(first, second, 0x20), high,
                                       _mm256_permute2x128_si256(first, second, 0x31));
        if constexpr (QT == kQ4_0)  // - 8 sum(q_x) per block: 2 sum(q_x) from each of its four lanes
          dot = _mm256_sub_epi32(
              dot, _mm256_set_m128i(_mm_set1_epi32(2 * v.xbs[i][b + 1]), _mm_set1_epi32(2 * v.xbs[i][b])));
        float term0 = static_cast<float>(hsum_i32(_mm256_castsi256_si128(dot))) * v.xd[i][b] * d0;
        float term1 = static_cast<float>(hsum_i32(_mm256_extracti128_si256(dot, 1))) * v.xd[i][b + 1] * d1;
        if constexpr (QT == kQ4_1) {  // + m d_x sum(q_x)
          term0 = std::fma(v.xd[i][b] * static_cast<float>(v.xbs[i][b]), half_to_float(p + 2), term0);
          term1 = std::fma(v.xd[i][b + 1] * static_cast<float>(v.xbs[i][b + 1]), half_to_float(p + kBytes + 2), term1);
        }
        tails[i][8 * (b - tail)] = term0;
        tails[i][8 * (b + 1 - tail)] = term1;
      }
    }
  }
  for (int64_t b = first_block; b < blocks; ++b) {
    const uint8_t* p = row + b * Format<QT>::kBytes;
    const int64_t k0 = b * Format<QT>::kWeights;
    const float d = half_to_float(p);
    __m256i w;
    if constexpr (QT == kQ8_0) w = load256(p + 2);
    if constexpr (QT == kQ4_0) w = _mm256_sub_epi8(nibbles32(p + 2), bytes(8));
    if constexpr (QT == kQ5_0) w = _mm256_sub_epi8(_mm256_or_si256(nibbles32(p + 6), fifth_bits(p + 2)), bytes(16));
    if constexpr (QT == kQ4_1) w = nibbles32(p + 4);  // unsigned: its minimum is Q4_1's m term
    const __m256i u = QT == kQ4_1 ? w : _mm256_abs_epi8(w);
    for (int i = 0; i < MR; ++i) {
      const __m256i xs = load256(v.xq[i] + k0);
      const __m256i dot = dot_u8s8(_mm256_setzero_si256(), u, QT == kQ4_1 ? xs : _mm256_sign_epi8(xs, w));
      float term = static_cast<float>(hsum_i32(dot)) * v.xd[i][b] * d;
      if constexpr (QT == kQ4_1) term = std::fma(v.xd[i][b] * static_cast<float>(v.xbs[i][b]), half_to_float(p + 2), term);
      tails[i][8 * (b - tail)] = term;
    }
  }
}

// Eight weight rows' terms (from block_terms: the octets' at terms[c * octets + b], the tail's a vector a block)
// added in order along K, a weight row a lane, into out[0..8). The octets transpose in registers.
inline void combine_columns(const float* terms, int64_t octets, const float* tails, int64_t tail_blocks, float* out) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < octets; b += 8) {
    __m256 t[8];
    for (int c = 0; c < 8; ++c) t[c] = _mm256_loadu_ps(terms + c * octets + b);
    transpose8(t);
    for (int j = 0; j < 8; ++j) acc = _mm256_add_ps(acc, t[j]);
  }
  for (int64_t b = 0; b < tail_blocks; ++b) acc = _mm256_add_ps(acc, _mm256_loadu_ps(tails + 8 * b));
  _mm256_storeu_ps(out, acc);
}

template <int64_t QT, int MR, Layout kLayout>
void dot_block_rows(const uint8_t* row, const Int8Rows& x, int64_t m0, float* out) {
  static_assert(kLayout == Layout::kGguf && Format<QT>::kWeights == 256, "32-weight formats run block_terms");
  const int64_t blocks = x.K / Format<QT>::kWeights;
  const RowViews<MR> v(x, m0);
  const int8_t* const* xq = v.xq;
  const float* const* xd = v.xd;
  const int16_t* const* xs = v.xs;
  float acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = row + b * Format<QT>::kBytes;
    const int64_t k0 = b * Format<QT>::kWeights;
    if constexpr (QT == kQ4_K || QT == kQ5_K) {
      const float d = half_to_float(p), dmin = half_to_float(p + 2);
      uint64_t scales, mins;
      k_scales_mins_packed(p + 4, scales, mins);
      // Each minimum twice, against x's sums of the two 16-value halves of its sub-block.
      const __m128i min8 = _mm_cvtsi64_si128(static_cast<int64_t>(mins));
      const __m256i min16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(min8, min8));
      const uint8_t* qs = p + (QT == kQ5_K ? 48 : 16);
#if defined(CARPOOL_AVX512) && defined(__AVX512VNNI__)
      // 512-bit: chunk c's two sub-blocks (low nibbles: 2c, high: 2c + 1) side by side in one register match 64
      // contiguous x values, so a row costs one load, one vpmaddubsw and one vpdpwssd per 64 weights, half the
      // 256-bit count (the per-row work is what made 2-4 rows cost 1.3-2.5 GEMVs).
      const __m512i scale16z =
          _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(scales))));
      constexpr __mmask32 kUpper = 0xFFFF0000;  // the int16 lanes of the high 256 bits
      __m512i high;
      if constexpr (QT == kQ5_K) high = _mm512_broadcast_i64x4(load256(p + 16));
      __m512i wide_sum[MR][2];  // even and odd chunks: half the dependency chain of vpdpwssd
      for (int i = 0; i < MR; ++i) wide_sum[i][0] = wide_sum[i][1] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const __m512i raw = _mm512_broadcast_i64x4(load256(qs + 32 * c));
        __m512i w = _mm512_and_si512(_mm512_mask_srli_epi16(raw, kUpper, raw, 4), _mm512_set1_epi8(0x0F));
        if constexpr (QT == kQ5_K) {  // as below: bit 2c of the high byte to bit 4 of sub-block 2c, 2c + 1 of 2c + 1
          const __m512i fifth = _mm512_mask_slli_epi16(_mm512_slli_epi16(high, 4), kUpper, high, 3);
          w = _mm512_or_si512(w, _mm512_and_si512(fifth, _mm512_set1_epi8(0x10)));
          high = _mm512_srli_epi16(high, 2);
        }
        const __m512i s = _mm512_shuffle_epi8(
            scale16z, _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>((4 * c + 1) << 8 | 4 * c)),
                                         _mm256_set1_epi16(static_cast<int16_t>((4 * c + 3) << 8 | (4 * c + 2))), 1));
        for (int i = 0; i < MR; ++i) {
          const __m512i products = _mm512_maddubs_epi16(w, _mm512_loadu_si512(xq[i] + k0 + 64 * c));
          wide_sum[i][c % 2] = _mm512_dpwssd_epi32(wide_sum[i][c % 2], products, s);
        }
      }
      __m256i isum[MR][2];
      for (int i = 0; i < MR; ++i) {
        const __m512i both = _mm512_add_epi32(wide_sum[i][0], wide_sum[i][1]);
        isum[i][0] = _mm512_castsi512_si256(both);
        isum[i][1] = _mm512_extracti64x4_epi64(both, 1);
      }
#else
      // Sub-block j's scale in every int16 lane: 8 int16 scales in each 128-bit half, picked by a byte shuffle.
      const __m256i scale16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(scales))));
      __m256i high;
      if constexpr (QT == kQ5_K) high = load256(p + 16);
      __m256i isum[MR][2];
      for (int i = 0; i < MR; ++i) isum[i][0] = isum[i][1] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i raw = load256(qs + 32 * c);
        __m256i lo = _mm256_and_si256(raw, bytes(0x0F)), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), bytes(0x0F));
        if constexpr (QT == kQ5_K) {  // bit 2c of high byte i is bit 4 of weight i of sub-block 2c, bit 2c+1 of 2c+1
          lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(high, 4), bytes(0x10)));
          hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(high, 3), bytes(0x10)));
          high = _mm256_srli_epi16(high, 2);
        }
        const __m256i s_lo = _mm256_shuffle_epi8(scale16, _mm256_set1_epi16(static_cast<int16_t>((4 * c + 1) << 8 | 4 * c)));
        const __m256i s_hi = _mm256_shuffle_epi8(scale16, _mm256_set1_epi16(static_cast<int16_t>((4 * c + 3) << 8 | (4 * c + 2))));
        for (int i = 0; i < MR; ++i) {  // two accumulators: half the dependency chain of vpdpwssd
          isum[i][0] = dot_i16(isum[i][0], _mm256_maddubs_epi16(lo, load256(xq[i] + k0 + 64 * c)), s_lo);
          isum[i][1] = dot_i16(isum[i][1], _mm256_maddubs_epi16(hi, load256(xq[i] + k0 + 64 * c + 32)), s_hi);
        }
      }
#endif
      for (int i = 0; i < MR; ++i) {
        const __m256i min_sum = _mm256_madd_epi16(min16, load256(xs[i] + 16 * b));
        acc[i] = block_step_with_mins(acc[i], hsum_i32(_mm256_add_epi32(isum[i][0], isum[i][1])), hsum_i32(min_sum),
                                      xd[i][b], d, -dmin);
      }
    } else if constexpr (QT == kQ6_K) {
      const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
      const float d = half_to_float(p + 208);
      __m256i isum[MR];
#if defined(CARPOOL_AVX512) && defined(__AVX512VNNI__)
      // 512-bit, as Q4_K above: q[0] | q[1] and q[2] | q[3] of the 256-bit code below each match 64 contiguous x values.
      constexpr __mmask32 kUpper = 0xFFFF0000;  // the int16 lanes of the high 256 bits
      __m512i wide_sum[MR][2];
      for (int i = 0; i < MR; ++i) wide_sum[i][0] = wide_sum[i][1] = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512i low = _mm512_loadu_si512(p + 64 * h), high = _mm512_broadcast_i64x4(load256(p + 128 + 32 * h));
        const __m512i low4 = _mm512_set1_epi8(0x0F), high2 = _mm512_set1_epi8(0x30);
        const __m512i q[2] = {
            _mm512_or_si512(_mm512_and_si512(low, low4),
                            _mm512_and_si512(_mm512_mask_slli_epi16(_mm512_slli_epi16(high, 4), kUpper, high, 2), high2)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), low4),
                            _mm512_and_si512(_mm512_mask_srli_epi16(high, kUpper, high, 2), high2)),
        };
        // 128-bit lane j of q[k2] holds sub-block 8h + 4 k2 + j (16 weights): its scale in every int16 lane.
        const __m512i scale16z =
            _mm512_broadcast_i32x4(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + 8 * h))));
        for (int k2 = 0; k2 < 2; ++k2) {
          auto pick = [](int j) { return _mm_set1_epi16(static_cast<int16_t>((2 * j + 1) << 8 | 2 * j)); };
          const __m512i control = _mm512_inserti64x4(
              _mm512_castsi256_si512(_mm256_set_m128i(pick(4 * k2 + 1), pick(4 * k2))),
              _mm256_set_m128i(pick(4 * k2 + 3), pick(4 * k2 + 2)), 1);
          const __m512i s = _mm512_shuffle_epi8(scale16z, control);
          for (int i = 0; i < MR; ++i) {
            const __m512i products = _mm512_maddubs_epi16(q[k2], _mm512_loadu_si512(xq[i] + k0 + 128 * h + 64 * k2));
            wide_sum[i][k2] = _mm512_dpwssd_epi32(wide_sum[i][k2], products, s);
          }
        }
      }
      for (int i = 0; i < MR; ++i) {
        const __m512i both = _mm512_add_epi32(wide_sum[i][0], wide_sum[i][1]);
        isum[i] = _mm256_add_epi32(_mm512_castsi512_si256(both), _mm512_extracti64x4_epi64(both, 1));
      }
#else
      for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        const __m256i low0 = load256(p + 64 * h), low1 = load256(p + 64 * h + 32), high = load256(p + 128 + 32 * h);
        __m256i q[4];
        q6_k_weights(low0, low1, high, q);
        // Sub-blocks 8h + 2k and 8h + 2k + 1 (16 weights each): one scale per 128-bit half of the int16 products.
        const __m256i scale16 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + 8 * h))));
        for (int k = 0; k < 4; ++k) {
          const int16_t first = static_cast<int16_t>((4 * k + 1) << 8 | 4 * k), second = static_cast<int16_t>((4 * k + 3) << 8 | (4 * k + 2));
          const __m256i s = _mm256_shuffle_epi8(scale16, _mm256_set_m128i(_mm_set1_epi16(second), _mm_set1_epi16(first)));
          for (int i = 0; i < MR; ++i)
            isum[i] = dot_i16(isum[i], _mm256_maddubs_epi16(q[k], load256(xq[i] + k0 + 128 * h + 32 * k)), s);
        }
      }
#endif
      const __m256i scale16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
      for (int i = 0; i < MR; ++i) {  // minus 32 sum_s sc_s sum_s(q_x): the q - 32 offset
        const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(scale16, load256(xs[i] + 16 * b)), 5);
        acc[i] = block_step(acc[i], hsum_i32(_mm256_sub_epi32(isum[i], offset)), xd[i][b], d);
      }
    } else {
      static_assert(QT != QT, "not a GGML kernel type");
    }
  }
  for (int i = 0; i < MR; ++i) out[i] = acc[i];
}

// ---- Q4_K row groups (ggml_blocks.h): eight weight rows at once, lane r of every vector row r ----
// Each 32-byte load of nibbles is word t of the eight rows' blocks: positions 4 (t % 8) to + 3 of sub-blocks 2c and
// 2c + 1 (c = t / 8), dotted with those four activation values broadcast, so one vpdpbusd sums four products of
// every row, the rows never leave their lanes (no per-row reduction) and the eight blocks' scales and minimums unpack
// together (k_scales_mins_packed's 32-bit operations, on eight lanes). Per block the integer sums are whole, so each
// row costs two float multiply-adds a block, as the portable build computes them. Qwen2.5-Coder-1.5B's 8960x1536,
// weights from memory, Zen 4: one row 1.46-1.50x the GGUF rows' GEMV on one thread (two: 1.24-1.66x, 27-38 GB/s,
// the memory's wall), four rows 1.73-1.91x; the 1.5B's decode step 42.7 -> 36.9 ms (docs/benchmarks.md).

// x's sums per sub-block of `sub` values (Q4_K's 32, Q6_K's 16) of one activation row, as the int16 pairs
// (j, j + 2) that the row groups' per-sub-block weights (Q4_K's minimums, Q6_K's scales) multiply: 128 / sub int32
// words per 256-value block ([0, 2], [1, 3], [4, 6], [5, 7], ...); sums of 32 int8 values fit int16.
std::vector<int32_t> subblock_sum_pairs(const Int8Rows& x, int64_t m, int sub) {
  const int64_t blocks = x.K / 256, words = 128 / sub, per_sub = sub / 16;
  std::vector<int32_t> pairs(words * blocks);
  const int16_t* sums = x.sums_row(m);
  const auto sub_sum = [&](int64_t b, int j) {
    int32_t total = 0;
    for (int64_t k = 0; k < per_sub; ++k) total += sums[16 * b + per_sub * j + k];
    return static_cast<uint16_t>(total);
  };
  for (int64_t b = 0; b < blocks; ++b)
    for (int w = 0; w < words; ++w) {
      const int j = 4 * (w / 2) + w % 2;
      pairs[words * b + w] = static_cast<int32_t>(sub_sum(b, j) | static_cast<uint32_t>(sub_sum(b, j + 2)) << 16);
    }
  return pairs;
}

// sum_w pairs[w] . x_pairs[w] per int32 lane: each lane's int16 pairs against one pair of x's sums, broadcast.
template <int W>
inline __m256i pair_dots(const __m256i (&pairs)[W], const int32_t* x_pairs) {
  __m256i total = _mm256_madd_epi16(pairs[0], _mm256_set1_epi32(x_pairs[0]));
  for (int w = 1; w < W; ++w)
    total = _mm256_add_epi32(total, _mm256_madd_epi16(pairs[w], _mm256_set1_epi32(x_pairs[w])));
  return total;
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, 4);
  return _mm256_set1_epi32(word);
}

// Every block of one row group against MR activation rows (x rows m0...), into acc (lane r: row r of the group).
template <int MR>
void dot_row_group(const uint8_t* group, const Int8Rows& x, int64_t m0, const std::vector<int32_t>* sum_pairs,
                   __m256* acc) {
  constexpr int64_t kColumnBytes = kGroupRows * Format<kQ4_K>::kBytes;
  using Words = uint32_t __attribute__((vector_size(32)));  // eight rows' 32-bit words, for k_scale_min_words
  const __m256i byte0 = _mm256_set1_epi32(0xFF), bytes02 = _mm256_set1_epi32(0x00FF00FF);
  for (int64_t b = 0; b < x.K / 256; ++b) {
    const uint8_t* column = group + b * kColumnBytes;
    carpool::simd::prefetch(column + kGemvPrefetchBytes, kColumnBytes);
    const __m256 d =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(column + group_half_offset(0, 0))));
    const __m256 negdmin = _mm256_xor_ps(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(column + group_half_offset(1, 0)))),
        _mm256_set1_ps(-0.0f));
    Words scale_words[2], min_words[2];
    const auto scale_word = [&](int64_t t) {
      return reinterpret_cast<Words>(load256(column + group_word_offset<kQ4_K>(t, 0)));
    };
    k_scale_min_words(scale_word(0), scale_word(1), scale_word(2), scale_words, min_words);
    const __m256i scales[2] = {reinterpret_cast<__m256i>(scale_words[0]), reinterpret_cast<__m256i>(scale_words[1])};
    const __m256i mins[2] = {reinterpret_cast<__m256i>(min_words[0]), reinterpret_cast<__m256i>(min_words[1])};
    __m256i isum[MR];
    for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c and 2c + 1: bytes 2c % 4 and 2c % 4 + 1 of scales[c / 2]
      const __m256i s_lo = _mm256_and_si256(_mm256_srli_epi32(scales[c / 2], 16 * (c % 2)), byte0);
      const __m256i s_hi = _mm256_and_si256(_mm256_srli_epi32(scales[c / 2], 16 * (c % 2) + 8), byte0);
      __m256i dots[MR][2];
      for (int i = 0; i < MR; ++i) dots[i][0] = dots[i][1] = _mm256_setzero_si256();
      for (int k = 0; k < 8; ++k) {
        const __m256i raw = load256(column + group_word_offset<kQ4_K>(3 + 8 * c + k, 0));
        const __m256i lo = _mm256_and_si256(raw, bytes(0x0F));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), bytes(0x0F));
        for (int i = 0; i < MR; ++i) {
          const int8_t* values = x.q_row(m0 + i) + 256 * b + 64 * c + 4 * k;
#ifdef CARPOOL_VNNI256
          dots[i][0] = dpbusd256(dots[i][0], lo, broadcast4(values));
          dots[i][1] = dpbusd256(dots[i][1], hi, broadcast4(values + 32));
#else  // int16 pair sums, added over the sub-block: at most 8 x 2 x 15 x 127 = 30480, no saturation
          dots[i][0] = _mm256_add_epi16(dots[i][0], _mm256_maddubs_epi16(lo, broadcast4(values)));
          dots[i][1] = _mm256_add_epi16(dots[i][1], _mm256_maddubs_epi16(hi, broadcast4(values + 32)));
#endif
        }
      }
#ifdef CARPOOL_VNNI256
      for (int i = 0; i < MR; ++i)
        isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(_mm256_mullo_epi32(dots[i][0], s_lo),
                                                             _mm256_mullo_epi32(dots[i][1], s_hi)));
#else  // the scale in both int16 halves of each row's lane: vpmaddwd sums the pair and scales it at once
      const __m256i s_lo16 = _mm256_or_si256(s_lo, _mm256_slli_epi32(s_lo, 16));
      const __m256i s_hi16 = _mm256_or_si256(s_hi, _mm256_slli_epi32(s_hi, 16));
      for (int i = 0; i < MR; ++i)
        isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(_mm256_madd_epi16(dots[i][0], s_lo16),
                                                             _mm256_madd_epi16(dots[i][1], s_hi16)));
#endif
    }
    // minimums j and j + 2 as int16 pairs of each row's lane, against x's pairs of sub-block sums
    const __m256i min_pairs[4] = {
        _mm256_and_si256(mins[0], bytes02), _mm256_and_si256(_mm256_srli_epi32(mins[0], 8), bytes02),
        _mm256_and_si256(mins[1], bytes02), _mm256_and_si256(_mm256_srli_epi32(mins[1], 8), bytes02)};
    for (int i = 0; i < MR; ++i) {
      const __m256i min_sum = pair_dots(min_pairs, sum_pairs[i].data() + 4 * b);
      // block_step_with_mins in every row's lane
      const __m256 terms = _mm256_fmadd_ps(_mm256_cvtepi32_ps(min_sum), negdmin, _mm256_mul_ps(_mm256_cvtepi32_ps(isum[i]), d));
      acc[i] = _mm256_fmadd_ps(terms, _mm256_set1_ps(x.d_row(m0 + i)[b]), acc[i]);
    }
  }
}

// ---- Q6_K row groups: the same scheme. In half h of a block (128 weights), low word l (l < 8) with low word 8 + l
// and high word l (GGUF's words 16 h + l, 16 h + 8 + l, 32 + 8 h + l) make the six-bit weights at positions 4 l + (0
// to 3) + 32 j, j = 0 to 3 (llama.cpp's order), sub-block 2 j + l / 4 of the half. The int8 scales are words 48 to 51
// (sub-block s: byte s % 4 of word 48 + s / 4), sign-extended in each row's lane. The q - 32 offset costs 32 sum_s
// sc_s sum_s(q_x) a block, from int16 pairs of scales against pairs of x's sums. The 1.5B's Q6_K, Zen 4, from memory,
// one row: the LM head 1.63x its GGUF rows' GEMV on one thread, 1.89x on two (39 GB/s); ffn_down 1.41-1.49x; four rows
// 1.59-1.64x; the decode step 36.1 -> 32.3 ms (1.12x; docs/benchmarks.md).

template <int MR>
void dot_q6_k_row_group(const uint8_t* group, const Int8Rows& x, int64_t m0, const std::vector<int32_t>* sum_pairs,
                        __m256* acc) {
  constexpr int64_t kColumnBytes = kGroupRows * Format<kQ6_K>::kBytes;
  const auto word = [](const uint8_t* column, int64_t t) { return load256(column + group_word_offset<kQ6_K>(t, 0)); };
  for (int64_t b = 0; b < x.K / 256; ++b) {
    const uint8_t* column = group + b * kColumnBytes;
    carpool::simd::prefetch(column + kGemvPrefetchBytes, kColumnBytes);
    const __m256 d =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(column + group_half_offset(0, 0))));
    const __m256i scale_words[4] = {word(column, 48), word(column, 49), word(column, 50), word(column, 51)};
    __m256i scale[16];  // sub-block s's scale in every row's lane
    for (int sub = 0; sub < 16; ++sub) {
      scale[sub] = q6_k_group_scale(scale_words, sub);
#ifndef CARPOOL_VNNI256
      scale[sub] = int16_in_both_halves(scale[sub]);  // for vpmaddwd
#endif
    }
    __m256i isum[MR];
    for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h)
      for (int half_sub = 0; half_sub < 2; ++half_sub) {  // low words 4 half_sub + (0-3); sub-blocks 8 h + 2 j + it
        const __m256i* sub_scale = scale + 8 * h + half_sub;  // sub_scale[2 j]
        __m256i dots[MR][4];
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < 4; ++j) dots[i][j] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const int l = 4 * half_sub + k;
          const __m256i low0 = word(column, 16 * h + l), low1 = word(column, 16 * h + 8 + l);
          const __m256i high = word(column, 32 + 8 * h + l);
          __m256i q[4];
          q6_k_weights(low0, low1, high, q);
          for (int i = 0; i < MR; ++i) {
            const int8_t* values = x.q_row(m0 + i) + 256 * b + 128 * h + 4 * l;
            for (int j = 0; j < 4; ++j)
#ifdef CARPOOL_VNNI256
              dots[i][j] = dpbusd256(dots[i][j], q[j], broadcast4(values + 32 * j));
#else  // int16 pair sums over two positions at most: 2 x 2 x 63 x 127 = 32004, no saturation
              dots[i][j] = _mm256_add_epi16(dots[i][j], _mm256_maddubs_epi16(q[j], broadcast4(values + 32 * j)));
#endif
          }
#ifndef CARPOOL_VNNI256
          if (k % 2 == 1)
            for (int i = 0; i < MR; ++i)
              for (int j = 0; j < 4; ++j) {
                isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(dots[i][j], sub_scale[2 * j]));
                dots[i][j] = _mm256_setzero_si256();
              }
#endif
        }
#ifdef CARPOOL_VNNI256
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < 4; ++j)
            isum[i] = _mm256_add_epi32(isum[i], _mm256_mullo_epi32(dots[i][j], sub_scale[2 * j]));
#endif
      }
    // scales s and s + 2 as int16 pairs of each row's lane (bytes 0 and 2, then 1 and 3, of a word), against x's
    // pairs of sums (subblock_sum_pairs' order)
    __m256i scale_pairs[8];
    for (int w = 0; w < 4; ++w) {
      scale_pairs[2 * w] = _mm256_srai_epi16(_mm256_slli_epi16(scale_words[w], 8), 8);
      scale_pairs[2 * w + 1] = _mm256_srai_epi16(scale_words[w], 8);
    }
    for (int i = 0; i < MR; ++i) {
      const __m256i offset = pair_dots(scale_pairs, sum_pairs[i].data() + 8 * b);
      const __m256i total = _mm256_sub_epi32(isum[i], _mm256_slli_epi32(offset, 5));  // block_step in every lane
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(x.d_row(m0 + i)[b])), d, acc[i]);
    }
  }
}

// Weight rows [first, last) of Q4_K or Q6_K row groups against every activation row. A range that splits a group
// (callers split a projection's rows in whole groups where they can) computes the whole group and stores its own rows.
template <int64_t QT, typename Y>
void int8_dot_row_groups(const Int8Rows& x, const uint8_t* weight, int64_t first, int64_t last, Y* y, int64_t ldy) {
  const int64_t group_bytes = kGroupRows * x.K / 256 * Format<QT>::kBytes, M = x.M;
  std::vector<std::vector<int32_t>> sum_pairs(M);
  for (int64_t m = 0; m < M; ++m) sum_pairs[m] = subblock_sum_pairs(x, m, QT == kQ4_K ? 32 : 16);
  for (int64_t g = first / kGroupRows; g * kGroupRows < last; ++g) {
    const uint8_t* group = weight + g * group_bytes;
    for (int64_t m = 0; m < M; m += kGemvPassRows) {  // a second pass finds the group's weights in cache
      const int64_t mr = std::min(kGemvPassRows, M - m);
      __m256 acc[kGemvPassRows];
      for (auto& a : acc) a = _mm256_setzero_ps();
      const auto dot = [&]<int MR>() {
        if constexpr (QT == kQ4_K)
          dot_row_group<MR>(group, x, m, sum_pairs.data() + m, acc);
        else
          dot_q6_k_row_group<MR>(group, x, m, sum_pairs.data() + m, acc);
      };
      switch (mr) {
        case 1: dot.template operator()<1>(); break;
        case 2: dot.template operator()<2>(); break;
        case 3: dot.template operator()<3>(); break;
        default: dot.template operator()<4>(); break;
      }
      alignas(32) float out[kGroupRows];
      for (int64_t i = 0; i < mr; ++i) {
        _mm256_store_ps(out, acc[i]);
        for (int64_t n = std::max(first, g * kGroupRows); n < std::min(last, g * kGroupRows + kGroupRows); ++n)
          y[(m + i) * ldy + n] = Y(out[n % kGroupRows]);
      }
    }
  }
}

#else  // portable: the same integer sums in plain loops

// One block's weights as integers (before the offsets of Q4_0/Q5_0/Q6_K) and its per-sub-block integer scales.
template <int64_t QT>
void dot_block_rows_scalar(const uint8_t* p, const Int8Rows& x, int64_t m, int64_t b, float& acc) {
  const int64_t k0 = b * Format<QT>::kWeights;
  const int8_t* xq = x.q_row(m) + k0;
  const float xd = x.d_row(m)[b];
  const int16_t* sums = x.sums_row(m) + k0 / 16;
  if constexpr (QT == kQ8_0 || QT == kQ4_0 || QT == kQ5_0 || QT == kQ4_1) {
    int w[32];
    if constexpr (QT == kQ8_0) {
      for (int i = 0; i < 32; ++i) w[i] = static_cast<int8_t>(p[2 + i]);
    } else {
      const uint8_t* nibbles = p + (QT == kQ5_0 ? 6 : QT == kQ4_1 ? 4 : 2);
      uint32_t high = 0;
      if constexpr (QT == kQ5_0) std::memcpy(&high, p + 2, 4);
      const int offset = QT == kQ4_0 ? 8 : QT == kQ5_0 ? 16 : 0;
      for (int i = 0; i < 16; ++i) {
        w[i] = (nibbles[i] & 0x0F) + static_cast<int>((high >> i) & 1) * 16 - offset;
        w[i + 16] = (nibbles[i] >> 4) + static_cast<int>((high >> (i + 16)) & 1) * 16 - offset;
      }
    }
    int dot = 0;
    for (int i = 0; i < 32; ++i) dot += w[i] * xq[i];
    acc += half_to_float(p) * xd * static_cast<float>(dot);
    if constexpr (QT == kQ4_1) acc += half_to_float(p + 2) * (xd * static_cast<float>(sums[0] + sums[1]));
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    uint64_t scales, mins;
    k_scales_mins_packed(p + 4, scales, mins);
    const uint8_t* qs = p + (QT == kQ5_K ? 48 : 16);
    int total = 0, min_total = 0;
    for (int j = 0; j < 8; ++j) {
      int dot = 0;
      for (int i = 0; i < 32; ++i) {
        int q = j % 2 ? qs[32 * (j / 2) + i] >> 4 : qs[32 * (j / 2) + i] & 0x0F;
        if constexpr (QT == kQ5_K) q += ((p[16 + i] >> j) & 1) * 16;
        dot += q * xq[32 * j + i];
      }
      total += static_cast<int>((scales >> 8 * j) & 0xFF) * dot;
      min_total += static_cast<int>((mins >> 8 * j) & 0xFF) * (sums[2 * j] + sums[2 * j + 1]);
    }
    acc += half_to_float(p) * xd * static_cast<float>(total);
    acc -= half_to_float(p + 2) * xd * static_cast<float>(min_total);
  } else if constexpr (QT == kQ6_K) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
    int total = 0, offset = 0;
    for (int s = 0; s < 16; ++s) offset += scales[s] * sums[s];
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k)
        for (int half = 0; half < 2; ++half) {
          int dot = 0;
          for (int l = 16 * half; l < 16 * half + 16; ++l) {
            const uint8_t low = p[64 * h + 32 * (k % 2) + l], high = p[128 + 32 * h + l];
            const int q = (k < 2 ? low & 0x0F : low >> 4) | (((high >> (2 * k)) & 3) << 4);
            dot += q * xq[128 * h + 32 * k + l];
          }
          total += scales[8 * h + 2 * k + half] * dot;
        }
    const float scale = half_to_float(p + 208) * xd;
    acc += scale * static_cast<float>(total);
    acc -= scale * static_cast<float>(32 * offset);
  } else {
    static_assert(QT != QT, "not a GGML kernel type");
  }
}

template <int64_t QT, int MR, Layout kLayout>
void dot_block_rows(const uint8_t* row, const Int8Rows& x, int64_t m0, float* out) {
  GgufBlocks<QT> blocks(row, x.K, kLayout);
  for (int i = 0; i < MR; ++i) {
    float acc = 0.0f;
    for (int64_t b = 0; b < x.K / Format<QT>::kWeights; ++b) dot_block_rows_scalar<QT>(blocks[b], x, m0 + i, b, acc);
    out[i] = acc;
  }
}

#endif

#ifdef CARPOOL_SIMD
// Weight rows [first, last) of a 32-weight format against every activation row: eight weight rows at a time, up to
// kGemvPassRows activation rows a pass (block_terms, then combine_columns per activation row).
template <int64_t QT, Layout kLayout, typename Y>
void int8_dot_rows_by_eight(const Int8Rows& x, const uint8_t* weight, int64_t first, int64_t last, Y* y,
                            int64_t ldy) {
  const int64_t row_bytes = gguf_row_bytes<QT>(x.K), M = x.M, blocks = x.K / 32;
  const int64_t octets = octet_blocks<QT>(blocks), tail = blocks - octets;
  RowReader<QT> rows(weight, row_bytes, kLayout);
  // Per pass row: the octets' terms [weight row of the eight][block], then the tail's [block][weight row]. Lanes past
  // a partial eight add whatever an earlier eight left (finite) and are never stored.
  std::vector<float> terms(kGemvPassRows * 8 * blocks, 0.0f);
  for (int64_t n = first; n < last; n += 8) {
    const int64_t columns = std::min<int64_t>(8, last - n);
    for (int64_t m = 0; m < M; m += kGemvPassRows) {
      const int64_t mr = std::min(kGemvPassRows, M - m);
      for (int64_t c = 0; c < columns; ++c) {
        const uint8_t* row = rows(n + c);
        if (m == 0) carpool::simd::prefetch(row + kGemvPrefetchBytes, row_bytes);
        float *t[kGemvPassRows], *tails[kGemvPassRows];
        for (int64_t i = 0; i < kGemvPassRows; ++i) {
          t[i] = terms.data() + i * 8 * blocks + c * octets;
          tails[i] = terms.data() + i * 8 * blocks + 8 * octets + c;
        }
        switch (mr) {
          case 1: block_terms<QT, 1, kLayout>(row, x, m, t, tails); break;
          case 2: block_terms<QT, 2, kLayout>(row, x, m, t, tails); break;
          case 3: block_terms<QT, 3, kLayout>(row, x, m, t, tails); break;
          default: block_terms<QT, 4, kLayout>(row, x, m, t, tails); break;
        }
      }
      for (int64_t i = 0; i < mr; ++i) {
        alignas(32) float out[8];
        const float* own = terms.data() + i * 8 * blocks;
        combine_columns(own, octets, own + 8 * octets, tail, out);
        for (int64_t c = 0; c < columns; ++c) y[(m + i) * ldy + n + c] = Y(out[c]);
      }
    }
  }
}
#endif

// Weight rows [first, last) against every activation row, one weight row at a time, up to kGemvPassRows activation
// rows per unpacked block.
template <int64_t QT, Layout kLayout, typename Y>
void int8_dot_rows_each(const Int8Rows& x, const uint8_t* weight, int64_t first, int64_t last, Y* y, int64_t ldy) {
  const int64_t row_bytes = gguf_row_bytes<QT>(x.K), M = x.M;
  RowReader<QT> rows(weight, row_bytes, kLayout);  // row groups: the portable build's
  float out[kGemvPassRows];
  for (int64_t n = first; n < last; ++n) {
    const uint8_t* row = rows(n);
#ifdef CARPOOL_SIMD
    carpool::simd::prefetch(row + kGemvPrefetchBytes, row_bytes);
#endif
    for (int64_t m = 0; m < M; m += kGemvPassRows) {
      const int64_t mr = std::min(kGemvPassRows, M - m);
      switch (mr) {
        case 1: dot_block_rows<QT, 1, kLayout>(row, x, m, out); break;
        case 2: dot_block_rows<QT, 2, kLayout>(row, x, m, out); break;
        case 3: dot_block_rows<QT, 3, kLayout>(row, x, m, out); break;
        default: dot_block_rows<QT, 4, kLayout>(row, x, m, out); break;
      }
      for (int64_t i = 0; i < mr; ++i) y[(m + i) * ldy + n] = Y(out[i]);
    }
  }
}

// Weight rows [first, last) against every activation row: the 32-weight formats eight weight rows at a time where
// the build has SIMD, the rest one at a time.
template <int64_t QT, Layout kLayout, typename Y>
void int8_dot_rows(const Int8Rows& x, const uint8_t* weight, int64_t first, int64_t last, Y* y, int64_t ldy) {
#ifdef CARPOOL_SIMD
  if constexpr (Format<QT>::kWeights == 32)
    int8_dot_rows_by_eight<QT, kLayout>(x, weight, first, last, y, ldy);
  else
#endif
    int8_dot_rows_each<QT, kLayout>(x, weight, first, last, y, ldy);
}

int64_t set_matmul_mode(int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "matmul: mode must be 0 (exact), 1 (int8-dot) or 2 (int8-dot-all), got ", mode);
  const int64_t previous = static_cast<int64_t>(current_mode);
  current_mode = static_cast<MatmulMode>(mode);
  return previous;
}

int64_t get_matmul_mode() { return static_cast<int64_t>(current_mode); }

// Rows up to which int8-dot mode runs the integer kernels, per format, in this build (1 thread, 8960x1536 and
// 1536x8960, docs/benchmarks.md). AVX-512: the batched kernel against the exact bf16 path is 1.3-2.2x at 8-64 rows
// for the K-quants, 1.0-1.3x at 8-64 for Q5_0 and Q8_0 and 0.9x at 8 / 1.3x at 16-64 for Q4_1. The K-quants keep
// their lead at prompt sizes (1.36-1.61x at 128 and 512 rows, all three, both shapes; a 512-token prefill of
// Qwen2.5-Coder-1.5B Q4_K_M 1.26x end to end), so they take every row; the 32-weight formats do not end to end
// (SmolLM2's Q4_1 prefill 0.89x: widening and quantizing 576-wide bf16 rows costs what the dots save). AVX2 (the
// exact path runs fp32 FMAs there): 1.5-2.0x at 8-64 rows, Q8_0 (|w| against signed x) 1.4-1.7x. The portable build
// keeps 4 rows (one GEMV pass).
//
// AMX (the exact path on tiles, amx_gemm.h) costs about the same from 8 to 32 rows, its weights' dequantization
// (8960x1536 at 2 threads: 1.1-1.5 ms), while the batched int8 kernel's cost doubles past 16 rows, its second
// vector of rows (Q4_K 0.99 ms at 16, 1.84 at 20): the K-quants and Q5_0 stay int8 up to 16 rows, Q4_0, Q4_1 and
// Q8_0 (whose int8 kernels lose to the tiles from 12 rows) up to 8, and larger batches and prompts run exact.
constexpr int64_t default_max_rows([[maybe_unused]] int64_t qtype) {
#if defined(CARPOOL_AMX)
  return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0 ? 8 : 16;
#elif defined(CARPOOL_AVX512)
  return qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K ? kEveryRow : kInt8GemmMaxRows;
#elif defined(CARPOOL_AVX2)
  return kInt8GemmMaxRows;
#else
  return kGemvPassRows;
#endif
}

struct RowLimits {
  std::atomic<int64_t> rows[kQ6_K + 1];
  RowLimits() {
    for (int64_t qtype = 0; qtype <= kQ6_K; ++qtype) rows[qtype] = default_max_rows(qtype);
  }
};

std::atomic<int64_t>& max_rows(int64_t qtype) {
  qtype = row_format(qtype).qtype;
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0 || qtype == kQ8_0 || qtype == kQ4_K ||
                  qtype == kQ5_K || qtype == kQ6_K,
              "qtype: unsupported GGML type ", qtype);
  static RowLimits limits;
  return limits.rows[qtype];
}

int64_t set_int8_dot_max_rows(int64_t qtype, int64_t rows) {
  TORCH_CHECK(rows >= 0, "rows: must be >= 0, got ", rows);
  return max_rows(qtype).exchange(rows);
}

}  // namespace

MatmulMode matmul_mode() { return current_mode; }

int64_t int8_dot_max_rows(int64_t qtype) { return max_rows(qtype).load(std::memory_order_relaxed); }

bool int8_dot_applies(int64_t qtype, int64_t M) {
  return current_mode == MatmulMode::kInt8DotAll || (current_mode == MatmulMode::kInt8Dot && M <= int8_dot_max_rows(qtype));
}

int64_t int8_gemv_max_rows(int64_t qtype) {
  return row_format(qtype).layout == Layout::kRowGroups ? kRowGroupGemvMaxRows : kInt8GemvMaxRows;
}

int64_t block_weights(int64_t qtype) {
  int64_t weights = 0;
  dispatch_qtype(row_format(qtype).qtype, [&]<int64_t QT>() { weights = Format<QT>::kWeights; });
  return weights;
}

float quantize_int8(const float* x, int64_t n, int8_t* q) {
#ifdef CARPOOL_SIMD
  // 8 lanes at a time (a 32-value block is 4 loads): the batched kernel's scalar loop took ~23 cycles a value on
  // Zen 3, 20% of a 32-row call of a 8960-wide down projection.
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax8 = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) amax8 = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), magnitude), amax8);
  __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(amax4, _mm_movehdup_ps(amax4)));
  const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
  const __m256 scale = _mm256_set1_ps(inverse);
  // cvtps rounds half to even (the default MXCSR mode, as nearbyint); the packs interleave 4-value groups per
  // 128-bit lane, which the permute puts back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < n; i += 32) {
    __m256i v[4];
    for (int j = 0; j < 4; ++j) v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), scale));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permutevar8x32_epi32(packed, order));
  }
  return d;
#else
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inverse));
  return d;
#endif
}

// Symmetric int8 per `block` values: d = max|x| / 127, q = round-half-even(x * (1 / d)) (0 where the block is 0).
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t block, Int8Rows& out) {
  out.M = M;
  out.K = K;
  out.block = block;
  out.blocks_per_row = K / block;
  out.q.resize(M * K);
  out.d.resize(M * K / block);
  out.sums.resize(M * K / 16);
  for (int64_t b = 0; b < M * K / block; ++b) out.d[b] = quantize_int8(x + b * block, block, out.q.data() + b * block);
  for (int64_t s = 0; s < M * K / 16; ++s) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) sum += out.q[s * 16 + i];
    out.sums[s] = static_cast<int16_t>(sum);
  }
  out.block_sums.assign(M * K / block, 0);
  for (int64_t s = 0; s < M * K / 16; ++s) out.block_sums[s * 16 / block] += out.sums[s];
  if (!kPairedOctets || block != 32) return;
  // Per 256 values, pair k (k < 4): x_k[0:16] x_{k+4}[0:16] x_k[16:32] x_{k+4}[16:32] (x_j: the 32 values of block j).
  const int64_t octet_values = K / 256 * 256;
  out.q_octets.resize(M * octet_values);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t v = 0; v < octet_values; v += 256)
      for (int k = 0; k < 4; ++k)
        for (int quarter = 0; quarter < 4; ++quarter) {  // which block (k, k + 4) and which half of it
          const int8_t* from = out.q.data() + m * K + v + 32 * (k + 4 * (quarter % 2)) + 16 * (quarter / 2);
          std::memcpy(out.q_octets.data() + m * octet_values + v + 64 * k + 16 * quarter, from, 16);
        }
}

template <typename Y>
void int8_gemv_rows(const Int8Rows& x, const uint8_t* weight, int64_t qtype, int64_t first, int64_t last, Y* y,
                    int64_t ldy) {
  const RowFormat format = row_format(qtype);
  dispatch_qtype(format.qtype, [&]<int64_t QT>() {
    if constexpr (kHasOctetMajor<QT>)
      if (format.layout == Layout::kOctetMajor)
        return int8_dot_rows<QT, Layout::kOctetMajor>(x, weight, first, last, y, ldy);
    if constexpr (kHasRowGroups<QT>) {
      if (format.layout == Layout::kRowGroups) {
#ifdef CARPOOL_SIMD
        return int8_dot_row_groups<QT>(x, weight, first, last, y, ldy);
#else
        return int8_dot_rows<QT, Layout::kRowGroups>(x, weight, first, last, y, ldy);
#endif
      }
    }
    int8_dot_rows<QT, Layout::kGguf>(x, weight, first, last, y, ldy);
  });
}
template void int8_gemv_rows<float>(const Int8Rows&, const uint8_t*, int64_t, int64_t, int64_t, float*, int64_t);
template void int8_gemv_rows<c10::BFloat16>(const Int8Rows&, const uint8_t*, int64_t, int64_t, int64_t,
                                            c10::BFloat16*, int64_t);

at::Tensor int8_dot_linear(const at::Tensor& x, const uint8_t* weight, int64_t qtype, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  // The batched kernel quantizes a bf16 x as it is (a float copy first was 1.3% of a 32-sequence step of the 1.5B).
  const at::Tensor rows = x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kFloat).contiguous();
  if (M > int8_gemv_max_rows(qtype) && int8_gemm_linear(rows, weight, qtype, N, y)) return y;
  const at::Tensor wide = rows.to(at::kFloat);
  Int8Rows q;
  quantize_rows(wide.data_ptr<float>(), M, K, block_weights(qtype), q);
  // Each thread streams its share of the weights, and takes on what a slower one has not started (WorkShares), in
  // units of whole row groups.
  constexpr int64_t unit = 2 * kGroupRows;
  const int threads = at::get_num_threads();
  carpool::kernels::WorkShares shares(threads);
  shares.reset((N + unit - 1) / unit, threads, unit * gguf_row_bytes(row_format(qtype).qtype, K));
  at::parallel_for(0, threads, 1, [&](int64_t first_thread, int64_t last_thread) {
    for (int64_t tid = first_thread; tid < last_thread; ++tid)  // all of them on one thread in a parallel region
      shares.run(static_cast<int>(tid), [&](int64_t first, int64_t last) {
        if (x.scalar_type() == at::kFloat)
          int8_gemv_rows(q, weight, qtype, first * unit, std::min(N, last * unit), y.data_ptr<float>(), N);
        else
          int8_gemv_rows(q, weight, qtype, first * unit, std::min(N, last * unit), y.data_ptr<c10::BFloat16>(), N);
      });
  });
  return y;
}

}  // namespace carpool::ggml

TORCH_LIBRARY_FRAGMENT(carpool, m) {
  m.def("set_matmul_mode(int mode) -> int", &carpool::ggml::set_matmul_mode);
  m.def("get_matmul_mode() -> int", &carpool::ggml::get_matmul_mode);
  m.def("int8_dot_max_rows(int qtype) -> int", &carpool::ggml::int8_dot_max_rows);
  m.def("set_int8_dot_max_rows(int qtype, int rows) -> int", &carpool::ggml::set_int8_dot_max_rows);
}
