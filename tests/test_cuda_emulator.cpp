// The CUDA emulator (tests/cuda_sim/) itself: device code means what it means on a GPU (shuffles, barriers,
// shared memory, atomics), and what would hang, fault or compute garbage on a GPU is an error naming the
// place. Built only with the CUDA device, as the test_*_sim executables that run titan's kernels on it.
#include <cublasLt.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda_sim.h"  // first: what device code sees
#include "device/cuda/cuda_common.cuh"

namespace titan::cuda {
namespace {

// ---- kernels --------------------------------------------------------------------------------------------
enum Op { kXor, kDown, kUp, kIdx };

// out[t] = the shuffle `op` of each thread's own index, with `arg` and `width`.
__global__ void shuffle_kernel(int* out, int op, int arg, int width) {
  const int t = threadIdx.x, v = t * 10;
  int r = 0;
  switch (op) {
    case kXor:
      r = __shfl_xor_sync(0xffffffffu, v, arg, width);
      break;
    case kDown:
      r = __shfl_down_sync(0xffffffffu, v, unsigned(arg), width);
      break;
    case kUp:
      r = __shfl_up_sync(0xffffffffu, v, unsigned(arg), width);
      break;
    default:
      r = __shfl_sync(0xffffffffu, v, arg, width);
      break;
  }
  out[t] = r;
}

// Tree sum of in[0, n) in shared memory, one result per block (blockDim.x a power of two).
__global__ void block_sum_kernel(float* out, const float* in, int64_t n) {
  __shared__ float s[1024];
  const int t = threadIdx.x;
  float acc = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + t; i < n; i += int64_t(gridDim.x) * blockDim.x)
    acc += in[i];
  s[t] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (t < stride) s[t] += s[t + stride];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = s[0];
}

// Each thread writes its index to dynamic shared memory and reads its right neighbour's, with or
// without the barrier between.
__global__ void neighbour_kernel(int* out, bool barrier) {
  TITAN_DYNAMIC_SHARED(int, s);
  const int t = threadIdx.x, n = blockDim.x;
  s[t] = t;
  if (barrier) __syncthreads();
  out[t] = s[(t + 1) % n];
}

// A tree sum whose loop lacks the barrier between levels: a thread reads s[t + stride] that the
// thread t + stride updates in the same level. Reverse order runs the writer first and hides it.
__global__ void unsynced_tree_sum_kernel(float* out) {
  __shared__ float s[64];
  const int t = threadIdx.x;
  s[t] = 1.0f;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2)
    if (t < stride) s[t] += s[t + stride];
  __syncthreads();
  if (t == 0) out[blockIdx.x] = s[0];
}

__global__ void atomic_count_kernel(float* total, unsigned* count) {
  atomicAdd(total, 0.5f);
  atomicAdd(count, 1u);
}

// 3-D indices: out[linear thread id of the whole grid] = packed (block, thread) coordinates.
__global__ void index_kernel(int* out) {
  const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int bid = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int per_block = blockDim.x * blockDim.y * blockDim.z;
  out[bid * per_block + tid] = int(blockIdx.z * 1000000 + blockIdx.y * 100000 + blockIdx.x * 10000 +
                                   threadIdx.z * 100 + threadIdx.y * 10 + threadIdx.x);
}

// Lane 0 waits in a shuffle, the others at __syncthreads: neither can complete.
__global__ void deadlock_kernel(int* out) {
  if (threadIdx.x == 0)
    out[0] = __shfl_sync(0xffffffffu, 1, 0);
  else
    __syncthreads();
}

__global__ void divergent_barrier_kernel(int* out) {
  if (threadIdx.x % 2 == 0) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

// Lane 0 leaves before a full-mask shuffle.
__global__ void exited_lane_kernel(int* out) {
  if (threadIdx.x == 0) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, int(threadIdx.x), 1);
}

// Lane 1 shuffles with a mask that leaves it out.
__global__ void own_mask_kernel(int* out) {
  if (threadIdx.x < 2) out[threadIdx.x] = __shfl_sync(0x1u, int(threadIdx.x), 0);
}

__global__ void throwing_kernel(int* out, int bad_thread) {
  TITAN_CHECK(int(threadIdx.x) != bad_thread, "thread ", bad_thread, " refuses");
  out[threadIdx.x] = 1;
}

