// The training loop: train() over the steps, train_step() = micro-batches forward/backward, loss and
// gradient reduction, clipping, AdamW; validation every validation.freq steps; metrics per logged step.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "device/device.h"
#include "distributed/data_parallel_plan.h"
#include "distributed/runtime.h"
#include "distributed/tensor_parallel.h"
#include "models/qwen3/model.h"
#include "optim/optimizer.h"
#include "train/metrics.h"
#include "train/pipeline_step.h"
#include "train/preemption.h"
#include "train/trainer.h"

namespace titan {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

TrainResult Trainer::train() {
  if (result_.dry_run) return result_;
  const int64_t last = cfg_.training.steps;
  PreemptionGuard preemption;
  for (int64_t step = first_step_; step <= last; ++step) {
    const double t0 = now_s();
    StepOutcome s = train_step(step);
    const double seconds = now_s() - t0;  // the step alone: tps and MFU leave validation out
    result_.losses.push_back(s.loss);
    if (s.skipped) continue;
    if (validation_due(step)) {
      s.validation = validate();
      result_.val_losses.emplace_back(step, s.validation->loss());
    }
    if (step % cfg_.metrics.log_freq == 0 || step == last || s.validation) log_step(step, s, seconds);
    if (step == last) gather_final_model();
    const bool save_now = cfg_.checkpoint.enable && (step % cfg_.checkpoint.interval == 0 || step == last);
    if (save_now) {
      const bool final_export = step == last && cfg_.checkpoint.last_save_in_hf;
      result_.checkpoint_dir = save(step, final_export);
      if (final_export) result_.export_dir = result_.checkpoint_dir;
    }
    if (step < last && preempted(preemption, step, save_now)) {
      metrics_->finish();
      return result_;
    }
  }
  metrics_->finish();
  finish();
  return result_;
}

// After each step: did any rank get SIGTERM / SIGUSR1? All ranks agree (one all-reduce), then save this
// step's training state (unless this step just saved it: `saved`) and stop.
bool Trainer::preempted(const PreemptionGuard& preemption, int64_t step, bool saved) {
  PreemptionGuard::inject_fault(step, rank_);
  int64_t stop = preemption.requested() ? 1 : 0;
  if (world_ > 1) pg_->all_reduce(&stop, 1, dist::ReduceOp::Max);
  if (!stop) return false;
  result_.preempted_at = step;
  if (cfg_.checkpoint.enable && !saved) result_.checkpoint_dir = save(step, false);
  if (lead_) {
    if (cfg_.checkpoint.enable)
      std::printf("preempted: stopped after step %lld; checkpoint %s; run the same command again to resume\n",
                  (long long)step, result_.checkpoint_dir.c_str());
    else
      std::printf("preempted: stopped after step %lld; nothing saved (checkpoint.enable = false)\n",
                  (long long)step);
    std::fflush(stdout);
  }
  return true;
}

// The micro-batches of one step: forward + backward of each, gradients accumulated. Fills totals with
// this rank's {CE sum, targets, aux-loss sum}.
void Trainer::forward_backward(int64_t step, double totals[3]) {
  model_->zero_grad();
  totals[0] = totals[1] = totals[2] = 0;
  std::vector<data::Batch> micro;
  next_micro_batches(step, micro);
  const float grad_scale = micro_batch_grad_scale(micro);
  if (pipeline_) {
    // Each accumulation step's batch through the pipeline schedule, in micro-batches.
    const int64_t m = plan_.pipeline.microbatches;
    PipelineTotals t;
    for (const data::Batch& batch : micro) {
      ForwardOptions fo;
      fo.grad_scale = grad_scale;
      fo.labels_shifted = true;
      fo.aux_loss_scale =
          mc_.output_router_logits
              ? static_cast<float>(mc_.router_aux_loss_coef * plan_.context_parallel / (plan_.grad_accum * m))
              : 0.0f;
      pipeline_->run(batch, fo, t);
    }
    if (step > first_step_) {  // (the first step's allocations are no steady state)
      pp_busy_s_ += t.busy_s;
      pp_wait_s_ += t.wait_s;
      pp_recomputed_ += t.recomputed;
      ++pp_steps_;
    }
    totals[0] = t.loss_sum;
    totals[1] = t.num_valid;
    totals[2] = t.aux_sum / static_cast<double>(m);  // the micro-batches' mean aux loss
    return;
  }
  for (const data::Batch& batch : micro) {
    ForwardOptions fo;
    fo.grad_scale = grad_scale;
    fo.labels_shifted = true;  // the loader's labels are the next tokens (torchtitan packing)
    if (!batch.position_ids.empty()) fo.position_ids = batch.position_ids.data();  // packed chat rows
    fo.aux_loss_scale = micro_batch_aux_scale();
    ForwardResult r =
        model_->forward(batch.input_ids.data(), batch.labels.data(), batch.batch_size, batch.seq_len, fo);
    model_->backward();
    totals[0] += r.loss_sum;
    totals[1] += static_cast<double>(r.num_valid);
    totals[2] += r.aux_loss;
  }
}

// The step's grad_accum micro-batches from the training data (context parallel: this rank's rows of each).
void Trainer::next_micro_batches(int64_t step, std::vector<data::Batch>& micro) {
  micro.resize(static_cast<size_t>(plan_.grad_accum));
  for (data::Batch& b : micro) {
    TITAN_CHECK(data_.train->next_batch(b), "the dataset ran out of data at step ", step);
    if (cp_) b = context_parallel_rows(b);
  }
}

// d(step loss)/d(row loss): the step's loss is the mean over every target of the global batch (HF
// num_items_in_batch). Packed text windows have a target at every position, so that is
// 1 / (tokens x grad_accum) on every rank; chat rows carry -100 outside the assistant tokens, so their
// targets are counted over the micro-batches and the ranks (the data-parallel average of the gradients
// then makes world / targets the per-rank scale).
float Trainer::micro_batch_grad_scale(const std::vector<data::Batch>& micro) const {
  if (cfg_.training.dataset_format != "chat") {
    // (context parallel: a rank holds 1/cp of each sequence; the gradients are averaged over dp x cp ranks)
    const int64_t tokens_per_micro = cfg_.training.local_batch_size * cfg_.training.seq_len;
    return static_cast<float>(plan_.context_parallel) /
           static_cast<float>(tokens_per_micro * plan_.grad_accum);
  }
  double targets = 0;
  for (const data::Batch& mb : micro)
    targets += static_cast<double>(
        std::count_if(mb.labels.begin(), mb.labels.end(), [](int32_t y) { return y != -100; }));
  if (world_ > 1) pg_->all_reduce(&targets, 1, dist::ReduceOp::Sum);
  return static_cast<float>(static_cast<double>(world_) / std::max(targets, 1.0));
}

StepOutcome Trainer::train_step(int64_t step) {
  if (cfg_.compile.enable && device_.type == DeviceType::CUDA) return train_step_captured(step);
  StepOutcome s;
  double totals[3];
  forward_backward(step, totals);
  s.loss = step_loss(totals);
  if (!std::isfinite(s.loss)) {
    TITAN_CHECK(cfg_.training.skip_nan_inf, "loss is ", s.loss, " at step ", step,
                " (set training.skip_nan_inf = true to skip such steps)");
    if (lead_)
      std::printf("step %lld: loss is %f, step skipped (training.skip_nan_inf)\n", (long long)step, s.loss);
    s.skipped = true;
    return s;
  }
  dp_->reduce_grads();
  // Pipeline parallel with LoRA: each adapter's gradient is non-zero on the pipeline rank running its layer;
  // summed over the pipeline, every pipeline rank holds (and steps) all of them.
  if (lora_ && pp_group_) pp_group_->all_reduce(dp_->optimizer_grads()[0], dist::ReduceOp::Sum);
  // Pipeline parallel with tied embeddings: the first stage's embedding and the last stage's copy used as
  // lm_head get the sum of both gradients (the same AdamW update keeps the copies equal).
  if (embed_group_) embed_group_->all_reduce(dp_->optimizer_grads()[0], dist::ReduceOp::Sum);
  // Tensor parallel: the replicated parameters' partial gradients (q/k norms: each rank's own heads).
  const std::vector<Param>& trained = lora_ ? lora_->params() : model_->params();
  if (tp_) tp_->reduce_replicated_grads(trained, tp_grads());
  balance_experts();
  // Clipping (torch's clip_grad_norm_) is applied inside the optimizer step: one pass fewer over the
  // gradients.
  s.grad_norm = pipeline_ && !lora_ ? pipeline_grad_norm()
                : tp_               ? std::sqrt(tp_->grad_sq_norm(trained, tp_grads()))
                                    : dp_->grad_norm();
  s.lr = cfg_.optimizer.lr * schedule_->factor(step - 1);
  optimizer_->step(static_cast<float>(s.lr), clip_coefficient(s.grad_norm, cfg_.training.max_norm));
  dp_->after_optimizer_step();
  refresh_bf16_model();
  return s;
}

// MoE aux loss: its coefficient split over the micro-batches (each contributes its own aux). Context
// parallel: each rank's rows carry their part of its gradient, averaged over dp x cp ranks like the CE's.
float Trainer::micro_batch_aux_scale() const {
  return mc_.output_router_logits
             ? static_cast<float>(mc_.router_aux_loss_coef * plan_.context_parallel / plan_.grad_accum)
             : 0.0f;
}

// The step's loss from this rank's {CE sum, targets, aux-loss sum} (summed over the ranks here). Packed
// windows have no ignored targets (every position has its next token), so every rank's window mean is the
// plain mean and the data-parallel average of the gradients is the gradient of the global mean.
double Trainer::step_loss(double totals[3]) {
  if (world_ > 1) pg_->all_reduce(totals, 3, dist::ReduceOp::Sum);
  double loss = totals[1] > 0 ? totals[0] / totals[1] : std::nan("");
  // HF MoE loss: CE + router_aux_loss_coef x aux (aux averaged over micro-batches and the ranks reporting it:
  // every rank, or under pipeline parallel those of the last stage).
  if (mc_.num_experts > 0 && mc_.output_router_logits)
    loss += mc_.router_aux_loss_coef * totals[2] /
            static_cast<double>(plan_.grad_accum * (world_ / plan_.pipeline.degree));
  return loss;
}

// Aux-loss-free balancing (model.load_balance_coeff > 0): the global routed-token counts, then the
// expert-bias update; all on the device.
void Trainer::balance_experts() {
  if (mc_.num_experts == 0 || mc_.load_balance_coeff <= 0) return;
  if (dp_pg().size() > 1) dp_pg().all_reduce(model_->expert_token_counts(), dist::ReduceOp::Sum);
  if (tp_ && tp_->experts_over_group())  // each rank of the group routed its own rows
    tp_->group().all_reduce(model_->expert_token_counts(), dist::ReduceOp::Sum);
  model_->update_expert_bias();
}

// The global gradient norm under pipeline parallel: each pipeline rank's part (over its data-parallel
// group), summed over the pipeline; the last stage's tied embedding copy is counted once (on the first).
double Trainer::pipeline_grad_norm() {
  double sq = 0;
  if (tp_) {
    std::vector<Param> counted;
    for (const Param& p : model_->params())
      if (p.group != 0 || !model_->holds_embedding_copy()) counted.push_back(p);
    sq = tp_->grad_sq_norm(counted, tp_grads());
  } else {
    sq = dp_->grad_norm();
    sq *= sq;
    if (model_->holds_embedding_copy()) {
      const double copy = dist::global_grad_norm({dp_->optimizer_grads()[0]}, dp_->grad_shard_group());
      sq -= copy * copy;
    }
  }
  return std::sqrt(std::max(0.0, pp_group_->host_group().all_reduce(sq, dist::ReduceOp::Sum)));
}

// The gradients the optimizer steps (full buffers, or FSDP shards) as the tensor-parallel layout sees them.
dist::TensorParallel::GradBuffers Trainer::tp_grads() {
  dist::TensorParallel::GradBuffers b{
      &dp_->optimizer_grads(), {}, {}, dp_->grad_shard_group(), ep_group_.get()};
  for (int g = 0; g < static_cast<int>(dp_->optimizer_grads().size()); ++g) {
    b.offset.push_back(dp_->optimizer_offset(g));
    b.count.push_back(dp_->optimizer_count(g));
  }
  return b;
}

bool Trainer::validation_due(int64_t step) const {
  return data_.validation && (step % cfg_.validation.freq == 0 || step == cfg_.training.steps);
}

EvalResult Trainer::validate() {
  TITAN_CHECK(data_.validation, "validate(): validation.enable is false, there is no validation data");
  data_.validation->reset();
  return evaluate_loss(*model_, *data_.validation, cfg_.validation.steps, pg_, pipeline_.get(),
                       cp_ ? [this](const data::Batch& b) { return context_parallel_rows(b); } : BatchRows());
}

void Trainer::log_step(int64_t step, const StepOutcome& s, double seconds) {
  // The model's device: its allocator and its memory (host memory for the cpu).
  const DeviceInterface& dev = device_interface(model_->device().type);
  static const double phys_gib =
      (dev.memory_bytes ? dev.memory_bytes() : physical_memory_bytes()) / double(int64_t(1) << 30);
  const auto& mem = dev.allocator->stats;
  StepMetrics m;
  m.step = step;
  m.loss = s.loss;
  m.grad_norm = s.grad_norm;
  m.lr = s.lr;
  m.tokens = cfg_.training.local_batch_size * cfg_.training.seq_len * plan_.grad_accum;
  m.tps = m.tokens / seconds;
  // A rank's share of the FLOPs.
  m.tflops = plan_.flops_per_token * m.tps / 1e12 / plan_.tensor_parallel / plan_.pipeline.degree /
             plan_.context_parallel;
  m.mfu = 100.0 * m.tflops / peak_tflops_;
  m.mem_gib = mem.peak.load() / double(int64_t(1) << 30);
  m.mem_pct = 100.0 * m.mem_gib / phys_gib;
  m.time_s = seconds;
  if (s.validation) {
    m.val_loss = s.validation->loss();
    m.val_ppl = s.validation->perplexity();
  }
  metrics_->log(m);
}

}  // namespace titan
