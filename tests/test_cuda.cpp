// CUDA device: every op registered for DeviceType::CUDA against the CPU "reference" implementation on the
// same random inputs, forward and backward, on odd shapes (N = 37, C = 72, hd = 24, T = 19, ...), plus
// the allocator, the copies and `titan env`. Built only with -DTITAN_CUDA=ON; every test skips with a
// message where the runtime finds no GPU, so the suite stays green on CPU-only machines.
//
// Tolerances (relative L2 error, as tests/test_kernels.cpp): 1e-5 for every f32 op (GEMMs in strict f32:
// no TF32), and for the bf16 GEMMs against the CPU bf16 reference (the same bf16-rounded operands, f32 vs
// double accumulation); 1e-9 relative for the double results (cross-entropy loss, sum of squares).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <tuple>

#include "core/dtype.h"
#include "device/cuda/sdpa_cudnn.h"
#include "device/device.h"
#include "distributed/nccl.h"
#include "kernels/op_timing.h"
#include "kernels/ops.h"
#include "kernels/registry.h"
#include "models/qwen3/config.h"
#include "models/qwen3/model.h"
#include "optim/optimizer.h"
#include "support/attention_bf16_case.h"
#include "support/moe_case.h"
#include "support/testing.h"

namespace titan {
namespace {

constexpr double kTol = 1e-5;

using testing::randn;
using testing::rel;

DeviceInterface& gpu() {
  return device_interface(DeviceType::CUDA);
}

#define SKIP_WITHOUT_GPU()                                                                                  \
  do {                                                                                                      \
    if (!device_available(DeviceType::CUDA)) GTEST_SKIP() << "titan was built without CUDA";                \
    if (gpu().device_count() == 0)                                                                          \
      GTEST_SKIP() << "no CUDA GPU on this machine (cudaGetDeviceCount found none): CUDA op tests skipped"; \
  } while (0)

// A device buffer holding a copy of a host vector; read() copies it back.
template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(const std::vector<T>& host) : n(host.size()) {
    p = static_cast<T*>(gpu().allocator->allocate(std::max<size_t>(n, 1) * sizeof(T)));
    gpu().copy_from_host(p, host.data(), n * sizeof(T));
  }
  explicit Dev(size_t count, T fill = T(0)) : Dev(std::vector<T>(count, fill)) {}
  ~Dev() { gpu().allocator->deallocate(p, std::max<size_t>(n, 1) * sizeof(T)); }
  std::vector<T> read() const {
    std::vector<T> host(n);
    gpu().copy_to_host(host.data(), p, n * sizeof(T));
    return host;
  }
  Dev(const Dev&) = delete;
};
using DevF = Dev<float>;

template <class K>
const K& cpu_ref() {
  return get_kernel<K>(DeviceType::CPU, "reference");
}
template <class K>
const K& cuda_op() {
  return get_kernel<K>(DeviceType::CUDA);
}

TEST(Cuda, EveryCudaOpHasACpuReference) {
  if (!device_available(DeviceType::CUDA)) GTEST_SKIP() << "titan was built without CUDA";
  auto& reg = KernelRegistry::global();
  for (const char* op :
       {"matmul",        "matmul_bf16",    "rmsnorm",         "rope",        "rope_qk",
        "attention",     "attention_ring", "attention_bf16",  "swiglu",      "embedding",
        "cross_entropy", "adamw",          "sum_squares",     "moe_experts", "moe_experts_bf16",
        "elementwise",   "moe_router",     "expert_parallel", "gemm",        "dropout"}) {
    EXPECT_FALSE(reg.impls(op, DeviceType::CUDA).empty()) << op << " has no CUDA implementation";
    auto cpu = reg.impls(op, DeviceType::CPU);
    EXPECT_NE(std::find(cpu.begin(), cpu.end(), "reference"), cpu.end()) << op;
  }
}

// The adapter ops (LoRA): the strided, scaled GEMM in every transpose form with padded leading dimensions,
// and the counter-hash dropout mask, which must be the CPU's bits.
TEST(Cuda, GemmAndDropoutMatchReference) {
  SKIP_WITHOUT_GPU();
  const auto& ref = cpu_ref<GemmKernels>();
  const auto& op = cuda_op<GemmKernels>();
  const int64_t M = 37, N = 19, K = 16, pad = 5;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (float beta : {0.0f, 1.0f}) {
        const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
        auto A = randn((ta ? K : M) * lda, 61), B = randn((tb ? N : K) * ldb, 62), C = randn(M * ldc, 63);
        auto want = C;
        ref.gemm(ta, tb, M, N, K, 0.75f, A.data(), lda, B.data(), ldb, beta, want.data(), ldc);
        DevF dA(A), dB(B), dC(C);
        op.gemm(ta, tb, M, N, K, 0.75f, dA.p, lda, dB.p, ldb, beta, dC.p, ldc);
        EXPECT_LT(rel(dC.read(), want), kTol) << "ta " << ta << " tb " << tb << " beta " << beta;
      }
  const auto& dref = cpu_ref<DropoutKernels>();
  const auto& dop = cuda_op<DropoutKernels>();
  const int64_t n = 100100;
  auto x = randn(n, 64), g = randn(n, 65);
  std::vector<float> out(n), dx(n, 0.5f);
  // (rows of 1001 keyed with a stride of 3003: a column slice's masks)
  dref.forward(out.data(), x.data(), n / 1001, 1001, 987654321, 3003, 0.1f, nullptr);
  dref.backward_add(dx.data(), g.data(), n / 1001, 1001, 987654321, 3003, 0.1f, nullptr);
  DevF dx_in(x), dout(n), dg(g), ddx(n, 0.5f);
  dop.forward(dout.p, dx_in.p, n / 1001, 1001, 987654321, 3003, 0.1f, nullptr);
  dop.backward_add(ddx.p, dg.p, n / 1001, 1001, 987654321, 3003, 0.1f, nullptr);
  EXPECT_EQ(dout.read(), out) << "dropout forward: the mask and the scaling must be the CPU's bits";
  // (dx += g * keep may be one fused multiply-add on either side)
  EXPECT_LT(rel(ddx.read(), dx), 1e-7) << "dropout backward";
}

// attention_kv (generation): a prefill of n queries after p cached positions and a decode step, GQA, against
// the CPU reference.
TEST(Cuda, AttentionKVMatchesReference) {
  SKIP_WITHOUT_GPU();
  const auto& ref = cpu_ref<AttentionKVKernels>();
  const auto& op = cuda_op<AttentionKVKernels>();
  const int64_t nH = 6, nKV = 2, hd = 24;
  for (auto [n, p] : {std::pair<int64_t, int64_t>{7, 0}, {5, 300}, {1, 1000}}) {
    auto q = randn(n * nH * hd, 71), k = randn((p + n) * nKV * hd, 72), v = randn((p + n) * nKV * hd, 73);
    std::vector<float> want(n * nH * hd);
    ref.forward(want.data(), q.data(), k.data(), v.data(), n, p, nH, nKV, hd);
    DevF dq(q), dk(k), dv(v), dout(want.size());
    op.forward(dout.p, dq.p, dk.p, dv.p, n, p, nH, nKV, hd);
    EXPECT_LT(rel(dout.read(), want), kTol) << "n " << n << " p " << p;
  }
}

// Without a GPU (CI), CUDA memory is a clear titan::Error, not a crash.
TEST(Cuda, NoGpuMeansAClearError) {
  if (!device_available(DeviceType::CUDA)) GTEST_SKIP() << "titan was built without CUDA";
  if (gpu().device_count() > 0) GTEST_SKIP() << "a GPU is present";
  try {
    gpu().allocator->allocate(16);
    ADD_FAILURE() << "allocation on a machine without a GPU succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("finds no GPU"), std::string::npos) << e.what();
  }
}

TEST(Cuda, AllocatorAndCopies) {
  SKIP_WITHOUT_GPU();
  auto& stats = gpu().allocator->stats;
  const int64_t before = stats.current.load();
  {
    auto host = randn(1000, 1);
    DevF d(host);
    EXPECT_EQ(stats.current.load(), before + 4000);
    EXPECT_EQ(d.read(), host);
  }
  EXPECT_EQ(stats.current.load(), before);
  // The pool hands freed memory out again: many same-size allocations never grow the peak.
  stats.reset_peak();
  for (int i = 0; i < 100; ++i) DevF d(size_t(1) << 20);
  EXPECT_EQ(stats.peak.load(), before + (int64_t(4) << 20));
}

void check_matmul(int64_t N, int64_t C, int64_t OC, bool bf16, uint64_t seed) {
  auto inp = randn(N * C, seed), w = randn(OC * C, seed + 1), dout = randn(N * OC, seed + 2);
  std::vector<float> out_r(N * OC), dinp_r(N * C, 0.25f), dw_r(OC * C, -0.5f), dw0_r(OC * C, 9.0f);
  DevF di(inp), dW(w), dd(dout), dout_(N * OC), ddinp(N * C, 0.25f), ddw(OC * C, -0.5f), ddw0(OC * C, 9.0f);
  auto run = [&](auto& ref, auto& op) {
    ref.forward(out_r.data(), inp.data(), w.data(), N, C, OC);
    ref.backward(dinp_r.data(), dw_r.data(), dout.data(), inp.data(), w.data(), N, C, OC, true);
    ref.backward(nullptr, dw0_r.data(), dout.data(), inp.data(), w.data(), N, C, OC, false);
    op.forward(dout_.p, di.p, dW.p, N, C, OC);
    op.backward(ddinp.p, ddw.p, dd.p, di.p, dW.p, N, C, OC, true);
    op.backward(nullptr, ddw0.p, dd.p, di.p, dW.p, N, C, OC, false);
  };
  if (bf16)
    run(cpu_ref<MatmulBf16Kernels>(), cuda_op<MatmulBf16Kernels>());
  else
    run(cpu_ref<MatmulKernels>(), cuda_op<MatmulKernels>());
  const char* what = bf16 ? "matmul_bf16" : "matmul";
  EXPECT_LE(rel(dout_.read(), out_r), kTol) << what << " forward N=" << N << " C=" << C << " OC=" << OC;
  EXPECT_LE(rel(ddinp.read(), dinp_r), kTol) << what << " dinp (accumulated)";
  EXPECT_LE(rel(ddw.read(), dw_r), kTol) << what << " dweight (accumulated)";
  EXPECT_LE(rel(ddw0.read(), dw0_r), kTol) << what << " dweight (overwritten)";
}

TEST(Cuda, MatmulF32MatchesReference) {
  SKIP_WITHOUT_GPU();
  check_matmul(37, 72, 53, false, 10);
  check_matmul(1, 5, 3, false, 11);
  check_matmul(257, 1000, 311, false, 12);
}

TEST(Cuda, MatmulBf16MatchesReference) {
  SKIP_WITHOUT_GPU();
  check_matmul(37, 72, 53, true, 20);
  check_matmul(257, 1000, 311, true, 21);
}

TEST(Cuda, RmsNormMatchesReference) {
  SKIP_WITHOUT_GPU();
  for (auto [N, C] : {std::pair<int64_t, int64_t>{37, 72}, {5, 1030}, {300, 24}}) {
    auto x = randn(N * C, 30), w = randn(C, 31), dy = randn(N * C, 32);
    std::vector<float> y_r(N * C), r_r(N), dx_r(N * C, 0.1f), dw_r(C, 0.3f);
    cpu_ref<RmsNormKernels>().forward(y_r.data(), r_r.data(), x.data(), w.data(), N, C, 1e-6f);
    cpu_ref<RmsNormKernels>().backward(dx_r.data(), dw_r.data(), dy.data(), x.data(), w.data(), r_r.data(), N,
                                       C);
    DevF dx_(x), dw_(w), ddy(dy), y(N * C), r(N), dx(N * C, 0.1f), dw(C, 0.3f);
    cuda_op<RmsNormKernels>().forward(y.p, r.p, dx_.p, dw_.p, N, C, 1e-6f);
    cuda_op<RmsNormKernels>().backward(dx.p, dw.p, ddy.p, dx_.p, dw_.p, r.p, N, C);
    EXPECT_LE(rel(y.read(), y_r), kTol) << "N=" << N << " C=" << C;
    EXPECT_LE(rel(r.read(), r_r), kTol);
    EXPECT_LE(rel(dx.read(), dx_r), kTol);
    EXPECT_LE(rel(dw.read(), dw_r), kTol);
  }
}

// Graphs (CUDA graphs; compile mode's foundation): ops captured once and launched again equal the same ops
// run eagerly on the inputs of that moment, bit for bit (the same kernels and GEMMs); a host read inside a
// capture is an error naming it, and the device runs eagerly afterwards.
TEST(Cuda, CapturedOpsReplayBitForBitAndHostReadsAreRejected) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 37, C = 72, OC = 53;
  auto x = randn(N * C, 60), w = randn(C, 61), proj = randn(OC * C, 62);
  DevF dx(x), dw(w), dproj(proj), y(N * C), r(N), out(N * OC), kept(N * OC);
  const auto& norm = cuda_op<RmsNormKernels>();
  const auto& mm = cuda_op<MatmulKernels>();
  auto ops = [&] {
    norm.forward(y.p, r.p, dx.p, dw.p, N, C, 1e-6f);
    mm.forward(out.p, y.p, dproj.p, N, C, OC);
    gpu().copy(kept.p, out.p, N * OC * sizeof(float));
  };
  ops();  // warm-up: what the ops make on first use (cuBLASLt's handle and workspace) exists before capture
  void* graph = gpu().capture(ops);
  ASSERT_NE(graph, nullptr);
  for (int round = 0; round < 2; ++round) {
    const auto xi = randn(N * C, 63 + round);
    gpu().copy_from_host(dx.p, xi.data(), xi.size() * sizeof(float));
    gpu().graph_launch(graph);
    const std::vector<float> replayed = kept.read();
    ops();  // the same ops, eagerly, on the same input
    EXPECT_EQ(replayed, kept.read()) << "round " << round;
    EXPECT_EQ(replayed, out.read());
  }
  gpu().graph_release(graph);

