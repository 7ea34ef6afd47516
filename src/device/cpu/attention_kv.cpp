// Attention of new queries against a KV cache (op attention_kv, see ops.h): "reference" (double
// accumulation, the oracle) and "fast" (f32, one (query, head) row per task, SIMD dot products).
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan {
namespace {

// q (n,nH,hd), k/v (p+n,nKV,hd), out (n,nH,hd); query i at position p + i reads keys [0, p + i].
void reference_forward(float* out, const float* q, const float* k, const float* v, int64_t n, int64_t p,
                       int64_t nH, int64_t nKV, int64_t hd) {
  const int64_t rep = nH / nKV;
  const double scale = 1.0 / std::sqrt((double)hd);
  std::vector<double> s(p + n);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < nH; ++h) {
      const int64_t kh = h / rep, len = p + i + 1;
      const float* qi = q + (i * nH + h) * hd;
      double mx = -INFINITY;
      for (int64_t j = 0; j < len; ++j) {
        const float* kj = k + (j * nKV + kh) * hd;
        double acc = 0;
        for (int64_t d = 0; d < hd; ++d) acc += (double)qi[d] * kj[d];
        s[j] = acc * scale;
        mx = std::max(mx, s[j]);
      }
      double sum = 0;
      for (int64_t j = 0; j < len; ++j) sum += (s[j] = std::exp(s[j] - mx));
      float* o = out + (i * nH + h) * hd;
      for (int64_t d = 0; d < hd; ++d) {
        double acc = 0;
        for (int64_t j = 0; j < len; ++j) acc += s[j] * v[(j * nKV + kh) * hd + d];
        o[d] = (float)(acc / sum);
      }
    }
}

void fast_forward(float* out, const float* q, const float* k, const float* v, int64_t n, int64_t p,
                  int64_t nH, int64_t nKV, int64_t hd) {
  const int64_t rep = nH / nKV;
  const float scale = 1.0f / std::sqrt((float)hd);
  // threads only when the work outweighs a fork/join (short decode steps run inline)
#pragma omp parallel if (n * nH * (p + n) * hd >= (int64_t(1) << 16))
  {
    std::vector<float> s(p + n);
    std::vector<double> acc(hd);
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < nH; ++h) {
        const int64_t kh = h / rep, len = p + i + 1;
        const float* qi = q + (i * nH + h) * hd;
        float mx = -INFINITY;
        for (int64_t j = 0; j < len; ++j) {
          const float* kj = k + (j * nKV + kh) * hd;
          float dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < hd; ++d) dot += qi[d] * kj[d];
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        float sum = 0;
        for (int64_t j = 0; j < len; ++j) sum += (s[j] = std::exp(s[j] - mx));
        // out = sum_j s_j v_j / sum, accumulated in double (cheap next to the dot products, and it keeps long
        // contexts as exact as the full-sequence kernels)
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < len; ++j) {
          const float* vj = v + (j * nKV + kh) * hd;
          const double w = s[j];
#pragma omp simd
          for (int64_t d = 0; d < hd; ++d) acc[d] += w * vj[d];
        }
        float* o = out + (i * nH + h) * hd;
        const double inv = 1.0 / sum;
        for (int64_t d = 0; d < hd; ++d) o[d] = (float)(acc[d] * inv);
      }
  }
}

const AttentionKVKernels kReference{reference_forward};
const AttentionKVKernels kFast{fast_forward};

}  // namespace

TITAN_REGISTER_REFERENCE_KERNEL(AttentionKVKernels, CPU, "reference", kReference, 0);
TITAN_REGISTER_KERNEL(AttentionKVKernels, CPU, "fast", kFast, 10);

}  // namespace titan
