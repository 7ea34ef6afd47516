// attention_kv on the GPU (ops.h): n new queries against the KV cache, one block per (query, head). The
// block computes the scores of keys [0, p + i] into scratch (one thread per key, an f32 dot of hd), reduces
// their max and the sum of exponentials, then each thread owns output dimensions and sums p_j v_j over the
// keys. Decode steps (n = 1) read the cache once per head; prefill runs n x nH blocks.
#include <cmath>

#include "device/cuda/cuda_common.cuh"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan::cuda {
namespace {

constexpr int kThreads = 128;

__global__ void attention_kv_kernel(float* out, float* scores, const float* q, const float* k, const float* v,
                                    int64_t n, int64_t p, int64_t nH, int64_t nKV, int64_t hd, float scale) {
  const int64_t i = blockIdx.x / nH, h = blockIdx.x % nH;
  const int64_t kh = h / (nH / nKV), len = p + i + 1;
  const float* qi = q + (i * nH + h) * hd;
  float* s = scores + blockIdx.x * (p + n);
  __shared__ float red[32];
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
    const float* kj = k + (j * nKV + kh) * hd;
    float dot = 0.0f;
    for (int64_t d = 0; d < hd; ++d) dot += qi[d] * kj[d];
    s[j] = dot * scale;
    mx = fmaxf(mx, s[j]);
  }
  mx = block_max(mx, red);
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < len; j += blockDim.x) sum += (s[j] = expf(s[j] - mx));
  sum = block_sum(sum, red);  // ends synchronized: every s[j] is written
  const float inv = 1.0f / sum;
  float* o = out + (i * nH + h) * hd;
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.0f;
    for (int64_t j = 0; j < len; ++j) acc += s[j] * v[(j * nKV + kh) * hd + d];
    o[d] = acc * inv;
  }
}

void attention_kv_forward(float* out, const float* q, const float* k, const float* v, int64_t n, int64_t p,
                          int64_t nH, int64_t nKV, int64_t hd) {
  if (n <= 0) return;
  Scratch<float> scores(static_cast<size_t>(n * nH * (p + n)));
  launch(attention_kv_kernel, static_cast<unsigned>(n * nH), kThreads, 0, out, scores.p, q, k, v, n, p, nH,
         nKV, hd, 1.0f / std::sqrt(static_cast<float>(hd)));
}

const AttentionKVKernels kAttentionKV{attention_kv_forward};

}  // namespace

TITAN_REGISTER_KERNEL(AttentionKVKernels, CUDA, "cuda", kAttentionKV, 10);

}  // namespace titan::cuda
