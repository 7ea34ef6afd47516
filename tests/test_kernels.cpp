// Kernel registry: every registered implementation of every op equals the reference on fresh random
// inputs (forward and backward), and the reference backward agrees with finite differences.
#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <tuple>

#include "core/dtype.h"
#include "device/cpu/sgemm.h"
#include "kernels/counter_hash.h"
#include "kernels/ops.h"
#include "kernels/registry.h"
#include "support/attention_bf16_case.h"
#include "support/moe_case.h"
#include "support/testing.h"

namespace titan {
namespace {

using testing::doc_starts;
using testing::randn;
using testing::rel;

// Every build of every implementation this CPU can run (the cap TITAN_CPU_ISA lowers what that is): "fast"
// when it has one build, else "fast@avx2", "fast@avx512", ... each compared with the reference.
template <class K>
std::vector<std::string> impls() {
  auto& reg = KernelRegistry::global();
  std::vector<std::string> out;
  for (auto& name : reg.impls(K::kOp, DeviceType::CPU)) {
    const auto isas = reg.variants(K::kOp, DeviceType::CPU, name);
    for (CpuIsa isa : isas)
      if (cpu_isa_supported(isa)) out.push_back(isas.size() == 1 ? name : name + "@" + cpu_isa_name(isa));
  }
  return out;
}

// The build that impls() named.
template <class K>
const K& variant(const std::string& name) {
  const auto at = name.find('@');
  if (at == std::string::npos) return get_kernel<K>(DeviceType::CPU, name);
  const void* t = KernelRegistry::global().find_variant(K::kOp, DeviceType::CPU, name.substr(0, at),
                                                        parse_cpu_isa(name.substr(at + 1), "variant"));
  if (!t) throw Error("no variant " + name);
  return *static_cast<const K*>(t);
}

constexpr double kTol = 1e-5;

TEST(KernelRegistry, EveryOpHasAReferenceAndTheDefaultIsRegistered) {
  for (auto& op : KernelRegistry::global().ops()) {
    auto names = KernelRegistry::global().impls(op, DeviceType::CPU);
    EXPECT_NE(std::find(names.begin(), names.end(), "reference"), names.end()) << op;
    EXPECT_FALSE(KernelRegistry::global().default_impl(op, DeviceType::CPU).empty()) << op;
  }
  EXPECT_THROW(get_kernel<RopeKernels>(DeviceType::CPU, "no-such-impl"), Error);
}

// An implementation is chosen by the CPU's level (capped by TITAN_CPU_ISA): the default runs here, and one
// that cannot run is never a default and, asked for by name, is an error naming the op, the implementation
// and the missing feature. The suite runs once uncapped and once with TITAN_CPU_ISA=avx2.
TEST(KernelRegistry, ImplementationsAreChosenByTheCpuIsa) {
  auto& reg = KernelRegistry::global();
  for (auto& op : reg.ops())
    EXPECT_TRUE(reg.runnable(op, DeviceType::CPU, reg.default_impl(op, DeviceType::CPU))) << op;
  // The fast kernels have AVX2 and AVX-512 builds; the highest one the CPU supports runs.
  const auto isas = reg.variants("swiglu", DeviceType::CPU, "fast");
  ASSERT_EQ(isas, (std::vector<CpuIsa>{CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512}));
  const CpuIsa want = std::min(cpu_isa(), CpuIsa::kAvx512);
  EXPECT_EQ(reg.running_isa("swiglu", DeviceType::CPU, "fast"), want);
  EXPECT_EQ(reg.find("swiglu", DeviceType::CPU, "fast"),
            reg.find_variant("swiglu", DeviceType::CPU, "fast", want));
  // bf16 GEMMs: oneDNN where the CPU has bf16 dot products, else bf16-rounded operands through sgemm.
  const auto mm = reg.impls("matmul_bf16", DeviceType::CPU);
  if (std::find(mm.begin(), mm.end(), "onednn") != mm.end() && !cpu_isa_supported(CpuIsa::kAvx512Bf16)) {
    EXPECT_EQ(reg.default_impl("matmul_bf16", DeviceType::CPU), "sgemm");
    EXPECT_EQ(reg.default_impl("moe_experts_bf16", DeviceType::CPU), "sgemm");
    try {
      get_kernel<MatmulBf16Kernels>(DeviceType::CPU, "onednn");
      ADD_FAILURE() << "onednn ran without AVX512_BF16";
    } catch (const Error& e) {
      // Under the cap: "needs avx512_bf16 (capped by TITAN_CPU_ISA=avx2)"; on an AVX2 CPU every missing
      // feature.
      const std::string what = e.what();
      EXPECT_NE(what.find("'matmul_bf16' implementation 'onednn' cannot run here: needs "), std::string::npos)
          << what;
      EXPECT_NE(what.find("avx512_bf16"), std::string::npos) << what;
    }
  } else if (cpu_isa_supported(CpuIsa::kAvx512Bf16) &&
             std::find(mm.begin(), mm.end(), "onednn") != mm.end()) {
    // Unless its bf16 dot products are slower than its f32 FMAs (AVX512_BF16 without AMX on some CPUs).
    const bool slow = !cpu_bf16_dot_products_slow().empty();
    EXPECT_EQ(reg.default_impl("matmul_bf16", DeviceType::CPU), slow ? "sgemm" : "onednn");
    EXPECT_EQ(reg.default_impl("moe_experts_bf16", DeviceType::CPU), slow ? "sgemm" : "onednn");
    EXPECT_EQ(reg.why_not_default("matmul_bf16", DeviceType::CPU, "onednn"), cpu_bf16_dot_products_slow());
    EXPECT_TRUE(reg.runnable("matmul_bf16", DeviceType::CPU, "onednn"));  // still runs by name
  }
  EXPECT_THROW(parse_cpu_isa("avx3", "TITAN_CPU_ISA"), Error);
  EXPECT_EQ(parse_cpu_isa("avx2", "TITAN_CPU_ISA"), CpuIsa::kAvx2);
}

// A condition passes an implementation over as the default on CPUs where another one is faster; it still
// runs when named, and where every candidate has a reason against it the priority decides.
TEST(KernelRegistry, AnImplementationSlowOnThisCpuIsNotTheDefault) {
  KernelRegistry reg;
  static const int table = 0;
  reg.add("op", DeviceType::CPU, "reference", &table, 0);
  reg.add("op", DeviceType::CPU, "engine", &table, 10);
  reg.add("op", DeviceType::CPU, "fallback", &table, 5);
  EXPECT_EQ(reg.default_impl("op", DeviceType::CPU), "engine");
  std::string (*slow)() = [] { return std::string("slow on this CPU"); };
  std::string (*fine)() = [] { return std::string(); };
  reg.set_default_condition("op", DeviceType::CPU, "engine", fine);
  EXPECT_EQ(reg.default_impl("op", DeviceType::CPU), "engine");
  reg.set_default_condition("op", DeviceType::CPU, "engine", slow);
  EXPECT_EQ(reg.default_impl("op", DeviceType::CPU), "fallback");
  EXPECT_EQ(reg.why_not_default("op", DeviceType::CPU, "engine"), "slow on this CPU");
  EXPECT_EQ(reg.why_not_default("op", DeviceType::CPU, "fallback"), "");
  EXPECT_EQ(reg.find("op", DeviceType::CPU, "engine"), &table);
  reg.set_default_condition("op", DeviceType::CPU, "fallback", slow);
  reg.set_default_condition("op", DeviceType::CPU, "reference", slow);
  EXPECT_EQ(reg.default_impl("op", DeviceType::CPU), "engine");

  // The measured rate behind the bf16 engines' condition: only at avx512_bf16 (AMX has its tiles, below
  // there are no bf16 dot products), and a plausible ratio there.
  const double r = cpu_bf16_dot_speedup();
  if (cpu_isa() == CpuIsa::kAvx512Bf16) {
    EXPECT_GT(r, 0.2);
    EXPECT_LT(r, 5.0);
    EXPECT_EQ(cpu_bf16_dot_products_slow().empty(), r >= 0.75);
  } else {
    EXPECT_EQ(r, 0.0);
    EXPECT_EQ(cpu_bf16_dot_products_slow(), "");
  }
}

TEST(Kernels, MatmulAllImplementations) {
  const int64_t N = 7, C = 13, OC = 11;
  auto inp = randn(N * C, 1), w = randn(OC * C, 2), dout = randn(N * OC, 3);
  const auto& ref = get_kernel<MatmulKernels>(DeviceType::CPU, "reference");
  std::vector<float> out_r(N * OC), dinp_r(N * C, 0.5f), dw_r(OC * C, 0.25f);
  ref.forward(out_r.data(), inp.data(), w.data(), N, C, OC);
  ref.backward(dinp_r.data(), dw_r.data(), dout.data(), inp.data(), w.data(), N, C, OC, true);
  for (auto& name : impls<MatmulKernels>()) {
    const auto& k = variant<MatmulKernels>(name);
    std::vector<float> out(N * OC), dinp(N * C, 0.5f), dw(OC * C, 0.25f);  // backward accumulates
    k.forward(out.data(), inp.data(), w.data(), N, C, OC);
    k.backward(dinp.data(), dw.data(), dout.data(), inp.data(), w.data(), N, C, OC, true);
    EXPECT_LE(rel(out, out_r), kTol) << name;
    EXPECT_LE(rel(dinp, dinp_r), kTol) << name;
    EXPECT_LE(rel(dw, dw_r), kTol) << name;
  }
}

#ifdef TITAN_HAVE_DNNL
// The onednn matmul computes weight gradients on oneDNN or, on CPUs running AVX2 code, on OpenBLAS
// (matmul_onednn.cpp): both engines give the reference's dW, written and accumulated, on any machine,
// whichever one this machine routes to; and the route follows its rule.
TEST(Kernels, WeightGradientEnginesMatchTheReference) {
  const int64_t N = 67, C = 40, OC = 96;
  auto inp = randn(N * C, 41), dout = randn(N * OC, 42);
  const auto& ref = get_kernel<MatmulKernels>(DeviceType::CPU, "reference");
  for (bool acc : {false, true}) {
    std::vector<float> dw_r(OC * C, 0.25f), dw_dnnl(OC * C, 0.25f), dw_blas(OC * C, 0.25f);
    ref.backward(nullptr, dw_r.data(), dout.data(), inp.data(), nullptr, N, C, OC, acc);
    const float beta = acc ? 1.0f : 0.0f;
    cpu::sgemm(true, false, OC, C, N, 1.0f, dout.data(), OC, inp.data(), C, beta, dw_dnnl.data(), C);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout.data(), OC, inp.data(), C, beta,
                dw_blas.data(), C);
    EXPECT_LE(rel(dw_dnnl, dw_r), kTol) << "oneDNN, accumulate " << acc;
    EXPECT_LE(rel(dw_blas, dw_r), kTol) << "OpenBLAS, accumulate " << acc;
  }
  EXPECT_EQ(cpu::weight_grad_on_openblas(), cpu_isa() < CpuIsa::kAvx512 && cpu::openblas_runs_avx2());
}
#endif

// bf16 GEMMs: every engine equals the reference (bf16-rounded operands, double accumulation); the result is
// within bf16 rounding of the f32 matmul.
TEST(Kernels, MatmulBf16AllImplementations) {
  for (auto [N, C, OC] : {std::tuple<int64_t, int64_t, int64_t>{7, 13, 11}, {33, 64, 48}}) {
    auto inp = randn(N * C, 1), w = randn(OC * C, 2), dout = randn(N * OC, 3);
    const auto& ref = get_kernel<MatmulBf16Kernels>(DeviceType::CPU, "reference");
    std::vector<float> out_r(N * OC), dinp_r(N * C, 0.5f), dw_r(OC * C, 0.25f);
    ref.forward(out_r.data(), inp.data(), w.data(), N, C, OC);
    ref.backward(dinp_r.data(), dw_r.data(), dout.data(), inp.data(), w.data(), N, C, OC, true);
    for (auto& name : impls<MatmulBf16Kernels>()) {
      const auto& k = variant<MatmulBf16Kernels>(name);
      std::vector<float> out(N * OC), dinp(N * C, 0.5f), dw(OC * C, 0.25f);
      k.forward(out.data(), inp.data(), w.data(), N, C, OC);
      k.backward(dinp.data(), dw.data(), dout.data(), inp.data(), w.data(), N, C, OC, true);
      k.backward(nullptr, nullptr, dout.data(), inp.data(), w.data(), N, C, OC, true);  // both skipped
      EXPECT_LE(rel(out, out_r), kTol) << name;
      EXPECT_LE(rel(dinp, dinp_r), kTol) << name;
      EXPECT_LE(rel(dw, dw_r), kTol) << name;
    }
    const auto& f32 = get_kernel<MatmulKernels>(DeviceType::CPU, "reference");
    std::vector<float> out32(N * OC), dinp32(N * C, 0.5f), dw32(OC * C, 0.25f);
    f32.forward(out32.data(), inp.data(), w.data(), N, C, OC);
    f32.backward(dinp32.data(), dw32.data(), dout.data(), inp.data(), w.data(), N, C, OC, true);
    EXPECT_LE(rel(out_r, out32), 2e-2);
    EXPECT_GT(rel(out_r, out32), 0.0);  // really rounded
    EXPECT_LE(rel(dinp_r, dinp32), 2e-2);
    EXPECT_LE(rel(dw_r, dw32), 2e-2);
  }
}

// The bf16-input GEMMs (the input given as bf16 bits) equal the f32-input ones on the f32 values of those
// bits, bit for bit, in every engine: forward, d(input) and the weight gradient (written and accumulated),
// each skipped when its output is null.
TEST(Kernels, MatmulBf16InputEqualsF32InputOfTheSameValues) {
  for (auto [N, C, OC] : {std::tuple<int64_t, int64_t, int64_t>{7, 13, 11}, {33, 64, 48}}) {
    auto x = randn(N * C, 11), w = randn(OC * C, 12), dout = randn(N * OC, 13);
    std::vector<uint16_t> x16(x.size());
    std::vector<float> xv(x.size());
    for (size_t i = 0; i < x.size(); ++i) x16[i] = f32_to_bf16(x[i]), xv[i] = bf16_to_f32(x16[i]);
    for (auto& name : impls<MatmulBf16Kernels>()) {
      const auto& k = variant<MatmulBf16Kernels>(name);
      ASSERT_TRUE(k.forward_bf16_input && k.backward_bf16_input) << name;
      for (bool acc : {false, true}) {
        std::vector<float> out(N * OC), dinp(N * C, 0.5f), dw(OC * C, 0.25f);
        std::vector<float> out16(N * OC), dinp16(N * C, 0.5f), dw16(OC * C, 0.25f), dw_only(OC * C, 0.25f);
        k.forward(out.data(), xv.data(), w.data(), N, C, OC);
        k.backward(dinp.data(), dw.data(), dout.data(), xv.data(), w.data(), N, C, OC, acc);
        k.forward_bf16_input(out16.data(), x16.data(), w.data(), N, C, OC);
        k.backward_bf16_input(dinp16.data(), dw16.data(), dout.data(), x16.data(), w.data(), N, C, OC, acc);
        k.backward_bf16_input(nullptr, dw_only.data(), dout.data(), x16.data(), w.data(), N, C, OC, acc);
        k.backward_bf16_input(nullptr, nullptr, dout.data(), x16.data(), w.data(), N, C, OC, acc);
        EXPECT_EQ(out16, out) << name;
        EXPECT_EQ(dinp16, dinp) << name;
        EXPECT_EQ(dw16, dw) << name << " accumulate " << acc;
        EXPECT_EQ(dw_only, dw) << name << " accumulate " << acc;
      }
    }
  }
}

// Under bf16 compute the tensors read only by GEMMs and SwiGLU are kept in bf16 (norm outputs, gate/up, the
// SwiGLU output): a GEMM's or RMSNorm's bf16 output is its f32 output rounded (nearest even), and the
// bf16-input forms equal the f32 forms on the same values, bit for bit, in every implementation, so the
// model computes what it computed on f32 buffers of bf16 values.
TEST(Kernels, Bf16ActivationFormsEqualTheF32FormsOfTheSameValues) {
  auto rounded_bits = [](const std::vector<float>& x) {
    std::vector<uint16_t> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) r[i] = f32_to_bf16(x[i]);
    return r;
  };
  for (auto [N, C, OC] : {std::tuple<int64_t, int64_t, int64_t>{7, 13, 11}, {33, 64, 48}}) {
    auto x = randn(N * C, 21), w = randn(OC * C, 22);
    const std::vector<uint16_t> x16 = rounded_bits(x);
    std::vector<float> xv(x.size());
    for (size_t i = 0; i < x.size(); ++i) xv[i] = bf16_to_f32(x16[i]);
    for (auto& name : impls<MatmulBf16Kernels>()) {
      const auto& k = variant<MatmulBf16Kernels>(name);
      ASSERT_TRUE(k.forward_bf16_output && k.forward_bf16_io) << name;
      std::vector<float> out(N * OC), outv(N * OC);
      std::vector<uint16_t> out16(N * OC, 0xffff), io16(N * OC, 0xffff);
      k.forward(out.data(), x.data(), w.data(), N, C, OC);
      k.forward_bf16_output(out16.data(), x.data(), w.data(), N, C, OC);
      EXPECT_EQ(out16, rounded_bits(out)) << name << " " << N << "x" << C << "x" << OC;
      k.forward(outv.data(), xv.data(), w.data(), N, C, OC);
      k.forward_bf16_io(io16.data(), x16.data(), w.data(), N, C, OC);
      EXPECT_EQ(io16, rounded_bits(outv)) << name << " " << N << "x" << C << "x" << OC;
      // backward with a bf16 output gradient: backward_bf16_input on its values
      ASSERT_TRUE(k.backward_bf16_io) << name;
      const std::vector<uint16_t> dout16 = rounded_bits(randn(N * OC, 23));
      std::vector<float> doutv(dout16.size());
      for (size_t i = 0; i < dout16.size(); ++i) doutv[i] = bf16_to_f32(dout16[i]);
      for (bool acc : {false, true}) {
        std::vector<float> dx(N * C, 0.5f), dx16(N * C, 0.5f), dw(OC * C, 0.25f), dw16(OC * C, 0.25f);
        k.backward_bf16_input(dx.data(), dw.data(), doutv.data(), x16.data(), w.data(), N, C, OC, acc);
        k.backward_bf16_io(dx16.data(), dw16.data(), dout16.data(), x16.data(), w.data(), N, C, OC, acc);
        EXPECT_EQ(dx16, dx) << name << " " << N << "x" << C << "x" << OC;
        EXPECT_EQ(dw16, dw) << name << " " << N << "x" << C << "x" << OC;
      }
    }
  }
  for (auto [N, C] : {std::pair<int64_t, int64_t>{9, 37}, {4, 256}}) {
    auto x = randn(N * C, 25), w = randn(C, 26);
    for (auto& name : impls<RmsNormKernels>()) {
      const auto& k = variant<RmsNormKernels>(name);
      ASSERT_TRUE(k.forward_bf16_output && k.forward_bf16_input && k.backward_bf16_input) << name;
      std::vector<float> out(N * C), rstd(N), rstd16(N, -1.0f);
      std::vector<uint16_t> out16(N * C, 0xffff);
      k.forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-6f);
      k.forward_bf16_output(out16.data(), rstd16.data(), x.data(), w.data(), N, C, 1e-6f);
      EXPECT_EQ(out16, rounded_bits(out)) << name << " " << N << "x" << C;
      EXPECT_EQ(rstd16, rstd) << name;
      // bf16 input (rows of an odd width start off any vector alignment)
      const std::vector<uint16_t> x16 = rounded_bits(x);
      std::vector<float> xv(x.size());
      for (size_t i = 0; i < x.size(); ++i) xv[i] = bf16_to_f32(x16[i]);
      auto dout = randn(N * C, 27);
      for (bool with_dw : {false, true}) {
        std::vector<float> o(N * C), o16in(N * C), r(N), r16(N), d(N * C, 0.5f), d16(N * C, 0.5f),
            dw(C, 0.25f), dw16(C, 0.25f);
        k.forward(o.data(), r.data(), xv.data(), w.data(), N, C, 1e-6f);
        k.forward_bf16_input(o16in.data(), r16.data(), x16.data(), w.data(), N, C, 1e-6f);
        EXPECT_EQ(o16in, o) << name << " " << N << "x" << C;
        EXPECT_EQ(r16, r) << name;
        // both bf16 (the bf16 residual stream into a bf16 norm output)
        ASSERT_TRUE(k.forward_bf16_io) << name;
        std::vector<uint16_t> io16(N * C, 0xffff);
        std::vector<float> rio(N, -1.0f);
        k.forward_bf16_io(io16.data(), rio.data(), x16.data(), w.data(), N, C, 1e-6f);
        EXPECT_EQ(io16, rounded_bits(o)) << name << " " << N << "x" << C;
        EXPECT_EQ(rio, r) << name;
        k.backward(d.data(), with_dw ? dw.data() : nullptr, dout.data(), xv.data(), w.data(), r.data(), N, C);
        k.backward_bf16_input(d16.data(), with_dw ? dw16.data() : nullptr, dout.data(), x16.data(), w.data(),
                              r.data(), N, C);
        EXPECT_EQ(d16, d) << name << " " << N << "x" << C;
        EXPECT_EQ(dw16, dw) << name << " " << N << "x" << C;
      }
    }
  }
  for (auto [N, I] : {std::pair<int64_t, int64_t>{10, 37}, {5, 64}}) {
    auto gu = randn(N * 2 * I, 23), dout = randn(N * I, 24);
    std::vector<uint16_t> gu16(gu.size());
    std::vector<float> guv(gu.size());
    for (size_t i = 0; i < gu.size(); ++i) gu16[i] = f32_to_bf16(3.0f * gu[i]), guv[i] = bf16_to_f32(gu16[i]);
    for (auto& name : impls<SwigluKernels>()) {
      const auto& k = variant<SwigluKernels>(name);
      ASSERT_TRUE(k.forward_bf16 && k.backward_bf16) << name;
      std::vector<float> o(N * I), d(N * 2 * I, 0.2f), d16(N * 2 * I, 0.2f);
      std::vector<uint16_t> want(N * I), o16(N * I, 0xffff);
      k.forward(o.data(), guv.data(), N, I);
      for (int64_t i = 0; i < N * I; ++i) want[i] = f32_to_bf16(o[i]);
      k.forward_bf16(o16.data(), gu16.data(), N, I);
      EXPECT_EQ(o16, want) << name << " N " << N << " I " << I;
      k.backward(d.data(), dout.data(), guv.data(), N, I);
      k.backward_bf16(d16.data(), dout.data(), gu16.data(), N, I);
      EXPECT_EQ(d16, d) << name << " N " << N << " I " << I;
      // d(gate/up) written as bf16: backward_bf16 into zeros, rounded
      ASSERT_TRUE(k.backward_bf16_output) << name;
      std::vector<float> z(N * 2 * I, 0.0f);
      std::vector<uint16_t> dz16(N * 2 * I, 0xffff);
      k.backward_bf16(z.data(), dout.data(), gu16.data(), N, I);
      k.backward_bf16_output(dz16.data(), dout.data(), gu16.data(), N, I);
      EXPECT_EQ(dz16, rounded_bits(z)) << name << " N " << N << " I " << I;
    }
  }
}

