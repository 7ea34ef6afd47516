// titan env: version, build, compiler, BLAS and its threading, MPI, CUDA, CPU features, threads,
// devices and registered kernels (what a bug report needs).
#include <cblas.h>
#ifdef TITAN_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif
#include <mpi.h>
#include <omp.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "cli/command.h"
#include "core/cpu_isa.h"
#include "core/version.h"
#include "device/cpu/sgemm.h"
#include "device/device.h"
#include "kernels/registry.h"

namespace {

std::string cpu_flags_of_interest() {
  std::ifstream f("/proc/cpuinfo");
  std::string line, model;
  std::set<std::string> flags;
  while (std::getline(f, line)) {
    if (model.empty() && line.starts_with("model name")) model = line.substr(line.find(':') + 2);
    if (line.starts_with("flags") && flags.empty()) {
      std::istringstream is(line.substr(line.find(':') + 1));
      std::string w;
      while (is >> w) flags.insert(w);
    }
  }
  std::string out = model + " |";
  for (const char* want : {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                           "avx512_bf16", "amx_bf16", "amx_tile", "neon", "sve"})
    if (flags.count(want)) out += std::string(" ") + want;
  return out;
}

#ifdef TITAN_HAVE_DNNL
const char* onednn_isa() {
  switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_sse41:
      return "sse41";
    case dnnl_cpu_isa_avx:
      return "avx";
    case dnnl_cpu_isa_avx2:
      return "avx2";
    case dnnl_cpu_isa_avx512_core:
      return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "other";
  }
}
#endif

// "fast [avx2 avx512*]": an implementation's builds, the one this CPU runs starred (none starred: it
// cannot run here, and why).
std::string describe_impl(const std::string& op, titan::DeviceType dev, const std::string& impl) {
  auto& reg = titan::KernelRegistry::global();
  std::string out = impl;
  if (dev != titan::DeviceType::CPU) return out;
  const bool runs = reg.runnable(op, dev, impl);
  const titan::CpuIsa at = reg.running_isa(op, dev, impl);
  out += " [";
  bool first = true;
  for (auto isa : reg.variants(op, dev, impl)) {
    out += std::string(first ? "" : " ") + titan::cpu_isa_name(isa) + (runs && isa == at ? "*" : "");
    first = false;
  }
  out += "]";
  if (!runs) out += " (" + reg.why_not_runnable(op, dev, impl) + ")";
  return out;
}

const char* env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

int env_main(int, char**) {
  std::printf("titan %s (%s build, %s, C++%ld)\n", titan::version(), TITAN_BUILD_TYPE, TITAN_COMPILER,
              __cplusplus / 100 % 100);
  std::printf("BLAS: %s\n      core %s, %d threads, parallel mode %s, library %s\n", openblas_get_config(),
              openblas_get_corename(), openblas_get_num_threads(),
              openblas_get_parallel() == 2   ? "OpenMP"
              : openblas_get_parallel() == 1 ? "pthreads"
                                             : "sequential",
              TITAN_BLAS_PATH);
  char mpi_version[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(mpi_version, &len);
  std::string mv(mpi_version, len);
  if (auto nl = mv.find('\n'); nl != std::string::npos) mv.resize(nl);
  std::printf("MPI: %s\n", mv.c_str());
  if (titan::device_available(titan::DeviceType::CUDA)) {
    auto& cuda = titan::device_interface(titan::DeviceType::CUDA);
    std::printf("CUDA: built, %d GPU(s)\n%s", cuda.device_count(), cuda.describe().c_str());
  } else {
    std::printf("CUDA: not built (devices: cpu)\n");
  }
  std::printf("CPU: %s\n", cpu_flags_of_interest().c_str());
  std::printf("CPU ISA: %s detected, TITAN_CPU_ISA=%s: kernels run at %s",
              titan::cpu_isa_name(titan::cpu_isa_detected()), env_or("TITAN_CPU_ISA", "(unset)"),
              titan::cpu_isa_name(titan::cpu_isa()));
#ifdef TITAN_HAVE_DNNL
  std::printf("; oneDNN at %s (ONEDNN_MAX_CPU_ISA=%s)", onednn_isa(),
              env_or("ONEDNN_MAX_CPU_ISA", "(unset)"));
#endif
  std::printf("; OpenBLAS core %s\n", openblas_get_corename());
  std::printf("threads: OpenMP max %d, cores online %ld, OMP_NUM_THREADS=%s, OPENBLAS_CORETYPE=%s\n",
              omp_get_max_threads(), sysconf(_SC_NPROCESSORS_ONLN), env_or("OMP_NUM_THREADS", "(unset)"),
              env_or("OPENBLAS_CORETYPE", "(unset)"));
  auto& reg = titan::KernelRegistry::global();
  for (auto dev : {titan::DeviceType::CPU, titan::DeviceType::CUDA}) {
    if (!titan::device_available(dev)) continue;
    std::printf("kernels (%s)%s:\n", titan::device_type_name(dev),
                dev == titan::DeviceType::CPU ? ", [ISA builds], * the one this CPU runs" : "");
    for (auto& op : reg.ops()) {
      std::string impls;
      for (auto& i : reg.impls(op, dev)) impls += (impls.empty() ? "" : ", ") + describe_impl(op, dev, i);
      if (impls.empty()) continue;
      const std::string def = reg.default_impl(op, dev);
      std::string runs_at;
      if (dev == titan::DeviceType::CPU)
        runs_at = std::string(" at ") + titan::cpu_isa_name(reg.running_isa(op, dev, def));
      std::printf("  %-16s default %s%s: %s\n", op.c_str(), def.c_str(), runs_at.c_str(), impls.c_str());
      for (auto& i : reg.impls(op, dev))
        if (reg.runnable(op, dev, i))
          if (const std::string why = reg.why_not_default(op, dev, i); !why.empty())
            std::printf("    (%s is not the default: %s)\n", i.c_str(), why.c_str());
    }
#ifdef TITAN_HAVE_DNNL
    if (dev == titan::DeviceType::CPU)
      std::printf("  (matmul onednn: weight gradients on %s)\n",
                  titan::cpu::weight_grad_on_openblas()
                      ? "OpenBLAS, whose AVX2 kernels run that layout faster"
                      : "oneDNN");
#endif
  }
  return 0;
}

}  // namespace

TITAN_COMMAND("env", "version, build, BLAS, MPI, CUDA, CPU features, threads and kernels", env_main);
