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
  KernelChoice kernels;
};

struct TokenBatch {
  int64_t B = 0, T = 0;
  std::vector<int32_t> input_ids, labels;  // (B,T) row-major; labels default to input_ids
};

// Parses {"input_ids": [[...]], "labels": [[...]]}; errors name the file and the field.
TokenBatch read_token_batch_json(const std::string& path);

void run_forward_tool(const ForwardToolOptions& opts);

}  // namespace titan
