// Trainer construction: each component of a run built in order by a function of its own.
#include "train/trainer.h"

#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>

#include "checkpoint/checkpoint.h"
#include "core/error.h"
#include "device/device.h"
#include "distributed/data_parallel_plan.h"
#include "distributed/expert_parallel.h"
#include "distributed/nccl.h"
#include "distributed/runtime.h"
#include "distributed/staged_process_group.h"
#include "distributed/tensor_parallel.h"
#include "models/qwen3/lora.h"
#include "models/qwen3/model.h"
#include "optim/optimizer.h"
#include "train/checkpointing.h"
#include "train/metrics.h"
#include "train/pipeline_step.h"
#include "train/plan_streamer.h"

namespace titan {

namespace fs = std::filesystem;

Trainer::Trainer(const TrainConfig& cfg) : cfg_(cfg) {
  cfg_.validate();
  build_process_group_and_plan();
  if (cfg_.dry_run) {
    check_dry_run();
    return;
  }
  if (lead_) {
    fs::create_directories(cfg_.job.dump_folder);
    std::ofstream(fs::path(cfg_.job.dump_folder) / "config.toml") << cfg_.to_toml();
  }
  build_data();
  build_model();
  build_parallelism();
  build_optimizer();
  build_checkpointing();
  build_metrics();
}

Trainer::~Trainer() {
  if (step_graph_) device_interface(device_.type).graph_release(step_graph_);
}

void Trainer::build_process_group_and_plan() {
  pg_ = &dist::init();
  world_ = pg_->size();
  rank_ = pg_->rank();
  lead_ = rank_ == 0;
  const auto& par = cfg_.parallelism;
  const int64_t tp = par.tensor_parallel_degree, pp = par.pipeline_parallel_degree,
                cp = par.context_parallel_degree;
  const int64_t dp_shard = par.data_parallel_shard_degree > 0
                               ? par.data_parallel_shard_degree
                               : world_ / tp / pp / cp / par.data_parallel_replicate_degree;
  mc_ = resolve_model_config(cfg_);
  if (cp > 1) {
    auto refuse = [&](bool bad, const char* what) {
      TITAN_CHECK(!bad, "parallelism.context_parallel_degree = ", cp, ": context parallel does not run with ",
                  what, " yet (titan plan --nproc N plans such layouts)");
    };
    // MoE: the aux-loss statistics are summed over the group; a padded token would count in them.
    refuse(mc_.is_moe() && cfg_.training.seq_len % (2 * cp) != 0,
           str_cat("a MoE model whose training.seq_len (", cfg_.training.seq_len,
                   ") is not a multiple of 2 x context_parallel_degree (", 2 * cp,
                   "; padding would enter the router's statistics)")
               .c_str());
    TITAN_CHECK(world_ % (cp * tp * pp) == 0, "parallelism.context_parallel_degree (", cp,
                ") x tensor_parallel_degree (", tp, ") x pipeline_parallel_degree (", pp,
                ") does not divide the world size ", world_);
  }
  if (pp > 1)
    TITAN_CHECK(world_ % pp == 0, "parallelism.pipeline_parallel_degree = ", pp,
                " does not divide the world size ", world_);
  TITAN_CHECK(world_ % tp == 0, "parallelism.tensor_parallel_degree = ", tp,
              " does not divide the world size ", world_);
  plan_ =
      make_plan(mc_, world_, par.data_parallel_replicate_degree, dp_shard, cfg_.training.local_batch_size,
                cfg_.training.global_batch_size, cfg_.training.seq_len, cfg_.activation_checkpoint.policy(),
                par.expert_parallel_degree, tp, par.enable_sequence_parallel, par.pipeline(), cp,
                cfg_.training.mixed_precision_param == "bfloat16");
  if (cfg_.lora.enable) {
    // LoRA: the frozen base (bf16 or f32) without gradients or optimizer state; the adapters train.
    LoraConfig lc;
    lc.rank = cfg_.lora.rank;
    lc.target_modules = cfg_.lora.target_modules;
    const int64_t adapters = lora_num_params(mc_, lc);
    plan_.param_bytes = plan_.params / tp * (cfg_.lora.base_dtype == "bfloat16" ? 2 : 4) + adapters * 4;
    plan_.grad_bytes = adapters * 4;
    plan_.optimizer_bytes = adapters * 8;
  }
  select_device();
  if (tp > 1) {
    // Groups of tp consecutive ranks (innermost); the ranks holding the same slice across groups. On a
    // device the groups are the device group's (NCCL on GPUs), their host side that of the MPI group.
    // (Under pipeline parallel the data-parallel group is also one pipeline rank's: see below.)
    const int64_t pp_rank = rank_ / (world_ / pp);
    tp_group_ = tensor_pg().split(rank_ / tp, rank_ % tp);
    dp_group_ = tensor_pg().split(static_cast<int>(pp_rank * tp + rank_ % tp), rank_ / tp);
    tp_ = std::make_unique<dist::TensorParallel>(tp_group_, par.enable_sequence_parallel,
                                                 plan_.experts_over_tensor_parallel);
  }
  if (pp > 1) {
    // The pipeline dimension outermost (torchtitan's mesh order pp, dp, tp): world rank = pipeline rank x
    // (dp x tp) + data-parallel index x tp + tensor-parallel index. The pipeline group joins the ranks with
    // the same place inside their stage.
    const int64_t per_stage = world_ / pp, pp_rank = rank_ / per_stage, in_stage = rank_ % per_stage;
    // (On a device the groups are the device group's: the stages' messages move between GPUs, NCCL's sends
    // on their own links so that they progress by themselves as MPI's do.)
    pp_group_ = tensor_pg().split(static_cast<int>(in_stage), static_cast<int>(pp_rank));
    if (tp == 1) dp_group_ = tensor_pg().split(static_cast<int>(pp_rank), static_cast<int>(in_stage));
    // (LoRA: the embedding is frozen, its two copies stay equal without a gradient)
    if (mc_.tie_word_embeddings && !cfg_.lora.enable) {  // (collective over the world: every rank splits)
      const bool ends = pp_rank == 0 || pp_rank == pp - 1;
      embed_group_ =
          tensor_pg().split(static_cast<int>(ends ? in_stage : per_stage + rank_), static_cast<int>(pp_rank));
      if (!ends) embed_group_.reset();
    }
  }
  if (cp > 1) {
    // torchtitan's mesh order pp, dp, cp, tp: world rank = pipeline rank x (dp x cp x tp) + data-parallel
    // index x (cp x tp) + context-parallel index x tp + tensor-parallel index. The data-parallel group
    // (above: a stage's ranks with the same tensor-parallel index) holds the context-parallel ranks.
    const int64_t per_stage = world_ / pp, pp_rank = rank_ / per_stage, in_stage = rank_ % per_stage;
    const int64_t dp = per_stage / (cp * tp), t = in_stage % tp, c = in_stage / tp % cp,
                  d = in_stage / (tp * cp);
    cp_ = std::make_unique<dist::ContextParallel>(
        tensor_pg().split(static_cast<int>((pp_rank * dp + d) * tp + t), static_cast<int>(c)));
    data_group_ = tensor_pg().split(static_cast<int>((pp_rank * cp + c) * tp + t), static_cast<int>(d));
  }
  if (cfg_.job.print_config && lead_)
    std::printf("# titan train: resolved config\n%s", cfg_.to_toml().c_str());
  if (lead_) std::printf("# plan\n%s\n", plan_.describe().c_str());
}

// job.device: an accelerator is picked per rank (rank r on GPU r mod #GPUs for "cuda"), and its
// gradients and parameters travel through NCCL between ranks. What is not yet on the GPU says so here.
void Trainer::select_device() {
  device_ = parse_device(cfg_.job.device, "job.device");
  if (device_.type == DeviceType::CPU) return;
  DeviceInterface& d = device_interface(device_.type);
  const int count = d.device_count();
  TITAN_CHECK(count > 0, "job.device = '", cfg_.job.device,
              "': the CUDA runtime finds no GPU on this machine");
  // "cuda" with several ranks: one GPU per rank of this node (local rank r on GPU r mod #GPUs).
  if (world_ > 1 && cfg_.job.device == "cuda") device_.index = dist::env().local_rank % count;
  d.set_current(device_.index);
  // Between ranks: NCCL on GPUs; other devices stage their buffers through the host group.
  if (world_ > 1)
    device_pg_ = device_.type == DeviceType::CUDA ? dist::make_nccl_group(*pg_)
                                                  : dist::make_host_staged_group(*pg_, device_);
  if (lead_)
    std::printf("device: %s (%d visible)%s\n", device_.str().c_str(), count,
                device_pg_ ? (", collectives: " + device_pg_->backend()).c_str() : "");
}

// Validates everything that can be checked without allocating the model.
void Trainer::check_dry_run() {
  validate_kernel_choice(cfg_.kernels);
  if (!cfg_.checkpoint.initial_load_path.empty() && !fs::exists(cfg_.checkpoint.initial_load_path))
    std::printf("note: checkpoint.initial_load_path '%s' is not present here; a real run needs it\n",
                cfg_.checkpoint.initial_load_path.c_str());
  std::printf("dry run: config valid, nothing allocated\n");
  result_.dry_run = true;
}

void Trainer::build_data() {
  // (the ranks of a tensor-parallel or context-parallel group: one batch)
  data_ = build_train_data(cfg_, data_pg(), mc_.vocab_size);
  if (lead_ && data_.validation) {
    const int64_t steps = cfg_.validation.steps;
    std::printf("validation: %s, every %lld steps and after the last, %s\n", data_.validation_source.c_str(),
                (long long)cfg_.validation.freq,
                steps < 0 ? "the whole set" : str_cat(steps, " batches per rank").c_str());
  }
}

void Trainer::build_model() {
  std::string notes;
  kernels_ = kernels_for_device(cfg_.kernels, device_.type, &notes);
  if (lead_ && !notes.empty()) std::printf("%s", notes.c_str());
  validate_kernel_choice(kernels_, device_.type);
  if (cfg_.compile.enable && device_.type == DeviceType::CUDA) {
    const std::string why = compile_refusal();
    TITAN_CHECK(why.empty(), "compile.enable = true: ", why, " (set compile.enable = false)");
    if (lead_)
      std::printf(
          "compile: the training step is captured into a CUDA graph after one eager step and "
          "launched on every step after\n");
    // The routed experts that a graph can hold: routing and expert GEMM sizes on the device.
    if (mc_.num_experts > 0)
      for (const char* op : {"moe_experts", "moe_experts_bf16"}) {
        auto it = kernels_.find(op);
        if (it != kernels_.end() && it->second != "device_routed" && lead_)
          std::printf(
              "compile: kernels.%s = '%s' routes on the host; the captured step runs 'device_routed'\n", op,
              it->second.c_str());
        kernels_[op] = "device_routed";
      }
  } else if (cfg_.compile.enable && lead_) {  // (config validation refused the other devices)
    std::printf(
        "compile: the CPU device's step is already compiled native code with a fixed memory plan; "
        "there is no graph to capture, compile.enable changes nothing\n");
  }
  if (cfg_.lora.enable) return build_lora_model();
  if (tp_) return build_tensor_parallel_model();
  if (pp_group_) return build_pipeline_model();
  // Expert parallel: groups of expert_parallel_degree consecutive ranks split every sparse layer's experts.
  ep_group_ = dist::make_expert_group(tensor_pg(), static_cast<int>(plan_.expert_parallel));
  model_ = std::make_unique<Qwen3Model>(mc_, kernels_, ep_group_.get(), true, device_);
  model_->init_weights(cfg_.training.seed);
  model_->set_activation_checkpoint_every(cfg_.activation_checkpoint.every());
  model_->set_activation_recompute_ops(cfg_.activation_checkpoint.recompute_ops());
  start_context_parallel();
  export_model_ = model_.get();
  find_resume_checkpoint();
  load_initial_weights();
}

Qwen3Model::TensorSlicer Trainer::tp_slicer() const {
  return [tp = tp_.get()](const std::string& name, const Tensor& full) { return tp->slice(name, full); };
}

// Tensor parallel: this rank's slices of the full model (distributed/tensor_parallel.h).
void Trainer::build_tensor_parallel_model() {
  // Expert parallel: the tensor-parallel group (with sequence parallel and expert_parallel_degree = tp), or
  // groups of expert_parallel_degree consecutive ranks of the data-parallel group (the ranks holding the
  // same tensor-parallel slice) split every sparse layer's experts.
  ep_group_ = tp_->experts_over_group()
                  ? tp_group_
                  : dist::make_expert_group(dp_pg(), static_cast<int>(plan_.expert_parallel));
  model_ = std::make_unique<Qwen3Model>(dist::tensor_parallel_config(mc_, tp_->size()), kernels_,
                                        ep_group_.get(), true, device_, pipeline_ranges());
  find_resume_checkpoint();
  const auto& c = cfg_.checkpoint;
  // HF weights and the seeded init: the full parameters one at a time, of which the rank keeps its slices;
  // a model-only checkpoint: the rank's slices read from it. A checkpoint with training state is resumed
  // slice by slice once the optimizer exists (resume()).
  std::unique_ptr<ckpt::Reader> reader;
  if (!resume_dir_.empty()) reader = std::make_unique<ckpt::Reader>(resume_dir_);
  if (reader && has_training_state(*reader)) {
    resume_ = std::move(reader);
    tp_->init_weights(*model_, mc_, cfg_.training.seed);
  } else if (!reader && c.initial_load_in_hf && !c.initial_load_path.empty()) {
    if (lead_) std::printf("loading HF weights from %s\n", c.initial_load_path.c_str());
    model_->load_hf(c.initial_load_path, tp_slicer());  // one full tensor at a time, sliced
  } else if (reader || !c.initial_load_path.empty()) {  // a model-only checkpoint: the rank's slices
    if (!reader && lead_) std::printf("loading checkpoint weights from %s\n", c.initial_load_path.c_str());
    load_model_from_checkpoint(*model_, reader ? resume_dir_ : c.initial_load_path, lead_, *tp_, mc_);
  } else {
    tp_->init_weights(*model_, mc_, cfg_.training.seed);
  }
  model_->set_tensor_parallel(tp_.get(), tp_->sequence_parallel(), tp_->experts_over_group());
  model_->set_activation_checkpoint_every(cfg_.activation_checkpoint.every());
  model_->set_activation_recompute_ops(cfg_.activation_checkpoint.recompute_ops());
  if (lead_)
    std::printf(
        "tensor parallel: %d ranks per group (%lld heads, %lld KV heads, MLP %lld, vocabulary %lld per rank; "
        "sequence parallel %s)\n",
        tp_->size(), (long long)model_->config().num_attention_heads,
        (long long)model_->config().num_key_value_heads, (long long)model_->config().intermediate_size,
        (long long)model_->config().vocab_size, tp_->sequence_parallel() ? "on" : "off");
  start_context_parallel();
  if (pp_group_) start_pipeline();
}

void Trainer::start_context_parallel() {
  if (!cp_) return;
  model_->set_context_parallel(cp_.get());
  if (lora_)  // (dropout: each row's masks are those of its row in one rank's batch)
    lora_->set_context_parallel(cp_->rank(), cp_->size(),
                                cp_->padded_len(cfg_.training.seq_len) / cp_->size(), cfg_.training.seq_len);
  if (lead_) {
    const int64_t T = cfg_.training.seq_len, Tp = cp_->padded_len(T), S = cp_->size();
    std::printf(
        "context parallel: %lld ranks per sequence, %lld tokens each (two chunks of %lld: rank r holds "
        "chunks "
        "r and %lld - r)%s, ring attention (attention_ring=%s)\n",
        (long long)S, (long long)(Tp / S), (long long)(Tp / S / 2), (long long)(2 * S - 1),
        Tp > T ? str_cat("; seq_len ", T, " padded to ", Tp).c_str() : "",
        model_->kernel_names()["attention_ring"].c_str());
  }
}

data::Batch Trainer::context_parallel_rows(const data::Batch& batch) const {
  if (!cp_) return batch;
  const int64_t B = batch.batch_size, T = batch.seq_len;
  data::Batch out;  // (the rows below, not copies of the whole batch's)
  out.batch_size = B;
  out.seq_len = cp_->padded_len(T) / cp_->size();
  out.step = batch.step;
  out.epoch = batch.epoch;
  out.input_ids = cp_->local_rows(batch.input_ids, B, T, 0);  // padding: token 0, ignored target, its own
  out.labels = cp_->local_rows(batch.labels, B, T, -100);     // document (position 0)
  if (!batch.position_ids.empty()) out.position_ids = cp_->local_rows(batch.position_ids, B, T, 0);
  return out;
}

// Data parallelism (DDP / FSDP / HSDP from the replicate x shard degrees; with one rank a no-op) and
// bf16 mixed precision: bf16 compute with f32 master weights (AdamW steps the master copy, the model
// computes with its bf16-rounded image, refreshed after every step). FSDP/HSDP stream the parameters
// (ZeRO-3): every rank keeps 1/S of the parameters, gradients and optimizer state; a layer group is
// gathered just before its forward/backward and freed after.
void Trainer::build_parallelism() {
  if (lora_) return build_lora_parallelism();
  bf16_ = cfg_.training.mixed_precision_param == "bfloat16";
  // Context parallel: FSDP over dp_shard x cp, as torchtitan's dp_shard_cp mesh dimension; with expert
  // parallel (DDP only) the context-parallel ranks are replicas.
  const bool ep_ddp = plan_.expert_parallel > 1 && !plan_.experts_over_tensor_parallel;
  const int64_t cp = plan_.context_parallel, shard = ep_ddp ? plan_.dp_shard : plan_.dp_shard * cp,
                replicate = ep_ddp ? plan_.dp_replicate * cp : plan_.dp_replicate;
  stream_ = shard > 1;
  if (bf16_ && !stream_) build_mixed_precision_master();
  dp_ = std::make_unique<dist::DataParallelPlan>(
      dp_pg(), static_cast<int>(replicate), static_cast<int>(shard),
      master_.empty() ? model_->flat_params() : master_, model_->flat_grads(), int64_t(25) << 20, stream_,
      // (experts over the tensor-parallel group: each rank's experts are averaged like its slices)
      dist::ExpertParallelLayout{tp_ && tp_->experts_over_group() ? nullptr : ep_group_,
                                 model_->expert_offsets()});
  streamer_ = std::make_unique<PlanStreamer>(*dp_);
  if (stream_) {
    model_->set_param_streamer(streamer_.get());  // drops the full buffers; the shards are f32 master weights
    if (bf16_) {
      model_->set_bf16_compute(true);  // gathered groups are rounded to bf16
      if (lead_) std::printf("mixed precision: bf16 compute, f32 master weights in the FSDP shards\n");
    }
  }
  if (lead_) {  // after the mixed-precision switch, which picks the bf16 engines
    std::printf("kernels:");
    for (auto& [op, impl] : model_->kernel_names()) std::printf(" %s=%s", op.c_str(), impl.c_str());
    std::printf("\n");
  }
  dp_->broadcast_from(0);
  refresh_bf16_model();
  if (lead_ && world_ > 1) std::printf("data parallel: %s\n", dp_->describe().c_str());
}

// bf16 with full buffers: f32 master copies of the parameters; the model computes in bf16.
void Trainer::build_mixed_precision_master() {
  for (auto& p : model_->flat_params()) master_.push_back(p.clone());
  model_->set_bf16_compute(true);
  if (lead_)
    std::printf("mixed precision: bf16 compute (bf16 GEMM operands, f32 accumulation), f32 master weights\n");
}

// The model computes with the bf16-rounded image of the f32 master weights (bf16 with full buffers).
void Trainer::refresh_bf16_model() {
  if (master_.empty()) return;
  for (size_t i = 0; i < master_.size(); ++i) model_->flat_params()[i].copy_from(master_[i]);
  model_->set_bf16_compute(true);
}

void Trainer::build_optimizer() {
  const auto& o = cfg_.optimizer;
  optimizer_ = std::make_unique<AdamW>(
      dp_->optimizer_params(), dp_->optimizer_grads(),
      AdamWConfig{(float)o.lr, (float)o.beta1, (float)o.beta2, (float)o.eps, (float)o.weight_decay},
      o.implementation);
  print_state_per_rank();
  const auto& s = cfg_.lr_scheduler;
  schedule_ = std::make_unique<LRSchedule>(
      LRScheduleConfig{s.warmup_steps, s.decay_ratio, s.decay_type, s.min_lr_factor}, cfg_.training.steps);
}

// Persistent training state on this rank (FSDP/HSDP: shards only, ~16/S bytes per parameter).
void Trainer::print_state_per_rank() const {
  int64_t param_bytes = 0, grad_bytes = 0;
  for (auto& t : model_->flat_params()) param_bytes += t.defined() ? t.nbytes() : 0;
  for (auto& t : model_->flat_grads()) grad_bytes += t.defined() ? t.nbytes() : 0;
  for (auto& t : master_) param_bytes += t.nbytes();
  if (lora_) {  // the frozen base (no gradient, no optimizer state) and the adapters
    if (frozen_base_) param_bytes += frozen_base_->bytes();
    param_bytes += lora_->flat_params()[0].nbytes();
    grad_bytes += lora_->flat_grads()[0].nbytes();
  }
  if (stream_ || dp_->shard_degree() > 1) {
    for (auto& t : dp_->optimizer_params()) param_bytes += t.nbytes();
    for (auto& t : dp_->optimizer_grads()) grad_bytes += t.nbytes();
  }
  const int64_t opt_bytes = optimizer_->state_bytes();
  if (lead_)
    std::printf(
        "state per rank: parameters %.2f MiB, gradients %.2f MiB, optimizer %.2f MiB (%.2f "
        "bytes/parameter)\n",
        param_bytes / 1048576.0, grad_bytes / 1048576.0, opt_bytes / 1048576.0,
        double(param_bytes + grad_bytes + opt_bytes) / double(model_->num_params()));
}

void Trainer::build_checkpointing() {
  if (resume_) resume();
  result_.first_step = first_step_;
}

void Trainer::build_metrics() {
  peak_tflops_ = cfg_.metrics.peak_tflops;
  if (peak_tflops_ > 0) {
    if (lead_) std::printf("MFU peak: %.3f TFLOP/s (metrics.peak_tflops)\n", peak_tflops_);
  } else {
    // The measured rate of the model's GEMM engine, or the CPU's theoretical rate when that is higher (a
    // measurement on a busy machine reads low, and MFU must not pass 100%).
    const double measured = measure_gemm_tflops(model_->matmul_kernels(), model_->device());
    const std::string matmul = model_->kernel_names()["matmul"];
    const int threads = device_interface(DeviceType::CPU).num_threads();
    std::string how;
    const double theory =
        model_->device().type == DeviceType::CPU
            ? cpu_theoretical_tflops(cpu_isa(), matmul.starts_with("bf16:onednn"), threads, &how)
            : 0.0;
    peak_tflops_ = std::max(measured, theory);
    if (lead_) {
      if (theory > measured)
        std::printf(
            "MFU peak: %.3f TFLOP/s (the CPU's theoretical rate, %s; above the measured %.3f of matmul=%s)\n",
            peak_tflops_, how.c_str(), measured, matmul.c_str());
      else
        std::printf(
            "MFU peak: %.3f TFLOP/s (measured rate of the model's GEMM engine, matmul=%s, %d threads%s%s)\n",
            peak_tflops_, matmul.c_str(), threads, theory > 0 ? "; above the theoretical " : "",
            theory > 0 ? how.c_str() : "");
    }
  }
  const std::string jsonl =
      cfg_.metrics.enable_jsonl && lead_ ? (fs::path(cfg_.job.dump_folder) / "metrics.jsonl").string() : "";
  std::string tb_dir;
  if (cfg_.metrics.enable_tensorboard && lead_) {  // torchtitan's layout: one folder per run start
    char stamp[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M", std::localtime(&now));
    tb_dir = (fs::path(cfg_.job.dump_folder) / cfg_.metrics.save_tb_folder / stamp).string();
  }
  metrics_ = std::make_unique<MetricsLogger>(
      jsonl, cfg_.training.steps, cfg_.metrics.progress_bar && world_ == 1, lead_, first_step_ - 1, tb_dir);
  if (!tb_dir.empty()) std::printf("TensorBoard: %s\n", tb_dir.c_str());
}

TrainResult run_training(const TrainConfig& config) {
  Trainer trainer(config);
  return trainer.train();
}

}  // namespace titan
