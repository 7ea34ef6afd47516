// The CPU device: 64-byte aligned host memory, OpenMP threads. Its kernels register in src/kernels/.
#include <omp.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "device/device.h"

namespace titan {
namespace {

class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    size_t rounded = (nbytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
    if (!p) throw std::bad_alloc();
    stats.on_alloc(nbytes);
    return p;
  }
  void deallocate(void* ptr, size_t nbytes) override {
    std::free(ptr);
    stats.on_free(nbytes);
  }
};

void copy_host(void* dst, const void* src, size_t n) {
  std::memcpy(dst, src, n);
}
void zero_host(void* dst, size_t n) {
  std::memset(dst, 0, n);
}
int64_t host_memory_bytes() {  // physical memory: what the cpu device's buffers can take
  return int64_t(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
}
int cpu_threads() {
  return omp_get_max_threads();
}

struct CpuDeviceRegistration {
  CpuAllocator allocator;
  DeviceInterface iface;
  CpuDeviceRegistration() {
    iface.name = "cpu";
    iface.allocator = &allocator;
    iface.copy_to_host = copy_host;
    iface.copy_from_host = copy_host;
    iface.zero = zero_host;
    iface.copy = copy_host;
    iface.num_threads = cpu_threads;
    iface.memory_bytes = host_memory_bytes;
    register_device(DeviceType::CPU, &iface);
  }
};
CpuDeviceRegistration cpu_device_registration;

}  // namespace
}  // namespace titan
