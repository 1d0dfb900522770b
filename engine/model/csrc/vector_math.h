// Scalar maths the kernels of cpu_ops.cpp and packed_linear.cpp share, in forms the compiler
// vectorizes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// exp(x) for x <= 0 (a score minus its row's maximum), in a form the compiler vectorizes:
// 2^(x log2 e) = 2^n * 2^f with n the nearest integer and f in [-0.5, 0.5], 2^f by Cephes'
// exp2f polynomial (relative error about 2e-7). Below -87 it returns exp(-87), about 1.6e-38.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.f) * 1.44269504088896341f;
  const int32_t n = static_cast<int32_t>(t - 0.5f);  // t <= 0: truncation rounds to nearest
  const float f = t - static_cast<float>(n);
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  const int32_t bits = (n + 127) << 23;
  float power;
  std::memcpy(&power, &bits, 4);
  return p * power;
}

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes, in the same steps.
inline __m512 exp_nonpositive_ps(__m512 x) {
  const __m512 t =
      _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512i n = _mm512_cvttps_epi32(_mm512_sub_ps(t, _mm512_set1_ps(0.5f)));
  const __m512 f = _mm512_sub_ps(t, _mm512_cvtepi32_ps(n));
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive on 8 lanes, in the same steps.
inline __m256 exp_nonpositive_ps(__m256 x) {
  const __m256 t =
      _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(1.44269504088896341f));
  const __m256i n = _mm256_cvttps_epi32(_mm256_sub_ps(t, _mm256_set1_ps(0.5f)));
  const __m256 f = _mm256_sub_ps(t, _mm256_cvtepi32_ps(n));
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// The sum and the largest of 8 lanes.
inline float reduce_add_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float reduce_max_ps(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif
