// The CPU's adapter ops (ops.h: gemm, dropout): the general strided GEMM on BLAS ("blas") beside plain loops
// with double accumulators ("reference"), and the counter-based dropout mask.
#include <cblas.h>

#include "kernels/counter_hash.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan {
namespace {

void gemm_reference(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k)
        acc += (double)(ta ? A[k * lda + m] : A[m * lda + k]) * (tb ? B[n * ldb + k] : B[k * ldb + n]);
      float& c = C[m * ldc + n];
      c = (float)(alpha * acc + (beta == 0.0f ? 0.0 : (double)beta * c));
    }
}

void gemm_blas(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
               const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha,
              A, lda, B, ldb, beta, C, ldc);
}

// The counter of element i of a (rows, cols) buffer.
inline uint64_t dropout_counter(int64_t i, int64_t cols, uint64_t key, uint64_t key_stride) {
  return key + static_cast<uint64_t>(i / cols) * key_stride + static_cast<uint64_t>(i % cols);
}

void dropout_forward(float* out, const float* x, int64_t rows, int64_t cols, uint64_t key,
                     uint64_t key_stride, float p, const uint64_t* key_add) {
  if (key_add) key += *key_add;
  const float keep = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows * cols; ++i)
    out[i] = counter_uniform(dropout_counter(i, cols, key, key_stride)) >= p ? x[i] * keep : 0.0f;
}

void dropout_backward_add(float* dx, const float* g, int64_t rows, int64_t cols, uint64_t key,
                          uint64_t key_stride, float p, const uint64_t* key_add) {
  if (key_add) key += *key_add;
  const float keep = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows * cols; ++i)
    if (counter_uniform(dropout_counter(i, cols, key, key_stride)) >= p) dx[i] += g[i] * keep;
}

const GemmKernels kGemmReference{gemm_reference};
const GemmKernels kGemmBlas{gemm_blas};
const DropoutKernels kDropout{dropout_forward, dropout_backward_add};

}  // namespace

TITAN_REGISTER_KERNEL(GemmKernels, CPU, "reference", kGemmReference, 0);
TITAN_REGISTER_KERNEL(GemmKernels, CPU, "blas", kGemmBlas, 10);
TITAN_REGISTER_KERNEL(DropoutKernels, CPU, "reference", kDropout, 0);

}  // namespace titan
