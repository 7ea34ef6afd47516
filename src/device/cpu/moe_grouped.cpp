// Grouped routed-experts kernel: token slots are permuted so each expert's rows are contiguous, then every
// expert runs as one BLAS GEMM per projection (a CPU grouped GEMM), and the results are unpermuted and
// combined with the routing weights. Same math and conventions as moe_reference.cpp.
//
// Pipeline (R = N*k routed rows, rows of expert e are [offsets[e], offsets[e+1])):
//   forward:  route tables -> gather x (R,H) -> GU_e = X_e W_gu_e^T -> act = swiglu(GU)
//             -> Y_e = act_e W_down_e^T (R,H) -> out[n] = sum_s w[n,s] Y[row_of[n,s]]
//   backward: gather dout (R,H) -> G_e = D_e W_down_e -> dw = <G, act>, dact = w G, wact = w act
//             -> dW_down_e += D_e^T wact_e -> dGU = swiglu'(dact) -> gather x -> dW_gu_e += dGU_e^T X_e
//             -> dX_e = dGU_e W_gu_e -> dx[n] += sum_s dX[row_of[n,s]]
//
// The GEMM engine is a template parameter: "grouped" (op moe_experts) runs the CPU kernels' sgemm (oneDNN
// where built, else BLAS); op moe_experts_bf16 runs the same pipeline on bf16 operands, "reference" (rounded
// operands, double accumulation: the oracle), "sgemm" (rounded operands through that sgemm, any CPU) and
// "onednn" (oneDNN matmul with the row count as a runtime dimension, one primitive per GEMM kind).
#include <omp.h>

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

// Every GEMM of the pipeline: C (M,N) = op(A) op(B) + beta C, row-major, beta 0 or 1. The operands are
// stored densely (lda = the stored row length), which the bf16 engines rely on. The f32 engine is the CPU
// kernels' sgemm (oneDNN where built, else BLAS: device/cpu/sgemm.h).
struct F32Gemm {
  void operator()(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                  const float* B, int64_t ldb, float beta, float* C, int64_t ldc) const {
    cpu::sgemm(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
  }
};

// bf16 oracle: operands rounded to bf16, double accumulation (B, the weight in the forward, read through
// cpu::bf16_rounded: a weight's registered image when there is one).
struct Bf16ReferenceGemm {
  void operator()(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                  const float* b_in, int64_t ldb, float beta, float* C, int64_t ldc) const {
    TITAN_CHECK(ldb == (tb ? K : N), "moe_experts_bf16: operands must be dense");
    std::vector<float> b_buf;
    const float* B = cpu::bf16_rounded(b_buf, b_in, K * N);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k)
          acc += (double)round_to_bf16(ta ? A[k * lda + m] : A[m * lda + k]) *
                 round_to_bf16(tb ? B[n * ldb + k] : B[k * ldb + n]);
        C[m * ldc + n] = (float)(beta == 0.0f ? acc : C[m * ldc + n] + acc);
      }
  }
};

// bf16 on any CPU: the operands rounded to bf16 (cpu::bf16_rounded) through the f32 GEMM.
struct Bf16RoundedGemm {
  void operator()(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                  const float* B, int64_t ldb, float beta, float* C, int64_t ldc) const {
    TITAN_CHECK(lda == (ta ? M : K) && ldb == (tb ? K : N), "moe_experts_bf16: operands must be dense");
    thread_local std::vector<float> a_buf, b_buf;
    F32Gemm{}(ta, tb, M, N, K, cpu::bf16_rounded(a_buf, A, M * K), lda, cpu::bf16_rounded(b_buf, B, K * N),
              ldb, beta, C, ldc);
  }
};

