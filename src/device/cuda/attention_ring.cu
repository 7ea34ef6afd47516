// Ring attention blocks on the GPU (op "attention_ring", impl "flash": context parallel, see
// AttentionRingKernels in kernels/ops.h). The same online softmax and tile structure as the flash kernels of
// attention.cu, with the mask taken from the rows' positions in the whole sequence instead of their indices:
// query i reads key j iff k_pos[j] <= q_pos[i] (and k_pos[j] >= key_start[b, i] for packed documents).
// A block's keys need not be causal against its queries (a rank's later chunk reads all of an earlier
// rank's keys), so no tile is skipped by its index; a tile without a readable key for a row is skipped by
// that row's warp, and a row that reads no key of the block gets out 0, lse -inf. Correctness first: plain
// f32 FMAs, one warp per query row (forward) and one block per key tile (backward), as attention.cu.
//
// forward, grid (ceil(Tq/8), nH, B), block 8 warps: warp w owns query row i = 8 blockIdx.x + w.
// merge, grid ceil(B Tq nH / 8), block 8 warps: one warp per (b, i, h) row.
// backward, D_i = dO_i . O_i first; then grid (ceil(Tk/32), nKV, B), block 4 warps: the block owns key tile
//   J of kv head kh and writes its dK_J, dV_J once; its warps take every query row of kh's heads in turn,
//   dQ_i by atomics (key tiles race on it).
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "device/cuda/attention.cuh"
#include "device/cuda/cuda_common.cuh"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan::cuda {
namespace {

constexpr int kTile = 32;
constexpr int kFwdWarps = 8;
constexpr int kBwdWarps = 4;

__device__ inline bool ring_reads(const int32_t* k_pos, int64_t j, int64_t Tk, int32_t qp, int32_t lo) {
  return j < Tk && k_pos[j] <= qp && k_pos[j] >= lo;
}

template <int R>
__global__ void ring_forward_kernel(float* out, float* lse, const float* q, const float* k, const float* v,
                                    int64_t Tq, int64_t Tk, int64_t nH, int64_t nKV, int64_t hd, float scale,
                                    const int32_t* q_pos, const int32_t* k_pos, const int32_t* key_start) {
  TITAN_DYNAMIC_SHARED(float, smem);
  const int64_t ks = hd | 1;
  float* Ks = smem;             // [kTile][ks]
  float* Vs = Ks + kTile * ks;  // [kTile][ks]
  float* Qs = Vs + kTile * ks;  // [kFwdWarps][hd]
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t b = blockIdx.z, h = blockIdx.y, kh = h / (nH / nKV);
  const int64_t i = (int64_t)blockIdx.x * kFwdWarps + w;
  const bool active = i < Tq;
  const int32_t qp = active ? q_pos[i] : -1, lo = active && key_start ? key_start[b * Tq + i] : INT32_MIN;
  float* qs = Qs + w * hd;
  if (active)
    for (int64_t d = lane; d < hd; d += 32) qs[d] = q[((b * Tq + i) * nH + h) * hd + d];
  float m = -INFINITY, l = 0.0f, o[R];
#pragma unroll
  for (int r = 0; r < R; ++r) o[r] = 0.0f;
  for (int64_t j0 = 0; j0 < Tk; j0 += kTile) {
    __syncthreads();  // the previous tile is no longer read
    load_kv_tile(Ks, Vs, k, v, b, Tk, nKV, kh, hd, j0, kTile);
    __syncthreads();
    if (!active) continue;  // warp-uniform
    const int n = Tk - j0 < kTile ? (int)(Tk - j0) : kTile;
    flash_forward_tile<R>(m, l, o, qs, Ks, Vs, ring_reads(k_pos, j0 + lane, Tk, qp, lo), scale, n, hd);
  }
  if (!active) return;
  const bool any = l > 0.0f;  // (a row without a key of this block: out 0, lse -inf)
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t d = lane + 32 * r;
    if (d < hd) out[((b * Tq + i) * nH + h) * hd + d] = any ? o[r] / l : 0.0f;
  }
  if (lane == 0) lse[(b * nH + h) * Tq + i] = any ? m + logf(l) : -INFINITY;
}

// (out, lse) := the merge of (out, lse) and (part_out, part_lse), one warp per (b, i, h) row.
__global__ void ring_merge_kernel(float* out, float* lse, const float* part_out, const float* part_lse,
                                  int64_t B, int64_t T, int64_t nH, int64_t hd) {
  const int64_t row = (int64_t)blockIdx.x * 8 + (threadIdx.x >> 5);  // (b, i, h) in memory order
  const int lane = threadIdx.x & 31;
  if (row >= B * T * nH) return;
  const int64_t h = row % nH, bi = row / nH, b = bi / T, i = bi % T;
  const int64_t at = (b * nH + h) * T + i;
  const float a = lse[at], p = part_lse[at];
  if (p == -INFINITY) return;  // the other block has no key for this row
  const float mx = fmaxf(a, p), merged = mx + logf(expf(a - mx) + expf(p - mx));
  const float ca = expf(a - merged), cp = expf(p - merged);
  for (int64_t d = lane; d < hd; d += 32)
    out[row * hd + d] = ca * out[row * hd + d] + cp * part_out[row * hd + d];
  __syncwarp();
  if (lane == 0) lse[at] = merged;
}

