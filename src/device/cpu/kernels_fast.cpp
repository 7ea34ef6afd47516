// Fast CPU kernels: BLAS (OpenBLAS, OpenMP build) for GEMMs, OpenMP + vectorisable loops elsewhere.
// Same math and conventions as kernels_reference.cpp (forward overwrites, backward accumulates).
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "device/cpu/row_ops.h"
#include "device/cpu/vec_math.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan {
namespace {

void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t C, int64_t OC) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, w, C, 0.0f, out, OC);
}

void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w, int64_t N,
                     int64_t C, int64_t OC, bool accumulate_dw) {
  if (dinp)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, w, C, 1.0f, dinp, C);
  if (dw)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C,
                accumulate_dw ? 1.0f : 0.0f, dw, C);
}

using cpu_rows::row_f32;

// inp: f32 or bf16 bits; out: f32, or bf16 bits (each value the nearest bf16 of the f32 one). The same
// arithmetic on the same values whichever the types (the row loops of row_ops.h).
template <class In, class Out>
void rmsnorm_forward_t(Out* out, float* rstd, const In* inp, const float* w, int64_t N, int64_t C,
                       float eps) {
#pragma omp parallel
  {
    std::vector<float> buf(std::is_same_v<In, float> ? 0 : (size_t)C);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* x = row_f32(inp, n, C, buf.data());
      const float r = cpu_rows::rms_row_rstd(x, C, eps);
      rstd[n] = r;
      cpu_rows::rms_row_scale(out + n * C, x, w, r, C);
    }
  }
}

template <class In>
void rmsnorm_backward_t(float* dinp, float* dw, const float* dout, const In* inp, const float* w,
                        const float* rstd, int64_t N, int64_t C) {
  const int nt = omp_get_max_threads();
  // Per-thread partial weight gradients, reduced at the end (deterministic for a fixed thread count).
  std::vector<float> partial(dw ? (size_t)nt * C : 0, 0.0f);
#pragma omp parallel
  {
    const int tid = omp_get_thread_num();
    float* pdw = dw ? partial.data() + (size_t)tid * C : nullptr;
    std::vector<float> buf(std::is_same_v<In, float> ? 0 : (size_t)C);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n)
      cpu_rows::rms_row_backward(dinp + n * C, pdw, dout + n * C, row_f32(inp, n, C, buf.data()), w, rstd[n],
                                 C);
  }
  if (dw)
    for (int t = 0; t < nt; ++t)
      for (int64_t c = 0; c < C; ++c) dw[c] += partial[(size_t)t * C + c];
}

void rope_forward(float* out, const float* inp, const float* cos, const float* sin, int64_t N, int64_t T,
                  int64_t nh, int64_t hd) {
  const int64_t half = hd / 2;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < nh; ++h) {
      const float* x = inp + (n * nh + h) * hd;
      float* y = out + (n * nh + h) * hd;
      const float* c = cos + (n % T) * half;
      const float* s = sin + (n % T) * half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        y[i] = x1 * c[i] - x2 * s[i];
        y[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
}

void rope_backward(float* dinp, const float* dout, const float* cos, const float* sin, int64_t N, int64_t T,
                   int64_t nh, int64_t hd) {
  const int64_t half = hd / 2;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < nh; ++h) {
      const float* dy = dout + (n * nh + h) * hd;
      float* dx = dinp + (n * nh + h) * hd;
      const float* c = cos + (n % T) * half;
      const float* s = sin + (n % T) * half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float d1 = dy[i], d2 = dy[i + half];
        dx[i] += d1 * c[i] + d2 * s[i];
        dx[i + half] += d2 * c[i] - d1 * s[i];
      }
    }
}