__global__ void smem_kernel(float* out) {
  TITAN_DYNAMIC_SHARED(float, s);
  s[threadIdx.x] = float(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];
}

// ---- helpers --------------------------------------------------------------------------------------------
template <class T>
struct DeviceBuffer {
  T* p = nullptr;
  size_t n;
  explicit DeviceBuffer(size_t count) : n(count) { TITAN_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T))); }
  ~DeviceBuffer() { cudaFree(p); }
  std::vector<T> host() const {
    std::vector<T> h(n);
    TITAN_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  void set(const std::vector<T>& h) {
    TITAN_CUDA_CHECK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
};

// Runs f, which must throw a titan::Error whose message holds every one of `parts`.
template <class F>
void expect_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one with '" << parts.front() << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

// The expected result of a shuffle with CUDA's rules: lanes in segments of `width`; a source outside the
// lane's segment (down, up, xor) keeps the lane's own value; idx wraps modulo width.
int expected_shuffle(int lane, Op op, int arg, int width) {
  const int seg = lane / width * width;
  int src = lane;
  switch (op) {
    case kXor:
      src = (lane ^ arg) < seg + width ? lane ^ arg : lane;
      break;
    case kDown:
      src = lane + arg < seg + width ? lane + arg : lane;
      break;
    case kUp:
      src = lane - arg >= seg ? lane - arg : lane;
      break;
    case kIdx:
      src = seg + arg % width;
      break;
  }
  return src * 10;
}

// ---- device code means what it means on a GPU -----------------------------------------------------------
TEST(CudaEmulator, ShufflesFollowCudaSemantics) {
  DeviceBuffer<int> out(64);
  for (int width : {32, 16, 8, 4}) {
    for (auto [op, args] : std::vector<std::pair<Op, std::vector<int>>>{
             {kXor, {1, 2, 16, 31}}, {kDown, {1, 4, 16}}, {kUp, {1, 3, 16}}, {kIdx, {0, 5, 31}}}) {
      for (int arg : args) {
        launch(shuffle_kernel, 1, 64, 0, out.p, int(op), arg, width);
        const std::vector<int> got = out.host();
        for (int t = 0; t < 64; ++t)
          ASSERT_EQ(got[t], (t / 32) * 320 + expected_shuffle(t % 32, op, arg, width))
              << "op " << op << " arg " << arg << " width " << width << " thread " << t;
      }
    }
  }
}

TEST(CudaEmulator, BlockReductionAndAtomics) {
  const int64_t n = 10000;
  std::vector<float> h(n);
  double want = 0;
  for (int64_t i = 0; i < n; ++i) want += h[i] = float(i % 7) - 2.5f;
  DeviceBuffer<float> in(n), partial(3);
  in.set(h);
  launch(block_sum_kernel, 3, 256, 0, partial.p, in.p, n);
  const std::vector<float> p = partial.host();
  EXPECT_DOUBLE_EQ(double(p[0]) + p[1] + p[2], want);

  DeviceBuffer<float> total(1);
  DeviceBuffer<unsigned> count(1);
  TITAN_CUDA_CHECK(cudaMemset(total.p, 0, sizeof(float)));
  TITAN_CUDA_CHECK(cudaMemset(count.p, 0, sizeof(unsigned)));
  launch(atomic_count_kernel, 7, 96, 0, total.p, count.p);
  EXPECT_EQ(total.host()[0], 7 * 96 * 0.5f);
  EXPECT_EQ(count.host()[0], 7u * 96u);
}

TEST(CudaEmulator, ThreeDimensionalIndices) {
  const dim3 grid(3, 2, 2), block(4, 3, 2);
  DeviceBuffer<int> out(3 * 2 * 2 * 4 * 3 * 2);
  launch(index_kernel, grid, block, 0, out.p);
  const std::vector<int> got = out.host();
  int i = 0;
  for (unsigned bz = 0; bz < 2; ++bz)
    for (unsigned by = 0; by < 2; ++by)
      for (unsigned bx = 0; bx < 3; ++bx)
        for (unsigned tz = 0; tz < 2; ++tz)
          for (unsigned ty = 0; ty < 3; ++ty)
            for (unsigned tx = 0; tx < 4; ++tx, ++i)
              ASSERT_EQ(got[i], int(bz * 1000000 + by * 100000 + bx * 10000 + tz * 100 + ty * 10 + tx)) << i;
}

// A read of shared memory that a missing __syncthreads leaves unordered with its write sees the 0xff
// fill of fresh shared memory, not the neighbour's value.
TEST(CudaEmulator, MissingBarrierShows) {
  DeviceBuffer<int> out(64);
  launch(neighbour_kernel, 1, 64, 64 * sizeof(int), out.p, true);
  std::vector<int> got = out.host();
  for (int t = 0; t < 64; ++t) EXPECT_EQ(got[t], (t + 1) % 64);
  launch(neighbour_kernel, 1, 64, 64 * sizeof(int), out.p, false);
  got = out.host();
  int wrong = 0;
  for (int t = 0; t < 64; ++t) wrong += got[t] != (t + 1) % 64;
  EXPECT_GT(wrong, 0) << "a missing barrier went unnoticed";
}

// Forward order between barriers shows a read that the reverse order would serve with the new value.
TEST(CudaEmulator, MissingBarrierShowsInEitherOrder) {
  DeviceBuffer<float> out(2);
  launch(unsynced_tree_sum_kernel, 2, 64, 0, out.p);  // neighbouring blocks start in different orders
  const std::vector<float> got = out.host();
  EXPECT_TRUE(got[0] != 64.0f || got[1] != 64.0f) << got[0] << " " << got[1];
}

// ---- what a GPU would not survive -----------------------------------------------------------------------
TEST(CudaEmulator, DeadlockIsAnErrorNamingTheWaits) {
  DeviceBuffer<int> out(32);
  expect_error([&] { launch(deadlock_kernel, 1, 32, 0, out.p); },
               {"deadlock in block (0,0,0)", "test_cuda_emulator.cpp", "31 thread(s) wait at __syncthreads",
                "1 thread(s) wait at a shuffle"});
  // The emulator is usable after a failed launch (the stuck threads were unwound).
  launch(shuffle_kernel, 1, 32, 0, out.p, int(kXor), 1, 32);
  EXPECT_EQ(out.host()[0], 10);
}

TEST(CudaEmulator, DivergentSyncthreadsIsAnError) {
  DeviceBuffer<int> out(64);
  expect_error([&] { launch(divergent_barrier_kernel, 1, 64, 0, out.p); },
               {"wait at different __syncthreads", "test_cuda_emulator.cpp"});
}

TEST(CudaEmulator, ShuffleMasksAreChecked) {
  DeviceBuffer<int> out(32);
  expect_error([&] { launch(exited_lane_kernel, 1, 32, 0, out.p); }, {"lane 0 of warp 0 exited"});
  expect_error([&] { launch(own_mask_kernel, 1, 32, 0, out.p); },
               {"lane 1 of warp 0 is not in its own mask 0x1"});
  // A full mask in a block of 16 threads names lanes that do not exist.
  expect_error([&] { launch(shuffle_kernel, 1, 16, 0, out.p, int(kXor), 1, 32); },
               {"names lane 16", "a block of 16 threads"});
}

TEST(CudaEmulator, ErrorsInsideAKernelReachTheCaller) {
  DeviceBuffer<int> out(64);
  expect_error([&] { launch(throwing_kernel, 2, 64, 0, out.p, 5); }, {"thread 5 refuses"});
  launch(throwing_kernel, 1, 64, 0, out.p, -1);
  for (int v : out.host()) EXPECT_EQ(v, 1);
}

TEST(CudaEmulator, LaunchConfigurationsAreChecked) {
  DeviceBuffer<float> out(2048);
  expect_error([&] { launch(smem_kernel, 1, 2048, 0, out.p); }, {"invalid block (2048,1,1)", "at most 1024"});
  expect_error([&] { launch(smem_kernel, dim3(1, 70000), 32, 0, out.p); }, {"invalid grid (1,70000,1)"});
  expect_error([&] { launch(smem_kernel, int64_t(1) << 32, 32, 0, out.p); },
               {"invalid grid (4294967296,1,1)"});
  expect_error([&] { launch(smem_kernel, 0, 32, 0, out.p); }, {"invalid grid (0,1,1)"});

  // Over 48 KiB of dynamic shared memory needs the kernel's opt-in, up to 227 KiB.
  const size_t big = 64 << 10;
  expect_error([&] { launch(smem_kernel, 1, 256, big, out.p); },
               {"asks for 65536 bytes of dynamic shared memory", "cudaFuncSetAttribute"});
  EXPECT_NE(cudaFuncSetAttribute(smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 300 << 10),
            cudaSuccess);
  (void)cudaGetLastError();
  ASSERT_EQ(cudaFuncSetAttribute(smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(big)),
            cudaSuccess);
  launch(smem_kernel, 1, 256, big, out.p);
  const std::vector<float> got = out.host();
  for (int t = 0; t < 256; ++t) EXPECT_EQ(got[t], float(255 - t));
}

TEST(CudaEmulator, KernelPointerArgumentsMustBeDeviceMemory) {
  std::vector<int> host(32);
  expect_error([&] { launch(shuffle_kernel, 1, 32, 0, host.data(), int(kXor), 1, 32); },
               {"argument 1 of the kernel", "is not device memory"});
}

// ---- memory and copies ----------------------------------------------------------------------------------
TEST(CudaEmulator, NewMemoryIsNaN) {
  DeviceBuffer<float> a(100);
  for (float v : a.host()) EXPECT_TRUE(std::isnan(v));
}

TEST(CudaEmulator, CopiesAndMemsetsAreChecked) {
  DeviceBuffer<float> a(16), b(16);
  std::vector<float> h(16, 1.0f);
  EXPECT_EQ(cudaMemcpy(a.p, h.data(), 16 * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(b.p, a.p, 16 * sizeof(float), cudaMemcpyDeviceToDevice), cudaSuccess);
  EXPECT_EQ(b.host(), h);

  // Direction swapped, a range past the allocation's end, a host pointer as device memory.
  EXPECT_EQ(cudaMemcpy(h.data(), a.p, 16 * sizeof(float), cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_NE(std::string(cudaGetErrorString(cudaGetLastError())).find("host to device of 64 bytes"),
            std::string::npos);
  EXPECT_EQ(cudaMemcpy(a.p, h.data(), 17 * sizeof(float), cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemset(h.data(), 0, 4), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemset(a.p + 8, 0, 9 * sizeof(float)), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemset(a.p + 8, 0, 8 * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaFree(h.data()), cudaErrorInvalidValue);
  (void)cudaGetLastError();

  // titan's checks report the emulator's detail.
  expect_error([&] { TITAN_CUDA_CHECK(cudaMemcpy(h.data(), a.p, 4, cudaMemcpyHostToDevice)); },
               {"cudaMemcpy", "not a device range"});
}

// ---- cuBLASLt ------------------------------------------------------------------------------------------
// D = A B (column-major, f32) through the emulator's cuBLASLt, and a D outside device memory rejected.
TEST(CudaEmulator, CublasLtMatmulAndItsChecks) {
  const int m = 3, n = 2, k = 4;
  std::vector<float> ha(m * k), hb(k * n), want(m * n, 0.0f);
  for (int i = 0; i < m * k; ++i) ha[i] = float(i % 5) - 1.0f;
  for (int i = 0; i < k * n; ++i) hb[i] = float(i % 3) + 0.5f;
  for (int c = 0; c < n; ++c)
    for (int r = 0; r < m; ++r)
      for (int p = 0; p < k; ++p) want[c * m + r] += ha[p * m + r] * hb[c * k + p];
  DeviceBuffer<float> a(m * k), b(k * n), d(m * n);
  a.set(ha);
  b.set(hb);

  cublasLtHandle_t lt;
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  cublasLtMatmulDesc_t op;
  ASSERT_EQ(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
  cublasLtMatrixLayout_t la, lb, ld;
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, m, k, m), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, k, n, k), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, m, n, m), CUBLAS_STATUS_SUCCESS);
  const float alpha = 1, beta = 0;
  EXPECT_EQ(
      cublasLtMatmul(lt, op, &alpha, a.p, la, b.p, lb, &beta, d.p, ld, d.p, ld, nullptr, nullptr, 0, nullptr),
      CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(d.host(), want);

  std::vector<float> host_d(m * n);
  EXPECT_EQ(cublasLtMatmul(lt, op, &alpha, a.p, la, b.p, lb, &beta, host_d.data(), ld, host_d.data(), ld,
                           nullptr, nullptr, 0, nullptr),
            CUBLAS_STATUS_INVALID_VALUE);
  cublasLtMatrixLayout_t bad;
  EXPECT_EQ(cublasLtMatrixLayoutCreate(&bad, CUDA_R_32F, m, k, m - 1), CUBLAS_STATUS_INVALID_VALUE);
  // op(A) and B disagree in k; A's layout reaches past its allocation (ld too large).
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&bad, CUDA_R_32F, k + 1, n, k + 1), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmul(lt, op, &alpha, a.p, la, b.p, bad, &beta, d.p, ld, d.p, ld, nullptr, nullptr, 0,
                           nullptr),
            CUBLAS_STATUS_INVALID_VALUE);
  cublasLtMatrixLayoutDestroy(bad);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&bad, CUDA_R_32F, m, k, 2 * m), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmul(lt, op, &alpha, a.p, bad, b.p, lb, &beta, d.p, ld, d.p, ld, nullptr, nullptr, 0,
                           nullptr),
            CUBLAS_STATUS_INVALID_VALUE);
  for (auto l : {la, lb, ld, bad}) cublasLtMatrixLayoutDestroy(l);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(lt);
}

