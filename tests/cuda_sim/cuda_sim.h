// The CUDA emulator: the CUDA device's own sources (src/device/cuda/*.cu, kernels and host code) compiled
// by the host compiler and run on the CPU, so that every CUDA op, the allocator, the copies and the cuBLASLt
// calls execute and are checked against the CPU references on machines without a GPU.
//
// This header is included first into every emulated .cu file (CMake's wrappers under build/cuda_sim/). It
// takes the types from the real CUDA headers and supplies what device code needs from the hardware:
//   - threadIdx, blockIdx, blockDim, gridDim of the thread now running;
//   - __shared__ variables: one copy per block (a block runs on one host thread at a time);
//   - __syncthreads, __syncwarp, __shfl_*_sync: each CUDA thread of a block is a fiber (Boost.Context, in
//     runtime.cpp) that runs until it reaches a barrier; a barrier is released when every thread it names
//     has arrived;
//   - atomicAdd and the bit-cast intrinsics.
// The runtime (runtime.cpp) defines the CUDA runtime functions the device calls (memory is host memory,
// streams are synchronous but for the NCCL sends they hold back: Deferred) and cublaslt.cpp the cuBLASLt
// subset of matmul.cu.
//
// What it checks, where a GPU would hang, fault or silently compute garbage (each a titan::Error naming the
// launch site or the barrier):
//   - launch configurations (block and grid limits, dynamic shared memory over 48 KiB without
//     cudaFuncSetAttribute, over 227 KiB at all) and kernel pointer arguments outside device allocations;
//   - barriers that can never complete (deadlock), threads of one block at different __syncthreads, lanes of
//     a shuffle's mask that exited or do not exist, a shuffle reading a lane outside its mask;
//   - copies and memsets outside device allocations, or with host and device pointers swapped.
// New device memory is filled with 0xff bytes (a NaN in every float format), so a kernel that reads
// memory nobody wrote shows NaN in the results. Threads of a block run one at a time between barriers,
// in reverse and forward order by turns (and neighbouring blocks start with different ones), so a missing
// barrier shows whichever way round the racing threads are; blocks run last to first.
// What it does not model: timing, memory coalescing, registers (a block too large for a kernel's register
// count launches here and fails on a GPU), warps executing in lockstep (no code may rely on that since
// Volta), races between blocks (blocks run one after another), static __shared__ arrays' contents at a
// block's start (they keep the previous block's values; dynamic shared memory is refilled with 0xff),
// out-of-bounds accesses inside a kernel (the asan preset's build of the emulator reports those past a
// device allocation).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <source_location>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace titan::cuda_sim {

// A launch's grid, with the launch site (for the emulator's errors). Integer grids wider than CUDA's
// gridDim.x limit are reported, not truncated.
struct Grid {
  dim3 dim;
  std::source_location where;
  int64_t requested_x = 1;
  Grid(dim3 d, std::source_location w = std::source_location::current())
      : dim(d), where(w), requested_x(d.x) {}
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  Grid(I n, std::source_location w = std::source_location::current())
      : dim(static_cast<unsigned>(n)), where(w), requested_x(static_cast<int64_t>(n)) {}
};

struct PointerArg {
  int index;
  const void* p;
};
template <class... P>
std::vector<PointerArg> pointer_args(const std::tuple<P...>& params) {
  std::vector<PointerArg> out;
  [&]<size_t... I>(std::index_sequence<I...>) {
    (
        [&] {
          if constexpr (std::is_pointer_v<std::tuple_element_t<I, std::tuple<P...>>>)
            out.push_back({static_cast<int>(I), static_cast<const void*>(std::get<I>(params))});
        }(),
        ...);
  }
  (std::index_sequence_for<P...>{});
  return out;
}

// Runs body() once per thread of every block (runtime.cpp). Throws titan::Error on a bad configuration,
// a deadlock or a misused intrinsic. On a stream under capture the launch is checked and recorded (body
// is kept: it must hold the kernel's arguments by value) and runs when the graph is launched.
void launch(const void* kernel, const Grid& grid, dim3 block, size_t dynamic_smem, cudaStream_t stream,
            const std::vector<PointerArg>& pointers, std::function<void()> body);

// Stream capture (cudaStreamBeginCapture .. cudaStreamEndCapture, global mode): work issued to the
// capturing stream (launches, cudaMemcpyAsync, cudaMemsetAsync, cuBLASLt matmuls, NCCL calls) is recorded
// into its graph instead of run, and cudaGraphLaunch runs the recorded work in order. cudaMallocAsync on
// it allocates once, at a fixed address the graph owns (as a graph's allocation node). What a real capture
// rejects is reported (the capture is invalidated, cudaStreamEndCapture fails naming the first offence):
// a synchronisation (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize/Query of work in
// the capture), a synchronous copy or memset (cudaMemcpy, cudaMemset: a host read of the device's results),
// a copy between host and device memory (titan's host memory is pageable: such a copy happens when it is
// issued, not when the graph runs), cudaMalloc/cudaFree. One stream captures at a time.
// record_if_capturing keeps `work` and returns true when `stream` is capturing (the caller then returns
// without running it); `what` names the call for errors.
bool record_if_capturing(cudaStream_t stream, std::function<void()> work);
// The same for calls that take no stream (NCCL's group calls): recorded while any capture is active.
bool record_if_capture_active(std::function<void()> work);

