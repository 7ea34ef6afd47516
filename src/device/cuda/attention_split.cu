// Causal GQA flash attention, impl "flash_split": the forward of "flash" (row logsumexp saved), and a
// backward in two kernels without atomics, where 8 threads share one key (or one query row) and split
// its head dimension (thread g owns dims g, g+8, g+16, ...): a dot product over hd is 8 partial sums and
// three shuffles.
//
// dK/dV: grid (ceil(T/16), nKV, B), 128 threads = 16 keys x 8 dim groups; the block owns 16 keys of kv
//   head kh and walks every query row (h in kh's group, i >= j0), 32 rows at a time staged in shared
//   memory: p = exp(scale q_i.k_j - lse_i), ds = p (dO_i.v_j - D_i) scale, dV_j += p dO_i, dK_j += ds q_i,
//   in registers; one += per element at the end.
// dQ:   grid (ceil(T/16), nH, B), 128 threads = 16 query rows x 8 dim groups; keys j <= i staged 32 at a
//   time: dQ_i += ds_ij k_j. Recomputes p and ds (both kernels do), which costs fewer cycles than dQ
//   atomics.
// Packed rows (doc_start): keys before the query row's document start are masked too.
#include <cuda_runtime.h>

#include <cmath>

#include "device/cuda/attention.cuh"
#include "device/cuda/cuda_common.cuh"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan::cuda {
namespace {

constexpr int kGroups = 8;  // threads per key / query row
constexpr int kPer = 16;    // keys (dK/dV) or query rows (dQ) per block
constexpr int kStage = 32;  // rows staged in shared memory per step
constexpr int kThreads = kPer * kGroups;

__device__ inline float group_sum(float v) {  // over the 8 consecutive lanes of a group
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v;
}

template <int DP>
__global__ void split_dkdv_kernel(float* dk, float* dv, const float* dout, const float* q, const float* k,
                                  const float* v, const float* lse, const float* D, int64_t T, int64_t nH,
                                  int64_t nKV, int64_t hd, float scale, const int32_t* doc_start) {
  TITAN_DYNAMIC_SHARED(float, smem);
  float* Qs = smem;               // [kStage][hd]
  float* dOs = Qs + kStage * hd;  // [kStage][hd]
  float* Ls = dOs + kStage * hd;  // [kStage]
  float* Ds = Ls + kStage;        // [kStage]
  const int key = threadIdx.x / kGroups, g = threadIdx.x % kGroups;
  const int64_t b = blockIdx.z, kh = blockIdx.y, rep = nH / nKV, j0 = (int64_t)blockIdx.x * kPer,
                j = j0 + key;
  const bool kvalid = j < T;
  float kr[DP], vr[DP], dkr[DP], dvr[DP];
#pragma unroll
  for (int c = 0; c < DP; ++c) {
    const int64_t d = g + kGroups * c;
    const bool in = kvalid && d < hd;
    kr[c] = in ? k[((b * T + j) * nKV + kh) * hd + d] : 0.0f;
    vr[c] = in ? v[((b * T + j) * nKV + kh) * hd + d] : 0.0f;
    dkr[c] = dvr[c] = 0.0f;
  }
  const int64_t rows_per_head = T - j0, total = rep * rows_per_head;
  for (int64_t base = 0; base < total; base += kStage) {
    const int nrows = (int)min((int64_t)kStage, total - base);
    __syncthreads();  // the previous rows are no longer read
    for (int64_t e = threadIdx.x; e < nrows * hd; e += blockDim.x) {
      const int64_t ridx = base + e / hd, d = e % hd;
      const int64_t h = kh * rep + ridx / rows_per_head, i = j0 + ridx % rows_per_head;
      Qs[e] = q[((b * T + i) * nH + h) * hd + d];
      dOs[e] = dout[((b * T + i) * nH + h) * hd + d];
    }
    for (int r = threadIdx.x; r < nrows; r += blockDim.x) {
      const int64_t ridx = base + r, h = kh * rep + ridx / rows_per_head, i = j0 + ridx % rows_per_head;
      Ls[r] = lse[(b * nH + h) * T + i];
      Ds[r] = D[(b * nH + h) * T + i];
    }
    __syncthreads();
    for (int r = 0; r < nrows; ++r) {
      const int64_t i = j0 + (base + r) % rows_per_head;
      const float* qs = Qs + r * hd;
      const float* dos = dOs + r * hd;
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int c = 0; c < DP; ++c) {
        const int64_t d = g + kGroups * c;
        if (d < hd) s += qs[d] * kr[c], dp += dos[d] * vr[c];
      }
      s = group_sum(s);
      dp = group_sum(dp);
      const int64_t lo = doc_start ? doc_start[b * T + i] : 0;  // first key of the row's document
      const float p = kvalid && j >= lo && j <= i ? expf(s * scale - Ls[r]) : 0.0f;
      const float ds = p * (dp - Ds[r]) * scale;
#pragma unroll
      for (int c = 0; c < DP; ++c) {
        const int64_t d = g + kGroups * c;
        if (d < hd) dvr[c] += p * dos[d], dkr[c] += ds * qs[d];
      }
    }
  }
  if (!kvalid) return;
#pragma unroll
  for (int c = 0; c < DP; ++c) {
    const int64_t d = g + kGroups * c;
    if (d < hd) {
      dk[((b * T + j) * nKV + kh) * hd + d] += dkr[c];
      dv[((b * T + j) * nKV + kh) * hd + d] += dvr[c];
    }
  }
}

