// Row and elementwise ops of the CUDA device (the contracts are in src/kernels/ops.h: forward overwrites,
// backward accumulates). Reductions run in f32 within a thread and combine across threads in f32
// (double where the CPU reference returns a double: the cross-entropy loss and sum_squares).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "device/cuda/cuda_common.cuh"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan::cuda {
namespace {

int row_threads(int64_t C) {
  return C >= 1024 ? 512 : C >= 256 ? 256 : 128;
}

// ---- RMSNorm -------------------------------------------------------------------------------------------
// grid N, block row_threads(C): one block per row. inp and out: f32, or bf16 bits (bf16 compute).
template <class In, class Out>
__global__ void rmsnorm_forward_kernel(Out* out, float* rstd, const In* inp, const float* w, int64_t C,
                                       float eps) {
  __shared__ float red[32];
  const In* x = inp + blockIdx.x * C;
  float ss = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) ss += load_value(x, c) * load_value(x, c);
  ss = block_sum(ss, red);
  const float r = 1.0f / sqrtf(ss / C + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
  Out* y = out + blockIdx.x * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) store_value(y, c, w[c] * (load_value(x, c) * r));
}

// dx += r dy w - x r^3 / C sum(dy w x)
template <class In>
__global__ void rmsnorm_backward_dx_kernel(float* dinp, const float* dout, const In* inp, const float* w,
                                           const float* rstd, int64_t C) {
  __shared__ float red[32];
  const In* x = inp + blockIdx.x * C;
  const float* dy = dout + blockIdx.x * C;
  float dot = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dot += dy[c] * w[c] * load_value(x, c);
  dot = block_sum(dot, red);
  const float r = rstd[blockIdx.x], k = r * r * r * dot / C;
  float* dx = dinp + blockIdx.x * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dx[c] += r * dy[c] * w[c] - load_value(x, c) * k;
}

// dw[c] += sum_n dy[n,c] x[n,c] r[n]: each chunk of rows summed by chunk_column_sums (grid (ceil(C/32), row
// chunks), block (32, 8)), the chunks added to dw in chunk order by add_column_sums.
template <class In>
__global__ void rmsnorm_backward_dw_kernel(float* out, const float* dout, const In* inp, const float* rstd,
                                           int64_t N, int64_t C, int64_t rows_per_chunk) {
  chunk_column_sums(out, N, C, rows_per_chunk, [&](int64_t n, int64_t c) {
    return dout[n * C + c] * load_value(inp, n * C + c) * rstd[n];
  });
}

template <class In, class Out>
void rmsnorm_forward(Out* out, float* rstd, const In* inp, const float* w, int64_t N, int64_t C, float eps) {
  if (N == 0) return;
  launch(rmsnorm_forward_kernel<In, Out>, N, row_threads(C), 0, out, rstd, inp, w, C, eps);
}

template <class In>
void rmsnorm_backward(float* dinp, float* dw, const float* dout, const In* inp, const float* w,
                      const float* rstd, int64_t N, int64_t C) {
  if (N == 0) return;
  launch(rmsnorm_backward_dx_kernel<In>, N, row_threads(C), 0, dinp, dout, inp, w, rstd, C);
  if (!dw) return;
  const int64_t chunks = std::min<int64_t>((N + 63) / 64, 256), rows = (N + chunks - 1) / chunks;
  Scratch<float> part(chunks * C);
  dim3 grid((C + 31) / 32, chunks), block(32, 8);
  launch(rmsnorm_backward_dw_kernel<In>, grid, block, 0, part.p, dout, inp, rstd, N, C, rows);
  add_column_sums(dw, part.p, chunks, C);
}

