// Reference CPU kernels: plain loops that follow the math line by line, with double accumulators.
// They are the oracle every other implementation is tested against; speed is not a goal here.
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan {
namespace {

void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t C, int64_t OC) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double acc = 0;
      for (int64_t c = 0; c < C; ++c) acc += (double)inp[n * C + c] * w[o * C + c];
      out[n * OC + o] = (float)acc;
    }
}

void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w, int64_t N,
                     int64_t C, int64_t OC, bool accumulate_dw) {
  if (dinp)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) {
        double acc = 0;
        for (int64_t o = 0; o < OC; ++o) acc += (double)dout[n * OC + o] * w[o * C + c];
        dinp[n * C + c] += (float)acc;
      }
  if (dw)
    for (int64_t o = 0; o < OC; ++o)
      for (int64_t c = 0; c < C; ++c) {
        double acc = 0;
        for (int64_t n = 0; n < N; ++n) acc += (double)dout[n * OC + o] * inp[n * C + c];
        dw[o * C + c] = accumulate_dw ? dw[o * C + c] + (float)acc : (float)acc;
      }
}

// The f32 values of n bf16 bit patterns (the bf16 forms below are the f32 forms on them, their bf16
// outputs narrowed).
std::vector<float> widen(const uint16_t* x, int64_t n) {
  std::vector<float> r((size_t)n);
  for (int64_t i = 0; i < n; ++i) r[i] = bf16_to_f32(x[i]);
  return r;
}
// out16 = the nearest bf16 of each of n floats.
void narrow(uint16_t* out16, const std::vector<float>& x) {
  for (size_t i = 0; i < x.size(); ++i) out16[i] = f32_to_bf16(x[i]);
}

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* w, int64_t N, int64_t C,
                     float eps) {
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    double ss = 0;
    for (int64_t c = 0; c < C; ++c) ss += (double)x[c] * x[c];
    float r = 1.0f / std::sqrt((float)(ss / C) + eps);
    rstd[n] = r;
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = w[c] * (x[c] * r);
  }
}

void rmsnorm_forward_bf16_output(uint16_t* out16, float* rstd, const float* inp, const float* w, int64_t N,
                                 int64_t C, float eps) {
  std::vector<float> out((size_t)(N * C));
  rmsnorm_forward(out.data(), rstd, inp, w, N, C, eps);
  narrow(out16, out);
}

// y = w * x * r with r = (mean(x^2) + eps)^-1/2:
// dx = r * (dy*w) - x * r^3 / C * sum(dy*w*x);   dw += dy * x * r
void rmsnorm_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w,
                      const float* rstd, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    const float* dy = dout + n * C;
    double r = rstd[n], dot = 0;
    for (int64_t c = 0; c < C; ++c) dot += (double)dy[c] * w[c] * x[c];
    for (int64_t c = 0; c < C; ++c) {
      dinp[n * C + c] += (float)(r * dy[c] * w[c] - x[c] * r * r * r * dot / C);
      if (dw) dw[c] += (float)(dy[c] * (double)x[c] * r);
    }
  }
}

void rmsnorm_forward_bf16_input(float* out, float* rstd, const uint16_t* inp16, const float* w, int64_t N,
                                int64_t C, float eps) {
  rmsnorm_forward(out, rstd, widen(inp16, N * C).data(), w, N, C, eps);
}
void rmsnorm_backward_bf16_input(float* dinp, float* dw, const float* dout, const uint16_t* inp16,
                                 const float* w, const float* rstd, int64_t N, int64_t C) {
  rmsnorm_backward(dinp, dw, dout, widen(inp16, N * C).data(), w, rstd, N, C);
}
void rmsnorm_forward_bf16_io(uint16_t* out16, float* rstd, const uint16_t* inp16, const float* w, int64_t N,
                             int64_t C, float eps) {
  rmsnorm_forward_bf16_output(out16, rstd, widen(inp16, N * C).data(), w, N, C, eps);
}

