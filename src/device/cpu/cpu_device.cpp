// The CPU device: 64-byte aligned host memory, OpenMP threads. Its kernels register in src/kernels/.
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "device/device.h"

namespace titan {
namespace {

// Buffers of 2 MiB and more (weights, gradients, optimizer state, activations) are 2 MiB aligned and asked
// to be backed by transparent huge pages: where the kernel hands them out only on request
// (/sys/kernel/mm/transparent_hugepage/enabled = madvise, a common default) the GEMMs and the optimizer's
// streams over hundreds of MiB otherwise walk 4 KiB pages.
constexpr size_t kHugePage = size_t(2) << 20;

class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    const size_t align = nbytes >= kHugePage ? kHugePage : 64;
    size_t rounded = (nbytes + align - 1) / align * align;
    void* p = std::aligned_alloc(align, rounded == 0 ? 64 : rounded);
    if (!p) throw std::bad_alloc();
    if (align == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);  // advice only: no error if refused
    stats.on_alloc(nbytes);
    return p;
  }
  void deallocate(void* ptr, size_t nbytes) override {
    std::free(ptr);
    stats.on_free(nbytes);
  }
};

// Copies and clears of 1 MiB and more (the backward's gradient buffers, the residual stream) are split
// across the OpenMP threads: one core's store bandwidth is a fraction of the socket's, and the other
// threads would only wait at the next kernel's barrier. Inside a parallel region they run on the caller.
constexpr size_t kSplitBytes = size_t(1) << 20;

template <typename Fn>
void split_bytes(size_t n, Fn&& fn) {
  if (n < kSplitBytes || omp_in_parallel() || omp_get_max_threads() == 1) return fn(size_t(0), n);
#pragma omp parallel
  {
    const size_t parts = static_cast<size_t>(omp_get_num_threads());
    const size_t chunk = (n / parts + 63) / 64 * 64;  // cache-line multiples
    const size_t begin = std::min(n, chunk * static_cast<size_t>(omp_get_thread_num()));
    const size_t end = std::min(n, begin + chunk);
    if (begin < end) fn(begin, end - begin);
  }
}

void copy_host(void* dst, const void* src, size_t n) {
  split_bytes(n, [&](size_t off, size_t len) {
    std::memcpy(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off, len);
  });
}
void zero_host(void* dst, size_t n) {
  split_bytes(n, [&](size_t off, size_t len) { std::memset(static_cast<char*>(dst) + off, 0, len); });
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