// ---- stream capture ------------------------------------------------------------------------------------
// A capture records, runs nothing, and the graph runs the recorded work in order on each launch, reading
// the buffers' contents then: a kernel, a copy, a memset and a cuBLASLt matmul whose descriptors are gone
// by the time the graph runs. Launches by the graph are not the host's.
TEST(CudaEmulator, StreamCaptureRecordsAndGraphLaunchReplays) {
  const int n = 256, m = 2, k = 2;
  DeviceBuffer<float> in(n), sums(4), a(m * k), d(m * m), zeroed(8), staged(n);
  in.set(std::vector<float>(n, 1.0f));
  std::vector<float> h(n, 1.0f), ha = {1, 2, 3, 4};
  a.set(ha);
  cudaStream_t s = cuda_stream();
  cublasLtHandle_t lt;
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);

  const auto before = cuda_sim::counters();
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  cudaStreamCaptureStatus status;
  ASSERT_EQ(cudaStreamIsCapturing(s, &status), cudaSuccess);
  EXPECT_EQ(status, cudaStreamCaptureStatusActive);
  ASSERT_EQ(cudaMemcpyAsync(staged.p, in.p, n * sizeof(float), cudaMemcpyDeviceToDevice, s), cudaSuccess);
  launch(block_sum_kernel, 4, 64, 0, sums.p, static_cast<const float*>(staged.p), int64_t(n));
  ASSERT_EQ(cudaMemsetAsync(zeroed.p, 0, 8 * sizeof(float), s), cudaSuccess);
  {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, ld;
    ASSERT_EQ(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, m, k, m), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, m, m, m), CUBLAS_STATUS_SUCCESS);
    const float alpha = 1, beta = 0;  // (host scalars: read at capture)
    EXPECT_EQ(
        cublasLtMatmul(lt, op, &alpha, a.p, la, a.p, la, &beta, d.p, ld, d.p, ld, nullptr, nullptr, 0, s),
        CUBLAS_STATUS_SUCCESS);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(op);
  }
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_EQ(cudaStreamIsCapturing(s, &status), cudaSuccess);
  EXPECT_EQ(status, cudaStreamCaptureStatusNone);
  // Nothing ran: the buffers still hold the NaN of new memory.
  for (float v : sums.host()) EXPECT_TRUE(std::isnan(v));
  for (float v : d.host()) EXPECT_TRUE(std::isnan(v));
  EXPECT_EQ(cuda_sim::counters().kernels_run, before.kernels_run);

  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);       // (the instance keeps what it needs)
  const std::vector<float> a_squared = {7, 10, 15, 22};  // column-major [1 3; 2 4]^2
  for (float value : {1.0f, 2.5f}) {
    std::fill(h.begin(), h.end(), value);
    in.set(h);  // (outside the graph) read by the graph's copy when it runs
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    float total = 0;
    for (float v : sums.host()) total += v;
    EXPECT_EQ(total, value * n);
    EXPECT_EQ(zeroed.host(), std::vector<float>(8, 0.0f));
    EXPECT_EQ(d.host(), a_squared);
  }
  const auto after = cuda_sim::counters();
  EXPECT_EQ(after.host_launches, before.host_launches);  // the kernel was never launched by the host
  EXPECT_EQ(after.kernels_run, before.kernels_run + 2);  // it ran once per graph launch
  EXPECT_EQ(after.graph_launches, before.graph_launches + 2);
  ASSERT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  cublasLtDestroy(lt);
}