  std::vector<float> host(N);
  try {
    gpu().capture([&] {
      norm.forward(y.p, r.p, dx.p, dw.p, N, C, 1e-6f);
      gpu().copy_to_host(host.data(), r.p, N * sizeof(float));  // a host read: not in a graph
    });
    ADD_FAILURE() << "a host read was captured";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("capturing"), std::string::npos) << e.what();
  }
  const auto y_eager = y.read();  // eager again
  norm.forward(y.p, r.p, dx.p, dw.p, N, C, 1e-6f);
  EXPECT_EQ(y.read(), y_eager);
}

TEST(Cuda, RopeAndRopeQKMatchReference) {
  SKIP_WITHOUT_GPU();
  const int64_t B = 2, T = 19, N = B * T, nH = 4, nKV = 2, hd = 24, half = hd / 2;
  auto cos = randn(T * half, 40), sin = randn(T * half, 41);
  auto q = randn(N * nH * hd, 42), k = randn(N * nKV * hd, 43), dq = randn(N * nH * hd, 44),
       dk = randn(N * nKV * hd, 45);
  DevF dcos(cos), dsin(sin);
  // rope: out of place, in place, backward accumulating
  std::vector<float> out_r(q.size()), din_r(q.size(), 0.5f);
  cpu_ref<RopeKernels>().forward(out_r.data(), q.data(), cos.data(), sin.data(), N, T, nH, hd);
  cpu_ref<RopeKernels>().backward(din_r.data(), dq.data(), cos.data(), sin.data(), N, T, nH, hd);
  DevF dqv(q), out(q.size()), inplace(q), ddq(dq), din(q.size(), 0.5f);
  cuda_op<RopeKernels>().forward(out.p, dqv.p, dcos.p, dsin.p, N, T, nH, hd);
  cuda_op<RopeKernels>().forward(inplace.p, inplace.p, dcos.p, dsin.p, N, T, nH, hd);
  cuda_op<RopeKernels>().backward(din.p, ddq.p, dcos.p, dsin.p, N, T, nH, hd);
  EXPECT_LE(rel(out.read(), out_r), kTol);
  EXPECT_LE(rel(inplace.read(), out_r), kTol);
  EXPECT_LE(rel(din.read(), din_r), kTol);
  // rope_qk
  auto q_r = q, k_r = k;
  std::vector<float> gq_r(q.size(), 0.2f), gk_r(k.size(), -0.2f);
  cpu_ref<RopeQKKernels>().forward(q_r.data(), k_r.data(), cos.data(), sin.data(), N, T, nH, nKV, hd);
  cpu_ref<RopeQKKernels>().backward(gq_r.data(), gk_r.data(), dq.data(), dk.data(), cos.data(), sin.data(), N,
                                    T, nH, nKV, hd);
  DevF gq_in(q), gk_in(k), gdq(dq), gdk(dk), gq(q.size(), 0.2f), gk(k.size(), -0.2f);
  cuda_op<RopeQKKernels>().forward(gq_in.p, gk_in.p, dcos.p, dsin.p, N, T, nH, nKV, hd);
  cuda_op<RopeQKKernels>().backward(gq.p, gk.p, gdq.p, gdk.p, dcos.p, dsin.p, N, T, nH, nKV, hd);
  EXPECT_LE(rel(gq_in.read(), q_r), kTol);
  EXPECT_LE(rel(gk_in.read(), k_r), kTol);
  EXPECT_LE(rel(gq.read(), gq_r), kTol);
  EXPECT_LE(rel(gk.read(), gk_r), kTol);
}

// qk_norm_rope equals the CUDA rmsnorm (bf16 input), rope_qk and to_bf16 run in turn, bit for bit, and the
// CPU reference within bf16's rounding (q16/k16) and f32 noise (the rest).
TEST(Cuda, QKNormRopeEqualsTheOpsInTurn) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 2 * 11, T = 11, nH = 4, nKV = 2, hd = 128, half = hd / 2, nq = N * nH * hd,
                nk = N * nKV * hd;
  auto bits = [](const std::vector<float>& x) {
    std::vector<uint16_t> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) r[i] = f32_to_bf16(x[i]);
    return r;
  };
  const auto q_raw = bits(randn(nq, 70)), k_raw = bits(randn(nk, 71)), dq16 = bits(randn(nq, 72)),
             dk16 = bits(randn(nk, 73));
  const auto qw = randn(hd, 74), kw = randn(hd, 75), cos = randn(T * half, 76), sin = randn(T * half, 77);
  Dev<uint16_t> dq_raw(q_raw), dk_raw(k_raw), ddq16(dq16), ddk16(dk16);
  DevF dqw(qw), dkw(kw), dcos(cos), dsin(sin);
  // in turn
  DevF q(nq), k(nk), q_rstd(N * nH), k_rstd(N * nKV), gq(nq), gk(nk), dq_rot(nq), dk_rot(nk), dq(nq), dk(nk),
      gqw(hd, 0.25f), gkw(hd, -0.25f);
  Dev<uint16_t> q16(nq), k16(nk), dq16w(nq), dk16w(nk);
  const auto& norm = cuda_op<RmsNormKernels>();
  const auto& glue = cuda_op<ElementwiseKernels>();
  norm.forward_bf16_input(q.p, q_rstd.p, dq_raw.p, dqw.p, N * nH, hd, 1e-6f);
  norm.forward_bf16_input(k.p, k_rstd.p, dk_raw.p, dkw.p, N * nKV, hd, 1e-6f);
  cuda_op<RopeQKKernels>().forward(q.p, k.p, dcos.p, dsin.p, N, T, nH, nKV, hd);
  glue.to_bf16(q16.p, q.p, nq);
  glue.to_bf16(k16.p, k.p, nk);
  glue.from_bf16(dq_rot.p, ddq16.p, nq);
  glue.from_bf16(dk_rot.p, ddk16.p, nk);
  cuda_op<RopeQKKernels>().backward(gq.p, gk.p, dq_rot.p, dk_rot.p, dcos.p, dsin.p, N, T, nH, nKV, hd);
  norm.backward_bf16_input(dq.p, gqw.p, gq.p, dq_raw.p, dqw.p, q_rstd.p, N * nH, hd);
  norm.backward_bf16_input(dk.p, gkw.p, gk.p, dk_raw.p, dkw.p, k_rstd.p, N * nKV, hd);
  glue.to_bf16(dq16w.p, dq.p, nq);
  glue.to_bf16(dk16w.p, dk.p, nk);
  // fused
  DevF fq_rstd(N * nH, -1.0f), fk_rstd(N * nKV, -1.0f), fqw(hd, 0.25f), fkw(hd, -0.25f);
  Dev<uint16_t> fq16(nq, 0xffff), fk16(nk, 0xffff), fdq(nq, 0xffff), fdk(nk, 0xffff);
  const auto& op = cuda_op<QKNormRopeKernels>();
  op.forward(fq16.p, fk16.p, fq_rstd.p, fk_rstd.p, dq_raw.p, dk_raw.p, dqw.p, dkw.p, dcos.p, dsin.p, N, T, nH,
             nKV, hd, 1e-6f);
  op.backward(fdq.p, fdk.p, fqw.p, fkw.p, ddq16.p, ddk16.p, dq_raw.p, dk_raw.p, dqw.p, dkw.p, fq_rstd.p,
              fk_rstd.p, dcos.p, dsin.p, N, T, nH, nKV, hd);
  EXPECT_EQ(fq16.read(), q16.read());
  EXPECT_EQ(fk16.read(), k16.read());
  EXPECT_EQ(fq_rstd.read(), q_rstd.read());
  EXPECT_EQ(fk_rstd.read(), k_rstd.read());
  EXPECT_EQ(fdq.read(), dq16w.read());
  EXPECT_EQ(fdk.read(), dk16w.read());
  EXPECT_EQ(fqw.read(), gqw.read());
  EXPECT_EQ(fkw.read(), gkw.read());
  // the CPU reference
  std::vector<uint16_t> rq16(nq), rk16(nk), rdq(nq), rdk(nk);
  std::vector<float> rq_rstd(N * nH), rk_rstd(N * nKV), rqw(hd, 0.25f), rkw(hd, -0.25f);
  const auto& ref = cpu_ref<QKNormRopeKernels>();
  ref.forward(rq16.data(), rk16.data(), rq_rstd.data(), rk_rstd.data(), q_raw.data(), k_raw.data(), qw.data(),
              kw.data(), cos.data(), sin.data(), N, T, nH, nKV, hd, 1e-6f);
  ref.backward(rdq.data(), rdk.data(), rqw.data(), rkw.data(), dq16.data(), dk16.data(), q_raw.data(),
               k_raw.data(), qw.data(), kw.data(), rq_rstd.data(), rk_rstd.data(), cos.data(), sin.data(), N,
               T, nH, nKV, hd);
  auto widen = [](const std::vector<uint16_t>& x) {
    std::vector<float> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) r[i] = bf16_to_f32(x[i]);
    return r;
  };
  EXPECT_LE(rel(widen(fq16.read()), widen(rq16)), 8e-3);
  EXPECT_LE(rel(widen(fk16.read()), widen(rk16)), 8e-3);
  EXPECT_LE(rel(fq_rstd.read(), rq_rstd), kTol);
  EXPECT_LE(rel(widen(fdq.read()), widen(rdq)), 8e-3);
  EXPECT_LE(rel(widen(fdk.read()), widen(rdk)), 8e-3);
  EXPECT_LE(rel(fqw.read(), rqw), kTol);
  EXPECT_LE(rel(fkw.read(), rkw), kTol);
}

void check_attention(int64_t B, int64_t T, int64_t nH, int64_t nKV, int64_t hd, uint64_t seed,
                     const std::vector<int32_t>& docs = {}) {
  auto q = randn(B * T * nH * hd, seed), k = randn(B * T * nKV * hd, seed + 1),
       v = randn(B * T * nKV * hd, seed + 2), dout = randn(B * T * nH * hd, seed + 3);
  const auto& ref = cpu_ref<AttentionKernels>();
  std::vector<float> out_r(q.size()), p_r(ref.saved_floats(B, T, nH)), dq_r(q.size(), 0.1f),
      dk_r(k.size(), 0.1f), dv_r(v.size(), 0.1f);
  const int32_t* doc_start = docs.empty() ? nullptr : docs.data();
  ref.forward(out_r.data(), p_r.data(), q.data(), k.data(), v.data(), B, T, nH, nKV, hd, doc_start);
  ref.backward(dq_r.data(), dk_r.data(), dv_r.data(), dout.data(), q.data(), k.data(), v.data(), out_r.data(),
               p_r.data(), B, T, nH, nKV, hd, doc_start);
  Dev<int32_t> ddocs(docs);
  for (auto& name : KernelRegistry::global().impls("attention", DeviceType::CUDA)) {
    const auto& op = get_kernel<AttentionKernels>(DeviceType::CUDA, name);
    DevF dq_(q), dk_(k), dv_(v), ddout(dout), out(q.size(), 7.0f), saved(op.saved_floats(B, T, nH)),
        dq(q.size(), 0.1f), dk(k.size(), 0.1f), dv(v.size(), 0.1f);
    const int32_t* dev_docs = docs.empty() ? nullptr : ddocs.p;
    op.forward(out.p, saved.p, dq_.p, dk_.p, dv_.p, B, T, nH, nKV, hd, dev_docs);
    op.backward(dq.p, dk.p, dv.p, ddout.p, dq_.p, dk_.p, dv_.p, out.p, saved.p, B, T, nH, nKV, hd, dev_docs);
    const std::string shape = name + " B=" + std::to_string(B) + " T=" + std::to_string(T) +
                              " nH=" + std::to_string(nH) + " nKV=" + std::to_string(nKV) +
                              " hd=" + std::to_string(hd) + (docs.empty() ? "" : " packed");
    EXPECT_LE(rel(out.read(), out_r), kTol) << "out " << shape;
    EXPECT_LE(rel(dq.read(), dq_r), kTol) << "dq " << shape;
    EXPECT_LE(rel(dk.read(), dk_r), kTol) << "dk " << shape;
    EXPECT_LE(rel(dv.read(), dv_r), kTol) << "dv " << shape;
  }
}