// ---- RoPE ----------------------------------------------------------------------------------------------
// One thread per (row n, head h, pair i < hd/2); position n % T. out may alias inp (each thread reads its
// pair before writing it).
template <bool kBackward>
__global__ void rope_kernel(float* out, const float* inp, const float* cos, const float* sin, int64_t N,
                            int64_t T, int64_t nh, int64_t hd) {
  const int64_t half = hd / 2, total = N * nh * half;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = idx % half, nhh = idx / half, n = nhh / nh;
    const float c = cos[(n % T) * half + i], s = sin[(n % T) * half + i];
    const float* x = inp + nhh * hd;
    float* y = out + nhh * hd;
    const float x1 = x[i], x2 = x[i + half];
    if (kBackward) {  // dx += R^T dy
      y[i] += x1 * c + x2 * s;
      y[i + half] += x2 * c - x1 * s;
    } else {
      y[i] = x1 * c - x2 * s;
      y[i + half] = x2 * c + x1 * s;
    }
  }
}

template <bool kBackward>
void rope_launch(float* out, const float* inp, const float* cos, const float* sin, int64_t N, int64_t T,
                 int64_t nh, int64_t hd) {
  const int64_t total = N * nh * (hd / 2);
  if (total == 0) return;
  launch(rope_kernel<kBackward>, blocks_for(total, 256), 256, 0, out, inp, cos, sin, N, T, nh, hd);
}

void rope_forward(float* out, const float* inp, const float* cos, const float* sin, int64_t N, int64_t T,
                  int64_t nh, int64_t hd) {
  rope_launch<false>(out, inp, cos, sin, N, T, nh, hd);
}
void rope_backward(float* dinp, const float* dout, const float* cos, const float* sin, int64_t N, int64_t T,
                   int64_t nh, int64_t hd) {
  rope_launch<true>(dinp, dout, cos, sin, N, T, nh, hd);
}
void rope_qk_forward(float* q, float* k, const float* cos, const float* sin, int64_t N, int64_t T, int64_t nH,
                     int64_t nKV, int64_t hd) {
  rope_launch<false>(q, q, cos, sin, N, T, nH, hd);
  rope_launch<false>(k, k, cos, sin, N, T, nKV, hd);
}
void rope_qk_backward(float* dq, float* dk, const float* dq_rot, const float* dk_rot, const float* cos,
                      const float* sin, int64_t N, int64_t T, int64_t nH, int64_t nKV, int64_t hd) {
  rope_launch<true>(dq, dq_rot, cos, sin, N, T, nH, hd);
  rope_launch<true>(dk, dk_rot, cos, sin, N, T, nKV, hd);
}

// ---- q/k norm + RoPE between bf16 tensors (qk_norm_rope) -----------------------------------------------
// One block of row_threads(hd) per head row (token n = row / nh), as the RMSNorm kernels run a row: the same
// block_sum and expressions, the normed row (forward) or the un-rotated gradient (backward) in shared memory
// instead of an f32 tensor, then rope_kernel's rotation, so the bits equal those ops run in turn.
__global__ void qk_norm_rope_forward_kernel(uint16_t* out16, float* rstd, const uint16_t* raw16,
                                            const float* w, const float* cos, const float* sin, int64_t T,
                                            int64_t nh, int64_t hd, float eps) {
  TITAN_DYNAMIC_SHARED(float, y);
  __shared__ float red[32];
  const int64_t row = blockIdx.x, half = hd / 2, t = (row / nh) % T;
  const uint16_t* x = raw16 + row * hd;
  float ss = 0;
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) ss += load_value(x, c) * load_value(x, c);
  ss = block_sum(ss, red);
  const float r = 1.0f / sqrtf(ss / hd + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) y[c] = w[c] * (load_value(x, c) * r);
  __syncthreads();
  uint16_t* o = out16 + row * hd;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const float cs = cos[t * half + i], sn = sin[t * half + i], x1 = y[i], x2 = y[i + half];
    o[i] = f32_to_bf16_bits(x1 * cs - x2 * sn);
    o[i + half] = f32_to_bf16_bits(x2 * cs + x1 * sn);
  }
}

