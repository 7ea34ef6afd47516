// Causal GQA flash attention in f32 (op "attention", impl "flash"): online softmax over 32-key tiles in
// the forward, which saves only the row logsumexp (B,nH,T), like the CPU "flash"; the backward recomputes
// each probability from it. No [T,T] buffer exists. Correctness first: one warp per query row, plain f32
// FMAs (no tensor cores), so the result matches the CPU kernels to f32 rounding.
//
// forward, grid (ceil(T/8), nH, B), block 8 warps, warp w owns query row i = 8 blockIdx.x + w:
//   for key tiles J (32 keys in shared memory, K and V of kv head h / rep):
//     lane j: s_j = scale q_i . k_j (masked j > i);  m' = max(m, max_j s_j);  p_j = exp(s_j - m')
//     l = l exp(m - m') + sum p_j;  o = o exp(m - m') + sum_j p_j v_j   (lane owns dims d = lane + 32 r)
//   out_i = o / l;  lse_i = m + log l
// backward, D_i = dO_i . O_i first; then grid (ceil(T/32), nKV, B), block 4 warps: the block owns key
// tile J of kv head kh, so it alone writes dK_J and dV_J (accumulated in shared memory, added once);
// its warps take the query rows (h in kh's group, i >= j0) in turn:
//   p_j = exp(scale q_i . k_j - lse_i);  dp_j = dO_i . v_j;  ds_j = p_j (dp_j - D_i) scale
//   dV_j += p_j dO_i;  dK_j += ds_j q_i;  dQ_i += sum_j ds_j k_j   (atomics: key tiles race on dQ_i)
// Packed rows (doc_start): keys before the row's document start are masked too; tiles wholly before it are
// skipped.
#include <cuda_runtime.h>

#include <cmath>

#include "device/cuda/attention.cuh"
#include "device/cuda/cuda_common.cuh"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan::cuda {
namespace {

constexpr int kTile = 32;     // keys per shared-memory tile
constexpr int kFwdWarps = 8;  // query rows per forward block
constexpr int kBwdWarps = 4;  // warps per backward block

int64_t padded(int64_t hd) {  // odd row stride: lane j reading row j, column d hits 32 different banks
  return hd | 1;
}

template <int R>
__global__ void flash_forward_kernel(float* out, float* lse, const float* q, const float* k, const float* v,
                                     int64_t T, int64_t nH, int64_t nKV, int64_t hd, float scale,
                                     const int32_t* doc_start) {
  TITAN_DYNAMIC_SHARED(float, smem);
  const int64_t ks = hd | 1;
  float* Ks = smem;             // [kTile][ks]
  float* Vs = Ks + kTile * ks;  // [kTile][ks]
  float* Qs = Vs + kTile * ks;  // [kFwdWarps][hd]
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t b = blockIdx.z, h = blockIdx.y, kh = h / (nH / nKV);
  const int64_t i0 = (int64_t)blockIdx.x * kFwdWarps, i = i0 + w;
  const int64_t last = min(T - 1, i0 + kFwdWarps - 1);
  const bool active = i < T;
  const int64_t lo = active && doc_start ? doc_start[b * T + i] : 0;  // first key of the row's document
  float* qs = Qs + w * hd;
  if (active)
    for (int64_t d = lane; d < hd; d += 32) qs[d] = q[((b * T + i) * nH + h) * hd + d];
  float m = -INFINITY, l = 0.0f, o[R];
#pragma unroll
  for (int r = 0; r < R; ++r) o[r] = 0.0f;
  for (int64_t j0 = 0; j0 <= last; j0 += kTile) {
    __syncthreads();  // the previous tile is no longer read
    load_kv_tile(Ks, Vs, k, v, b, T, nKV, kh, hd, j0, kTile);
    __syncthreads();
    if (!active || j0 > i || j0 + kTile <= lo) continue;  // warp-uniform
    const int64_t j = j0 + lane;
    const int nvalid = i - j0 + 1 < kTile ? (int)(i - j0 + 1) : kTile;
    flash_forward_tile<R>(m, l, o, qs, Ks, Vs, j >= lo && j <= i, scale, nvalid, hd);
  }
  if (!active) return;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t d = lane + 32 * r;
    if (d < hd) out[((b * T + i) * nH + h) * hd + d] = o[r] / l;
  }
  if (lane == 0) lse[(b * nH + h) * T + i] = m + logf(l);
}

// D[(b,h),i] = dO_i . O_i, one warp per row.  grid ceil(B T nH / 8), block 256.
__global__ void flash_rowdot_kernel(float* D, const float* dout, const float* out, int64_t B, int64_t T,
                                    int64_t nH, int64_t hd) {
  const int64_t row = (int64_t)blockIdx.x * 8 + (threadIdx.x >> 5);  // (b, i, h) in memory order
  const int lane = threadIdx.x & 31;
  if (row >= B * T * nH) return;
  float acc = 0.0f;
  for (int64_t d = lane; d < hd; d += 32) acc += dout[row * hd + d] * out[row * hd + d];
  acc = warp_sum(acc);
  const int64_t h = row % nH, bi = row / nH, b = bi / T, i = bi % T;
  if (lane == 0) D[(b * nH + h) * T + i] = acc;
}

