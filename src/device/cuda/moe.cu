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

// dst[r] = src[order[r] / k] (rows of H), r < Nk.  grid Nk, block 128.
__global__ void gather_rows_kernel(float* dst, const float* src, const int32_t* order, int64_t k, int64_t H) {
  const int64_t r = blockIdx.x, n = order[r] / k;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) dst[r * H + h] = src[n * H + h];
}

// act = silu(gu[:, :I]) * gu[:, I:], rows of the sorted layout.
__global__ void moe_swiglu_kernel(float* act, const float* gu, int64_t rows, int64_t I) {
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < rows * I;
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
    for (int64_t s = 0; s < k; ++s) acc += w[n * k + s] * y[row_of[n * k + s] * H + h];
    out[n * H + h] = acc;
  }
}

// Per sorted row r (slot = order[r], weight ws): dw[slot] += <g_r, act_r>; wact_r = ws act_r;
// dgu_r = swiglu'(ws g_r).  grid Nk, block 128.
__global__ void moe_backward_rows_kernel(float* dw, float* wact, float* dgu, const float* g, const float* act,
                                         const float* gu, const float* w, const int32_t* order, int64_t I) {
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
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
    for (int64_t s = 0; s < k; ++s) acc += dxs[row_of[n * k + s] * H + h];
    dx[n * H + h] += acc;
  }
}

template <bool kBf16>
void moe_forward(float* out, const MoeExpertsBuffers& buf, const float* x, const int32_t* idx, const float* w,
                 const float* w_gu, const float* w_down, int64_t N, int64_t k, int64_t E, int64_t H,
                 int64_t I) {
  const int64_t Nk = N * k;
  if (N == 0) return;
  const auto off = route(buf, idx, Nk, E);
  float* xs = buf.scratch;  // (Nk, H)
  float* y = xs + Nk * H;   // (Nk, H)
  launch(gather_rows_kernel, Nk, 128, 0, xs, x, buf.order, k, H);
  for (int64_t e = 0; e < E; ++e) {  // gu_e (c,2I) = xs_e W_gu_e^T
    const int64_t r0 = off[e], c = off[e + 1] - off[e];
    gemm_f32_or_bf16(kBf16, true, false, 2 * I, c, H, w_gu + e * 2 * I * H, H, xs + r0 * H, H,
                     buf.gu + r0 * 2 * I, 2 * I, 0.0f);
  }
  launch(moe_swiglu_kernel, blocks_for(Nk * I, 256), 256, 0, buf.act, buf.gu, Nk, I);
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
  launch(gather_rows_kernel, Nk, 128, 0, xs, x, buf.order, k, H);
  launch(gather_rows_kernel, Nk, 128, 0, dy, dout, buf.order, k, H);
  for (int64_t e = 0; e < E; ++e) {  // g_e (c,I) = dy_e W_down_e
    const int64_t r0 = off[e], c = off[e + 1] - off[e];
    gemm_f32_or_bf16(kBf16, false, false, I, c, H, w_down + e * H * I, I, dy + r0 * H, H, g + r0 * I, I,
                     0.0f);
  }
  launch(moe_backward_rows_kernel, Nk, 128, 0, dw, wact, dgu, g, buf.act, buf.gu, w, buf.order, I);
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

const MoeExpertsKernels kMoe{moe_forward<false>, moe_backward<false>};
const MoeExpertsBf16Kernels kMoeBf16{{moe_forward<true>, moe_backward<true>}};
TITAN_REGISTER_KERNEL(MoeExpertsKernels, CUDA, "grouped", kMoe, 10);
TITAN_REGISTER_KERNEL(MoeExpertsBf16Kernels, CUDA, "grouped", kMoeBf16, 10);

}  // namespace
}  // namespace titan::cuda
