// CUDA op micro-benchmark: titan's CUDA kernels on the shapes of a Qwen3-0.6B layer, median of timed
// repetitions after warm-up (each repetition ends with a device synchronization). Prints one JSON object
// per line; bench/cuda_ops.py runs the same ops in PyTorch and prints the comparison.
//   bench_cuda_ops [reps]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "device/device.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

using namespace titan;

namespace {

DeviceInterface& gpu() {
  return device_interface(DeviceType::CUDA);
}

float* dev_randn(int64_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> h(n);
  for (auto& x : h) x = d(rng);
  auto* p = static_cast<float*>(gpu().allocator->allocate(n * 4));
  gpu().copy_from_host(p, h.data(), n * 4);
  return p;
}

double median_ms(int reps, const std::function<void()>& f) {
  for (int i = 0; i < 3; ++i) f();
  gpu().synchronize();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    gpu().synchronize();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void report(const char* op, const std::string& shape, double ms, double flops) {
  std::printf("{\"op\": \"%s\", \"shape\": \"%s\", \"ms\": %.4f, \"tflops\": %.2f}\n", op, shape.c_str(), ms,
              flops / (ms * 1e-3) / 1e12);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  if (!device_available(DeviceType::CUDA) || gpu().device_count() == 0) {
    std::fprintf(stderr, "bench_cuda_ops: no CUDA GPU\n");
    return 1;
  }
  {  // GEMM: (N, C) x (OC, C)^T
    const int64_t N = 8192, C = 4096, OC = 4096;
    float *x = dev_randn(N * C, 1), *w = dev_randn(OC * C, 2), *y = dev_randn(N * OC, 3);
    const std::string shape = std::to_string(N) + "x" + std::to_string(C) + "x" + std::to_string(OC);
    const double flops = 2.0 * N * C * OC;
    auto& f32 = get_kernel<MatmulKernels>(DeviceType::CUDA);
    auto& bf16 = get_kernel<MatmulBf16Kernels>(DeviceType::CUDA);
    report("matmul_f32", shape, median_ms(reps, [&] { f32.forward(y, x, w, N, C, OC); }), flops);
    report("matmul_bf16", shape, median_ms(reps, [&] { bf16.forward(y, x, w, N, C, OC); }), flops);
    float *dx = dev_randn(N * C, 4), *dw = dev_randn(OC * C, 5);
    report("matmul_bf16_fwd_bwd", shape,
           median_ms(reps,
                     [&] {
                       bf16.forward(y, x, w, N, C, OC);
                       bf16.backward(dx, dw, y, x, w, N, C, OC, true);
                     }),
           3 * flops);
    for (float* p : {x, w, y, dx, dw}) gpu().allocator->deallocate(p, 0);
  }
  {  // causal GQA attention, Qwen3-0.6B heads: 16 query, 8 kv, head_dim 128
    const int64_t B = 4, T = 2048, nH = 16, nKV = 8, hd = 128;
    auto& att = get_kernel<AttentionKernels>(DeviceType::CUDA);
    float *q = dev_randn(B * T * nH * hd, 6), *k = dev_randn(B * T * nKV * hd, 7),
          *v = dev_randn(B * T * nKV * hd, 8), *o = dev_randn(B * T * nH * hd, 9),
          *s = dev_randn(att.saved_floats(B, T, nH), 10), *dq = dev_randn(B * T * nH * hd, 11),
          *dk = dev_randn(B * T * nKV * hd, 12), *dv = dev_randn(B * T * nKV * hd, 13);
    const std::string shape = "B4 T2048 nH16 nKV8 hd128";
    const double flops = 4.0 * B * nH * hd * (double(T) * (T + 1) / 2);  // causal: lower triangle
    report("attention_fwd_f32", shape,
           median_ms(reps, [&] { att.forward(o, s, q, k, v, B, T, nH, nKV, hd, nullptr); }), flops);
    report("attention_fwd_bwd_f32", shape,
           median_ms(reps,
                     [&] {
                       att.forward(o, s, q, k, v, B, T, nH, nKV, hd, nullptr);
                       att.backward(dq, dk, dv, o, q, k, v, o, s, B, T, nH, nKV, hd, nullptr);
                     }),
           3.5 * flops);
    auto& flash = get_kernel<AttentionKernels>(DeviceType::CUDA, "flash");  // the one-warp-per-row backward
    report("attention_fwd_bwd_f32_flash", shape,
           median_ms(reps,
                     [&] {
                       flash.forward(o, s, q, k, v, B, T, nH, nKV, hd, nullptr);
                       flash.backward(dq, dk, dv, o, q, k, v, o, s, B, T, nH, nKV, hd, nullptr);
                     }),
           3.5 * flops);
  }
  {  // the same attention in bf16 (attention_bf16: cuDNN's fused attention where built), q/k/v read through
     // the strides of one fused QKV row
    const int64_t B = 4, T = 2048, nH = 16, nKV = 8, hd = 128, N = B * T, qw = nH * hd, kw = nKV * hd;
    const int64_t ld = qw + 2 * kw;
    auto& att = get_kernel<AttentionBf16Kernels>(DeviceType::CUDA);
    auto bf16 = [](int64_t n, uint64_t seed) {
      std::mt19937_64 rng(seed);
      std::normal_distribution<float> d(0.0f, 1.0f);
      std::vector<uint16_t> h(n);
      for (auto& x : h) x = f32_to_bf16(d(rng));
      auto* p = static_cast<uint16_t*>(gpu().allocator->allocate(n * 2));
      gpu().copy_from_host(p, h.data(), n * 2);
      return p;
    };
    uint16_t *qkv = bf16(N * ld, 20), *o = bf16(N * qw, 21), *dout = bf16(N * qw, 22),
             *dqkv = bf16(N * ld, 23);
    float* lse = dev_randn(B * nH * T, 24);
    const AttentionBf16Shape s{B, T, nH, nKV, hd, ld, ld, ld, qw};
    const std::string shape = "B4 T2048 nH16 nKV8 hd128";
    const double flops = 4.0 * B * nH * hd * (double(T) * (T + 1) / 2);
    report("attention_fwd_bf16", shape,
           median_ms(reps, [&] { att.forward(o, lse, qkv, qkv + qw, qkv + qw + kw, s, nullptr); }), flops);
    report("attention_fwd_bwd_bf16", shape,
           median_ms(reps,
                     [&] {
                       att.forward(o, lse, qkv, qkv + qw, qkv + qw + kw, s, nullptr);
                       att.backward(dqkv, dqkv + qw, dqkv + qw + kw, dout, qkv, qkv + qw, qkv + qw + kw, o,
                                    lse, s, nullptr);
                     }),
           3.5 * flops);
  }
  {  // RMSNorm and cross-entropy over a 151936 vocabulary
    const int64_t N = 8192, C = 1024, V = 151936, NV = 1024;
    auto& rn = get_kernel<RmsNormKernels>(DeviceType::CUDA);
    float *x = dev_randn(N * C, 14), *w = dev_randn(C, 15), *y = dev_randn(N * C, 16), *r = dev_randn(N, 17);
    report("rmsnorm_fwd", "8192x1024", median_ms(reps, [&] { rn.forward(y, r, x, w, N, C, 1e-6f); }), 0);
    auto& ce = get_kernel<CrossEntropyKernels>(DeviceType::CUDA);
    float* logits = dev_randn(NV * V, 18);
    std::vector<int32_t> t(NV);
    for (int64_t n = 0; n < NV; ++n) t[n] = int32_t(n * 131 % V);
    auto* dt = static_cast<int32_t*>(gpu().allocator->allocate(NV * 4));
    gpu().copy_from_host(dt, t.data(), NV * 4);
    report("cross_entropy_fwd_bwd", "1024x151936",
           median_ms(reps, [&] { ce.forward_backward(logits, dt, NV, V, 1.0f / NV, true); }), 0);
  }
  return 0;
}
