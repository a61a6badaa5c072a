// 16-lane fp32 loads and stores of float or bf16 data, for the kernels' AVX-512 paths. Built with -march=native:
// on a CPU without AVX-512 (and its bf16 conversions) CARPOOL_AVX512 is undefined and kernels use their scalar loops.
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>

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
#endif
