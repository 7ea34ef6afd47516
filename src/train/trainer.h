// The trainer as components (torchtitan's Trainer): the constructor builds the pieces of a run from a
// TrainConfig in order, each in a function of its own, and train() drives them:
//
//   build_process_group_and_plan   ranks, the run plan (parallel layout, batch shape, memory)
//   build_data                     sources, tokenizer, training and validation loaders (train/dataset.h)
//   build_model                    Qwen3Model, kernels, initial weights      (train/model_setup.h)
//   build_parallelism              FSDP/HSDP/DDP plan, parameter streaming, bf16 master weights
//   build_optimizer                AdamW over dp's parameters, LR schedule
//   build_checkpointing            training-state resume                    (train/checkpointing.h)
//   build_metrics                  MFU peak, console/jsonl logger           (train/metrics.h)
//
// train() runs train_step() per step (micro-batches, gradient reduce, clip, AdamW, metrics),
// validate() every validation.freq steps (forward only, train/evaluate.h), save() at the checkpoint
// interval, then finish() (HF export, loss curve, sample). Everything collective is
// called by every rank; rank 0 ("lead") prints and writes the artifacts.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "distributed/context_parallel.h"
#include "distributed/tensor_parallel.h"
#include "models/qwen3/config.h"
#include "models/qwen3/lora.h"
#include "models/qwen3/model.h"
#include "train/config.h"
#include "train/dataset.h"
#include "train/evaluate.h"
#include "train/model_setup.h"
#include "train/plan.h"

namespace titan {

class PreemptionGuard;
class PipelineStep;

class Qwen3Model;
class LoraAdapters;
class FrozenBf16Base;
class AdamW;
class LRSchedule;
class MetricsLogger;
class PlanStreamer;
namespace dist {
class ProcessGroup;
class DataParallelPlan;
}  // namespace dist
namespace ckpt {
class Reader;
struct Slice;
}  // namespace ckpt

struct TrainResult {
  std::vector<double> losses;  // per step
  std::string export_dir;      // HF checkpoint written at the end ("" if none)
  std::string checkpoint_dir;  // last training checkpoint saved ("" if none)
  int64_t first_step = 1;      // > 1 when the run resumed from a checkpoint
  std::string sample;          // text generated at the end ("" if none)
  bool dry_run = false;
  std::vector<std::pair<int64_t, double>> val_losses;  // (step, validation loss) of every validation
  // > 0: the run stopped after this step on SIGTERM / SIGUSR1 (train/preemption.h), its checkpoint in
  // checkpoint_dir when checkpoint.enable; `titan train` then exits with kPreemptedExitStatus.
  int64_t preempted_at = 0;
};

// The outcome of one optimizer step (train_step).
struct StepOutcome {
  double loss = 0;  // global mean loss of the step (CE, + coef x aux for MoE with aux loss)
  double grad_norm = 0, lr = 0;
  bool skipped = false;                  // non-finite loss with training.skip_nan_inf: no update
  std::optional<EvalResult> validation;  // set by train() when the step was followed by a validation
};

class Trainer {
 public:
  // Builds every component (with cfg.dry_run: validates and prints the plan, allocates nothing).
  explicit Trainer(const TrainConfig& cfg);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Steps from the first (or resumed) step to training.steps, checkpoints on the interval, then
  // finish(). Returns the run's result.
  TrainResult train();
  // One optimizer step `step` (1-based): grad_accum micro-batches forward/backward, loss all-reduce,
  // gradient reduce, expert-bias update, clipping inside AdamW, the bf16 refresh. Collective.
  StepOutcome train_step(int64_t step);
  // The mean loss over the validation set (validation.steps batches per rank, -1: all), forward only,
  // all-reduced over the data-parallel ranks; the loader is rewound first, so every call sees the same
  // windows. Collective. Needs validation.enable.
  EvalResult validate();
  // Saves a training checkpoint after `step` (collective); with hf_export the final one also holds the
  // HF export. Returns the checkpoint directory.
  std::string save(int64_t step, bool hf_export);
  // Loads the training state of the checkpoint found at construction (every rank its own slices).
  void resume();
  // After the last step: streamed parameters back, experts gathered, HF export, loss curve, sample.
  void finish();
  bool preempted(const PreemptionGuard& preemption, int64_t step, bool saved);

