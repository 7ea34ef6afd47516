// Shared pieces of the CUDA device: error checks, the device's one stream, stream-ordered scratch
// buffers and block reductions. Every op of src/device/cuda/ enqueues on cuda_stream(), so ops, copies
// and the allocator's frees are ordered without events; the host waits only where an op returns a value
// (cross_entropy's loss, sum_squares) and in the copies to the host.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <tuple>

#include "core/error.h"

namespace titan::cuda {

[[noreturn]] void fail_cuda(cudaError_t e, const char* what, const char* file, int line);

#define TITAN_CUDA_CHECK(call)                                              \
  do {                                                                      \
    cudaError_t titan_cuda_err_ = (call);                                   \
    if (titan_cuda_err_ != cudaSuccess)                                     \
      ::titan::cuda::fail_cuda(titan_cuda_err_, #call, __FILE__, __LINE__); \
  } while (0)
// After a kernel launch: reports launch errors (bad configuration) at the launch site.
#define TITAN_CUDA_LAUNCH_CHECK() TITAN_CUDA_CHECK(cudaGetLastError())

// The stream every op runs on (created on first use, on the current device). Throws titan::Error when
// the runtime finds no GPU.
cudaStream_t cuda_stream();

// Stream-ordered device memory from the caching pool (cudaMallocAsync on cuda_stream()): freed blocks are
// kept by the pool and reused by later allocations on the same stream without a device synchronization.
void* scratch_alloc(size_t nbytes);
void scratch_free(void* p);

// RAII scratch buffer of n elements of T.
template <class T>
struct Scratch {
  T* p = nullptr;
  explicit Scratch(size_t n) : p(static_cast<T*>(scratch_alloc(n * sizeof(T)))) {}
  ~Scratch() { scratch_free(p); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

// Column-major GEMM on cuBLASLt (matmul.cu): D (m,n) = op(A) op(B) + beta D with f32 A, B, D; bf16 = true
// rounds A and B to bf16 first and multiplies in bf16 with f32 accumulation. beta = 0 never reads D.
void gemm_f32_or_bf16(bool bf16, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* A,
                      int64_t lda, const float* B, int64_t ldb, float* D, int64_t ldd, float beta);

// Grid-stride loop over [0, n) with 64-bit indices (n may exceed the grid).
#define TITAN_GRID_STRIDE(i, n)                                             \
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); \
       i += (int64_t)gridDim.x * blockDim.x)

// Nearest bf16, ties to even; NaN stays a (quiet) NaN. The bit formula of f32_to_bf16 (src/core/dtype.h).
__device__ inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
__device__ inline float bf16_bits_to_f32(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}
// An element of an f32 or bf16 tensor as f32, and a value stored into one (bf16: nearest even).
__device__ inline float load_value(const float* p, int64_t i) {
  return p[i];
}
__device__ inline float load_value(const uint16_t* p, int64_t i) {
  return bf16_bits_to_f32(p[i]);
}
__device__ inline void store_value(float* p, int64_t i, float v) {
  p[i] = v;
}
__device__ inline void store_value(uint16_t* p, int64_t i, float v) {
  p[i] = f32_to_bf16_bits(v);
}

// Launches `kernel` on the device's stream and reports a bad launch (configuration, resources) here:
//   launch(rmsnorm_forward_kernel, grid, threads, dynamic_smem_bytes, out, rstd, inp, w, C, eps);
// Built for the CUDA emulator (TITAN_CUDA_SIM, tests/cuda_sim/), the same call runs the kernel's threads on
// the CPU instead.
#ifdef TITAN_CUDA_SIM
template <class... P, class... A>
void launch(void (*kernel)(P...), ::titan::cuda_sim::Grid grid, dim3 block, size_t smem, A... args) {
  const std::tuple<P...> params(static_cast<P>(args)...);
  // (the arguments by value: a launch under stream capture runs later, when its graph is launched)
  ::titan::cuda_sim::launch(reinterpret_cast<const void*>(kernel), grid, block, smem, cuda_stream(),
                            ::titan::cuda_sim::pointer_args(params),
                            [kernel, params] { std::apply(kernel, params); });
}
#else
template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, A... args) {
  // (clang-format takes a .cuh for C++ and would split the launch chevrons)
  // clang-format off
  kernel<<<grid, block, smem, cuda_stream()>>>(static_cast<P>(args)...);
  // clang-format on
  TITAN_CUDA_LAUNCH_CHECK();
}
#endif

// The kernel's dynamic shared memory (the launch's smem bytes) as an array of T.
#ifdef TITAN_CUDA_SIM
#define TITAN_DYNAMIC_SHARED(T, name) T* name = static_cast<T*>(::titan::cuda_sim::dynamic_shared())
#else
#define TITAN_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

inline unsigned blocks_for(int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 * 32 ? 65535 * 32 : b));
}

