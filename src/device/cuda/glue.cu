// The glue ops of the model step on the GPU (contracts in src/kernels/ops.h: elementwise, moe_router,
// expert_parallel; the CPU oracle is src/device/cpu/kernels_glue.cpp). Every kernel is queued on
// cuda_stream(); only ExpertParallel's unpack waits for the device (it returns a count to the host).
// Results equal the CPU's bit for bit where the CPU's order of operations can be kept (bf16 rounding,
// top-k, the renormalised weights, counts, row packing, the combine's slot order); the row reductions of
// softmax and the router backward sum in double across threads (the CPU sums in double in order), so they
// agree to double rounding before the final cast to f32.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "device/cuda/cuda_common.cuh"
#include "kernels/counter_hash.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan::cuda {
namespace {

constexpr int kThreads = 256;

// ---- elementwise ----------------------------------------------------------------------------------------
__global__ void add_kernel(float* y, const float* x, int64_t n) {
  TITAN_GRID_STRIDE(i, n) y[i] += x[i];
}
__global__ void round_bf16_kernel(float* x, int64_t n) {
  TITAN_GRID_STRIDE(i, n) x[i] = bf16_bits_to_f32(f32_to_bf16_bits(x[i]));
}
__global__ void to_bf16_kernel(uint16_t* dst, const float* src, int64_t n) {
  TITAN_GRID_STRIDE(i, n) dst[i] = f32_to_bf16_bits(src[i]);
}
__global__ void from_bf16_kernel(float* dst, const uint16_t* src, int64_t n) {
  TITAN_GRID_STRIDE(i, n) dst[i] = bf16_bits_to_f32(src[i]);
}
__global__ void add_to_bf16_kernel(uint16_t* out16, const float* y, const uint16_t* x16, int64_t n) {
  TITAN_GRID_STRIDE(i, n) out16[i] = f32_to_bf16_bits(y[i] + bf16_bits_to_f32(x16[i]));
}
__global__ void fill_kernel(float* x, float value, int64_t n) {
  TITAN_GRID_STRIDE(i, n) x[i] = value;
}
__global__ void scale_kernel(float* x, float a, int64_t n) {
  TITAN_GRID_STRIDE(i, n) x[i] *= a;
}

void add(float* y, const float* x, int64_t n) {
  if (n <= 0) return;
  launch(add_kernel, blocks_for(n, kThreads), kThreads, 0, y, x, n);
}
void round_bf16(float* x, int64_t n) {
  if (n <= 0) return;
  launch(round_bf16_kernel, blocks_for(n, kThreads), kThreads, 0, x, n);
}
void to_bf16(uint16_t* dst, const float* src, int64_t n) {
  if (n <= 0) return;
  launch(to_bf16_kernel, blocks_for(n, kThreads), kThreads, 0, dst, src, n);
}
void from_bf16(float* dst, const uint16_t* src, int64_t n) {
  if (n <= 0) return;
  launch(from_bf16_kernel, blocks_for(n, kThreads), kThreads, 0, dst, src, n);
}
void add_to_bf16(uint16_t* out16, const float* y, const uint16_t* x16, int64_t n) {
  if (n <= 0) return;
  launch(add_to_bf16_kernel, blocks_for(n, kThreads), kThreads, 0, out16, y, x16, n);
}
void fill(float* x, float value, int64_t n) {
  if (n <= 0) return;
  launch(fill_kernel, blocks_for(n, kThreads), kThreads, 0, x, value, n);
}
void scale(float* x, float a, int64_t n) {
  if (n <= 0) return;
  launch(scale_kernel, blocks_for(n, kThreads), kThreads, 0, x, a, n);
}

// ---- moe_router -----------------------------------------------------------------------------------------
constexpr int kRowThreads = 128;  // E <= 512 experts: a block of 128 per row is plenty

// x (N,E) in place. grid N, block kRowThreads. The max is exact in any order; exp in double rounded to f32
// (as close to the CPU's std::exp as a GPU gets), the sum in double, then x *= (float)(1 / sum).
__global__ void softmax_kernel(float* x, int64_t E) {
  __shared__ float redf[32];
  __shared__ double redd[32];
  float* r = x + blockIdx.x * E;
  float mx = -INFINITY;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) mx = fmaxf(mx, r[e]);
  mx = block_max(mx, redf);
  double sum = 0;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    const float v = (float)exp((double)(r[e] - mx));
    r[e] = v;
    sum += v;
  }
  sum = block_sum(sum, redd);
  const float inv = (float)(1.0 / sum);
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) r[e] *= inv;
}

