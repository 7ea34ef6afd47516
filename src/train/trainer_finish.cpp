// The end of a run: the final model in full buffers (experts gathered under expert parallel), the HF
// export (+ tokenizer), the loss curve and a text sample.
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "checkpoint/checkpoint.h"
#include "distributed/tensor_parallel.h"
#include "io/hf_checkpoint.h"
#include "models/qwen3/model.h"
#include "tokenizer/tokenizer.h"
#include "train/metrics.h"
#include "train/sample.h"
#include "train/trainer.h"

namespace titan {

namespace fs = std::filesystem;

// Collective, once: streamed parameters back into full buffers; under expert parallel every expert
// gathered into a full model on rank 0 (HF export, sample).
void Trainer::gather_final_model() {
  if (finished_model_) return;
  finished_model_ = true;
  // LoRA keeps its frozen base where it is (a bf16 base is never expanded to f32 in full); under tensor
  // parallel the full adapters are gathered for the export.
  if (lora_) return gather_lora();
  if (model_->param_streamer()) model_->set_param_streamer(nullptr);
  const bool on_cpu = model_->device().type == DeviceType::CPU;
  const bool want = cfg_.checkpoint.last_save_in_hf || cfg_.training.sample_tokens > 0;
  if (!want) return;
  if (pipeline_) return gather_pipeline_model();
  if (tp_) {
    gathered_state_ = gather_tensor_parallel(lead_);
    if (!lead_) return;
    if (cfg_.training.sample_tokens > 0) {  // the sample needs a model
      gathered_ = std::make_unique<Qwen3Model>(mc_, on_cpu ? cfg_.kernels : KernelChoice{});
      gathered_->load_state_dict(gathered_state_);
      if (mc_.num_experts > 0) gathered_->expert_bias().copy_from(model_->expert_bias());
      export_model_ = gathered_.get();
    }
    return;
  }
  if (ep_group_) {
    NamedTensors all = model_->gathered_state_dict();  // collective over the expert group
    if (lead_) {
      gathered_ = std::make_unique<Qwen3Model>(mc_, on_cpu ? cfg_.kernels : KernelChoice{});
      gathered_->load_state_dict(all);
      gathered_->expert_bias().copy_from(model_->expert_bias());
      export_model_ = gathered_.get();
    }
  }
}

// Tensor parallel: the slices of data-parallel index 0's group gathered into full tensors, kept where `keep`
// (collective over that group); with expert parallel the first expert group's rank 0 gathers every expert
// first (collective over that group), and they replace the keeping rank's own. Other ranks get nothing.
NamedTensors Trainer::gather_tensor_parallel(bool keep) {
  NamedTensors experts;
  const bool in_first_expert_group =
      ep_group_ && (tp_->experts_over_group() ? dp_pg().rank() == 0
                                              : tp_->rank() == 0 && dp_pg().rank() < ep_group_->size());
  if (in_first_expert_group)
    for (auto& [name, t] : model_->gathered_state_dict())
      if (name.find(".mlp.experts.") != std::string::npos) experts.emplace_back(name, t);
  if (dp_pg().rank() != 0) return {};
  NamedTensors all = tp_->gather(*model_, keep);
  if (!keep || !ep_group_) return all;
  NamedTensors merged;
  for (auto& nt : all)
    if (nt.first.find(".mlp.experts.") == std::string::npos) merged.push_back(std::move(nt));
  for (auto& nt : experts) merged.push_back(std::move(nt));
  return merged;
}

// HF export (rank 0): config.json + safetensors (+ tokenizer.json) into `dir`.
void Trainer::export_hf(const std::string& dir) {
  if (lora_) return export_lora(dir);  // the adapters in PEFT format (merge: titan convert --merge-lora)
  const DType dtype = cfg_.checkpoint.export_dtype == "bfloat16" ? DType::BF16 : DType::F32;
  if (!gathered_state_.empty())  // tensor parallel: the gathered full parameters
    save_hf_checkpoint(dir, mc_.to_hf_json(), gathered_state_, dtype);
  else
    export_model_->save_hf(dir, dtype);
  const std::string& tok = data_.tokenizer_path;
  if (tok.empty()) return;
  const fs::path file = fs::is_directory(tok) ? fs::path(tok) / "tokenizer.json" : fs::path(tok);
  fs::copy_file(file, fs::path(dir) / "tokenizer.json", fs::copy_options::overwrite_existing);
}

void Trainer::finish() {
  gather_final_model();
  if (pipeline_) report_pipeline_bubble();
  if (cp_) model_->set_context_parallel(nullptr);  // (the sample runs whole sequences on rank 0)
  if (!lead_) return;
  if (cfg_.checkpoint.last_save_in_hf && !cfg_.checkpoint.enable) {
    const fs::path final_dir = fs::path(ckpt_folder_) / ("step-" + std::to_string(cfg_.training.steps));
    ckpt::publish_directory(final_dir.string(), [this](const std::string& dir) { export_hf(dir); });
    result_.export_dir = final_dir.string();
  }
  if (!result_.export_dir.empty())
    std::printf("saved %s: %s\n", lora_ ? "LoRA adapter (PEFT format)" : "HF checkpoint",
                result_.export_dir.c_str());
  const std::string svg = (fs::path(cfg_.job.dump_folder) / "loss.svg").string();
  std::vector<std::pair<int64_t, double>> val;  // at the index of their step in result_.losses
  for (auto& [step, loss] : result_.val_losses) val.emplace_back(step - first_step_, loss);
  write_loss_svg(svg, result_.losses,
                 "titan train: " + mc_.to_hf_json().value("model_type", "qwen3") + " loss", val);
  std::printf("loss curve: %s\n", svg.c_str());
  if (cfg_.training.sample_tokens > 0 && !data_.tokenizer_path.empty()) {
    if (lora_ && (tp_ || pipeline_))
      std::printf(
          "sample: none under %s parallel with LoRA (each rank holds a part of the base); "
          "titan generate --lora %s samples the adapter\n",
          tp_ ? "tensor" : "pipeline",
          result_.export_dir.empty() ? "<checkpoint>" : result_.export_dir.c_str());
    else
      write_sample();
  }
}

// A sample of the trained model after training.sample_prompt (sample.txt, and on the console).
void Trainer::write_sample() {
  Tokenizer tok = Tokenizer::load(data_.tokenizer_path);
  std::vector<int32_t> prompt = tok.encode(cfg_.training.sample_prompt);
  if (prompt.empty()) prompt.push_back(data_.train->eos_id() >= 0 ? data_.train->eos_id() : 0);
  if (bf16_) export_model_->set_bf16_compute(true);
  auto ids = sample_tokens(*export_model_, prompt, cfg_.training.sample_tokens, cfg_.training.seq_len,
                           cfg_.training.seed);
  result_.sample = cfg_.training.sample_prompt + tok.decode(ids, true);
  std::ofstream(fs::path(cfg_.job.dump_folder) / "sample.txt") << result_.sample << "\n";
  std::printf("sample:\n%s\n", result_.sample.c_str());
}

}  // namespace titan