// A registered bf16 image of a weight range is what the engines read instead of converting the weight:
// the results are bit-identical to converting, for a weight inside the range too; after unregistering,
// the weight is converted again.
TEST(Kernels, MatmulBf16ReadsRegisteredWeightImages) {
  const int64_t N = 9, C = 32, OC = 24;
  auto inp = randn(N * C, 7), big = randn(3 * OC * C, 8), dout = randn(N * OC, 9);
  std::vector<uint16_t> image(big.size());
  for (size_t i = 0; i < big.size(); ++i) image[i] = f32_to_bf16(big[i]);
  const float* w = big.data() + OC * C;  // the middle weight of three
  EXPECT_EQ(find_bf16_image(w, OC * C), nullptr);
  for (auto& name : impls<MatmulBf16Kernels>()) {
    const auto& k = variant<MatmulBf16Kernels>(name);
    std::vector<float> out(N * OC), dinp(N * C, 0.5f), out_i(N * OC), dinp_i(N * C, 0.5f);
    k.forward(out.data(), inp.data(), w, N, C, OC);
    k.backward(dinp.data(), nullptr, dout.data(), inp.data(), w, N, C, OC, true);
    register_bf16_image(big.data(), static_cast<int64_t>(big.size()), image.data());
    ASSERT_EQ(find_bf16_image(w, OC * C), image.data() + OC * C);
    k.forward(out_i.data(), inp.data(), w, N, C, OC);
    k.backward(dinp_i.data(), nullptr, dout.data(), inp.data(), w, N, C, OC, true);
    unregister_bf16_image(big.data());
    EXPECT_EQ(out, out_i) << name;
    EXPECT_EQ(dinp, dinp_i) << name;
  }
  EXPECT_EQ(find_bf16_image(w, OC * C), nullptr);
  // A range reaching past the registered one is not served from it.
  register_bf16_image(big.data(), OC * C, image.data());
  EXPECT_EQ(find_bf16_image(big.data() + 1, OC * C), nullptr);
  unregister_bf16_image(big.data());
}

