// One Qwen3-MoE sparse block (HF Qwen3MoeSparseMoeBlock: router, softmax, top-k, renormalise, routed SwiGLU
// experts, weighted combine) forward + backward, timed per moe_experts implementation. Prints one JSON line
// per implementation (median over the measured iterations), the format bench/moe_layer.py reads.
//   bench_moe_layer [--hidden 2048 --moe-intermediate 768 --experts 64 --top-k 4 --tokens 2048
//                    --iters 5 --warmup 1 --impl grouped,reference]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "kernels/registry.h"
#include "kernels/registry.h"

namespace {

std::vector<float> randn(size_t n, uint64_t seed, float std) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, std);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t H = 2048, I = 768, E = 64, k = 4, N = 2048, iters = 5, warmup = 1;
  std::string impl_list = "grouped,reference";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string key = argv[i], val = argv[i + 1];
    if (key == "--impl") {
      impl_list = val;
      continue;
    }
    int64_t v = std::atoll(val.c_str());
    if (key == "--hidden")
      H = v;
    else if (key == "--moe-intermediate")
      I = v;
    else if (key == "--experts")
      E = v;
    else if (key == "--top-k")
      k = v;
    else if (key == "--tokens")
      N = v;
    else if (key == "--iters")
      iters = v;
    else if (key == "--warmup")
      warmup = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  using namespace titan;
  const auto& matmul = get_kernel<MatmulKernels>(DeviceType::CPU);
  auto x = randn(N * H, 1, 1.0f), router = randn(E * H, 2, 0.02f), wgu = randn(E * 2 * I * H, 3, 0.02f),
       wdown = randn(E * H * I, 4, 0.02f), dout = randn(N * H, 5, 1.0f);
  std::vector<float> probs(N * E), topw(N * k), out(N * H), dx(N * H), dtopw(N * k), dlogits(N * E),
      drouter(E * H), dwgu(wgu.size()), dwdown(wdown.size());
  std::vector<int32_t> idx(N * k), order(N * k), row_of(N * k), offsets(E + 1);
  std::vector<float> gu(N * k * 2 * I), act(N * k * I), scratch(moe_experts_scratch_floats(N, k, H, I));
  MoeExpertsBuffers buf{gu.data(), act.data(), order.data(), row_of.data(), offsets.data(), scratch.data()};
  // 6 FLOPs per routed token per expert weight (forward 2, backward 4) + the router GEMM.
  const double flops = 6.0 * N * (k * 3.0 * H * I + (double)E * H);

  std::stringstream ss(impl_list);
  std::string name;
  while (std::getline(ss, name, ',')) {
    const auto& moe = get_kernel<MoeExpertsKernels>(DeviceType::CPU, name);
    const auto& route = get_kernel<MoeRouterKernels>(DeviceType::CPU);
    std::vector<double> fwd_t, bwd_t;
    for (int64_t it = 0; it < warmup + iters; ++it) {
      auto t0 = std::chrono::steady_clock::now();
      matmul.forward(probs.data(), x.data(), router.data(), N, H, E);
      route.softmax(probs.data(), N, E);
      route.select_topk(idx.data(), topw.data(), probs.data(), nullptr, N, E, k, true);
      moe.forward(out.data(), buf, x.data(), idx.data(), topw.data(), wgu.data(), wdown.data(), N, k, E, H,
                  I);
      auto t1 = std::chrono::steady_clock::now();
      std::memset(dx.data(), 0, dx.size() * sizeof(float));
      std::memset(dtopw.data(), 0, dtopw.size() * sizeof(float));
      moe.backward(dx.data(), dtopw.data(), dwgu.data(), dwdown.data(), buf, dout.data(), x.data(),
                   idx.data(), topw.data(), wgu.data(), wdown.data(), N, k, E, H, I);
      route.backward(dlogits.data(), probs.data(), idx.data(), dtopw.data(), nullptr, N, E, k, true);
      matmul.backward(dx.data(), drouter.data(), dlogits.data(), x.data(), router.data(), N, H, E, true);
      auto t2 = std::chrono::steady_clock::now();
      if (it >= warmup) {
        fwd_t.push_back(std::chrono::duration<double>(t1 - t0).count());
        bwd_t.push_back(std::chrono::duration<double>(t2 - t1).count());
      }
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double f = median(fwd_t), b = median(bwd_t);
    double checksum = 0;
    for (float v : dx) checksum += v;
    std::printf(
        "{\"impl\": \"titan-%s\", \"tokens\": %lld, \"hidden\": %lld, \"moe_intermediate\": %lld, "
        "\"experts\": %lld, "
        "\"top_k\": %lld, \"threads\": %d, \"forward_s\": %.6f, \"backward_s\": %.6f, \"total_s\": %.6f, "
        "\"tokens_per_s\": %.1f, \"gflops\": %.2f, \"dx_sum\": %.6e}\n",
        name.c_str(), (long long)N, (long long)H, (long long)I, (long long)E, (long long)k,
        omp_get_max_threads(), f, b, f + b, N / (f + b), flops / (f + b) / 1e9, checksum);
    std::fflush(stdout);
  }
  return 0;
}
