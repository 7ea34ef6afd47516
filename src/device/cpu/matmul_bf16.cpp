// bf16 GEMMs with f32 accumulation (op "matmul_bf16"). "reference": operands rounded to bf16, double
// accumulation (the test oracle). "sgemm": operands rounded to bf16 (kept in f32) through the f32 sgemm of
// the "matmul" op's default engine: exact products, f32 accumulation, on any CPU. "onednn": oneDNN's
// matmul on bf16 copies of the operands, which uses the CPU's bf16 dot-product instructions (AVX512_BF16
// vdpbf16ps, AMX where present); registered when the build found oneDNN (TITAN_HAVE_DNNL) and chosen
// where the CPU has AVX512_BF16.
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "device/cpu/sgemm.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

#ifdef TITAN_HAVE_DNNL
#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace titan {
namespace {

double rb(float x) {
  return round_to_bf16(x);
}

// The references read a weight through cpu::bf16_rounded too (its registered image when there is one).
void ref_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC) {
  std::vector<float> wbuf;
  const float* w = cpu::bf16_rounded(wbuf, weight, OC * C);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double acc = 0;
      for (int64_t c = 0; c < C; ++c) acc += rb(inp[n * C + c]) * rb(w[o * C + c]);
      out[n * OC + o] = (float)acc;
    }
}

void ref_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* weight, int64_t N,
                  int64_t C, int64_t OC, bool accumulate_dw) {
  std::vector<float> wbuf;
  const float* w = dinp ? cpu::bf16_rounded(wbuf, weight, OC * C) : nullptr;
  if (dinp)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) {
        double acc = 0;
        for (int64_t o = 0; o < OC; ++o) acc += rb(dout[n * OC + o]) * rb(w[o * C + c]);
        dinp[n * C + c] += (float)acc;
      }
  if (dw)
    for (int64_t o = 0; o < OC; ++o)
      for (int64_t c = 0; c < C; ++c) {
        double acc = 0;
        for (int64_t n = 0; n < N; ++n) acc += rb(dout[n * OC + o]) * rb(inp[n * C + c]);
        dw[o * C + c] = accumulate_dw ? dw[o * C + c] + (float)acc : (float)acc;
      }
}

struct Bf16Image {
  const float* base;
  int64_t n;
  const uint16_t* image;
};
std::mutex& image_mutex() {
  static std::mutex mu;
  return mu;
}
std::vector<Bf16Image>& images() {
  static std::vector<Bf16Image> all;
  return all;
}

// The f32 values of n bf16 bit patterns, in a buffer reused across calls (the input of the bf16-input
// GEMMs; the other operands have their own buffers).
const float* widened(const uint16_t* x, int64_t n) {
  static std::vector<float> buf;
  return cpu::bf16_widened(buf, x, n);
}

void ref_forward_bf16_input(float* out, const uint16_t* inp16, const float* weight, int64_t N, int64_t C,
                            int64_t OC) {
  ref_forward(out, widened(inp16, N * C), weight, N, C, OC);
}
void ref_backward_bf16_input(float* dinp, float* dw, const float* dout, const uint16_t* inp16,
                             const float* weight, int64_t N, int64_t C, int64_t OC, bool accumulate_dw) {
  ref_backward(dinp, dw, dout, dw ? widened(inp16, N * C) : nullptr, weight, N, C, OC, accumulate_dw);
}

// forward_bf16_output / forward_bf16_io of every CPU engine: the engine's own forward (f32 or bf16 input)
// into a buffer reused across calls, then the nearest bf16 of each value (so it equals forward rounded,
// bit for bit).
template <auto Forward, class In>
void forward_bf16_output(uint16_t* out16, const In* inp, const float* w, int64_t N, int64_t C, int64_t OC) {
  static std::vector<float> buf;
  if ((int64_t)buf.size() < N * OC) buf.resize(N * OC);
  Forward(buf.data(), inp, w, N, C, OC);
  cpu::bf16_narrowed(out16, buf.data(), N * OC);
}

// backward_bf16_io of every CPU engine: the output gradient widened into a buffer reused across calls, then
// the engine's bf16-input backward (which reads it as the bf16-exact f32 values they are).
template <auto BackwardBf16Input>
void backward_bf16_io(float* dinp, float* dw, const uint16_t* dout16, const uint16_t* inp16, const float* w,
                      int64_t N, int64_t C, int64_t OC, bool accumulate_dw) {
  static std::vector<float> buf;
  BackwardBf16Input(dinp, dw, cpu::bf16_widened(buf, dout16, N * OC), inp16, w, N, C, OC, accumulate_dw);
}

