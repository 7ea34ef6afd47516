// Kernel registry: op -> device -> named implementations. Every op has a "reference" implementation
// (simple loops, the oracle in tests) and may have others ("fast", "fused", ...), each registered
// statically from its own file. A config picks one by name; otherwise the highest priority wins.
//
// A CPU implementation may come in several builds of the same source, one per instruction-set level
// (core/cpu_isa.h; CMake's TITAN_ISA_VARIANT_SOURCES compile them with -march=x86-64-v3 / -v4), or need a
// level to run at all (oneDNN's bf16 engines need AVX512_BF16). Each build is a variant of the
// implementation tagged with the level it needs; the registry runs the highest variant the CPU supports
// (cpu_isa(): cpuid, capped by TITAN_CPU_ISA), and an implementation with no runnable variant is not a
// default and, asked for by name, is an error naming the op, the implementation and the missing feature.
#pragma once
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/cpu_isa.h"
#include "core/error.h"
#include "device/device.h"

namespace titan {

struct KernelVariant {
  const void* table = nullptr;  // points at the op's function table (e.g. RmsNormKernels)
  CpuIsa isa = CpuIsa::kBaseline;
};

struct KernelEntry {
  std::vector<KernelVariant> variants;  // ascending isa
  int priority = 0;
};

class KernelRegistry {
 public:
  static KernelRegistry& global();
  void add(std::string_view op, DeviceType device, std::string_view impl, const void* table, int priority,
           CpuIsa isa = CpuIsa::kBaseline);
  // The variant of `impl` this CPU runs (the highest level it supports); nullptr when none is registered
  // or none can run here.
  const void* find(std::string_view op, DeviceType device, std::string_view impl) const;
  // One variant exactly (tests run every variant the CPU supports against the reference).
  const void* find_variant(std::string_view op, DeviceType device, std::string_view impl, CpuIsa isa) const;
  // The levels `impl` is built for (ascending), and the one this CPU runs (kBaseline when none can run).
  std::vector<CpuIsa> variants(std::string_view op, DeviceType device, std::string_view impl) const;
  bool runnable(std::string_view op, DeviceType device, std::string_view impl) const;
  CpuIsa running_isa(std::string_view op, DeviceType device, std::string_view impl) const;
  // Why `impl` cannot run here: "needs avx512_bf16 (this CPU: avx2)"; empty when it can.
  std::string why_not_runnable(std::string_view op, DeviceType device, std::string_view impl) const;
  // The default: among the implementations that run here, the highest priority of those with no reason
  // not to be a default on this CPU (set_default_condition), else the highest priority.
  std::string default_impl(std::string_view op, DeviceType device) const;
  // An implementation that runs here but is slower than another on some CPUs (oneDNN's bf16 GEMMs where
  // bf16 dot products are slow): `why_not` returns why it should not be the default here, or "" when it
  // should. It is still run when asked for by name.
  void set_default_condition(std::string_view op, DeviceType device, std::string_view impl,
                             std::string (*why_not)());
  // Why the runnable `impl` is passed over as the default here; empty when it is not.
  std::string why_not_default(std::string_view op, DeviceType device, std::string_view impl) const;
  std::vector<std::string> ops() const;
  std::vector<std::string> impls(std::string_view op, DeviceType device) const;

