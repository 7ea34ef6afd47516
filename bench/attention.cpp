// Causal attention forward + backward per registered implementation (median of --reps after a warm-up).
//   bench_attention [--batch 1 --seq 512 --heads 16 --kv-heads 8 --head-dim 128 --reps 5]
// Prints one JSON line per implementation: forward and backward seconds, saved floats; the bf16 attention
// of mixed precision (attention_bf16, bf16 in and out) as "bf16:<impl>".
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

int main(int argc, char** argv) {
  int64_t B = 1, T = 512, nH = 16, nKV = 8, hd = 128, reps = 5;
  std::string only;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    int64_t v = std::atoll(argv[i + 1]);
    if (k == "--batch")
      B = v;
    else if (k == "--seq")
      T = v;
    else if (k == "--heads")
      nH = v;
    else if (k == "--kv-heads")
      nKV = v;
    else if (k == "--head-dim")
      hd = v;
    else if (k == "--reps")
      reps = v;
    else if (k == "--impl")
      only = argv[i + 1];
  }
  std::mt19937 rng(0);
  std::normal_distribution<float> d(0.0f, 1.0f);
  auto randn = [&](int64_t n) {
    std::vector<float> x(n);
    for (auto& e : x) e = d(rng);
    return x;
  };
  auto q = randn(B * T * nH * hd), k = randn(B * T * nKV * hd), v = randn(B * T * nKV * hd),
       dout = randn(B * T * nH * hd);
  auto report = [&](const std::string& name, std::vector<double>& fw, std::vector<double>& bw,
                    double saved_floats) {
    std::sort(fw.begin(), fw.end());
    std::sort(bw.begin(), bw.end());
    std::printf(
        "{\"impl\":\"%s\",\"B\":%lld,\"T\":%lld,\"nH\":%lld,\"nKV\":%lld,\"hd\":%lld,\"threads\":%d,"
        "\"forward_s\":%.5f,\"backward_s\":%.5f,\"saved_mib\":%.2f}\n",
        name.c_str(), (long long)B, (long long)T, (long long)nH, (long long)nKV, (long long)hd,
        omp_get_max_threads(), fw[fw.size() / 2], bw[bw.size() / 2], saved_floats * 4.0 / (1 << 20));
  };
  auto timed = [&](auto&& run, std::vector<double>& out) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    out.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  };
  for (auto& name : titan::KernelRegistry::global().impls("attention", titan::DeviceType::CPU)) {
    if (name == "reference" || (!only.empty() && name != only)) continue;
    const auto& kk = titan::get_kernel<titan::AttentionKernels>(titan::DeviceType::CPU, name);
    std::vector<float> out(q.size()), saved(kk.saved_floats(B, T, nH)), dq(q.size()), dk(k.size()),
        dv(v.size());
    std::vector<double> fw, bw;
    for (int64_t r = 0; r <= reps; ++r) {
      if (r == 1) fw.clear(), bw.clear();  // (the first round warms up)
      timed(
          [&] {
            kk.forward(out.data(), saved.data(), q.data(), k.data(), v.data(), B, T, nH, nKV, hd, nullptr);
          },
          fw);
      timed(
          [&] {
            kk.backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                        out.data(), saved.data(), B, T, nH, nKV, hd, nullptr);
          },
          bw);
    }
    report(name, fw, bw, static_cast<double>(saved.size()));
  }
  // The bf16 attention of mixed precision (attention_bf16; its bf16 conversions included), as "bf16:<impl>".
  auto bits = [](const std::vector<float>& x) {
    std::vector<uint16_t> b(x.size());
    for (size_t i = 0; i < x.size(); ++i) b[i] = titan::f32_to_bf16(x[i]);
    return b;
  };
  const auto q16 = bits(q), k16 = bits(k), v16 = bits(v), dout16 = bits(dout);
  const titan::AttentionBf16Shape s{B, T, nH, nKV, hd, nH * hd, nKV * hd, nKV * hd, nH * hd};
  for (auto& name : titan::KernelRegistry::global().impls("attention_bf16", titan::DeviceType::CPU)) {
    if (name == "reference" || (!only.empty() && "bf16:" + name != only)) continue;
    const auto& kk = titan::get_kernel<titan::AttentionBf16Kernels>(titan::DeviceType::CPU, name);
    std::vector<uint16_t> out(q.size()), dq(q.size()), dk(k.size()), dv(v.size());
    std::vector<float> lse(B * nH * T);
    std::vector<double> fw, bw;
    for (int64_t r = 0; r <= reps; ++r) {
      if (r == 1) fw.clear(), bw.clear();
      timed([&] { kk.forward(out.data(), lse.data(), q16.data(), k16.data(), v16.data(), s, nullptr); }, fw);
      timed(
          [&] {
            kk.backward(dq.data(), dk.data(), dv.data(), dout16.data(), q16.data(), k16.data(), v16.data(),
                        out.data(), lse.data(), s, nullptr);
          },
          bw);
    }
    report("bf16:" + name, fw, bw, static_cast<double>(lse.size()));
  }
  return 0;
}