// One (batch, kv head) group per task so the dK/dV accumulation of the group's query heads never races.
// Inside a task BLAS runs single-threaded (OpenBLAS detects the enclosing OpenMP region).
void attention_forward(float* out, float* probs, const float* q, const float* k, const float* v, int64_t B,
                       int64_t T, int64_t nH, int64_t nKV, int64_t hd, const int32_t* doc_start) {
  const int64_t rep = nH / nKV;
  const float scale = 1.0f / std::sqrt((float)hd);
  const int64_t ldq = nH * hd, ldk = nKV * hd;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < nH; ++h) {
      const int64_t kh = h / rep;
      const float* qb = q + b * T * ldq + h * hd;
      const float* kb = k + b * T * ldk + kh * hd;
      const float* vb = v + b * T * ldk + kh * hd;
      float* p = probs + (b * nH + h) * T * T;
      // S = scale * Q K^T (only the lower triangle is used)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hd, scale, qb, ldq, kb, ldk, 0.0f, p, T);
      for (int64_t i = 0; i < T; ++i) {
        float* row = p + i * T;
        const int64_t lo = attention_key_start(doc_start, b, T, i);
        float mx = -INFINITY;
        for (int64_t j = lo; j <= i; ++j) mx = std::max(mx, row[j]);
        float sum = 0.0f;
        for (int64_t j = lo; j <= i; ++j) sum += (row[j] = std::exp(row[j] - mx));
        const float inv = 1.0f / sum;
        for (int64_t j = lo; j <= i; ++j) row[j] *= inv;
        std::fill(row, row + lo, 0.0f);
        for (int64_t j = i + 1; j < T; ++j) row[j] = 0.0f;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hd, T, 1.0f, p, T, vb, ldk, 0.0f,
                  out + b * T * ldq + h * hd, ldq);
    }
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                        const float* v, const float* /*out*/, const float* probs, int64_t B, int64_t T,
                        int64_t nH, int64_t nKV, int64_t hd, const int32_t* doc_start) {
  const int64_t rep = nH / nKV;
  const float scale = 1.0f / std::sqrt((float)hd);
  const int64_t ldq = nH * hd, ldk = nKV * hd;
#pragma omp parallel
  {
    std::vector<float> ds((size_t)T * T);
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t kh = 0; kh < nKV; ++kh)
        for (int64_t h = kh * rep; h < (kh + 1) * rep; ++h) {
          const float* p = probs + (b * nH + h) * T * T;
          const float* dob = dout + b * T * ldq + h * hd;
          const float* qb = q + b * T * ldq + h * hd;
          const float* kb = k + b * T * ldk + kh * hd;
          const float* vb = v + b * T * ldk + kh * hd;
          // dV += P^T dO
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hd, T, 1.0f, p, T, dob, ldq, 1.0f,
                      dv + b * T * ldk + kh * hd, ldk);
          // dP = dO V^T
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hd, 1.0f, dob, ldq, vb, ldk, 0.0f,
                      ds.data(), T);
          for (int64_t i = 0; i < T; ++i) {
            const float* pr = p + i * T;
            float* dr = ds.data() + i * T;
            const int64_t lo = attention_key_start(doc_start, b, T, i);
            float dot = 0.0f;
            for (int64_t j = lo; j <= i; ++j) dot += pr[j] * dr[j];
            for (int64_t j = lo; j <= i; ++j) dr[j] = pr[j] * (dr[j] - dot) * scale;
            std::fill(dr, dr + lo, 0.0f);
            for (int64_t j = i + 1; j < T; ++j) dr[j] = 0.0f;
          }
          // dQ += dS K;  dK += dS^T Q
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hd, T, 1.0f, ds.data(), T, kb, ldk, 1.0f,
                      dq + b * T * ldq + h * hd, ldq);
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hd, T, 1.0f, ds.data(), T, qb, ldq, 1.0f,
                      dk + b * T * ldk + kh * hd, ldk);
        }
  }
}

// silu(g) = g * sigmoid(g); the sigmoid of a row first (vec::sigmoid), then the products.
void swiglu_forward(float* out, const float* gu, int64_t N, int64_t I) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = gu + n * 2 * I;
    const float* u = g + I;
    float* y = out + n * I;
    vec::sigmoid(y, g, I);
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) y[i] = g[i] * y[i] * u[i];
  }
}

// The bf16 forms, row by row as above on the row's widened gate/up (so each value equals the f32 form's).
void swiglu_forward_bf16(uint16_t* out16, const uint16_t* gu16, int64_t N, int64_t I) {
#pragma omp parallel
  {
    std::vector<float> buf((size_t)(3 * I));
    float *g = buf.data(), *u = g + I, *y = u + I;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const uint16_t* row = gu16 + n * 2 * I;
#pragma omp simd
      for (int64_t i = 0; i < 2 * I; ++i) g[i] = bf16_to_f32(row[i]);
      vec::sigmoid(y, g, I);
      uint16_t* out = out16 + n * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) out[i] = f32_to_bf16(g[i] * y[i] * u[i]);
    }
  }
}