// Every CUDA attention implementation ("flash", "flash_split").
TEST(Cuda, FlashAttentionMatchesReference) {
  SKIP_WITHOUT_GPU();
  EXPECT_EQ(cuda_op<AttentionKernels>().saved_floats(2, 4096, 16), int64_t(2) * 16 * 4096);
  check_attention(2, 19, 4, 2, 24, 50);   // one key tile, GQA
  check_attention(1, 77, 3, 3, 40, 51);   // three key tiles, R = 2, MHA
  check_attention(2, 70, 8, 2, 128, 52);  // Qwen3's head_dim (R = 4, > 48 KiB shared memory in backward)
  check_attention(1, 33, 2, 1, 8, 53);    // tiny head_dim
  // Packed rows (document-masked): documents across key tiles (32 / 16) and of one token.
  check_attention(2, 70, 4, 2, 24, 54, testing::doc_starts({{5, 30, 1, 34}, {64, 6}}, 70));
  check_attention(1, 77, 8, 2, 128, 55, testing::doc_starts({{1, 40, 36}}, 77));
  check_attention(1, 21, 2, 1, 256, 54);  // the largest head_dim (> 48 KiB shared memory)
}

// Relative error over the finite entries of a row logsumexp; the rows without a key (-inf) must agree.
double rel_lse(const std::vector<float>& got, const std::vector<float>& want) {
  std::vector<float> g, w;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i]) || std::isinf(got[i])) {
      if (got[i] != want[i]) return INFINITY;
      continue;
    }
    g.push_back(got[i]), w.push_back(want[i]);
  }
  return rel(g, w);
}

// Ring attention blocks (context parallel): rank r's queries (chunks r and 2S - 1 - r of a sequence split
// over S ranks) against every rank's block of keys, forward, merge and backward, against the CPU reference
// block by block. Rank 0's first chunk reads no key of a later rank's block (out 0, lse -inf).
void check_ring_attention(int64_t B, int64_t c, int64_t S, int64_t nH, int64_t nKV, int64_t hd, uint64_t seed,
                          bool packed) {
  const int64_t Tl = 2 * c;
  auto pos = [&](int64_t r) {
    std::vector<int32_t> ps(Tl);
    for (int64_t t = 0; t < Tl; ++t) ps[t] = static_cast<int32_t>((t < c ? r : 2 * S - 1 - r) * c + t % c);
    return ps;
  };
  const auto& ref = cpu_ref<AttentionRingKernels>();
  const auto& op = cuda_op<AttentionRingKernels>();
  for (int64_t r = 0; r < S; ++r) {
    const auto qp = pos(r);
    std::vector<int32_t> start;  // packed: documents starting every 7 positions (as a key_start per row)
    for (int64_t b = 0; packed && b < B; ++b)
      for (int32_t t : qp) start.push_back(t / (7 + b) * (7 + b));
    const auto q = randn(B * Tl * nH * hd, seed + 10 * r), dout = randn(B * Tl * nH * hd, seed + 10 * r + 1);
    std::vector<std::vector<float>> ks(S), vs(S);
    for (int64_t s = 0; s < S; ++s)
      ks[s] = randn(B * Tl * nKV * hd, seed + 100 + s), vs[s] = randn(B * Tl * nKV * hd, seed + 200 + s);
    const int32_t* key_start = packed ? start.data() : nullptr;
    Dev<int32_t> dqp(qp), dstart(start);
    const int32_t* dkey_start = packed ? dstart.p : nullptr;
    DevF dq_in(q), ddout(dout), out(q.size()), lse(B * nH * Tl), part(q.size()), part_lse(B * nH * Tl);
    std::vector<float> out_r(q.size()), lse_r(B * nH * Tl), part_r(q.size()), part_lse_r(B * nH * Tl);
    for (int64_t step = 0; step < S; ++step) {  // the ring order: the rank's own block first
      const int64_t src = (r - step + S) % S;
      const auto kp = pos(src);
      Dev<int32_t> dkp(kp);
      DevF dk(ks[src]), dv(vs[src]);
      const std::string what = "rank " + std::to_string(r) + " block " + std::to_string(src) +
                               " hd=" + std::to_string(hd) + (packed ? " packed" : "");
      float* o_r = step == 0 ? out_r.data() : part_r.data();
      float* l_r = step == 0 ? lse_r.data() : part_lse_r.data();
      ref.forward(o_r, l_r, q.data(), ks[src].data(), vs[src].data(), B, Tl, Tl, nH, nKV, hd, qp.data(),
                  kp.data(), key_start);
      DevF& o = step == 0 ? out : part;
      DevF& l = step == 0 ? lse : part_lse;
      op.forward(o.p, l.p, dq_in.p, dk.p, dv.p, B, Tl, Tl, nH, nKV, hd, dqp.p, dkp.p, dkey_start);
      EXPECT_LE(rel(o.read(), step == 0 ? out_r : part_r), kTol) << "forward out, " << what;
      EXPECT_LE(rel_lse(l.read(), step == 0 ? lse_r : part_lse_r), kTol) << "forward lse, " << what;
      if (step == 0) continue;
      ref.merge(out_r.data(), lse_r.data(), part_r.data(), part_lse_r.data(), B, Tl, nH, hd);
      op.merge(out.p, lse.p, part.p, part_lse.p, B, Tl, nH, hd);
      EXPECT_LE(rel(out.read(), out_r), kTol) << "merge out, " << what;
      EXPECT_LE(rel_lse(lse.read(), lse_r), kTol) << "merge lse, " << what;
    }
    // Backward of every block from the merged output (the reference's, so each block is checked alone).
    DevF mout(out_r), mlse(lse_r);
    for (int64_t src = 0; src < S; ++src) {
      const auto kp = pos(src);
      Dev<int32_t> dkp(kp);
      DevF dk(ks[src]), dv(vs[src]), gq(q.size(), 0.1f), gk(ks[src].size(), 0.1f), gv(vs[src].size(), 0.1f);
      std::vector<float> gq_r(q.size(), 0.1f), gk_r(ks[src].size(), 0.1f), gv_r(vs[src].size(), 0.1f);
      ref.backward(gq_r.data(), gk_r.data(), gv_r.data(), dout.data(), q.data(), ks[src].data(),
                   vs[src].data(), out_r.data(), lse_r.data(), B, Tl, Tl, nH, nKV, hd, qp.data(), kp.data(),
                   key_start);
      op.backward(gq.p, gk.p, gv.p, ddout.p, dq_in.p, dk.p, dv.p, mout.p, mlse.p, B, Tl, Tl, nH, nKV, hd,
                  dqp.p, dkp.p, dkey_start);
      const std::string what = "rank " + std::to_string(r) + " block " + std::to_string(src);
      EXPECT_LE(rel(gq.read(), gq_r), kTol) << "dq, " << what;
      EXPECT_LE(rel(gk.read(), gk_r), kTol) << "dk, " << what;
      EXPECT_LE(rel(gv.read(), gv_r), kTol) << "dv, " << what;
    }
  }
}

TEST(Cuda, RingAttentionMatchesReference) {
  SKIP_WITHOUT_GPU();
  check_ring_attention(2, 19, 2, 4, 2, 24, 300, false);   // chunks across key tiles, GQA
  check_ring_attention(1, 40, 3, 2, 1, 128, 310, false);  // Qwen3's head_dim, 3 ranks
  check_ring_attention(2, 21, 2, 3, 3, 40, 320, true);    // packed documents, MHA
}

// attention_bf16, every CUDA implementation ("cudnn": cuDNN's fused attention where built, the own kernels
// behind its interface on the emulator; "flash": the own kernels), on the fused, padded QKV layout of
// tests/support/attention_bf16_case.h against the definition in double. A second call of a shape builds no
// graph (the cache); packed documents take the own kernels.
TEST(Cuda, AttentionBf16MatchesReference) {
  SKIP_WITHOUT_GPU();
  auto& reg = KernelRegistry::global();
  EXPECT_EQ(reg.default_impl("attention_bf16", DeviceType::CUDA), "cudnn");
  std::printf("fused attention engine: %s\n", cuda::sdpa_engine());
  for (auto& name : reg.impls("attention_bf16", DeviceType::CUDA)) {
    const auto& k = get_kernel<AttentionBf16Kernels>(DeviceType::CUDA, name);
    for (const auto& c :
         {testing::AttentionBf16Case(2, 37, 4, 2, 64, 300), testing::AttentionBf16Case(1, 70, 4, 4, 128, 310),
          testing::AttentionBf16Case(2, 50, 4, 1, 32, 320,
                                     testing::doc_starts({{1, 20, 29}, {2, 48}}, 50))}) {
      const int64_t N = c.s.B * c.s.T, qw = c.s.nH * c.s.hd, kw = c.s.nKV * c.s.hd;
      Dev<uint16_t> qkv(c.qkv), dout(c.dout), out(N * c.s.ldo, c.kSentinel), dqkv(N * c.s.ldq, c.kSentinel);
      Dev<int32_t> docs(c.doc_start);
      const int32_t* ds = c.doc_start.empty() ? nullptr : docs.p;
      DevF lse(c.lse.size());
      for (int rep = 0; rep < 2; ++rep) {
        const int64_t built = cuda::sdpa_graphs_built();
        k.forward(out.p, lse.p, qkv.p, qkv.p + qw, qkv.p + qw + kw, c.s, ds);
        k.backward(dqkv.p, dqkv.p + qw, dqkv.p + qw + kw, dout.p, qkv.p, qkv.p + qw, qkv.p + qw + kw, out.p,
                   lse.p, c.s, ds);
        if (rep == 1) {
          EXPECT_EQ(cuda::sdpa_graphs_built(), built) << name << ": a cached shape built a graph";
        }
      }
      for (auto& f : c.failures(out.read(), lse.read(), dqkv.read()))
        ADD_FAILURE() << name << " T=" << c.s.T << ": " << f;
    }
  }
}

// matmul_bf16's bf16-input GEMMs (the input given as bf16 bits, as o_proj reads the bf16 attention output)
// equal its f32-input GEMMs on the f32 values of those bits, bit for bit.
TEST(Cuda, MatmulBf16InputEqualsF32InputOfTheSameValues) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 37, C = 72, OC = 53;
  auto x = randn(N * C, 30), w = randn(OC * C, 31), dout = randn(N * OC, 32);
  std::vector<uint16_t> x16(x.size());
  std::vector<float> xv(x.size());
  for (size_t i = 0; i < x.size(); ++i) x16[i] = f32_to_bf16(x[i]), xv[i] = bf16_to_f32(x16[i]);
  const auto& mm = get_kernel<MatmulBf16Kernels>(DeviceType::CUDA);
  DevF dx(xv), dw_(w), ddout(dout);
  Dev<uint16_t> dx16(x16);
  for (bool acc : {false, true}) {
    DevF out(N * OC), dinp(N * C, 0.5f), dw(OC * C, 0.25f), out16(N * OC), dinp16(N * C, 0.5f),
        dw16(OC * C, 0.25f);
    mm.forward(out.p, dx.p, dw_.p, N, C, OC);
    mm.backward(dinp.p, dw.p, ddout.p, dx.p, dw_.p, N, C, OC, acc);
    mm.forward_bf16_input(out16.p, dx16.p, dw_.p, N, C, OC);
    mm.backward_bf16_input(dinp16.p, dw16.p, ddout.p, dx16.p, dw_.p, N, C, OC, acc);
    EXPECT_EQ(out16.read(), out.read());
    EXPECT_EQ(dinp16.read(), dinp.read());
    EXPECT_EQ(dw16.read(), dw.read()) << "accumulate " << acc;
  }
}

