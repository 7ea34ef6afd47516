// The counter-based uniform of DropoutKernels (ops.h), shared by every device's implementation so that a
// mask is the same bits wherever it is drawn: splitmix64 of the counter, its top 24 bits / 2^24.
#pragma once
#include <cstdint>

#include "kernels/host_device.h"

namespace titan {

TITAN_HOST_DEVICE inline float counter_uniform(uint64_t key) {
  uint64_t z = key + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * 0x1.0p-24f;
}

}  // namespace titan