// Element c of R^T dy for head row `row` (dy: bf16 bits), as rope_kernel's backward adds it to a cleared
// buffer.
__device__ inline float unrotated(const uint16_t* d16, const float* cos, const float* sin, int64_t row,
                                  int64_t c, int64_t T, int64_t nh, int64_t hd) {
  const int64_t half = hd / 2, i = c < half ? c : c - half, t = (row / nh) % T;
  const float cs = cos[t * half + i], sn = sin[t * half + i];
  const float x1 = load_value(d16, row * hd + i), x2 = load_value(d16, row * hd + i + half);
  return c < half ? 0.0f + (x1 * cs + x2 * sn) : 0.0f + (x2 * cs - x1 * sn);
}

__global__ void qk_norm_rope_backward_dx_kernel(uint16_t* dinp16, const uint16_t* d16, const uint16_t* raw16,
                                                const float* w, const float* rstd, const float* cos,
                                                const float* sin, int64_t T, int64_t nh, int64_t hd) {
  TITAN_DYNAMIC_SHARED(float, g);
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) g[c] = unrotated(d16, cos, sin, row, c, T, nh, hd);
  __syncthreads();
  const uint16_t* x = raw16 + row * hd;
  float dot = 0;
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) dot += g[c] * w[c] * load_value(x, c);
  dot = block_sum(dot, red);
  const float r = rstd[row], k = r * r * r * dot / hd;
  uint16_t* dx = dinp16 + row * hd;  // (what rmsnorm's backward adds to a cleared buffer, rounded)
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x)
    dx[c] = f32_to_bf16_bits(0.0f + (r * g[c] * w[c] - load_value(x, c) * k));
}

// rmsnorm_backward_dw_kernel with the gradient rows un-rotated on the fly.
__global__ void qk_norm_rope_backward_dw_kernel(float* out, const uint16_t* d16, const uint16_t* raw16,
                                                const float* rstd, const float* cos, const float* sin,
                                                int64_t rows, int64_t T, int64_t nh, int64_t hd,
                                                int64_t rows_per_chunk) {
  chunk_column_sums(out, rows, hd, rows_per_chunk, [&](int64_t n, int64_t c) {
    return unrotated(d16, cos, sin, n, c, T, nh, hd) * load_value(raw16, n * hd + c) * rstd[n];
  });
}

void qk_norm_rope_forward(uint16_t* q16, uint16_t* k16, float* q_rstd, float* k_rstd, const uint16_t* q_raw16,
                          const uint16_t* k_raw16, const float* q_w, const float* k_w, const float* cos,
                          const float* sin, int64_t N, int64_t T, int64_t nH, int64_t nKV, int64_t hd,
                          float eps) {
  if (N == 0) return;
  const size_t smem = hd * sizeof(float);
  launch(qk_norm_rope_forward_kernel, N * nH, row_threads(hd), smem, q16, q_rstd, q_raw16, q_w, cos, sin, T,
         nH, hd, eps);
  launch(qk_norm_rope_forward_kernel, N * nKV, row_threads(hd), smem, k16, k_rstd, k_raw16, k_w, cos, sin, T,
         nKV, hd, eps);
}

void qk_norm_rope_backward_rows(uint16_t* dinp16, float* dw, const uint16_t* d16, const uint16_t* raw16,
                                const float* w, const float* rstd, const float* cos, const float* sin,
                                int64_t rows, int64_t T, int64_t nh, int64_t hd) {
  if (rows == 0) return;
  launch(qk_norm_rope_backward_dx_kernel, rows, row_threads(hd), hd * sizeof(float), dinp16, d16, raw16, w,
         rstd, cos, sin, T, nh, hd);
  if (!dw) return;
  // (the chunking of rmsnorm_backward's weight gradient, so the partial sums are the same)
  const int64_t chunks = std::min<int64_t>((rows + 63) / 64, 256), per = (rows + chunks - 1) / chunks;
  Scratch<float> part(chunks * hd);
  dim3 grid((hd + 31) / 32, chunks), block(32, 8);
  launch(qk_norm_rope_backward_dw_kernel, grid, block, 0, part.p, d16, raw16, rstd, cos, sin, rows, T, nh, hd,
         per);
  add_column_sums(dw, part.p, chunks, hd);
}

