// titan env: version, build, compiler, BLAS and its threading, MPI, CUDA, CPU features, threads,
// devices and registered kernels (what a bug report needs).
#include <cblas.h>
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
#include "core/version.h"
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
  std::printf("threads: OpenMP max %d, cores online %ld, OMP_NUM_THREADS=%s, OPENBLAS_CORETYPE=%s\n",
              omp_get_max_threads(), sysconf(_SC_NPROCESSORS_ONLN), env_or("OMP_NUM_THREADS", "(unset)"),
              env_or("OPENBLAS_CORETYPE", "(unset)"));
  auto& reg = titan::KernelRegistry::global();
  for (auto dev : {titan::DeviceType::CPU, titan::DeviceType::CUDA}) {
    if (!titan::device_available(dev)) continue;
    std::printf("kernels (%s):\n", titan::device_type_name(dev));
    for (auto& op : reg.ops()) {
      std::string impls;
      for (auto& i : reg.impls(op, dev)) impls += (impls.empty() ? "" : ", ") + i;
      if (impls.empty()) continue;
      std::printf("  %-16s %s (default %s)\n", op.c_str(), impls.c_str(), reg.default_impl(op, dev).c_str());
    }
  }
  return 0;
}

}  // namespace

TITAN_COMMAND("env", "version, build, BLAS, MPI, CUDA, CPU features, threads and kernels", env_main);
