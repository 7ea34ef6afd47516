// f32 GEMMs through oneDNN's sgemm (op "matmul", implementation "onednn"; built when oneDNN is found).
// oneDNN picks its kernels from the CPU's instruction set (AVX-512 where present) independently of
// OpenBLAS's core type; the default over "blas" by measurement (bench/BENCHMARKS.md).
#ifdef TITAN_HAVE_DNNL
#include "device/cpu/sgemm.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan {
namespace {

void matmul_forward(float* out, const float* inp, const float* w, int64_t N, int64_t C, int64_t OC) {
  cpu::sgemm(false, true, N, OC, C, 1.0f, inp, C, w, C, 0.0f, out, OC);
}

void matmul_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w, int64_t N,
                     int64_t C, int64_t OC, bool accumulate_dw) {
  if (dinp) cpu::sgemm(false, false, N, C, OC, 1.0f, dout, OC, w, C, 1.0f, dinp, C);
  if (dw) cpu::sgemm(true, false, OC, C, N, 1.0f, dout, OC, inp, C, accumulate_dw ? 1.0f : 0.0f, dw, C);
}

const MatmulKernels kMatmul{matmul_forward, matmul_backward};
TITAN_REGISTER_KERNEL(MatmulKernels, CPU, "onednn", kMatmul, 20);

}  // namespace
}  // namespace titan
#endif
