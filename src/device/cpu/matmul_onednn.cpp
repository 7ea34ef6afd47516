// f32 GEMMs through oneDNN's sgemm (op "matmul", implementation "onednn"; built when oneDNN is found).
// oneDNN picks its kernels from the CPU's instruction set (AVX-512 where present) independently of
// OpenBLAS's core type; the default over "blas" by measurement (bench/BENCHMARKS.md).
//
// The weight gradient (dW = dout^T inp, the transposed-A GEMM) runs on OpenBLAS instead where the CPU runs
// AVX2 code (no AVX-512, or capped by TITAN_CPU_ISA) and OpenBLAS runs its AVX2 kernels: oneDNN 2.6's AVX2
// sgemm does that layout at half its rate when the input is narrow (C = 256, the debug flavor: 71-83 against
// OpenBLAS Zen's 147-169 GFLOP/s; its other layouts and the wide shapes are on a par), a 12% shorter debug
// step (bench/BENCHMARKS.md "Every x86-64 CPU"). On AVX-512 oneDNN is the faster engine for every layout,
// and on a VM that hides the CPU model OpenBLAS falls back to its SSE kernels: oneDNN keeps the GEMM there.
#ifdef TITAN_HAVE_DNNL
#include <strings.h>

#include "device/cpu/sgemm.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan {

namespace cpu {
bool openblas_runs_avx2() {
  const char* core = openblas_get_corename();
  for (const char* avx2_core : {"haswell", "zen", "skylakex", "cooperlake", "sapphirerapids"})
    if (core && strcasecmp(core, avx2_core) == 0) return true;
  return false;
}

bool weight_grad_on_openblas() {
  static const bool on_blas = cpu_isa() < CpuIsa::kAvx512 && openblas_runs_avx2();
  return on_blas;
}
}  // namespace cpu

namespace {

void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t C, int64_t OC) {
  cpu::sgemm(false, true, N, OC, C, 1.0f, inp, C, w, C, 0.0f, out, OC);
}

void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w, int64_t N,
                     int64_t C, int64_t OC, bool accumulate_dw) {
  if (dinp) cpu::sgemm(false, false, N, C, OC, 1.0f, dout, OC, w, C, 1.0f, dinp, C);
  if (!dw) return;
  const float beta = accumulate_dw ? 1.0f : 0.0f;
  if (cpu::weight_grad_on_openblas())
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, beta, dw, C);
  else
    cpu::sgemm(true, false, OC, C, N, 1.0f, dout, OC, inp, C, beta, dw, C);
}

const MatmulKernels kMatmul{matmul_forward, matmul_backward};
TITAN_REGISTER_KERNEL(MatmulKernels, CPU, "onednn", kMatmul, 20);

}  // namespace
}  // namespace titan
#endif
