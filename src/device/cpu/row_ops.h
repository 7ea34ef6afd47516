// Row loops of the fast CPU kernels that more than one op runs: RMSNorm of one row (forward, backward) and
// rotate-half RoPE of a token row's heads. The ops that share them (rmsnorm, rope_qk and the fused
// qk_norm_rope) are built from the same source at each ISA level, so a fused op made of these loops gives
// the same bits as the separate ops run one after the other. The loops with a reduction are compiled on
// their own (noipa: never inlined or specialised for a caller), since a vectorised sum's order may follow
// the code around it; each file including this gets its own copies (internal linkage), as the builds of
// one file for different ISA levels must not share a symbol.
#pragma once
#include <cmath>
#include <cstdint>

#include "core/dtype.h"

namespace titan::cpu_rows {
namespace {

// A row of inp as f32: the row itself, or (bf16 bits) its values widened into buf.
inline const float* row_f32(const float* inp, int64_t n, int64_t C, float*) {
  return inp + n * C;
}
inline const float* row_f32(const uint16_t* inp, int64_t n, int64_t C, float* buf) {
  const uint16_t* x = inp + n * C;
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) buf[c] = bf16_to_f32(x[c]);
  return buf;
}

// 1 / sqrt(mean(x^2) + eps) of one row.
[[gnu::noipa]] float rms_row_rstd(const float* x, int64_t C, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t c = 0; c < C; ++c) ss += x[c] * x[c];
  return 1.0f / std::sqrt(ss / (float)C + eps);
}

// y = w * (x * r): f32, or bf16 bits (the nearest bf16 of the f32 value).
inline void rms_row_scale(float* y, const float* x, const float* w, float r, int64_t C) {
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) y[c] = w[c] * (x[c] * r);
}
inline void rms_row_scale(uint16_t* y, const float* x, const float* w, float r, int64_t C) {
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) y[c] = f32_to_bf16(w[c] * (x[c] * r));
}

// dx += r dy w - x r^3 / C sum(dy w x); pdw (may be null) += dy x r.
[[gnu::noipa]] void rms_row_backward(float* dx, float* pdw, const float* dy, const float* x, const float* w,
                                     float r, int64_t C) {
  float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int64_t c = 0; c < C; ++c) dot += dy[c] * w[c] * x[c];
  const float k = r * r * r * dot / (float)C;
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) dx[c] += r * dy[c] * w[c] - x[c] * k;
  if (pdw) {
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) pdw[c] += dy[c] * x[c] * r;
  }
}

// Rotates `heads` consecutive heads of one token row in place with the row's cos/sin (c, s: hd/2 each):
// x1' = x1 c - x2 s, x2' = x2 c + x1 s.
inline void rotate_heads(float* x, const float* c, const float* s, int64_t heads, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < heads; ++h, x += hd) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      x[i] = x1 * c[i] - x2 * s[i];
      x[i + half] = x2 * c[i] + x1 * s[i];
    }
  }
}

// dx += R^T dy for `heads` consecutive heads of one token row.
inline void unrotate_heads(float* dx, const float* dy, const float* c, const float* s, int64_t heads,
                           int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < heads; ++h, dx += hd, dy += hd) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float d1 = dy[i], d2 = dy[i + half];
      dx[i] += d1 * c[i] + d2 * s[i];
      dx[i + half] += d2 * c[i] - d1 * s[i];
    }
  }
}

}  // namespace
}  // namespace titan::cpu_rows
