#include "models/qwen3/moe_router.h"

#include <cmath>
#include <cstring>

namespace titan::moe_router {

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

void count_slots(double* counts, const int32_t* idx, int64_t n_slots, int64_t E) {
  for (int64_t i = 0; i < n_slots; ++i) counts[idx[i]] += 1.0;
}

void sum_probs(double* prob_sum, const float* probs, int64_t N, int64_t E) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) prob_sum[e] += probs[n * E + e];
}

void backward(float* dlogits, const float* probs, const int32_t* idx, const float* dw,
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

void update_bias(float* bias, const float* counts, int64_t E, double coeff) {
  double mean = 0;
  for (int64_t e = 0; e < E; ++e) mean += counts[e];
  mean /= (double)E;
  double delta_mean = 0;
  for (int64_t e = 0; e < E; ++e) {
    const double d = mean - counts[e];
    delta_mean += coeff * (d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0);
  }
  delta_mean /= (double)E;
  for (int64_t e = 0; e < E; ++e) {
    const double d = mean - counts[e];
    bias[e] += (float)(coeff * (d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0) - delta_mean);
  }
}

}  // namespace titan::moe_router