// The bf16 forms of the step's bf16 activations (norm outputs, gate/up, the SwiGLU output): cuBLASLt's bf16
// output is the f32 output rounded (its epilogue rounds the same f32 accumulators; within one bf16 step
// should a GPU pick another algorithm for the bf16 output), RMSNorm's and SwiGLU's bf16 forms equal their
// f32 forms on the same values, bit for bit.
TEST(Cuda, Bf16ActivationFormsEqualTheF32FormsOfTheSameValues) {
  SKIP_WITHOUT_GPU();
  auto rounded_bits = [](const std::vector<float>& f) {
    std::vector<uint16_t> r(f.size());
    for (size_t i = 0; i < f.size(); ++i) r[i] = f32_to_bf16(f[i]);
    return r;
  };
  const int64_t N = 37, C = 72, OC = 53, I = 73;
  auto x = randn(N * C, 33), w = randn(OC * C, 34);
  std::vector<uint16_t> x16(x.size());
  std::vector<float> xv(x.size());
  for (size_t i = 0; i < x.size(); ++i) x16[i] = f32_to_bf16(x[i]), xv[i] = bf16_to_f32(x16[i]);
  const auto& mm = get_kernel<MatmulBf16Kernels>(DeviceType::CUDA);
  DevF dx(x), dxv(xv), dw_(w), out(N * OC), outv(N * OC);
  Dev<uint16_t> dx16(x16), out16(N * OC, 0xffff), io16(N * OC, 0xffff);
  mm.forward(out.p, dx.p, dw_.p, N, C, OC);
  mm.forward_bf16_output(out16.p, dx.p, dw_.p, N, C, OC);
  mm.forward(outv.p, dxv.p, dw_.p, N, C, OC);
  mm.forward_bf16_io(io16.p, dx16.p, dw_.p, N, C, OC);
  for (auto [f, h] : {std::pair{out.read(), out16.read()}, {outv.read(), io16.read()}})
    for (int64_t i = 0; i < N * OC; ++i)
      ASSERT_LE(std::abs(int(h[i]) - int(f32_to_bf16(f[i]))), 1)
          << i << ": " << f[i] << " vs " << bf16_to_f32(h[i]);

  auto nw = randn(C, 37);
  DevF dnw(nw), nout(N * C), rstd(N), rstd16(N, -1.0f);
  Dev<uint16_t> nout16(N * C, 0xffff);
  cuda_op<RmsNormKernels>().forward(nout.p, rstd.p, dx.p, dnw.p, N, C, 1e-6f);
  cuda_op<RmsNormKernels>().forward_bf16_output(nout16.p, rstd16.p, dx.p, dnw.p, N, C, 1e-6f);
  EXPECT_EQ(nout16.read(), rounded_bits(nout.read()));
  EXPECT_EQ(rstd16.read(), rstd.read());
  // bf16 input: forward and backward equal the f32 forms on the same values
  auto ndout = randn(N * C, 38);
  DevF nin_v(xv), ndy(ndout), fo(N * C), fo16(N * C), fr(N), fr16(N), fd(N * C, 0.5f), fd16(N * C, 0.5f),
      fdw(C, 0.25f), fdw16(C, 0.25f);
  cuda_op<RmsNormKernels>().forward(fo.p, fr.p, nin_v.p, dnw.p, N, C, 1e-6f);
  cuda_op<RmsNormKernels>().forward_bf16_input(fo16.p, fr16.p, dx16.p, dnw.p, N, C, 1e-6f);
  cuda_op<RmsNormKernels>().backward(fd.p, fdw.p, ndy.p, nin_v.p, dnw.p, fr.p, N, C);
  cuda_op<RmsNormKernels>().backward_bf16_input(fd16.p, fdw16.p, ndy.p, dx16.p, dnw.p, fr.p, N, C);
  EXPECT_EQ(fo16.read(), fo.read());
  EXPECT_EQ(fr16.read(), fr.read());
  EXPECT_EQ(fd16.read(), fd.read());
  EXPECT_EQ(fdw16.read(), fdw.read());
  // both bf16 (the bf16 residual stream into a bf16 norm output): the f32-input form's output, rounded
  Dev<uint16_t> fio16(N * C, 0xffff);
  DevF fior(N, -1.0f);
  cuda_op<RmsNormKernels>().forward_bf16_io(fio16.p, fior.p, dx16.p, dnw.p, N, C, 1e-6f);
  EXPECT_EQ(fio16.read(), rounded_bits(fo.read()));
  EXPECT_EQ(fior.read(), fr.read());
  // backward with a bf16 output gradient: backward_bf16_input on its values
  std::vector<uint16_t> g16(N * OC);
  std::vector<float> gv(N * OC);
  const auto gr = randn(N * OC, 39);
  for (int64_t i = 0; i < N * OC; ++i) g16[i] = f32_to_bf16(gr[i]), gv[i] = bf16_to_f32(g16[i]);
  Dev<uint16_t> dg16(g16);
  DevF dgv(gv), bx(N * C, 0.5f), bx16(N * C, 0.5f), bw(OC * C, 0.25f), bw16(OC * C, 0.25f);
  mm.backward_bf16_input(bx.p, bw.p, dgv.p, dx16.p, dw_.p, N, C, OC, true);
  mm.backward_bf16_io(bx16.p, bw16.p, dg16.p, dx16.p, dw_.p, N, C, OC, true);
  EXPECT_EQ(bx16.read(), bx.read());
  EXPECT_EQ(bw16.read(), bw.read());

  auto gu = randn(N * 2 * I, 35), dout = randn(N * I, 36);
  std::vector<uint16_t> gu16(gu.size());
  std::vector<float> guv(gu.size());
  for (size_t i = 0; i < gu.size(); ++i) gu16[i] = f32_to_bf16(3.0f * gu[i]), guv[i] = bf16_to_f32(gu16[i]);
  const auto& sw = cuda_op<SwigluKernels>();
  DevF dguv(guv), ddout(dout), o(N * I), d(N * 2 * I, 0.2f), d16(N * 2 * I, 0.2f);
  Dev<uint16_t> dgu16(gu16), o16(N * I, 0xffff);
  sw.forward(o.p, dguv.p, N, I);
  sw.forward_bf16(o16.p, dgu16.p, N, I);
  sw.backward(d.p, ddout.p, dguv.p, N, I);
  sw.backward_bf16(d16.p, ddout.p, dgu16.p, N, I);
  EXPECT_EQ(o16.read(), rounded_bits(o.read()));
  EXPECT_EQ(d16.read(), d.read());
  // d(gate/up) written as bf16: backward_bf16 into zeros, rounded
  DevF z(N * 2 * I);
  Dev<uint16_t> z16(N * 2 * I, 0xffff);
  sw.backward_bf16(z.p, ddout.p, dgu16.p, N, I);
  sw.backward_bf16_output(z16.p, ddout.p, dgu16.p, N, I);
  EXPECT_EQ(z16.read(), rounded_bits(z.read()));
}

// matmul_bf16 and the bf16 experts read a weight's registered bf16 image (ops.h register_bf16_image) instead
// of converting the weight: an image of the exact bf16 weights gives bit-identical results, an image of the
// weights doubled doubles what is linear in them (exact: a power of two), and after unregistering the
// weights are converted again.
TEST(Cuda, Bf16GemmsReadRegisteredWeightImages) {
  SKIP_WITHOUT_GPU();
  auto image_of = [](const std::vector<float>& w, float scale) {
    std::vector<uint16_t> b(w.size());
    for (size_t i = 0; i < w.size(); ++i) b[i] = f32_to_bf16(scale * w[i]);
    return b;
  };
  auto doubled = [](std::vector<float> x) {
    for (float& v : x) v *= 2.0f;
    return x;
  };
  const int64_t N = 9, C = 32, OC = 24;
  auto inp = randn(N * C, 7), w = randn(OC * C, 8), dout = randn(N * OC, 9);
  const auto& mm = get_kernel<MatmulBf16Kernels>(DeviceType::CUDA);
  DevF dinp_(inp), dw_(w), ddout(dout);
  auto run = [&] {
    DevF out(N * OC), dinp(N * C), dw(OC * C);
    mm.forward(out.p, dinp_.p, dw_.p, N, C, OC);
    mm.backward(dinp.p, dw.p, ddout.p, dinp_.p, dw_.p, N, C, OC, false);
    return std::make_tuple(out.read(), dinp.read(), dw.read());
  };
  const auto [out, dinp, dw] = run();
  for (float scale : {1.0f, 2.0f}) {
    Dev<uint16_t> image(image_of(w, scale));
    register_bf16_image(dw_.p, OC * C, image.p);
    const auto [out_i, dinp_i, dw_i] = run();
    unregister_bf16_image(dw_.p);
    EXPECT_EQ(out_i, scale == 1.0f ? out : doubled(out)) << "scale " << scale;
    EXPECT_EQ(dinp_i, scale == 1.0f ? dinp : doubled(dinp)) << "scale " << scale;
    EXPECT_EQ(dw_i, dw) << "scale " << scale;  // (no weight in the weight gradient's GEMM)
  }
  EXPECT_EQ(std::get<0>(run()), out);

  // The routed experts: their output is linear in the down projection.
  const testing::MoeCase c(37, 2, 8, 16, 24, 70);
  const auto& moe = get_kernel<MoeExpertsBf16Kernels>(DeviceType::CUDA);
  DevF x(c.x), wgu(c.wgu), wdown(c.wdown), wt(c.w);
  Dev<int32_t> idx(c.idx);
  const int64_t S = c.N * c.k;
  DevF gu(S * 2 * c.I), act(S * c.I), scratch(moe_experts_scratch_floats(c.N, c.k, c.H, c.I));
  Dev<int32_t> order(S), row_of(S), offsets(c.E + 1);
  const MoeExpertsBuffers buf{gu.p, act.p, order.p, row_of.p, offsets.p, scratch.p};
  auto moe_out = [&] {
    DevF y(c.N * c.H);
    moe.forward(y.p, buf, x.p, idx.p, wt.p, wgu.p, wdown.p, c.N, c.k, c.E, c.H, c.I);
    return y.read();
  };
  const auto y = moe_out();
  for (float scale : {1.0f, 2.0f}) {
    Dev<uint16_t> gu_image(image_of(c.wgu, 1.0f)), down_image(image_of(c.wdown, scale));
    register_bf16_image(wgu.p, static_cast<int64_t>(c.wgu.size()), gu_image.p);
    register_bf16_image(wdown.p, static_cast<int64_t>(c.wdown.size()), down_image.p);
    const auto y_i = moe_out();
    unregister_bf16_image(wgu.p);
    unregister_bf16_image(wdown.p);
    EXPECT_EQ(y_i, scale == 1.0f ? y : doubled(y)) << "scale " << scale;
  }
}

TEST(Cuda, SwigluEmbeddingMatchReference) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 37, I = 73, C = 72, V = 50;
  auto gu = randn(N * 2 * I, 60), dout = randn(N * I, 61);
  std::vector<float> o_r(N * I), d_r(N * 2 * I, 0.2f);
  cpu_ref<SwigluKernels>().forward(o_r.data(), gu.data(), N, I);
  cpu_ref<SwigluKernels>().backward(d_r.data(), dout.data(), gu.data(), N, I);
  DevF dgu_(gu), ddout(dout), o(N * I), d(N * 2 * I, 0.2f);
  cuda_op<SwigluKernels>().forward(o.p, dgu_.p, N, I);
  cuda_op<SwigluKernels>().backward(d.p, ddout.p, dgu_.p, N, I);
  EXPECT_LE(rel(o.read(), o_r), kTol);
  EXPECT_LE(rel(d.read(), d_r), kTol);

  std::vector<int32_t> ids(N);
  for (int64_t n = 0; n < N; ++n) ids[n] = int32_t((n * 7) % 11 + (n % 3) * 13);  // repeats
  ids[N / 2] = -1;  // a row another rank holds (vocab parallel): zeros, no gradient
  auto table = randn(V * C, 62), demb = randn(N * C, 63);
  std::vector<float> e_r(N * C), de_r(V * C, 0.5f);
  cpu_ref<EmbeddingKernels>().forward(e_r.data(), ids.data(), table.data(), N, C);
  cpu_ref<EmbeddingKernels>().backward(de_r.data(), demb.data(), ids.data(), N, C, V);
  Dev<int32_t> dids(ids);
  DevF dtable(table), ddemb(demb), e(N * C), de(V * C, 0.5f);
  cuda_op<EmbeddingKernels>().forward(e.p, dids.p, dtable.p, N, C);
  cuda_op<EmbeddingKernels>().backward(de.p, ddemb.p, dids.p, N, C, V);
  EXPECT_EQ(e.read(), e_r);  // a gather is exact
  EXPECT_LE(rel(de.read(), de_r), kTol);
}

TEST(Cuda, CrossEntropyMatchesReference) {
  SKIP_WITHOUT_GPU();
  for (auto [N, V] : {std::pair<int64_t, int64_t>{37, 1001}, {3, 151936}}) {
    std::vector<int32_t> targets(N);
    for (int64_t n = 0; n < N; ++n) targets[n] = n % 5 == 1 ? -100 : int32_t((n * 7919) % V);
    auto logits = randn(N * V, 70, 3.0f);
    for (bool grad : {true, false}) {
      auto g_r = logits;
      const double l_r =
          cpu_ref<CrossEntropyKernels>().forward_backward(g_r.data(), targets.data(), N, V, 0.125f, grad);
      Dev<int32_t> dt(targets);
      DevF g(logits);
      const double l = cuda_op<CrossEntropyKernels>().forward_backward(g.p, dt.p, N, V, 0.125f, grad);
      EXPECT_NEAR(l, l_r, 1e-9 * std::abs(l_r)) << "N=" << N << " V=" << V;
      EXPECT_LE(rel(g.read(), g_r), kTol) << "N=" << N << " V=" << V << " grad=" << grad;
      // The loss added to a device scalar instead, the scale read from one: exactly the returned sum, the
      // same gradient.
      DevF g2(logits), scale(std::vector<float>{0.125f});
      Dev<double> sum(std::vector<double>{0.5});
      cuda_op<CrossEntropyKernels>().forward_backward_device(sum.p, g2.p, dt.p, N, V, scale.p, grad);
      EXPECT_EQ(sum.read()[0], 0.5 + l) << "N=" << N << " V=" << V;
      EXPECT_EQ(g2.read(), g.read());
    }
  }
}

