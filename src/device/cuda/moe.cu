// Routed SwiGLU experts on the GPU (ops "moe_experts" and "moe_experts_bf16", impl "grouped"): the token
// slots are sorted by expert (counting sort on the host from the routing table: the per-expert GEMM
// sizes are needed there anyway), gathered into contiguous rows, and each expert's rows go through two
// cuBLASLt GEMMs (f32, or bf16 operands with f32 accumulation). SwiGLU, the weighted combine and the
// scatter of dx stay f32; slots are combined in the order s = 0..k-1 as the reference does.
//
// forward:  xs = x[token(r)] (Nk,H);  gu_e = xs_e W_gu_e^T (c_e,2I);  act = silu(gate) up;
//           y_e = act_e W_down_e^T (c_e,H);  out[n] = sum_s w[n,s] y[row(n,s)]
// backward: dy = dout[token(r)];  g_e = dy_e W_down_e (c_e,I);  dw[slot] += <g, act>;  dact = w g;
//           dgu = swiglu'(dact);  dW_down_e += dy_e^T (w act)_e;  dW_gu_e += dgu_e^T xs_e;
//           dxs_e = dgu_e W_gu_e;  dx[n] += sum_s dxs[row(n,s)]
// Saved (MoeExpertsBuffers): gu and act in the sorted row order, order/row_of/offsets on the device.
//
// impl "device_routed": the same layout and element kernels, with the routing and the expert GEMMs on the
// device: a stable counting sort by kernels (each expert's slots in ascending slot order, as route() does)
// and grouped GEMM kernels that find each expert's rows from the offsets in device memory. Nothing waits for
// the device, reads it from the host or depends on the routing's counts on the host, so a CUDA graph holds
// the MoE layer and replays it for any routing (compile mode). A slot whose expert index lies outside
// [0, E) is left unrouted: it contributes nothing and gets no gradient (expert parallel's fixed-capacity
// exchange pads with such rows). The GEMMs run on CUDA cores (32 x 32 tiles, f32 accumulation; bf16 rounds
// the operands first), each output summed in index order: deterministic, its bits those of neither cuBLAS
// path.
#include <cuda_runtime.h>

#include <vector>

#include "device/cuda/cuda_common.cuh"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan::cuda {
namespace {

// Sorted layout from idx (N,k): rows of expert e are [offsets[e], offsets[e+1]), slots in ascending order.
// Writes order/row_of/offsets to the device buffers and returns the offsets on the host.
std::vector<int32_t> route(const MoeExpertsBuffers& buf, const int32_t* idx, int64_t Nk, int64_t E) {
  std::vector<int32_t> h_idx(Nk), order(Nk), row_of(Nk), offsets(E + 1, 0);
  TITAN_CUDA_CHECK(cudaMemcpyAsync(h_idx.data(), idx, Nk * 4, cudaMemcpyDeviceToHost, cuda_stream()));
  TITAN_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
  for (int64_t s = 0; s < Nk; ++s) {
    TITAN_CHECK(h_idx[s] >= 0 && h_idx[s] < E, "moe_experts: expert index ", h_idx[s], " of slot ", s,
                " not in [0, ", E, ")");
    ++offsets[h_idx[s] + 1];
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  std::vector<int32_t> fill(offsets.begin(), offsets.end() - 1);
  for (int64_t s = 0; s < Nk; ++s) {
    const int32_t r = fill[h_idx[s]]++;
    order[r] = int32_t(s), row_of[s] = r;
  }
  TITAN_CUDA_CHECK(cudaMemcpyAsync(buf.order, order.data(), Nk * 4, cudaMemcpyHostToDevice, cuda_stream()));
  TITAN_CUDA_CHECK(cudaMemcpyAsync(buf.row_of, row_of.data(), Nk * 4, cudaMemcpyHostToDevice, cuda_stream()));
  TITAN_CUDA_CHECK(
      cudaMemcpyAsync(buf.offsets, offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice, cuda_stream()));
  TITAN_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));  // the host vectors go out of scope
  return offsets;
}

// The device-routed kernels may leave slots unrouted (an expert index outside [0, E): expert parallel's
// padding rows): the sorted rows end at *rows_end (offsets[E]; null: every row is routed) and such a slot's
// row_of is -1. The element kernels below skip the rows past the end and the unrouted slots.

