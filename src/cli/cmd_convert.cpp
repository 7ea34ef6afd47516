// titan convert --input DIR --output DIR [--dtype float32|bfloat16] [--max-shard-size BYTES] [--step N]
// Training checkpoint -> HF directory, or HF directory -> training checkpoint (model only, step N,
// written as <output>/step-N), chosen by what --input holds. --input may also be a checkpoint folder
// (the newest complete step-N inside is taken).
// --merge-lora ADAPTER_DIR: add a PEFT LoRA adapter into the weights (W += alpha/r B A, as PEFT's
// merge_and_unload) and write an HF directory (also from an HF --input).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>

#include "checkpoint/checkpoint.h"
#include "cli/cli_errors.h"
#include "cli/command.h"
#include "core/error.h"
#include "models/qwen3/lora.h"
#include "models/qwen3/model.h"
#include "train/checkpointing.h"

namespace {

namespace fs = std::filesystem;

int convert_main(int argc, char** argv) {
  std::string input, output, dtype = "float32", merge_lora;
  int64_t max_shard = int64_t(5) << 30, step = 0;
  CLI::App app{
      "Convert a training checkpoint to an HF directory, or an HF directory to a training checkpoint",
      "titan convert"};
  app.add_option("--input", input, "training checkpoint (step-N or its folder) or HF model directory")
      ->required();
  app.add_option("--output", output,
                 "HF directory (from a checkpoint) or checkpoint folder (from HF; step-N is created inside)")
      ->required();
  app.add_option("--dtype", dtype, "HF export dtype: float32 or bfloat16")->capture_default_str();
  app.add_option("--max-shard-size", max_shard, "HF export: shard above this many bytes")
      ->capture_default_str();
  app.add_option(
      "--merge-lora", merge_lora,
      "PEFT adapter dir (adapter_config.json + adapter_model.safetensors) merged into the weights; "
      "writes an HF directory");
  app.add_option("--step", step, "HF -> checkpoint: the step number to record")->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return titan::cli::exit_on_parse_error(app, e);
  }
  TITAN_CHECK(dtype == "float32" || dtype == "bfloat16", "--dtype '", dtype,
              "': valid values are float32, bfloat16");
  TITAN_CHECK(fs::is_directory(input), "--input ", input, ": no such directory");

  std::string ckpt_dir;
  if (fs::exists(fs::path(input) / "metadata.json")) {
    ckpt_dir = input;
  } else if (!fs::exists(fs::path(input) / "config.json")) {
    ckpt_dir = titan::ckpt::latest(input, true);
    TITAN_CHECK(
        !ckpt_dir.empty(), "--input ", input,
        ": neither a training checkpoint (metadata.json), a folder of complete checkpoints, nor an HF "
        "directory (config.json)");
  }

  if (!ckpt_dir.empty()) {
    titan::ckpt::Reader reader(ckpt_dir);
    const titan::Qwen3Config config = titan::saved_model_config(reader);
    titan::Qwen3Model model(config);
    titan::load_model_from_checkpoint(model, ckpt_dir, true);
    if (!merge_lora.empty()) titan::merge_lora_into(model, merge_lora);
    titan::ckpt::publish_directory(output, [&](const std::string& dir) {
      model.save_hf(dir, dtype == "bfloat16" ? titan::DType::BF16 : titan::DType::F32, max_shard);
      const fs::path tok = fs::path(ckpt_dir) / "tokenizer.json";
      if (fs::exists(tok)) fs::copy_file(tok, fs::path(dir) / "tokenizer.json");
    });
    std::printf("wrote HF directory %s (%s) from checkpoint %s (step %lld)\n", output.c_str(), dtype.c_str(),
                ckpt_dir.c_str(), static_cast<long long>(reader.step()));
    return 0;
  }

  titan::Qwen3Model model(titan::Qwen3Config::from_hf_file((fs::path(input) / "config.json").string()));
  model.load_hf(input);
  if (!merge_lora.empty()) {  // HF + adapter -> merged HF directory (complete or not at all)
    titan::merge_lora_into(model, merge_lora);
    titan::ckpt::publish_directory(output, [&](const std::string& dir) {
      model.save_hf(dir, dtype == "bfloat16" ? titan::DType::BF16 : titan::DType::F32, max_shard);
      for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"})
        if (fs::exists(fs::path(input) / f)) fs::copy_file(fs::path(input) / f, fs::path(dir) / f);
    });
    std::printf("wrote HF directory %s (%s): %s merged with LoRA adapter %s\n", output.c_str(), dtype.c_str(),
                input.c_str(), merge_lora.c_str());
    return 0;
  }
  const std::string dir = titan::save_model_checkpoint(model, output, step);
  std::printf("wrote model-only checkpoint %s from HF directory %s\n", dir.c_str(), input.c_str());
  return 0;
}

}  // namespace

TITAN_COMMAND("convert", "training checkpoint <-> HF directory", convert_main);