// Loss parallel: each shard's statistics and gradient as the CPU reference computes them.
TEST(Cuda, CrossEntropyVocabParallelMatchesReference) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 37, V = 1001, v0 = 2002;  // the shard [2002, 3003) of a larger vocabulary
  std::vector<int32_t> targets(N);
  for (int64_t n = 0; n < N; ++n) targets[n] = n % 5 == 1 ? -1 : int32_t(1500 + (n * 7919) % 2000);
  auto logits = randn(N * V, 71, 3.0f);
  const auto& ref = cpu_ref<VocabParallelCrossEntropyKernels>();
  const auto& op = cuda_op<VocabParallelCrossEntropyKernels>();
  std::vector<float> st_r(3 * N);
  ref.shard_stats(st_r.data(), logits.data(), targets.data(), N, V, v0);
  Dev<int32_t> dt(targets);
  DevF g(logits), st(3 * N);
  op.shard_stats(st.p, g.p, dt.p, N, V, v0);
  EXPECT_LE(rel(st.read(), st_r), kTol);
  std::vector<float> lse(N);
  for (int64_t n = 0; n < N; ++n) lse[n] = st_r[3 * n] + std::log(std::max(st_r[3 * n + 1], 1e-30f)) + 0.5f;
  auto g_r = logits;
  const float scale_r = 0.125f;
  ref.shard_grad(g_r.data(), lse.data(), targets.data(), N, V, v0, &scale_r);
  DevF dlse(lse), scale(std::vector<float>{0.125f});
  op.shard_grad(g.p, dlse.p, dt.p, N, V, v0, scale.p);
  EXPECT_LE(rel(g.read(), g_r), kTol);
  // Combining two shards' statistics on the device: the max, the rescaled sums, the logsumexp and the loss.
  std::vector<float> m_r(N), other(3 * N);
  ref.row_max(m_r.data(), st_r.data(), N);
  DevF m(N);
  op.row_max(m.p, st.p, N);
  EXPECT_EQ(m.read(), m_r);
  for (int64_t n = 0; n < N; ++n) m_r[n] = std::max(m_r[n], m_r[n] * 0.5f + 1.0f);  // another shard's max
  auto st2_r = st_r;
  ref.rescale(st2_r.data(), m_r.data(), N);
  DevF dm(m_r);
  op.rescale(st.p, dm.p, N);
  EXPECT_LE(rel(st.read(), st2_r), kTol);
  double loss_r = 0.25;  // added to what the sum holds
  ref.loss(m_r.data(), st2_r.data(), targets.data(), N, &loss_r);
  Dev<double> loss(std::vector<double>{0.25});
  op.loss(dm.p, st.p, dt.p, N, loss.p);
  auto lse_got = dm.read();
  for (int64_t n = 0; n < N; ++n)
    if (targets[n] < 0) lse_got[n] = m_r[n] = 0.0f;  // (an ignored row's logsumexp is log 0 = -inf)
  EXPECT_LE(rel(lse_got, m_r), kTol);
  EXPECT_NEAR(loss.read()[0], loss_r, 1e-5 * std::abs(loss_r));
}

TEST(Cuda, AdamWAndSumSquaresMatchReference) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 1001;
  auto p0 = randn(n, 80), grad = randn(n, 81);
  std::vector<float> p_r = p0, m_r(n, 0), v_r(n, 0);
  DevF p(p0), m(n), v(n), g(grad);
  for (int s = 1; s <= 3; ++s) {
    cpu_ref<AdamWKernels>().step(p_r.data(), grad.data(), m_r.data(), v_r.data(), n, 1e-2f, 0.9f, 0.95f,
                                 1e-8f, 0.1f, s, 0.375f);
    cuda_op<AdamWKernels>().step(p.p, g.p, m.p, v.p, n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, s, 0.375f);
  }
  EXPECT_LE(rel(p.read(), p_r), kTol);
  EXPECT_LE(rel(m.read(), m_r), kTol);
  EXPECT_LE(rel(v.read(), v_r), kTol);
  EXPECT_EQ(g.read(), grad) << "the gradient buffer was written";

  auto x = randn(1000003, 82);
  DevF dx(x);
  const double want = cpu_ref<SumSquaresKernels>().sum_squares(x.data(), x.size());
  const double got = cuda_op<SumSquaresKernels>().sum_squares(dx.p, x.size());
  EXPECT_NEAR(got, want, 1e-9 * want);
  // The device-scalar forms (compile mode): the sum added on the device, the step's scalars and clip read
  // from device memory; the same bits as the host forms.
  Dev<double> acc(std::vector<double>{0.5});
  cuda_op<SumSquaresKernels>().sum_squares_device(acc.p, dx.p, x.size());
  const double sum = acc.read()[0];
  EXPECT_NEAR(sum, 0.5 + want, 1e-9 * want);
  // Partial sums totalled on the device in the host's order.
  const std::vector<double> parts = {0.1, 1e17, -1e17, 0.3};
  Dev<double> dparts(parts), total(1);
  cuda_op<SumSquaresKernels>().total_device(total.p, dparts.p, 4);
  EXPECT_EQ(total.read()[0], ((0.1 + 1e17) + -1e17) + 0.3);
  DevF p2(p0), m2(n), v2(n), p3(p0), m3(n), v3(n);
  for (int s = 1; s <= 3; ++s) {
    const AdamWStepScalars st = adamw_step_scalars(1e-2f, 0.9f, 0.95f, 0.1f, s);
    Dev<int64_t> dst(std::vector<int64_t>(sizeof(st) / sizeof(int64_t)));
    gpu().copy_from_host(dst.p, &st, sizeof(st));
    cuda_op<AdamWKernels>().step_device(p2.p, g.p, m2.p, v2.p, n, 0.9f, 0.95f, 1e-8f, 0.1f,
                                        reinterpret_cast<const AdamWStepScalars*>(dst.p), acc.p, 30.0f);
    cuda_op<AdamWKernels>().step(p3.p, g.p, m3.p, v3.p, n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, s,
                                 clip_scale(sum, 30.0f));
  }
  EXPECT_LT(clip_scale(sum, 30.0f), 1.0f);
  EXPECT_EQ(p2.read(), p3.read());
  EXPECT_EQ(v2.read(), v3.read());
  // Non-finite losses counted on the device (training.skip_nan_inf): the count, then a step that it skips.
  const std::vector<double> losses = {1.0, std::nan(""), INFINITY};
  Dev<double> dlosses(losses);
  AdamWStepScalars st = adamw_step_scalars(1e-2f, 0.9f, 0.95f, 0.1f, 4);
  Dev<int64_t> dst(std::vector<int64_t>(sizeof(st) / sizeof(int64_t)));
  gpu().copy_from_host(dst.p, &st, sizeof(st));
  auto* scalars = reinterpret_cast<AdamWStepScalars*>(dst.p);
  cuda_op<SumSquaresKernels>().count_nonfinite(&scalars->nonfinite, dlosses.p, 3);
  gpu().copy_to_host(&st, dst.p, sizeof(st));
  EXPECT_EQ(st.nonfinite, 2.0);
  const auto p_before = p2.read(), m_before = m2.read(), v_before = v2.read();
  cuda_op<AdamWKernels>().step_device(p2.p, g.p, m2.p, v2.p, n, 0.9f, 0.95f, 1e-8f, 0.1f, scalars, acc.p,
                                      30.0f);
  EXPECT_EQ(p2.read(), p_before);
  EXPECT_EQ(m2.read(), m_before);
  EXPECT_EQ(v2.read(), v_before);
}

// MoE experts: the shared case (support/moe_case.h) through the CUDA grouped kernels with all buffers on the
// device.
using testing::MoeCase;
template <class Kernels>
MoeCase::Result run_moe_on_gpu(const MoeCase& c, const Kernels& kk) {
  const int64_t N = c.N, k = c.k, E = c.E, H = c.H, I = c.I, R = c.R();
  DevF gu(R * 2 * I), act(R * I), scratch(moe_experts_scratch_floats(N, k, H, I));
  Dev<int32_t> order(R), row_of(R), offsets(E + 1), didx(c.idx);
  MoeExpertsBuffers buf{gu.p, act.p, order.p, row_of.p, offsets.p, scratch.p};
  DevF dx_(c.x), dwgu_(c.wgu), dwdown_(c.wdown), ddout(c.dout), dw_(c.w), out(N * H, 9.0f), dx(N * H, 0.5f),
      dw(R, 0.25f), gwgu(c.wgu.size(), 0.1f), gwdown(c.wdown.size(), -0.1f);
  kk.forward(out.p, buf, dx_.p, didx.p, dw_.p, dwgu_.p, dwdown_.p, N, k, E, H, I);
  kk.backward(dx.p, dw.p, gwgu.p, gwdown.p, buf, ddout.p, dx_.p, didx.p, dw_.p, dwgu_.p, dwdown_.p, N, k, E,
              H, I);
  return {out.read(), dx.read(), dw.read(), gwgu.read(), gwdown.read()};
}

TEST(Cuda, MoeExpertsMatchReference) {
  SKIP_WITHOUT_GPU();
  for (const MoeCase& c : {MoeCase(23, 3, 6, 10, 7, 90), MoeCase(37, 2, 8, 72, 24, 90)}) {
    const std::string shape = "N=" + std::to_string(c.N) + " H=" + std::to_string(c.H);
    MoeCase::expect_near(run_moe_on_gpu(c, cuda_op<MoeExpertsKernels>()), c.run(cpu_ref<MoeExpertsKernels>()),
                         kTol, "f32 " + shape);
    MoeCase::expect_near(run_moe_on_gpu(c, cuda_op<MoeExpertsBf16Kernels>()),
                         c.run(cpu_ref<MoeExpertsBf16Kernels>()), kTol, "bf16 " + shape);
  }
}