// An engine's table from its four GEMMs (f32 and bf16 input); its bf16-output forms are its forwards
// rounded, its bf16-gradient backward the bf16-input one on the widened gradient.
template <auto Forward, auto Backward, auto ForwardBf16Input, auto BackwardBf16Input>
MatmulBf16Kernels engine_table() {
  return {Forward,
          Backward,
          ForwardBf16Input,
          BackwardBf16Input,
          forward_bf16_output<Forward, float>,
          forward_bf16_output<ForwardBf16Input, uint16_t>,
          backward_bf16_io<BackwardBf16Input>};
}

const MatmulBf16Kernels kRef =
    engine_table<ref_forward, ref_backward, ref_forward_bf16_input, ref_backward_bf16_input>();
TITAN_REGISTER_KERNEL(MatmulBf16Kernels, CPU, "reference", kRef, 0);

// bf16-rounded copies of the operands in f32, reused across calls (one per operand slot).
const float* rounded(int slot, const float* x, int64_t n) {
  static std::vector<float> bufs[2];
  return cpu::bf16_rounded(bufs[slot], x, n);
}

const MatmulKernels& f32_engine() {
  static const MatmulKernels& k = get_kernel<MatmulKernels>(DeviceType::CPU);
  return k;
}

void sgemm_forward(float* out, const float* inp, const float* w, int64_t N, int64_t C, int64_t OC) {
  f32_engine().forward(out, rounded(0, inp, N * C), rounded(1, w, OC * C), N, C, OC);
}

void sgemm_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w, int64_t N,
                    int64_t C, int64_t OC, bool accumulate_dw) {
  const float* g = rounded(0, dout, N * OC);
  if (dinp) f32_engine().backward(dinp, nullptr, g, nullptr, rounded(1, w, OC * C), N, C, OC, false);
  if (dw) f32_engine().backward(nullptr, dw, g, rounded(1, inp, N * C), nullptr, N, C, OC, accumulate_dw);
}

// (the widened input is bf16-exact already: no rounding pass)
void sgemm_forward_bf16_input(float* out, const uint16_t* inp16, const float* w, int64_t N, int64_t C,
                              int64_t OC) {
  f32_engine().forward(out, widened(inp16, N * C), rounded(1, w, OC * C), N, C, OC);
}
void sgemm_backward_bf16_input(float* dinp, float* dw, const float* dout, const uint16_t* inp16,
                               const float* w, int64_t N, int64_t C, int64_t OC, bool accumulate_dw) {
  const float* g = rounded(0, dout, N * OC);
  if (dinp) f32_engine().backward(dinp, nullptr, g, nullptr, rounded(1, w, OC * C), N, C, OC, false);
  if (dw) f32_engine().backward(nullptr, dw, g, widened(inp16, N * C), nullptr, N, C, OC, accumulate_dw);
}

const MatmulBf16Kernels kSgemm =
    engine_table<sgemm_forward, sgemm_backward, sgemm_forward_bf16_input, sgemm_backward_bf16_input>();
TITAN_REGISTER_KERNEL(MatmulBf16Kernels, CPU, "sgemm", kSgemm, 5);

#ifdef TITAN_HAVE_DNNL
using dnnl::memory;

dnnl::engine& engine() {
  static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  return eng;
}

// bf16 copies of the operands, reused across calls (grown as needed).
struct Bf16Buffer {
  std::vector<uint16_t> data;
  uint16_t* fill(const float* x, int64_t n) {
    if ((int64_t)data.size() < n) data.resize(n);
    uint16_t* d = data.data();
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(x[i]);
    return d;
  }
};

// C (M,N) [+]= A (M,K) B (K,N); A, B given by their strides (transposes are strides), C row-major.
struct GemmKey {
  int64_t M, N, K, sa0, sa1, sb0, sb1;
  bool accumulate;
  bool operator<(const GemmKey& o) const {
    return std::tie(M, N, K, sa0, sa1, sb0, sb1, accumulate) <
           std::tie(o.M, o.N, o.K, o.sa0, o.sa1, o.sb0, o.sb1, o.accumulate);
  }
};

struct Gemm {
  dnnl::matmul prim;
  memory::desc a, b, c;
};

const Gemm& gemm_for(const GemmKey& k) {
  static std::mutex mu;
  static std::map<GemmKey, Gemm> cache;  // primitives are JIT-compiled once per shape
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(k);
  if (it != cache.end()) return it->second;
  Gemm g;
  g.a = memory::desc({k.M, k.K}, memory::data_type::bf16, memory::dims{k.sa0, k.sa1});
  g.b = memory::desc({k.K, k.N}, memory::data_type::bf16, memory::dims{k.sb0, k.sb1});
  g.c = memory::desc({k.M, k.N}, memory::data_type::f32, memory::dims{k.N, 1});
  dnnl::primitive_attr attr;
  if (k.accumulate) {
    dnnl::post_ops po;
    po.append_sum(1.0f);
    attr.set_post_ops(po);
  }
  try {
    g.prim = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(g.a, g.b, g.c), attr, engine()));
  } catch (const dnnl::error&) {
    fail("matmul_bf16: the oneDNN engine has no bf16 matmul for this CPU (it needs ",
         cpu_isa_features(CpuIsa::kAvx512Bf16),
         "; ONEDNN_MAX_CPU_ISA may cap it); use kernels.matmul_bf16 = "
         "\"sgemm\"");
  }
  return cache.emplace(k, std::move(g)).first->second;
}