void qk_norm_rope_backward(uint16_t* dq, uint16_t* dk, float* dq_w, float* dk_w, const uint16_t* dq16,
                           const uint16_t* dk16, const uint16_t* q_raw16, const uint16_t* k_raw16,
                           const float* q_w, const float* k_w, const float* q_rstd, const float* k_rstd,
                           const float* cos, const float* sin, int64_t N, int64_t T, int64_t nH, int64_t nKV,
                           int64_t hd) {
  qk_norm_rope_backward_rows(dq, dq_w, dq16, q_raw16, q_w, q_rstd, cos, sin, N * nH, T, nH, hd);
  qk_norm_rope_backward_rows(dk, dk_w, dk16, k_raw16, k_w, k_rstd, cos, sin, N * nKV, T, nKV, hd);
}

// ---- SwiGLU --------------------------------------------------------------------------------------------
// gate/up read as f32 or bf16 bits (bf16 compute), the forward's output written as either.

template <class In, class Out>
__global__ void swiglu_forward_kernel(Out* out, const In* gu, int64_t N, int64_t I) {
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < N * I;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t n = idx / I, i = idx % I;
    const float g = load_value(gu, n * 2 * I + i), u = load_value(gu, n * 2 * I + I + i);
    store_value(out, idx, g / (1.0f + expf(-g)) * u);
  }
}

// d/dg silu(g) = s (1 + g (1 - s)), s = sigmoid(g)
// d(gate/up) added to dgu (f32), or written as bf16 bits: the nearest bf16 of the sum into a cleared buffer.
__device__ inline void add_grad(float* p, int64_t i, float v) {
  p[i] += v;
}
__device__ inline void add_grad(uint16_t* p, int64_t i, float v) {
  p[i] = f32_to_bf16_bits(0.0f + v);
}
template <class In, class Out>
__global__ void swiglu_backward_kernel(Out* dgu, const float* dout, const In* gu, int64_t N, int64_t I) {
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < N * I;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t n = idx / I, i = idx % I;
    const float g = load_value(gu, n * 2 * I + i), u = load_value(gu, n * 2 * I + I + i), dy = dout[idx];
    const float s = 1.0f / (1.0f + expf(-g));
    add_grad(dgu, n * 2 * I + i, dy * u * s * (1.0f + g * (1.0f - s)));
    add_grad(dgu, n * 2 * I + I + i, dy * g * s);
  }
}

template <class In, class Out>
void swiglu_forward_t(Out* out, const In* gu, int64_t N, int64_t I) {
  if (N * I == 0) return;
  launch(swiglu_forward_kernel<In, Out>, blocks_for(N * I, 256), 256, 0, out, gu, N, I);
}
template <class In, class Out = float>
void swiglu_backward_t(Out* dgu, const float* dout, const In* gu, int64_t N, int64_t I) {
  if (N * I == 0) return;
  launch(swiglu_backward_kernel<In, Out>, blocks_for(N * I, 256), 256, 0, dgu, dout, gu, N, I);
}

// ---- Embedding -----------------------------------------------------------------------------------------
__global__ void embedding_forward_kernel(float* out, const int32_t* ids, const float* table, int64_t N,
                                         int64_t C) {
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < N * C;
       idx += (int64_t)gridDim.x * blockDim.x)
    out[idx] = ids[idx / C] < 0 ? 0.0f : table[(int64_t)ids[idx / C] * C + idx % C];
}
// Repeated ids add into the same row, in token order and without atomics: grid (ceil(C/256), buckets),
// block 256; block (x, b) owns columns x*256.. of the rows whose id % buckets == b, and each of its threads
// walks all N tokens adding its column of the rows it owns (the ids are read by all threads of the block
// at once). The order of the adds is the CPU's: the gradient repeats bit for bit.
__global__ void embedding_backward_kernel(float* dtable, const float* dout, const int32_t* ids, int64_t N,
                                          int64_t C, int64_t buckets) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int64_t n = 0; n < N; ++n) {
    const int32_t id = ids[n];
    if (id >= 0 && id % buckets == (int64_t)blockIdx.y) dtable[(int64_t)id * C + c] += dout[n * C + c];
  }
}