void softmax(float* x, int64_t N, int64_t E) {
  if (N <= 0 || E <= 0) return;
  launch(softmax_kernel, static_cast<unsigned>(N), kRowThreads, 0, x, E);
}

// One warp per row (4 rows per block of 128). k passes of a warp arg-max over the experts not yet taken:
// each lane scans its experts in increasing order keeping the first maximum, and the warp combine prefers
// the larger score, then the lower index, so ties go to the lower expert as on the CPU. Lane 0 then
// writes the weights, summed in f32 in slot order and divided by the sum when norm (the CPU's operations).
__device__ inline bool better(float s_a, int32_t e_a, float s_b, int32_t e_b) {  // is a preferred over b?
  if (e_b < 0) return e_a >= 0;
  if (e_a < 0) return false;
  return s_a > s_b || (s_a == s_b && e_a < e_b);
}

__global__ void select_topk_kernel(int32_t* idx, float* w, const float* probs, const float* bias, int64_t N,
                                   int64_t E, int64_t k, bool norm) {
  const int lane = threadIdx.x & 31;
  const int64_t n = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5);
  if (n >= N) return;  // the whole warp leaves together
  const float* p = probs + n * E;
  int32_t* id = idx + n * k;
  for (int64_t s = 0; s < k; ++s) {
    int32_t best = -1;
    float best_score = 0.0f;
    for (int64_t e = lane; e < E; e += 32) {
      bool taken = false;
      for (int64_t t = 0; t < s; ++t) taken |= id[t] == e;
      if (taken) continue;
      const float score = bias ? p[e] + bias[e] : p[e];
      if (best < 0 || score > best_score) best = (int32_t)e, best_score = score;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float os = __shfl_xor_sync(0xffffffffu, best_score, o);
      const int32_t oe = __shfl_xor_sync(0xffffffffu, best, o);
      if (better(os, oe, best_score, best)) best = oe, best_score = os;
    }
    // Every lane holds the same winner (the preference is a total order on distinct indices).
    if (lane == 0) id[s] = best;
    __syncwarp();  // the next pass reads id[s]
  }
  if (lane == 0) {
    float* wn = w + n * k;
    float sum = 0.0f;
    for (int64_t s = 0; s < k; ++s) sum += (wn[s] = p[id[s]]);
    if (norm)
      for (int64_t s = 0; s < k; ++s) wn[s] /= sum;
  }
}

void select_topk(int32_t* idx, float* w, const float* probs, const float* bias, int64_t N, int64_t E,
                 int64_t k, bool norm) {
  if (N <= 0 || k <= 0) return;
  constexpr int kWarps = 4;
  const unsigned blocks = static_cast<unsigned>((N + kWarps - 1) / kWarps);
  launch(select_topk_kernel, blocks, kWarps * 32, 0, idx, w, probs, bias, N, E, k, norm);
}

// counts[idx[i]] += 1 (exact: the counts are integers far below 2^24).
__global__ void count_tokens_kernel(float* counts, const int32_t* idx, int64_t n_slots) {
  TITAN_GRID_STRIDE(i, n_slots) atomicAdd(counts + idx[i], 1.0f);
}

void count_tokens(float* counts, const int32_t* idx, int64_t n_slots, int64_t /*E*/) {
  if (n_slots <= 0) return;
  launch(count_tokens_kernel, blocks_for(n_slots, kThreads), kThreads, 0, counts, idx, n_slots);
}