TEST(Kernels, RmsNormAllImplementations) {
  const int64_t N = 9, C = 33;
  auto inp = randn(N * C, 4), w = randn(C, 5), dout = randn(N * C, 6);
  const auto& ref = get_kernel<RmsNormKernels>(DeviceType::CPU, "reference");
  std::vector<float> out_r(N * C), rstd_r(N), dinp_r(N * C, 0.1f), dw_r(C, 0.2f);
  ref.forward(out_r.data(), rstd_r.data(), inp.data(), w.data(), N, C, 1e-6f);
  ref.backward(dinp_r.data(), dw_r.data(), dout.data(), inp.data(), w.data(), rstd_r.data(), N, C);
  for (auto& name : impls<RmsNormKernels>()) {
    const auto& k = variant<RmsNormKernels>(name);
    std::vector<float> out(N * C), rstd(N), dinp(N * C, 0.1f), dw(C, 0.2f);
    k.forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, 1e-6f);
    k.backward(dinp.data(), dw.data(), dout.data(), inp.data(), w.data(), rstd.data(), N, C);
    EXPECT_LE(rel(out, out_r), kTol) << name;
    EXPECT_LE(rel(dinp, dinp_r), kTol) << name;
    EXPECT_LE(rel(dw, dw_r), kTol) << name;
  }
}

TEST(Kernels, RopeAllImplementations) {
  const int64_t B = 2, T = 5, nh = 3, hd = 8, N = B * T;
  auto inp = randn(N * nh * hd, 7), dout = randn(N * nh * hd, 8);
  std::vector<float> cos(T * hd / 2), sin(T * hd / 2);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < hd / 2; ++i)
      cos[t * hd / 2 + i] = std::cos(t * 0.3f / (i + 1)), sin[t * hd / 2 + i] = std::sin(t * 0.3f / (i + 1));
  const auto& ref = get_kernel<RopeKernels>(DeviceType::CPU, "reference");
  std::vector<float> out_r(inp.size()), din_r(inp.size(), 0.3f);
  ref.forward(out_r.data(), inp.data(), cos.data(), sin.data(), N, T, nh, hd);
  ref.backward(din_r.data(), dout.data(), cos.data(), sin.data(), N, T, nh, hd);
  for (auto& name : impls<RopeKernels>()) {
    const auto& k = variant<RopeKernels>(name);
    std::vector<float> out(inp.size()), din(inp.size(), 0.3f), inplace = inp;
    k.forward(out.data(), inp.data(), cos.data(), sin.data(), N, T, nh, hd);
    k.forward(inplace.data(), inplace.data(), cos.data(), sin.data(), N, T, nh, hd);  // aliasing allowed
    k.backward(din.data(), dout.data(), cos.data(), sin.data(), N, T, nh, hd);
    EXPECT_LE(rel(out, out_r), kTol) << name;
    EXPECT_LE(rel(inplace, out_r), kTol) << name;
    EXPECT_LE(rel(din, din_r), kTol) << name;
  }
}

// Every implementation against the reference, forward and backward; `saved` is sized by each implementation.
// docs (B*T doc_start, optional): packed rows.
void check_attention_all(int64_t B, int64_t T, int64_t nH, int64_t nKV, int64_t hd, uint64_t seed,
                         const std::vector<int32_t>& docs = {}) {
  const int32_t* doc_start = docs.empty() ? nullptr : docs.data();
  auto q = randn(B * T * nH * hd, seed), k = randn(B * T * nKV * hd, seed + 1),
       v = randn(B * T * nKV * hd, seed + 2), dout = randn(B * T * nH * hd, seed + 3);
  const auto& ref = get_kernel<AttentionKernels>(DeviceType::CPU, "reference");
  std::vector<float> out_r(q.size()), p_r(ref.saved_floats(B, T, nH)), dq_r(q.size(), 0.1f),
      dk_r(k.size(), 0.1f), dv_r(v.size(), 0.1f);
  ref.forward(out_r.data(), p_r.data(), q.data(), k.data(), v.data(), B, T, nH, nKV, hd, doc_start);
  ref.backward(dq_r.data(), dk_r.data(), dv_r.data(), dout.data(), q.data(), k.data(), v.data(), out_r.data(),
               p_r.data(), B, T, nH, nKV, hd, doc_start);
  for (auto& name : impls<AttentionKernels>()) {
    const auto& kk = variant<AttentionKernels>(name);
    std::vector<float> out(q.size(), 7.0f), p(kk.saved_floats(B, T, nH)), dq(q.size(), 0.1f),
        dk(k.size(), 0.1f), dv(v.size(), 0.1f);
    kk.forward(out.data(), p.data(), q.data(), k.data(), v.data(), B, T, nH, nKV, hd, doc_start);
    kk.backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(), out.data(),
                p.data(), B, T, nH, nKV, hd, doc_start);
    EXPECT_LE(rel(out, out_r), kTol) << name << " T=" << T;
    EXPECT_LE(rel(dq, dq_r), kTol) << name << " T=" << T;
    EXPECT_LE(rel(dk, dk_r), kTol) << name << " T=" << T;
    EXPECT_LE(rel(dv, dv_r), kTol) << name << " T=" << T;
  }
}

TEST(Kernels, AttentionAllImplementations) {
  check_attention_all(2, 6, 4, 2, 5, 9);
}

// Sequences longer than one tile of the tiled implementations (64), not a multiple of it, GQA 4, MHA.
TEST(Kernels, AttentionAllImplementationsMultiBlock) {
  check_attention_all(1, 150, 4, 1, 16, 60);
  check_attention_all(2, 129, 2, 2, 32, 70);
}

// Packed rows: the reference with a document mask equals each document run as its own sequence, and every
// implementation equals the reference, across tile boundaries (64 / 128) and with one-token documents.
TEST(Kernels, AttentionDocumentMaskIsSeparateSequences) {
  const int64_t T = 40, nH = 4, nKV = 2, hd = 8;
  const std::vector<std::vector<int32_t>> rows = {{7, 1, 20, 12}, {40}};
  const int64_t B = static_cast<int64_t>(rows.size());
  const auto docs = doc_starts(rows, T);
  auto q = randn(B * T * nH * hd, 81), k = randn(B * T * nKV * hd, 82), v = randn(B * T * nKV * hd, 83),
       dout = randn(B * T * nH * hd, 84);
  const auto& ref = get_kernel<AttentionKernels>(DeviceType::CPU, "reference");
  std::vector<float> out(q.size()), p(ref.saved_floats(B, T, nH)), dq(q.size()), dk(k.size()), dv(v.size());
  ref.forward(out.data(), p.data(), q.data(), k.data(), v.data(), B, T, nH, nKV, hd, docs.data());
  ref.backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(), out.data(),
               p.data(), B, T, nH, nKV, hd, docs.data());
  for (int64_t b = 0; b < B; ++b) {
    int64_t t0 = 0;
    for (int32_t len : rows[b]) {
      // The document alone: rows [t0, t0 + len) of row b, as a batch of one sequence.
      auto slice = [&](const std::vector<float>& x, int64_t heads) {
        const auto first = x.begin() + (b * T + t0) * heads * hd;
        return std::vector<float>(first, first + len * heads * hd);
      };
      const auto qs = slice(q, nH), ks = slice(k, nKV), vs = slice(v, nKV), dos = slice(dout, nH);
      std::vector<float> o1(qs.size()), p1(ref.saved_floats(1, len, nH)), dq1(qs.size()), dk1(ks.size()),
          dv1(vs.size());
      ref.forward(o1.data(), p1.data(), qs.data(), ks.data(), vs.data(), 1, len, nH, nKV, hd, nullptr);
      ref.backward(dq1.data(), dk1.data(), dv1.data(), dos.data(), qs.data(), ks.data(), vs.data(), o1.data(),
                   p1.data(), 1, len, nH, nKV, hd, nullptr);
      EXPECT_LE(rel(slice(out, nH), o1), 1e-7) << "row " << b << " doc at " << t0;
      EXPECT_LE(rel(slice(dq, nH), dq1), 1e-7) << "row " << b << " doc at " << t0;
      EXPECT_LE(rel(slice(dk, nKV), dk1), 1e-7) << "row " << b << " doc at " << t0;
      EXPECT_LE(rel(slice(dv, nKV), dv1), 1e-7) << "row " << b << " doc at " << t0;
      t0 += len;
    }
  }
  check_attention_all(B, T, nH, nKV, hd, 85, docs);
  check_attention_all(2, 150, 4, 1, 16, 86, doc_starts({{5, 70, 1, 74}, {130, 20}}, 150));
  check_attention_all(1, 300, 2, 2, 32, 87, doc_starts({{1, 128, 127, 1, 43}}, 300));
}