// The device-routed experts (compile mode's MoE): the reference's results, the same sorted layout as the
// host-routed kernel, bit-for-bit repeats, and a graph captured for one routing and launched for another
// equals the eager call on that routing, bit for bit (no host read or host-sized GEMM inside).
TEST(Cuda, MoeExpertsDeviceRoutedMatchReferenceAndReplay) {
  SKIP_WITHOUT_GPU();
  const auto& f32 = get_kernel<MoeExpertsKernels>(DeviceType::CUDA, "device_routed");
  const auto& bf16 = get_kernel<MoeExpertsBf16Kernels>(DeviceType::CUDA, "device_routed");
  for (const MoeCase& c :
       {MoeCase(23, 3, 6, 10, 7, 90), MoeCase(37, 2, 8, 72, 24, 90), MoeCase(300, 2, 5, 40, 36, 91)}) {
    const std::string shape = "N=" + std::to_string(c.N) + " H=" + std::to_string(c.H);
    const auto got = run_moe_on_gpu(c, f32);
    MoeCase::expect_near(got, c.run(cpu_ref<MoeExpertsKernels>()), kTol, "f32 " + shape);
    MoeCase::expect_near(run_moe_on_gpu(c, bf16), c.run(cpu_ref<MoeExpertsBf16Kernels>()), kTol,
                         "bf16 " + shape);
    const auto again = run_moe_on_gpu(c, f32);
    EXPECT_EQ(again.out, got.out) << shape;
    EXPECT_EQ(again.dwgu, got.dwgu) << shape;
    EXPECT_EQ(again.dwdown, got.dwdown) << shape;
  }
  // Slots naming no expert (expert parallel's padding rows, index -1) are left unrouted: nothing out, no
  // gradient; the others get the reference's results on the routed tokens alone.
  {
    MoeCase padded(40, 1, 5, 16, 24, 92);
    std::vector<int64_t> kept;
    for (int64_t n = 0; n < padded.N; ++n)
      if (n % 3 == 0)
        padded.idx[n] = -1;
      else
        kept.push_back(n);
    MoeCase alone(static_cast<int64_t>(kept.size()), 1, 5, 16, 24, 92);
    alone.wgu = padded.wgu, alone.wdown = padded.wdown;
    for (size_t j = 0; j < kept.size(); ++j) {
      const int64_t n = kept[j], H = padded.H;
      std::copy_n(padded.x.begin() + n * H, H, alone.x.begin() + j * H);
      std::copy_n(padded.dout.begin() + n * H, H, alone.dout.begin() + j * H);
      alone.idx[j] = padded.idx[n], alone.w[j] = padded.w[n];
    }
    const auto got = run_moe_on_gpu(padded, f32), want = alone.run(cpu_ref<MoeExpertsKernels>());
    MoeCase::Result routed{std::vector<float>(kept.size() * padded.H),
                           std::vector<float>(kept.size() * padded.H), std::vector<float>(kept.size()),
                           got.dwgu, got.dwdown};
    for (int64_t n = 0, j = 0; n < padded.N; ++n) {
      const int64_t H = padded.H;
      if (n % 3 == 0) {  // (the kernel's outputs start at 9, dx at 0.5, dw at 0.25)
        for (int64_t h = 0; h < H; ++h) ASSERT_EQ(got.out[n * H + h], 0.0f) << n;
        for (int64_t h = 0; h < H; ++h) ASSERT_EQ(got.dx[n * H + h], 0.5f) << n;
        ASSERT_EQ(got.dw[n], 0.25f) << n;
        continue;
      }
      std::copy_n(got.out.begin() + n * H, H, routed.out.begin() + j * H);
      std::copy_n(got.dx.begin() + n * H, H, routed.dx.begin() + j * H);
      routed.dw[j++] = got.dw[n];
    }
    MoeCase::expect_near(routed, want, kTol, "unrouted slots");
  }
  // The sorted layout equals the host-routed kernel's (each expert's slots in ascending order).
  const MoeCase c(37, 2, 8, 16, 24, 70), other(37, 2, 8, 16, 24, 71);
  const int64_t S = c.R();
  DevF x(c.x), wgu(c.wgu), wdown(c.wdown), wt(c.w), dout(c.dout);
  Dev<int32_t> idx(c.idx);
  DevF gu(S * 2 * c.I), act(S * c.I), scratch(moe_experts_scratch_floats(c.N, c.k, c.H, c.I));
  Dev<int32_t> order(S), row_of(S), offsets(c.E + 1);
  const MoeExpertsBuffers buf{gu.p, act.p, order.p, row_of.p, offsets.p, scratch.p};
  DevF y(c.N * c.H), dx(c.N * c.H), dw(S), gwgu(c.wgu.size()), gwdown(c.wdown.size());
  auto call = [&](const MoeExpertsKernels& kk) {
    kk.forward(y.p, buf, x.p, idx.p, wt.p, wgu.p, wdown.p, c.N, c.k, c.E, c.H, c.I);
    kk.backward(dx.p, dw.p, gwgu.p, gwdown.p, buf, dout.p, x.p, idx.p, wt.p, wgu.p, wdown.p, c.N, c.k, c.E,
                c.H, c.I);
  };
  call(get_kernel<MoeExpertsKernels>(DeviceType::CUDA, "grouped"));
  const auto host_order = order.read(), host_row_of = row_of.read(), host_offsets = offsets.read();
  call(f32);
  EXPECT_EQ(order.read(), host_order);
  EXPECT_EQ(row_of.read(), host_row_of);
  EXPECT_EQ(offsets.read(), host_offsets);
  // Captured on c's routing, launched on other's: the eager results on other's routing.
  auto zero_grads = [&] {
    for (DevF* g : {&dx, &dw, &gwgu, &gwdown}) gpu().zero(g->p, g->n * sizeof(float));
  };
  void* graph = gpu().capture([&] {
    zero_grads();
    call(f32);
  });
  gpu().copy_from_host(idx.p, other.idx.data(), S * sizeof(int32_t));
  zero_grads();
  call(f32);
  const std::vector<std::vector<float>> eager{y.read(), dx.read(), dw.read(), gwgu.read(), gwdown.read()};
  for (DevF* t : {&y, &dx, &dw, &gwgu, &gwdown}) {
    const std::vector<float> nan(t->n, std::nanf(""));
    gpu().copy_from_host(t->p, nan.data(), t->n * sizeof(float));
  }
  gpu().graph_launch(graph);
  const std::vector<std::vector<float>> replayed{y.read(), dx.read(), dw.read(), gwgu.read(), gwdown.read()};
  EXPECT_EQ(replayed, eager);
  gpu().graph_release(graph);
}

// NCCL group of one rank (one GPU here): every collective's plumbing on device buffers, the uneven forms
// (grouped reduce/broadcast, send/recv) included. Several ranks need several GPUs and a launcher.
TEST(Cuda, NcclGroupOfOneRank) {
  SKIP_WITHOUT_GPU();
  if (!dist::nccl_available()) GTEST_SKIP() << "titan was built without NCCL";
  dist::SingleProcessGroup boot;
  auto g = dist::make_nccl_group(boot);
  EXPECT_EQ(g->backend(), "nccl");
  EXPECT_EQ(g->size(), 1);
  EXPECT_EQ(g->rank(), 0);
  auto host = randn(37, 100);
  DevF a(host), b(37, 0.0f);
  g->all_reduce(a.p, 37, dist::CommType::F32, dist::ReduceOp::Sum);
  g->all_reduce(a.p, 37, dist::CommType::F32, dist::ReduceOp::Avg);
  EXPECT_EQ(a.read(), host);
  g->reduce_scatter(a.p, b.p, {37}, dist::CommType::F32, dist::ReduceOp::Sum);
  EXPECT_EQ(b.read(), host);
  DevF c(37, 0.0f);
  g->all_gather(a.p, c.p, {37}, dist::CommType::F32);
  EXPECT_EQ(c.read(), host);
  DevF d(37, 0.0f);
  g->all_to_all_v(a.p, {37}, d.p, {37}, dist::CommType::F32);
  EXPECT_EQ(d.read(), host);
  g->broadcast(a.p, 37, dist::CommType::F32, 0);
  EXPECT_EQ(a.read(), host);
  g->barrier();
  auto sub = g->split(0, 0);
  EXPECT_EQ(sub->backend(), "nccl");
  EXPECT_EQ(sub->size(), 1);
  std::vector<int64_t> ints = {1, -2, 3};
  Dev<int64_t> di(ints);
  sub->all_reduce(di.p, 3, dist::CommType::I64, dist::ReduceOp::Max);
  EXPECT_EQ(di.read(), ints);
  EXPECT_THROW(g->all_reduce(a.p, 2, dist::CommType::BF16, dist::ReduceOp::Sum), Error);
  // Collectives go into a graph (a gradient reduction inside compile mode's captured step): recorded, then
  // run by each launch on the buffers' contents of that moment.
  DevF e(37, 0.0f);
  void* graph = gpu().capture([&] {
    g->all_gather(a.p, e.p, {37}, dist::CommType::F32);
    g->all_reduce(e.p, 37, dist::CommType::F32, dist::ReduceOp::Sum);
  });
  EXPECT_EQ(e.read(), std::vector<float>(37, 0.0f));  // (not yet run)
  gpu().graph_launch(graph);
  EXPECT_EQ(e.read(), host);
  gpu().graph_release(graph);
}

// `titan env` names the GPUs when there are any.
TEST(Cuda, EnvListsGpus) {
  SKIP_WITHOUT_GPU();
  FILE* f = popen(TITAN_BINARY " env", "r");
  ASSERT_NE(f, nullptr);
  std::string text;
  char buf[512];
  while (fgets(buf, sizeof buf, f)) text += buf;
  EXPECT_EQ(pclose(f), 0);
  EXPECT_NE(text.find("CUDA: built"), std::string::npos) << text;
  EXPECT_NE(text.find("cuda:0 "), std::string::npos) << text;
  EXPECT_NE(text.find("compute "), std::string::npos) << text;
  EXPECT_NE(text.find("kernels (cuda):"), std::string::npos) << text;
}