void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C) {
  if (N * C == 0) return;
  launch(embedding_forward_kernel, blocks_for(N * C, 256), 256, 0, out, ids, table, N, C);
}
void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t C,
                        int64_t V) {
  if (N * C == 0) return;
  // Enough blocks to fill a GPU at the released shapes (C 1024-5120: 4-20 column blocks x 256 buckets).
  const int64_t buckets = std::clamp<int64_t>((N + 15) / 16, 1, 256);
  dim3 grid(static_cast<unsigned>((C + 255) / 256), static_cast<unsigned>(buckets));
  launch(embedding_backward_kernel, grid, 256, 0, dtable, dout, ids, N, C, buckets);
}

// ---- Cross-entropy -------------------------------------------------------------------------------------
// The block's row x (V): its max, and *sum = sum_j exp(x[j] - max) in double (every thread gets both).
__device__ float row_max_sum_exp(const float* x, int64_t V, float* redf, double* redd, double* sum) {
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, x[j]);
  mx = block_max(mx, redf);
  double s = 0;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) s += exp((double)x[j] - mx);
  *sum = block_sum(s, redd);
  return mx;
}

// grid N, block 512: max, then the sum of exp in double, lse; the row's loss to loss[n]; the row overwritten
// with grad_scale (softmax - onehot) when compute_grad (the scale read from scale_dev where that is set).
__global__ void cross_entropy_kernel(double* loss, float* logits, const int32_t* targets, int64_t V,
                                     float scale_host, const float* scale_dev, bool compute_grad) {
  __shared__ float redf[32];
  __shared__ double redd[32];
  float* x = logits + blockIdx.x * V;
  const int32_t t = targets[blockIdx.x];
  if (t < 0) {
    if (compute_grad)
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) x[j] = 0.0f;
    if (threadIdx.x == 0) loss[blockIdx.x] = 0.0;
    return;
  }
  double sum;
  const float mx = row_max_sum_exp(x, V, redf, redd, &sum);
  const double lse = mx + log(sum);
  if (threadIdx.x == 0) loss[blockIdx.x] = lse - x[t];
  __syncthreads();  // x[t] is read above before any thread overwrites it
  const float grad_scale = scale_dev ? *scale_dev : scale_host;
  if (compute_grad)
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
      x[j] = grad_scale * (expf((float)((double)x[j] - lse)) - (j == t ? 1.0f : 0.0f));
}

double cross_entropy(float* logits, const int32_t* targets, int64_t N, int64_t V, float grad_scale,
                     bool compute_grad) {
  if (N == 0) return 0.0;
  Scratch<double> loss(N);
  launch(cross_entropy_kernel, N, 512, 0, loss.p, logits, targets, V, grad_scale,
         static_cast<const float*>(nullptr), compute_grad);
  std::vector<double> host(N);
  TITAN_CUDA_CHECK(
      cudaMemcpyAsync(host.data(), loss.p, N * sizeof(double), cudaMemcpyDeviceToHost, cuda_stream()));
  TITAN_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
  double total = 0;  // summed in row order, as the CPU does
  for (double l : host) total += l;
  return total;
}

// *loss_sum += the rows' losses summed in row order (one thread: the order, and so the bits, of
// cross_entropy's host sum).
__global__ void add_row_losses_kernel(double* loss_sum, const double* rows, int64_t N) {
  double total = 0;
  for (int64_t n = 0; n < N; ++n) total += rows[n];
  *loss_sum += total;
}

void cross_entropy_device(double* loss_sum, float* logits, const int32_t* targets, int64_t N, int64_t V,
                          const float* grad_scale, bool compute_grad) {
  if (N == 0) return;
  Scratch<double> loss(N);
  launch(cross_entropy_kernel, N, 512, 0, loss.p, logits, targets, V, 0.0f, grad_scale, compute_grad);
  launch(add_row_losses_kernel, 1, 1, 0, loss_sum, static_cast<const double*>(loss.p), N);
}