__global__ void aux_counts_kernel(double* counts, const int32_t* idx, int64_t n_slots) {
  TITAN_GRID_STRIDE(i, n_slots) atomicAdd(counts + idx[i], 1.0);
}

// prob_sum[e] += sum_n probs[n,e] in double: each chunk of rows summed by chunk_column_sums (grid
// (ceil(E/32), row chunks), block (32, 8)), the chunks added to prob_sum in chunk order by add_column_sums.
__global__ void aux_prob_sum_kernel(double* out, const float* probs, int64_t N, int64_t E,
                                    int64_t rows_per_chunk) {
  chunk_column_sums(out, N, E, rows_per_chunk,
                    [&](int64_t n, int64_t e) { return double(probs[n * E + e]); });
}

void aux_stats(double* counts, double* prob_sum, const int32_t* idx, const float* probs, int64_t N, int64_t E,
               int64_t k) {
  if (N <= 0 || E <= 0) return;
  if (k > 0) {
    launch(aux_counts_kernel, blocks_for(N * k, kThreads), kThreads, 0, counts, idx, N * k);
  }
  const int64_t chunks = std::min<int64_t>((N + 63) / 64, 256), rows = (N + chunks - 1) / chunks;
  Scratch<double> part(chunks * E);
  dim3 grid(static_cast<unsigned>((E + 31) / 32), static_cast<unsigned>(chunks)), block(32, 8);
  launch(aux_prob_sum_kernel, grid, block, 0, part.p, probs, N, E, rows);
  add_column_sums(prob_sum, static_cast<const double*>(part.p), chunks, E);
}

// grid N, block kRowThreads; dlogits row n is the dprobs scratch, then the result (as on the CPU).
// Thread 0 does the renormalisation backward in slot order (k is small; the CPU's double sums exactly),
// the softmax backward's dot product is a double block sum.
__global__ void router_backward_kernel(float* dlogits, const float* probs, const int32_t* idx,
                                       const float* dw, const float* dprob_bias, int64_t E, int64_t k,
                                       bool norm) {
  __shared__ double redd[32];
  const int64_t n = blockIdx.x;
  const float* p = probs + n * E;
  float* dp = dlogits + n * E;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) dp[e] = dprob_bias ? dprob_bias[e] : 0.0f;
  __syncthreads();  // thread 0 adds into entries other threads wrote
  if (threadIdx.x == 0) {
    const int32_t* id = idx + n * k;
    const float* g = dw + n * k;
    if (norm) {
      // w_s = p_s / S, S = sum_t p_t:  dp_s = (dw_s - sum_t dw_t w_t) / S
      double S = 0, dot = 0;
      for (int64_t s = 0; s < k; ++s) S += p[id[s]];
      for (int64_t s = 0; s < k; ++s) dot += (double)g[s] * (p[id[s]] / S);
      for (int64_t s = 0; s < k; ++s) dp[id[s]] += (float)((g[s] - dot) / S);
    } else {
      for (int64_t s = 0; s < k; ++s) dp[id[s]] += g[s];
    }
  }
  __syncthreads();  // every thread reads the entries thread 0 wrote
  // softmax backward: dl_e = p_e (dp_e - sum_j p_j dp_j)
  double dot = 0;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) dot += (double)p[e] * dp[e];
  dot = block_sum(dot, redd);
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) dp[e] = (float)(p[e] * (dp[e] - dot));
}

void router_backward(float* dlogits, const float* probs, const int32_t* idx, const float* dw,
                     const float* dprob_bias, int64_t N, int64_t E, int64_t k, bool norm) {
  if (N <= 0 || E <= 0) return;
  launch(router_backward_kernel, static_cast<unsigned>(N), kRowThreads, 0, dlogits, probs, idx, dw,
         dprob_bias, E, k, norm);
}

