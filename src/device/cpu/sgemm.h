// The f32 GEMM inside the CPU kernels (tiles of flash attention, the grouped experts' GEMMs): oneDNN's
// sgemm where the build has oneDNN, else BLAS. oneDNN picks its kernels from cpuid (and honours the
// TITAN_CPU_ISA cap, core/cpu_isa.cpp); OpenBLAS picks them from the CPU's model, which virtual machines
// often hide (it then runs its SSE3 "Prescott" kernels, 5x slower on an AVX-512 machine:
// bench/BENCHMARKS.md). Called inside OpenMP regions, both run single-threaded there.
#pragma once
#include <cblas.h>

#include <cstdint>

#ifdef TITAN_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif

namespace titan::cpu {

// C (M,N) = alpha op(A) op(B) + beta C, row-major; op(A) (M,K), op(B) (K,N); beta = 0 never reads C.
inline void sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                  const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
#ifdef TITAN_HAVE_DNNL
  dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#else
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha, A,
              lda, B, ldb, beta, C, ldc);
#endif
}

}  // namespace titan::cpu