  int64_t first_step() const { return first_step_; }
  const RunPlan& plan() const { return plan_; }
  Qwen3Model& model() { return *model_; }

 private:
  void build_process_group_and_plan();
  void check_dry_run();
  void build_data();
  void build_model();
  void build_parallelism();
  void build_mixed_precision_master();
  void build_optimizer();
  void build_checkpointing();
  void build_metrics();
  void print_state_per_rank() const;

  void find_resume_checkpoint();
  void load_initial_weights();
  void refresh_bf16_model();
  void forward_backward(int64_t step, double totals[3]);
  // Compile mode on an accelerator (train/train_compiled.cpp): why this run's step cannot be captured
  // ("" when it can), and the step as a graph: captured after an eager step, launched on every step after.
  std::string compile_refusal() const;
  StepOutcome train_step_captured(int64_t step);
  float micro_batch_grad_scale(const std::vector<data::Batch>& micro) const;
  float micro_batch_aux_scale() const;
  double step_loss(double totals[3]);
  void balance_experts();
  void next_micro_batches(int64_t step, std::vector<data::Batch>& micro);
  bool validation_due(int64_t step) const;
  void log_step(int64_t step, const StepOutcome& s, double seconds);
  void gather_final_model();
  NamedTensors gather_tensor_parallel(bool keep);  // (collective; see trainer_finish.cpp)
  // LoRA ([lora] enable; train/trainer_lora.cpp): frozen base + adapters, data parallel over the adapters,
  // checkpoints of the adapters and their optimizer state, PEFT adapter export.
  void build_lora_model();
  void build_lora_parallelism();
  std::vector<ckpt::Slice> lora_slices(bool for_save);
  LoraConfig lora_config_;  // the adapters' (r, alpha, targets: the adapter file's when one is loaded)
  void gather_lora();
  Qwen3Model::TensorSlicer tp_slicer() const;  // tensor parallel: this rank's slice of a full tensor
  std::unique_ptr<LoraAdapters> lora_full_;    // tensor parallel: the gathered adapters (rank 0's export)
  void export_lora(const std::string& dir);
  void export_hf(const std::string& dir);
  void write_sample();