template <int DP>
__global__ void split_dq_kernel(float* dq, const float* dout, const float* q, const float* k, const float* v,
                                const float* lse, const float* D, int64_t T, int64_t nH, int64_t nKV,
                                int64_t hd, float scale, const int32_t* doc_start) {
  TITAN_DYNAMIC_SHARED(float, smem);
  float* Ks = smem;              // [kStage][hd]
  float* Vs = Ks + kStage * hd;  // [kStage][hd]
  const int row = threadIdx.x / kGroups, g = threadIdx.x % kGroups;
  const int64_t b = blockIdx.z, h = blockIdx.y, kh = h / (nH / nKV), i0 = (int64_t)blockIdx.x * kPer;
  const int64_t i = i0 + row;
  const bool valid = i < T;
  float qr[DP], dor[DP], dqr[DP];
#pragma unroll
  for (int c = 0; c < DP; ++c) {
    const int64_t d = g + kGroups * c;
    const bool in = valid && d < hd;
    qr[c] = in ? q[((b * T + i) * nH + h) * hd + d] : 0.0f;
    dor[c] = in ? dout[((b * T + i) * nH + h) * hd + d] : 0.0f;
    dqr[c] = 0.0f;
  }
  const float lse_i = valid ? lse[(b * nH + h) * T + i] : 0.0f, D_i = valid ? D[(b * nH + h) * T + i] : 0.0f;
  const int64_t last = min(T - 1, i0 + kPer - 1);
  // Keys from the first document of the block's rows (doc_start never decreases along a row).
  const int64_t lo = valid && doc_start ? doc_start[b * T + i] : 0,
                first = doc_start ? doc_start[b * T + i0] : 0;
  for (int64_t j0 = first; j0 <= last; j0 += kStage) {
    const int nk = (int)min((int64_t)kStage, last - j0 + 1);
    __syncthreads();
    for (int64_t e = threadIdx.x; e < nk * hd; e += blockDim.x) {
      const int64_t j = j0 + e / hd, d = e % hd;
      Ks[e] = k[((b * T + j) * nKV + kh) * hd + d];
      Vs[e] = v[((b * T + j) * nKV + kh) * hd + d];
    }
    __syncthreads();
    for (int jj = 0; jj < nk; ++jj) {
      const float* ks = Ks + jj * hd;
      const float* vs = Vs + jj * hd;
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int c = 0; c < DP; ++c) {
        const int64_t d = g + kGroups * c;
        if (d < hd) s += qr[c] * ks[d], dp += dor[c] * vs[d];
      }
      s = group_sum(s);
      dp = group_sum(dp);
      const float p = valid && j0 + jj >= lo && j0 + jj <= i ? expf(s * scale - lse_i) : 0.0f;
      const float ds = p * (dp - D_i) * scale;
#pragma unroll
      for (int c = 0; c < DP; ++c) {
        const int64_t d = g + kGroups * c;
        if (d < hd) dqr[c] += ds * ks[d];
      }
    }
  }
  if (!valid) return;