// Loss parallel (ops.h VocabParallelCrossEntropyKernels): grid N, block 512 per row of the shard.
__global__ void cross_entropy_shard_stats_kernel(float* stats, const float* logits, const int32_t* targets,
                                                 int64_t V, int64_t v0) {
  __shared__ float redf[32];
  __shared__ double redd[32];
  const float* x = logits + blockIdx.x * V;
  float* st = stats + 3 * blockIdx.x;
  const int32_t t = targets[blockIdx.x];
  if (t < 0) {
    if (threadIdx.x == 0) st[0] = st[1] = st[2] = 0.0f;
    return;
  }
  double sum;
  const float mx = row_max_sum_exp(x, V, redf, redd, &sum);
  if (threadIdx.x == 0) {
    const int64_t local = t - v0;
    st[0] = mx, st[1] = (float)sum, st[2] = local >= 0 && local < V ? x[local] : 0.0f;
  }
}

__global__ void cross_entropy_shard_grad_kernel(float* logits, const float* lse, const int32_t* targets,
                                                int64_t V, int64_t v0, const float* scale) {
  float* x = logits + blockIdx.x * V;
  const int32_t t = targets[blockIdx.x];
  const double l = lse[blockIdx.x];
  const float grad_scale = *scale;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
    x[j] = t < 0 ? 0.0f : grad_scale * (expf((float)((double)x[j] - l)) - (j + v0 == t ? 1.0f : 0.0f));
}

void cross_entropy_shard_stats(float* stats, const float* logits, const int32_t* targets, int64_t N,
                               int64_t V, int64_t v0) {
  if (N == 0) return;
  launch(cross_entropy_shard_stats_kernel, N, 512, 0, stats, logits, targets, V, v0);
}

void cross_entropy_shard_grad(float* logits, const float* lse, const int32_t* targets, int64_t N, int64_t V,
                              int64_t v0, const float* grad_scale) {
  if (N == 0) return;
  launch(cross_entropy_shard_grad_kernel, N, 512, 0, logits, lse, targets, V, v0, grad_scale);
}

// Combining the ranks' row statistics on the device (ops.h): one thread per row, the loss in one thread.
__global__ void shard_row_max_kernel(float* m, const float* stats, int64_t N) {
  TITAN_GRID_STRIDE(n, N) m[n] = stats[3 * n];
}
__global__ void shard_rescale_kernel(float* stats, const float* m, int64_t N) {
  TITAN_GRID_STRIDE(n, N) {
    stats[3 * n + 1] *= expf(stats[3 * n] - m[n]);
    stats[3 * n] = 0.0f;
  }
}
__global__ void shard_lse_kernel(float* m, const float* stats, int64_t N) {
  TITAN_GRID_STRIDE(n, N) m[n] += logf(stats[3 * n + 1]);
}
// The rows' losses added in row order, as the host adds them (a chunk of rows: a few thousand adds).
__global__ void shard_loss_kernel(const float* lse, const float* stats, const int32_t* targets, int64_t N,
                                  double* loss_sum) {
  double loss = 0;
  for (int64_t n = 0; n < N; ++n)
    if (targets[n] >= 0) loss += (double)lse[n] - stats[3 * n + 2];
  *loss_sum += loss;
}

void cross_entropy_shard_row_max(float* m, const float* stats, int64_t N) {
  if (N > 0) launch(shard_row_max_kernel, blocks_for(N, 256), 256, 0, m, stats, N);
}
void cross_entropy_shard_rescale(float* stats, const float* m, int64_t N) {
  if (N > 0) launch(shard_rescale_kernel, blocks_for(N, 256), 256, 0, stats, m, N);
}
void cross_entropy_shard_loss(float* m, const float* stats, const int32_t* targets, int64_t N,
                              double* loss_sum) {
  if (N == 0) return;
  launch(shard_lse_kernel, blocks_for(N, 256), 256, 0, m, stats, N);
  launch(shard_loss_kernel, 1, 1, 0, static_cast<const float*>(m), stats, targets, N, loss_sum);
}