#ifdef TITAN_HAVE_DNNL
// oneDNN matmul on bf16 copies of the operands (a weight's registered bf16 image when there is one). The
// row count varies per expert and step, so M and K are runtime dimensions: one primitive per GEMM kind
// (transposes, N, strides, beta), not per shape.
struct Bf16OneDnnGemm {
  using memory = dnnl::memory;
  static constexpr int64_t kRuntime = DNNL_RUNTIME_DIM_VAL;
  struct Kind {
    bool ta, tb;
    int64_t N, lda, ldb, ldc;
    bool accumulate;
    bool operator<(const Kind& o) const {
      return std::tie(ta, tb, N, lda, ldb, ldc, accumulate) <
             std::tie(o.ta, o.tb, o.N, o.lda, o.ldb, o.ldc, o.accumulate);
    }
  };
  static dnnl::engine& engine() {
    static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
    return eng;
  }
  static memory::dims a_strides(const Kind& k) {
    return k.ta ? memory::dims{1, k.lda} : memory::dims{k.lda, 1};
  }
  static memory::dims b_strides(const Kind& k) {
    return k.tb ? memory::dims{1, k.ldb} : memory::dims{k.ldb, 1};
  }
  // Primitives run concurrently (one expert per thread), so each thread brings its own scratchpad.
  struct Primitive {
    dnnl::matmul prim;
    memory::desc scratchpad;
  };
  // The shared cache is locked only on a thread's first use of a kind; later calls hit its own map.
  static const Primitive& primitive(const Kind& k) {
    thread_local std::map<Kind, const Primitive*> seen;
    auto hit = seen.find(k);
    if (hit != seen.end()) return *hit->second;
    const Primitive& p = shared_primitive(k);
    seen.emplace(k, &p);
    return p;
  }
  static const Primitive& shared_primitive(const Kind& k) {
    static std::mutex mu;
    static std::map<Kind, Primitive> cache;
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(k);
    if (it != cache.end()) return it->second;
    const memory::desc a({kRuntime, kRuntime}, memory::data_type::bf16, a_strides(k));
    const memory::desc b({kRuntime, k.N}, memory::data_type::bf16, b_strides(k));
    const memory::desc c({kRuntime, k.N}, memory::data_type::f32, memory::dims{k.ldc, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (k.accumulate) {
      dnnl::post_ops po;
      po.append_sum(1.0f);
      attr.set_post_ops(po);
    }
    try {
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, engine());
      return cache.emplace(k, Primitive{dnnl::matmul(pd), pd.scratchpad_desc()}).first->second;
    } catch (const dnnl::error&) {
      fail("moe_experts_bf16: the oneDNN engine has no bf16 matmul for this CPU (it needs ",
           cpu_isa_features(CpuIsa::kAvx512Bf16),
           "; ONEDNN_MAX_CPU_ISA may cap it); use kernels.moe_experts_bf16 = "
           "\"sgemm\"");
    }
  }
  static const uint16_t* to_bf16(std::vector<uint16_t>& buf, const float* x, int64_t n) {
    if ((int64_t)buf.size() < n) buf.resize(n);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) buf[i] = f32_to_bf16(x[i]);
    return buf.data();
  }
  void operator()(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                  const float* B, int64_t ldb, float beta, float* C, int64_t ldc) const {
    TITAN_CHECK(lda == (ta ? M : K) && ldb == (tb ? K : N), "moe_experts_bf16: operands must be dense");
    thread_local std::vector<uint16_t> a_buf, b_buf;
    thread_local std::vector<uint8_t> scratch;
    const uint16_t* a = to_bf16(a_buf, A, M * K);
    const uint16_t* b = find_bf16_image(B, K * N);
    if (!b) b = to_bf16(b_buf, B, K * N);
    const Kind kind{ta, tb, N, lda, ldb, ldc, beta != 0.0f};
    const Primitive& p = primitive(kind);
    if (scratch.size() < p.scratchpad.get_size()) scratch.resize(p.scratchpad.get_size());
    memory ma(memory::desc({M, K}, memory::data_type::bf16, a_strides(kind)), engine(),
              const_cast<uint16_t*>(a));
    memory mb(memory::desc({K, N}, memory::data_type::bf16, b_strides(kind)), engine(),
              const_cast<uint16_t*>(b));
    memory mc(memory::desc({M, N}, memory::data_type::f32, memory::dims{ldc, 1}), engine(), C);
    dnnl::stream s(engine());
    memory pad(p.scratchpad, engine(), scratch.data());
    p.prim.execute(
        s, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}, {DNNL_ARG_SCRATCHPAD, pad}});
    s.wait();
  }
};
#endif

