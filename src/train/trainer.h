// The trainer loop: config -> model spec (flavor or HF dir) -> data -> forward/backward with
// gradient accumulation -> clip -> AdamW -> metrics; HF export, loss curve and a sample at the end.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "models/qwen3/config.h"
#include "train/config.h"

namespace titan {

struct TrainResult {
  std::vector<double> losses;  // per step
  std::string export_dir;      // HF checkpoint written at the end ("" if none)
  std::string checkpoint_dir;  // last training checkpoint saved ("" if none)
  int64_t first_step = 1;      // > 1 when the run resumed from a checkpoint
  std::string sample;          // text generated at the end ("" if none)
  bool dry_run = false;
};

// Runs `config` to completion (or validates and prints the plan with dry_run). Throws titan::Error.
TrainResult run_training(const TrainConfig& config);

// The model shape of a run: config.json of model.hf_assets_path when present, else model.flavor;
// model.vocab_size overrides the vocabulary.
Qwen3Config resolve_model_config(const TrainConfig& config);

// The fortune(6) text files of the Debian `fortunes` packages (the embedded default corpus).
std::vector<std::string> fortune_files();

}  // namespace titan