// dst[r] = src[order[r] / k] (rows of H), r < Nk.  grid Nk, block 128.
__global__ void gather_rows_kernel(float* dst, const float* src, const int32_t* order, int64_t k, int64_t H,
                                   const int32_t* rows_end) {
  const int64_t r = blockIdx.x;
  if (rows_end && r >= *rows_end) return;
  const int64_t n = order[r] / k;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) dst[r * H + h] = src[n * H + h];
}

// act = silu(gu[:, :I]) * gu[:, I:], rows of the sorted layout.
__global__ void moe_swiglu_kernel(float* act, const float* gu, int64_t rows, int64_t I,
                                  const int32_t* rows_end) {
  const int64_t used = rows_end ? *rows_end : rows;
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < used * I;
       e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = e / I, i = e % I;
    const float g = gu[r * 2 * I + i], u = gu[r * 2 * I + I + i];
    act[e] = g / (1.0f + expf(-g)) * u;
  }
}

// out[n] = sum_s w[n,s] y[row_of[n k + s]].  grid N, block 128.
__global__ void combine_kernel(float* out, const float* y, const float* w, const int32_t* row_of, int64_t k,
                               int64_t H) {
  const int64_t n = blockIdx.x;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    float acc = 0.0f;
    for (int64_t s = 0; s < k; ++s) {
      const int32_t r = row_of[n * k + s];
      if (r >= 0) acc += w[n * k + s] * y[r * H + h];
    }
    out[n * H + h] = acc;
  }
}

// Per sorted row r (slot = order[r], weight ws): dw[slot] += <g_r, act_r>; wact_r = ws act_r;
// dgu_r = swiglu'(ws g_r).  grid Nk, block 128.
__global__ void moe_backward_rows_kernel(float* dw, float* wact, float* dgu, const float* g, const float* act,
                                         const float* gu, const float* w, const int32_t* order, int64_t I,
                                         const int32_t* rows_end) {
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  if (rows_end && r >= *rows_end) return;
  const int32_t slot = order[r];
  const float ws = w[slot];
  float dot = 0.0f;
  for (int64_t i = threadIdx.x; i < I; i += blockDim.x) {
    const float gi = g[r * I + i], a = gu[r * 2 * I + i], u = gu[r * 2 * I + I + i];
    dot += gi * act[r * I + i];
    wact[r * I + i] = ws * act[r * I + i];
    const float sg = 1.0f / (1.0f + expf(-a)), da = ws * gi;
    dgu[r * 2 * I + i] = da * u * sg * (1.0f + a * (1.0f - sg));
    dgu[r * 2 * I + I + i] = da * a * sg;
  }
  dot = block_sum(dot, red);
  if (threadIdx.x == 0) dw[slot] += dot;
}

// dx[n] += sum_s dxs[row_of[n k + s]].  grid N, block 128.
__global__ void scatter_dx_kernel(float* dx, const float* dxs, const int32_t* row_of, int64_t k, int64_t H) {
  const int64_t n = blockIdx.x;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    float acc = 0.0f;
    for (int64_t s = 0; s < k; ++s) {
      const int32_t r = row_of[n * k + s];
      if (r >= 0) acc += dxs[r * H + h];
    }
    dx[n * H + h] += acc;
  }
}

const int32_t* const kAll = nullptr;  // (rows_end: every slot routed)