void rope_forward(float* out, const float* inp, const float* cos, const float* sin, int64_t N, int64_t T,
                  int64_t nh, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < nh; ++h) {
      const float* x = inp + (n * nh + h) * hd;
      float* y = out + (n * nh + h) * hd;
      const float* c = cos + (n % T) * half;
      const float* s = sin + (n % T) * half;
      for (int64_t i = 0; i < half; ++i) {  // read both halves first: out may alias inp
        const float x1 = x[i], x2 = x[i + half];
        y[i] = x1 * c[i] - x2 * s[i];
        y[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
}

void rope_backward(float* dinp, const float* dout, const float* cos, const float* sin, int64_t N, int64_t T,
                   int64_t nh, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < nh; ++h) {
      const float* dy = dout + (n * nh + h) * hd;
      float* dx = dinp + (n * nh + h) * hd;
      const float* c = cos + (n % T) * half;
      const float* s = sin + (n % T) * half;
      for (int64_t i = 0; i < half; ++i) {
        dx[i] += dy[i] * c[i] + dy[i + half] * s[i];
        dx[i + half] += -dy[i] * s[i] + dy[i + half] * c[i];
      }
    }
}

void attention_forward(float* out, float* probs, const float* q, const float* k, const float* v, int64_t B,
                       int64_t T, int64_t nH, int64_t nKV, int64_t hd, const int32_t* doc_start) {
  const int64_t rep = nH / nKV;
  const double scale = 1.0 / std::sqrt((double)hd);
  std::vector<double> row(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < nH; ++h) {
      const int64_t kh = h / rep;
      for (int64_t i = 0; i < T; ++i) {
        const float* qi = q + ((b * T + i) * nH + h) * hd;
        const int64_t lo = attention_key_start(doc_start, b, T, i);
        double mx = -INFINITY;
        for (int64_t j = lo; j <= i; ++j) {
          const float* kj = k + ((b * T + j) * nKV + kh) * hd;
          double s = 0;
          for (int64_t d = 0; d < hd; ++d) s += (double)qi[d] * kj[d];
          row[j] = s * scale;
          mx = std::max(mx, row[j]);
        }
        double sum = 0;
        for (int64_t j = lo; j <= i; ++j) sum += (row[j] = std::exp(row[j] - mx));
        float* p = probs + ((b * nH + h) * T + i) * T;
        for (int64_t j = 0; j < T; ++j) p[j] = j >= lo && j <= i ? (float)(row[j] / sum) : 0.0f;
        float* o = out + ((b * T + i) * nH + h) * hd;
        for (int64_t d = 0; d < hd; ++d) {
          double acc = 0;
          for (int64_t j = lo; j <= i; ++j) acc += (double)p[j] * v[((b * T + j) * nKV + kh) * hd + d];
          o[d] = (float)acc;
        }
      }
    }
}

// dP = dO V^T;  dV += P^T dO;  dS = P * (dP - sum_j P dP);  dQ += scale dS K;  dK += scale dS^T Q
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                        const float* v, const float* /*out*/, const float* probs, int64_t B, int64_t T,
                        int64_t nH, int64_t nKV, int64_t hd, const int32_t* doc_start) {
  const int64_t rep = nH / nKV;
  const double scale = 1.0 / std::sqrt((double)hd);
  std::vector<double> dp(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < nH; ++h) {
      const int64_t kh = h / rep;
      for (int64_t i = 0; i < T; ++i) {
        const float* p = probs + ((b * nH + h) * T + i) * T;
        const float* doi = dout + ((b * T + i) * nH + h) * hd;
        const int64_t lo = attention_key_start(doc_start, b, T, i);
        double dot = 0;
        for (int64_t j = lo; j <= i; ++j) {
          const float* vj = v + ((b * T + j) * nKV + kh) * hd;
          double s = 0;
          for (int64_t d = 0; d < hd; ++d) s += (double)doi[d] * vj[d];
          dp[j] = s;
          dot += s * p[j];
          float* dvj = dv + ((b * T + j) * nKV + kh) * hd;
          for (int64_t d = 0; d < hd; ++d) dvj[d] += (float)((double)p[j] * doi[d]);
        }
        const float* qi = q + ((b * T + i) * nH + h) * hd;
        float* dqi = dq + ((b * T + i) * nH + h) * hd;
        for (int64_t j = lo; j <= i; ++j) {
          double ds = p[j] * (dp[j] - dot) * scale;
          const float* kj = k + ((b * T + j) * nKV + kh) * hd;
          float* dkj = dk + ((b * T + j) * nKV + kh) * hd;
          for (int64_t d = 0; d < hd; ++d) {
            dqi[d] += (float)(ds * kj[d]);
            dkj[d] += (float)(ds * qi[d]);
          }
        }
      }
    }
}

