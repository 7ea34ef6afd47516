// AdamW (torch semantics), clip_grad_norm_ semantics and torchtitan's warmup-stable-decay schedule.
#include <cmath>

#include "core/error.h"
#include "optim/optimizer.h"
#include "support/testing.h"

namespace titan {
namespace {

TEST(AdamW, MatchesTorchFormulaStepByStep) {
  // torch.optim.AdamW single-tensor path, written out in double for one element.
  const float lr = 0.01f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f;
  Tensor p = Tensor::from_vector({0.5f, -1.0f, 2.0f}, {3});
  Tensor g = Tensor::from_vector({0.1f, -0.2f, 0.0f}, {3});
  AdamW opt({p}, {g}, AdamWConfig{lr, b1, b2, eps, wd});
  double pp[3] = {0.5, -1.0, 2.0}, m[3] = {}, v[3] = {};
  for (int step = 1; step <= 4; ++step) {
    opt.step(lr);
    for (int i = 0; i < 3; ++i) {
      double gi = g.f32()[i];
      pp[i] *= 1 - double(lr) * wd;
      m[i] = b1 * m[i] + (1 - b1) * gi;
      v[i] = b2 * v[i] + (1 - b2) * gi * gi;
      double denom = std::sqrt(v[i]) / std::sqrt(1 - std::pow(double(b2), step)) + eps;
      pp[i] -= lr / (1 - std::pow(double(b1), step)) * m[i] / denom;
      EXPECT_NEAR(p.f32()[i], pp[i], 1e-6 * std::max(1.0, std::abs(pp[i]))) << "step " << step << " i " << i;
    }
  }
  EXPECT_EQ(opt.step_count(), 4);
  // Zero gradient: only the decoupled weight decay acts.
  EXPECT_NEAR(p.f32()[2], 2.0 * std::pow(1 - 0.001, 4), 1e-6);
}

TEST(ClipGradNorm, ScalesOnlyAboveMaxNorm) {
  Tensor a = Tensor::from_vector({3, 0}, {2}), b = Tensor::from_vector({4}, {1});
  std::vector<Tensor> grads{a, b};
  EXPECT_DOUBLE_EQ(clip_grad_norm(grads, 10.0), 5.0);
  EXPECT_EQ(a.f32()[0], 3.0f);  // norm below max: untouched
  EXPECT_NEAR(clip_grad_norm(grads, 1.0), 5.0, 1e-9);
  const float coef = 1.0f / (5.0f + 1e-6f);
  EXPECT_FLOAT_EQ(a.f32()[0], 3.0f * coef);
  EXPECT_FLOAT_EQ(b.f32()[0], 4.0f * coef);
  EXPECT_NEAR(std::sqrt(grad_sq_norm(grads)), 1.0, 1e-5);
}

TEST(ClipGradNorm, CoefficientFusedIntoAdamWEqualsClipThenStep) {
  EXPECT_EQ(clip_coefficient(5.0, 10.0), 1.0f);  // below max_norm: no scaling
  EXPECT_EQ(clip_coefficient(5.0, 0.0), 1.0f);   // max_norm <= 0: clipping off
  EXPECT_FLOAT_EQ(clip_coefficient(5.0, 1.0), 1.0f / (5.0f + 1e-6f));
  // The trainer's path (norm, then AdamW::step with the coefficient) against torch's order
  // (clip_grad_norm_ scales the gradients in place, then the step).
  const std::vector<float> p0{0.5f, -1.0f, 2.0f, 0.25f}, g0{3.0f, -4.0f, 1.0f, 0.5f};
  Tensor p_fused = Tensor::from_vector(p0, {4}), g_fused = Tensor::from_vector(g0, {4});
  Tensor p_torch = Tensor::from_vector(p0, {4}), g_torch = Tensor::from_vector(g0, {4});
  AdamW fused({p_fused}, {g_fused}, AdamWConfig{0.01f, 0.9f, 0.999f, 1e-8f, 0.1f});
  AdamW torch_order({p_torch}, {g_torch}, AdamWConfig{0.01f, 0.9f, 0.999f, 1e-8f, 0.1f});
  std::vector<Tensor> gt{g_torch};
  for (int step = 0; step < 3; ++step) {
    const double norm = std::sqrt(grad_sq_norm({g_fused}));
    fused.step(0.01f, clip_coefficient(norm, 1.0));
    EXPECT_DOUBLE_EQ(clip_grad_norm(gt, 1.0), norm);
    torch_order.step(0.01f);
    for (int i = 0; i < 4; ++i) {
      g_torch.f32()[i] = g0[i];  // the next step's gradient, as a fresh backward would leave it
      EXPECT_NEAR(p_fused.f32()[i], p_torch.f32()[i], 1e-7) << "step " << step << " i " << i;
      EXPECT_EQ(g_fused.f32()[i], g0[i]) << "the fused path leaves the gradients as they are";
    }
  }
}

TEST(LRSchedule, WarmupThenLinearDecayAsTorchtitan) {
  // 10 steps, 2 warmup, decay over the rest; torchtitan adds a virtual last step (stable = 1).
  LRSchedule s({2, -1, "linear", 0.0}, 10);
  EXPECT_DOUBLE_EQ(s.factor(0), 0.5);
  EXPECT_DOUBLE_EQ(s.factor(1), 1.0);
  EXPECT_DOUBLE_EQ(s.factor(2), 1.0);              // the stable (virtual) step
  EXPECT_NEAR(s.factor(3), 1.0 - 1.0 / 8, 1e-12);  // progress (3+1-2-1)/8
  EXPECT_NEAR(s.factor(9), 1.0 - 7.0 / 8, 1e-12);  // never reaches 0 inside the run
}

TEST(LRSchedule, CosineWithMinFactorAndDecayRatio) {
  LRSchedule s({0, 0.5, "cosine", 0.1}, 10);  // 5 decay steps, stable 6 (incl. the virtual step)
  for (int i = 0; i < 6; ++i) EXPECT_DOUBLE_EQ(s.factor(i), 1.0);
  const double progress = (6 + 1 - 6) / 5.0;
  EXPECT_NEAR(s.factor(6), 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * progress)), 1e-12);
  EXPECT_GE(s.factor(9), 0.1);
  LRSchedule c({3, -1, "constant", 0.0}, 10);
  EXPECT_NEAR(c.factor(0), 1.0 / 3, 1e-12);
  EXPECT_DOUBLE_EQ(c.factor(9), 1.0);
  EXPECT_THROW(LRSchedule({0, -1, "exp", 0.0}, 10), Error);
}

}  // namespace
}  // namespace titan
