// RoPE on q and k together (op "rope_qk"): the example of a custom fused kernel chosen by name
// ([kernels] rope = "fused"). "reference" rotates q, then k, head by head; "fused" makes one pass over the
// token rows, loads the row's cos/sin from the cached tables once and rotates all nH + nKV heads with it.
#include <cstring>

#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan {
namespace {

// x (rows, nh, hd) in place; x1' = x1 c - x2 s, x2' = x2 c + x1 s
void rotate_ref(float* x, const float* cos, const float* sin, int64_t N, int64_t T, int64_t nh, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < nh; ++h) {
      float* v = x + (n * nh + h) * hd;
      const float* c = cos + (n % T) * half;
      const float* s = sin + (n % T) * half;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] - x2 * s[i];
        v[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
}

// dx += R^T dy
void unrotate_ref(float* dx, const float* dy, const float* cos, const float* sin, int64_t N, int64_t T,
                  int64_t nh, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < nh; ++h) {
      const float* d = dy + (n * nh + h) * hd;
      float* g = dx + (n * nh + h) * hd;
      const float* c = cos + (n % T) * half;
      const float* s = sin + (n % T) * half;
      for (int64_t i = 0; i < half; ++i) {
        g[i] += d[i] * c[i] + d[i + half] * s[i];
        g[i + half] += d[i + half] * c[i] - d[i] * s[i];
      }
    }
}

void rope_qk_forward_ref(float* q, float* k, const float* cos, const float* sin, int64_t N, int64_t T,
                         int64_t nH, int64_t nKV, int64_t hd) {
  rotate_ref(q, cos, sin, N, T, nH, hd);
  rotate_ref(k, cos, sin, N, T, nKV, hd);
}

void rope_qk_backward_ref(float* dq, float* dk, const float* dq_rot, const float* dk_rot, const float* cos,
                          const float* sin, int64_t N, int64_t T, int64_t nH, int64_t nKV, int64_t hd) {
  unrotate_ref(dq, dq_rot, cos, sin, N, T, nH, hd);
  unrotate_ref(dk, dk_rot, cos, sin, N, T, nKV, hd);
}

// Rotates `heads` consecutive heads of one token row with the row's cos/sin (c, s: hd/2 each).
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

void rope_qk_forward_fused(float* q, float* k, const float* cos, const float* sin, int64_t N, int64_t T,
                           int64_t nH, int64_t nKV, int64_t hd) {
  const int64_t half = hd / 2;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* c = cos + (n % T) * half;
    const float* s = sin + (n % T) * half;
    rotate_heads(q + n * nH * hd, c, s, nH, hd);
    rotate_heads(k + n * nKV * hd, c, s, nKV, hd);
  }
}

void rope_qk_backward_fused(float* dq, float* dk, const float* dq_rot, const float* dk_rot, const float* cos,
                            const float* sin, int64_t N, int64_t T, int64_t nH, int64_t nKV, int64_t hd) {
  const int64_t half = hd / 2;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* c = cos + (n % T) * half;
    const float* s = sin + (n % T) * half;
    unrotate_heads(dq + n * nH * hd, dq_rot + n * nH * hd, c, s, nH, hd);
    unrotate_heads(dk + n * nKV * hd, dk_rot + n * nKV * hd, c, s, nKV, hd);
  }
}

// The same row-wise kernel behind the per-tensor "rope" table, so `rope = "fused"` names one implementation
// in both tables (the model calls rope_qk; code that rotates a single tensor gets the same loop).
// out may alias inp: each head is read before it is written.
void rope_forward_fused(float* out, const float* inp, const float* cos, const float* sin, int64_t N,
                        int64_t T, int64_t nh, int64_t hd) {
  const int64_t half = hd / 2;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    if (out != inp) std::memcpy(out + n * nh * hd, inp + n * nh * hd, nh * hd * sizeof(float));
    rotate_heads(out + n * nh * hd, cos + (n % T) * half, sin + (n % T) * half, nh, hd);
  }
}

void rope_backward_fused(float* dinp, const float* dout, const float* cos, const float* sin, int64_t N,
                         int64_t T, int64_t nh, int64_t hd) {
  const int64_t half = hd / 2;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    unrotate_heads(dinp + n * nh * hd, dout + n * nh * hd, cos + (n % T) * half, sin + (n % T) * half, nh,
                   hd);
}

const RopeKernels kRopeFused{rope_forward_fused, rope_backward_fused};
TITAN_REGISTER_KERNEL(RopeKernels, CPU, "fused", kRopeFused, 5);

const RopeQKKernels kRopeQKReference{rope_qk_forward_ref, rope_qk_backward_ref};
const RopeQKKernels kRopeQKFused{rope_qk_forward_fused, rope_qk_backward_fused};
TITAN_REGISTER_REFERENCE_KERNEL(RopeQKKernels, CPU, "reference", kRopeQKReference, 0);
TITAN_REGISTER_KERNEL(RopeQKKernels, CPU, "fused", kRopeQKFused, 10);

}  // namespace
}  // namespace titan
