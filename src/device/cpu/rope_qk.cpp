// RoPE on q and k together (op "rope_qk"): the example of a custom fused kernel chosen by name
// ([kernels] rope = "fused"). "reference" rotates q, then k, head by head; "fused" makes one pass over the
// token rows, loads the row's cos/sin from the cached tables once and rotates all nH + nKV heads with it.
// Also "qk_norm_rope" (bf16 activations): the q/k norms, RoPE and the bf16 conversion in one pass.
#include <omp.h>

#include <cstring>
#include <vector>

#include "device/cpu/row_ops.h"
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

using cpu_rows::rotate_heads;
using cpu_rows::unrotate_heads;

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

// ---- qk_norm_rope: q/k norm + RoPE between bf16 tensors ---------------------------------------------------

// reference: the CPU reference ops in turn (rmsnorm on the widened rows, rope_qk, the nearest bf16).
void qk_norm_rope_forward_ref(uint16_t* q16, uint16_t* k16, float* q_rstd, float* k_rstd,
                              const uint16_t* q_raw16, const uint16_t* k_raw16, const float* q_w,
                              const float* k_w, const float* cos, const float* sin, int64_t N, int64_t T,
                              int64_t nH, int64_t nKV, int64_t hd, float eps) {
  const auto& norm = get_kernel<RmsNormKernels>(DeviceType::CPU, "reference");
  std::vector<float> q(N * nH * hd), k(N * nKV * hd);
  norm.forward_bf16_input(q.data(), q_rstd, q_raw16, q_w, N * nH, hd, eps);
  norm.forward_bf16_input(k.data(), k_rstd, k_raw16, k_w, N * nKV, hd, eps);
  rope_qk_forward_ref(q.data(), k.data(), cos, sin, N, T, nH, nKV, hd);
  for (size_t i = 0; i < q.size(); ++i) q16[i] = f32_to_bf16(q[i]);
  for (size_t i = 0; i < k.size(); ++i) k16[i] = f32_to_bf16(k[i]);
}

void qk_norm_rope_backward_ref(uint16_t* dq_raw16, uint16_t* dk_raw16, float* dq_w, float* dk_w,
                               const uint16_t* dq16, const uint16_t* dk16, const uint16_t* q_raw16,
                               const uint16_t* k_raw16, const float* q_w, const float* k_w,
                               const float* q_rstd, const float* k_rstd, const float* cos, const float* sin,
                               int64_t N, int64_t T, int64_t nH, int64_t nKV, int64_t hd) {
  const auto& norm = get_kernel<RmsNormKernels>(DeviceType::CPU, "reference");
  std::vector<float> dq_rot(N * nH * hd), dk_rot(N * nKV * hd), gq(dq_rot.size(), 0.0f),
      gk(dk_rot.size(), 0.0f);
  for (size_t i = 0; i < dq_rot.size(); ++i) dq_rot[i] = bf16_to_f32(dq16[i]);
  for (size_t i = 0; i < dk_rot.size(); ++i) dk_rot[i] = bf16_to_f32(dk16[i]);
  rope_qk_backward_ref(gq.data(), gk.data(), dq_rot.data(), dk_rot.data(), cos, sin, N, T, nH, nKV, hd);
  std::vector<float> dq(gq.size(), 0.0f), dk(gk.size(), 0.0f);
  norm.backward_bf16_input(dq.data(), dq_w, gq.data(), q_raw16, q_w, q_rstd, N * nH, hd);
  norm.backward_bf16_input(dk.data(), dk_w, gk.data(), k_raw16, k_w, k_rstd, N * nKV, hd);
  for (size_t i = 0; i < dq.size(); ++i) dq_raw16[i] = f32_to_bf16(dq[i]);
  for (size_t i = 0; i < dk.size(); ++i) dk_raw16[i] = f32_to_bf16(dk[i]);
}

// fused: one pass over the head rows, each widened, normed, rotated and narrowed in a row buffer, with the
// loops of the fast rmsnorm and rope_qk (row_ops.h) and their thread split, so the bits are theirs.
void qk_norm_rope_forward_fused(uint16_t* q16, uint16_t* k16, float* q_rstd, float* k_rstd,
                                const uint16_t* q_raw16, const uint16_t* k_raw16, const float* q_w,
                                const float* k_w, const float* cos, const float* sin, int64_t N, int64_t T,
                                int64_t nH, int64_t nKV, int64_t hd, float eps) {
  const int64_t half = hd / 2;
#pragma omp parallel
  {
    std::vector<float> buf(hd), y(hd);
    auto rows = [&](uint16_t* out16, float* rstd, const uint16_t* raw16, const float* w, int64_t nh) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < N * nh; ++r) {
        const float* x = cpu_rows::row_f32(raw16, r, hd, buf.data());
        const float rs = cpu_rows::rms_row_rstd(x, hd, eps);
        rstd[r] = rs;
        cpu_rows::rms_row_scale(y.data(), x, w, rs, hd);
        const int64_t t = (r / nh) % T;
        rotate_heads(y.data(), cos + t * half, sin + t * half, 1, hd);
        uint16_t* o = out16 + r * hd;
#pragma omp simd
        for (int64_t c = 0; c < hd; ++c) o[c] = f32_to_bf16(y[c]);
      }
    };
    rows(q16, q_rstd, q_raw16, q_w, nH);
    rows(k16, k_rstd, k_raw16, k_w, nKV);
  }
}

