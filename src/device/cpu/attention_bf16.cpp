// attention_bf16 on the CPU (src/kernels/ops.h): the strided bf16 rows unpacked to f32, an f32 attention
// that saves the row logsumexp, the results rounded back into the strided bf16 layout. "reference" runs the
// reference ring-attention block (double sums) over the whole sequence (positions 0..T-1, doc_start as the
// key start), "flash" the fastest f32 flash implementation this CPU runs.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/dtype.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan {
namespace {

void unpack_rows(float* dst, const uint16_t* src, int64_t rows, int64_t width, int64_t ld) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c) dst[r * width + c] = bf16_to_f32(src[r * ld + c]);
}

void pack_rows(uint16_t* dst, const float* src, int64_t rows, int64_t width, int64_t ld) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c) dst[r * ld + c] = f32_to_bf16(src[r * width + c]);
}

// f32 scratch of one call, kept between calls (no page faults per layer).
float* scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if ((int64_t)buf.size() < n) buf.resize(n);
  return buf.data();
}

// An f32 attention over whole causal sequences with the row logsumexp saved: (out, lse, q, k, v) contiguous
// (B,T,heads,hd), and its backward (accumulating into zeroed dq, dk, dv).
struct F32Attention {
  void (*forward)(float* out, float* lse, const float* q, const float* k, const float* v,
                  const AttentionBf16Shape& s, const int32_t* doc_start);
  void (*backward)(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                   const float* v, const float* out, const float* lse, const AttentionBf16Shape& s,
                   const int32_t* doc_start);
};

template <const F32Attention& A>
void forward_via_f32(uint16_t* out, float* lse, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                     const AttentionBf16Shape& s, const int32_t* doc_start) {
  const int64_t N = s.B * s.T, qw = s.nH * s.hd, kw = s.nKV * s.hd;
  float* qf = scratch(N * (2 * qw + 2 * kw));
  float *kf = qf + N * qw, *vf = kf + N * kw, *of = vf + N * kw;
  unpack_rows(qf, q, N, qw, s.ldq);
  unpack_rows(kf, k, N, kw, s.ldk);
  unpack_rows(vf, v, N, kw, s.ldv);
  A.forward(of, lse, qf, kf, vf, s, doc_start);
  pack_rows(out, of, N, qw, s.ldo);
}

template <const F32Attention& A>
void backward_via_f32(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout, const uint16_t* q,
                      const uint16_t* k, const uint16_t* v, const uint16_t* out, const float* lse,
                      const AttentionBf16Shape& s, const int32_t* doc_start) {
  const int64_t N = s.B * s.T, qw = s.nH * s.hd, kw = s.nKV * s.hd;
  float* qf = scratch(N * (5 * qw + 4 * kw));
  float *kf = qf + N * qw, *vf = kf + N * kw, *of = vf + N * kw, *dof = of + N * qw;
  float *dqf = dof + N * qw, *dkf = dqf + N * qw, *dvf = dkf + N * kw;
  unpack_rows(qf, q, N, qw, s.ldq);
  unpack_rows(kf, k, N, kw, s.ldk);
  unpack_rows(vf, v, N, kw, s.ldv);
  unpack_rows(of, out, N, qw, s.ldo);
  unpack_rows(dof, dout, N, qw, s.ldo);
  std::memset(dqf, 0, sizeof(float) * N * (qw + 2 * kw));
  A.backward(dqf, dkf, dvf, dof, qf, kf, vf, of, lse, s, doc_start);
  pack_rows(dq, dqf, N, qw, s.ldq);
  pack_rows(dk, dkf, N, kw, s.ldk);
  pack_rows(dv, dvf, N, kw, s.ldv);
}

// ---- reference: the ring block over the whole sequence ----
std::vector<int32_t> positions(int64_t T) {
  std::vector<int32_t> p(T);
  std::iota(p.begin(), p.end(), 0);
  return p;
}
const AttentionRingKernels& ring_reference() {
  return get_kernel<AttentionRingKernels>(DeviceType::CPU, "reference");
}
const F32Attention kRingReference{
    [](float* out, float* lse, const float* q, const float* k, const float* v, const AttentionBf16Shape& s,
       const int32_t* doc_start) {
      const std::vector<int32_t> pos = positions(s.T);
      ring_reference().forward(out, lse, q, k, v, s.B, s.T, s.T, s.nH, s.nKV, s.hd, pos.data(), pos.data(),
                               doc_start);
    },
    [](float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k, const float* v,
       const float* out, const float* lse, const AttentionBf16Shape& s, const int32_t* doc_start) {
      const std::vector<int32_t> pos = positions(s.T);
      ring_reference().backward(dq, dk, dv, dout, q, k, v, out, lse, s.B, s.T, s.T, s.nH, s.nKV, s.hd,
                                pos.data(), pos.data(), doc_start);
    }};

// ---- flash: the CPU's fastest f32 flash attention (its saved tensor is the row logsumexp) ----
const AttentionKernels& f32_flash() {
  static const AttentionKernels& k = get_kernel<AttentionKernels>(
      DeviceType::CPU, KernelRegistry::global().runnable("attention", DeviceType::CPU, "flash_onednn")
                           ? "flash_onednn"
                           : "flash");
  return k;
}
const F32Attention kFlash{
    [](float* out, float* lse, const float* q, const float* k, const float* v, const AttentionBf16Shape& s,
       const int32_t* doc_start) {
      f32_flash().forward(out, lse, q, k, v, s.B, s.T, s.nH, s.nKV, s.hd, doc_start);
    },
    [](float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k, const float* v,
       const float* out, const float* lse, const AttentionBf16Shape& s, const int32_t* doc_start) {
      f32_flash().backward(dq, dk, dv, dout, q, k, v, out, lse, s.B, s.T, s.nH, s.nKV, s.hd, doc_start);
    }};

const AttentionBf16Kernels kReferenceBf16{forward_via_f32<kRingReference>, backward_via_f32<kRingReference>};
TITAN_REGISTER_REFERENCE_KERNEL(AttentionBf16Kernels, CPU, "reference", kReferenceBf16, 0);
const AttentionBf16Kernels kFlashBf16{forward_via_f32<kFlash>, backward_via_f32<kFlash>};
TITAN_REGISTER_KERNEL(AttentionBf16Kernels, CPU, "flash", kFlashBf16, 20);

}  // namespace
}  // namespace titan