// One row of the backward: dg, du (= dg + I) += d(gate), d(up); s: I floats of scratch.
inline void swiglu_backward_row(float* dg, const float* dy, const float* g, float* s, int64_t I) {
  const float* u = g + I;
  float* du = dg + I;
  vec::sigmoid(s, g, I);
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) {
    dg[i] += dy[i] * u[i] * s[i] * (1.0f + g[i] * (1.0f - s[i]));
    du[i] += dy[i] * g[i] * s[i];
  }
}

// gate/up: f32, or bf16 bits (each row widened into a buffer, row_f32); d(gate/up) added to f32, or (bf16
// bits) the row summed into a cleared buffer and narrowed: the same arithmetic every way.
template <class In, class Out = float>
void swiglu_backward_t(Out* dgu, const float* dout, const In* gu, int64_t N, int64_t I) {
  constexpr bool in16 = !std::is_same_v<In, float>, out16 = !std::is_same_v<Out, float>;
#pragma omp parallel
  {
    std::vector<float> buf((size_t)(I + (in16 ? 2 * I : 0) + (out16 ? 2 * I : 0)));
    float *s = buf.data(), *acc = s + I + (in16 ? 2 * I : 0);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* g = row_f32(gu, n, 2 * I, s + I);
      if constexpr (out16) {
        std::fill_n(acc, 2 * I, 0.0f);
        swiglu_backward_row(acc, dout + n * I, g, s, I);
        uint16_t* o = dgu + n * 2 * I;
#pragma omp simd
        for (int64_t i = 0; i < 2 * I; ++i) o[i] = f32_to_bf16(acc[i]);
      } else {
        swiglu_backward_row(dgu + n * 2 * I, dout + n * I, g, s, I);
      }
    }
  }
}

void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    if (ids[n] < 0)
      std::fill_n(out + n * C, C, 0.0f);
    else
      std::copy_n(table + (int64_t)ids[n] * C, C, out + n * C);
}

// Parallel over columns so rows hit by repeated ids never race; order per element is fixed (deterministic).
void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t C,
                        int64_t V) {
  const int nt = omp_get_max_threads();
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t c0 = C * tid / nth, c1 = C * (tid + 1) / nth;
    for (int64_t n = 0; n < N; ++n) {
      if (ids[n] < 0) continue;
      float* d = dtable + (int64_t)ids[n] * C;
      const float* g = dout + n * C;
      for (int64_t c = c0; c < c1; ++c) d[c] += g[c];
    }
  }
}

// Three vectorised passes per row (max, sum of exp, gradient); the exponential is vec::exp_ps.
double cross_entropy(float* logits, const int32_t* targets, int64_t N, int64_t V, float grad_scale,
                     bool compute_grad) {
  double total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total)
  for (int64_t n = 0; n < N; ++n) {
    float* x = logits + n * V;
    const int32_t t = targets[n];
    if (t < 0) {
      if (compute_grad) std::fill_n(x, V, 0.0f);
      continue;
    }
    const float mx = vec::max(x, V);
    const float lse = mx + std::log(vec::sum_exp(x, V, mx));
    total += (double)(lse - x[t]);
    if (compute_grad) {
      vec::exp_scale(x, x, V, lse, grad_scale);
      x[t] -= grad_scale;
    }
  }
  return total;
}

void cross_entropy_shard_stats(float* stats, const float* logits, const int32_t* targets, int64_t N,
                               int64_t V, int64_t v0) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = logits + n * V;
    float* s = stats + 3 * n;
    s[0] = s[1] = s[2] = 0.0f;
    if (targets[n] < 0) continue;
    const float mx = vec::max(x, V);
    const int64_t t = targets[n] - v0;
    s[0] = mx, s[1] = vec::sum_exp(x, V, mx), s[2] = t >= 0 && t < V ? x[t] : 0.0f;
  }
}