// attention_bf16: every implementation on a fused, padded QKV layout against the f32 reference of the bf16
// values (tests/support/attention_bf16_case.h): causal with GQA and MHA, packed documents, odd lengths.
TEST(Kernels, AttentionBf16MatchesReference) {
  for (auto& name : impls<AttentionBf16Kernels>()) {
    const auto& k = variant<AttentionBf16Kernels>(name);
    for (const auto& c :
         {testing::AttentionBf16Case(2, 37, 4, 2, 64, 300), testing::AttentionBf16Case(1, 70, 3, 3, 32, 310),
          testing::AttentionBf16Case(2, 50, 4, 1, 8, 320, doc_starts({{1, 20, 29}, {2, 48}}, 50))}) {
      const int64_t N = c.s.B * c.s.T, qw = c.s.nH * c.s.hd, kw = c.s.nKV * c.s.hd;
      std::vector<uint16_t> out(N * c.s.ldo, c.kSentinel), dqkv(N * c.s.ldq, c.kSentinel);
      std::vector<float> lse(c.lse.size());
      const uint16_t* qkv = c.qkv.data();
      k.forward(out.data(), lse.data(), qkv, qkv + qw, qkv + qw + kw, c.s, c.docs());
      k.backward(dqkv.data(), dqkv.data() + qw, dqkv.data() + qw + kw, c.dout.data(), qkv, qkv + qw,
                 qkv + qw + kw, out.data(), lse.data(), c.s, c.docs());
      for (auto& f : c.failures(out, lse, dqkv)) ADD_FAILURE() << name << " T=" << c.s.T << ": " << f;
    }
  }
}

// Ring attention (context parallel) against whole-sequence attention: a sequence of T tokens (zero-padded to
// a multiple of 2 S) split over S ranks as two mirrored chunks each; every rank runs its queries against each
// rank's keys and values (forward block by block, merged) and the backward of each block from the merged
// output. Every rank's rows of the output and of dq, and the sum over ranks of each rank's dk / dv, equal
// the whole sequence's attention (the reference kernel), for every implementation of attention_ring.
void check_ring_attention(int64_t B, int64_t T, int64_t S, int64_t nH, int64_t nKV, int64_t hd, uint64_t seed,
                          const std::vector<int32_t>& docs = {}) {
  const int64_t Tp = (T + 2 * S - 1) / (2 * S) * (2 * S), c = Tp / (2 * S), Tl = 2 * c;
  auto pad = [&](const std::vector<float>& x, int64_t heads) {
    std::vector<float> y(B * Tp * heads * hd, 0.0f);
    for (int64_t b = 0; b < B; ++b)
      std::copy_n(x.begin() + b * T * heads * hd, T * heads * hd, y.begin() + b * Tp * heads * hd);
    return y;
  };
  const auto q = pad(randn(B * T * nH * hd, seed), nH), k = pad(randn(B * T * nKV * hd, seed + 1), nKV),
             v = pad(randn(B * T * nKV * hd, seed + 2), nKV),
             dout = pad(randn(B * T * nH * hd, seed + 3), nH);
  std::vector<int32_t> start;  // padded rows: a padding token reads itself and the tokens before it
  if (!docs.empty())
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tp; ++t) start.push_back(t < T ? docs[b * T + t] : docs[b * T + T - 1]);
  const int32_t* doc_start = start.empty() ? nullptr : start.data();
  const auto& ref = get_kernel<AttentionKernels>(DeviceType::CPU, "reference");
  std::vector<float> out(q.size()), p(ref.saved_floats(B, Tp, nH)), dq(q.size()), dk(k.size()), dv(v.size());
  ref.forward(out.data(), p.data(), q.data(), k.data(), v.data(), B, Tp, nH, nKV, hd, doc_start);
  ref.backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(), out.data(),
               p.data(), B, Tp, nH, nKV, hd, doc_start);
  // Rank r's rows: chunks r and 2S - 1 - r.
  auto pos = [&](int64_t r) {
    std::vector<int32_t> ps(Tl);
    for (int64_t t = 0; t < Tl; ++t) ps[t] = static_cast<int32_t>((t < c ? r : 2 * S - 1 - r) * c + t % c);
    return ps;
  };
  auto rows_of = [&](const std::vector<float>& x, int64_t heads, int64_t r) {
    const auto ps = pos(r);
    std::vector<float> y(B * Tl * heads * hd);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tl; ++t)
        std::copy_n(x.begin() + (b * Tp + ps[t]) * heads * hd, heads * hd,
                    y.begin() + (b * Tl + t) * heads * hd);
    return y;
  };
  for (auto& name : impls<AttentionRingKernels>()) {
    const auto& ring = variant<AttentionRingKernels>(name);
    std::vector<std::vector<float>> o(S), lse(S), dqs(S), dks(S), dvs(S);
    for (int64_t r = 0; r < S; ++r) {
      const auto qp = pos(r);
      const auto ql = rows_of(q, nH, r);
      std::vector<int32_t> ks;
      for (int64_t b = 0; doc_start && b < B; ++b)
        for (int32_t t : qp) ks.push_back(doc_start[b * Tp + t]);
      o[r].assign(ql.size(), 7.0f), lse[r].assign(B * nH * Tl, 7.0f);
      std::vector<float> po(ql.size()), pl(B * nH * Tl);
      for (int64_t s = 0; s < S; ++s) {  // the ring order: the rank's own block first
        const int64_t src = (r - s + S) % S;
        const auto kp = pos(src);
        const auto kl = rows_of(k, nKV, src), vl = rows_of(v, nKV, src);
        float *oo = s == 0 ? o[r].data() : po.data(), *ll = s == 0 ? lse[r].data() : pl.data();
        ring.forward(oo, ll, ql.data(), kl.data(), vl.data(), B, Tl, Tl, nH, nKV, hd, qp.data(), kp.data(),
                     ks.empty() ? nullptr : ks.data());
        if (s > 0) ring.merge(o[r].data(), lse[r].data(), po.data(), pl.data(), B, Tl, nH, hd);
      }
      EXPECT_LE(rel(o[r], rows_of(out, nH, r)), kTol) << name << " rank " << r << " T=" << T;
    }
    for (int64_t r = 0; r < S; ++r) dqs[r].assign(B * Tl * nH * hd, 0.0f);
    for (int64_t r = 0; r < S; ++r)
      dks[r].assign(B * Tl * nKV * hd, 0.0f), dvs[r].assign(B * Tl * nKV * hd, 0.0f);
    for (int64_t r = 0; r < S; ++r) {
      const auto qp = pos(r);
      const auto ql = rows_of(q, nH, r), dol = rows_of(dout, nH, r);
      std::vector<int32_t> ks;
      for (int64_t b = 0; doc_start && b < B; ++b)
        for (int32_t t : qp) ks.push_back(doc_start[b * Tp + t]);
      for (int64_t src = 0; src < S; ++src)
        ring.backward(dqs[r].data(), dks[src].data(), dvs[src].data(), dol.data(), ql.data(),
                      rows_of(k, nKV, src).data(), rows_of(v, nKV, src).data(), o[r].data(), lse[r].data(), B,
                      Tl, Tl, nH, nKV, hd, qp.data(), pos(src).data(), ks.empty() ? nullptr : ks.data());
    }
    for (int64_t r = 0; r < S; ++r) {
      EXPECT_LE(rel(dqs[r], rows_of(dq, nH, r)), kTol) << name << " rank " << r << " T=" << T;
      EXPECT_LE(rel(dks[r], rows_of(dk, nKV, r)), kTol) << name << " rank " << r << " T=" << T;
      EXPECT_LE(rel(dvs[r], rows_of(dv, nKV, r)), kTol) << name << " rank " << r << " T=" << T;
    }
  }
}

TEST(Kernels, RingAttentionEqualsWholeSequence) {
  check_ring_attention(2, 13, 2, 4, 2, 8, 200);    // padded 13 -> 16, chunks of 4
  check_ring_attention(1, 150, 4, 4, 1, 16, 210);  // padded to 152, chunks of 19 across 64-row tiles
  check_ring_attention(1, 600, 2, 2, 2, 32, 220);  // chunks of 150: several tiles per block
  check_ring_attention(2, 90, 3, 4, 2, 8, 230, doc_starts({{5, 40, 1, 44}, {90}}, 90));  // packed documents
}

// The tiled implementation saves O(T) floats per head (row logsumexp), not the [T,T] probabilities.
TEST(Kernels, FlashAttentionSavesNoTxTMatrix) {
  const auto& flash = get_kernel<AttentionKernels>(DeviceType::CPU, "flash");
  EXPECT_EQ(flash.saved_floats(2, 4096, 16), int64_t(2) * 16 * 4096);
  // The default is a tiled one: on oneDNN's sgemm where built, else on BLAS.
  const auto names = KernelRegistry::global().impls("attention", DeviceType::CPU);
  const bool onednn = std::find(names.begin(), names.end(), "flash_onednn") != names.end();
  EXPECT_EQ(KernelRegistry::global().default_impl("attention", DeviceType::CPU),
            onednn ? "flash_onednn" : "flash");
}

