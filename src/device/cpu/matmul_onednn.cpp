// f32 GEMMs through oneDNN's sgemm (op "matmul", implementation "onednn"; built when oneDNN is found).
// oneDNN picks its kernels from the CPU's instruction set (AVX-512 where present) independently of
// OpenBLAS's core type; the default over "blas" by measurement (bench/BENCHMARKS.md).
#ifdef TITAN_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>

#include "core/error.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan {
namespace {

// dnnl_sgemm is row-major: C (M,N) = alpha op(A) op(B) + beta C.
void sgemm(char ta, char tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
           int64_t ldb, float beta, float* C, int64_t ldc) {
  const dnnl_status_t st = dnnl_sgemm(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
  TITAN_CHECK(st == dnnl_success, "oneDNN sgemm failed (status ", (int)st, ")");
}

void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t C, int64_t OC) {
  sgemm('N', 'T', N, OC, C, inp, C, w, C, 0.0f, out, OC);
}

void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w, int64_t N,
                     int64_t C, int64_t OC, bool accumulate_dw) {
  if (dinp) sgemm('N', 'N', N, C, OC, dout, OC, w, C, 1.0f, dinp, C);
  if (dw) sgemm('T', 'N', OC, C, N, dout, OC, inp, C, accumulate_dw ? 1.0f : 0.0f, dw, C);
}

const MatmulKernels kMatmul{matmul_forward, matmul_backward};
TITAN_REGISTER_KERNEL(MatmulKernels, CPU, "onednn", kMatmul, 20);

}  // namespace
}  // namespace titan
#endif