// ---- AdamW ---------------------------------------------------------------------------------------------
// torch.optim.AdamW, the same f32 operations in the same order as the CPU reference; the bias corrections
// are computed once on the host in double (adamw_step_scalars).
__device__ inline void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float beta1,
                                    float beta2, float eps, float decay, float step_size, float bc2_sqrt,
                                    float grad_scale) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float gi = g[i] * grad_scale;
    float pi = p[i] * decay;
    float mi = m[i];
    mi += (1.0f - beta1) * (gi - mi);
    const float vi = v[i] * beta2 + (1.0f - beta2) * gi * gi;
    const float denom = sqrtf(vi) / bc2_sqrt + eps;
    pi += -step_size * (mi / denom);
    p[i] = pi, m[i] = mi, v[i] = vi;
  }
}

__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n, float beta1,
                             float beta2, float eps, float decay, float step_size, float bc2_sqrt,
                             float grad_scale) {
  adamw_update(p, g, m, v, n, beta1, beta2, eps, decay, step_size, bc2_sqrt, grad_scale);
}

void adamw_step(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                float eps, float wd, int64_t step, float grad_scale) {
  if (n == 0) return;
  const AdamWStepScalars s = adamw_step_scalars(lr, beta1, beta2, wd, step);
  launch(adamw_kernel, blocks_for(n, 256), 256, 0, p, g, m, v, n, beta1, beta2, eps, s.decay, s.step_size,
         s.bc2_sqrt, grad_scale);
}

// The step with its scalars (staged by the host) and the clip's sum of squares (computed in the step) read
// from device memory: the body of adamw_kernel, the clip factor as clip_scale computes it.
__global__ void adamw_device_kernel(float* p, const float* g, float* m, float* v, int64_t n, float beta1,
                                    float beta2, float eps, const AdamWStepScalars* s, const double* sq_sum,
                                    float max_norm) {
  if (s->nonfinite != 0) return;  // (a skipped step: training.skip_nan_inf)
  const float grad_scale = sq_sum ? clip_scale(*sq_sum, max_norm) : 1.0f;
  adamw_update(p, g, m, v, n, beta1, beta2, eps, s->decay, s->step_size, s->bc2_sqrt, grad_scale);
}

void adamw_step_device(float* p, const float* g, float* m, float* v, int64_t n, float beta1, float beta2,
                       float eps, float, const AdamWStepScalars* s, const double* sq_sum, float max_norm) {
  if (n == 0) return;
  launch(adamw_device_kernel, blocks_for(n, 256), 256, 0, p, g, m, v, n, beta1, beta2, eps, s, sq_sum,
         max_norm);
}

// ---- Sum of squares (gradient norm) --------------------------------------------------------------------
// Each block's sum of squares into part[block]; then one block sums the partials in a fixed tree.
__global__ void sum_squares_kernel(double* part, const float* x, int64_t n) {
  __shared__ double red[32];
  double s = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    s += (double)x[i] * x[i];
  s = block_sum(s, red);
  if (threadIdx.x == 0) part[blockIdx.x] = s;
}

// *out = (accumulate ? *out : 0) + sum of part[0, n)
__global__ void sum_partials_kernel(double* out, const double* part, int n, bool accumulate) {
  __shared__ double red[32];
  double s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += part[i];
  s = block_sum(s, red);
  if (threadIdx.x == 0) *out = accumulate ? *out + s : s;
}

// The buffer's sum of squares into *out, or added to it: the host form's total over the buffers adds each
// buffer's sum in the same order, so both forms give the same bits.
void sum_squares_into(double* out, const float* x, int64_t n, bool accumulate) {
  const unsigned blocks = std::min<unsigned>(blocks_for(n, 256), 1024);
  Scratch<double> part(blocks);
  launch(sum_squares_kernel, blocks, 256, 0, part.p, x, n);
  launch(sum_partials_kernel, 1, 1024, 0, out, static_cast<const double*>(part.p), static_cast<int>(blocks),
         accumulate);
}