TEST(Kernels, SwigluEmbeddingCrossEntropyAdamWAllImplementations) {
  const int64_t N = 10, I = 7, C = 6, V = 12;
  auto gu = randn(N * 2 * I, 13), dout = randn(N * I, 14);
  const auto& sref = get_kernel<SwigluKernels>(DeviceType::CPU, "reference");
  std::vector<float> o_r(N * I), d_r(N * 2 * I, 0.2f);
  sref.forward(o_r.data(), gu.data(), N, I);
  sref.backward(d_r.data(), dout.data(), gu.data(), N, I);
  for (auto& name : impls<SwigluKernels>()) {
    const auto& k = variant<SwigluKernels>(name);
    std::vector<float> o(N * I), d(N * 2 * I, 0.2f);
    k.forward(o.data(), gu.data(), N, I);
    k.backward(d.data(), dout.data(), gu.data(), N, I);
    EXPECT_LE(rel(o, o_r), kTol) << name;
    EXPECT_LE(rel(d, d_r), kTol) << name;
  }
  std::vector<int32_t> ids = {3, 1, 3, 0, 11, -1, 7, 1, 0, 2};  // -1: a row another rank holds
  auto table = randn(V * C, 15), demb = randn(N * C, 16);
  const auto& eref = get_kernel<EmbeddingKernels>(DeviceType::CPU, "reference");
  std::vector<float> e_r(N * C), de_r(V * C, 0.5f);
  eref.forward(e_r.data(), ids.data(), table.data(), N, C);
  eref.backward(de_r.data(), demb.data(), ids.data(), N, C, V);
  for (int64_t c = 0; c < C; ++c) {
    EXPECT_EQ(e_r[5 * C + c], 0.0f);
    EXPECT_EQ(e_r[6 * C + c], table[7 * C + c]);
    EXPECT_EQ(de_r[7 * C + c], 0.5f + demb[6 * C + c]);
  }
  for (auto& name : impls<EmbeddingKernels>()) {
    const auto& k = variant<EmbeddingKernels>(name);
    std::vector<float> e(N * C), de(V * C, 0.5f);
    k.forward(e.data(), ids.data(), table.data(), N, C);
    k.backward(de.data(), demb.data(), ids.data(), N, C, V);
    EXPECT_LE(rel(e, e_r), kTol) << name;
    EXPECT_LE(rel(de, de_r), kTol) << name;
  }
  std::vector<int32_t> targets = {3, -1, 0, 11, 5, -1, 2, 2, 9, 1};
  auto logits = randn(N * V, 17, 3.0f);
  const auto& cref = get_kernel<CrossEntropyKernels>(DeviceType::CPU, "reference");
  auto g_r = logits;
  double l_r = cref.forward_backward(g_r.data(), targets.data(), N, V, 0.125f, true);
  for (auto& name : impls<CrossEntropyKernels>()) {
    auto g = logits;
    double l =
        variant<CrossEntropyKernels>(name).forward_backward(g.data(), targets.data(), N, V, 0.125f, true);
    EXPECT_NEAR(l, l_r, 1e-5 * std::abs(l_r)) << name;
    EXPECT_LE(rel(g, g_r), kTol) << name;
    // The device-scalar form adds exactly the returned sum and leaves the same gradient.
    auto g2 = logits;
    double sum = 0.5;
    const float scale = 0.125f;
    variant<CrossEntropyKernels>(name).forward_backward_device(&sum, g2.data(), targets.data(), N, V, &scale,
                                                               true);
    EXPECT_EQ(sum, 0.5 + l) << name;
    EXPECT_EQ(g2, g) << name;
  }
  // AdamW: every implementation against the reference; the fused clip scale (grad_scale) against a
  // step on gradients scaled beforehand, and a scale of 1 leaves the gradients as they are.
  auto p0 = randn(50, 18), grad = randn(50, 19);
  const auto& aref = get_kernel<AdamWKernels>(DeviceType::CPU, "reference");
  const float clip = 0.375f;
  std::vector<float> p_r = p0, m_r(50, 0), v_r(50, 0), grad_clipped = grad;
  for (auto& x : grad_clipped) x *= clip;
  for (int s = 1; s <= 3; ++s)
    aref.step(p_r.data(), grad_clipped.data(), m_r.data(), v_r.data(), 50, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f,
              s, 1.0f);
  for (auto& name : impls<AdamWKernels>()) {
    std::vector<float> p = p0, m(50, 0), v(50, 0), g = grad;
    for (int s = 1; s <= 3; ++s)
      variant<AdamWKernels>(name).step(p.data(), g.data(), m.data(), v.data(), 50, 1e-2f, 0.9f, 0.999f, 1e-8f,
                                       0.1f, s, clip);
    EXPECT_LE(rel(p, p_r), kTol) << name;
    EXPECT_LE(rel(m, m_r), kTol) << name;
    EXPECT_EQ(g, grad) << name << ": the gradient buffer was written";
    // The device-scalar forms (compile mode): the staged scalars and the clip from a sum of squares give the
    // same bits as step() with the host's clip_scale; sum_squares_device adds exactly the returned sum.
    std::vector<float> p2 = p0, m2(50, 0), v2(50, 0), p3 = p0, m3(50, 0), v3(50, 0);
    const double sq =
        0.5 + variant<SumSquaresKernels>(name == "fast" ? "fast" : "reference").sum_squares(g.data(), 50);
    double acc = 0.5;
    variant<SumSquaresKernels>(name == "fast" ? "fast" : "reference").sum_squares_device(&acc, g.data(), 50);
    EXPECT_EQ(acc, sq) << name;
    for (int s = 1; s <= 3; ++s) {
      const AdamWStepScalars st = adamw_step_scalars(1e-2f * s, 0.9f, 0.999f, 0.1f, s);
      variant<AdamWKernels>(name).step_device(p2.data(), g.data(), m2.data(), v2.data(), 50, 0.9f, 0.999f,
                                              1e-8f, 0.1f, &st, &acc, 0.25f);
      variant<AdamWKernels>(name).step(p3.data(), g.data(), m3.data(), v3.data(), 50, 1e-2f * s, 0.9f, 0.999f,
                                       1e-8f, 0.1f, s, clip_scale(acc, 0.25f));
    }
    EXPECT_LT(clip_scale(acc, 0.25f), 1.0f);
    EXPECT_EQ(p2, p3) << name;
    EXPECT_EQ(v2, v3) << name;
    // A staged step with non-finite losses counted (training.skip_nan_inf) leaves everything as it is.
    AdamWStepScalars skipped = adamw_step_scalars(1e-2f, 0.9f, 0.999f, 0.1f, 4);
    skipped.nonfinite = 1;
    const auto p4 = p2, m4 = m2, v4 = v2;
    variant<AdamWKernels>(name).step_device(p2.data(), g.data(), m2.data(), v2.data(), 50, 0.9f, 0.999f,
                                            1e-8f, 0.1f, &skipped, &acc, 0.25f);
    EXPECT_EQ(p2, p4) << name;
    EXPECT_EQ(m2, m4) << name;
    EXPECT_EQ(v2, v4) << name;
  }
  // count_nonfinite adds how many values are NaN or infinite.
  for (auto& name : impls<SumSquaresKernels>()) {
    const std::vector<double> x = {1.0, std::nan(""), -INFINITY, 1e308, INFINITY, -0.0};
    double count = 2;
    variant<SumSquaresKernels>(name).count_nonfinite(&count, x.data(), 6);
    EXPECT_EQ(count, 5.0) << name;
  }
}

// Central finite differences of a scalar loss L = sum(out * dout) through the reference forward.
double fd_check(std::vector<float>& x, const std::vector<float>& analytic,
                const std::function<double()>& loss) {
  double worst = 0;
  for (size_t i = 0; i < x.size(); i += std::max<size_t>(1, x.size() / 23)) {
    const float h = 1e-2f, saved = x[i];
    x[i] = saved + h;
    double lp = loss();
    x[i] = saved - h;
    double lm = loss();
    x[i] = saved;
    double num = (lp - lm) / (2 * h);
    worst = std::max(worst, std::abs(num - analytic[i]) / std::max(1.0, std::abs(num)));
  }
  return worst;
}

TEST(Kernels, ReferenceBackwardMatchesFiniteDifferences) {
  const int64_t B = 1, T = 5, nH = 2, nKV = 1, hd = 4, N = B * T, C = 8;
  // Attention: gradient w.r.t. q, k, v.
  auto q = randn(N * nH * hd, 20), k = randn(N * nKV * hd, 21), v = randn(N * nKV * hd, 22),
       dout = randn(N * nH * hd, 23);
  const auto& att = get_kernel<AttentionKernels>(DeviceType::CPU, "reference");
  std::vector<float> out(q.size()), p(B * nH * T * T), dq(q.size()), dk(k.size()), dv(v.size());
  att.forward(out.data(), p.data(), q.data(), k.data(), v.data(), B, T, nH, nKV, hd, nullptr);
  att.backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(), out.data(),
               p.data(), B, T, nH, nKV, hd, nullptr);
  auto att_loss = [&] {
    att.forward(out.data(), p.data(), q.data(), k.data(), v.data(), B, T, nH, nKV, hd, nullptr);
    double s = 0;
    for (size_t i = 0; i < out.size(); ++i) s += double(out[i]) * dout[i];
    return s;
  };
  EXPECT_LE(fd_check(q, dq, att_loss), 2e-3);
  EXPECT_LE(fd_check(k, dk, att_loss), 2e-3);
  EXPECT_LE(fd_check(v, dv, att_loss), 2e-3);
  // RMSNorm: input and weight.
  auto x = randn(N * C, 24), w = randn(C, 25), dy = randn(N * C, 26);
  const auto& rn = get_kernel<RmsNormKernels>(DeviceType::CPU, "reference");
  std::vector<float> y(N * C), rstd(N), dx(N * C), dw(C);
  rn.forward(y.data(), rstd.data(), x.data(), w.data(), N, C, 1e-6f);
  rn.backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
  auto rn_loss = [&] {
    rn.forward(y.data(), rstd.data(), x.data(), w.data(), N, C, 1e-6f);
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += double(y[i]) * dy[i];
    return s;
  };
  EXPECT_LE(fd_check(x, dx, rn_loss), 2e-3);
  EXPECT_LE(fd_check(w, dw, rn_loss), 2e-3);
  // SwiGLU.
  auto gu = randn(N * 2 * C, 27), ds = randn(N * C, 28);
  const auto& sw = get_kernel<SwigluKernels>(DeviceType::CPU, "reference");
  std::vector<float> so(N * C), dgu(N * 2 * C);
  sw.backward(dgu.data(), ds.data(), gu.data(), N, C);
  auto sw_loss = [&] {
    sw.forward(so.data(), gu.data(), N, C);
    double s = 0;
    for (size_t i = 0; i < so.size(); ++i) s += double(so[i]) * ds[i];
    return s;
  };
  EXPECT_LE(fd_check(gu, dgu, sw_loss), 2e-3);
  // Cross-entropy with an ignored row.
  std::vector<int32_t> tg = {1, -1, 3, 0, 2};
  auto lg = randn(N * C, 29);
  const auto& ce = get_kernel<CrossEntropyKernels>(DeviceType::CPU, "reference");
  auto g = lg;
  ce.forward_backward(g.data(), tg.data(), N, C, 1.0f, true);
  auto ce_loss = [&] {
    auto tmp = lg;
    return ce.forward_backward(tmp.data(), tg.data(), N, C, 1.0f, false);
  };
  EXPECT_LE(fd_check(lg, g, ce_loss), 2e-3);
}

// MoE experts: the shared case (support/moe_case.h) at a small shape.
using testing::MoeCase;
MoeCase small_moe_case() {
  return MoeCase(23, 3, 6, 10, 7, 40);
}

TEST(Kernels, MoeExpertsAllImplementations) {
  const MoeCase c = small_moe_case();
  const int64_t N = c.N, k = c.k, E = c.E, H = c.H, I = c.I, R = c.R();
  auto x = c.x, wgu = c.wgu, wdown = c.wdown, w = c.w;  // perturbed by the finite differences below
  const auto& dout = c.dout;
  const auto& idx = c.idx;
  const auto want = c.run(get_kernel<MoeExpertsKernels>(DeviceType::CPU, "reference"));
  ASSERT_GE(impls<MoeExpertsKernels>().size(), 2u);
  for (auto& name : impls<MoeExpertsKernels>())
    MoeCase::expect_near(c.run(variant<MoeExpertsKernels>(name)), want, kTol, name);
  // Reference backward against finite differences of L = sum(out * dout).
  const auto& ref = get_kernel<MoeExpertsKernels>(DeviceType::CPU, "reference");
  std::vector<float> gu(R * 2 * I), act(R * I), scratch(moe_experts_scratch_floats(N, k, H, I)), out(N * H);
  std::vector<int32_t> order(R), row_of(R), offsets(E + 1);
  MoeExpertsBuffers buf{gu.data(), act.data(), order.data(), row_of.data(), offsets.data(), scratch.data()};
  std::vector<float> dx(N * H, 0), dw(R, 0), dwgu(wgu.size(), 0), dwdown(wdown.size(), 0);
  ref.forward(out.data(), buf, x.data(), idx.data(), w.data(), wgu.data(), wdown.data(), N, k, E, H, I);
  ref.backward(dx.data(), dw.data(), dwgu.data(), dwdown.data(), buf, dout.data(), x.data(), idx.data(),
               w.data(), wgu.data(), wdown.data(), N, k, E, H, I);
  auto loss = [&] {
    ref.forward(out.data(), buf, x.data(), idx.data(), w.data(), wgu.data(), wdown.data(), N, k, E, H, I);
    double s = 0;
    for (size_t i = 0; i < out.size(); ++i) s += double(out[i]) * dout[i];
    return s;
  };
  EXPECT_LE(fd_check(x, dx, loss), 2e-3);
  EXPECT_LE(fd_check(w, dw, loss), 2e-3);
  EXPECT_LE(fd_check(wgu, dwgu, loss), 2e-3);
  EXPECT_LE(fd_check(wdown, dwdown, loss), 2e-3);
}

