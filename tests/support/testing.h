// Helpers shared by the C++ tests: relative errors, temporary directories, running the titan binary.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "device/device.h"

namespace titan::testing {

// ||a - b|| / ||b|| over f32 tensors of equal numel (||b|| == 0: absolute norm of a - b).
inline double rel_error(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.numel(), b.numel());
  double diff = 0, ref = 0;
  const float* pa = a.f32();
  const float* pb = b.f32();
  for (int64_t i = 0; i < a.numel() && i < b.numel(); ++i) {
    diff += (double(pa[i]) - pb[i]) * (double(pa[i]) - pb[i]);
    ref += double(pb[i]) * pb[i];
  }
  return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
}

// ||a - b|| / ||b|| over float vectors (the kernel tests' buffers).
inline double rel(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i)
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), ref += double(b[i]) * b[i];
  return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
}

// n samples of N(0, scale^2) from a seeded mt19937_64.
inline std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Packed rows for document-masked attention: rows[b] lists the lengths of row b's documents (summing to T);
// returns doc_start (B*T): the position of each token's document start within its row.
inline std::vector<int32_t> doc_starts(const std::vector<std::vector<int32_t>>& rows, int64_t T) {
  std::vector<int32_t> start;
  for (const auto& lengths : rows) {
    int32_t t0 = 0;
    for (int32_t len : lengths) {
      for (int32_t i = 0; i < len; ++i) start.push_back(t0);
      t0 += len;
    }
    EXPECT_EQ(t0, T) << "document lengths must fill the row";
  }
  return start;
}

// A fresh directory under the system temp dir, removed when the object dies.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "titan-test-XXXXXX").string();
    path = mkdtemp(tmpl.data());
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

// Runs the titan binary with `args`; returns the exit status; stdout+stderr go to *output if given.
// A CUDA GPU this build can use (the GPU tests skip elsewhere, saying why).
inline bool have_cuda_gpu() {
  return device_available(DeviceType::CUDA) && device_interface(DeviceType::CUDA).device_count() > 0;
}
#define TITAN_SKIP_WITHOUT_CUDA_GPU()                                                                   \
  do {                                                                                                  \
    if (!::titan::testing::have_cuda_gpu())                                                             \
      GTEST_SKIP() << "no CUDA GPU here (or a build without CUDA): this GPU test runs on GPU machines"; \
  } while (0)

// `env`: variable assignments for the command ("TITAN_CPU_ISA=avx2").
inline int run_titan(const std::string& args, std::string* output = nullptr, const std::string& env = "") {
  TempDir tmp;
  std::string log = tmp / "out.txt";
  std::string cmd =
      (env.empty() ? "" : env + " ") + std::string(TITAN_BINARY) + " " + args + " > " + log + " 2>&1";
  int rc = std::system(cmd.c_str());
  if (output) {
    FILE* f = std::fopen(log.c_str(), "rb");
    output->clear();
    if (f) {
      char buf[4096];
      size_t n;
      while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) output->append(buf, n);
      std::fclose(f);
    }
  }
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// The message of the titan::Error that fn() throws ("" when it throws none).
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Runs a shell command (stdout+stderr captured); rc is the exit status, -1 when killed by a signal.
// OpenMPI may run as root (CI containers); OMP_NUM_THREADS=1 keeps 2-core runs of several ranks fast.
struct ShellResult {
  int rc = -1;
  std::string output;
};
inline ShellResult run_shell_command(const std::string& cmd) {
  TempDir tmp;
  const std::string log = tmp / "out.txt";
  const std::string full = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 " +
                           cmd + " > " + log + " 2>&1";
  const int status = std::system(full.c_str());
  ShellResult r;
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  FILE* f = std::fopen(log.c_str(), "rb");
  if (f) {
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) r.output.append(buf, n);
    std::fclose(f);
  }
  return r;
}

// The "loss" of every line of a metrics.jsonl file, in order.
inline std::vector<double> jsonl_losses(const std::string& path) {
  std::vector<double> out;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);)
    out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return out;
}

// The "val_loss" of the lines of a metrics.jsonl file that have one, in order (full precision; the console
// prints 4 decimals).
inline std::vector<double> jsonl_val_losses(const std::string& path) {
  std::vector<double> out;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) out.push_back(j["val_loss"].get<double>());
  }
  return out;
}

inline std::string source_path(const std::string& rel) {
  return std::string(TITAN_SOURCE_DIR) + "/" + rel;
}

// A small trainer run: a 200-document corpus written into `tmp`, the small test tokenizer, the debug model at
// vocab 1024, seq 32, local batch 2, `steps` steps, output in tmp/<out>; no held-out split, no validation,
// no sample (tests that want them add their own settings, which override these).
inline std::vector<std::string> small_run_args(const TempDir& tmp, int64_t steps,
                                               const std::string& out = "out") {
  std::ofstream f(tmp / "corpus.txt");
  for (int i = 0; i < 200; ++i) f << "the quick brown fox " << i << " jumps over the lazy dog.\n%\n";
  return {
      "--job.dump_folder=" + (tmp / out),
      "--training.dataset=" + (tmp / "corpus.txt"),
      "--model.tokenizer_path=" + source_path("tests/golden/tokenizer/small"),
      "--model.vocab_size=1024",
      "--training.seq_len=32",
      "--training.local_batch_size=2",
      "--training.steps=" + std::to_string(steps),
      "--training.sample_tokens=0",
      "--lr_scheduler.warmup_steps=2",
      "--metrics.peak_tflops=1",
      "--training.val_fraction=0",
      "--validation.enable=false",
  };
}

}  // namespace titan::testing