// Stable counting sort of token slots by expert: order (R), row_of (R), offsets (E+1).
void build_route_tables(const int32_t* idx, int64_t R, int64_t E, int32_t* order, int32_t* row_of,
                        int32_t* offsets) {
  std::memset(offsets, 0, (E + 1) * sizeof(int32_t));
  for (int64_t i = 0; i < R; ++i) ++offsets[idx[i] + 1];
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  // offsets[e] serves as the cursor of expert e; afterwards it holds the end of e = start of e+1.
  for (int64_t i = 0; i < R; ++i) {
    const int32_t r = offsets[idx[i]]++;
    order[r] = static_cast<int32_t>(i);
    row_of[i] = r;
  }
  for (int64_t e = E; e > 0; --e) offsets[e] = offsets[e - 1];
  offsets[0] = 0;
}

// dst[r] = src[order[r] / k]      src (N,C), dst (R,C)
void gather_rows(float* dst, const float* src, const int32_t* order, int64_t R, int64_t k, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) std::memcpy(dst + r * C, src + (order[r] / k) * C, C * sizeof(float));
}

// Runs body(e, row0, rows) for every expert with rows. Many small groups: one expert per thread with
// single-threaded BLAS (OpenBLAS sees the enclosing parallel region); few large groups: serial loop with
// multi-threaded BLAS inside each GEMM.
template <class F>
void for_each_expert(const int32_t* offsets, int64_t E, F&& body) {
  int64_t active = 0;
  for (int64_t e = 0; e < E; ++e) active += offsets[e + 1] > offsets[e];
  if (active >= omp_get_max_threads() && omp_get_max_threads() > 1) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t e = 0; e < E; ++e)
      if (offsets[e + 1] > offsets[e]) body(e, offsets[e], offsets[e + 1] - offsets[e]);
  } else {
    for (int64_t e = 0; e < E; ++e)
      if (offsets[e + 1] > offsets[e]) body(e, offsets[e], offsets[e + 1] - offsets[e]);
  }
}

template <class Gemm>
void moe_forward(float* out, const MoeExpertsBuffers& buf, const float* x, const int32_t* idx, const float* w,
                 const float* w_gu, const float* w_down, int64_t N, int64_t k, int64_t E, int64_t H,
                 int64_t I) {
  const Gemm gemm;
  const int64_t R = N * k;
  build_route_tables(idx, R, E, buf.order, buf.row_of, buf.offsets);
  float* xy = buf.scratch;  // (R,H): gathered inputs, then (per expert, after its GU GEMM) expert outputs
  gather_rows(xy, x, buf.order, R, k, H);
  for_each_expert(buf.offsets, E, [&](int64_t e, int64_t r0, int64_t rows) {
    // GU_e (rows,2I) = X_e (rows,H) @ W_gu_e^T
    gemm(false, true, rows, 2 * I, H, xy + r0 * H, H, w_gu + e * 2 * I * H, H, 0.0f, buf.gu + r0 * 2 * I,
         2 * I);
    for (int64_t r = r0; r < r0 + rows; ++r) {
      const float* g = buf.gu + r * 2 * I;
      float* a = buf.act + r * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) a[i] = g[i] / (1.0f + std::exp(-g[i])) * g[I + i];
    }
    // Y_e (rows,H) = act_e (rows,I) @ W_down_e^T, written over X_e (no longer needed)
    gemm(false, true, rows, H, I, buf.act + r0 * I, I, w_down + e * H * I, I, 0.0f, xy + r0 * H, H);
  });
  // Unpermute + weighted combine; slots of a token summed in order s (deterministic).
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* o = out + n * H;
    std::memset(o, 0, H * sizeof(float));
    for (int64_t s = 0; s < k; ++s) {
      const float ws = w[n * k + s];
      const float* y = xy + (int64_t)buf.row_of[n * k + s] * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) o[h] += ws * y[h];
    }
  }
}