template <bool kBf16>
void moe_forward(float* out, const MoeExpertsBuffers& buf, const float* x, const int32_t* idx, const float* w,
                 const float* w_gu, const float* w_down, int64_t N, int64_t k, int64_t E, int64_t H,
                 int64_t I) {
  const int64_t Nk = N * k;
  if (N == 0) return;
  const auto off = route(buf, idx, Nk, E);
  float* xs = buf.scratch;  // (Nk, H)
  float* y = xs + Nk * H;   // (Nk, H)
  launch(gather_rows_kernel, Nk, 128, 0, xs, x, buf.order, k, H, kAll);
  for (int64_t e = 0; e < E; ++e) {  // gu_e (c,2I) = xs_e W_gu_e^T
    const int64_t r0 = off[e], c = off[e + 1] - off[e];
    gemm_f32_or_bf16(kBf16, true, false, 2 * I, c, H, w_gu + e * 2 * I * H, H, xs + r0 * H, H,
                     buf.gu + r0 * 2 * I, 2 * I, 0.0f);
  }
  launch(moe_swiglu_kernel, blocks_for(Nk * I, 256), 256, 0, buf.act, buf.gu, Nk, I, kAll);
  for (int64_t e = 0; e < E; ++e) {  // y_e (c,H) = act_e W_down_e^T
    const int64_t r0 = off[e], c = off[e + 1] - off[e];
    gemm_f32_or_bf16(kBf16, true, false, H, c, I, w_down + e * H * I, I, buf.act + r0 * I, I, y + r0 * H, H,
                     0.0f);
  }
  launch(combine_kernel, N, 128, 0, out, y, w, buf.row_of, k, H);
}

template <bool kBf16>
void moe_backward(float* dx, float* dw, float* dw_gu, float* dw_down, const MoeExpertsBuffers& buf,
                  const float* dout, const float* x, const int32_t* idx, const float* w, const float* w_gu,
                  const float* w_down, int64_t N, int64_t k, int64_t E, int64_t H, int64_t I) {
  const int64_t Nk = N * k;
  if (N == 0) return;
  std::vector<int32_t> off(E + 1);
  TITAN_CUDA_CHECK(
      cudaMemcpyAsync(off.data(), buf.offsets, (E + 1) * 4, cudaMemcpyDeviceToHost, cuda_stream()));
  TITAN_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
  float* xs = buf.scratch;     // (Nk, H)
  float* dy = xs + Nk * H;     // (Nk, H), later dxs
  float* g = dy + Nk * H;      // (Nk, I)
  float* wact = g + Nk * I;    // (Nk, I)
  float* dgu = wact + Nk * I;  // (Nk, 2I)
  launch(gather_rows_kernel, Nk, 128, 0, xs, x, buf.order, k, H, kAll);
  launch(gather_rows_kernel, Nk, 128, 0, dy, dout, buf.order, k, H, kAll);
  for (int64_t e = 0; e < E; ++e) {  // g_e (c,I) = dy_e W_down_e
    const int64_t r0 = off[e], c = off[e + 1] - off[e];
    gemm_f32_or_bf16(kBf16, false, false, I, c, H, w_down + e * H * I, I, dy + r0 * H, H, g + r0 * I, I,
                     0.0f);
  }
  launch(moe_backward_rows_kernel, Nk, 128, 0, dw, wact, dgu, g, buf.act, buf.gu, w, buf.order, I, kAll);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = off[e], c = off[e + 1] - off[e];
    if (c == 0) continue;
    // dW_down_e (H,I) += dy_e^T (w act)_e;  dW_gu_e (2I,H) += dgu_e^T xs_e
    gemm_f32_or_bf16(kBf16, false, true, I, H, c, wact + r0 * I, I, dy + r0 * H, H, dw_down + e * H * I, I,
                     1.0f);
    gemm_f32_or_bf16(kBf16, false, true, H, 2 * I, c, xs + r0 * H, H, dgu + r0 * 2 * I, 2 * I,
                     dw_gu + e * 2 * I * H, H, 1.0f);
    // dxs_e (c,H) = dgu_e W_gu_e, into dy's rows (dy_e is read above, before this on the stream)
    gemm_f32_or_bf16(kBf16, false, false, H, c, 2 * I, w_gu + e * 2 * I * H, H, dgu + r0 * 2 * I, 2 * I,
                     dy + r0 * H, H, 0.0f);
  }
  launch(scatter_dx_kernel, N, 128, 0, dx, dy, buf.row_of, k, H);
}

// ---- device_routed ----

// Slots of expert e = blockIdx.x counted into offsets[e + 1] (offsets[0] = 0).  grid E, block 256.
__global__ void count_slots_kernel(int32_t* offsets, const int32_t* idx, int64_t Nk) {
  __shared__ int32_t red[32];
  const int32_t e = blockIdx.x;
  int32_t c = 0;
  for (int64_t s = threadIdx.x; s < Nk; s += blockDim.x) c += idx[s] == e;
  c = block_sum(c, red);
  if (threadIdx.x == 0) {
    offsets[e + 1] = c;
    if (e == 0) offsets[0] = 0;
  }
}