double silu(double x) {
  return x / (1.0 + std::exp(-x));
}

void swiglu_forward(float* out, const float* gu, int64_t N, int64_t I) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < I; ++i) out[n * I + i] = (float)(silu(gu[n * 2 * I + i]) * gu[n * 2 * I + I + i]);
}

// d/dg silu(g) = s(g) * (1 + g * (1 - s(g))), s = sigmoid
void swiglu_backward(float* dgu, const float* dout, const float* gu, int64_t N, int64_t I) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < I; ++i) {
      double g = gu[n * 2 * I + i], u = gu[n * 2 * I + I + i], dy = dout[n * I + i];
      double s = 1.0 / (1.0 + std::exp(-g));
      dgu[n * 2 * I + i] += (float)(dy * u * s * (1.0 + g * (1.0 - s)));
      dgu[n * 2 * I + I + i] += (float)(dy * g * s);
    }
}

// The bf16 forms: the f32 forms on the widened values.
void swiglu_forward_bf16(uint16_t* out16, const uint16_t* gu16, int64_t N, int64_t I) {
  std::vector<float> out((size_t)(N * I));
  swiglu_forward(out.data(), widen(gu16, N * 2 * I).data(), N, I);
  narrow(out16, out);
}

void swiglu_backward_bf16(float* dgu, const float* dout, const uint16_t* gu16, int64_t N, int64_t I) {
  swiglu_backward(dgu, dout, widen(gu16, N * 2 * I).data(), N, I);
}

void swiglu_backward_bf16_output(uint16_t* dgu16, const float* dout, const uint16_t* gu16, int64_t N,
                                 int64_t I) {
  std::vector<float> dgu((size_t)(N * 2 * I), 0.0f);
  swiglu_backward_bf16(dgu.data(), dout, gu16, N, I);
  narrow(dgu16, dgu);
}

void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = ids[n] < 0 ? 0.0f : table[(int64_t)ids[n] * C + c];
}

void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t C,
                        int64_t V) {
  for (int64_t n = 0; n < N; ++n)
    if (ids[n] >= 0)
      for (int64_t c = 0; c < C; ++c) dtable[(int64_t)ids[n] * C + c] += dout[n * C + c];
}

double cross_entropy(float* logits, const int32_t* targets, int64_t N, int64_t V, float grad_scale,
                     bool compute_grad) {
  double total = 0;
  for (int64_t n = 0; n < N; ++n) {
    float* x = logits + n * V;
    if (targets[n] < 0) {
      if (compute_grad)
        for (int64_t j = 0; j < V; ++j) x[j] = 0.0f;
      continue;
    }
    double mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < V; ++j) mx = std::max(mx, (double)x[j]);
    for (int64_t j = 0; j < V; ++j) sum += std::exp(x[j] - mx);
    double lse = mx + std::log(sum);
    total += lse - x[targets[n]];
    if (compute_grad)
      for (int64_t j = 0; j < V; ++j)
        x[j] = (float)(grad_scale * (std::exp(x[j] - lse) - (j == targets[n] ? 1.0 : 0.0)));
  }
  return total;
}

void cross_entropy_shard_stats(float* stats, const float* logits, const int32_t* targets, int64_t N,
                               int64_t V, int64_t v0) {
  for (int64_t n = 0; n < N; ++n) {
    const float* x = logits + n * V;
    float* s = stats + 3 * n;
    s[0] = s[1] = s[2] = 0.0f;
    if (targets[n] < 0) continue;
    double mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < V; ++j) mx = std::max(mx, (double)x[j]);
    for (int64_t j = 0; j < V; ++j) sum += std::exp(x[j] - mx);
    const int64_t t = targets[n] - v0;
    s[0] = (float)mx, s[1] = (float)sum, s[2] = t >= 0 && t < V ? x[t] : 0.0f;
  }
}

void cross_entropy_shard_grad(float* logits, const float* lse, const int32_t* targets, int64_t N, int64_t V,
                              int64_t v0, const float* scale) {
  const float grad_scale = *scale;
  for (int64_t n = 0; n < N; ++n) {
    float* x = logits + n * V;
    const int64_t t = targets[n] < 0 ? -1 : targets[n] - v0;
    for (int64_t j = 0; j < V; ++j)
      x[j] = targets[n] < 0 ? 0.0f
                            : (float)(grad_scale * (std::exp((double)x[j] - lse[n]) - (j == t ? 1.0 : 0.0)));
  }
}