 private:
  const KernelEntry* entry(std::string_view op, DeviceType device, std::string_view impl) const;
  // op -> device -> impl -> entry
  std::map<std::string, std::map<int, std::map<std::string, KernelEntry, std::less<>>>, std::less<>> table_;
  // "op/device/impl" -> why_not (kept apart from table_: a condition may be set before its implementation
  // registers, static initialisation order across files being unspecified)
  std::map<std::string, std::string (*)(), std::less<>> default_conditions_;
};

// Typed access. K is an op's function table type with a static `kOp` name.
template <class K>
const K& get_kernel(DeviceType device, std::string_view impl = "") {
  auto& reg = KernelRegistry::global();
  std::string name = impl.empty() ? reg.default_impl(K::kOp, device) : std::string(impl);
  const void* t = reg.find(K::kOp, device, name);
  if (!t) {
    std::string why = reg.why_not_runnable(K::kOp, device, name);
    if (!why.empty()) fail("kernel '", K::kOp, "' implementation '", name, "' cannot run here: ", why);
    std::string valid;
    for (auto& s : reg.impls(K::kOp, device)) valid += (valid.empty() ? "" : ", ") + s;
    fail("kernel '", K::kOp, "' has no implementation '", name, "' on ", device_type_name(device),
         " (registered: ", valid, ")");
  }
  return *static_cast<const K*>(t);
}

struct KernelDefaultCondition {
  KernelDefaultCondition(const char* op, DeviceType device, const char* impl, std::string (*why_not)()) {
    KernelRegistry::global().set_default_condition(op, device, impl, why_not);
  }
};

template <class K>
struct KernelRegistrar {
  KernelRegistrar(DeviceType device, const char* impl, const K* table, int priority, CpuIsa isa) {
    KernelRegistry::global().add(K::kOp, device, impl, table, priority, isa);
  }
};

}  // namespace titan

// The level the sources of this translation unit are compiled for: TITAN_KERNEL_ISA (kAvx2, kAvx512) in the
// per-ISA builds of TITAN_ISA_VARIANT_SOURCES, else the build's own flags (kBaseline).
#ifdef TITAN_KERNEL_ISA
#define TITAN_THIS_ISA ::titan::CpuIsa::TITAN_KERNEL_ISA
#else
#define TITAN_THIS_ISA ::titan::CpuIsa::kBaseline
#endif

// TITAN_REGISTER_KERNEL(RmsNormKernels, CPU, "fast", table, 10): a variant at this file's own level.
#define TITAN_REGISTER_KERNEL(Type, dev, impl, table, priority) \
  TITAN_REGISTER_KERNEL_ISA(Type, dev, impl, table, priority, TITAN_THIS_ISA)
// An implementation that needs a level whatever it is compiled with (a library's instructions).
#define TITAN_REGISTER_KERNEL_ISA(Type, dev, impl, table, priority, isa)                  \
  static ::titan::KernelRegistrar<Type> TITAN_KERNEL_CONCAT(titan_kernel_reg_, __LINE__)( \
      ::titan::DeviceType::dev, impl, &(table), priority, isa)
// Registered once, by the build of its file at the build's own flags, never by its per-ISA builds: the
// reference implementations (the oracles) and implementations whose instructions are a library's (oneDNN's
// bf16 engines), which need `isa` whatever the file is compiled with.
#ifdef TITAN_KERNEL_ISA
#define TITAN_REGISTER_KERNEL_ONCE(Type, dev, impl, table, priority, isa)
#else
#define TITAN_REGISTER_KERNEL_ONCE(Type, dev, impl, table, priority, isa) \
  TITAN_REGISTER_KERNEL_ISA(Type, dev, impl, table, priority, isa)
#endif
// A condition for `impl` to be a default (KernelRegistry::set_default_condition), set once (not by the
// per-ISA builds).
#ifdef TITAN_KERNEL_ISA
#define TITAN_KERNEL_DEFAULT_CONDITION(Type, dev, impl, why_not)
#else
#define TITAN_KERNEL_DEFAULT_CONDITION(Type, dev, impl, why_not)                            \
  static ::titan::KernelDefaultCondition TITAN_KERNEL_CONCAT(titan_kernel_cond_, __LINE__)( \
      Type::kOp, ::titan::DeviceType::dev, impl, why_not)
#endif
#define TITAN_REGISTER_REFERENCE_KERNEL(Type, dev, impl, table, priority) \
  TITAN_REGISTER_KERNEL_ONCE(Type, dev, impl, table, priority, ::titan::CpuIsa::kBaseline)
#define TITAN_KERNEL_CONCAT_INNER(a, b) a##b
#define TITAN_KERNEL_CONCAT(a, b) TITAN_KERNEL_CONCAT_INNER(a, b)
