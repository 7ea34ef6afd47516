// LoRA fine-tuning in the Trainer ([lora] enable = true): the base model is frozen (bf16 by default, 2 bytes
// per parameter, or f32), the adapters are the only parameters the optimizer, the gradient reduction and
// the checkpoints see. Data parallel (DDP or FSDP degrees) runs over the adapters: only their gradients
// are reduced (FSDP shards the adapters' optimizer state); every rank holds the frozen base (under pipeline
// parallel its stages' part; the adapters are whole on every pipeline rank, their gradients summed over the
// pipeline, so every pipeline rank takes the same optimizer step). Under tensor
// parallel the base and the adapters are the rank's slices (distributed/tensor_parallel.h), made from the
// full ones (read or drawn one tensor at a time), and checkpoints and the PEFT export hold the full adapters.
#include <array>
#include <cstdio>
#include <map>

#include "checkpoint/checkpoint.h"
#include "core/error.h"
#include "distributed/data_parallel_plan.h"
#include "distributed/expert_parallel.h"
#include "distributed/runtime.h"
#include "distributed/tensor_parallel.h"
#include "models/qwen3/lora.h"
#include "models/qwen3/model.h"
#include "optim/optimizer.h"
#include "train/checkpointing.h"
#include "train/plan_streamer.h"
#include "train/trainer.h"