double sum_squares(const float* x, int64_t n) {
  if (n == 0) return 0.0;
  Scratch<double> acc(1);
  sum_squares_into(acc.p, x, n, false);
  double host = 0;
  TITAN_CUDA_CHECK(cudaMemcpyAsync(&host, acc.p, sizeof(double), cudaMemcpyDeviceToHost, cuda_stream()));
  TITAN_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
  return host;
}

void sum_squares_device(double* acc, const float* x, int64_t n) {
  if (n > 0) sum_squares_into(acc, x, n, true);
}

__global__ void total_kernel(double* out, const double* parts, int64_t n) {
  double t = n > 0 ? parts[0] : 0.0;
  for (int64_t i = 1; i < n; ++i) t += parts[i];
  *out = t;
}

void total_device(double* out, const double* parts, int64_t n) {
  launch(total_kernel, 1, 1, 0, out, parts, n);
}

__global__ void count_nonfinite_kernel(double* out, const double* x, int64_t n) {
  count_nonfinite_into(out, x, n);
}
void count_nonfinite(double* out, const double* x, int64_t n) {
  launch(count_nonfinite_kernel, 1, 1, 0, out, x, n);
}

const RmsNormKernels kRmsNorm{rmsnorm_forward<float, float>,    rmsnorm_backward<float>,
                              rmsnorm_forward<float, uint16_t>, rmsnorm_forward<uint16_t, float>,
                              rmsnorm_backward<uint16_t>,       rmsnorm_forward<uint16_t, uint16_t>};
const RopeKernels kRope{rope_forward, rope_backward};
const RopeQKKernels kRopeQK{rope_qk_forward, rope_qk_backward};
const QKNormRopeKernels kQKNormRope{qk_norm_rope_forward, qk_norm_rope_backward};
const SwigluKernels kSwiglu{swiglu_forward_t<float, float>, swiglu_backward_t<float>,
                            swiglu_forward_t<uint16_t, uint16_t>, swiglu_backward_t<uint16_t>,
                            swiglu_backward_t<uint16_t, uint16_t>};
const EmbeddingKernels kEmbedding{embedding_forward, embedding_backward};
const CrossEntropyKernels kCrossEntropy{cross_entropy, cross_entropy_device};
const VocabParallelCrossEntropyKernels kVocabParallelCrossEntropy{
    cross_entropy_shard_stats, cross_entropy_shard_grad, cross_entropy_shard_row_max,
    cross_entropy_shard_rescale, cross_entropy_shard_loss};
const AdamWKernels kAdamW{adamw_step, adamw_step_device};
const SumSquaresKernels kSumSquares{sum_squares, sum_squares_device, total_device, count_nonfinite};

TITAN_REGISTER_KERNEL(RmsNormKernels, CUDA, "cuda", kRmsNorm, 10);
TITAN_REGISTER_KERNEL(RopeKernels, CUDA, "cuda", kRope, 10);
TITAN_REGISTER_KERNEL(RopeQKKernels, CUDA, "cuda", kRopeQK, 10);
TITAN_REGISTER_KERNEL(QKNormRopeKernels, CUDA, "cuda", kQKNormRope, 10);
TITAN_REGISTER_KERNEL(SwigluKernels, CUDA, "cuda", kSwiglu, 10);
TITAN_REGISTER_KERNEL(EmbeddingKernels, CUDA, "cuda", kEmbedding, 10);
TITAN_REGISTER_KERNEL(CrossEntropyKernels, CUDA, "cuda", kCrossEntropy, 10);
TITAN_REGISTER_KERNEL(VocabParallelCrossEntropyKernels, CUDA, "cuda", kVocabParallelCrossEntropy, 10);
TITAN_REGISTER_KERNEL(AdamWKernels, CUDA, "cuda", kAdamW, 10);
TITAN_REGISTER_KERNEL(SumSquaresKernels, CUDA, "cuda", kSumSquares, 10);

}  // namespace
}  // namespace titan::cuda
