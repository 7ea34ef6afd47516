// Reference routed-experts kernel: one token slot at a time, double accumulators, no permutation.
// The oracle for every other moe_experts implementation. Saved rows are indexed by token slot n*k+s.
#include <cmath>

#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan {
namespace {

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// out[n] = sum_s w[n,s] * down_e(silu(gate_e x[n]) * up_e x[n])
// x (N,H), idx/w (N,k), w_gu (E,2I,H), w_down (E,H,I); saves gu (N*k,2I), act (N*k,I) by slot.
void moe_forward(float* out, const MoeExpertsBuffers& buf, const float* x, const int32_t* idx, const float* w,
                 const float* w_gu, const float* w_down, int64_t N, int64_t k, int64_t E, int64_t H,
                 int64_t I) {
  for (int64_t n = 0; n < N; ++n) {
    const float* xn = x + n * H;
    for (int64_t h = 0; h < H; ++h) out[n * H + h] = 0.0f;
    for (int64_t s = 0; s < k; ++s) {
      const int64_t slot = n * k + s, e = idx[slot];
      const float* wgu = w_gu + e * 2 * I * H;
      const float* wd = w_down + e * H * I;
      float* gu = buf.gu + slot * 2 * I;
      float* act = buf.act + slot * I;
      for (int64_t j = 0; j < 2 * I; ++j) {
        double acc = 0;
        for (int64_t h = 0; h < H; ++h) acc += (double)wgu[j * H + h] * xn[h];
        gu[j] = (float)acc;
      }
      for (int64_t i = 0; i < I; ++i) act[i] = (float)(gu[i] * sigmoid(gu[i]) * gu[I + i]);
      for (int64_t h = 0; h < H; ++h) {
        double acc = 0;
        for (int64_t i = 0; i < I; ++i) acc += (double)wd[h * I + i] * act[i];
        out[n * H + h] += (float)(w[slot] * acc);
      }
    }
  }
}

// With g = down_e^T dout[n] (I):  dw[n,s] += <g, act>;  dact = w g;  dgu = swiglu'(dact);
// dw_down_e += w dout[n] act^T;  dw_gu_e += dgu x[n]^T;  dx[n] += w_gu_e^T dgu
void moe_backward(float* dx, float* dw, float* dw_gu, float* dw_down, const MoeExpertsBuffers& buf,
                  const float* dout, const float* x, const int32_t* idx, const float* w, const float* w_gu,
                  const float* w_down, int64_t N, int64_t k, int64_t E, int64_t H, int64_t I) {
  for (int64_t n = 0; n < N; ++n) {
    const float* xn = x + n * H;
    const float* dy = dout + n * H;
    for (int64_t s = 0; s < k; ++s) {
      const int64_t slot = n * k + s, e = idx[slot];
      const float* wgu = w_gu + e * 2 * I * H;
      const float* wd = w_down + e * H * I;
      const float* gu = buf.gu + slot * 2 * I;
      const float* act = buf.act + slot * I;
      float* dwgu = dw_gu + e * 2 * I * H;
      float* dwd = dw_down + e * H * I;
      const double ws = w[slot];
      double dot = 0;
      for (int64_t i = 0; i < I; ++i) {
        double g = 0;
        for (int64_t h = 0; h < H; ++h) g += (double)wd[h * I + i] * dy[h];
        dot += g * act[i];
        // swiglu backward on dact = w g
        const double a = gu[i], u = gu[I + i], sg = sigmoid(a), da = ws * g;
        const double dgate = da * u * sg * (1.0 + a * (1.0 - sg)), dup = da * a * sg;
        for (int64_t h = 0; h < H; ++h) {
          dwgu[i * H + h] += (float)(dgate * xn[h]);
          dwgu[(I + i) * H + h] += (float)(dup * xn[h]);
          dx[n * H + h] += (float)(dgate * wgu[i * H + h] + dup * wgu[(I + i) * H + h]);
        }
      }
      dw[slot] += (float)dot;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < I; ++i) dwd[h * I + i] += (float)(ws * dy[h] * act[i]);
    }
  }
}

const MoeExpertsKernels kMoeReference{moe_forward, moe_backward};
TITAN_REGISTER_KERNEL(MoeExpertsKernels, CPU, "reference", kMoeReference, 0);

}  // namespace
}  // namespace titan