void adamw_step(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                float eps, float wd, int64_t step, float grad_scale) {
  const AdamWStepScalars s = adamw_step_scalars(lr, beta1, beta2, wd, step);
  const float decay = s.decay, step_size = s.step_size, bc2_sqrt = s.bc2_sqrt;
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * grad_scale;
    p[i] *= decay;
    m[i] += (1.0f - beta1) * (gi - m[i]);
    v[i] = v[i] * beta2 + (1.0f - beta2) * gi * gi;
    float denom = std::sqrt(v[i]) / bc2_sqrt + eps;
    p[i] += -step_size * (m[i] / denom);
  }
}

double sum_squares(const float* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += (double)x[i] * x[i];
  return s;
}

// Ring attention blocks (context parallel), one query row at a time in double.
bool ring_reads(const int32_t* q_pos, const int32_t* k_pos, const int32_t* key_start, int64_t b, int64_t Tq,
                int64_t i, int64_t j) {
  return k_pos[j] <= q_pos[i] && (!key_start || k_pos[j] >= key_start[b * Tq + i]);
}

void attention_ring_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                            int64_t Tq, int64_t Tk, int64_t nH, int64_t nKV, int64_t hd, const int32_t* q_pos,
                            const int32_t* k_pos, const int32_t* key_start) {
  const int64_t rep = nH / nKV;
  const double scale = 1.0 / std::sqrt((double)hd);
  std::vector<double> row(Tk);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < nH; ++h)
      for (int64_t i = 0; i < Tq; ++i) {
        const float* qi = q + ((b * Tq + i) * nH + h) * hd;
        double mx = -INFINITY;
        for (int64_t j = 0; j < Tk; ++j) {
          if (!ring_reads(q_pos, k_pos, key_start, b, Tq, i, j)) continue;
          const float* kj = k + ((b * Tk + j) * nKV + h / rep) * hd;
          double s = 0;
          for (int64_t d = 0; d < hd; ++d) s += (double)qi[d] * kj[d];
          mx = std::max(mx, row[j] = s * scale);
        }
        double sum = 0;
        for (int64_t j = 0; j < Tk; ++j)
          sum += row[j] = ring_reads(q_pos, k_pos, key_start, b, Tq, i, j) ? std::exp(row[j] - mx) : 0.0;
        float* o = out + ((b * Tq + i) * nH + h) * hd;
        for (int64_t d = 0; d < hd; ++d) {
          double acc = 0;
          for (int64_t j = 0; j < Tk; ++j)
            if (row[j] != 0.0) acc += row[j] * v[((b * Tk + j) * nKV + h / rep) * hd + d];
          o[d] = sum > 0 ? (float)(acc / sum) : 0.0f;
        }
        lse[(b * nH + h) * Tq + i] = sum > 0 ? (float)(mx + std::log(sum)) : -INFINITY;
      }
}

void attention_ring_merge(float* out, float* lse, const float* part_out, const float* part_lse, int64_t B,
                          int64_t T, int64_t nH, int64_t hd) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < nH; ++h)
      for (int64_t t = 0; t < T; ++t) {
        float& l = lse[(b * nH + h) * T + t];
        const double a = l, p = part_lse[(b * nH + h) * T + t];
        if (p == -INFINITY) continue;
        const double m = std::max(a, p), merged = m + std::log(std::exp(a - m) + std::exp(p - m));
        const double ca = std::exp(a - merged), cp = std::exp(p - merged);
        float* o = out + ((b * T + t) * nH + h) * hd;
        const float* po = part_out + ((b * T + t) * nH + h) * hd;
        for (int64_t d = 0; d < hd; ++d) o[d] = (float)(ca * o[d] + cp * po[d]);
        l = (float)merged;
      }
}