void qk_norm_rope_backward_fused(uint16_t* dq_raw16, uint16_t* dk_raw16, float* dq_w, float* dk_w,
                                 const uint16_t* dq16, const uint16_t* dk16, const uint16_t* q_raw16,
                                 const uint16_t* k_raw16, const float* q_w, const float* k_w,
                                 const float* q_rstd, const float* k_rstd, const float* cos, const float* sin,
                                 int64_t N, int64_t T, int64_t nH, int64_t nKV, int64_t hd) {
  const int64_t half = hd / 2;
  const int nt = omp_get_max_threads();
  // Per-thread partial weight gradients, reduced in thread order at the end (as the fast rmsnorm).
  std::vector<float> part_q(dq_w ? (size_t)nt * hd : 0, 0.0f), part_k(dk_w ? (size_t)nt * hd : 0, 0.0f);
#pragma omp parallel
  {
    const int tid = omp_get_thread_num();
    std::vector<float> dbuf(hd), g(hd), xbuf(hd), dx(hd);
    auto rows = [&](uint16_t* out16, std::vector<float>& part, const uint16_t* d16, const uint16_t* raw16,
                    const float* w, const float* rstd, int64_t nh) {
      float* pdw = part.empty() ? nullptr : part.data() + (size_t)tid * hd;
#pragma omp for schedule(static)
      for (int64_t r = 0; r < N * nh; ++r) {
        const float* dy = cpu_rows::row_f32(d16, r, hd, dbuf.data());
        std::fill(g.begin(), g.end(), 0.0f);
        const int64_t t = (r / nh) % T;
        unrotate_heads(g.data(), dy, cos + t * half, sin + t * half, 1, hd);
        std::fill(dx.begin(), dx.end(), 0.0f);  // (the projection's gradient row, then rounded)
        cpu_rows::rms_row_backward(dx.data(), pdw, g.data(), cpu_rows::row_f32(raw16, r, hd, xbuf.data()), w,
                                   rstd[r], hd);
        uint16_t* o = out16 + r * hd;
#pragma omp simd
        for (int64_t c = 0; c < hd; ++c) o[c] = f32_to_bf16(dx[c]);
      }
    };
    rows(dq_raw16, part_q, dq16, q_raw16, q_w, q_rstd, nH);
    rows(dk_raw16, part_k, dk16, k_raw16, k_w, k_rstd, nKV);
  }
  for (auto [dw, part] : {std::pair{dq_w, &part_q}, {dk_w, &part_k}})
    if (dw)
      for (int t = 0; t < nt; ++t)
        for (int64_t c = 0; c < hd; ++c) dw[c] += (*part)[(size_t)t * hd + c];
}

const RopeKernels kRopeFused{rope_forward_fused, rope_backward_fused};
TITAN_REGISTER_KERNEL(RopeKernels, CPU, "fused", kRopeFused, 5);

const RopeQKKernels kRopeQKReference{rope_qk_forward_ref, rope_qk_backward_ref};
const RopeQKKernels kRopeQKFused{rope_qk_forward_fused, rope_qk_backward_fused};
TITAN_REGISTER_REFERENCE_KERNEL(RopeQKKernels, CPU, "reference", kRopeQKReference, 0);
TITAN_REGISTER_KERNEL(RopeQKKernels, CPU, "fused", kRopeQKFused, 10);

const QKNormRopeKernels kQKNormRopeReference{qk_norm_rope_forward_ref, qk_norm_rope_backward_ref};
const QKNormRopeKernels kQKNormRopeFused{qk_norm_rope_forward_fused, qk_norm_rope_backward_fused};
TITAN_REGISTER_REFERENCE_KERNEL(QKNormRopeKernels, CPU, "reference", kQKNormRopeReference, 0);
TITAN_REGISTER_KERNEL(QKNormRopeKernels, CPU, "fused", kQKNormRopeFused, 10);

}  // namespace
}  // namespace titan