// ---- Glue of the model step (ops elementwise, moe_router, expert_parallel) --------------------------------
// Bit patterns of floats: equality that also holds for NaN.
std::vector<uint32_t> bits(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
  return b;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Every elementwise op bit for bit, on random values plus the edge cases of bf16 rounding: ties (low half
// exactly 0x8000) to an even and to an odd bf16, a carry into the exponent, the largest float (rounds to
// inf), infinities, signed zeros, denormals and NaNs (quiet, signalling, negative: a NaN must stay a NaN).
TEST(Cuda, ElementwiseMatchesReference) {
  SKIP_WITHOUT_GPU();
  const auto& ref = cpu_ref<ElementwiseKernels>();
  const auto& op = cuda_op<ElementwiseKernels>();
  auto x = randn(1001, 110, 3.0f);
  const uint32_t special[] = {0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x3f807fffu, 0x3fffff80u, 0x7f7fffffu,
                              0xff7fffffu, 0x7f800000u, 0xff800000u, 0x00000000u, 0x80000000u, 0x00000001u,
                              0x00408000u, 0x807f8000u, 0x7fc00000u, 0x7f800001u, 0xffc12345u, 0x7fffffffu};
  for (size_t i = 0; i < std::size(special); ++i) x[i * 7] = from_bits(special[i]);
  const int64_t n = static_cast<int64_t>(x.size());
  auto y = randn(x.size(), 111);
  // add: y += x
  auto add_r = y;
  ref.add(add_r.data(), x.data(), n);
  DevF dy(y), dx(x);
  op.add(dy.p, dx.p, n);
  EXPECT_EQ(bits(dy.read()), bits(add_r)) << "add";
  // round_bf16 in place
  auto round_r = x;
  ref.round_bf16(round_r.data(), n);
  DevF dround(x);
  op.round_bf16(dround.p, n);
  EXPECT_EQ(bits(dround.read()), bits(round_r)) << "round_bf16";
  EXPECT_TRUE(std::isnan(dround.read()[15 * 7])) << "a NaN rounded to bf16 is a NaN";
  // to_bf16
  std::vector<uint16_t> h_r(x.size());
  ref.to_bf16(h_r.data(), x.data(), n);
  Dev<uint16_t> dh(x.size());
  op.to_bf16(dh.p, dx.p, n);
  EXPECT_EQ(dh.read(), h_r) << "to_bf16";
  EXPECT_EQ(h_r[0], 0x3f80u);  // the oracle's ties: to even (down), then to even (up)
  EXPECT_EQ(h_r[7], 0x3f82u);
  // add_to_bf16: y + x's bf16 values, the sum's nearest bf16 (the residual add into the bf16 stream)
  std::vector<uint16_t> s_r(x.size());
  ref.add_to_bf16(s_r.data(), y.data(), h_r.data(), n);
  Dev<uint16_t> ds(x.size(), 0xffff);
  DevF dy0(y);
  op.add_to_bf16(ds.p, dy0.p, dh.p, n);
  EXPECT_EQ(ds.read(), s_r) << "add_to_bf16";
  // from_bf16: every one of the 65536 bf16 values
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> f_r(all.size());
  ref.from_bf16(f_r.data(), all.data(), static_cast<int64_t>(all.size()));
  Dev<uint16_t> dall(all);
  DevF df(all.size(), 7.0f);
  op.from_bf16(df.p, dall.p, static_cast<int64_t>(all.size()));
  EXPECT_EQ(bits(df.read()), bits(f_r)) << "from_bf16";
  // fill (and a size no block divides)
  DevF dfill(x.size(), 1.0f);
  op.fill(dfill.p, -2.5f, n - 1);
  auto fill_r = std::vector<float>(x.size(), -2.5f);
  fill_r.back() = 1.0f;
  EXPECT_EQ(dfill.read(), fill_r) << "fill";
  // scale (the gradient clip outside the optimizer)
  const auto plain = randn(1001, 111);  // (GPUs canonicalise NaN payloads in arithmetic: no specials here)
  std::vector<float> scaled_r = plain;
  ref.scale(scaled_r.data(), 0.375f, n);
  DevF dscaled(plain);
  op.scale(dscaled.p, 0.375f, n);
  EXPECT_EQ(bits(dscaled.read()), bits(scaled_r)) << "scale";
}

// Router logits with ties: row 5 all equal (top-k by index), row 6 with repeated values around the top.
std::vector<float> router_logits(int64_t N, int64_t E, uint64_t seed) {
  auto x = randn(N * E, seed, 2.0f);
  if (N > 6) {
    for (int64_t e = 0; e < E; ++e) x[5 * E + e] = 0.25f;
    for (int64_t e = 0; e < E; e += 3) x[6 * E + e] = 4.0f;
  }
  return x;
}

void check_router(int64_t N, int64_t E, int64_t k, uint64_t seed) {
  const auto& ref = cpu_ref<MoeRouterKernels>();
  const auto& op = cuda_op<MoeRouterKernels>();
  const std::string shape = "N=" + std::to_string(N) + " E=" + std::to_string(E) + " k=" + std::to_string(k);
  // softmax in place
  auto logits = router_logits(N, E, seed);
  auto probs = logits;
  ref.softmax(probs.data(), N, E);
  DevF dprobs(logits);
  op.softmax(dprobs.p, N, E);
  EXPECT_LE(rel(dprobs.read(), probs), 1e-6) << "softmax " << shape;
  // select_topk on the same (CPU) probabilities, with and without a bias (ties in it too), with and
  // without renormalisation: the same experts in the same order, the same weights.
  std::vector<float> bias = randn(E, seed + 1, 0.05f);
  if (E > 2) bias[1] = bias[2] = 0.0f;
  DevF dp(probs), dbias(bias);
  for (bool with_bias : {false, true})
    for (bool norm : {false, true}) {
      std::vector<int32_t> idx_r(N * k, -7);
      std::vector<float> w_r(N * k, -7.0f);
      ref.select_topk(idx_r.data(), w_r.data(), probs.data(), with_bias ? bias.data() : nullptr, N, E, k,
                      norm);
      Dev<int32_t> didx(N * k, -7);
      DevF dw(N * k, -7.0f);
      op.select_topk(didx.p, dw.p, dp.p, with_bias ? dbias.p : nullptr, N, E, k, norm);
      const std::string what = shape + " bias=" + std::to_string(with_bias) + " norm=" + std::to_string(norm);
      EXPECT_EQ(didx.read(), idx_r) << "select_topk idx " << what;
      EXPECT_EQ(dw.read(), w_r) << "select_topk weights " << what;
    }
  std::vector<int32_t> idx(N * k);
  std::vector<float> w(N * k);
  ref.select_topk(idx.data(), w.data(), probs.data(), nullptr, N, E, k, true);
  Dev<int32_t> didx(idx);
  // count_tokens (f32, accumulating) and aux_stats (double, accumulating)
  std::vector<float> counts_r(E, 0.5f);
  ref.count_tokens(counts_r.data(), idx.data(), N * k, E);
  DevF dcounts(E, 0.5f);
  op.count_tokens(dcounts.p, didx.p, N * k, E);
  EXPECT_EQ(dcounts.read(), counts_r) << "count_tokens " << shape;
  std::vector<double> c_r(E, 2.0), ps_r(E, 0.125);
  ref.aux_stats(c_r.data(), ps_r.data(), idx.data(), probs.data(), N, E, k);
  Dev<double> dc(E, 2.0), dps(E, 0.125);
  op.aux_stats(dc.p, dps.p, didx.p, dp.p, N, E, k);
  EXPECT_EQ(dc.read(), c_r) << "aux_stats counts " << shape;
  const auto ps = dps.read();
  for (int64_t e = 0; e < E; ++e) EXPECT_NEAR(ps[e], ps_r[e], 1e-12 * std::abs(ps_r[e])) << "prob_sum " << e;
  // backward (overwrites dlogits), with and without the aux term and the renormalisation
  auto dw = randn(N * k, seed + 2), dbias_aux = randn(E, seed + 3, 0.1f);
  DevF ddw(dw), ddb(dbias_aux);
  for (bool aux : {false, true})
    for (bool norm : {false, true}) {
      std::vector<float> dl_r(N * E, 3.0f);
      ref.backward(dl_r.data(), probs.data(), idx.data(), dw.data(), aux ? dbias_aux.data() : nullptr, N, E,
                   k, norm);
      DevF ddl(N * E, 3.0f);
      op.backward(ddl.p, dp.p, didx.p, ddw.p, aux ? ddb.p : nullptr, N, E, k, norm);
      EXPECT_LE(rel(ddl.read(), dl_r), 1e-6)
          << "router backward " << shape << " aux=" << aux << " norm=" << norm;
    }
}

TEST(Cuda, MoeRouterMatchesReference) {
  SKIP_WITHOUT_GPU();
  check_router(37, 12, 3, 120);
  check_router(5, 160, 8, 121);  // several experts per lane, more than a block of threads per row
  check_router(3, 512, 2, 122);  // the largest router
  check_router(9, 1, 1, 123);    // one expert
}

// update_bias: the CPU's bias step bit for bit (counts above, below and equal to the mean), counts zeroed.
TEST(Cuda, MoeRouterUpdateBiasMatchesReference) {
  SKIP_WITHOUT_GPU();
  for (int64_t E : {int64_t(12), int64_t(300)}) {
    std::vector<float> counts(E), bias = randn(E, 130, 0.01f);
    for (int64_t e = 0; e < E; ++e) counts[e] = float(e % 3);  // mean 1: above, below and equal to it
    auto bias_r = bias, counts_r = counts;
    cpu_ref<MoeRouterKernels>().update_bias(bias_r.data(), counts_r.data(), E, 1e-3);
    DevF db(bias), dc(counts);
    cuda_op<MoeRouterKernels>().update_bias(db.p, dc.p, E, 1e-3);
    EXPECT_EQ(db.read(), bias_r) << "E=" << E;
    EXPECT_EQ(dc.read(), std::vector<float>(E, 0.0f)) << "E=" << E;
    EXPECT_NE(bias_r, bias);
  }
}

// Expert-parallel row packing, bit for bit: a permuted send order, local expert indices, malformed rows.
TEST(Cuda, ExpertParallelGlueMatchesReference) {
  SKIP_WITHOUT_GPU();
  const auto& ref = cpu_ref<ExpertParallelKernels>();
  const auto& op = cuda_op<ExpertParallelKernels>();
  const int64_t N = 37, k = 3, H = 40, E = 12, El = 4, S = N * k;
  auto x = randn(N * H, 140), w = randn(S, 141);
  std::vector<int32_t> idx(S);
  std::mt19937_64 rng(142);
  for (auto& e : idx) e = int32_t(rng() % E);
  std::vector<int64_t> order(S), pos(S);
  for (int64_t i = 0; i < S; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  for (int64_t i = 0; i < S; ++i) pos[order[i]] = i;
  Dev<int32_t> didx(idx);
  Dev<int64_t> dorder(order), dpos(pos);
  DevF dx(x), dw(w);
  // pack
  std::vector<float> send_r(S * (H + 2));
  ref.pack(send_r.data(), x.data(), w.data(), idx.data(), order.data(), S, k, H, El);
  DevF dsend(S * (H + 2), 9.0f);
  op.pack(dsend.p, dx.p, dw.p, didx.p, dorder.p, S, k, H, El);
  EXPECT_EQ(dsend.read(), send_r) << "pack";
  // unpack of the packed rows (all well formed), then with two malformed rows (expert El and -1)
  for (int bad_rows : {0, 2}) {
    auto recv = send_r;
    if (bad_rows) recv[3 * (H + 2) + H + 1] = float(El), recv[50 * (H + 2) + H + 1] = -1.0f;
    const int64_t R = S;
    std::vector<float> ux_r(R * H), uw_r(R);
    std::vector<int32_t> ui_r(R);
    const int64_t bad_r = ref.unpack(ux_r.data(), uw_r.data(), ui_r.data(), recv.data(), R, H, El);
    EXPECT_EQ(bad_r, bad_rows);
    DevF drecv(recv), ux(R * H), uw(R);
    Dev<int32_t> ui(R);
    EXPECT_EQ(op.unpack(ux.p, uw.p, ui.p, drecv.p, R, H, El), bad_r) << "unpack: malformed rows";
    EXPECT_EQ(ux.read(), ux_r) << "unpack x";
    EXPECT_EQ(uw.read(), uw_r) << "unpack w";
    EXPECT_EQ(ui.read(), ui_r) << "unpack idx";
  }
  // The fixed-capacity layout (3 ranks of El experts), its padded packing and unpacking, bit for bit.
  const int64_t ranks = E / El;
  std::vector<int64_t> forder_r(ranks * S), fpos_r(S);
  ref.route_fixed(forder_r.data(), fpos_r.data(), idx.data(), S, El, ranks);
  Dev<int64_t> forder(ranks * S, 7), fpos(S, 7);
  op.route_fixed(forder.p, fpos.p, didx.p, S, El, ranks);
  EXPECT_EQ(forder.read(), forder_r) << "route_fixed order";
  EXPECT_EQ(fpos.read(), fpos_r) << "route_fixed pos";
  std::vector<float> fsend_r(ranks * S * (H + 2));
  ref.pack(fsend_r.data(), x.data(), w.data(), idx.data(), forder_r.data(), ranks * S, k, H, El);
  DevF fsend(ranks * S * (H + 2), 9.0f);
  op.pack(fsend.p, dx.p, dw.p, didx.p, forder.p, ranks * S, k, H, El);
  EXPECT_EQ(fsend.read(), fsend_r) << "pack with padding";
  std::vector<float> fx_r(ranks * S * H), fw_r(ranks * S);
  std::vector<int32_t> fi_r(ranks * S);
  ref.unpack_padded(fx_r.data(), fw_r.data(), fi_r.data(), fsend_r.data(), ranks * S, H);
  DevF fx(ranks * S * H), fw(ranks * S);
  Dev<int32_t> fi(ranks * S);
  op.unpack_padded(fx.p, fw.p, fi.p, fsend.p, ranks * S, H);
  EXPECT_EQ(fx.read(), fx_r) << "unpack_padded x";
  EXPECT_EQ(fw.read(), fw_r) << "unpack_padded w";
  EXPECT_EQ(fi.read(), fi_r) << "unpack_padded idx";
  // gather_rows
  auto src = randn(N * H, 143);
  std::vector<float> g_r(S * H);
  ref.gather_rows(g_r.data(), src.data(), order.data(), S, k, H);
  DevF dsrc(src), dg(S * H);
  op.gather_rows(dg.p, dsrc.p, dorder.p, S, k, H);
  EXPECT_EQ(dg.read(), g_r) << "gather_rows";
  // pack_grads
  auto gdx = randn(S * H, 144), gdw = randn(S, 145);
  std::vector<float> pg_r(S * (H + 1));
  ref.pack_grads(pg_r.data(), gdx.data(), gdw.data(), S, H);
  DevF dgdx(gdx), dgdw(gdw), dpg(S * (H + 1));
  op.pack_grads(dpg.p, dgdx.p, dgdw.p, S, H);
  EXPECT_EQ(dpg.read(), pg_r) << "pack_grads";
  // combine: [rows | dw] back to tokens (accumulating, with dtw) and plain rows (overwriting, no dtw)
  DevF dpgr(pg_r);
  for (bool accumulate : {false, true}) {
    auto out0 = randn(N * H, 146), dtw0 = randn(S, 147);
    auto out_r = out0, dtw_r = dtw0;
    ref.combine(out_r.data(), accumulate ? dtw_r.data() : nullptr, pg_r.data(), pos.data(), N, k, H, H + 1,
                accumulate);
    DevF dout(out0), ddtw(dtw0);
    op.combine(dout.p, accumulate ? ddtw.p : nullptr, dpgr.p, dpos.p, N, k, H, H + 1, accumulate);
    EXPECT_EQ(dout.read(), out_r) << "combine accumulate=" << accumulate;
    EXPECT_EQ(ddtw.read(), dtw_r) << "combine dtw accumulate=" << accumulate;
  }
  std::vector<float> plain_r(N * H, 5.0f);
  ref.combine(plain_r.data(), nullptr, g_r.data(), pos.data(), N, k, H, H, false);
  DevF dplain(N * H, 5.0f);
  op.combine(dplain.p, nullptr, dg.p, dpos.p, N, k, H, H, false);
  EXPECT_EQ(dplain.read(), plain_r) << "combine of H-wide rows";
}

// ---- The model on the GPU
// ---------------------------------------------------------------------------------- A tiny Qwen3 on the GPU
// against the same model on the CPU: one training step (forward with the logits kept, backward), every flat
// gradient compared. Dense (tied embeddings) and MoE (3 layers, the middle one dense; 8 experts top-2,
// renormalised, the aux loss in the loss; a variant with the aux-loss-free expert bias).
Qwen3Config tiny_qwen3(bool moe, double load_balance_coeff = 0.0) {
  Qwen3Config c = Qwen3Config::flavor(moe ? "debug_moe" : "debug");
  c.vocab_size = 128;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_hidden_layers = moe ? 3 : 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  if (moe) {
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 32;
    c.norm_topk_prob = true;
    c.mlp_only_layers = {1};
    c.output_router_logits = true;
    c.router_aux_loss_coef = 0.01;
    c.load_balance_coeff = load_balance_coeff;
  }
  return c;
}

std::vector<float> host_floats(const Tensor& t) {
  const Tensor h = t.to(Device::cpu());
  return std::vector<float>(h.f32(), h.f32() + h.numel());
}

struct StepResult {
  ForwardResult r;
  std::vector<float> logits;
  std::vector<std::vector<float>> grads;  // per flat buffer
};

// B = 2, T = 9; distinct token ids (the embedding gradient then gets one add per element, so a GPU step is
// bit-reproducible), every fourth label ignored.
StepResult train_step(Qwen3Model& m) {
  const int64_t B = 2, T = 9, V = m.config().vocab_size;
  std::vector<int32_t> ids(B * T), labels(B * T);
  for (int64_t n = 0; n < B * T; ++n) {
    ids[n] = int32_t((n * 37 + 5) % V);
    labels[n] = n % 4 == 2 ? -100 : int32_t((n * 53 + 11) % V);
  }
  m.zero_grad();
  ForwardOptions opts;
  opts.keep_logits = true;
  StepResult s;
  s.r = m.forward(ids.data(), labels.data(), B, T, opts);
  m.backward();
  s.logits = host_floats(m.logits());
  for (auto& g : m.flat_grads()) s.grads.push_back(host_floats(g));
  return s;
}

void expect_close(const StepResult& a, const StepResult& ref, double tol_loss, double tol_logits,
                  double tol_grads, const std::string& what) {
  EXPECT_EQ(a.r.num_valid, ref.r.num_valid) << what;
  EXPECT_NEAR(a.r.loss, ref.r.loss, tol_loss * std::abs(ref.r.loss)) << what << " loss";
  EXPECT_NEAR(a.r.aux_loss, ref.r.aux_loss, tol_loss * std::abs(ref.r.aux_loss)) << what << " aux loss";
  EXPECT_LE(rel(a.logits, ref.logits), tol_logits) << what << " logits";
  ASSERT_EQ(a.grads.size(), ref.grads.size()) << what;
  for (size_t g = 0; g < ref.grads.size(); ++g)
    EXPECT_LE(rel(a.grads[g], ref.grads[g]), tol_grads) << what << " gradient of flat buffer " << g;
}

void expect_bit_equal(const StepResult& a, const StepResult& b, const std::string& what) {
  EXPECT_EQ(a.r.loss, b.r.loss) << what;
  EXPECT_EQ(a.r.aux_loss, b.r.aux_loss) << what;
  EXPECT_EQ(a.logits, b.logits) << what << " logits";
  ASSERT_EQ(a.grads.size(), b.grads.size()) << what;
  for (size_t g = 0; g < a.grads.size(); ++g)
    EXPECT_EQ(a.grads[g], b.grads[g]) << what << " flat buffer " << g;
}

// `device`: where the second model lives (the GPU; the CPU as a check of the harness itself).
void check_model_against_cpu(const Qwen3Config& cfg, const std::string& name, Device device) {
  Qwen3Model cpu(cfg);
  cpu.init_weights(3);
  Qwen3Model dev(cfg, {}, nullptr, true, device);
  dev.load_state_dict(cpu.state_dict());
  // f32: the same step
  const StepResult c = train_step(cpu), d = train_step(dev);
  expect_close(d, c, 1e-5, 1e-5, 1e-4, name + " f32");
  if (cfg.load_balance_coeff > 0) {
    // The expert token counts of the step, then the bias update (counts cleared), then a step routed
    // with the bias.
    EXPECT_EQ(host_floats(dev.expert_token_counts()), host_floats(cpu.expert_token_counts())) << name;
    cpu.update_expert_bias();
    dev.update_expert_bias();
    const auto bias = host_floats(cpu.expert_bias());
    EXPECT_EQ(host_floats(dev.expert_bias()), bias) << name << " expert bias";
    EXPECT_NE(bias, std::vector<float>(bias.size(), 0.0f)) << name;
    EXPECT_EQ(host_floats(dev.expert_token_counts()), std::vector<float>(bias.size(), 0.0f)) << name;
    expect_close(train_step(dev), train_step(cpu), 1e-5, 1e-5, 1e-4, name + " f32 with the expert bias");
  }
  // Activation checkpointing recomputes each layer bit for bit: the same step, the same bits.
  const StepResult plain = train_step(dev);
  dev.set_activation_checkpointing(true);
  expect_bit_equal(train_step(dev), plain, name + " activation checkpointing");
  dev.set_activation_checkpointing(false);
  // bf16 compute on both (the parameters rounded in place on each side) against the CPU's bf16 path.
  cpu.set_bf16_compute(true);
  dev.set_bf16_compute(true);
  expect_close(train_step(dev), train_step(cpu), 2e-2, 2e-2, 2e-2, name + " bf16");
}

// Qwen3Model::time_ops: every op class of a bf16 step reports device time (CUDA events) to the current
// OpTiming, and the step's results stay bit for bit those of the untimed ops.
TEST(Cuda, TimedOpsReportEveryClassAndChangeNothing) {
  SKIP_WITHOUT_GPU();
  Qwen3Model m(tiny_qwen3(false), {}, nullptr, true, Device{DeviceType::CUDA, 0});
  m.init_weights(3);
  m.set_bf16_compute(true);
  const StepResult plain = train_step(m);
  OpTiming timing(DeviceType::CUDA);
  timing.make_current();
  m.time_ops();
  const StepResult timed_step = train_step(m);
  expect_bit_equal(timed_step, plain, "timed ops");
  const auto ms = timing.collect();
  for (int c = 0; c < static_cast<int>(OpClass::kCount); ++c) {
    EXPECT_GT(timing.calls()[c], 0) << op_class_name(static_cast<OpClass>(c));
    EXPECT_GE(ms[c], 0.0) << op_class_name(static_cast<OpClass>(c));
  }
  EXPECT_GT(ms[static_cast<int>(OpClass::kGemm)], 0.0);
  EXPECT_THROW(m.time_ops(), Error);  // (once)
}

// Compile mode's step on the device: the batch staged outside the graph (ids, targets, the loss scale of its
// valid targets, packed rows' position tables), then zero_grad, the forward with the loss kept on the
// device and the backward, captured into a graph after an eager warm-up step and launched once per batch:
// the loss and every gradient equal the eager step's on that batch, bit for bit (the gradients poisoned
// with NaN before each launch, so the graph wrote all of them). The batches differ in their ignored
// targets and their documents.
TEST(Cuda, CapturedTrainingStepEqualsTheEagerStep) {
  SKIP_WITHOUT_GPU();
  Qwen3Model m(tiny_qwen3(false), {}, nullptr, true, Device{DeviceType::CUDA, 0});
  m.init_weights(3);
  const int64_t B = 2, T = 9, V = m.config().vocab_size;
  std::vector<int32_t> pos(B * T);  // packed rows: a document starts at t = 0 and t = 3 + salt
  auto batch = [&](int salt) {
    std::vector<int32_t> ids(B * T), labels(B * T);
    for (int64_t n = 0; n < B * T; ++n) {
      ids[n] = int32_t((n * 37 + 5 + salt) % V);
      labels[n] = (n + salt) % 4 == 2 ? -100 : int32_t((n * 53 + 11 + 3 * salt) % V);
      const int64_t t = n % T;
      pos[n] = int32_t(t < 3 + salt ? t : t - 3 - salt);
    }
    return std::pair{ids, labels};
  };
  std::vector<int32_t> ids, labels;
  ForwardOptions opts;
  opts.loss_on_device = true;
  opts.inputs_staged = true;
  opts.position_ids = pos.data();
  auto step = [&] {
    m.zero_grad();
    EXPECT_TRUE(std::isnan(m.forward(ids.data(), labels.data(), B, T, opts).loss_sum));
    m.backward();
  };
  std::tie(ids, labels) = batch(0);
  m.stage_inputs(ids.data(), labels.data(), B, T, opts);
  step();  // warm-up, eagerly
  void* graph = gpu().capture(step);
  for (int salt : {1, 0, 2}) {
    std::tie(ids, labels) = batch(salt);
    m.zero_grad();
    ForwardOptions eager_opts;
    eager_opts.position_ids = pos.data();
    const ForwardResult eager = m.forward(ids.data(), labels.data(), B, T, eager_opts);
    m.backward();
    std::vector<std::vector<float>> grads;
    for (auto& g : m.flat_grads()) {
      grads.push_back(host_floats(g));
      const std::vector<float> nan(g.numel(), std::nanf(""));
      g.copy_from_host(nan.data());
    }
    m.stage_inputs(ids.data(), labels.data(), B, T, opts);
    gpu().graph_launch(graph);
    EXPECT_EQ(m.device_loss_sum(), eager.loss_sum) << "batch " << salt;
    for (size_t i = 0; i < grads.size(); ++i)
      EXPECT_EQ(host_floats(m.flat_grads()[i]), grads[i]) << "group " << i << ", batch " << salt;
  }
  gpu().graph_release(graph);
  // A MoE model keeps its aux loss on the device too: the eager forward's CE sum and aux loss.
  Qwen3Model moe(tiny_qwen3(true), {{"moe_experts", "device_routed"}}, nullptr, true,
                 Device{DeviceType::CUDA, 0});
  moe.init_weights(3);
  const ForwardResult eager =
      moe.forward(ids.data(), labels.data(), B, T, ForwardOptions{.position_ids = pos.data()});
  moe.stage_inputs(ids.data(), labels.data(), B, T, opts);
  const ForwardResult staged = moe.forward(ids.data(), labels.data(), B, T, opts);
  EXPECT_TRUE(std::isnan(staged.aux_loss));
  EXPECT_EQ(moe.device_loss_sum(), eager.loss_sum);
  EXPECT_EQ(moe.device_aux_loss(), eager.aux_loss);
  EXPECT_GT(eager.aux_loss, 0.0);
}

// The whole step in the graph: the gradient norm on the device and AdamW reading the staged learning rate
// and step count and the clip factor from device memory. Two twin models, one stepped eagerly (host norm,
// clip_coefficient, AdamW::step), one by the graph (stage_inputs + stage_step, then the launch), over three
// batches at three learning rates: their parameters stay equal bit for bit, and so do the losses.
TEST(Cuda, CapturedStepWithTheOptimizerEqualsTheEagerSteps) {
  SKIP_WITHOUT_GPU();
  const Device cuda{DeviceType::CUDA, 0};
  Qwen3Model eager(tiny_qwen3(false), {}, nullptr, true, cuda),
      graphed(tiny_qwen3(false), {}, nullptr, true, cuda);
  eager.init_weights(3);
  graphed.init_weights(3);
  const AdamWConfig cfg{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f};
  AdamW opt_e(eager.flat_params(), eager.flat_grads(), cfg),
      opt_g(graphed.flat_params(), graphed.flat_grads(), cfg);
  const float max_norm = 0.5f;  // (small enough to clip)
  const int64_t B = 2, T = 9, V = eager.config().vocab_size;
  std::vector<int32_t> ids(B * T), labels(B * T);
  auto batch = [&](int salt) {
    for (int64_t n = 0; n < B * T; ++n) {
      ids[n] = int32_t((n * 37 + 5 + salt) % V);
      labels[n] = n % 4 == 2 ? -100 : int32_t((n * 53 + 11 + 3 * salt) % V);
    }
  };
  Tensor sq = Tensor::zeros({1}, DType::F64, cuda);
  ForwardOptions opts;
  opts.loss_on_device = true;
  opts.inputs_staged = true;
  auto graph_step = [&] {
    graphed.zero_grad();
    graphed.forward(ids.data(), labels.data(), B, T, opts);
    graphed.backward();
    grad_sq_norm_device(graphed.flat_grads(), sq.data<double>());
    opt_g.step_staged(sq.data<double>(), max_norm);
  };
  double eager_loss = 0;
  auto eager_step = [&](float lr) {
    eager.zero_grad();
    eager_loss = eager.forward(ids.data(), labels.data(), B, T).loss_sum;
    eager.backward();
    opt_e.step(lr, clip_coefficient(std::sqrt(grad_sq_norm(eager.flat_grads())), max_norm));
  };
  // Warm-up: both eagerly (the graph's twin through the staged forms).
  batch(0);
  eager_step(1e-3f);
  graphed.stage_inputs(ids.data(), labels.data(), B, T, opts);
  opt_g.stage_step(1e-3f);
  graph_step();
  auto expect_twins = [&](const std::string& when) {
    EXPECT_EQ(graphed.device_loss_sum(), eager_loss) << when;
    for (size_t i = 0; i < eager.flat_params().size(); ++i)
      EXPECT_EQ(host_floats(graphed.flat_params()[i]), host_floats(eager.flat_params()[i]))
          << when << ", group " << i;
  };
  expect_twins("the warm-up step");
  void* graph = gpu().capture(graph_step);
  for (int salt : {1, 2, 3}) {
    const float lr = 1e-3f * float(salt + 1);
    batch(salt);
    eager_step(lr);
    graphed.stage_inputs(ids.data(), labels.data(), B, T, opts);
    opt_g.stage_step(lr);
    gpu().graph_launch(graph);
    expect_twins("batch " + std::to_string(salt));
  }
  EXPECT_EQ(opt_g.step_count(), opt_e.step_count());
  gpu().graph_release(graph);
}

TEST(Cuda, Qwen3ModelMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const Device cuda{DeviceType::CUDA, 0};
  check_model_against_cpu(tiny_qwen3(false), "dense", cuda);
  check_model_against_cpu(tiny_qwen3(true), "moe", cuda);
  check_model_against_cpu(tiny_qwen3(true, 1e-3), "moe+expert bias", cuda);
}

}  // namespace
}  // namespace titan