void attention_ring_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                             const float* k, const float* v, const float* out, const float* lse, int64_t B,
                             int64_t Tq, int64_t Tk, int64_t nH, int64_t nKV, int64_t hd,
                             const int32_t* q_pos, const int32_t* k_pos, const int32_t* key_start) {
  const int64_t rep = nH / nKV;
  const double scale = 1.0 / std::sqrt((double)hd);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < nH; ++h)
      for (int64_t i = 0; i < Tq; ++i) {
        const float* qi = q + ((b * Tq + i) * nH + h) * hd;
        const float* doi = dout + ((b * Tq + i) * nH + h) * hd;
        const float* oi = out + ((b * Tq + i) * nH + h) * hd;
        float* dqi = dq + ((b * Tq + i) * nH + h) * hd;
        double D = 0;
        for (int64_t d = 0; d < hd; ++d) D += (double)doi[d] * oi[d];
        const double l = lse[(b * nH + h) * Tq + i];
        for (int64_t j = 0; j < Tk; ++j) {
          if (!ring_reads(q_pos, k_pos, key_start, b, Tq, i, j)) continue;
          const int64_t kv = ((b * Tk + j) * nKV + h / rep) * hd;
          double s = 0, dp = 0;
          for (int64_t d = 0; d < hd; ++d) s += (double)qi[d] * k[kv + d], dp += (double)doi[d] * v[kv + d];
          const double p = std::exp(s * scale - l), ds = p * (dp - D) * scale;
          for (int64_t d = 0; d < hd; ++d) {
            dv[kv + d] += (float)(p * doi[d]);
            dqi[d] += (float)(ds * k[kv + d]);
            dk[kv + d] += (float)(ds * qi[d]);
          }
        }
      }
}

const MatmulKernels kMatmul{matmul_forward, matmul_backward};
const RmsNormKernels kRmsNorm{rmsnorm_forward,
                              rmsnorm_backward,
                              rmsnorm_forward_bf16_output,
                              rmsnorm_forward_bf16_input,
                              rmsnorm_backward_bf16_input,
                              rmsnorm_forward_bf16_io};
const RopeKernels kRope{rope_forward, rope_backward};
int64_t attention_probs_floats(int64_t B, int64_t T, int64_t nH) {
  return B * nH * T * T;
}
const AttentionKernels kAttention{attention_forward, attention_backward, attention_probs_floats};
const AttentionRingKernels kAttentionRing{attention_ring_forward, attention_ring_merge,
                                          attention_ring_backward};
const SwigluKernels kSwiglu{swiglu_forward, swiglu_backward, swiglu_forward_bf16, swiglu_backward_bf16,
                            swiglu_backward_bf16_output};
const EmbeddingKernels kEmbedding{embedding_forward, embedding_backward};
const CrossEntropyKernels kCrossEntropy{cross_entropy, add_loss_sum<cross_entropy>};
const VocabParallelCrossEntropyKernels kVocabParallelCrossEntropy{
    cross_entropy_shard_stats, cross_entropy_shard_grad, shard_row_max_on_host, shard_rescale_on_host,
    shard_loss_on_host};
const AdamWKernels kAdamW{adamw_step, adamw_step_from_scalars<adamw_step>};
const SumSquaresKernels kSumSquares{sum_squares, add_sum_squares<sum_squares>, total_on_host,
                                    count_nonfinite_into};

TITAN_REGISTER_KERNEL(MatmulKernels, CPU, "reference", kMatmul, 0);
TITAN_REGISTER_KERNEL(RmsNormKernels, CPU, "reference", kRmsNorm, 0);
TITAN_REGISTER_KERNEL(RopeKernels, CPU, "reference", kRope, 0);
TITAN_REGISTER_KERNEL(AttentionKernels, CPU, "reference", kAttention, 0);
TITAN_REGISTER_KERNEL(AttentionRingKernels, CPU, "reference", kAttentionRing, 0);
TITAN_REGISTER_KERNEL(SwigluKernels, CPU, "reference", kSwiglu, 0);
TITAN_REGISTER_KERNEL(EmbeddingKernels, CPU, "reference", kEmbedding, 0);
TITAN_REGISTER_KERNEL(CrossEntropyKernels, CPU, "reference", kCrossEntropy, 0);
TITAN_REGISTER_KERNEL(VocabParallelCrossEntropyKernels, CPU, "reference", kVocabParallelCrossEntropy, 0);
TITAN_REGISTER_KERNEL(AdamWKernels, CPU, "reference", kAdamW, 0);
TITAN_REGISTER_KERNEL(SumSquaresKernels, CPU, "reference", kSumSquares, 0);

}  // namespace
}  // namespace titan
