// The f32 GEMM inside the CPU kernels (tiles of flash attention, the grouped experts' GEMMs): oneDNN's
// sgemm where the build has oneDNN, else BLAS. oneDNN picks its kernels from cpuid (and honours the
// TITAN_CPU_ISA cap, core/cpu_isa.cpp); OpenBLAS picks them from the CPU's model, which virtual machines
// often hide (it then runs its SSE3 "Prescott" kernels, 5x slower on an AVX-512 machine:
// bench/BENCHMARKS.md). Called inside OpenMP regions, both run single-threaded there.
#pragma once
#include <cblas.h>
#include <omp.h>

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/ops.h"

#ifdef TITAN_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif

namespace titan::cpu {

// C (M,N) = alpha op(A) op(B) + beta C, row-major; op(A) (M,K), op(B) (K,N); beta = 0 never reads C.
inline void sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                  const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
#ifdef TITAN_HAVE_DNNL
  const dnnl_status_t st =
      dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  TITAN_CHECK(st == dnnl_success, "oneDNN sgemm failed (status ", (int)st, ")");
#else
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha,
              A, lda, B, ldb, beta, C, ldc);
#endif
}

#ifdef TITAN_HAVE_DNNL
// Whether OpenBLAS runs its AVX2 (or wider) kernels here: its core type is one of Haswell, Zen, SkylakeX,
// Cooperlake, SapphireRapids (a VM hiding the CPU model gets Prescott/Nehalem-class SSE kernels).
bool openblas_runs_avx2();
// Whether the "onednn" matmul computes weight gradients on OpenBLAS (matmul_onednn.cpp says why): the
// running ISA is below AVX-512 and openblas_runs_avx2(). Decided once per process.
bool weight_grad_on_openblas();
#endif

// The bf16 GEMM engines of CPUs without bf16 dot products ("sgemm" of matmul_bf16 / moe_experts_bf16, and
// the references): an operand rounded to bf16 (nearest even) into `buf`, kept in f32, so that sgemm's
// products are exact and only its accumulation is f32, as on the bf16 instructions. A weight with a
// registered bf16 image (kernels/ops.h) is read from the image (the same values), so a weight held only in
// bf16 (an inference model's, generate/kv_model.h) needs no f32 copy. Parallel unless called inside a
// parallel region.
// The f32 values of n bf16 bit patterns, into `buf`.
inline const float* bf16_widened(std::vector<float>& buf, const uint16_t* x, int64_t n) {
  if ((int64_t)buf.size() < n) buf.resize(n);
  float* d = buf.data();
#pragma omp parallel for simd schedule(static) if (n >= (int64_t(1) << 16) && !omp_in_parallel())
  for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(x[i]);
  return d;
}

// dst = the nearest bf16 (ties to even) of each of n floats.
inline void bf16_narrowed(uint16_t* dst, const float* src, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= (int64_t(1) << 16) && !omp_in_parallel())
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

inline const float* bf16_rounded(std::vector<float>& buf, const float* x, int64_t n) {
  if (const uint16_t* image = find_bf16_image(x, n)) return bf16_widened(buf, image, n);
  if ((int64_t)buf.size() < n) buf.resize(n);
  float* d = buf.data();
#pragma omp parallel for simd schedule(static) if (n >= (int64_t(1) << 16) && !omp_in_parallel())
  for (int64_t i = 0; i < n; ++i) d[i] = round_to_bf16(x[i]);
  return d;
}

}  // namespace titan::cpu
