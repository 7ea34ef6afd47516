// Device registry (like ggml-backend / PyTorch PrivateUse1): each device registers an allocator and
// its kernels at start-up. Nothing outside src/device/ knows which device it runs on.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace titan {

// GUARD: host memory behind addresses the host cannot dereference, running the CPU's kernels
// (src/device/guard/). Code that reads or writes device memory outside an op or a device copy crashes on it,
// so the whole device path of a model or trainer can be checked on a machine without an accelerator.
enum class DeviceType : uint8_t { CPU = 0, CUDA = 1, GUARD = 2 };
constexpr int kNumDeviceTypes = 3;
const char* device_type_name(DeviceType t);

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;
  static Device cpu() { return {}; }
  std::string str() const;
  bool operator==(const Device&) const = default;
};

// Allocation statistics per device (bytes), for the trainer's memory metrics.
struct AllocatorStats {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> num_allocs{0};
  void on_alloc(size_t n);
  void on_free(size_t n);
  void reset_peak() { peak.store(current.load()); }
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t nbytes) = 0;
  virtual void deallocate(void* ptr, size_t nbytes) = 0;
  AllocatorStats stats;
};

// What a device provides to the core. Versioned so an out-of-tree device can check compatibility.
struct DeviceInterface {
  static constexpr int kVersion = 5;  // 2: device_count, describe, synchronize; 3: zero, copy; 4: marks;
                                      // 5: graphs
  int version = kVersion;
  const char* name = "";
  Allocator* allocator = nullptr;
  // Copies between host memory and this device (CPU: memcpy).
  void (*copy_to_host)(void* dst, const void* src, size_t n) = nullptr;
  void (*copy_from_host)(void* dst, const void* src, size_t n) = nullptr;
  // On the device: n zero bytes at dst; n bytes from src to dst (both this device's memory, no overlap).
  // Queued in order with the device's ops.
  void (*zero)(void* dst, size_t n) = nullptr;
  void (*copy)(void* dst, const void* src, size_t n) = nullptr;
  int (*num_threads)() = nullptr;
  // Accelerators: how many are present (0 when the runtime finds none; then every allocation fails with
  // a titan::Error) and a one-line-per-device description for `titan env`. Null on the CPU.
  int (*device_count)() = nullptr;
  std::string (*describe)() = nullptr;
  // Waits until the device has finished all queued work (null where work is synchronous).
  void (*synchronize)() = nullptr;
  // Accelerators: makes device `index` this process's current one (before its first allocation or op).
  void (*set_current)(int index) = nullptr;
  // Accelerators: bytes of memory of the current device (for memory reports). Null: host memory.
  int64_t (*memory_bytes)() = nullptr;
  // Accelerators: timing marks in the device's queue (CUDA events). mark() records a point after the work
  // queued so far and returns it (the host does not wait); elapsed_ms(a, b) waits until b is reached and
  // returns the device time from a to b; release_mark frees one. Null where ops run on the host (time them
  // with the host clock).
  void* (*mark)() = nullptr;
  double (*elapsed_ms)(void* from, void* to) = nullptr;
  void (*release_mark)(void* m) = nullptr;
  // Accelerators: graphs (CUDA graphs). capture(work) runs work() with the device's queue recording instead
  // of running: the ops it issues become a graph, returned, that graph_launch() runs again, in order, on
  // the same addresses (the ops' pointers and scalar arguments are fixed; buffer contents are read when it
  // runs). A call a graph cannot hold (a host read of device memory, a synchronisation, an allocation
  // outside the queue's pool) throws an Error naming it, and the capture is ended; so run the work once
  // before capturing it (what ops make on first use, a GEMM library's handle and workspace, cached
  // attention plans, is made then). graph_release frees a graph. Null where ops run on the host.
  void* (*capture)(const std::function<void()>& work) = nullptr;
  void (*graph_launch)(void* graph) = nullptr;
  void (*graph_release)(void* graph) = nullptr;
};

// Registers `iface` for `type`; called from a static initializer in the device's own file.
void register_device(DeviceType type, DeviceInterface* iface);
// Throws titan::Error if the device type is not compiled in.
DeviceInterface& device_interface(DeviceType type);
bool device_available(DeviceType type);
// "cpu", "cuda" (= cuda:0), "cuda:N" or "guard". Throws titan::Error naming `what` (e.g. the config key)
// otherwise.
Device parse_device(std::string_view name, std::string_view what = "device");

}  // namespace titan