// bf16 routed experts: every engine equals its oracle (the same pipeline on bf16-rounded GEMM operands with
// double accumulation), which is within bf16 rounding of the f32 experts; a registered bf16 image of the
// expert weights gives the same result as converting them.
TEST(Kernels, MoeExpertsBf16AllImplementations) {
  const MoeCase c = small_moe_case();
  const auto want = c.run(get_kernel<MoeExpertsBf16Kernels>(DeviceType::CPU, "reference"));
  for (auto& name : impls<MoeExpertsBf16Kernels>())
    MoeCase::expect_near(c.run(variant<MoeExpertsBf16Kernels>(name)), want, kTol, name);
  const auto f32 = c.run(get_kernel<MoeExpertsKernels>(DeviceType::CPU, "reference"));
  MoeCase::expect_near(want, f32, 2e-2, "bf16 oracle vs f32");
  EXPECT_GT(rel(want.out, f32.out), 0.0);  // really rounded
  std::vector<uint16_t> gu_image(c.wgu.size()), down_image(c.wdown.size());
  for (size_t i = 0; i < c.wgu.size(); ++i) gu_image[i] = f32_to_bf16(c.wgu[i]);
  for (size_t i = 0; i < c.wdown.size(); ++i) down_image[i] = f32_to_bf16(c.wdown[i]);
  for (auto& name : impls<MoeExpertsBf16Kernels>()) {
    const auto& kk = variant<MoeExpertsBf16Kernels>(name);
    const auto converted = c.run(kk);
    register_bf16_image(c.wgu.data(), static_cast<int64_t>(c.wgu.size()), gu_image.data());
    register_bf16_image(c.wdown.data(), static_cast<int64_t>(c.wdown.size()), down_image.data());
    const auto from_image = c.run(kk);
    unregister_bf16_image(c.wgu.data());
    unregister_bf16_image(c.wdown.data());
    EXPECT_EQ(converted.out, from_image.out) << name;
    EXPECT_EQ(converted.dx, from_image.dx) << name;
    EXPECT_EQ(converted.dwgu, from_image.dwgu) << name;
  }
}

// rope_qk against the reference, and the reference against the per-tensor rope reference.
TEST(Kernels, RopeQKAllImplementations) {
  const int64_t B = 2, T = 7, nH = 4, nKV = 2, hd = 12, N = B * T;
  auto q = randn(N * nH * hd, 50), k = randn(N * nKV * hd, 51), dq_rot = randn(q.size(), 52),
       dk_rot = randn(k.size(), 53);
  std::vector<float> cos(T * hd / 2), sin(T * hd / 2);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < hd / 2; ++i)
      cos[t * hd / 2 + i] = std::cos(t * 0.7f / (i + 1)), sin[t * hd / 2 + i] = std::sin(t * 0.7f / (i + 1));
  const auto& rope = get_kernel<RopeKernels>(DeviceType::CPU, "reference");
  std::vector<float> q_r(q.size()), k_r(k.size()), dq_r(q.size(), 0.2f), dk_r(k.size(), 0.2f);
  rope.forward(q_r.data(), q.data(), cos.data(), sin.data(), N, T, nH, hd);
  rope.forward(k_r.data(), k.data(), cos.data(), sin.data(), N, T, nKV, hd);
  rope.backward(dq_r.data(), dq_rot.data(), cos.data(), sin.data(), N, T, nH, hd);
  rope.backward(dk_r.data(), dk_rot.data(), cos.data(), sin.data(), N, T, nKV, hd);
  ASSERT_GE(impls<RopeQKKernels>().size(), 2u);
  for (auto& name : impls<RopeQKKernels>()) {
    const auto& kk = variant<RopeQKKernels>(name);
    auto qq = q, kq = k;
    std::vector<float> dq(q.size(), 0.2f), dk(k.size(), 0.2f);
    kk.forward(qq.data(), kq.data(), cos.data(), sin.data(), N, T, nH, nKV, hd);
    kk.backward(dq.data(), dk.data(), dq_rot.data(), dk_rot.data(), cos.data(), sin.data(), N, T, nH, nKV,
                hd);
    EXPECT_LE(rel(qq, q_r), kTol) << name;
    EXPECT_LE(rel(kq, k_r), kTol) << name;
    EXPECT_LE(rel(dq, dq_r), kTol) << name;
    EXPECT_LE(rel(dk, dk_r), kTol) << name;
  }
}

// qk_norm_rope equals rmsnorm's bf16-input forms, rope_qk and the bf16 conversion run in turn, bit for bit:
// "fused" against the fast rmsnorm and fused rope_qk of the same build, "reference" against the references;
// and each against the other within bf16's rounding.
TEST(Kernels, QKNormRopeEqualsTheOpsInTurn) {
  for (auto [N, T, nH, nKV, hd] : {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{6, 3, 4, 2, 8},
                                   {9, 9, 2, 1, 128},
                                   {5, 7, 3, 3, 6}}) {
    SCOPED_TRACE(::testing::Message()
                 << N << " tokens, T " << T << ", " << nH << "/" << nKV << " heads of " << hd);
    const int64_t half = hd / 2, nq = N * nH * hd, nk = N * nKV * hd;
    auto bits = [](const std::vector<float>& x, float scale) {
      std::vector<uint16_t> r(x.size());
      for (size_t i = 0; i < x.size(); ++i) r[i] = f32_to_bf16(scale * x[i]);
      return r;
    };
    const auto q_raw = bits(randn(nq, 60), 3.0f), k_raw = bits(randn(nk, 61), 0.5f),
               dq16 = bits(randn(nq, 62), 1), dk16 = bits(randn(nk, 63), 1);
    const auto qw = randn(hd, 64), kw = randn(hd, 65);
    std::vector<float> cos(T * half), sin(T * half);
    for (int64_t i = 0; i < T * half; ++i) cos[i] = std::cos(0.3f * i), sin[i] = std::sin(0.3f * i);
    struct Result {
      std::vector<uint16_t> q16, k16, dq, dk;
      std::vector<float> q_rstd, k_rstd, dqw, dkw;
    };
    auto fresh = [&] {
      return Result{std::vector<uint16_t>(nq, 0xffff), std::vector<uint16_t>(nk, 0xffff),
                    std::vector<uint16_t>(nq, 0xffff), std::vector<uint16_t>(nk, 0xffff),
                    std::vector<float>(N * nH, -1),    std::vector<float>(N * nKV, -1),
                    std::vector<float>(hd, 0.25f),     std::vector<float>(hd, -0.25f)};
    };
    // The separate ops: rmsnorm (bf16 input) into f32 q/k, rope_qk in place, the nearest bf16; backward: the
    // bf16 gradients widened, rope_qk's backward and rmsnorm's bf16-input backward into cleared buffers, the
    // nearest bf16.
    auto in_turn = [&](const RmsNormKernels& norm, const RopeQKKernels& rope) {
      Result r = fresh();
      std::vector<float> q(nq), k(nk), gq(nq, 0.0f), gk(nk, 0.0f), dq_rot(nq), dk_rot(nk);
      norm.forward_bf16_input(q.data(), r.q_rstd.data(), q_raw.data(), qw.data(), N * nH, hd, 1e-6f);
      norm.forward_bf16_input(k.data(), r.k_rstd.data(), k_raw.data(), kw.data(), N * nKV, hd, 1e-6f);
      rope.forward(q.data(), k.data(), cos.data(), sin.data(), N, T, nH, nKV, hd);
      for (int64_t i = 0; i < nq; ++i) r.q16[i] = f32_to_bf16(q[i]), dq_rot[i] = bf16_to_f32(dq16[i]);
      for (int64_t i = 0; i < nk; ++i) r.k16[i] = f32_to_bf16(k[i]), dk_rot[i] = bf16_to_f32(dk16[i]);
      rope.backward(gq.data(), gk.data(), dq_rot.data(), dk_rot.data(), cos.data(), sin.data(), N, T, nH, nKV,
                    hd);
      std::vector<float> dq(nq, 0.0f), dk(nk, 0.0f);
      norm.backward_bf16_input(dq.data(), r.dqw.data(), gq.data(), q_raw.data(), qw.data(), r.q_rstd.data(),
                               N * nH, hd);
      norm.backward_bf16_input(dk.data(), r.dkw.data(), gk.data(), k_raw.data(), kw.data(), r.k_rstd.data(),
                               N * nKV, hd);
      for (int64_t i = 0; i < nq; ++i) r.dq[i] = f32_to_bf16(dq[i]);
      for (int64_t i = 0; i < nk; ++i) r.dk[i] = f32_to_bf16(dk[i]);
      return r;
    };
    auto fused = [&](const QKNormRopeKernels& op) {
      Result r = fresh();
      op.forward(r.q16.data(), r.k16.data(), r.q_rstd.data(), r.k_rstd.data(), q_raw.data(), k_raw.data(),
                 qw.data(), kw.data(), cos.data(), sin.data(), N, T, nH, nKV, hd, 1e-6f);
      op.backward(r.dq.data(), r.dk.data(), r.dqw.data(), r.dkw.data(), dq16.data(), dk16.data(),
                  q_raw.data(), k_raw.data(), qw.data(), kw.data(), r.q_rstd.data(), r.k_rstd.data(),
                  cos.data(), sin.data(), N, T, nH, nKV, hd);
      return r;
    };
    auto widen = [](const std::vector<uint16_t>& x) {
      std::vector<float> r(x.size());
      for (size_t i = 0; i < x.size(); ++i) r[i] = bf16_to_f32(x[i]);
      return r;
    };
    const Result ref = fused(variant<QKNormRopeKernels>("reference"));
    ASSERT_GE(impls<QKNormRopeKernels>().size(), 2u);
    for (auto& name : impls<QKNormRopeKernels>()) {
      SCOPED_TRACE(name);
      const auto at = name.find('@');
      const std::string isa = at == std::string::npos ? "" : name.substr(at);
      const bool is_ref = name == "reference";
      const Result want = in_turn(variant<RmsNormKernels>(is_ref ? "reference" : "fast" + isa),
                                  variant<RopeQKKernels>(is_ref ? "reference" : "fused" + isa));
      const Result got = fused(variant<QKNormRopeKernels>(name));
      EXPECT_EQ(got.q16, want.q16);
      EXPECT_EQ(got.k16, want.k16);
      EXPECT_EQ(got.q_rstd, want.q_rstd);
      EXPECT_EQ(got.k_rstd, want.k_rstd);
      EXPECT_EQ(got.dq, want.dq);
      EXPECT_EQ(got.dk, want.dk);
      EXPECT_EQ(got.dqw, want.dqw);
      EXPECT_EQ(got.dkw, want.dkw);
      // against the reference: within one bf16 rounding for the bf16 outputs, f32 noise for the rest
      for (auto [a, b] :
           {std::pair{&got.q16, &ref.q16}, {&got.k16, &ref.k16}, {&got.dq, &ref.dq}, {&got.dk, &ref.dk}})
        EXPECT_LE(rel(widen(*a), widen(*b)), 8e-3);
      for (auto [a, b] : {std::pair{&got.q_rstd, &ref.q_rstd},
                          {&got.k_rstd, &ref.k_rstd},
                          {&got.dqw, &ref.dqw},
                          {&got.dkw, &ref.dkw}})
        EXPECT_LE(rel(*a, *b), kTol);
    }
  }
}

// KV-cache attention: n queries at positions [p, p + n) against keys [0, p + n) equal the last n rows of the
// full causal attention over p + n positions; every implementation equals the reference.
TEST(Kernels, AttentionKVAllImplementations) {
  for (auto [p, n, nH, nKV, hd] : {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{0, 9, 4, 2, 8},
                                   {13, 1, 4, 1, 16},
                                   {7, 5, 6, 3, 8},
                                   {40, 3, 2, 2, 32}}) {
    const int64_t T = p + n;
    auto q = randn(T * nH * hd, 11), k = randn(T * nKV * hd, 12), v = randn(T * nKV * hd, 13);
    const auto& full = get_kernel<AttentionKernels>(DeviceType::CPU, "reference");
    std::vector<float> out_full(T * nH * hd), saved(full.saved_floats(1, T, nH));
    full.forward(out_full.data(), saved.data(), q.data(), k.data(), v.data(), 1, T, nH, nKV, hd, nullptr);
    std::vector<float> want(out_full.begin() + p * nH * hd, out_full.end());
    for (auto& name : impls<AttentionKVKernels>()) {
      const auto& kv = variant<AttentionKVKernels>(name);
      std::vector<float> out(n * nH * hd, NAN);
      kv.forward(out.data(), q.data() + p * nH * hd, k.data(), v.data(), n, p, nH, nKV, hd);
      EXPECT_LE(rel(out, want), kTol) << name << " p=" << p << " n=" << n;
    }
  }
}

