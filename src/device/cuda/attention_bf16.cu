// attention_bf16 on the CUDA device (src/kernels/ops.h): "cudnn" runs cuDNN's fused attention (sdpa_cudnn.cu)
// and falls back to the own kernels for what it cannot run (packed documents, a shape cuDNN refuses);
// "flash" is the own kernels alone: the strided bf16 rows unpacked to f32, the f32 flash kernels
// (attention.cu), the result rounded back into the strided bf16 layout.
#include "device/cuda/attention.cuh"
#include "device/cuda/sdpa_cudnn.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan::cuda {
namespace {

constexpr int kThreads = 256;

// dst (rows, width) f32 contiguous <- src rows of stride ld (bf16).
__global__ void unpack_rows_kernel(float* dst, const uint16_t* src, int64_t rows, int64_t width, int64_t ld) {
  TITAN_GRID_STRIDE(i, rows * width) dst[i] = bf16_bits_to_f32(src[i / width * ld + i % width]);
}
// dst rows of stride ld (bf16) <- src (rows, width) f32, rounded to nearest even.
__global__ void pack_rows_kernel(uint16_t* dst, const float* src, int64_t rows, int64_t width, int64_t ld) {
  TITAN_GRID_STRIDE(i, rows * width) dst[i / width * ld + i % width] = f32_to_bf16_bits(src[i]);
}

void unpack_rows(float* dst, const uint16_t* src, int64_t rows, int64_t width, int64_t ld) {
  if (rows * width == 0) return;
  launch(unpack_rows_kernel, blocks_for(rows * width, kThreads), kThreads, 0, dst, src, rows, width, ld);
}
void pack_rows(uint16_t* dst, const float* src, int64_t rows, int64_t width, int64_t ld) {
  if (rows * width == 0) return;
  launch(pack_rows_kernel, blocks_for(rows * width, kThreads), kThreads, 0, dst, src, rows, width, ld);
}

void own_forward(const SdpaShape& s, uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k,
                 const uint16_t* v, const int32_t* doc_start) {
  const int64_t N = s.B * s.T, qw = s.nH * s.hd, kw = s.nKV * s.hd;
  Scratch<float> f(N * (2 * qw + 2 * kw));
  float *qf = f.p, *kf = qf + N * qw, *vf = kf + N * kw, *of = vf + N * kw;
  unpack_rows(qf, q, N, qw, s.ldq);
  unpack_rows(kf, k, N, kw, s.ldk);
  unpack_rows(vf, v, N, kw, s.ldv);
  flash_forward(of, lse, qf, kf, vf, s.B, s.T, s.nH, s.nKV, s.hd, doc_start);
  pack_rows(o, of, N, qw, s.ldo);
}

void own_backward(const SdpaShape& s, uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout,
                  const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* o,
                  const float* lse, const int32_t* doc_start) {
  const int64_t N = s.B * s.T, qw = s.nH * s.hd, kw = s.nKV * s.hd;
  Scratch<float> f(N * (5 * qw + 4 * kw));
  float *qf = f.p, *kf = qf + N * qw, *vf = kf + N * kw, *of = vf + N * kw, *dof = of + N * qw;
  float *dqf = dof + N * qw, *dkf = dqf + N * qw, *dvf = dkf + N * kw;
  unpack_rows(qf, q, N, qw, s.ldq);
  unpack_rows(kf, k, N, kw, s.ldk);
  unpack_rows(vf, v, N, kw, s.ldv);
  unpack_rows(of, o, N, qw, s.ldo);
  unpack_rows(dof, dout, N, qw, s.ldo);
  TITAN_CUDA_CHECK(cudaMemsetAsync(dqf, 0, N * (qw + 2 * kw) * sizeof(float), cuda_stream()));
  flash_backward(dqf, dkf, dvf, dof, qf, kf, vf, of, lse, s.B, s.T, s.nH, s.nKV, s.hd, doc_start);
  pack_rows(dq, dqf, N, qw, s.ldq);
  pack_rows(dk, dkf, N, kw, s.ldk);
  pack_rows(dv, dvf, N, kw, s.ldv);
}

void flash_bf16_forward(uint16_t* out, float* lse, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                        const AttentionBf16Shape& s, const int32_t* doc_start) {
  own_forward(s, out, lse, q, k, v, doc_start);
}
void flash_bf16_backward(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout, const uint16_t* q,
                         const uint16_t* k, const uint16_t* v, const uint16_t* out, const float* lse,
                         const AttentionBf16Shape& s, const int32_t* doc_start) {
  own_backward(s, dq, dk, dv, dout, q, k, v, out, lse, doc_start);
}

// cuDNN's graph has no document mask here: packed rows take the own kernels.
void cudnn_bf16_forward(uint16_t* out, float* lse, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                        const AttentionBf16Shape& s, const int32_t* doc_start) {
  if (doc_start || !sdpa_forward(s, out, lse, q, k, v)) flash_bf16_forward(out, lse, q, k, v, s, doc_start);
}
void cudnn_bf16_backward(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout, const uint16_t* q,
                         const uint16_t* k, const uint16_t* v, const uint16_t* out, const float* lse,
                         const AttentionBf16Shape& s, const int32_t* doc_start) {
  if (doc_start || !sdpa_backward(s, dq, dk, dv, dout, q, k, v, out, lse))
    flash_bf16_backward(dq, dk, dv, dout, q, k, v, out, lse, s, doc_start);
}

const AttentionBf16Kernels kFlashBf16{flash_bf16_forward, flash_bf16_backward};
TITAN_REGISTER_KERNEL(AttentionBf16Kernels, CUDA, "flash", kFlashBf16, 10);
const AttentionBf16Kernels kCudnnBf16{cudnn_bf16_forward, cudnn_bf16_backward};
TITAN_REGISTER_KERNEL(AttentionBf16Kernels, CUDA, "cudnn", kCudnnBf16, 20);

}  // namespace

void sdpa_own_forward(const SdpaShape& s, uint16_t* o, float* stats, const uint16_t* q, const uint16_t* k,
                      const uint16_t* v) {
  own_forward(s, o, stats, q, k, v, nullptr);
}
void sdpa_own_backward(const SdpaShape& s, uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout,
                       const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* o,
                       const float* stats) {
  own_backward(s, dq, dk, dv, dout, q, k, v, o, stats, nullptr);
}

}  // namespace titan::cuda