  TrainConfig cfg_;
  TrainResult result_;
  dist::ProcessGroup* pg_ = nullptr;
  int64_t world_ = 1, rank_ = 0;
  Device device_;  // job.device: where the model, gradients and optimizer state live
  std::map<std::string, std::string> kernels_;  // cfg_.kernels as they apply on device_
  // Collectives over device buffers (gradients, parameters): NCCL on GPUs, else pg_ itself.
  std::shared_ptr<dist::ProcessGroup> device_pg_;
  dist::ProcessGroup& tensor_pg() { return device_pg_ ? *device_pg_ : *pg_; }
  // Tensor parallel (parallelism.tensor_parallel_degree > 1, CPU): groups of tp consecutive ranks hold the
  // slices of one model; the ranks with the same slice form the data-parallel group (data, DDP).
  std::shared_ptr<dist::ProcessGroup> tp_group_, dp_group_;
  std::unique_ptr<dist::TensorParallel> tp_;
  dist::ProcessGroup& dp_pg() { return dp_group_ ? *dp_group_ : tensor_pg(); }
  // Context parallel (parallelism.context_parallel_degree > 1, CPU; mesh pp, dp, cp, tp as torchtitan's): cp_
  // joins the ranks holding chunks of the same sequences (same data-parallel and tensor-parallel index). The
  // data-parallel group holds them too (their gradients are summed like data parallel's; FSDP shards over
  // dp_shard x cp); data_group_ is the ranks that read different batches.
  std::unique_ptr<dist::ContextParallel> cp_;
  std::shared_ptr<dist::ProcessGroup> data_group_;
  dist::ProcessGroup& data_pg() { return data_group_ ? *data_group_ : dp_pg(); }
  // This rank's rows of a batch under context parallel (the batch itself without).
  data::Batch context_parallel_rows(const data::Batch& batch) const;
  void start_context_parallel();
  void build_tensor_parallel_model();
  // Pipeline parallel (parallelism.pipeline_parallel_degree > 1, CPU): pp_group_ holds one rank per stage
  // set (ranks r, r + dp, r + 2 dp, ...: the pipeline dimension outermost, as torchtitan's mesh), dp_group_
  // the ranks of the same stages; with tied embeddings embed_group_ joins the first and the last pipeline
  // rank (their embedding copies' gradients are summed).
  std::shared_ptr<dist::ProcessGroup> pp_group_, embed_group_;
  std::unique_ptr<PipelineStep> pipeline_;
  void build_pipeline_model();
  std::vector<StageRange> pipeline_ranges() const;  // this rank's stages (empty: the whole model)
  void start_pipeline();
  void gather_pipeline_model();
  double pipeline_grad_norm();
  // This rank's seconds of stage compute and of waiting for messages over the steps after the first, and
  // the stage forwards it ran again; reported against the schedule's bubble at the end (collective).
  double pp_busy_s_ = 0, pp_wait_s_ = 0;
  int64_t pp_recomputed_ = 0, pp_steps_ = 0;
  void report_pipeline_bubble();
  dist::TensorParallel::GradBuffers tp_grads();
  void select_device();
  bool lead_ = true;  // rank 0 prints and writes the artifacts
  Qwen3Config mc_;
  RunPlan plan_;

  TrainData data_;  // loaders and the tokenizer of a text dataset

  std::shared_ptr<dist::ProcessGroup> ep_group_;  // expert parallel group (null: none)
  std::unique_ptr<LoraAdapters> lora_;            // declared before model_: the model points at them
  std::unique_ptr<FrozenBf16Base> frozen_base_;
  std::unique_ptr<Qwen3Model> model_;
  bool bf16_ = false, stream_ = false;
  std::vector<Tensor> master_;  // bf16 with full buffers: the f32 master weights
  std::unique_ptr<dist::DataParallelPlan> dp_;
  std::unique_ptr<PlanStreamer> streamer_;
  std::unique_ptr<AdamW> optimizer_;
  // Compile mode: the captured step, the model's buffers epoch it was captured at, the batch its forward
  // reads on the host, the forward's options, the gradients' sum of squares on the device.
  void* step_graph_ = nullptr;
  int64_t step_graph_epoch_ = -1;
  std::vector<data::Batch>
      compile_micro_;  // (the graph reads their host arrays' addresses only when captured)
  std::vector<ForwardOptions> compile_fo_;
  Tensor compile_sq_;
  std::unique_ptr<LRSchedule> schedule_;

  std::string ckpt_folder_, resume_dir_;
  std::unique_ptr<ckpt::Reader> resume_;  // set when the found checkpoint holds training state
  int64_t first_step_ = 1;

  double peak_tflops_ = 0;
  std::unique_ptr<MetricsLogger> metrics_;

  Qwen3Model* export_model_ = nullptr;  // expert parallel: a full model gathered on rank 0 at the end
  std::unique_ptr<Qwen3Model> gathered_;
  NamedTensors gathered_state_;  // tensor parallel: the full parameters gathered on rank 0 at the end
  bool finished_model_ = false;
};

// Runs `config` to completion (or validates and prints the plan with dry_run). Throws titan::Error.
TrainResult run_training(const TrainConfig& config);

}  // namespace titan
