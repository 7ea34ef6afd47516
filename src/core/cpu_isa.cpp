#include "core/cpu_isa.h"

#include <cpuid.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
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

// Seconds to run `rounds` x 12 independent vfmadd231ps (dot = false) or vdpbf16ps (dot = true) on zmm
// registers: twelve accumulators cover the latency of either instruction on every CPU that has both, so
// the loop runs at the instruction's throughput. Only called where the CPU runs AVX512_BF16.
double zmm_loop_seconds(bool dot, long rounds) {
#define TITAN_ZMM12(ins)                                                      \
  ins " %%zmm14, %%zmm15, %%zmm0\n\t" ins " %%zmm14, %%zmm15, %%zmm1\n\t" ins \
      " %%zmm14, %%zmm15, %%zmm2\n\t" ins " %%zmm14, %%zmm15, %%zmm3\n\t" ins \
      " %%zmm14, %%zmm15, %%zmm4\n\t" ins " %%zmm14, %%zmm15, %%zmm5\n\t" ins \
      " %%zmm14, %%zmm15, %%zmm6\n\t" ins " %%zmm14, %%zmm15, %%zmm7\n\t" ins \
      " %%zmm14, %%zmm15, %%zmm8\n\t" ins " %%zmm14, %%zmm15, %%zmm9\n\t" ins \
      " %%zmm14, %%zmm15, %%zmm10\n\t" ins " %%zmm14, %%zmm15, %%zmm11\n\t"
  const auto t0 = std::chrono::steady_clock::now();
  if (dot)
    __asm__ volatile(
        "vpxord %%zmm14, %%zmm14, %%zmm14\n\tvpxord %%zmm15, %%zmm15, %%zmm15\n\t"
        "1:\n\t" TITAN_ZMM12("vdpbf16ps") "dec %0\n\tjnz 1b\n\tvzeroupper"
        : "+r"(rounds)::"xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
          "xmm10", "xmm11", "xmm14", "xmm15", "cc");
  else
    __asm__ volatile(
        "vpxord %%zmm14, %%zmm14, %%zmm14\n\tvpxord %%zmm15, %%zmm15, %%zmm15\n\t"
        "1:\n\t" TITAN_ZMM12("vfmadd231ps") "dec %0\n\tjnz 1b\n\tvzeroupper"
        : "+r"(rounds)::"xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
          "xmm10", "xmm11", "xmm14", "xmm15", "cc");
#undef TITAN_ZMM12
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// vdpbf16ps does 32 multiply-adds per instruction, vfmadd231ps 16. The best of 9 alternating rounds of each
// (the first rounds also wake the 512-bit units), so a neighbour's burst on a shared machine cannot tilt it.
double measure_bf16_dot_speedup() {
  constexpr long kRounds = 4000;  // 48k instructions: ~10-40 microseconds
  double fma = 1e30, dot = 1e30;
  for (int i = 0; i < 9; ++i) {
    fma = std::min(fma, zmm_loop_seconds(false, kRounds));
    dot = std::min(dot, zmm_loop_seconds(true, kRounds));
  }
  return (2.0 * fma) / dot;
}

}  // namespace

double cpu_bf16_dot_speedup() {
  if (cpu_isa() != CpuIsa::kAvx512Bf16) return 0.0;
  static const double speedup = measure_bf16_dot_speedup();
  return speedup;
}

std::string cpu_bf16_dot_products_slow() {
  const double r = cpu_bf16_dot_speedup();
  if (r == 0.0 || r >= 0.75) return "";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", r);
  return str_cat("this CPU's bf16 dot products (vdpbf16ps) run at ", buf,
                 "x its f32 FMA rate, so f32 GEMMs of the bf16-rounded operands are faster");
}

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
