// SGEMM rate of the BLAS titan links and of every other registered f32 matmul engine (oneDNN), on the thread
// count of OMP_NUM_THREADS: the best is the "peak" that bench/compare_pytorch.py divides by for MFU; then
// the bf16 engine's rate. Prints one JSON line per shape and engine and a summary.
//   bench_gemm_peak [--reps 3]
// Shapes: square 1024/2048/3072 and the training GEMMs of the 0.6B width at seq 512 (q/gate-up projection,
// down projection, lm_head forward and its weight gradient).
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

int main(int argc, char** argv) {
  int reps = 3;
  for (int i = 1; i + 1 < argc; i += 2)
    if (std::string(argv[i]) == "--reps") reps = std::atoi(argv[i + 1]);
  struct Shape {
    const char* name;
    int64_t M, N, K;
    bool transb, transa;
  };
  const Shape shapes[] = {
      {"square1024", 1024, 1024, 1024, true, false},  {"square2048", 2048, 2048, 2048, true, false},
      {"square3072", 3072, 3072, 3072, true, false},  {"gate_up_fwd", 512, 6144, 1024, true, false},
      {"down_fwd", 512, 1024, 3072, true, false},     {"lm_head_fwd", 512, 151936, 1024, true, false},
      {"lm_head_dw", 151936, 1024, 512, false, true}, {"lm_head_dx", 512, 1024, 151936, false, false},
  };
  double best = 0;
  for (const Shape& s : shapes) {
    const int64_t lda = s.transa ? s.M : s.K, ldb = s.transb ? s.K : s.N;
    std::vector<float> a((size_t)s.M * s.K, 0.01f), b((size_t)s.K * s.N, 0.02f), c((size_t)s.M * s.N, 0.0f);
    double t_best = 1e30;
    for (int r = 0; r <= reps; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      cblas_sgemm(CblasRowMajor, s.transa ? CblasTrans : CblasNoTrans, s.transb ? CblasTrans : CblasNoTrans,
                  s.M, s.N, s.K, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), s.N);
      double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) t_best = std::min(t_best, dt);  // the first call warms caches and threads
    }
    const double gflops = 2.0 * s.M * s.N * s.K / t_best / 1e9;
    best = std::max(best, gflops);
    std::printf("{\"shape\":\"%s\",\"M\":%lld,\"N\":%lld,\"K\":%lld,\"seconds\":%.6f,\"gflops\":%.2f}\n",
                s.name, (long long)s.M, (long long)s.N, (long long)s.K, t_best, gflops);
    std::fflush(stdout);
  }
  // Every f32 matmul engine other than the reference and "blas" (which is cblas_sgemm, measured above): the
  // forward GEMM out = inp @ w^T, and for lm_head_dw the weight gradient of the lm_head.
  const auto& reg0 = titan::KernelRegistry::global();
  for (auto& impl : reg0.impls("matmul", titan::DeviceType::CPU)) {
    if (impl == "reference" || impl == "blas") continue;
    const auto& mm = titan::get_kernel<titan::MatmulKernels>(titan::DeviceType::CPU, impl);
    for (const Shape& s : shapes) {
      std::vector<float> a((size_t)s.M * s.K, 0.01f), b((size_t)s.K * s.N, 0.02f), c((size_t)s.M * s.N);
      double t_best = 1e30;
      for (int r = 0; r <= reps; ++r) {
        auto t0 = std::chrono::steady_clock::now();
        if (s.transa)  // dw (M=OC, N=C) += dout^T (OC, K=rows) inp (rows, C)
          mm.backward(nullptr, c.data(), a.data(), b.data(), nullptr, s.K, s.N, s.M, true);
        else if (!s.transb)  // dinp (M=rows, N=C) += dout (rows, K=OC) w (OC, C)
          mm.backward(c.data(), nullptr, a.data(), nullptr, b.data(), s.M, s.N, s.K, true);
        else
          mm.forward(c.data(), a.data(), b.data(), s.M, s.K, s.N);
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (r > 0) t_best = std::min(t_best, dt);
      }
      const double gflops = 2.0 * s.M * s.N * s.K / t_best / 1e9;
      best = std::max(best, gflops);
      std::printf("{\"shape\":\"%s\",\"dtype\":\"f32\",\"engine\":\"%s\",\"seconds\":%.6f,\"gflops\":%.2f}\n",
                  s.name, impl.c_str(), t_best, gflops);
      std::fflush(stdout);
    }
  }
  // The bf16 GEMM engine (op matmul_bf16, default implementation; includes the f32 -> bf16 operand
  // conversion of the activations; the weight's image is made once, as the model does), every shape.
  double best_bf16 = 0;
  const auto& reg = titan::KernelRegistry::global();
  const std::string bf16_impl = reg.default_impl("matmul_bf16", titan::DeviceType::CPU);
  if (bf16_impl != "reference") {
    const auto& mm = titan::get_kernel<titan::MatmulBf16Kernels>(titan::DeviceType::CPU, bf16_impl);
    for (const Shape& s : shapes) {
      std::vector<float> a((size_t)s.M * s.K, 0.01f), b((size_t)s.K * s.N, 0.02f), c((size_t)s.M * s.N);
      // The weight operand (b, except for dw where both are activations) as a registered bf16 image.
      std::vector<uint16_t> image;
      if (!s.transa) {
        image.resize(b.size());
        for (size_t i = 0; i < b.size(); ++i) image[i] = titan::f32_to_bf16(b[i]);
        titan::register_bf16_image(b.data(), (int64_t)b.size(), image.data());
      }
      double t_best = 1e30;
      for (int r = 0; r <= reps; ++r) {
        auto t0 = std::chrono::steady_clock::now();
        if (s.transa)
          mm.backward(nullptr, c.data(), a.data(), b.data(), nullptr, s.K, s.N, s.M, true);
        else if (!s.transb)
          mm.backward(c.data(), nullptr, a.data(), nullptr, b.data(), s.M, s.N, s.K, true);
        else
          mm.forward(c.data(), a.data(), b.data(), s.M, s.K, s.N);
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (r > 0) t_best = std::min(t_best, dt);
      }
      if (!image.empty()) titan::unregister_bf16_image(b.data());
      const double gflops = 2.0 * s.M * s.N * s.K / t_best / 1e9;
      best_bf16 = std::max(best_bf16, gflops);
      std::printf(
          "{\"shape\":\"%s\",\"dtype\":\"bf16\",\"engine\":\"%s\",\"seconds\":%.6f,\"gflops\":%.2f}\n",
          s.name, bf16_impl.c_str(), t_best, gflops);
      std::fflush(stdout);
    }
  }
  const char* core = std::getenv("OPENBLAS_CORETYPE");
  std::printf(
      "{\"summary\":true,\"threads\":%d,\"peak_gflops\":%.2f,\"bf16_peak_gflops\":%.2f,\"openblas_coretype\":"
      "\"%s\",\"config\":\"%s\"}\n",
      omp_get_max_threads(), best, best_bf16, core ? core : "", openblas_get_config());
  return 0;
}
