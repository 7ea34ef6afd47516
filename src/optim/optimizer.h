// AdamW (torch.optim.AdamW semantics), global-norm gradient clipping (torch.nn.utils.clip_grad_norm_)
// and torchtitan's warmup-stable-decay LR schedule.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "kernels/ops.h"

namespace titan {

struct AdamWConfig {
  float lr = 8e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
};

// Steps flat parameter buffers with their gradients. State (m, v) lives beside each buffer.
class AdamW {
 public:
  AdamW(std::vector<Tensor> params, std::vector<Tensor> grads, const AdamWConfig& config,
        const std::string& impl = "");
  // One step at learning rate `lr` (the schedule's value) on the gradients times `grad_scale` (the clip
  // coefficient, see clip_coefficient; the gradient buffers are left as they are). Increments the step
  // count first (torch).
  void step(float lr, float grad_scale = 1.0f);
  // Compile mode: the same step with its scalars in device memory, so that a graph can hold it.
  // stage_step(lr) (before the graph's launch: a copy of host memory) increments the step count and writes
  // the step's scalars; step_staged(sq_sum, max_norm) (inside the graph) takes the step from them with the
  // clip factor computed on the device from *sq_sum (grad_sq_norm_device; null: no clipping). Equal to
  // step(lr, clip_coefficient(sqrt(sum), max_norm)), bit for bit.
  void stage_step(float lr);
  void step_staged(const double* sq_sum, float max_norm);
  // The staged step's `nonfinite` count (device memory, 0 as staged): step_staged leaves everything as it is
  // when it is not 0 by then (training.skip_nan_inf in compile mode).
  double* staged_nonfinite();
  int64_t step_count() const { return step_; }
  void set_step_count(int64_t s) { step_ = s; }
  const AdamWConfig& config() const { return config_; }
  std::vector<Tensor>& exp_avg() { return m_; }
  std::vector<Tensor>& exp_avg_sq() { return v_; }
  int64_t state_bytes() const;

 private:
  std::vector<Tensor> params_, grads_, m_, v_;
  AdamWConfig config_;
  const AdamWKernels* kernel_;
  int64_t step_ = 0;
  Tensor scalars_;  // one AdamWStepScalars on the device (stage_step)
};

// Sum of squares of all gradients (double accumulation); the global norm is its sqrt. Separate from
// clipping so a distributed run can all-reduce the sum first.
double grad_sq_norm(const std::vector<Tensor>& grads);
// The same left on the device: *sum (one double in the gradients' device memory) = the sum of squares, bit
// for bit grad_sq_norm's, with no host wait (compile mode).
void grad_sq_norm_device(const std::vector<Tensor>& grads, double* sum);
// torch.nn.utils.clip_grad_norm_'s factor for a total norm: max_norm / (norm + 1e-6) in float, clamped
// to 1; 1 when max_norm <= 0 (no clipping).
float clip_coefficient(double norm, double max_norm);
// torch.nn.utils.clip_grad_norm_: grads *= clip_coefficient(norm, max_norm). Returns the total norm
// before clipping. A training step instead passes the coefficient to AdamW::step (no separate pass).
double clip_grad_norm(std::vector<Tensor>& grads, double max_norm);
void scale_grads(std::vector<Tensor>& grads, float coef);

// torchtitan lr_scheduler: linear warmup, stable, then decay (linear | sqrt | cosine | constant) to
// min_lr_factor; decay_ratio < 0 means "decay over all steps after warmup".
struct LRScheduleConfig {
  int64_t warmup_steps = 0;
  double decay_ratio = -1;
  std::string decay_type = "linear";
  double min_lr_factor = 0.0;
};

class LRSchedule {
 public:
  LRSchedule(const LRScheduleConfig& config, int64_t total_steps);
  // Multiplier for optimizer step `step` (0-based: the first step uses factor(0)), as torch's LambdaLR.
  double factor(int64_t step) const;

 private:
  LRScheduleConfig config_;
  int64_t warmup_ = 0, stable_ = 0, decay_ = 0;
};

}  // namespace titan
