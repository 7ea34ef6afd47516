// Vectorised row helpers for the CPU kernels: max, sum of exp(x - m), y = s * exp(x - m), sigmoid. The
// exponential is a Cephes-style range reduction + degree-7 polynomial (about 1 ulp, exp(-inf) = 0) on
// 16 lanes with AVX-512 and 8 lanes with AVX2 + FMA; without either the loops call std::exp. Which one a
// kernel gets is decided by the flags its file is compiled with: the per-ISA builds of the kernels
// (CMake's TITAN_ISA_VARIANT_SOURCES) get each. Used by softmax-like kernels (attention, cross-entropy) and
// SwiGLU, whose scalar expf calls otherwise cost as much as their GEMMs.
// Everything here has internal linkage (an anonymous namespace): the same function compiled at two ISA
// levels in two per-ISA builds must never be merged by the linker into one (an AVX-512 copy run on an AVX2
// CPU), as inline functions with external linkage would be wherever the compiler does not inline a call.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// GCC 12 reports the undefined temporaries inside the intrinsics (_mm512_max_ps, ...) as
// -Wmaybe-uninitialized; the pragma covers the intrinsic headers' lines when they are first included here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define TITAN_VEC_SIMD 1
#endif

namespace titan::vec {
namespace {

// exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n ln2 in [-ln2/2, ln2/2] (ln2 split in two for
// precision); exp(r) by a degree-7 polynomial. x is clamped to [-104, 88.72]: exp overflows to inf above
// and underflows to 0 below, as expf does.
constexpr float kExpHi = 88.7228f, kExpLo = -104.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using vf = __m512;
inline vf exp_ps(vf x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kExpHi)), _mm512_set1_ps(kExpLo));
  const vf n = _mm512_maskz_roundscale_ps(0xFFFF, _mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  vf p = _mm512_set1_ps(kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(0xFFFF, p, n);  // exact 2^n scaling, underflows to 0 below the float range
}
inline vf load(const float* x) {
  return _mm512_loadu_ps(x);
}
inline void store(float* y, vf v) {
  _mm512_storeu_ps(y, v);
}
// The first `n` < kLanes lanes; the others `fill`.
inline vf load_part(const float* x, int64_t n, float fill) {
  const __mmask16 k = (__mmask16)((1u << n) - 1);
  return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), k, x);
}
inline void store_part(float* y, vf v, int64_t n) {
  _mm512_mask_storeu_ps(y, (__mmask16)((1u << n) - 1), v);
}
// Horizontal reductions by hand: GCC 12 warns about the undefined temporaries of the reduce intrinsics.
inline float hmax(vf v) {
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  float m = t[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, t[i]);
  return m;
}
inline float hsum(vf v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_maskz_extractf32x8_ps(0xFF, v, 1));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  alignas(16) float t[4];
  _mm_store_ps(t, b);
  return (t[0] + t[1]) + (t[2] + t[3]);
}
inline vf vset(float a) {
  return _mm512_set1_ps(a);
}
inline vf vzero() {
  return _mm512_setzero_ps();
}
inline vf vmax(vf a, vf b) {
  return _mm512_max_ps(a, b);
}
inline vf vadd(vf a, vf b) {
  return _mm512_add_ps(a, b);
}
inline vf vsub(vf a, vf b) {
  return _mm512_sub_ps(a, b);
}
inline vf vmul(vf a, vf b) {
  return _mm512_mul_ps(a, b);
}
inline vf vdiv(vf a, vf b) {
  return _mm512_div_ps(a, b);
}
#elif defined(TITAN_VEC_SIMD)
constexpr int kLanes = 8;
using vf = __m256;
// AVX2 has no scalef: 2^n is built in the exponent field, in two factors 2^(n>>1) 2^(n - (n>>1)) so that
// n in [-150, 128] (the clamp's range) stays in normal floats and only the last product rounds (as scalef).
inline vf exp_ps(vf x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(kExpHi)), _mm256_set1_ps(kExpLo));
  const vf n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  vf p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const vf s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const vf s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
inline vf load(const float* x) {
  return _mm256_loadu_ps(x);
}
inline void store(float* y, vf v) {
  _mm256_storeu_ps(y, v);
}
inline __m256i lane_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf load_part(const float* x, int64_t n, float fill) {
  const __m256i m = lane_mask(n);
  return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(x, m), _mm256_castsi256_ps(m));
}
inline void store_part(float* y, vf v, int64_t n) {
  _mm256_maskstore_ps(y, lane_mask(n), v);
}
inline float hmax(vf v) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  float m = t[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, t[i]);
  return m;
}
inline float hsum(vf v) {
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  alignas(16) float t[4];
  _mm_store_ps(t, b);
  return (t[0] + t[1]) + (t[2] + t[3]);
}
inline vf vset(float a) {
  return _mm256_set1_ps(a);
}
inline vf vzero() {
  return _mm256_setzero_ps();
}
inline vf vmax(vf a, vf b) {
  return _mm256_max_ps(a, b);
}
inline vf vadd(vf a, vf b) {
  return _mm256_add_ps(a, b);
}
inline vf vsub(vf a, vf b) {
  return _mm256_sub_ps(a, b);
}
inline vf vmul(vf a, vf b) {
  return _mm256_mul_ps(a, b);
}
inline vf vdiv(vf a, vf b) {
  return _mm256_div_ps(a, b);
}
#endif

#if defined(TITAN_VEC_SIMD)
inline float max(const float* x, int64_t n) {
  vf m = vset(-INFINITY);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) m = vmax(m, load(x + i));
  if (i < n) m = vmax(m, load_part(x + i, n - i, -INFINITY));
  return hmax(m);
}

// sum_i exp(x[i] - m)
inline float sum_exp(const float* x, int64_t n, float m) {
  const vf vm = vset(m);
  vf s = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) s = vadd(s, exp_ps(vsub(load(x + i), vm)));
  if (i < n) s = vadd(s, exp_ps(vsub(load_part(x + i, n - i, -INFINITY), vm)));  // exp(-inf) = 0
  return hsum(s);
}

// y[i] = scale * exp(x[i] - m) (y may be x); returns sum_i exp(x[i] - m)
inline float exp_scale(float* y, const float* x, int64_t n, float m, float scale) {
  const vf vm = vset(m), vs = vset(scale);
  vf s = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf e = exp_ps(vsub(load(x + i), vm));
    s = vadd(s, e);
    store(y + i, vmul(e, vs));
  }
  if (i < n) {
    const vf e = exp_ps(vsub(load_part(x + i, n - i, -INFINITY), vm));
    s = vadd(s, e);
    store_part(y + i, vmul(e, vs), n - i);
  }
  return hsum(s);
}

// y[i] = 1 / (1 + exp(-x[i])) (y may be x)
inline void sigmoid(float* y, const float* x, int64_t n) {
  const vf one = vset(1.0f), zero = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(y + i, vdiv(one, vadd(one, exp_ps(vsub(zero, load(x + i))))));
  if (i < n)
    store_part(y + i, vdiv(one, vadd(one, exp_ps(vsub(zero, load_part(x + i, n - i, 0.0f))))), n - i);
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
inline void sigmoid(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = 1.0f / (1.0f + std::exp(-x[i]));
}
#endif

}  // namespace
}  // namespace titan::vec

#if defined(TITAN_VEC_SIMD)
#pragma GCC diagnostic pop
#endif