// Counters of the emulated device since the process started: kernels launched by the host (outside a
// capture), kernels run (eagerly or by a graph), graphs launched.
struct Counters {
  uint64_t host_launches = 0, kernels_run = 0, graph_launches = 0;
};
Counters counters();

// True if [p, p + n) lies inside one live device allocation (a zero-length range may end one).
bool is_device_range(const void* p, size_t n);

const uint3& thread_index();
const uint3& block_index();
const dim3& block_dim();
const dim3& grid_dim();
void* dynamic_shared();

enum class Exchange { kSyncWarp, kXor, kIdx, kDown, kUp };
void sync_threads(const std::source_location& where);
uint64_t warp_exchange(Exchange kind, unsigned mask, uint64_t bits, int arg, int width,
                       const std::source_location& where);

// Work a stream holds back until it is synchronized (everything else on an emulated stream completes when
// it is issued): the emulator's NCCL sends outside a group, which on a GPU hold their stream until the peer
// has posted the receive while the host goes on. cudaStreamSynchronize, cudaEventSynchronize (of an event
// recorded after it) and cudaStreamWaitEvent wait for it, cudaEventQuery tests it; in issue order.
struct Deferred {
  std::function<bool()> test;  // done? (never blocks)
  std::function<void()> wait;  // until done
};
void defer_on_stream(cudaStream_t stream, Deferred work);

template <class T>
T shuffle(Exchange kind, unsigned mask, T v, int arg, int width, const std::source_location& where) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a value wider than 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = warp_exchange(kind, mask, bits, arg, width, where);
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

}  // namespace titan::cuda_sim

// ---- what device code sees -----------------------------------------------------------------------------
#undef __shared__
#define __shared__ static thread_local
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#define threadIdx (::titan::cuda_sim::thread_index())
#define blockIdx (::titan::cuda_sim::block_index())
#define blockDim (::titan::cuda_sim::block_dim())
#define gridDim (::titan::cuda_sim::grid_dim())

inline void __syncthreads(std::source_location where = std::source_location::current()) {
  ::titan::cuda_sim::sync_threads(where);
}
inline void __syncwarp(unsigned mask = 0xffffffffu,
                       std::source_location where = std::source_location::current()) {
  ::titan::cuda_sim::warp_exchange(::titan::cuda_sim::Exchange::kSyncWarp, mask, 0, 0, 32, where);
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32,
              std::source_location where = std::source_location::current()) {
  return ::titan::cuda_sim::shuffle(::titan::cuda_sim::Exchange::kIdx, mask, v, src_lane, width, where);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32,
                  std::source_location where = std::source_location::current()) {
  return ::titan::cuda_sim::shuffle(::titan::cuda_sim::Exchange::kXor, mask, v, lane_mask, width, where);
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32,
                   std::source_location where = std::source_location::current()) {
  return ::titan::cuda_sim::shuffle(::titan::cuda_sim::Exchange::kDown, mask, v, static_cast<int>(delta),
                                    width, where);
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32,
                 std::source_location where = std::source_location::current()) {
  return ::titan::cuda_sim::shuffle(::titan::cuda_sim::Exchange::kUp, mask, v, static_cast<int>(delta), width,
                                    where);
}

// CUDA's overloads (no template: the same implicit conversions as nvcc).
inline float atomicAdd(float* p, float v) {
  return std::atomic_ref<float>(*p).fetch_add(v);
}
inline double atomicAdd(double* p, double v) {
  return std::atomic_ref<double>(*p).fetch_add(v);
}
inline int atomicAdd(int* p, int v) {
  return std::atomic_ref<int>(*p).fetch_add(v);
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return std::atomic_ref<unsigned>(*p).fetch_add(v);
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return std::atomic_ref<unsigned long long>(*p).fetch_add(v);
}

inline float __uint_as_float(unsigned u) {
  return std::bit_cast<float>(u);
}
inline unsigned __float_as_uint(float f) {
  return std::bit_cast<unsigned>(f);
}
inline float __int_as_float(int i) {
  return std::bit_cast<float>(i);
}
inline int __float_as_int(float f) {
  return std::bit_cast<int>(f);
}
inline int __float2int_rz(float x) {  // saturating, NaN -> 0, as the hardware
  if (std::isnan(x)) return 0;
  if (x >= 2147483648.0f) return INT32_MAX;
  if (x <= -2147483648.0f) return INT32_MIN;
  return static_cast<int>(x);
}
inline float __expf(float x) {
  return std::exp(x);
}
inline float __logf(float x) {
  return std::log(x);
}
inline float rsqrtf(float x) {
  return 1.0f / std::sqrt(x);
}

// CUDA's integer and float min/max overloads (usual arithmetic conversions for mixed types).
template <class A, class B, std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>, int> = 0>
std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return C(b) < C(a) ? C(b) : C(a);
}
template <class A, class B, std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>, int> = 0>
std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return C(a) < C(b) ? C(b) : C(a);
}

// cuda_runtime.h's typed overload (declared for nvcc only).
template <class T>
cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}
