// The guard device's address offset (guard_device.cpp): a guard "device pointer" is the host address plus
// kOffset, which the host cannot dereference. hide/reveal convert; a process group for guard buffers
// (dist) reveals before it hands them to MPI.
#pragma once
#include <cstdint>

namespace titan::guard {

constexpr uintptr_t kOffset = uintptr_t(1) << 52;
inline void* hide(void* p) {
  return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) + kOffset);
}
inline bool is_hidden(const void* p) {
  const uintptr_t u = reinterpret_cast<uintptr_t>(p);
  return u >= kOffset && u < 2 * kOffset;
}
inline void* reveal(const void* p) {
  return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) - kOffset);
}

}  // namespace titan::guard