// ---- device helpers ------------------------------------------------------------------------------------
template <class T>
__device__ inline T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `shared` holds 32 T; the call ends with the block synchronized, so `shared` may be reused after it.
template <class T>
__device__ T block_sum(T v, T* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T r = lane < nwarps ? shared[lane] : T(0);
  r = warp_sum(r);
  __syncthreads();
  return r;
}

__device__ inline float block_max(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float r = lane < nwarps ? shared[lane] : -INFINITY;
  r = warp_max(r);
  __syncthreads();
  return r;
}

// Inclusive prefix sum of scan[0, blockDim.x) in shared memory, each thread holding its own entry
// (Hillis-Steele). Call with the entries written and unsynchronized; ends with the block synchronized.
__device__ inline void block_inclusive_scan(int32_t* scan) {
  __syncthreads();
  for (unsigned o = 1; o < blockDim.x; o <<= 1) {
    const int32_t add = threadIdx.x >= o ? scan[threadIdx.x - o] : 0;
    __syncthreads();
    scan[threadIdx.x] += add;
    __syncthreads();
  }
}

// A block's stable compaction: place(s, j) for each s < n with match(s), j counting those s in ascending
// order from 0; blockDim.x candidates at a time, ranked by block_inclusive_scan over `scan` (blockDim.x
// entries of shared memory). Every thread of the block calls it.
template <class Match, class Place>
__device__ void block_stable_compact(int64_t n, int32_t* scan, Match match, Place place) {
  int64_t base = 0;
  for (int64_t s0 = 0; s0 < n; s0 += blockDim.x) {
    const int64_t s = s0 + threadIdx.x;
    const int32_t mine = s < n && match(s);
    scan[threadIdx.x] = mine;
    block_inclusive_scan(scan);
    if (mine) place(s, base + scan[threadIdx.x] - 1);
    base += scan[blockDim.x - 1];
    __syncthreads();  // (scan is rewritten by the next chunk)
  }
}

// ---- deterministic reductions ----
// The reductions across blocks write one partial result per block (or per row chunk) and a second kernel
// adds the partials in a fixed order: no atomics, so a step's gradients and norms repeat bit for bit from
// run to run (a replayed graph equals the eager step, a resumed run the uninterrupted one), which float
// atomics, whose order follows the blocks' scheduling, do not give.

// Column sums of term(n, c) over a chunk of rows, for grid (ceil(C/32), chunks) and block (32, 8): the
// threads of a warp take consecutive columns, the 8 rows of threads reduce in shared memory, and the chunk's
// sums go to row blockIdx.y of out (chunks, C), which add_column_sums then adds up in chunk order.
template <class T, class Term>
__device__ void chunk_column_sums(T* out, int64_t N, int64_t C, int64_t rows_per_chunk, Term term) {
  __shared__ T part[8][33];
  const int64_t c = blockIdx.x * 32 + threadIdx.x;
  const int64_t n0 = blockIdx.y * rows_per_chunk, n1 = min(N, n0 + rows_per_chunk);
  T acc = 0;
  if (c < C)
    for (int64_t n = n0 + threadIdx.y; n < n1; n += 8) acc += term(n, c);
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    T s = 0;
    for (int i = 0; i < 8; ++i) s += part[i][threadIdx.x];
    out[blockIdx.y * C + c] = s;
  }
}

// out[c] += sum over r < rows of part[r * C + c], r in order: one thread per column.
template <class T>
__global__ void add_column_sums_kernel(T* out, const T* part, int64_t rows, int64_t C) {
  TITAN_GRID_STRIDE(c, C) {
    T s = 0;
    for (int64_t r = 0; r < rows; ++r) s += part[r * C + c];
    out[c] += s;
  }
}

template <class T>
void add_column_sums(T* out, const T* part, int64_t rows, int64_t C) {
  if (C > 0) launch(add_column_sums_kernel<T>, blocks_for(C, 256), 256, 0, out, part, rows, C);
}

}  // namespace titan::cuda
