// Autoregressive generation over a KV cache: prefill the prompt in one batched forward, then one token per
// step until an end-of-sequence id or max_new_tokens. Plus what `titan generate` / `titan eval` share:
// loading a model directory and its generation settings, and streaming decoded text.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "generate/kv_model.h"
#include "generate/sampler.h"
#include "models/qwen3/model.h"
#include "tokenizer/tokenizer.h"

namespace titan {

struct GenerateOptions {
  int64_t max_new_tokens = 256;
  std::vector<int32_t> eos_ids;  // generation stops after emitting one of these (it is returned)
  SamplingOptions sampling;
};

// Runs `prompt` at the cache's current position (a conversation continues where the cache stands), then
// generates. on_token(id) is called for every new id as it is chosen. Returns the new ids (the stopping
// eos id included, as HF generate). The cache then holds the prompt and every new id but the last.
std::vector<int32_t> generate(KVCacheModel& kv, std::span<const int32_t> prompt, const GenerateOptions& opts,
                              const std::function<void(int32_t)>& on_token = {});

// The model directory's generation settings: eos ids (generation_config.json, else config.json; an int
// or a list) and HF sampling defaults (do_sample, temperature, top_k, top_p) when present.
struct GenerationDefaults {
  std::vector<int32_t> eos_ids;
  SamplingOptions sampling;
};
GenerationDefaults read_generation_defaults(const std::string& model_dir);

// A model directory (config.json + safetensors) loaded for inference; bf16: weights rounded to bf16 and
// the bf16 GEMM engines (Qwen3Model::set_bf16_compute); on the CPU the weights are then held only as bf16
// (a FrozenBf16Base the model owns: 2 bytes a parameter, read one tensor at a time), which the KV-cache
// model reads in place and a full forward streams group by group. Inference only: no gradient buffers
// (forward with compute_grad = false; no backward). lora_dir: a PEFT adapter merged into the f32 weights
// first (before any bf16 rounding). Errors name the directory.
// device: where the model lives and runs (the kernel choices give way to its defaults where they name
// cpu implementations).
std::unique_ptr<Qwen3Model> load_model_dir(const std::string& dir, bool bf16,
                                           const KernelChoice& kernels = {}, const std::string& lora_dir = "",
                                           Device device = Device::cpu());

// Merges the PEFT LoRA adapter in `adapter_dir` into the model's weights (the LoRA room's merge).
void apply_lora_dir(Qwen3Model& model, const std::string& adapter_dir);

// Interactive chat on stdin/stdout: each line is a user turn; the conversation is rendered with the model's
// chat template and the assistant reply streamed. The KV cache keeps the conversation (only the new part of
// the rendering runs each turn). max_context: cache positions (0: min(4096, max_position_embeddings)).
int run_chat(Qwen3Model& model, const Tokenizer& tok, const std::string& model_dir,
             const GenerateOptions& opts, int64_t max_context, const KernelChoice& kernels);

// Incremental detokenisation for streaming: put(id) returns the text that became complete (UTF-8 bytes
// split across byte-level tokens are held back until their character is whole); finish() the rest.
class TextStreamer {
 public:
  explicit TextStreamer(const Tokenizer& tok, bool skip_special_tokens = true)
      : tok_(tok), skip_special_(skip_special_tokens) {}
  std::string put(int32_t id);
  std::string finish();

 private:
  const Tokenizer& tok_;
  bool skip_special_;
  std::vector<int32_t> ids_;  // ids not returned yet (their text ends in an incomplete character)
};

}  // namespace titan
