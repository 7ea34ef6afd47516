#include "core/cpu_isa.h"

#include <cpuid.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "core/error.h"

#ifdef TITAN_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif

namespace titan {
namespace {

constexpr const char* kNames[kCpuIsaCount] = {"baseline", "avx2", "avx512", "avx512_bf16", "amx"};
constexpr const char* kFeatures[kCpuIsaCount] = {
    "x86-64", "avx2 fma f16c", "avx512f avx512bw avx512vl avx512dq", "avx512_bf16", "amx_tile amx_bf16"};

bool bit(uint32_t reg, int b) {
  return (reg >> b) & 1u;
}

uint64_t xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((uint64_t)hi << 32) | lo;
}

// cpuid for the instructions, XCR0 for the register state the OS saves (a CPU with AVX-512 under an OS or
// hypervisor that does not enable ZMM state cannot run it).
CpuIsa detect() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return CpuIsa::kBaseline;
  const bool fma = bit(c, 12), osxsave = bit(c, 27), avx = bit(c, 28), f16c = bit(c, 29);
  if (!osxsave || !avx) return CpuIsa::kBaseline;
  const uint64_t xcr0 = xgetbv0();
  if ((xcr0 & 0x6) != 0x6) return CpuIsa::kBaseline;  // XMM + YMM state
  if (__get_cpuid_max(0, nullptr) < 7) return CpuIsa::kBaseline;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = bit(b, 5), avx512f = bit(b, 16), avx512dq = bit(b, 17), avx512bw = bit(b, 30),
             avx512vl = bit(b, 31), amx_bf16 = bit(d, 22), amx_tile = bit(d, 24);
  const uint32_t leaf7_subleaves = a;
  if (!(avx2 && fma && f16c)) return CpuIsa::kBaseline;
  if (!(avx512f && avx512dq && avx512bw && avx512vl) || (xcr0 & 0xE0) != 0xE0) return CpuIsa::kAvx2;
  bool avx512_bf16 = false;
  if (leaf7_subleaves >= 1) {
    __cpuid_count(7, 1, a, b, c, d);
    avx512_bf16 = bit(a, 5);
  }
  if (!avx512_bf16) return CpuIsa::kAvx512;
  const bool tile_state = (xcr0 & (3ull << 17)) == (3ull << 17);  // XTILECFG + XTILEDATA
  if (!(amx_bf16 && amx_tile && tile_state)) return CpuIsa::kAvx512Bf16;
  return CpuIsa::kAmx;
}

const char* cap_env() {
  const char* v = std::getenv("TITAN_CPU_ISA");
  return v && *v ? v : nullptr;
}

CpuIsa capped() {
  const CpuIsa hw = cpu_isa_detected();
  const char* cap = cap_env();
  if (!cap) return hw;
  return std::min(hw, parse_cpu_isa(cap, "TITAN_CPU_ISA"));
}

#ifdef TITAN_HAVE_DNNL
// TITAN_CPU_ISA caps oneDNN's own dispatch too (before its first primitive), unless oneDNN's variable is set.
// An invalid value is reported by cpu_isa() at first use, not here (static initialisation).
[[maybe_unused]] const bool kOneDnnCapped = [] {
  if (!cap_env() || std::getenv("ONEDNN_MAX_CPU_ISA") || std::getenv("DNNL_MAX_CPU_ISA")) return false;
  try {
    static constexpr dnnl_cpu_isa_t kDnnl[kCpuIsaCount] = {
        dnnl_cpu_isa_sse41, dnnl_cpu_isa_avx2, dnnl_cpu_isa_avx512_core, dnnl_cpu_isa_avx512_core_bf16,
        dnnl_cpu_isa_avx512_core_amx};
    return dnnl_set_max_cpu_isa(kDnnl[static_cast<int>(capped())]) == dnnl_success;
  } catch (const Error&) {
    return false;
  }
}();
#endif

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  return kNames[static_cast<int>(isa)];
}

const char* cpu_isa_features(CpuIsa isa) {
  return kFeatures[static_cast<int>(isa)];
}

CpuIsa parse_cpu_isa(std::string_view name, std::string_view what) {
  for (int i = 0; i < kCpuIsaCount; ++i)
    if (name == kNames[i]) return static_cast<CpuIsa>(i);
  std::string valid;
  for (auto* n : kNames) valid += (valid.empty() ? "" : ", ") + std::string(n);
  fail(what, " = '", name, "': unknown CPU ISA level (valid: ", valid, ")");
}

CpuIsa cpu_isa_detected() {
  static const CpuIsa isa = detect();
  return isa;
}

CpuIsa cpu_isa() {
  static const CpuIsa isa = capped();
  return isa;
}

bool cpu_isa_supported(CpuIsa need) {
  return need <= cpu_isa();
}

std::string cpu_isa_missing(CpuIsa need) {
  const CpuIsa hw = cpu_isa_detected();
  if (need <= hw)
    return str_cat(cpu_isa_features(need), " (capped by TITAN_CPU_ISA=", cap_env() ? cap_env() : "", ")");
  std::string missing;
  for (int i = static_cast<int>(hw) + 1; i <= static_cast<int>(need); ++i)
    missing += (missing.empty() ? "" : " ") + std::string(kFeatures[i]);
  return str_cat(missing, " (this CPU: ", cpu_isa_name(hw), ")");
}

}  // namespace titan
