// Vector loads and stores of float or bf16 data (arithmetic in fp32 lanes) for the kernels' intrinsics paths.
// setup.py compiles every kernel once per ISA path, so which of these exist depends on the build:
//   CARPOOL_AVX512  16 lanes (-march=x86-64-v4 + AVX512-BF16): bf16 rounding in one instruction;
//   CARPOOL_AVX2     8 lanes (-march=x86-64-v3: AVX2, FMA, F16C): bf16 rounding in integer arithmetic (the avx2
//                    and avxvnni builds);
//   neither          the portable build: kernels use their scalar loops.
// carpool::simd names whichever of the first two is built, so a kernel written once against it runs on both.
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
namespace carpool {

// Four horizontal sums at once: [sum(a), sum(b), sum(c), sum(d)].
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

}  // namespace carpool
#endif

#if defined(__AVX2__)
namespace carpool {

// Four horizontal sums at once, 8 lanes each: [sum(a), sum(b), sum(c), sum(d)].
inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // per 128-bit half
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

inline float reduce_add(__m256 v) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// fp32 -> bf16 bits in each 32-bit lane exactly as c10::BFloat16 rounds: add 0x7FFF plus the kept part's lowest
// bit (round to nearest, ties to even), keep the high half; any NaN becomes 0x7FC0.
inline __m256i bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

}  // namespace carpool
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__F16C__)
#define CARPOOL_AVX512 1

namespace carpool {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  const __m256bh packed = _mm512_cvtneps_pbh(v);  // round to nearest even, as c10::BFloat16
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<const __m256i&>(packed));
}
// Round to T and back: a value as torch would have stored it between two ops.
inline __m512 round_to(float*, __m512 v) { return v; }
inline __m512 round_to(c10::BFloat16*, __m512 v) {
  const __m256bh packed = _mm512_cvtneps_pbh(v);
  const __m512i wide = _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(packed));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

}  // namespace carpool

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CARPOOL_AVX2 1

namespace carpool {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = bf16_bits(v);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline __m256 round_to(float*, __m256 v) { return v; }
inline __m256 round_to(c10::BFloat16*, __m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }

}  // namespace carpool
#endif

// 256-bit integer dot products summed into int32 lanes: AVX512-VNNI's (EVEX, with AVX512-VL) or, in the avxvnni
// build (avx2's flags and -mavxvnni: Intel client chips from Alder Lake on, Sierra Forest), AVX-VNNI's (VEX).
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define CARPOOL_VNNI256 1
namespace carpool {
// dpbusd256: acc + sums of four u8 x s8 products per int32 lane; dpwssd256: of two int16 x int16 products.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
inline __m256i dpwssd256(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
#else
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
inline __m256i dpwssd256(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
#endif
}  // namespace carpool
#endif

// The amx build (avx512's flags and -mamx-tile -mamx-bf16): CARPOOL_AVX512 and the tile kernels (amx_gemm.h).
#if defined(CARPOOL_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define CARPOOL_AMX 1
#endif

#if defined(CARPOOL_AVX512) || defined(CARPOOL_AVX2)
#define CARPOOL_SIMD 1
#include <sleef.h>  // torch's own vector exp (libtorch_cpu exports it): what torch's kernels compute, to the bit

// The built path's lanes under one set of names. Kernels use them with `kLanes`-sized steps.
namespace carpool::simd {

#if defined(CARPOOL_AVX512)
using Vec = __m512;
constexpr int kLanes = 16;
template <typename T> inline Vec load(const T* p) { return load16(p); }
template <typename T> inline void store(T* p, Vec v) { store16(p, v); }
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float reduce_add(Vec v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec exp(Vec v) { return Sleef_expf16_u10(v); }
#else
using Vec = __m256;
constexpr int kLanes = 8;
template <typename T> inline Vec load(const T* p) { return load8(p); }
template <typename T> inline void store(T* p, Vec v) { store8(p, v); }
inline Vec set1(float x) { return _mm256_set1_ps(x); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float reduce_add(Vec v) { return carpool::reduce_add(v); }
inline float reduce_max(Vec v) {
  const __m128 quad = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_max_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_max_ss(pair, _mm_movehdup_ps(pair)));
}
inline Vec exp(Vec v) { return Sleef_expf8_u10(v); }
#endif
using carpool::reduce4;
using carpool::round_to;
inline void store4(float* p, __m128 v) { _mm_storeu_ps(p, v); }
// Asks for the cache lines of [p, p + bytes) (a prefetch never faults, whatever the address).
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64)
    _mm_prefetch(static_cast<const char*>(p) + offset, _MM_HINT_T0);
}

// How many elements of T torch's own element-wise loops (cpu_kernel_vec) cover with vector code: two of its
// vectors (of this build's width) per step, the rest through the scalar function. Kernels that must equal torch
// to the bit (silu_mul, whose exp differs between the two) split a row the same way.
template <typename T>
constexpr int64_t torch_vector_step() { return 2 * static_cast<int64_t>(kLanes * sizeof(float) / sizeof(T)); }

}  // namespace carpool::simd
#endif