template <int R>
__global__ void ring_backward_kernel(float* dq, float* dk, float* dv, const float* dout, const float* q,
                                     const float* k, const float* v, const float* lse, const float* D,
                                     int64_t Tq, int64_t Tk, int64_t nH, int64_t nKV, int64_t hd, float scale,
                                     const int32_t* q_pos, const int32_t* k_pos, const int32_t* key_start) {
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
  load_kv_tile(Ks, Vs, k, v, b, Tk, nKV, kh, hd, j0, kTile);
  for (int64_t e = threadIdx.x; e < kTile * hd; e += blockDim.x) {
    const int64_t at = e / hd * ks + e % hd;
    dKs[at] = dVs[at] = 0.0f;
  }
  __syncthreads();
  const int n = Tk - j0 < kTile ? (int)(Tk - j0) : kTile;
  for (int64_t ridx = w; ridx < rep * Tq; ridx += kBwdWarps) {
    const int64_t h = kh * rep + ridx / Tq, i = ridx % Tq;
    const bool valid =
        ring_reads(k_pos, j0 + lane, Tk, q_pos[i], key_start ? key_start[b * Tq + i] : INT32_MIN);
    if (warp_max(valid ? 1.0f : 0.0f) == 0.0f) continue;  // no key of this tile for the row (warp-uniform)
    const int64_t base = ((b * Tq + i) * nH + h) * hd;
    flash_backward_row<R>(dq + base, dKs, dVs, q + base, dout + base, Qs + w * hd, dOs + w * hd, Ks, Vs,
                          valid, lse[(b * nH + h) * Tq + i], D[(b * nH + h) * Tq + i], scale, n, hd);
  }
  __syncthreads();
  store_dkv_tile(dk, dv, dKs, dVs, b, Tk, nKV, kh, hd, j0, kTile);
}

void ring_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                  int64_t Tq, int64_t Tk, int64_t nH, int64_t nKV, int64_t hd, const int32_t* q_pos,
                  const int32_t* k_pos, const int32_t* key_start) {
  if (B * Tq * nH == 0) return;
  const size_t smem = sizeof(float) * (2 * kTile * (hd | 1) + kFwdWarps * hd);
  const dim3 grid((unsigned)((Tq + kFwdWarps - 1) / kFwdWarps), (unsigned)nH, (unsigned)B);
  const float scale = 1.0f / std::sqrt((float)hd);
  with_head_dim_r(hd, "CUDA ring attention", [&](auto r) {
    constexpr int R = decltype(r)::value;
    allow_smem(ring_forward_kernel<R>, smem);
    launch(ring_forward_kernel<R>, grid, kFwdWarps * 32, smem, out, lse, q, k, v, Tq, Tk, nH, nKV, hd, scale,
           q_pos, k_pos, key_start);
  });
}

void ring_merge(float* out, float* lse, const float* part_out, const float* part_lse, int64_t B, int64_t T,
                int64_t nH, int64_t hd) {
  if (B * T * nH == 0) return;
  launch(ring_merge_kernel, blocks_for(B * T * nH, 8), 256, 0, out, lse, part_out, part_lse, B, T, nH, hd);
}

void ring_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                   const float* v, const float* out, const float* lse, int64_t B, int64_t Tq, int64_t Tk,
                   int64_t nH, int64_t nKV, int64_t hd, const int32_t* q_pos, const int32_t* k_pos,
                   const int32_t* key_start) {
  if (B * Tq * nH == 0 || Tk == 0) return;
  Scratch<float> D(B * nH * Tq);
  flash_rowdot(D.p, dout, out, B, Tq, nH, hd);
  const size_t smem = sizeof(float) * (4 * kTile * (hd | 1) + 2 * kBwdWarps * hd);
  const dim3 grid((unsigned)((Tk + kTile - 1) / kTile), (unsigned)nKV, (unsigned)B);
  const float scale = 1.0f / std::sqrt((float)hd);
  with_head_dim_r(hd, "CUDA ring attention", [&](auto r) {
    constexpr int R = decltype(r)::value;
    allow_smem(ring_backward_kernel<R>, smem);
    launch(ring_backward_kernel<R>, grid, kBwdWarps * 32, smem, dq, dk, dv, dout, q, k, v, lse,
           (const float*)D.p, Tq, Tk, nH, nKV, hd, scale, q_pos, k_pos, key_start);
  });
}

const AttentionRingKernels kRing{ring_forward, ring_merge, ring_backward};
TITAN_REGISTER_KERNEL(AttentionRingKernels, CUDA, "flash", kRing, 10);

}  // namespace
}  // namespace titan::cuda
