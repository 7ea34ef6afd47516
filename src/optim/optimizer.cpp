#include "optim/optimizer.h"

#include <cmath>

#include "core/error.h"
#include "kernels/registry.h"

namespace titan {

AdamW::AdamW(std::vector<Tensor> params, std::vector<Tensor> grads, const AdamWConfig& config,
             const std::string& impl)
    : params_(std::move(params)), grads_(std::move(grads)), config_(config) {
  TITAN_CHECK(params_.size() == grads_.size(), "AdamW: ", params_.size(), " parameter buffers but ",
              grads_.size(), " gradient buffers");
  // The state lives beside the parameters, on their device, and the step runs there.
  const Device device = params_.empty() ? Device::cpu() : params_[0].device();
  for (size_t i = 0; i < params_.size(); ++i) {
    TITAN_CHECK(params_[i].device() == device && grads_[i].device() == device, "AdamW: buffer ", i, " is on ",
                params_[i].device().str(), " / ", grads_[i].device().str(), ", buffer 0 on ", device.str());
    m_.push_back(Tensor::zeros(params_[i].shape(), DType::F32, device));
    v_.push_back(Tensor::zeros(params_[i].shape(), DType::F32, device));
  }
  kernel_ = &get_kernel<AdamWKernels>(device.type, impl);
}

void AdamW::step(float lr, float grad_scale) {
  ++step_;
  for (size_t i = 0; i < params_.size(); ++i)
    kernel_->step(params_[i].f32(), grads_[i].f32(), m_[i].f32(), v_[i].f32(), params_[i].numel(), lr,
                  config_.beta1, config_.beta2, config_.eps, config_.weight_decay, step_, grad_scale);
}

void AdamW::stage_step(float lr) {
  ++step_;
  static_assert(sizeof(AdamWStepScalars) % sizeof(int64_t) == 0);
  const Device device = params_.empty() ? Device::cpu() : params_[0].device();
  if (!scalars_.defined())
    scalars_ = Tensor::empty({int64_t(sizeof(AdamWStepScalars) / sizeof(int64_t))}, DType::I64, device);
  const AdamWStepScalars s =
      adamw_step_scalars(lr, config_.beta1, config_.beta2, config_.weight_decay, step_);
  scalars_.copy_from_host(&s);
}

double* AdamW::staged_nonfinite() {
  TITAN_CHECK(scalars_.defined(), "AdamW::staged_nonfinite before stage_step");
  return &scalars_.data<AdamWStepScalars>()->nonfinite;  // (a device address: never dereferenced here)
}

void AdamW::step_staged(const double* sq_sum, float max_norm) {
  TITAN_CHECK(scalars_.defined(), "AdamW::step_staged before stage_step");
  const auto* s = scalars_.data<AdamWStepScalars>();
  for (size_t i = 0; i < params_.size(); ++i)
    kernel_->step_device(params_[i].f32(), grads_[i].f32(), m_[i].f32(), v_[i].f32(), params_[i].numel(),
                         config_.beta1, config_.beta2, config_.eps, config_.weight_decay, s, sq_sum,
                         max_norm);
}

int64_t AdamW::state_bytes() const {
  int64_t n = 0;
  for (auto& t : m_) n += 2 * t.nbytes();
  return n;
}

double grad_sq_norm(const std::vector<Tensor>& grads) {
  double total = 0;
  for (auto& g : grads)
    total += get_kernel<SumSquaresKernels>(g.device().type).sum_squares(g.f32(), g.numel());
  return total;
}

void grad_sq_norm_device(const std::vector<Tensor>& grads, double* sum) {
  if (grads.empty()) return;
  const DeviceType type = grads[0].device().type;
  device_interface(type).zero(sum, sizeof(double));
  for (auto& g : grads) get_kernel<SumSquaresKernels>(type).sum_squares_device(sum, g.f32(), g.numel());
}

void scale_grads(std::vector<Tensor>& grads, float coef) {
  for (auto& g : grads) get_kernel<ElementwiseKernels>(g.device().type).scale(g.f32(), coef, g.numel());
}

float clip_coefficient(double norm, double max_norm) {
  return max_norm <= 0 ? 1.0f : clip_factor(static_cast<float>(norm), static_cast<float>(max_norm));
}

double clip_grad_norm(std::vector<Tensor>& grads, double max_norm) {
  const double norm = std::sqrt(grad_sq_norm(grads));
  const float coef = clip_coefficient(norm, max_norm);
  if (coef < 1.0f) scale_grads(grads, coef);
  return norm;
}

LRSchedule::LRSchedule(const LRScheduleConfig& config, int64_t total_steps) : config_(config) {
  TITAN_CHECK(config.decay_type == "linear" || config.decay_type == "sqrt" || config.decay_type == "cosine" ||
                  config.decay_type == "constant",
              "lr_scheduler.decay_type '", config.decay_type,
              "' is not one of linear, sqrt, cosine, constant");
  TITAN_CHECK(config.min_lr_factor >= 0 && config.min_lr_factor <= 1,
              "lr_scheduler.min_lr_factor must be in [0, 1]");
  TITAN_CHECK(config.warmup_steps >= 0, "lr_scheduler.warmup_steps must be >= 0");
  warmup_ = std::min<int64_t>(config.warmup_steps, total_steps);
  decay_ = config.decay_ratio >= 0 ? std::llround(total_steps * config.decay_ratio) : total_steps - warmup_;
  if (warmup_ + decay_ > total_steps) decay_ = total_steps - warmup_;
  // A virtual last step keeps the final learning rate above zero (torchtitan).
  stable_ = total_steps + 1 - warmup_ - decay_;
}

double LRSchedule::factor(int64_t step) const {
  if (step < warmup_) return static_cast<double>(step + 1) / static_cast<double>(warmup_);
  if (config_.decay_type == "constant" || step < warmup_ + stable_ || decay_ <= 0) return 1.0;
  const double progress = static_cast<double>(step + 1 - warmup_ - stable_) / static_cast<double>(decay_);
  double adj;
  if (config_.decay_type == "linear")
    adj = 1.0 - progress;
  else if (config_.decay_type == "sqrt")
    adj = 1.0 - std::sqrt(progress);
  else
    adj = 0.5 * (1.0 + std::cos(M_PI * progress));
  return config_.min_lr_factor + (1.0 - config_.min_lr_factor) * adj;
}

}  // namespace titan