// One block. Thread 0 takes the two means in the CPU's order (E is small), so the bias moves by exactly
// the CPU's amounts; all threads then update the bias and clear the counts.
__global__ void update_bias_kernel(float* bias, float* counts, int64_t E, double coeff) {
  __shared__ double mean_s, delta_mean_s;
  auto sign = [](double d) { return d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0; };
  if (threadIdx.x == 0) {
    double mean = 0;
    for (int64_t e = 0; e < E; ++e) mean += counts[e];
    mean /= (double)E;
    double delta_mean = 0;
    for (int64_t e = 0; e < E; ++e) delta_mean += coeff * sign(mean - counts[e]);
    delta_mean /= (double)E;
    mean_s = mean, delta_mean_s = delta_mean;
  }
  __syncthreads();
  const double mean = mean_s, delta_mean = delta_mean_s;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    bias[e] += (float)(coeff * sign(mean - counts[e]) - delta_mean);
    counts[e] = 0.0f;  // this thread read counts[e] just above; thread 0 finished reading before the barrier
  }
}

void update_bias(float* bias, float* counts, int64_t E, double coeff) {
  if (E <= 0) return;
  launch(update_bias_kernel, 1, kThreads, 0, bias, counts, E, coeff);
}

// ---- expert_parallel ------------------------------------------------------------------------------------
// One thread per output element (64-bit indices: S * (H + 2) may pass 2^31).
__global__ void ep_pack_kernel(float* send, const float* x, const float* w, const int32_t* idx,
                               const int64_t* order, int64_t S, int64_t k, int64_t H, int64_t El) {
  const int64_t row = H + 2;
  TITAN_GRID_STRIDE(t, S * row) {
    const int64_t i = t / row, c = t % row, slot = order[i];
    if (slot < 0)  // padding
      send[t] = c <= H ? 0.0f : -1.0f;
    else
      send[t] = c < H ? x[(slot / k) * H + c] : c == H ? w[slot] : static_cast<float>(idx[slot] % El);
  }
}

void ep_pack(float* send, const float* x, const float* w, const int32_t* idx, const int64_t* order, int64_t S,
             int64_t k, int64_t H, int64_t El) {
  const int64_t total = S * (H + 2);
  if (total <= 0) return;
  launch(ep_pack_kernel, blocks_for(total, kThreads), kThreads, 0, send, x, w, idx, order, S, k, H, El);
}

// float -> int32 as the CPU's static_cast for every in-range value (truncation); __float2int_rz saturates
// out-of-range values and maps NaN to 0 instead of being undefined.
__global__ void ep_unpack_kernel(float* x, float* w, int32_t* idx, unsigned long long* bad, const float* recv,
                                 int64_t R, int64_t H, int64_t El) {
  const int64_t row = H + 2;
  TITAN_GRID_STRIDE(t, R * row) {
    const int64_t r = t / row, c = t % row;
    const float v = recv[t];
    if (c < H) {
      x[r * H + c] = v;
    } else if (c == H) {
      w[r] = v;
    } else {
      const int32_t e = __float2int_rz(v);
      idx[r] = e;
      if (e < 0 || e >= El) atomicAdd(bad, 1ull);
    }
  }
}

int64_t ep_unpack(float* x, float* w, int32_t* idx, const float* recv, int64_t R, int64_t H, int64_t El) {
  const int64_t total = R * (H + 2);
  if (total <= 0) return 0;
  Scratch<unsigned long long> bad(1);
  TITAN_CUDA_CHECK(cudaMemsetAsync(bad.p, 0, sizeof(unsigned long long), cuda_stream()));
  launch(ep_unpack_kernel, blocks_for(total, kThreads), kThreads, 0, x, w, idx, bad.p, recv, R, H, El);
  unsigned long long host = 0;
  TITAN_CUDA_CHECK(cudaMemcpyAsync(&host, bad.p, sizeof(host), cudaMemcpyDeviceToHost, cuda_stream()));
  TITAN_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
  return static_cast<int64_t>(host);
}

__global__ void ep_gather_rows_kernel(float* send, const float* src, const int64_t* order, int64_t S,
                                      int64_t k, int64_t H) {
  TITAN_GRID_STRIDE(t, S * H) {
    const int64_t i = t / H, c = t % H;
    send[t] = order[i] < 0 ? 0.0f : src[(order[i] / k) * H + c];
  }
}

