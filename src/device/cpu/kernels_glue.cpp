// The CPU's glue ops of the model step (ops.h: elementwise, moe_router, expert_parallel): residual adds,
// bf16 rounding, the MoE router and the expert-parallel row packing. One implementation each
// ("reference"): the loops are already the fast form (memory-bound, OpenMP over rows or elements).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan {
namespace {

// ---- elementwise ----------------------------------------------------------------------------------------
// Threads only where the work outweighs a fork/join (a decode step's rows are short, and a barrier on a
// busy machine can cost more than the loop).
constexpr int64_t kParallelMin = int64_t(1) << 16;

void add(float* y, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void round_bf16(float* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

void to_bf16(uint16_t* dst, const float* src, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

void from_bf16(float* dst, const uint16_t* src, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

void add_to_bf16(uint16_t* out16, const float* y, const uint16_t* x16, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) out16[i] = f32_to_bf16(y[i] + bf16_to_f32(x16[i]));
}

void fill(float* x, float value, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) x[i] = value;
}

// ---- moe_router -----------------------------------------------------------------------------------------
void softmax_rows(float* x, int64_t N, int64_t E) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* r = x + n * E;
    float mx = r[0];
    for (int64_t e = 1; e < E; ++e) mx = std::max(mx, r[e]);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (r[e] = std::exp(r[e] - mx));
    const float inv = (float)(1.0 / sum);
    for (int64_t e = 0; e < E; ++e) r[e] *= inv;
  }
}

void select_topk(int32_t* idx, float* w, const float* probs, const float* bias, int64_t N, int64_t E,
                 int64_t k, bool norm) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* p = probs + n * E;
    int32_t* id = idx + n * k;
    // k passes of arg-max over the experts not yet taken (k is small); ties go to the lower index.
    for (int64_t s = 0; s < k; ++s) {
      int32_t best = -1;
      float best_score = 0;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t t = 0; t < s; ++t) taken |= id[t] == e;
        if (taken) continue;
        const float score = bias ? p[e] + bias[e] : p[e];
        if (best < 0 || score > best_score) best = (int32_t)e, best_score = score;
      }
      id[s] = best;
    }
    float sum = 0.0f;
    for (int64_t s = 0; s < k; ++s) sum += (w[n * k + s] = p[id[s]]);
    if (norm)
      for (int64_t s = 0; s < k; ++s) w[n * k + s] /= sum;
  }
}

void count_tokens(float* counts, const int32_t* idx, int64_t n_slots, int64_t /*E*/) {
  for (int64_t i = 0; i < n_slots; ++i) counts[idx[i]] += 1.0f;
}

void aux_stats(double* counts, double* prob_sum, const int32_t* idx, const float* probs, int64_t N, int64_t E,
               int64_t k) {
  for (int64_t i = 0; i < N * k; ++i) counts[idx[i]] += 1.0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) prob_sum[e] += probs[n * E + e];
}

void router_backward(float* dlogits, const float* probs, const int32_t* idx, const float* dw,
                     const float* dprob_bias, int64_t N, int64_t E, int64_t k, bool norm) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* p = probs + n * E;
    float* dp = dlogits + n * E;  // dprobs first, then turned into dlogits in place
    for (int64_t e = 0; e < E; ++e) dp[e] = dprob_bias ? dprob_bias[e] : 0.0f;
    const int32_t* id = idx + n * k;
    const float* g = dw + n * k;
    if (norm) {
      // w_s = p_s / S, S = sum_t p_t:  dp_s = (dw_s - sum_t dw_t w_t) / S
      double S = 0, dot = 0;
      for (int64_t s = 0; s < k; ++s) S += p[id[s]];
      for (int64_t s = 0; s < k; ++s) dot += (double)g[s] * (p[id[s]] / S);
      for (int64_t s = 0; s < k; ++s) dp[id[s]] += (float)((g[s] - dot) / S);
    } else {
      for (int64_t s = 0; s < k; ++s) dp[id[s]] += g[s];
    }
    // softmax backward: dl_e = p_e (dp_e - sum_j p_j dp_j)
    double dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += (double)p[e] * dp[e];
    for (int64_t e = 0; e < E; ++e) dp[e] = (float)(p[e] * (dp[e] - dot));
  }
}

