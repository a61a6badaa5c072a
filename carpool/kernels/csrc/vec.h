// 16-lane fp32 loads and stores of float or bf16 data, for the kernels' AVX-512 paths. Built with -march=native:
// on a CPU without AVX-512 (and its bf16 conversions) CARPOOL_AVX512 is undefined and kernels use their scalar loops.
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__F16C__)
#include <immintrin.h>
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
  alignas(64) c10::BFloat16 tmp[16];
  store16(tmp, v);
  return load16(tmp);
}

}  // namespace carpool
#endif