// offsets[e + 1] += offsets[e], e = 0..E-1 (one thread).
__global__ void prefix_offsets_kernel(int32_t* offsets, int64_t E) {
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
}

// Expert e = blockIdx.x: its slots in ascending order take rows offsets[e], offsets[e] + 1, ...
// (order[row] = slot, row_of[slot] = row), by block_stable_compact.  grid E, block 256.
__global__ void place_slots_kernel(int32_t* order, int32_t* row_of, const int32_t* offsets,
                                   const int32_t* idx, int64_t Nk) {
  __shared__ int32_t scan[256];
  const int32_t e = blockIdx.x, base = offsets[e];
  block_stable_compact(
      Nk, scan, [&](int64_t s) { return idx[s] == e; },
      [&](int64_t s, int64_t j) {
        const int32_t r = base + static_cast<int32_t>(j);
        order[r] = static_cast<int32_t>(s), row_of[s] = r;
      });
}

// row_of[s] = -1 for the slots naming no expert in [0, E) (unrouted).
__global__ void mark_unrouted_kernel(int32_t* row_of, const int32_t* idx, int64_t Nk, int64_t E) {
  TITAN_GRID_STRIDE(s, Nk) {
    if (idx[s] < 0 || idx[s] >= E) row_of[s] = -1;
  }
}

void route_on_device(const MoeExpertsBuffers& buf, const int32_t* idx, int64_t Nk, int64_t E) {
  launch(mark_unrouted_kernel, blocks_for(Nk, 256), 256, 0, buf.row_of, idx, Nk, E);
  launch(count_slots_kernel, E, 256, 0, buf.offsets, idx, Nk);
  launch(prefix_offsets_kernel, 1, 1, 0, buf.offsets, E);
  launch(place_slots_kernel, E, 256, 0, buf.order, buf.row_of, static_cast<const int32_t*>(buf.offsets), idx,
         Nk);
}

// Grouped GEMM tiles: 32 x 32 outputs per block of 32 x 8 threads, k in steps of 32.
constexpr int kTile = 32;

// An operand element as the GEMM multiplies it: f32, or rounded to bf16 (nearest even) first.
template <bool kBf16>
__device__ inline float operand(float x) {
  return kBf16 ? bf16_bits_to_f32(f32_to_bf16_bits(x)) : x;
}

// The expert and first row of row tile t (tiles of kTile rows, each inside one expert's rows, experts in
// order); false past the last tile. Every thread of a block computes the same.
__device__ inline bool row_tile(const int32_t* offsets, int64_t E, int64_t t, int64_t* e_out, int64_t* r0,
                                int64_t* r1) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = offsets[e + 1] - offsets[e], tiles = (c + kTile - 1) / kTile;
    if (t < tiles) {
      *e_out = e, *r0 = offsets[e] + t * kTile, *r1 = offsets[e + 1];
      return true;
    }
    t -= tiles;
  }
  return false;
}