// What a real capture rejects is reported: the call fails naming itself, the capture is invalidated and
// cudaStreamEndCapture fails naming the first offence. Stream-ordered allocation is what a graph can hold.
TEST(CudaEmulator, WhatACaptureCannotHoldIsReported) {
  cudaStream_t s = cuda_stream();
  DeviceBuffer<float> a(16);
  std::vector<float> h(16);
  auto capture_with = [&](auto&& call, cudaError_t want, const std::string& named) {
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
    EXPECT_EQ(call(), want);
    const std::string detail = cudaGetErrorString(cudaGetLastError());
    EXPECT_NE(detail.find(named), std::string::npos) << detail;
    EXPECT_NE(detail.find("while a stream is capturing"), std::string::npos) << detail;
    cudaGraph_t g = nullptr;
    EXPECT_EQ(cudaStreamEndCapture(s, &g), cudaErrorStreamCaptureInvalidated);
    EXPECT_EQ(g, nullptr);
    EXPECT_NE(std::string(cudaGetErrorString(cudaGetLastError())).find(named), std::string::npos);
  };
  // The host reading results inside the capture: a copy to the host and the wait for it.
  capture_with([&] { return cudaMemcpy(h.data(), a.p, 64, cudaMemcpyDeviceToHost); },
               cudaErrorStreamCaptureUnsupported, "cudaMemcpy (device to host");
  capture_with([&] { return cudaMemcpyAsync(h.data(), a.p, 64, cudaMemcpyDeviceToHost, s); },
               cudaErrorStreamCaptureUnsupported, "a copy (device to host, 64 bytes) of host memory");
  capture_with([&] { return cudaMemcpyAsync(a.p, h.data(), 64, cudaMemcpyHostToDevice, s); },
               cudaErrorStreamCaptureUnsupported, "a copy (host to device, 64 bytes) of host memory");
  capture_with([&] { return cudaStreamSynchronize(s); }, cudaErrorStreamCaptureUnsupported,
               "cudaStreamSynchronize");
  capture_with([&] { return cudaDeviceSynchronize(); }, cudaErrorStreamCaptureUnsupported,
               "cudaDeviceSynchronize");
  capture_with(
      [&] {
        void* p = nullptr;
        return cudaMalloc(&p, 64);
      },
      cudaErrorStreamCaptureUnsupported, "cudaMalloc of 64 bytes");
  capture_with([&] { return cudaFreeAsync(a.p, s); }, cudaErrorStreamCaptureUnsupported,
               "cudaFreeAsync of memory allocated before the capture");
  capture_with([&] { return cudaMemsetAsync(a.p, 0, 64, nullptr); }, cudaErrorStreamCaptureUnsupported,
               "a memset on the legacy stream");
  ASSERT_EQ(cudaMemcpy(a.p, h.data(), 64, cudaMemcpyHostToDevice), cudaSuccess);  // eager again

  // cudaMallocAsync on the capturing stream: one fixed address for every launch, owned by the graph; its
  // cudaFreeAsync in the capture is the graph's.
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  void* scratch = nullptr;
  ASSERT_EQ(cudaMallocAsync(&scratch, 64, s), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(scratch, a.p, 64, cudaMemcpyDeviceToDevice, s), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(a.p + 8, scratch, 32, cudaMemcpyDeviceToDevice, s), cudaSuccess);
  ASSERT_EQ(cudaFreeAsync(scratch, s), cudaSuccess);
  cudaGraph_t g;
  ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
  EXPECT_TRUE(cuda_sim::is_device_range(scratch, 64));  // alive while the graph is
  for (int i = 0; i < 16; ++i) h[i] = float(i);
  a.set(h);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  const std::vector<float> got = a.host();
  for (int i = 0; i < 8; ++i) EXPECT_EQ(got[8 + i], float(i));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(g);
  EXPECT_FALSE(cuda_sim::is_device_range(scratch, 64));  // freed with the graph
}

}  // namespace
}  // namespace titan::cuda
