// Vectorised row helpers for the CPU kernels: max, sum of exp(x - m), y = s * exp(x - m). With AVX-512 the
// exponential is a Cephes-style range reduction + degree-7 polynomial (about 1 ulp, exp(-inf) = 0); without
// it the loops call std::exp. Used by softmax-like kernels (attention, cross-entropy) whose scalar expf calls
// otherwise cost as much as their GEMMs.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
// GCC 12 reports the undefined temporaries inside the AVX-512 intrinsics (_mm512_max_ps, ...) as
// -Wmaybe-uninitialized; the pragma covers the intrinsic headers' lines when they are first included here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif

namespace titan::vec {

#if defined(__AVX512F__)
inline __m512 exp_ps(__m512 x) {
  // exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n ln2 in [-ln2/2, ln2/2].
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7228f)), _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_maskz_roundscale_ps(0xFFFF, _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(0xFFFF, p, n);  // exact 2^n scaling, underflows to 0 below the float range
}

// Horizontal reductions by hand, and maskz_ forms of the intrinsics: GCC 12 warns about the undefined
// temporaries of the plain forms (-Wmaybe-uninitialized).
inline float hmax(__m512 v) {
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  float m = t[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, t[i]);
  return m;
}
inline float hsum(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_maskz_extractf32x8_ps(0xFF, v, 1));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  alignas(16) float t[4];
  _mm_store_ps(t, b);
  return (t[0] + t[1]) + (t[2] + t[3]);
}

inline float max(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
  if (i < n) {
    const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
    m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, x + i));
  }
  return hmax(m);
}

// sum_i exp(x[i] - m)
inline float sum_exp(const float* x, int64_t n, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 s = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) s = _mm512_add_ps(s, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm)));
  if (i < n) {
    const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
    s = _mm512_mask_add_ps(s, k, s, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm)));
  }
  return hsum(s);
}

// y[i] = scale * exp(x[i] - m) (y may be x); returns sum_i exp(x[i] - m)
inline float exp_scale(float* y, const float* x, int64_t n, float m, float scale) {
  const __m512 vm = _mm512_set1_ps(m), vs = _mm512_set1_ps(scale);
  __m512 s = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
    s = _mm512_add_ps(s, e);
    _mm512_storeu_ps(y + i, _mm512_mul_ps(e, vs));
  }
  if (i < n) {
    const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm));
    s = _mm512_mask_add_ps(s, k, s, e);
    _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(e, vs));
  }
  return hsum(s);
}
#else
inline float max(const float* x, int64_t n) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}
inline float sum_exp(const float* x, int64_t n, float m) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += std::exp(x[i] - m);
  return s;
}
inline float exp_scale(float* y, const float* x, int64_t n, float m, float scale) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float e = std::exp(x[i] - m);
    s += e;
    y[i] = scale * e;
  }
  return s;
}
#endif

}  // namespace titan::vec

#if defined(__AVX512F__)
#pragma GCC diagnostic pop
#endif