#pragma unroll
  for (int c = 0; c < DP; ++c) {
    const int64_t d = g + kGroups * c;
    if (d < hd) dq[((b * T + i) * nH + h) * hd + d] += dqr[c];
  }
}

template <int DP>
void launch_split(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                  const float* v, const float* lse, const float* D, int64_t B, int64_t T, int64_t nH,
                  int64_t nKV, int64_t hd, float scale, const int32_t* doc_start) {
  const size_t smem_kv = sizeof(float) * (2 * kStage * hd + 2 * kStage),
               smem_q = sizeof(float) * 2 * kStage * hd;
  if (smem_kv > 48 * 1024)
    TITAN_CUDA_CHECK(cudaFuncSetAttribute(split_dkdv_kernel<DP>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          (int)smem_kv));
  if (smem_q > 48 * 1024)
    TITAN_CUDA_CHECK(
        cudaFuncSetAttribute(split_dq_kernel<DP>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_q));
  const unsigned tiles = (unsigned)((T + kPer - 1) / kPer);
  launch(split_dkdv_kernel<DP>, dim3(tiles, (unsigned)nKV, (unsigned)B), kThreads, smem_kv, dk, dv, dout, q,
         k, v, lse, D, T, nH, nKV, hd, scale, doc_start);
  launch(split_dq_kernel<DP>, dim3(tiles, (unsigned)nH, (unsigned)B), kThreads, smem_q, dq, dout, q, k, v,
         lse, D, T, nH, nKV, hd, scale, doc_start);
}

void split_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                    const float* v, const float* out, const float* lse, int64_t B, int64_t T, int64_t nH,
                    int64_t nKV, int64_t hd, const int32_t* doc_start) {
  if (B * T * nH == 0) return;
  TITAN_CHECK(hd > 0 && hd <= 256, "CUDA flash attention: head_dim ", hd, " not in [1, 256]");
  Scratch<float> D(B * nH * T);
  flash_rowdot(D.p, dout, out, B, T, nH, hd);
  const float scale = 1.0f / std::sqrt((float)hd);
  const int64_t dp = (hd + kGroups - 1) / kGroups;
  if (dp <= 2)
    launch_split<2>(dq, dk, dv, dout, q, k, v, lse, D.p, B, T, nH, nKV, hd, scale, doc_start);
  else if (dp <= 4)
    launch_split<4>(dq, dk, dv, dout, q, k, v, lse, D.p, B, T, nH, nKV, hd, scale, doc_start);
  else if (dp <= 8)
    launch_split<8>(dq, dk, dv, dout, q, k, v, lse, D.p, B, T, nH, nKV, hd, scale, doc_start);
  else if (dp <= 16)
    launch_split<16>(dq, dk, dv, dout, q, k, v, lse, D.p, B, T, nH, nKV, hd, scale, doc_start);
  else
    launch_split<32>(dq, dk, dv, dout, q, k, v, lse, D.p, B, T, nH, nKV, hd, scale, doc_start);
}

// The default: forward + backward 1.56x "flash" on an H200 (bench/BENCHMARKS.md, B4 T2048 hd128).
const AttentionKernels kFlashSplit{flash_forward, split_backward, flash_saved_floats};
TITAN_REGISTER_KERNEL(AttentionKernels, CUDA, "flash_split", kFlashSplit, 20);

}  // namespace
}  // namespace titan::cuda