// sum_squares (the gradient norm's partial sums): every implementation against a double loop.
TEST(Kernels, SumSquaresAllImplementations) {
  auto x = randn(10007, 95, 3.0f);
  double want = 0;
  for (float v : x) want += double(v) * v;
  for (auto& name : impls<SumSquaresKernels>()) {
    const auto& k = variant<SumSquaresKernels>(name);
    EXPECT_NEAR(k.sum_squares(x.data(), int64_t(x.size())), want, 1e-12 * want) << name;
    EXPECT_EQ(k.sum_squares(x.data(), 0), 0.0) << name;
  }
}

// Every registered op has an all-implementations test above; a new op must add one here.
// ---- Glue of the model step: elementwise, moe_router, expert_parallel ------------------------------------
// One implementation each; checked against the math written out here (not against their own loops).

TEST(Kernels, ElementwiseMatchesTheMath) {
  for (auto& name : impls<ElementwiseKernels>()) {
    const auto& k = variant<ElementwiseKernels>(name);
    const int64_t n = 70001;  // above the threading threshold
    auto x = randn(n, 11), y = randn(n, 12);
    x[0] = std::nanf(""), x[1] = 1.0f + 0x1.0p-8f, x[2] = 1.0f + 3 * 0x1.0p-8f, x[3] = -0.0f;
    auto sum = y;
    k.add(sum.data(), x.data(), n);
    for (int64_t i = 4; i < n; ++i) ASSERT_EQ(sum[i], y[i] + x[i]) << name << " add at " << i;
    auto r = x;
    k.round_bf16(r.data(), n);
    EXPECT_TRUE(std::isnan(r[0]));
    EXPECT_EQ(r[1], 1.0f) << "a tie rounds to the even neighbour";
    EXPECT_EQ(r[2], 1.0f + 4 * 0x1.0p-8f) << "a tie rounds to the even neighbour";
    EXPECT_TRUE(std::signbit(r[3]));
    std::vector<uint16_t> h(n);
    k.to_bf16(h.data(), x.data(), n);
    std::vector<float> back(n);
    k.from_bf16(back.data(), h.data(), n);
    for (int64_t i = 1; i < n; ++i) {
      ASSERT_EQ(h[i], f32_to_bf16(x[i])) << name << " to_bf16 at " << i;
      ASSERT_EQ(back[i], r[i]) << name << " from_bf16(to_bf16(x)) == round_bf16(x) at " << i;
    }
    k.fill(back.data(), 2.5f, n);
    EXPECT_EQ(std::count(back.begin(), back.end(), 2.5f), n);
    auto scaled = y;
    k.scale(scaled.data(), 0.75f, n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(scaled[i], y[i] * 0.75f) << name << " scale at " << i;
    // the residual add into the bf16 residual stream: the f32 sum's nearest bf16 (h: x's bf16 bits)
    std::vector<uint16_t> s16(n, 0xffff);
    k.add_to_bf16(s16.data(), y.data(), h.data(), n);
    for (int64_t i = 1; i < n; ++i)
      ASSERT_EQ(s16[i], f32_to_bf16(y[i] + bf16_to_f32(h[i]))) << name << " add_to_bf16 at " << i;
  }
}

// Top-k by sorting: descending score, ties to the lower index (torch.topk on CPU).
std::vector<int32_t> topk_by_sort(const float* p, const float* bias, int64_t E, int64_t k) {
  std::vector<int32_t> ids(E);
  for (int64_t e = 0; e < E; ++e) ids[e] = (int32_t)e;
  auto score = [&](int32_t e) { return bias ? p[e] + bias[e] : p[e]; };
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return score(a) > score(b); });
  ids.resize(k);
  return ids;
}

TEST(Kernels, MoeRouterMatchesTheMath) {
  const int64_t N = 37, E = 12, k = 3;
  for (auto& name : impls<MoeRouterKernels>()) {
    const auto& r = variant<MoeRouterKernels>(name);
    auto logits = randn(N * E, 21, 2.0f), bias = randn(E, 22, 0.05f);
    for (int64_t e = 0; e < E; ++e) logits[5 * E + e] = 0.5f;  // row 5: every expert ties
    auto probs = logits;
    r.softmax(probs.data(), N, E);
    for (int64_t n = 0; n < N; ++n) {
      double z = 0;
      for (int64_t e = 0; e < E; ++e) z += std::exp((double)logits[n * E + e]);
      for (int64_t e = 0; e < E; ++e)
        ASSERT_NEAR(probs[n * E + e], std::exp((double)logits[n * E + e]) / z, 1e-7) << name;
    }
    for (bool norm : {false, true})
      for (const float* b : {(const float*)nullptr, (const float*)bias.data()}) {
        std::vector<int32_t> idx(N * k);
        std::vector<float> w(N * k);
        r.select_topk(idx.data(), w.data(), probs.data(), b, N, E, k, norm);
        for (int64_t n = 0; n < N; ++n) {
          auto want = topk_by_sort(probs.data() + n * E, b, E, k);
          double S = 0;
          for (int64_t s = 0; s < k; ++s) S += probs[n * E + want[s]];
          for (int64_t s = 0; s < k; ++s) {
            ASSERT_EQ(idx[n * k + s], want[s]) << name << " row " << n;
            const double p = probs[n * E + want[s]];
            ASSERT_NEAR(w[n * k + s], norm ? p / S : p, 1e-7) << name;
          }
        }
      }
    // Statistics: counted by hand.
    std::vector<int32_t> idx(N * k);
    std::vector<float> w(N * k);
    r.select_topk(idx.data(), w.data(), probs.data(), nullptr, N, E, k, true);
    std::vector<float> counts(E, 1.0f);
    std::vector<double> c2(E, 2.0), psum(E, 3.0);
    r.count_tokens(counts.data(), idx.data(), N * k, E);
    r.aux_stats(c2.data(), psum.data(), idx.data(), probs.data(), N, E, k);
    for (int64_t e = 0; e < E; ++e) {
      const auto hits = std::count(idx.begin(), idx.end(), (int32_t)e);
      double ps = 0;
      for (int64_t n = 0; n < N; ++n) ps += probs[n * E + e];
      EXPECT_EQ(counts[e], 1.0f + hits);
      EXPECT_EQ(c2[e], 2.0 + hits);
      EXPECT_NEAR(psum[e], 3.0 + ps, 1e-12);
    }
    // Backward against central differences in double of
    //   L(logits) = sum_s g[s] * w_s(softmax(logits)) + sum_e dbias[e] * softmax(logits)_e
    // with the selection held fixed (no row here is near a tie except row 5, left out).
    auto g = randn(N * k, 23), dbias = randn(E, 24);
    std::vector<float> dlogits(N * E, 7.0f);  // overwritten
    for (bool norm : {false, true}) {
      r.select_topk(idx.data(), w.data(), probs.data(), nullptr, N, E, k, norm);
      r.backward(dlogits.data(), probs.data(), idx.data(), g.data(), dbias.data(), N, E, k, norm);
      for (int64_t n = 0; n < N; ++n) {
        if (n == 5) continue;
        auto loss = [&](const std::vector<double>& lg) {
          double z = 0, S = 0, L = 0;
          std::vector<double> p(E);
          for (int64_t e = 0; e < E; ++e) z += std::exp(lg[e]);
          for (int64_t e = 0; e < E; ++e) p[e] = std::exp(lg[e]) / z, L += dbias[e] * p[e];
          for (int64_t s = 0; s < k; ++s) S += p[idx[n * k + s]];
          for (int64_t s = 0; s < k; ++s) L += g[n * k + s] * p[idx[n * k + s]] / (norm ? S : 1.0);
          return L;
        };
        std::vector<double> lg(logits.begin() + n * E, logits.begin() + (n + 1) * E);
        for (int64_t e = 0; e < E; ++e) {
          const double h = 1e-5, x0 = lg[e];
          lg[e] = x0 + h;
          const double up = loss(lg);
          lg[e] = x0 - h;
          const double down = loss(lg);
          lg[e] = x0;
          ASSERT_NEAR(dlogits[n * E + e], (up - down) / (2 * h), 2e-5) << name << " norm " << norm;
        }
      }
    }
    // torchtitan's bias update: sign(mean - count), centred; the counts are cleared.
    std::vector<float> cnt = {5, 1, 3, 3, 0, 6, 3, 3, 3, 3, 3, 3}, b(E, 0.25f);
    r.update_bias(b.data(), cnt.data(), E, 0.01);
    const double mean = 36.0 / 12.0;  // 3: experts with 3 tokens get no push
    double shift = 0;
    for (float c : {5, 1, 3, 3, 0, 6, 3, 3, 3, 3, 3, 3}) shift += (c < mean) - (c > mean);
    shift *= 0.01 / 12.0;
    const float want[] = {-1, 1, 0, 0, 1, -1, 0, 0, 0, 0, 0, 0};
    for (int64_t e = 0; e < E; ++e) {
      EXPECT_NEAR(b[e], 0.25 + 0.01 * want[e] - shift, 1e-7) << e;
      EXPECT_EQ(cnt[e], 0.0f);
    }
  }
}

