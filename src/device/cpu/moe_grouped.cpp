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
#include <cblas.h>
#include <omp.h>

#include <cmath>
#include <cstring>

#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan {
namespace {

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

void moe_forward(float* out, const MoeExpertsBuffers& buf, const float* x, const int32_t* idx, const float* w,
                 const float* w_gu, const float* w_down, int64_t N, int64_t k, int64_t E, int64_t H,
                 int64_t I) {
  const int64_t R = N * k;
  build_route_tables(idx, R, E, buf.order, buf.row_of, buf.offsets);
  float* xy = buf.scratch;  // (R,H): gathered inputs, then (per expert, after its GU GEMM) expert outputs
  gather_rows(xy, x, buf.order, R, k, H);
  for_each_expert(buf.offsets, E, [&](int64_t e, int64_t r0, int64_t rows) {
    // GU_e (rows,2I) = X_e (rows,H) @ W_gu_e^T
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, 2 * I, H, 1.0f, xy + r0 * H, H,
                w_gu + e * 2 * I * H, H, 0.0f, buf.gu + r0 * 2 * I, 2 * I);
    for (int64_t r = r0; r < r0 + rows; ++r) {
      const float* g = buf.gu + r * 2 * I;
      float* a = buf.act + r * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) a[i] = g[i] / (1.0f + std::exp(-g[i])) * g[I + i];
    }
    // Y_e (rows,H) = act_e (rows,I) @ W_down_e^T, written over X_e (no longer needed)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, H, I, 1.0f, buf.act + r0 * I, I,
                w_down + e * H * I, I, 0.0f, xy + r0 * H, H);
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

void moe_backward(float* dx, float* dw, float* dw_gu, float* dw_down, const MoeExpertsBuffers& buf,
                  const float* dout, const float* x, const int32_t* idx, const float* w, const float* w_gu,
                  const float* w_down, int64_t N, int64_t k, int64_t E, int64_t H, int64_t I) {
  const int64_t R = N * k;
  float* d = buf.scratch;       // (R,H) gathered dout, later dX
  float* g = d + R * H;         // (R,I) down_e^T dout, then dact in place
  float* wact = g + R * I;      // (R,I) w * act
  float* dgu = wact + R * I;    // (R,2I)
  float* xp = dgu + R * 2 * I;  // (R,H) gathered x
  gather_rows(d, dout, buf.order, R, k, H);
  for_each_expert(buf.offsets, E, [&](int64_t e, int64_t r0, int64_t rows) {
    // G_e (rows,I) = D_e (rows,H) @ W_down_e (H,I)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, I, H, 1.0f, d + r0 * H, H,
                w_down + e * H * I, I, 0.0f, g + r0 * I, I);
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
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, H, I, rows, 1.0f, d + r0 * H, H, wact + r0 * I, I,
                1.0f, dw_down + e * H * I, I);
  });
  gather_rows(xp, x, buf.order, R, k, H);
  for_each_expert(buf.offsets, E, [&](int64_t e, int64_t r0, int64_t rows) {
    // dW_gu_e (2I,H) += dGU_e^T (2I,rows) @ X_e (rows,H)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, 2 * I, H, rows, 1.0f, dgu + r0 * 2 * I, 2 * I,
                xp + r0 * H, H, 1.0f, dw_gu + e * 2 * I * H, H);
    // dX_e (rows,H) = dGU_e (rows,2I) @ W_gu_e (2I,H), over the gathered dout rows of this expert
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, H, 2 * I, 1.0f, dgu + r0 * 2 * I, 2 * I,
                w_gu + e * 2 * I * H, H, 0.0f, d + r0 * H, H);
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

const MoeExpertsKernels kMoeGrouped{moe_forward, moe_backward};
TITAN_REGISTER_KERNEL(MoeExpertsKernels, CPU, "grouped", kMoeGrouped, 10);

}  // namespace
}  // namespace titan
