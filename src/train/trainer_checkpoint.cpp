// Trainer checkpoints: finding the checkpoint to resume, the initial weights, resume() and save().
//
// With checkpoint.enable, the newest complete checkpoint in <dump>/<folder> is resumed (rank 0 picks it
// so that every rank reads the same); otherwise checkpoint.initial_load_path gives the initial weights
// (HF directory, or a titan checkpoint with initial_load_in_hf = false).
#include <cstdio>
#include <filesystem>

#include "checkpoint/checkpoint.h"
#include "core/error.h"
#include "distributed/data_parallel_plan.h"
#include "distributed/runtime.h"
#include "distributed/tensor_parallel.h"
#include "models/qwen3/model.h"
#include "optim/optimizer.h"
#include "train/checkpointing.h"
#include "train/trainer.h"

namespace titan {

namespace fs = std::filesystem;

void Trainer::find_resume_checkpoint() {
  ckpt_folder_ = (fs::path(cfg_.job.dump_folder) / cfg_.checkpoint.folder).string();
  if (!cfg_.checkpoint.enable) return;
  int64_t found = -1;
  if (lead_) {
    const std::string dir = ckpt::latest(ckpt_folder_, true);
    if (!dir.empty()) found = ckpt::Reader(dir).step();
  }
  pg_->broadcast(&found, 1, dist::CommType::I64, 0);
  if (found >= 0) resume_dir_ = (fs::path(ckpt_folder_) / ("step-" + std::to_string(found))).string();
}

// A found checkpoint with training state is kept for resume(); a model-only one gives the initial
// weights, as does checkpoint.initial_load_path when nothing was found.
void Trainer::load_initial_weights() {
  const auto& c = cfg_.checkpoint;
  if (!resume_dir_.empty()) {
    auto reader = std::make_unique<ckpt::Reader>(resume_dir_);
    if (has_training_state(*reader)) {
      resume_ = std::move(reader);
    } else {
      if (lead_)
        std::printf("checkpoint: initial weights from the model-only checkpoint %s\n", resume_dir_.c_str());
      load_model_from_checkpoint(*model_, resume_dir_, lead_);
    }
  } else if (!c.initial_load_path.empty()) {
    if (c.initial_load_in_hf) {
      if (lead_) std::printf("loading HF weights from %s\n", c.initial_load_path.c_str());
      model_->load_hf(c.initial_load_path);
    } else {
      if (lead_) std::printf("loading model weights from checkpoint %s\n", c.initial_load_path.c_str());
      load_model_from_checkpoint(*model_, c.initial_load_path, lead_);
    }
  }
}

// Everything is validated before any state is replaced; each rank reads its own slices (any world
// size: the layout is the model's flat groups, not the writer's sharding).
void Trainer::resume() {
  TITAN_CHECK(resume_, "resume: no checkpoint with training state was found in ", ckpt_folder_);
  const ckpt::Reader& reader = *resume_;
  check_resumable(reader, mc_, cfg_, plan_.global_batch);
  const bool saved_lora = reader.meta().value("lora", false);
  TITAN_CHECK(saved_lora == (lora_ != nullptr), "checkpoint ", reader.dir(), ": ",
              saved_lora ? "holds LoRA adapters; set lora.enable = true to resume it"
                         : "holds a full fine-tune; it cannot resume a LoRA run (lora.enable = true)");
  if (lead_)
    std::printf("checkpoint: resuming from %s (step %lld)\n", resume_dir_.c_str(), (long long)reader.step());
  std::vector<ckpt::Slice> wanted =
      lora_ ? lora_slices(false)
            : training_slices(*model_, *dp_, *optimizer_, /*for_save=*/false, tp_.get(), &mc_);
  reader.read(wanted, lead_);
  optimizer_->set_step_count(reader.meta()["optimizer"].at("step").get<int64_t>());
  if (lora_ && reader.meta().contains("lora_dropout_passes")) {
    const auto& passes = reader.meta()["lora_dropout_passes"];
    TITAN_CHECK(passes.is_number_unsigned(), "checkpoint ", reader.dir(),
                "/metadata.json: field 'lora_dropout_passes' must be a non-negative integer");
    lora_->set_passes(passes.get<uint64_t>());
  }
  dp_->after_optimizer_step();  // FSDP/HSDP: the loaded shards into the full parameter buffers
  refresh_bf16_model();
  try {
    data_.train->load_state(reader.meta()["data_loader"]);
  } catch (const Error& e) {
    fail("checkpoint ", reader.dir(), "/metadata.json: field 'data_loader': ", e.what());
  }
  first_step_ = reader.step() + 1;
}

std::string Trainer::save(int64_t step, bool hf_export) {
  ckpt::SaveRequest req;
  req.folder = ckpt_folder_;
  req.step = step;
  req.slices = lora_ ? lora_slices(true)
                     : training_slices(*model_, *dp_, *optimizer_, /*for_save=*/true, tp_.get(), &mc_);
  if (lead_) {
    req.meta = training_metadata(mc_, cfg_, *optimizer_, data_.train->state(), *dp_, plan_.global_batch);
    if (lora_) req.meta["lora"] = true;
    if (lora_) req.meta["lora_dropout_passes"] = lora_->passes();
    if (hf_export) req.extra_files = [this](const std::string& dir) { export_hf(dir); };
    // LoRA: every checkpoint directory is also a PEFT adapter directory.
    if (lora_ && !hf_export) req.extra_files = [this](const std::string& dir) { export_lora(dir); };
  }
  if (lora_) gather_lora();  // tensor parallel: the PEFT export writes the full adapters
  const std::string dir = ckpt::save(*pg_, req);
  if (lead_) ckpt::prune(ckpt_folder_, cfg_.checkpoint.keep_latest_k);
  return dir;
}

}  // namespace titan
