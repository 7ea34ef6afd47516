// The CUDA device: a caching, stream-ordered allocator (the runtime's memory pool behind cudaMallocAsync,
// told to keep freed memory instead of returning it to the driver), copies through the device's stream,
// and the GPU list for `titan env`. It registers for DeviceType::CUDA at start-up without touching the
// GPU: the runtime is first called by the first allocation, copy or kernel, so a binary built with CUDA
// runs unchanged on a machine without one (every CUDA call then fails with a titan::Error).
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>

#include "device/cuda/cuda_common.cuh"
#include "device/device.h"

namespace titan::cuda {

void fail_cuda(cudaError_t e, const char* what, const char* file, int line) {
  fail("CUDA error ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ") in ", what, " at ", file, ":",
       line);
}

namespace {

int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device"/"no driver" error
    return 0;
  }
  return n;
}

struct StreamState {
  std::once_flag once;
  cudaStream_t stream = nullptr;
};
StreamState& stream_state() {
  static StreamState s;
  return s;
}

void init_stream() {
  TITAN_CHECK(gpu_count() > 0, "CUDA device requested but the CUDA runtime finds no GPU");
  int dev = 0;
  TITAN_CUDA_CHECK(cudaGetDevice(&dev));
  // Keep every freed block in the pool: allocations of a training step repeat, so after the first step
  // they are served from the cache, stream-ordered, with no cudaMalloc and no device synchronization.
  cudaMemPool_t pool;
  TITAN_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t keep = UINT64_MAX;
  TITAN_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  TITAN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_state().stream, cudaStreamNonBlocking));
}

}  // namespace

cudaStream_t cuda_stream() {
  auto& s = stream_state();
  std::call_once(s.once, init_stream);
  return s.stream;
}

void* scratch_alloc(size_t nbytes) {
  void* p = nullptr;
  TITAN_CUDA_CHECK(cudaMallocAsync(&p, nbytes == 0 ? 256 : nbytes, cuda_stream()));
  return p;
}

void scratch_free(void* p) {
  if (p) TITAN_CUDA_CHECK(cudaFreeAsync(p, cuda_stream()));
}

namespace {

class CudaAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    void* p = scratch_alloc(nbytes);
    stats.on_alloc(nbytes);
    return p;
  }
  void deallocate(void* ptr, size_t nbytes) override {
    scratch_free(ptr);
    stats.on_free(nbytes);
  }
};

// Host <-> device copies wait for the stream: the host buffer may be read or freed right after.
void copy_to_host(void* dst, const void* src, size_t n) {
  if (n == 0) return;
  TITAN_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, cuda_stream()));
  TITAN_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
}
void copy_from_host(void* dst, const void* src, size_t n) {
  if (n == 0) return;
  TITAN_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, cuda_stream()));
  TITAN_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
}
void zero(void* dst, size_t n) {
  if (n) TITAN_CUDA_CHECK(cudaMemsetAsync(dst, 0, n, cuda_stream()));
}
void copy_on_device(void* dst, const void* src, size_t n) {
  if (n) TITAN_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, cuda_stream()));
}
void set_current(int index) {
  const int n = gpu_count();
  TITAN_CHECK(n > 0, "cuda:", index, " requested, but the CUDA runtime finds no GPU");
  TITAN_CHECK(index >= 0 && index < n, "cuda:", index, " requested, but the CUDA runtime finds ", n,
              " GPU(s)");
  TITAN_CUDA_CHECK(cudaSetDevice(index));
}
int64_t memory_bytes() {
  size_t free_bytes = 0, total = 0;
  cuda_stream();  // the runtime on the current device
  TITAN_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  return static_cast<int64_t>(total);
}
int one_thread() {
  return 1;
}
void synchronize() {
  TITAN_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
}
void* mark() {
  cudaEvent_t e = nullptr;
  TITAN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDefault));
  TITAN_CUDA_CHECK(cudaEventRecord(e, cuda_stream()));
  return e;
}
double elapsed_ms(void* from, void* to) {
  float ms = 0;
  TITAN_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(to)));
  TITAN_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(from), static_cast<cudaEvent_t>(to)));
  return ms;
}
void release_mark(void* m) {
  TITAN_CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(m)));
}

// Stream capture in global mode: any call elsewhere in the process that a graph cannot hold fails too.
void* capture(const std::function<void()>& work) {
  cudaStream_t s = cuda_stream();
  TITAN_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  cudaGraph_t graph = nullptr;
  try {
    work();
  } catch (...) {
    cudaStreamEndCapture(s, &graph);  // (invalidated: no graph; the stream runs eagerly again)
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();  // (the capture's errors are reported by the exception, not by the next launch)
    throw;
  }
  if (const cudaError_t e = cudaStreamEndCapture(s, &graph); e != cudaSuccess) {
    const std::string why = cudaGetErrorString(e);
    cudaGetLastError();
    fail("CUDA graph capture failed: ", why);
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  TITAN_CUDA_CHECK(e);
  return exec;
}
void graph_launch(void* graph) {
  TITAN_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), cuda_stream()));
}
void graph_release(void* graph) {
  TITAN_CUDA_CHECK(cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph)));
}

// One line per GPU: index, name, memory, compute capability, multiprocessors; plus driver/runtime.
std::string describe() {
  const int n = gpu_count();
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::string out = str_cat("  driver ", driver / 1000, ".", driver % 1000 / 10, ", runtime ", runtime / 1000,
                            ".", runtime % 1000 / 10, "\n");
  if (n == 0) return out + "  (no GPU found)\n";
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    out += str_cat("  cuda:", i, " ", p.name, ", ", p.totalGlobalMem / (1024 * 1024), " MiB, compute ",
                   p.major, ".", p.minor, ", ", p.multiProcessorCount, " SMs\n");
  }
  return out;
}

struct CudaDeviceRegistration {
  CudaAllocator allocator;
  DeviceInterface iface;
  CudaDeviceRegistration() {
    iface.name = "cuda";
    iface.allocator = &allocator;
    iface.copy_to_host = copy_to_host;
    iface.copy_from_host = copy_from_host;
    iface.zero = zero;
    iface.copy = copy_on_device;
    iface.set_current = set_current;
    iface.memory_bytes = memory_bytes;
    iface.num_threads = one_thread;
    iface.device_count = gpu_count;
    iface.describe = describe;
    iface.synchronize = synchronize;
    iface.mark = mark;
    iface.elapsed_ms = elapsed_ms;
    iface.release_mark = release_mark;
    iface.capture = capture;
    iface.graph_launch = graph_launch;
    iface.graph_release = graph_release;
    register_device(DeviceType::CUDA, &iface);
  }
};
CudaDeviceRegistration cuda_device_registration;

}  // namespace
}  // namespace titan::cuda