void ep_gather_rows(float* send, const float* src, const int64_t* order, int64_t S, int64_t k, int64_t H) {
  const int64_t total = S * H;
  if (total <= 0) return;
  launch(ep_gather_rows_kernel, blocks_for(total, kThreads), kThreads, 0, send, src, order, S, k, H);
}

__global__ void ep_pack_grads_kernel(float* dst, const float* dx, const float* dw, int64_t R, int64_t H) {
  const int64_t row = H + 1;
  TITAN_GRID_STRIDE(t, R * row) {
    const int64_t r = t / row, c = t % row;
    dst[t] = c < H ? dx[r * H + c] : dw[r];
  }
}

void ep_pack_grads(float* dst, const float* dx, const float* dw, int64_t R, int64_t H) {
  const int64_t total = R * (H + 1);
  if (total <= 0) return;
  launch(ep_pack_grads_kernel, blocks_for(total, kThreads), kThreads, 0, dst, dx, dw, R, H);
}

// out (N,H): one thread per element sums its token's k rows in slot order (0 + a == a, so starting from
// zero equals the CPU's memset then +=): deterministic, no atomics.
__global__ void ep_combine_kernel(float* out, const float* rows, const int64_t* pos, int64_t N, int64_t k,
                                  int64_t H, int64_t row, bool accumulate) {
  TITAN_GRID_STRIDE(t, N * H) {
    const int64_t n = t / H, h = t % H;
    float acc = accumulate ? out[t] : 0.0f;
    for (int64_t j = 0; j < k; ++j) acc += rows[pos[n * k + j] * row + h];
    out[t] = acc;
  }
}
// dtw[i] += rows[pos[i]][H], i < N*k (each slot its own element).
__global__ void ep_combine_dtw_kernel(float* dtw, const float* rows, const int64_t* pos, int64_t n_slots,
                                      int64_t H, int64_t row) {
  TITAN_GRID_STRIDE(i, n_slots) dtw[i] += rows[pos[i] * row + H];
}

void ep_combine(float* out, float* dtw, const float* rows, const int64_t* pos, int64_t N, int64_t k,
                int64_t H, int64_t row, bool accumulate) {
  if (N <= 0) return;
  if (N * H > 0) {
    launch(ep_combine_kernel, blocks_for(N * H, kThreads), kThreads, 0, out, rows, pos, N, k, H, row,
           accumulate);
  }
  if (dtw && N * k > 0) {
    launch(ep_combine_dtw_kernel, blocks_for(N * k, kThreads), kThreads, 0, dtw, rows, pos, N * k, H, row);
  }
}

// ---- dropout (counter-based mask, kernels/counter_hash.h: the CPU's bits) -------------------------------
__device__ inline uint64_t dropout_counter(int64_t i, int64_t cols, uint64_t key, uint64_t key_stride) {
  return key + static_cast<uint64_t>(i / cols) * key_stride + static_cast<uint64_t>(i % cols);
}
__global__ void dropout_forward_kernel(float* out, const float* x, int64_t n, int64_t cols, uint64_t key,
                                       uint64_t key_stride, float p, float keep, const uint64_t* key_add) {
  if (key_add) key += *key_add;
  TITAN_GRID_STRIDE(i, n)
  out[i] = counter_uniform(dropout_counter(i, cols, key, key_stride)) >= p ? x[i] * keep : 0.0f;
}
__global__ void dropout_backward_kernel(float* dx, const float* g, int64_t n, int64_t cols, uint64_t key,
                                        uint64_t key_stride, float p, float keep, const uint64_t* key_add) {
  if (key_add) key += *key_add;
  TITAN_GRID_STRIDE(i, n)
  if (counter_uniform(dropout_counter(i, cols, key, key_stride)) >= p) dx[i] += g[i] * keep;
}
void dropout_forward(float* out, const float* x, int64_t rows, int64_t cols, uint64_t key,
                     uint64_t key_stride, float p, const uint64_t* key_add) {
  const int64_t n = rows * cols;
  if (n <= 0) return;
  launch(dropout_forward_kernel, blocks_for(n, kThreads), kThreads, 0, out, x, n, cols, key, key_stride, p,
         1.0f / (1.0f - p), key_add);
}
void dropout_backward_add(float* dx, const float* g, int64_t rows, int64_t cols, uint64_t key,
                          uint64_t key_stride, float p, const uint64_t* key_add) {
  const int64_t n = rows * cols;
  if (n <= 0) return;
  launch(dropout_backward_kernel, blocks_for(n, kThreads), kThreads, 0, dx, g, n, cols, key, key_stride, p,
         1.0f / (1.0f - p), key_add);
}

