// `titan forward`: logits, loss, gradients and K AdamW steps of a model on a given batch, written to
// safetensors with HF parameter names (the debugging tool behind the golden tests).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "models/qwen3/model.h"

namespace titan {

struct ForwardToolOptions {
  std::string model_dir;
  std::string input_path;
  std::string output_path;
  bool grads = false;
  int64_t steps = 0;
  float lr = 1e-3f;  // torch.optim.AdamW defaults
  float weight_decay = 0.01f;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  double max_norm = 0;  // <= 0: no clipping
  DType dtype = DType::F32;
  Device device;  // where the model lives and runs (inputs and outputs stay in host memory)
  KernelChoice kernels;
  // LoRA: a PEFT adapter dir (adapter_config.json + adapter_model.safetensors) put on the model; the base is
  // frozen, grads/params are written for the adapter tensors only (PEFT names), AdamW steps the adapters.
  std::string lora_dir;
  bool lora_bf16_base = false;  // hold the frozen base in bf16 (default f32, as PEFT's fp32 goldens)
};

struct TokenBatch {
  int64_t B = 0, T = 0;
  std::vector<int32_t> input_ids, labels;  // (B,T) row-major; labels default to input_ids
};

// Parses {"input_ids": [[...]], "labels": [[...]]}; errors name the file and the field.
TokenBatch read_token_batch_json(const std::string& path);

void run_forward_tool(const ForwardToolOptions& opts);

}  // namespace titan