namespace titan {

void Trainer::build_lora_model() {
  const auto& lc = cfg_.lora;
  const auto& c = cfg_.checkpoint;
  TITAN_CHECK(plan_.expert_parallel <= 1,
              "lora.enable: expert parallel is not supported with LoRA (the experts "
              "carry no adapters); set parallelism.expert_parallel_degree = 1");
  const bool bf16_base = lc.base_dtype == "bfloat16";
  TITAN_CHECK(
      !bf16_base || c.initial_load_path.empty() || c.initial_load_in_hf,
      "lora.base_dtype = \"bfloat16\" reads the base from an HF directory; checkpoint.initial_load_in_hf = "
      "false needs lora.base_dtype = \"float32\"");
  LoraConfig cfg;
  cfg.enable = true;
  cfg.rank = lc.rank;
  cfg.alpha = lc.alpha;
  cfg.dropout = lc.dropout;
  cfg.target_modules = lc.target_modules;
  cfg.bf16_base = bf16_base;
  cfg.seed = cfg_.training.seed;
  if (!lc.adapter_path.empty()) {  // the adapter's own r / alpha / targets
    const LoraConfig file = LoraConfig::from_peft_file(lc.adapter_path + "/adapter_config.json");
    cfg.rank = file.rank, cfg.alpha = file.alpha, cfg.target_modules = file.target_modules;
  }
  lora_config_ = cfg;
  const Qwen3Config local = tp_ ? dist::tensor_parallel_config(mc_, tp_->size()) : mc_;
  lora_ = std::make_unique<LoraAdapters>(local, cfg, device_);
  if (tp_) {  // the full adapters on the host (initialised, or read), then this rank's slices
    LoraAdapters full(mc_, cfg);
    if (!lc.adapter_path.empty()) full.load_peft(lc.adapter_path);
    std::map<std::string, const Param*> by_name;
    for (const Param& p : full.params()) by_name[p.name] = &p;
    for (Param& p : lora_->params())
      p.value.copy_from_host(tp_->slice(p.name, by_name.at(p.name)->value).f32());
    lora_->set_tensor_parallel(tp_->rank(), tp_->size());
  } else if (!lc.adapter_path.empty()) {
    lora_->load_peft(lc.adapter_path);
  }
  if (lead_ && !lc.adapter_path.empty()) std::printf("lora: adapters from %s\n", lc.adapter_path.c_str());
  // (pipeline parallel: this rank's stages of the base; every rank holds all the adapters, see
  // build_lora_parallelism)
  model_ = std::make_unique<Qwen3Model>(local, kernels_, nullptr, /*allocate=*/!bf16_base, device_,
                                        pipeline_ranges());
  model_->set_lora(lora_.get());
  if (tp_) model_->set_tensor_parallel(tp_.get(), tp_->sequence_parallel());
  model_->set_activation_checkpoint_every(cfg_.activation_checkpoint.every());
  model_->set_activation_recompute_ops(cfg_.activation_checkpoint.recompute_ops());
  export_model_ = model_.get();
  find_resume_checkpoint();  // a checkpoint of this run holds the adapters; the base is loaded below
  if (!resume_dir_.empty()) {
    auto reader = std::make_unique<ckpt::Reader>(resume_dir_);
    if (has_training_state(*reader)) resume_ = std::move(reader);
  }
  const std::string hf = c.initial_load_in_hf ? c.initial_load_path : "";
  if (lead_)
    std::printf("lora: frozen base %s (%s)\n", hf.empty() ? "randomly initialised" : hf.c_str(),
                bf16_base ? "bfloat16" : "float32");
  if (bf16_base) {
    FrozenBf16Base::Slicer slicer{
        mc_, [this](const std::string& name, const Tensor& full) { return tp_->slice(name, full); }};
    frozen_base_ = std::make_unique<FrozenBf16Base>(*model_, hf, cfg_.training.seed, tp_ ? &slicer : nullptr);
  } else if (tp_) {  // the full f32 base (HF or a checkpoint) sliced, or the seeded init's slices
    if (!hf.empty()) {
      model_->load_hf(hf, tp_slicer());
    } else if (c.initial_load_path.empty()) {
      tp_->init_weights(*model_, mc_, cfg_.training.seed);
    } else {
      load_model_from_checkpoint(*model_, c.initial_load_path, lead_, *tp_, mc_);
    }
  } else {
    model_->init_weights(cfg_.training.seed);
    if (!hf.empty()) model_->load_hf(hf);
    if (!c.initial_load_path.empty() && !c.initial_load_in_hf)
      load_model_from_checkpoint(*model_, c.initial_load_path, lead_);
  }
  if (lead_)
    std::printf("lora: rank %lld, alpha %g, dropout %g, %lld adapter parameters (%.4f%% of %lld)\n",
                (long long)cfg.rank, cfg.alpha, cfg.dropout, (long long)lora_->num_params(),
                100.0 * lora_->num_params() / model_->num_params(), (long long)model_->num_params());
  start_context_parallel();
  if (pp_group_) start_pipeline();
}

void Trainer::build_lora_parallelism() {
  bf16_ = cfg_.training.mixed_precision_param == "bfloat16";
  if (bf16_) model_->set_bf16_compute(true);  // base GEMMs on bf16 operands; the adapters stay f32
  std::vector<int64_t> no_experts = {lora_->num_params()};
  dp_ = std::make_unique<dist::DataParallelPlan>(
      // (context parallel: the adapters sharded over dp_shard x cp, as the full model's parameters)
      dp_pg(), static_cast<int>(plan_.dp_replicate),
      static_cast<int>(plan_.dp_shard * plan_.context_parallel), lora_->flat_params(), lora_->flat_grads(),
      int64_t(25) << 20, /*stream_params=*/false, dist::ExpertParallelLayout{nullptr, no_experts});
  streamer_ = std::make_unique<PlanStreamer>(*dp_);
  dp_->broadcast_from(0);
  if (lead_) {
    std::printf("kernels:");
    for (auto& [op, impl] : model_->kernel_names()) std::printf(" %s=%s", op.c_str(), impl.c_str());
    std::printf("\n");
    if (world_ > 1) std::printf("data parallel (LoRA adapters only): %s\n", dp_->describe().c_str());
  }
}

// The adapters and their AdamW moments where dp puts them (full, or this rank's FSDP shard); under tensor
// parallel each slice at its place in the full adapters' layout. Under pipeline parallel every pipeline
// rank holds the same adapters: pipeline rank 0's data-parallel ranks write them.
std::vector<ckpt::Slice> Trainer::lora_slices(bool for_save) {
  std::vector<ckpt::Slice> out;
  if (for_save && pp_group_ && pp_group_->rank() != 0) return out;
  if (tp_) {
    const LoraAdapters full(mc_, lora_config_);  // the full layout (names, offsets)
    const int64_t n = full.num_params();
    tensor_parallel_slices(
        lora_->params(), full.params(),
        [](int) {
          return std::array<std::string, 3>{"lora/params", "lora/exp_avg", "lora/exp_avg_sq"};
        },
        [n](int) { return n; }, *dp_, *optimizer_, for_save, *tp_, out);
    return out;
  }
  if (for_save && !dp_->saves_state()) return out;
  const int64_t n = lora_->num_params(), off = dp_->optimizer_offset(0), count = dp_->optimizer_count(0);
  out.push_back({"lora/params", n, off, dp_->optimizer_params()[0].view_at(0, {count})});
  out.push_back({"lora/exp_avg", n, off, optimizer_->exp_avg()[0].view_at(0, {count})});
  out.push_back({"lora/exp_avg_sq", n, off, optimizer_->exp_avg_sq()[0].view_at(0, {count})});
  return out;
}

void Trainer::gather_lora() {
  if (!tp_ || dp_pg().rank() != 0) return;
  NamedTensors all = tp_->gather(lora_->params(), lead_);  // collective over rank 0's group
  if (!lead_) return;
  if (!lora_full_) lora_full_ = std::make_unique<LoraAdapters>(mc_, lora_config_);
  std::map<std::string, Param*> by_name;
  for (Param& p : lora_full_->params()) by_name[p.name] = &p;
  for (auto& [name, t] : all) by_name.at(name)->value.copy_from(t);
}

void Trainer::export_lora(const std::string& dir) {
  const LoraAdapters& adapters = lora_full_ ? *lora_full_ : *lora_;
  adapters.save_peft(dir, cfg_.checkpoint.initial_load_in_hf ? cfg_.checkpoint.initial_load_path : "");
}

}  // namespace titan
