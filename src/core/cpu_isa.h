// x86-64 instruction-set levels, detected at run time (cpuid + the OS's enabled register state) and capped
// by TITAN_CPU_ISA. Kernels that need an ISA are registered with it (kernels/registry.h) and picked by
// these levels, so one build runs on any x86-64 CPU and an AVX-512 machine can run the AVX2 paths.
#pragma once
#include <string>
#include <string_view>

namespace titan {

// Ordered: every level includes the ones below it (true of every x86-64 CPU that has the higher one).
enum class CpuIsa : int {
  kBaseline = 0,  // x86-64 as the build's own flags compiled it (no intrinsics of its own)
  kAvx2,          // AVX2 + FMA + F16C (x86-64-v3)
  kAvx512,        // AVX-512 F/BW/VL/DQ (x86-64-v4)
  kAvx512Bf16,    // + AVX512_BF16 (vdpbf16ps)
  kAmx,           // + AMX-TILE and AMX-BF16
};
constexpr int kCpuIsaCount = 5;

const char* cpu_isa_name(CpuIsa isa);  // "baseline", "avx2", "avx512", "avx512_bf16", "amx"
// The CPU features a level adds over the one below it, as lscpu names them ("avx512_bf16").
const char* cpu_isa_features(CpuIsa isa);
// Parses a level name; throws an Error naming `what` and the valid names otherwise.
CpuIsa parse_cpu_isa(std::string_view name, std::string_view what);

CpuIsa cpu_isa_detected();  // the highest level this CPU and OS support
CpuIsa cpu_isa();           // min(detected, TITAN_CPU_ISA) — what kernels are chosen by
bool cpu_isa_supported(CpuIsa need);
// "avx512_bf16 (CPU has avx2)" or "avx512_bf16 (capped by TITAN_CPU_ISA=avx2)": why `need` cannot run.
std::string cpu_isa_missing(CpuIsa need);

// The rate of the CPU's bf16 dot products (vdpbf16ps) over that of its f32 FMAs (vfmadd231ps), in FLOPs
// per second on one core, where the kernels run at avx512_bf16 (no AMX); 0 at any other level. Measured once
// (register-only loops, the best of several short rounds: well under a millisecond). It differs between
// CPUs that all report AVX512_BF16: a Sapphire Rapids VM without AMX runs vdpbf16ps at half the rate of
// its two f32 FMA ports (0.5), a core with one bf16 port beside two FMA ports at par (1.0), AMD Zen 4 at
// twice its f32 rate (2.0).
double cpu_bf16_dot_speedup();
// Why the bf16 GEMM engines built on bf16 dot products (oneDNN's) should not be a default here: non-empty
// where the kernels run at avx512_bf16 and the dot products are under 0.75x the f32 FMA rate, so the f32
// GEMM of bf16-rounded operands (the `sgemm` engines) is faster.
std::string cpu_bf16_dot_products_slow();

}  // namespace titan