void cross_entropy_shard_grad(float* logits, const float* lse, const int32_t* targets, int64_t N, int64_t V,
                              int64_t v0, const float* scale) {
  const float grad_scale = *scale;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* x = logits + n * V;
    if (targets[n] < 0) {
      std::fill_n(x, V, 0.0f);
      continue;
    }
    vec::exp_scale(x, x, V, lse[n], grad_scale);
    const int64_t t = targets[n] - v0;
    if (t >= 0 && t < V) x[t] -= grad_scale;
  }
}

void adamw_step(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                float eps, float wd, int64_t step, float grad_scale) {
  const AdamWStepScalars s = adamw_step_scalars(lr, beta1, beta2, wd, step);
  const float decay = s.decay, step_size = s.step_size, bc2_sqrt = s.bc2_sqrt;
  const float one_minus_b1 = 1.0f - beta1, one_minus_b2 = 1.0f - beta2;
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * grad_scale;
    const float mi = m[i] + one_minus_b1 * (gi - m[i]);
    const float vi = v[i] * beta2 + one_minus_b2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step_size * (mi / (std::sqrt(vi) / bc2_sqrt + eps));
  }
}

// Threads reduce partial sums in double (the gradient norm over every gradient buffer).
double sum_squares(const float* x, int64_t n) {
  double s = 0;
#pragma omp parallel for simd reduction(+ : s) schedule(static)
  for (int64_t i = 0; i < n; ++i) s += (double)x[i] * x[i];
  return s;
}

const MatmulKernels kMatmul{matmul_forward, matmul_backward};
const RmsNormKernels kRmsNorm{rmsnorm_forward_t<float, float>,    rmsnorm_backward_t<float>,
                              rmsnorm_forward_t<float, uint16_t>, rmsnorm_forward_t<uint16_t, float>,
                              rmsnorm_backward_t<uint16_t>,       rmsnorm_forward_t<uint16_t, uint16_t>};
const RopeKernels kRope{rope_forward, rope_backward};
int64_t attention_probs_floats(int64_t B, int64_t T, int64_t nH) {
  return B * nH * T * T;
}
const AttentionKernels kAttention{attention_forward, attention_backward, attention_probs_floats};
const SwigluKernels kSwiglu{swiglu_forward, swiglu_backward_t<float>, swiglu_forward_bf16,
                            swiglu_backward_t<uint16_t>, swiglu_backward_t<uint16_t, uint16_t>};
const EmbeddingKernels kEmbedding{embedding_forward, embedding_backward};
const CrossEntropyKernels kCrossEntropy{cross_entropy, add_loss_sum<cross_entropy>};
const VocabParallelCrossEntropyKernels kVocabParallelCrossEntropy{
    cross_entropy_shard_stats, cross_entropy_shard_grad, shard_row_max_on_host, shard_rescale_on_host,
    shard_loss_on_host};
const AdamWKernels kAdamW{adamw_step, adamw_step_from_scalars<adamw_step>};
const SumSquaresKernels kSumSquares{sum_squares, add_sum_squares<sum_squares>, total_on_host,
                                    count_nonfinite_into};

TITAN_REGISTER_KERNEL(MatmulKernels, CPU, "blas", kMatmul, 10);
TITAN_REGISTER_KERNEL(RmsNormKernels, CPU, "fast", kRmsNorm, 10);
TITAN_REGISTER_KERNEL(RopeKernels, CPU, "fast", kRope, 10);
TITAN_REGISTER_KERNEL(AttentionKernels, CPU, "blas", kAttention, 10);
TITAN_REGISTER_KERNEL(SwigluKernels, CPU, "fast", kSwiglu, 10);
TITAN_REGISTER_KERNEL(EmbeddingKernels, CPU, "fast", kEmbedding, 10);
TITAN_REGISTER_KERNEL(CrossEntropyKernels, CPU, "fast", kCrossEntropy, 10);
TITAN_REGISTER_KERNEL(VocabParallelCrossEntropyKernels, CPU, "fast", kVocabParallelCrossEntropy, 10);
TITAN_REGISTER_KERNEL(AdamWKernels, CPU, "fast", kAdamW, 10);
TITAN_REGISTER_KERNEL(SumSquaresKernels, CPU, "fast", kSumSquares, 10);

}  // namespace
}  // namespace titan