void update_bias(float* bias, float* counts, int64_t E, double coeff) {
  double mean = 0;
  for (int64_t e = 0; e < E; ++e) mean += counts[e];
  mean /= (double)E;
  auto sign = [](double d) { return d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0; };
  double delta_mean = 0;
  for (int64_t e = 0; e < E; ++e) delta_mean += coeff * sign(mean - counts[e]);
  delta_mean /= (double)E;
  for (int64_t e = 0; e < E; ++e) bias[e] += (float)(coeff * sign(mean - counts[e]) - delta_mean);
  std::fill(counts, counts + E, 0.0f);
}

// ---- expert_parallel ------------------------------------------------------------------------------------
void ep_pack(float* send, const float* x, const float* w, const int32_t* idx, const int64_t* order, int64_t S,
             int64_t k, int64_t H, int64_t El) {
  const int64_t row = H + 2;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < S; ++i) {
    const int64_t slot = order[i];
    float* r = send + i * row;
    if (slot < 0) {  // padding
      std::fill_n(r, H + 1, 0.0f);
      r[H + 1] = -1.0f;
      continue;
    }
    std::memcpy(r, x + (slot / k) * H, H * sizeof(float));
    r[H] = w[slot];
    r[H + 1] = static_cast<float>(idx[slot] % El);
  }
}

int64_t ep_unpack(float* x, float* w, int32_t* idx, const float* recv, int64_t R, int64_t H, int64_t El) {
  const int64_t row = H + 2;
  int64_t bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad)
  for (int64_t r = 0; r < R; ++r) {
    const float* src = recv + r * row;
    std::memcpy(x + r * H, src, H * sizeof(float));
    w[r] = src[H];
    idx[r] = static_cast<int32_t>(src[H + 1]);
    bad += idx[r] < 0 || idx[r] >= El;
  }
  return bad;
}

void ep_gather_rows(float* send, const float* src, const int64_t* order, int64_t S, int64_t k, int64_t H) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < S; ++i) {
    if (order[i] < 0)
      std::fill_n(send + i * H, H, 0.0f);
    else
      std::memcpy(send + i * H, src + (order[i] / k) * H, H * sizeof(float));
  }
}

void ep_route_fixed(int64_t* order, int64_t* pos, const int32_t* idx, int64_t S, int64_t El, int64_t ranks) {
  std::fill_n(order, ranks * S, int64_t(-1));
  std::vector<int64_t> next(ranks, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t d = idx[s] / El, p = d * S + next[d]++;
    order[p] = s, pos[s] = p;
  }
}

void ep_unpack_padded(float* x, float* w, int32_t* idx, const float* recv, int64_t R, int64_t H) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    const float* src = recv + r * (H + 2);
    std::memcpy(x + r * H, src, H * sizeof(float));
    w[r] = src[H];
    idx[r] = static_cast<int32_t>(src[H + 1]);
  }
}

void ep_pack_grads(float* dst, const float* dx, const float* dw, int64_t R, int64_t H) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    std::memcpy(dst + r * (H + 1), dx + r * H, H * sizeof(float));
    dst[r * (H + 1) + H] = dw[r];
  }
}

void ep_combine(float* out, float* dtw, const float* rows, const int64_t* pos, int64_t N, int64_t k,
                int64_t H, int64_t row, bool accumulate) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* o = out + n * H;
    if (!accumulate) std::memset(o, 0, H * sizeof(float));
    for (int64_t j = 0; j < k; ++j) {
      const float* src = rows + pos[n * k + j] * row;
      for (int64_t h = 0; h < H; ++h) o[h] += src[h];
      if (dtw) dtw[n * k + j] += src[H];
    }
  }
}

void scale(float* x, float a, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) x[i] *= a;
}

const ElementwiseKernels kElementwise{add, round_bf16, to_bf16, from_bf16, fill, scale, add_to_bf16};
void aux_loss(double* aux, float* dprob, const double* stats, int64_t E, double R) {
  *aux = moe_aux_loss(stats, E, R, dprob);
}

const MoeRouterKernels kMoeRouter{softmax_rows,    select_topk, count_tokens, aux_stats,
                                  router_backward, update_bias, aux_loss};
const ExpertParallelKernels kExpertParallel{ep_pack,    ep_unpack,      ep_gather_rows,  ep_pack_grads,
                                            ep_combine, ep_route_fixed, ep_unpack_padded};

}  // namespace

TITAN_REGISTER_KERNEL(ElementwiseKernels, CPU, "reference", kElementwise, 0);
TITAN_REGISTER_KERNEL(MoeRouterKernels, CPU, "reference", kMoeRouter, 0);
TITAN_REGISTER_KERNEL(ExpertParallelKernels, CPU, "reference", kExpertParallel, 0);

}  // namespace titan