template <int R>
__global__ void flash_backward_kernel(float* dq, float* dk, float* dv, const float* dout, const float* q,
                                      const float* k, const float* v, const float* lse, const float* D,
                                      int64_t T, int64_t nH, int64_t nKV, int64_t hd, float scale,
                                      const int32_t* doc_start) {
  TITAN_DYNAMIC_SHARED(float, smem);
  const int64_t ks = hd | 1;
  float* Ks = smem;                  // [kTile][ks]
  float* Vs = Ks + kTile * ks;       // [kTile][ks]
  float* dKs = Vs + kTile * ks;      // [kTile][ks]
  float* dVs = dKs + kTile * ks;     // [kTile][ks]
  float* Qs = dVs + kTile * ks;      // [kBwdWarps][hd]
  float* dOs = Qs + kBwdWarps * hd;  // [kBwdWarps][hd]
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t b = blockIdx.z, kh = blockIdx.y, rep = nH / nKV, j0 = (int64_t)blockIdx.x * kTile;
  load_kv_tile(Ks, Vs, k, v, b, T, nKV, kh, hd, j0, kTile);
  for (int64_t e = threadIdx.x; e < kTile * hd; e += blockDim.x) {
    const int64_t at = e / hd * ks + e % hd;
    dKs[at] = dVs[at] = 0.0f;
  }
  __syncthreads();
  float* qs = Qs + w * hd;
  float* dos = dOs + w * hd;
  const int64_t rows_per_head = T - j0, total = rep * rows_per_head;
  for (int64_t ridx = w; ridx < total; ridx += kBwdWarps) {
    const int64_t h = kh * rep + ridx / rows_per_head, i = j0 + ridx % rows_per_head;
    const int64_t lo = doc_start ? doc_start[b * T + i] : 0;
    if (lo >= j0 + kTile) continue;  // the row's document starts after this key tile (warp-uniform)
    const int64_t base = ((b * T + i) * nH + h) * hd, j = j0 + lane;
    const int nvalid = i - j0 + 1 < kTile ? (int)(i - j0 + 1) : kTile;
    flash_backward_row<R>(dq + base, dKs, dVs, q + base, dout + base, qs, dos, Ks, Vs, j >= lo && j <= i,
                          lse[(b * nH + h) * T + i], D[(b * nH + h) * T + i], scale, nvalid, hd);
  }
  __syncthreads();
  store_dkv_tile(dk, dv, dKs, dVs, b, T, nKV, kh, hd, j0, kTile);
}

}  // namespace

void flash_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                   int64_t T, int64_t nH, int64_t nKV, int64_t hd, const int32_t* doc_start) {
  if (B * T * nH == 0) return;
  const size_t smem = sizeof(float) * (2 * kTile * padded(hd) + kFwdWarps * hd);
  dim3 grid((unsigned)((T + kFwdWarps - 1) / kFwdWarps), (unsigned)nH, (unsigned)B);
  const float scale = 1.0f / std::sqrt((float)hd);
  with_head_dim_r(hd, "CUDA flash attention", [&](auto r) {
    constexpr int R = decltype(r)::value;
    allow_smem(flash_forward_kernel<R>, smem);
    launch(flash_forward_kernel<R>, grid, kFwdWarps * 32, smem, out, lse, q, k, v, T, nH, nKV, hd, scale,
           doc_start);
  });
}

void flash_rowdot(float* D, const float* dout, const float* out, int64_t B, int64_t T, int64_t nH,
                  int64_t hd) {
  launch(flash_rowdot_kernel, blocks_for(B * T * nH, 8), 256, 0, D, dout, out, B, T, nH, hd);
}

void flash_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                    const float* v, const float* out, const float* lse, int64_t B, int64_t T, int64_t nH,
                    int64_t nKV, int64_t hd, const int32_t* doc_start) {
  if (B * T * nH == 0) return;
  Scratch<float> D(B * nH * T);
  flash_rowdot(D.p, dout, out, B, T, nH, hd);
  const size_t smem = sizeof(float) * (4 * kTile * padded(hd) + 2 * kBwdWarps * hd);
  dim3 grid((unsigned)((T + kTile - 1) / kTile), (unsigned)nKV, (unsigned)B);
  const float scale = 1.0f / std::sqrt((float)hd);
  with_head_dim_r(hd, "CUDA flash attention", [&](auto r) {
    constexpr int R = decltype(r)::value;
    allow_smem(flash_backward_kernel<R>, smem);
    launch(flash_backward_kernel<R>, grid, kBwdWarps * 32, smem, dq, dk, dv, dout, q, k, v, lse,
           (const float*)D.p, T, nH, nKV, hd, scale, doc_start);
  });
}

int64_t flash_saved_floats(int64_t B, int64_t T, int64_t nH) {
  return B * nH * T;
}

namespace {

const AttentionKernels kFlash{flash_forward, flash_backward, flash_saved_floats};
TITAN_REGISTER_KERNEL(AttentionKernels, CUDA, "flash", kFlash, 10);

}  // namespace
}  // namespace titan::cuda
