// Kernel registry: op -> device -> named implementations. Every op has a "reference" implementation
// (simple loops, the oracle in tests) and may have others ("fast", "fused", ...), each registered
// statically from its own file. A config picks one by name; otherwise the highest priority wins.
#pragma once
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "device/device.h"

namespace titan {

struct KernelEntry {
  const void* table = nullptr;  // points at the op's function table (e.g. RmsNormKernels)
  int priority = 0;
};

class KernelRegistry {
 public:
  static KernelRegistry& global();
  void add(std::string_view op, DeviceType device, std::string_view impl, const void* table, int priority);
  const void* find(std::string_view op, DeviceType device, std::string_view impl) const;
  std::string default_impl(std::string_view op, DeviceType device) const;
  std::vector<std::string> ops() const;
  std::vector<std::string> impls(std::string_view op, DeviceType device) const;

 private:
  // op -> device -> impl -> entry
  std::map<std::string, std::map<int, std::map<std::string, KernelEntry>, std::less<>>, std::less<>> table_;
};

// Typed access. K is an op's function table type with a static `kOp` name.
template <class K>
const K& get_kernel(DeviceType device, std::string_view impl = "") {
  auto& reg = KernelRegistry::global();
  std::string name = impl.empty() ? reg.default_impl(K::kOp, device) : std::string(impl);
  const void* t = reg.find(K::kOp, device, name);
  if (!t) {
    std::string valid;
    for (auto& s : reg.impls(K::kOp, device)) valid += (valid.empty() ? "" : ", ") + s;
    fail("kernel '", K::kOp, "' has no implementation '", name, "' on ", device_type_name(device),
         " (registered: ", valid, ")");
  }
  return *static_cast<const K*>(t);
}

template <class K>
struct KernelRegistrar {
  KernelRegistrar(DeviceType device, const char* impl, const K* table, int priority) {
    KernelRegistry::global().add(K::kOp, device, impl, table, priority);
  }
};

}  // namespace titan

// TITAN_REGISTER_KERNEL(RmsNormKernels, CPU, "fast", table, 10)
#define TITAN_REGISTER_KERNEL(Type, dev, impl, table, priority)                           \
  static ::titan::KernelRegistrar<Type> TITAN_KERNEL_CONCAT(titan_kernel_reg_, __LINE__)( \
      ::titan::DeviceType::dev, impl, &(table), priority)
#define TITAN_KERNEL_CONCAT_INNER(a, b) a##b
#define TITAN_KERNEL_CONCAT(a, b) TITAN_KERNEL_CONCAT_INNER(a, b)