void run(const GemmKey& k, const uint16_t* a, const uint16_t* b, float* c) {
  const Gemm& g = gemm_for(k);
  dnnl::stream s(engine());
  memory ma(g.a, engine(), const_cast<uint16_t*>(a)), mb(g.b, engine(), const_cast<uint16_t*>(b)),
      mc(g.c, engine(), c);
  g.prim.execute(s, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
  s.wait();
}

// 0: the activation or output gradient, 1: a weight without an image, 2: the backward's input.
Bf16Buffer& buf(int i) {
  static Bf16Buffer b[3];
  return b[i];
}

// The weight's registered bf16 image, else a converted copy.
const uint16_t* weight_bf16(const float* w, int64_t n) {
  const uint16_t* image = find_bf16_image(w, n);
  return image ? image : buf(1).fill(w, n);
}

// out (N,OC) = inp (N,C) @ w^T: B = w^T is (C,OC) with strides (1, C). The bf16-input variants read inp16
// in place of the converted copy.
void dnnl_forward_bf16_input(float* out, const uint16_t* inp16, const float* w, int64_t N, int64_t C,
                             int64_t OC) {
  run({N, OC, C, C, 1, 1, C, false}, inp16, weight_bf16(w, OC * C), out);
}
void dnnl_forward(float* out, const float* inp, const float* w, int64_t N, int64_t C, int64_t OC) {
  dnnl_forward_bf16_input(out, buf(0).fill(inp, N * C), w, N, C, OC);
}

// inp16: the input's bf16 values, read only for dw (null when dw is).
void dnnl_backward_bf16_input(float* dinp, float* dw, const float* dout, const uint16_t* inp16,
                              const float* w, int64_t N, int64_t C, int64_t OC, bool accumulate_dw) {
  const uint16_t* g = buf(0).fill(dout, N * OC);
  if (dinp) {  // dinp (N,C) += dout (N,OC) @ w (OC,C)
    const uint16_t* b = weight_bf16(w, OC * C);
    run({N, C, OC, OC, 1, C, 1, true}, g, b, dinp);
  }
  if (dw)  // dw (OC,C) [+]= dout^T (OC,N) @ inp (N,C); dout^T has strides (1, OC)
    run({OC, C, N, 1, OC, C, 1, accumulate_dw}, g, inp16, dw);
}
void dnnl_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w, int64_t N,
                   int64_t C, int64_t OC, bool accumulate_dw) {
  dnnl_backward_bf16_input(dinp, dw, dout, dw ? buf(2).fill(inp, N * C) : nullptr, w, N, C, OC,
                           accumulate_dw);
}

// (forward_bf16_output through the f32 output: oneDNN's bf16 destination would be one pass less, but the
// primitive for it may block the sum differently, and the output must equal forward's rounded)
const MatmulBf16Kernels kDnnl =
    engine_table<dnnl_forward, dnnl_backward, dnnl_forward_bf16_input, dnnl_backward_bf16_input>();
TITAN_REGISTER_KERNEL_ISA(MatmulBf16Kernels, CPU, "onednn", kDnnl, 10, CpuIsa::kAvx512Bf16);
// Not the default where the CPU's bf16 dot products are slower than its f32 FMAs (AVX512_BF16 without AMX
// on some CPUs): sgemm on the rounded operands is faster there.
TITAN_KERNEL_DEFAULT_CONDITION(MatmulBf16Kernels, CPU, "onednn", cpu_bf16_dot_products_slow);
#endif

}  // namespace

void register_bf16_image(const float* base, int64_t n, const uint16_t* image) {
  std::lock_guard<std::mutex> lock(image_mutex());
  for (auto& e : images())
    if (e.base == base) {
      e = Bf16Image{base, n, image};
      return;
    }
  images().push_back(Bf16Image{base, n, image});
}

void unregister_bf16_image(const float* base) {
  std::lock_guard<std::mutex> lock(image_mutex());
  auto& all = images();
  for (size_t i = 0; i < all.size(); ++i)
    if (all[i].base == base) {
      all.erase(all.begin() + static_cast<std::ptrdiff_t>(i));
      return;
    }
}

const uint16_t* find_bf16_image(const float* p, int64_t n) {
  std::lock_guard<std::mutex> lock(image_mutex());
  for (auto& e : images())
    if (p >= e.base && p + n <= e.base + e.n) return e.image + (p - e.base);
  return nullptr;
}

}  // namespace titan
