// Pieces of the CUDA flash attention shared by its implementations (attention.cu, attention_split.cu) and
// the ring attention blocks (attention_ring.cu).
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "device/cuda/cuda_common.cuh"

namespace titan::cuda {

// Forward: out (B,T,nH,hd) and the row logsumexp lse (B,nH,T) of the causal GQA attention.
void flash_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                   int64_t T, int64_t nH, int64_t nKV, int64_t hd, const int32_t* doc_start);
// Backward from out and lse: dq, dk, dv (shapes of q, k, v) accumulated.
void flash_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                    const float* v, const float* out, const float* lse, int64_t B, int64_t T, int64_t nH,
                    int64_t nKV, int64_t hd, const int32_t* doc_start);
// D (B,nH,T) = rowwise dO . O
void flash_rowdot(float* D, const float* dout, const float* out, int64_t B, int64_t T, int64_t nH,
                  int64_t hd);
int64_t flash_saved_floats(int64_t B, int64_t T, int64_t nH);

// ---- pieces of the flash kernels shared with the ring kernels (attention_ring.cu) ----

// Keys and values j0 .. j0 + kTile - 1 of kv head kh (zero past Tk) into shared tiles of row stride hd | 1,
// by the whole block. k/v (B,Tk,nKV,hd).
__device__ inline void load_kv_tile(float* Ks, float* Vs, const float* k, const float* v, int64_t b,
                                    int64_t Tk, int64_t nKV, int64_t kh, int64_t hd, int64_t j0, int tile) {
  const int64_t ks = hd | 1;
  for (int64_t e = threadIdx.x; e < tile * hd; e += blockDim.x) {
    const int64_t jj = e / hd, d = e % hd, j = j0 + jj;
    const int64_t src = ((b * Tk + j) * nKV + kh) * hd + d;
    Ks[jj * ks + d] = j < Tk ? k[src] : 0.0f;
    Vs[jj * ks + d] = j < Tk ? v[src] : 0.0f;
  }
}

// One warp's query row (qs: in shared memory) against a tile of n keys, online softmax: lane j scores key j
// where `valid`; m (running max), l (running sum) and o (lane owns dims lane + 32 r) updated. A tile without
// a valid key leaves them as they are.
template <int R>
__device__ inline void flash_forward_tile(float& m, float& l, float (&o)[R], const float* qs, const float* Ks,
                                          const float* Vs, bool valid, float scale, int n, int64_t hd) {
  const int64_t ks = hd | 1;
  const int lane = threadIdx.x & 31;
  float s = -INFINITY;
  if (valid) {
    float acc = 0.0f;
    for (int64_t d = 0; d < hd; ++d) acc += qs[d] * Ks[lane * ks + d];
    s = acc * scale;
  }
  const float tile_max = warp_max(s);
  if (tile_max == -INFINITY) return;  // (warp-uniform)
  const float m_new = fmaxf(m, tile_max);
  const float p = valid ? expf(s - m_new) : 0.0f;
  const float c = expf(m - m_new);  // 0 on the row's first tile with a key
  l = l * c + warp_sum(p);
#pragma unroll
  for (int r = 0; r < R; ++r) o[r] *= c;
  for (int jj = 0; jj < n; ++jj) {
    const float pj = __shfl_sync(0xffffffffu, p, jj);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t d = lane + 32 * r;
      if (d < hd) o[r] += pj * Vs[jj * ks + d];
    }
  }
  m = m_new;
}

// One warp's query row (q_row, do_row, dq_row: global rows of hd) against a tile of n keys in the backward:
// lane j, where `valid`, takes p = exp(scale q.k_j - lse), ds = p (dO.v_j - D) scale; then dV_j += p dO and
// dK_j += ds q in the shared tiles (atomics: the block's warps share them) and dQ += sum_j ds k_j (global
// atomics: key tiles race on it). qs/dos: the warp's shared rows.
template <int R>
__device__ inline void flash_backward_row(float* dq_row, float* dKs, float* dVs, const float* q_row,
                                          const float* do_row, float* qs, float* dos, const float* Ks,
                                          const float* Vs, bool valid, float lse_i, float D_i, float scale,
                                          int n, int64_t hd) {
  const int64_t ks = hd | 1;
  const int lane = threadIdx.x & 31;
  float qr[R], dor[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t d = lane + 32 * r;
    qr[r] = d < hd ? q_row[d] : 0.0f;
    dor[r] = d < hd ? do_row[d] : 0.0f;
    if (d < hd) qs[d] = qr[r], dos[d] = dor[r];
  }
  __syncwarp();
  float p = 0.0f, ds = 0.0f;
  if (valid) {
    float s = 0.0f, dp = 0.0f;
    for (int64_t d = 0; d < hd; ++d) {
      s += qs[d] * Ks[lane * ks + d];
      dp += dos[d] * Vs[lane * ks + d];
    }
    p = expf(s * scale - lse_i);
    ds = p * (dp - D_i) * scale;
  }
  float dqr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) dqr[r] = 0.0f;
  for (int jj = 0; jj < n; ++jj) {
    const float pj = __shfl_sync(0xffffffffu, p, jj), dsj = __shfl_sync(0xffffffffu, ds, jj);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t d = lane + 32 * r;
      if (d < hd) {
        atomicAdd(dVs + jj * ks + d, pj * dor[r]);
        atomicAdd(dKs + jj * ks + d, dsj * qr[r]);
        dqr[r] += dsj * Ks[jj * ks + d];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t d = lane + 32 * r;
    if (d < hd) atomicAdd(dq_row + d, dqr[r]);
  }
  __syncwarp();  // qs/dos are rewritten by this warp's next row
}

// Adds the shared dK/dV tiles of keys j0.. (zero past Tk) to dk/dv (B,Tk,nKV,hd), by the whole block.
__device__ inline void store_dkv_tile(float* dk, float* dv, const float* dKs, const float* dVs, int64_t b,
                                      int64_t Tk, int64_t nKV, int64_t kh, int64_t hd, int64_t j0, int tile) {
  const int64_t ks = hd | 1;
  for (int64_t e = threadIdx.x; e < tile * hd; e += blockDim.x) {
    const int64_t jj = e / hd, d = e % hd, j = j0 + jj;
    if (j >= Tk) continue;
    const int64_t dst = ((b * Tk + j) * nKV + kh) * hd + d;
    dk[dst] += dKs[jj * ks + d];
    dv[dst] += dVs[jj * ks + d];
  }
}

// Host side: raises a kernel's dynamic shared-memory limit when it needs more than the default 48 KiB.
template <class Kernel>
void allow_smem(Kernel kernel, size_t smem) {
  if (smem > 48 * 1024)
    TITAN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
}

// Runs f(std::integral_constant<int, R>) with R = ceil(hd / 32) rounded up to 1, 2, 4 or 8 (registers per
// lane and vector); `what` names the op in the error for a head_dim outside [1, 256].
template <class F>
void with_head_dim_r(int64_t hd, const char* what, F&& f) {
  TITAN_CHECK(hd > 0 && hd <= 256, what, ": head_dim ", hd, " not in [1, 256]");
  const int64_t r = (hd + 31) / 32;
  if (r <= 1)
    f(std::integral_constant<int, 1>{});
  else if (r <= 2)
    f(std::integral_constant<int, 2>{});
  else if (r <= 4)
    f(std::integral_constant<int, 4>{});
  else
    f(std::integral_constant<int, 8>{});
}

}  // namespace titan::cuda