// route_fixed: order = -1, then block d = blockIdx.x places its slots (idx / El = d) in slot order
// (block_stable_compact).  grid ranks, block 256.
__global__ void ep_route_fixed_kernel(int64_t* order, int64_t* pos, const int32_t* idx, int64_t S,
                                      int64_t El) {
  __shared__ int32_t scan[256];
  const int64_t d = blockIdx.x, base = d * S;
  for (int64_t i = threadIdx.x; i < S; i += blockDim.x) order[base + i] = -1;
  __syncthreads();
  block_stable_compact(
      S, scan, [&](int64_t s) { return idx[s] / El == d; },
      [&](int64_t s, int64_t j) { order[base + j] = s, pos[s] = base + j; });
}

void ep_route_fixed(int64_t* order, int64_t* pos, const int32_t* idx, int64_t S, int64_t El, int64_t ranks) {
  if (S > 0) launch(ep_route_fixed_kernel, ranks, 256, 0, order, pos, idx, S, El);
}

__global__ void ep_unpack_padded_kernel(float* x, float* w, int32_t* idx, const float* recv, int64_t R,
                                        int64_t H) {
  const int64_t row = H + 2;
  TITAN_GRID_STRIDE(t, R * row) {
    const int64_t r = t / row, c = t % row;
    const float v = recv[t];
    if (c < H)
      x[r * H + c] = v;
    else if (c == H)
      w[r] = v;
    else
      idx[r] = __float2int_rz(v);
  }
}

void ep_unpack_padded(float* x, float* w, int32_t* idx, const float* recv, int64_t R, int64_t H) {
  const int64_t total = R * (H + 2);
  if (total > 0)
    launch(ep_unpack_padded_kernel, blocks_for(total, kThreads), kThreads, 0, x, w, idx, recv, R, H);
}

#undef TITAN_GRID_STRIDE

const DropoutKernels kDropout{dropout_forward, dropout_backward_add};
const ElementwiseKernels kElementwise{add, round_bf16, to_bf16, from_bf16, fill, scale, add_to_bf16};
__global__ void aux_loss_kernel(double* aux, float* dprob, const double* stats, int64_t E, double R) {
  *aux = moe_aux_loss(stats, E, R, dprob);
}
void aux_loss(double* aux, float* dprob, const double* stats, int64_t E, double R) {
  launch(aux_loss_kernel, 1, 1, 0, aux, dprob, stats, E, R);
}

const MoeRouterKernels kMoeRouter{softmax,         select_topk, count_tokens, aux_stats,
                                  router_backward, update_bias, aux_loss};
const ExpertParallelKernels kExpertParallel{ep_pack,    ep_unpack,      ep_gather_rows,  ep_pack_grads,
                                            ep_combine, ep_route_fixed, ep_unpack_padded};

TITAN_REGISTER_KERNEL(ElementwiseKernels, CUDA, "cuda", kElementwise, 10);
TITAN_REGISTER_KERNEL(DropoutKernels, CUDA, "cuda", kDropout, 10);
TITAN_REGISTER_KERNEL(MoeRouterKernels, CUDA, "cuda", kMoeRouter, 10);
TITAN_REGISTER_KERNEL(ExpertParallelKernels, CUDA, "cuda", kExpertParallel, 10);

}  // namespace
}  // namespace titan::cuda
