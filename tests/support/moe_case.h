// A routed-experts case shared by the kernel tests (every CPU implementation) and the CUDA tests: random
// routing with distinct experts per token, one expert (4) that gets no token and one (0) that gets most of
// them; weights and gradients from seeds seed..seed+4. run() goes through forward, then backward into
// gradient buffers that hold other values first (they accumulate), on host buffers.
#pragma once
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "testing.h"

namespace titan::testing {

struct MoeCase {
  int64_t N, k, E, H, I;
  std::vector<float> x, wgu, wdown, dout, w;
  std::vector<int32_t> idx;
  MoeCase(int64_t N_, int64_t k_, int64_t E_, int64_t H_, int64_t I_, uint64_t seed)
      : N(N_),
        k(k_),
        E(E_),
        H(H_),
        I(I_),
        x(randn(N * H, seed)),
        wgu(randn(E * 2 * I * H, seed + 1, 0.3f)),
        wdown(randn(E * H * I, seed + 2, 0.3f)),
        dout(randn(N * H, seed + 3)),
        w(N * k),
        idx(N * k) {
    std::mt19937_64 rng(seed + 4);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t s = 0; s < k; ++s) {
        int32_t e;  // distinct experts per token, never expert 4, expert 0 for most tokens
        do e = s == 0 && n % 4 != 0 ? 0 : int32_t(rng() % E);
        while (e == 4 ||
               std::find(idx.begin() + n * k, idx.begin() + n * k + s, e) != idx.begin() + n * k + s);
        idx[n * k + s] = e;
        w[n * k + s] = 0.1f + float(rng() % 1000) / 1000.0f;
      }
  }
  int64_t R() const { return N * k; }

  struct Result {
    std::vector<float> out, dx, dw, dwgu, dwdown;
  };
  template <class Kernels>
  Result run(const Kernels& kk) const {
    std::vector<float> gu(R() * 2 * I), act(R() * I), scratch(moe_experts_scratch_floats(N, k, H, I));
    std::vector<int32_t> order(R()), row_of(R()), offsets(E + 1);
    MoeExpertsBuffers buf{gu.data(), act.data(), order.data(), row_of.data(), offsets.data(), scratch.data()};
    Result r{std::vector<float>(N * H, 9.0f), std::vector<float>(N * H, 0.5f), std::vector<float>(R(), 0.25f),
             std::vector<float>(wgu.size(), 0.1f), std::vector<float>(wdown.size(), -0.1f)};
    kk.forward(r.out.data(), buf, x.data(), idx.data(), w.data(), wgu.data(), wdown.data(), N, k, E, H, I);
    kk.backward(r.dx.data(), r.dw.data(), r.dwgu.data(), r.dwdown.data(), buf, dout.data(), x.data(),
                idx.data(), w.data(), wgu.data(), wdown.data(), N, k, E, H, I);
    return r;
  }
  static void expect_near(const Result& a, const Result& b, double tol, const std::string& label) {
    EXPECT_LE(rel(a.out, b.out), tol) << label << " out";
    EXPECT_LE(rel(a.dx, b.dx), tol) << label << " dx";
    EXPECT_LE(rel(a.dw, b.dw), tol) << label << " dw";
    EXPECT_LE(rel(a.dwgu, b.dwgu), tol) << label << " dw_gu";
    EXPECT_LE(rel(a.dwdown, b.dwdown), tol) << label << " dw_down";
  }
};

}  // namespace titan::testing