template <class Gemm>
void moe_backward(float* dx, float* dw, float* dw_gu, float* dw_down, const MoeExpertsBuffers& buf,
                  const float* dout, const float* x, const int32_t* idx, const float* w, const float* w_gu,
                  const float* w_down, int64_t N, int64_t k, int64_t E, int64_t H, int64_t I) {
  const Gemm gemm;
  const int64_t R = N * k;
  float* d = buf.scratch;       // (R,H) gathered dout, later dX
  float* g = d + R * H;         // (R,I) down_e^T dout, then dact in place
  float* wact = g + R * I;      // (R,I) w * act
  float* dgu = wact + R * I;    // (R,2I)
  float* xp = dgu + R * 2 * I;  // (R,H) gathered x
  gather_rows(d, dout, buf.order, R, k, H);
  for_each_expert(buf.offsets, E, [&](int64_t e, int64_t r0, int64_t rows) {
    // G_e (rows,I) = D_e (rows,H) @ W_down_e (H,I)
    gemm(false, false, rows, I, H, d + r0 * H, H, w_down + e * H * I, I, 0.0f, g + r0 * I, I);
    for (int64_t r = r0; r < r0 + rows; ++r) {
      const int32_t slot = buf.order[r];
      const float ws = w[slot];
      float* gr = g + r * I;
      const float* a = buf.act + r * I;
      float* wa = wact + r * I;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < I; ++i) dot += gr[i] * a[i];
      dw[slot] += dot;  // each slot is owned by exactly one row: no race
      const float* gu = buf.gu + r * 2 * I;
      float* dg = dgu + r * 2 * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        wa[i] = ws * a[i];
        const float da = ws * gr[i], gate = gu[i], up = gu[I + i];
        const float sg = 1.0f / (1.0f + std::exp(-gate));
        dg[i] = da * up * sg * (1.0f + gate * (1.0f - sg));
        dg[I + i] = da * gate * sg;
      }
    }
    // dW_down_e (H,I) += D_e^T (H,rows) @ wact_e (rows,I)
    gemm(true, false, H, I, rows, d + r0 * H, H, wact + r0 * I, I, 1.0f, dw_down + e * H * I, I);
  });
  gather_rows(xp, x, buf.order, R, k, H);
  for_each_expert(buf.offsets, E, [&](int64_t e, int64_t r0, int64_t rows) {
    // dW_gu_e (2I,H) += dGU_e^T (2I,rows) @ X_e (rows,H)
    gemm(true, false, 2 * I, H, rows, dgu + r0 * 2 * I, 2 * I, xp + r0 * H, H, 1.0f, dw_gu + e * 2 * I * H,
         H);
    // dX_e (rows,H) = dGU_e (rows,2I) @ W_gu_e (2I,H), over the gathered dout rows of this expert
    gemm(false, false, rows, H, 2 * I, dgu + r0 * 2 * I, 2 * I, w_gu + e * 2 * I * H, H, 0.0f, d + r0 * H, H);
  });
  // Unpermute: dx[n] += sum_s dX[row_of[n,s]]
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* o = dx + n * H;
    for (int64_t s = 0; s < k; ++s) {
      const float* src = d + (int64_t)buf.row_of[n * k + s] * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) o[h] += src[h];
    }
  }
}

const MoeExpertsKernels kMoeGrouped{moe_forward<F32Gemm>, moe_backward<F32Gemm>};
TITAN_REGISTER_KERNEL(MoeExpertsKernels, CPU, "grouped", kMoeGrouped, 10);
const MoeExpertsBf16Kernels kMoeBf16Reference{moe_forward<Bf16ReferenceGemm>,
                                              moe_backward<Bf16ReferenceGemm>};
TITAN_REGISTER_REFERENCE_KERNEL(MoeExpertsBf16Kernels, CPU, "reference", kMoeBf16Reference, 0);
const MoeExpertsBf16Kernels kMoeBf16Sgemm{{moe_forward<Bf16RoundedGemm>, moe_backward<Bf16RoundedGemm>}};
TITAN_REGISTER_KERNEL(MoeExpertsBf16Kernels, CPU, "sgemm", kMoeBf16Sgemm, 5);
#ifdef TITAN_HAVE_DNNL
// oneDNN has bf16 matmul kernels from AVX512_BF16 on (AMX where present).
const MoeExpertsBf16Kernels kMoeBf16OneDnn{{moe_forward<Bf16OneDnnGemm>, moe_backward<Bf16OneDnnGemm>}};
TITAN_REGISTER_KERNEL_ONCE(MoeExpertsBf16Kernels, CPU, "onednn", kMoeBf16OneDnn, 10, CpuIsa::kAvx512Bf16);
TITAN_KERNEL_DEFAULT_CONDITION(MoeExpertsBf16Kernels, CPU, "onednn", cpu_bf16_dot_products_slow);
#endif

}  // namespace
}  // namespace titan
