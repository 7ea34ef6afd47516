// Compile mode on an accelerator (`[compile] enable = true`, job.device = "cuda"): the training step is
// captured into a CUDA graph after one eager step and launched on every step after. Inside the graph:
// zero_grad, the forward with its loss kept on the device, the backward, the gradients' sum of squares,
// AdamW with the clip factor computed on the device, the bf16 refresh. Before each launch the host stages
// what changes per step (the batch, the learning rate and step count: copies of host memory, which a
// graph cannot hold); after it, it reads the loss and the gradient norm. The graph is captured again when
// the model has replaced a buffer since (another shape ran, e.g. validation's).
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "device/device.h"
#include "distributed/data_parallel_plan.h"
#include "models/qwen3/model.h"
#include "optim/optimizer.h"
#include "train/trainer.h"

namespace titan {

// What the captured step does not hold yet, each refused with its reason (as torchtitan refuses CUDA graphs
// with pipeline parallel) rather than run eagerly behind the user's back.
std::string Trainer::compile_refusal() const {
  if (world_ > 1)
    return "the captured step runs on one rank (data, tensor, context, pipeline and expert parallel reduce "
           "their gradient norm or statistics on the host)";
  if (plan_.grad_accum > 1) return "gradient accumulation (one micro-batch per captured step)";
  if (cfg_.lora.enable) return "LoRA";
  if (mc_.num_experts > 0) return "MoE models (the aux loss and the expert counts are combined on the host)";
  if (cfg_.training.dataset_format == "chat")
    return "chat data (the loss scale counts each batch's targets on the host)";
  if (cfg_.training.skip_nan_inf)
    return "training.skip_nan_inf (a captured step applies the update before the host sees the loss)";
  return "";
}

StepOutcome Trainer::train_step_captured(int64_t step) {
  StepOutcome s;
  TITAN_CHECK(data_.train->next_batch(compile_batch_), "the dataset ran out of data at step ", step);
  data::Batch& b = compile_batch_;
  ForwardOptions& fo = compile_fo_;
  fo = ForwardOptions{};
  fo.grad_scale = micro_batch_grad_scale({b});  // (text windows: a constant of the run)
  fo.labels_shifted = true;
  fo.loss_on_device = true;
  fo.inputs_staged = true;
  model_->stage_inputs(b.input_ids.data(), b.labels.data(), b.batch_size, b.seq_len, fo);
  s.lr = cfg_.optimizer.lr * schedule_->factor(step - 1);
  optimizer_->stage_step(static_cast<float>(s.lr));
  if (!compile_sq_.defined()) compile_sq_ = Tensor::zeros({1}, DType::F64, device_);
  const float max_norm = static_cast<float>(cfg_.training.max_norm);
  auto step_ops = [&] {
    model_->zero_grad();
    model_->forward(b.input_ids.data(), b.labels.data(), b.batch_size, b.seq_len, fo);
    model_->backward();
    dp_->reduce_grads();
    grad_sq_norm_device(dp_->optimizer_grads(), compile_sq_.data<double>());
    optimizer_->step_staged(compile_sq_.data<double>(), max_norm);
    dp_->after_optimizer_step();
    refresh_bf16_model();
  };
  DeviceInterface& dev = device_interface(device_.type);
  if (step_graph_ && model_->buffers_epoch() != step_graph_epoch_) {
    dev.graph_release(step_graph_);
    step_graph_ = nullptr;
  }
  if (step_graph_) {
    dev.graph_launch(step_graph_);
  } else {
    // Eagerly (what the ops make on first use is made here), then captured for the next steps.
    step_ops();
    const int64_t epoch = model_->buffers_epoch();
    step_graph_ = dev.capture(step_ops);
    TITAN_CHECK(model_->buffers_epoch() == epoch, "compile: the step replaced a model buffer while captured");
    step_graph_epoch_ = epoch;
  }
  const int64_t valid = std::count_if(b.labels.begin(), b.labels.end(), [](int32_t y) { return y >= 0; });
  s.loss = valid > 0 ? model_->device_loss_sum() / static_cast<double>(valid) : std::nan("");
  double sq = 0;
  compile_sq_.copy_to_host(&sq);
  s.grad_norm = std::sqrt(sq);
  TITAN_CHECK(std::isfinite(s.loss), "loss is ", s.loss, " at step ", step, " (compile mode)");
  return s;
}

}  // namespace titan