TEST(Kernels, ExpertParallelPackingMatchesTheMath) {
  const int64_t N = 11, k = 3, H = 5, El = 4, S = N * k;
  for (auto& name : impls<ExpertParallelKernels>()) {
    const auto& ep = variant<ExpertParallelKernels>(name);
    auto x = randn(N * H, 31), w = randn(S, 32);
    std::vector<int32_t> idx(S);
    std::vector<int64_t> order(S), pos(S);
    std::mt19937 rng(33);
    for (auto& i : idx) i = (int32_t)(rng() % (3 * El));     // 3 ranks' experts
    for (int64_t i = 0; i < S; ++i) order[i] = (i * 7) % S;  // a permutation (7 is prime to 33)
    for (int64_t i = 0; i < S; ++i) pos[order[i]] = i;
    std::vector<float> send(S * (H + 2));
    ep.pack(send.data(), x.data(), w.data(), idx.data(), order.data(), S, k, H, El);
    std::vector<float> rx(S * H), rw(S);
    std::vector<int32_t> ridx(S);
    EXPECT_EQ(ep.unpack(rx.data(), rw.data(), ridx.data(), send.data(), S, H, El), 0);
    for (int64_t i = 0; i < S; ++i) {
      const int64_t slot = order[i];
      for (int64_t h = 0; h < H; ++h) ASSERT_EQ(rx[i * H + h], x[(slot / k) * H + h]);
      ASSERT_EQ(rw[i], w[slot]);
      ASSERT_EQ(ridx[i], idx[slot] % El);
    }
    send[3 * (H + 2) + H + 1] = (float)El;  // a row naming a foreign expert is counted
    EXPECT_EQ(ep.unpack(rx.data(), rw.data(), ridx.data(), send.data(), S, H, El), 1);
    std::vector<float> g(S * H);
    ep.gather_rows(g.data(), x.data(), order.data(), S, k, H);
    for (int64_t i = 0; i < S; ++i)
      for (int64_t h = 0; h < H; ++h) ASSERT_EQ(g[i * H + h], x[(order[i] / k) * H + h]);
    // Returned rows back to tokens, slots in order: out[n] = sum_s rows[pos[n*k+s]].
    auto rows = randn(S * (H + 1), 34);
    auto dx = randn(S * H, 35), dw = randn(S, 36);
    std::vector<float> packed(S * (H + 1));
    ep.pack_grads(packed.data(), dx.data(), dw.data(), S, H);
    for (int64_t r = 0; r < S; ++r) {
      for (int64_t h = 0; h < H; ++h) ASSERT_EQ(packed[r * (H + 1) + h], dx[r * H + h]);
      ASSERT_EQ(packed[r * (H + 1) + H], dw[r]);
    }
    std::vector<float> out(N * H, 9.0f), acc(N * H, 1.0f), dtw(S, 2.0f);
    ep.combine(out.data(), nullptr, rows.data(), pos.data(), N, k, H, H + 1, false);
    ep.combine(acc.data(), dtw.data(), rows.data(), pos.data(), N, k, H, H + 1, true);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t h = 0; h < H; ++h) {
        float want = 0.0f;
        for (int64_t s = 0; s < k; ++s) want += rows[pos[n * k + s] * (H + 1) + h];
        ASSERT_EQ(out[n * H + h], want);
        ASSERT_NEAR(acc[n * H + h], 1.0f + want, 1e-6);
      }
      for (int64_t s = 0; s < k; ++s) ASSERT_EQ(dtw[n * k + s], 2.0f + rows[pos[n * k + s] * (H + 1) + H]);
    }
    // The fixed-capacity layout: 3 blocks of S rows, block d = the slots routed to rank d in ascending order,
    // then padding (-1), which packs as [0 | 0 | -1], gathers as zeros and unpacks with expert -1.
    std::vector<int64_t> forder(3 * S, 7), fpos(S, 7);
    ep.route_fixed(forder.data(), fpos.data(), idx.data(), S, El, 3);
    for (int64_t d = 0, p = 0; d < 3; ++d, p = d * S) {
      for (int64_t s = 0; s < S; ++s)
        if (idx[s] / El == d) {
          ASSERT_EQ(forder[p], s) << name << " rank " << d;
          ASSERT_EQ(fpos[s], p++);
        }
      for (; p < (d + 1) * S; ++p) ASSERT_EQ(forder[p], -1) << name << " rank " << d;
    }
    std::vector<float> fsend(3 * S * (H + 2));
    ep.pack(fsend.data(), x.data(), w.data(), idx.data(), forder.data(), 3 * S, k, H, El);
    std::vector<float> fx(3 * S * H), fw(3 * S), fg(3 * S * H);
    std::vector<int32_t> fidx(3 * S);
    ep.unpack_padded(fx.data(), fw.data(), fidx.data(), fsend.data(), 3 * S, H);
    ep.gather_rows(fg.data(), x.data(), forder.data(), 3 * S, k, H);
    for (int64_t i = 0; i < 3 * S; ++i) {
      const int64_t slot = forder[i];
      ASSERT_EQ(fidx[i], slot < 0 ? -1 : idx[slot] % El);
      ASSERT_EQ(fw[i], slot < 0 ? 0.0f : w[slot]);
      for (int64_t h = 0; h < H; ++h) {
        ASSERT_EQ(fx[i * H + h], slot < 0 ? 0.0f : x[(slot / k) * H + h]);
        ASSERT_EQ(fg[i * H + h], fx[i * H + h]);
      }
    }
  }
}

TEST(Kernels, GemmAllImplementations) {
  const auto& ref = get_kernel<GemmKernels>(DeviceType::CPU, "reference");
  const int64_t M = 7, N = 9, K = 5, pad = 3;  // leading dimensions wider than the rows
  for (auto& name : impls<GemmKernels>())
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (float beta : {0.0f, 1.0f}) {
          const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
          auto A = randn((ta ? K : M) * lda, 41), B = randn((tb ? N : K) * ldb, 42), C0 = randn(M * ldc, 43);
          if (beta == 0.0f) std::fill(C0.begin(), C0.end(), std::nanf(""));  // never read
          auto want = C0, got = C0;
          ref.gemm(ta, tb, M, N, K, 0.5f, A.data(), lda, B.data(), ldb, beta, want.data(), ldc);
          variant<GemmKernels>(name).gemm(ta, tb, M, N, K, 0.5f, A.data(), lda, B.data(), ldb, beta,
                                          got.data(), ldc);
          for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < ldc; ++n) {
              const float w = want[m * ldc + n], g = got[m * ldc + n];
              if (n >= N) {  // the padding between rows is left alone
                ASSERT_TRUE(std::isnan(w) ? std::isnan(g) : g == w) << name;
                continue;
              }
              double acc = 0;  // the math written out
              for (int64_t k = 0; k < K; ++k)
                acc +=
                    (double)(ta ? A[k * lda + m] : A[m * lda + k]) * (tb ? B[n * ldb + k] : B[k * ldb + n]);
              const double expect = 0.5 * acc + (beta == 0.0f ? 0.0 : C0[m * ldc + n]);
              ASSERT_NEAR(g, expect, 1e-5 * (1 + std::abs(expect))) << name << " ta " << ta << " tb " << tb;
              ASSERT_NEAR(w, expect, 1e-6 * (1 + std::abs(expect))) << "reference";
            }
        }
}

TEST(Kernels, DropoutMaskIsTheCounterHash) {
  const int64_t n = 100000;
  auto x = randn(n, 51), g = randn(n, 52);
  for (auto& name : impls<DropoutKernels>()) {
    const auto& d = variant<DropoutKernels>(name);
    const float p = 0.25f, keep = 1.0f / (1.0f - p);
    std::vector<float> out(n), dx(n, 1.0f);
    d.forward(out.data(), x.data(), 1, n, 12345, n, p, nullptr);
    d.backward_add(dx.data(), g.data(), 1, n, 12345, n, p, nullptr);
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      const bool k = counter_uniform(12345 + i) >= p;
      kept += k;
      ASSERT_EQ(out[i], k ? x[i] * keep : 0.0f) << name << " " << i;
      ASSERT_EQ(dx[i], k ? 1.0f + g[i] * keep : 1.0f) << name << " " << i;
    }
    EXPECT_NEAR(double(kept) / n, 1.0 - p, 0.01);  // the counter hash is uniform
    std::vector<float> other(n);
    d.forward(other.data(), x.data(), 1, n, 12346, n, p, nullptr);
    EXPECT_NE(other, out) << "another key draws another mask";
    const uint64_t add = 1;  // a part of the key in the op's memory: the mask of the sum
    std::vector<float> added(n);
    d.forward(added.data(), x.data(), 1, n, 12345, n, p, &add);
    EXPECT_EQ(added, other) << name;
    // A column slice (rows 0..99 of a 100 x 1000 matrix, columns [250, 500)) keyed with the full matrix's
    // stride draws the full matrix's masks at those columns.
    std::vector<float> full(n), slice(100 * 250), back(100 * 250, 1.0f);
    d.forward(full.data(), x.data(), 100, 1000, 777, 1000, p, nullptr);
    std::vector<float> xs(100 * 250), gs(100 * 250, 1.0f);
    for (int64_t r = 0; r < 100; ++r)
      for (int64_t c = 0; c < 250; ++c) xs[r * 250 + c] = x[r * 1000 + 250 + c];
    d.forward(slice.data(), xs.data(), 100, 250, 777 + 250, 1000, p, nullptr);
    d.backward_add(back.data(), gs.data(), 100, 250, 777 + 250, 1000, p, nullptr);
    for (int64_t r = 0; r < 100; ++r)
      for (int64_t c = 0; c < 250; ++c) {
        ASSERT_EQ(slice[r * 250 + c], full[r * 1000 + 250 + c]) << name << " " << r << "," << c;
        ASSERT_EQ(back[r * 250 + c], full[r * 1000 + 250 + c] != 0.0f ? 1.0f + keep : 1.0f) << name;
      }
  }
}

// Loss parallel: the vocabulary split into shards, each shard's statistics combined as the ranks do
// (max, then the sums of exp rescaled to it and the target logit) give the full cross-entropy's loss and,
// shard by shard, its gradient.
TEST(Kernels, CrossEntropyVocabParallelEqualsFullVocabulary) {
  const int64_t N = 9, V = 12, shards = 3, Vs = V / shards;
  std::vector<int32_t> targets = {3, -1, 0, 11, 5, 4, 7, 8, 1};
  auto logits = randn(N * V, 21, 3.0f);
  auto g_full = logits;
  const double l_full = get_kernel<CrossEntropyKernels>(DeviceType::CPU, "reference")
                            .forward_backward(g_full.data(), targets.data(), N, V, 0.25f, true);
  for (auto& name : impls<VocabParallelCrossEntropyKernels>()) {
    const auto& k = variant<VocabParallelCrossEntropyKernels>(name);
    std::vector<std::vector<float>> shard(shards, std::vector<float>(N * Vs)), stats(shards);
    for (int64_t s = 0; s < shards; ++s) {
      for (int64_t n = 0; n < N; ++n)
        std::copy_n(logits.begin() + n * V + s * Vs, Vs, shard[s].begin() + n * Vs);
      stats[s].resize(3 * N);
      k.shard_stats(stats[s].data(), shard[s].data(), targets.data(), N, Vs, s * Vs);
    }
    std::vector<float> lse(N);
    double loss = 0;
    for (int64_t n = 0; n < N; ++n) {
      float mx = -INFINITY, sum = 0, tgt = 0;
      for (int64_t s = 0; s < shards; ++s) mx = std::max(mx, stats[s][3 * n]);
      for (int64_t s = 0; s < shards; ++s)
        sum += stats[s][3 * n + 1] * std::exp(stats[s][3 * n] - mx), tgt += stats[s][3 * n + 2];
      lse[n] = mx + std::log(sum);
      if (targets[n] >= 0) loss += lse[n] - tgt;
    }
    EXPECT_NEAR(loss, l_full, 1e-5 * std::abs(l_full)) << name;
    std::vector<float> g(N * V);
    for (int64_t s = 0; s < shards; ++s) {
      const float scale = 0.25f;
      k.shard_grad(shard[s].data(), lse.data(), targets.data(), N, Vs, s * Vs, &scale);
      for (int64_t n = 0; n < N; ++n) std::copy_n(shard[s].begin() + n * Vs, Vs, g.begin() + n * V + s * Vs);
    }
    EXPECT_LE(rel(g, g_full), kTol) << name;
  }
}

TEST(KernelRegistry, EveryRegisteredOpIsCoveredByATest) {
  const std::vector<std::string> covered = {"adamw",
                                            "attention",
                                            "attention_kv",
                                            "attention_bf16",
                                            "attention_ring",
                                            "cross_entropy",
                                            "cross_entropy_vocab_parallel",
                                            "dropout",
                                            "elementwise",
                                            "embedding",
                                            "gemm",
                                            "expert_parallel",
                                            "matmul",
                                            "matmul_bf16",
                                            "moe_experts",
                                            "moe_experts_bf16",
                                            "moe_router",
                                            "qk_norm_rope",
                                            "rmsnorm",
                                            "rope",
                                            "rope_qk",
                                            "swiglu",
                                            "sum_squares"};
  for (auto& op : KernelRegistry::global().ops())
    EXPECT_NE(std::find(covered.begin(), covered.end(), op), covered.end())
        << "op '" << op << "' has no all-implementations test in tests/test_kernels.cpp";
  auto names = KernelRegistry::global().impls("moe_experts", DeviceType::CPU);
  EXPECT_NE(std::find(names.begin(), names.end(), "grouped"), names.end());
  names = KernelRegistry::global().impls("rope_qk", DeviceType::CPU);
  EXPECT_NE(std::find(names.begin(), names.end(), "fused"), names.end());
}

}  // namespace
}  // namespace titan