// Per expert e, for its rows r:  C[r, j] = sum_k A[r, k] W_e(j, k),  W_e(j, k) = w[e] (J, K) row-major at
// [j K + k] when kWT (A W_e^T), else (K, J) at [k J + j] (A W_e). A (rows, K), C (rows, J) row-major.
// grid (ceil(J / 32), ceil(Nk / 32) + E), block (32, 8): each thread 4 rows of one column.
template <bool kBf16, bool kWT>
__global__ void grouped_rows_gemm_kernel(float* C, const float* A, const float* w, const int32_t* offsets,
                                         int64_t E, int64_t K, int64_t J) {
  __shared__ float As[kTile][kTile + 1], Ws[kTile][kTile + 1];  // As[row][k], Ws[k][col]
  int64_t e, r0, r1;
  if (!row_tile(offsets, E, blockIdx.y, &e, &r0, &r1)) return;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t j0 = (int64_t)blockIdx.x * kTile;
  const float* W = w + e * J * K;
  float acc[4] = {0, 0, 0, 0};
  for (int64_t k0 = 0; k0 < K; k0 += kTile) {
    for (int i = ty; i < kTile; i += 8) {
      const int64_t r = r0 + i, k = k0 + tx;
      As[i][tx] = r < r1 && k < K ? operand<kBf16>(A[r * K + k]) : 0.0f;
      // Ws[kk][jj] = W_e(j0 + jj, k0 + kk)
      if (kWT) {
        const int64_t j = j0 + i, kk = k0 + tx;  // (coalesced along k)
        Ws[tx][i] = j < J && kk < K ? operand<kBf16>(W[j * K + kk]) : 0.0f;
      } else {
        const int64_t kk = k0 + i, j = j0 + tx;  // (coalesced along j)
        Ws[i][tx] = j < J && kk < K ? operand<kBf16>(W[kk * J + j]) : 0.0f;
      }
    }
    __syncthreads();
    for (int kk = 0; kk < kTile; ++kk)
      for (int q = 0; q < 4; ++q) acc[q] += As[ty + 8 * q][kk] * Ws[kk][tx];
    __syncthreads();
  }
  for (int q = 0; q < 4; ++q) {
    const int64_t r = r0 + ty + 8 * q, j = j0 + tx;
    if (r < r1 && j < J) C[r * J + j] = acc[q];
  }
}

// Per expert e: dW_e (M, J) += sum over its rows r of A[r, m] B[r, j]  (A (rows, M), B (rows, J), dW
// row-major (E, M, J)); the rows summed in order. grid (ceil(J / 32), ceil(M / 32), E), block (32, 8).
template <bool kBf16>
__global__ void grouped_weight_grad_kernel(float* dW, const float* A, const float* B, const int32_t* offsets,
                                           int64_t M, int64_t J) {
  __shared__ float As[kTile][kTile + 1], Bs[kTile][kTile + 1];  // As[row][m], Bs[row][j]
  const int64_t e = blockIdx.z, r0 = offsets[e], r1 = offsets[e + 1];
  if (r1 == r0) return;  // (no rows: dW_e unchanged)
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t m0 = (int64_t)blockIdx.y * kTile, j0 = (int64_t)blockIdx.x * kTile;
  float acc[4] = {0, 0, 0, 0};
  for (int64_t rb = r0; rb < r1; rb += kTile) {
    for (int i = ty; i < kTile; i += 8) {
      const int64_t r = rb + i;
      As[i][tx] = r < r1 && m0 + tx < M ? operand<kBf16>(A[r * M + m0 + tx]) : 0.0f;
      Bs[i][tx] = r < r1 && j0 + tx < J ? operand<kBf16>(B[r * J + j0 + tx]) : 0.0f;
    }
    __syncthreads();
    for (int i = 0; i < kTile; ++i)
      for (int q = 0; q < 4; ++q) acc[q] += As[i][ty + 8 * q] * Bs[i][tx];
    __syncthreads();
  }
  float* D = dW + e * M * J;
  for (int q = 0; q < 4; ++q) {
    const int64_t m = m0 + ty + 8 * q, j = j0 + tx;
    if (m < M && j < J) D[m * J + j] += acc[q];
  }
}

template <bool kBf16, bool kWT>
void grouped_rows_gemm(float* C, const float* A, const float* w, const int32_t* offsets, int64_t Nk,
                       int64_t E, int64_t K, int64_t J) {
  const dim3 grid(static_cast<unsigned>((J + kTile - 1) / kTile),
                  static_cast<unsigned>((Nk + kTile - 1) / kTile + E));
  launch(grouped_rows_gemm_kernel<kBf16, kWT>, grid, dim3(kTile, 8), 0, C, A, w, offsets, E, K, J);
}

template <bool kBf16>
void grouped_weight_grad(float* dW, const float* A, const float* B, const int32_t* offsets, int64_t E,
                         int64_t M, int64_t J) {
  const dim3 grid(static_cast<unsigned>((J + kTile - 1) / kTile),
                  static_cast<unsigned>((M + kTile - 1) / kTile), static_cast<unsigned>(E));
  launch(grouped_weight_grad_kernel<kBf16>, grid, dim3(kTile, 8), 0, dW, A, B, offsets, M, J);
}

