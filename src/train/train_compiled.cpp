// Compile mode on an accelerator (`[compile] enable = true`, job.device = "cuda"): the training step is
// captured into a CUDA graph after one eager step and launched on every step after. Inside the graph:
// zero_grad, the forward of each micro-batch with its loss kept on the device, its backward, the
// data-parallel gradient reduction, the gradients' sum of squares, AdamW with the clip factor computed on
// the device, the FSDP gather, the bf16 refresh. Before each launch the host stages what changes per step
// (the micro-batches with their loss scale and packing tables, the learning rate and step count: copies of
// host memory, which a graph cannot hold);
// after it, it reads the losses and the gradient norm. The graph is captured again when the model has
// replaced a buffer since (another shape ran, e.g. validation's).
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "device/device.h"
#include "distributed/data_parallel_plan.h"
#include "models/qwen3/lora.h"
#include "models/qwen3/model.h"
#include "optim/optimizer.h"
#include "train/trainer.h"

namespace titan {

// What the captured step does not hold yet, each refused with its reason (as torchtitan refuses CUDA graphs
// with pipeline parallel) rather than run eagerly behind the user's back.
std::string Trainer::compile_refusal() const {
  if (plan_.pipeline.degree > 1)
    return "pipeline parallel (its schedule runs on the host inside the step); data, tensor, context and "
           "expert parallel are captured";
  if (cfg_.training.skip_nan_inf && mc_.num_experts > 0 && mc_.load_balance_coeff > 0)
    return "training.skip_nan_inf with model.load_balance_coeff > 0 (the expert-bias update is not skipped "
           "on the device)";
  return "";
}

// One step: the micro-batches staged (slot k for micro-batch k), the graph launched (or the step run
// eagerly and captured), then the losses and the norm read back. Inside the graph, as in train_step():
// zero_grad, forward + backward of every micro-batch (tensor and context parallel's collectives included),
// the data-parallel reduction (NCCL), tensor parallel's sums of the replicated parameters' gradients, the
// gradients' global sum of squares (its partial sums all-reduced on the device), AdamW with the clip, the
// FSDP gather, the bf16 refresh.
StepOutcome Trainer::train_step_captured(int64_t step) {
  StepOutcome s;
  const int64_t accum = plan_.grad_accum;
  std::vector<data::Batch>& micro = compile_micro_;
  next_micro_batches(step, micro);
  std::vector<ForwardOptions>& fo = compile_fo_;
  fo.assign(static_cast<size_t>(accum), ForwardOptions{});
  // (chat data: the step's targets counted over the micro-batches and the ranks, here on the host)
  const float grad_scale = micro_batch_grad_scale(micro);
  for (int64_t k = 0; k < accum; ++k) {
    const data::Batch& b = micro[k];
    fo[k].grad_scale = grad_scale;
    fo[k].labels_shifted = true;
    fo[k].loss_on_device = true;
    fo[k].inputs_staged = true;
    fo[k].staged_slot = k;
    if (!b.position_ids.empty()) fo[k].position_ids = b.position_ids.data();  // packed chat rows
    fo[k].aux_loss_scale = micro_batch_aux_scale();
    model_->stage_inputs(b.input_ids.data(), b.labels.data(), b.batch_size, b.seq_len, fo[k], k, accum);
    if (lora_) lora_->stage_pass(k, accum);  // (dropout masks: the forward's pass number)
  }
  s.lr = cfg_.optimizer.lr * schedule_->factor(step - 1);
  optimizer_->stage_step(static_cast<float>(s.lr));
  // The gradients' sum of squares in [3] (tensor parallel: its three partial sums before it).
  if (!compile_sq_.defined()) compile_sq_ = Tensor::zeros({4}, DType::F64, device_);
  const float max_norm = static_cast<float>(cfg_.training.max_norm);
  const std::vector<Param>& trained = lora_ ? lora_->params() : model_->params();
  auto step_ops = [&] {
    model_->zero_grad();
    for (int64_t k = 0; k < accum; ++k) {
      const data::Batch& b = micro[k];
      model_->forward(b.input_ids.data(), b.labels.data(), b.batch_size, b.seq_len, fo[k]);
      model_->backward();
    }
    if (cfg_.training.skip_nan_inf) {  // a non-finite loss on any rank: AdamW leaves everything as it is
      double* nonfinite = optimizer_->staged_nonfinite();
      model_->count_nonfinite_losses(nonfinite, accum);
      if (world_ > 1) tensor_pg().all_reduce(nonfinite, 1, dist::ReduceOp::Sum);
    }
    dp_->reduce_grads();
    balance_experts();
    if (tp_) {
      tp_->reduce_replicated_grads(trained, tp_grads());
      tp_->grad_sq_norm_device(trained, tp_grads(), compile_sq_.data<double>());
    } else {
      dp_->grad_sq_norm_device(compile_sq_.data<double>() + 3);
    }
    optimizer_->step_staged(compile_sq_.data<double>() + 3, max_norm);
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
  // This rank's {CE sum, targets, aux-loss sum} summed over the micro-batches in train_step()'s order.
  double totals[3] = {0, 0, 0};
  for (int64_t k = 0; k < accum; ++k) {
    totals[0] += model_->device_loss_sum(k);
    totals[1] += static_cast<double>(
        std::count_if(micro[k].labels.begin(), micro[k].labels.end(), [](int32_t y) { return y >= 0; }));
    if (mc_.num_experts > 0) totals[2] += model_->device_aux_loss(k);
  }
  s.loss = step_loss(totals);
  if (!std::isfinite(s.loss)) {
    TITAN_CHECK(cfg_.training.skip_nan_inf, "loss is ", s.loss, " at step ", step,
                " (compile mode; set training.skip_nan_inf = true to skip such steps)");
    // The graph's AdamW saw the count and left the parameters and moments alone; the step is not counted.
    optimizer_->set_step_count(optimizer_->step_count() - 1);
    if (lead_)
      std::printf("step %lld: loss is %f, step skipped (training.skip_nan_inf)\n", (long long)step, s.loss);
    s.lr = 0;
    s.skipped = true;
    return s;
  }
  double sq = 0;
  compile_sq_.view_at(3, {1}).copy_to_host(&sq);
  s.grad_norm = std::sqrt(sq);
  return s;
}

}  // namespace titan