template <bool kBf16>
void moe_forward_device(float* out, const MoeExpertsBuffers& buf, const float* x, const int32_t* idx,
                        const float* w, const float* w_gu, const float* w_down, int64_t N, int64_t k,
                        int64_t E, int64_t H, int64_t I) {
  const int64_t Nk = N * k;
  if (N == 0) return;
  route_on_device(buf, idx, Nk, E);
  const int32_t* end = buf.offsets + E;  // (slots outside [0, E) unrouted)
  float* xs = buf.scratch;               // (Nk, H)
  float* y = xs + Nk * H;                // (Nk, H)
  launch(gather_rows_kernel, Nk, 128, 0, xs, x, buf.order, k, H, end);
  grouped_rows_gemm<kBf16, true>(buf.gu, xs, w_gu, buf.offsets, Nk, E, H, 2 * I);  // gu_e = xs_e W_gu_e^T
  launch(moe_swiglu_kernel, blocks_for(Nk * I, 256), 256, 0, buf.act, buf.gu, Nk, I, end);
  grouped_rows_gemm<kBf16, true>(y, buf.act, w_down, buf.offsets, Nk, E, I, H);  // y_e = act_e W_down_e^T
  launch(combine_kernel, N, 128, 0, out, y, w, buf.row_of, k, H);
}

template <bool kBf16>
void moe_backward_device(float* dx, float* dw, float* dw_gu, float* dw_down, const MoeExpertsBuffers& buf,
                         const float* dout, const float* x, const int32_t* idx, const float* w,
                         const float* w_gu, const float* w_down, int64_t N, int64_t k, int64_t E, int64_t H,
                         int64_t I) {
  const int64_t Nk = N * k;
  if (N == 0) return;
  float* xs = buf.scratch;     // (Nk, H)
  float* dy = xs + Nk * H;     // (Nk, H), later dxs
  float* g = dy + Nk * H;      // (Nk, I)
  float* wact = g + Nk * I;    // (Nk, I)
  float* dgu = wact + Nk * I;  // (Nk, 2I)
  const int32_t* end = buf.offsets + E;
  launch(gather_rows_kernel, Nk, 128, 0, xs, x, buf.order, k, H, end);
  launch(gather_rows_kernel, Nk, 128, 0, dy, dout, buf.order, k, H, end);
  grouped_rows_gemm<kBf16, false>(g, dy, w_down, buf.offsets, Nk, E, H, I);  // g_e = dy_e W_down_e
  launch(moe_backward_rows_kernel, Nk, 128, 0, dw, wact, dgu, g, buf.act, buf.gu, w, buf.order, I, end);
  grouped_weight_grad<kBf16>(dw_down, dy, wact, buf.offsets, E, H, I);   // dW_down_e += dy_e^T (w act)_e
  grouped_weight_grad<kBf16>(dw_gu, dgu, xs, buf.offsets, E, 2 * I, H);  // dW_gu_e += dgu_e^T xs_e
  grouped_rows_gemm<kBf16, false>(dy, dgu, w_gu, buf.offsets, Nk, E, 2 * I, H);  // dxs_e = dgu_e W_gu_e
  launch(scatter_dx_kernel, N, 128, 0, dx, dy, buf.row_of, k, H);
}

const MoeExpertsKernels kMoe{moe_forward<false>, moe_backward<false>};
const MoeExpertsBf16Kernels kMoeBf16{{moe_forward<true>, moe_backward<true>}};
TITAN_REGISTER_KERNEL(MoeExpertsKernels, CUDA, "grouped", kMoe, 10);
TITAN_REGISTER_KERNEL(MoeExpertsBf16Kernels, CUDA, "grouped", kMoeBf16, 10);
const MoeExpertsKernels kMoeDevice{moe_forward_device<false>, moe_backward_device<false>};
const MoeExpertsBf16Kernels kMoeDeviceBf16{{moe_forward_device<true>, moe_backward_device<true>}};
TITAN_REGISTER_KERNEL(MoeExpertsKernels, CUDA, "device_routed", kMoeDevice, 5);
TITAN_REGISTER_KERNEL(MoeExpertsBf16Kernels, CUDA, "device_routed", kMoeDeviceBf16, 5);

}  // namespace
}  // namespace titan::cuda
