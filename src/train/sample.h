// A short text sample from a trained model (the end of a run).
#pragma once
#include <cstdint>
#include <vector>

#include "models/qwen3/model.h"

namespace titan {

// Samples `n` tokens after `prompt` (temperature 0.8, top-k 40, seeded; no stop at eos); the prompt keeps its
// last max_context - n tokens when prompt + sample would exceed max_context positions. Forward only. A model
// with its own weights runs the KV-cache generator (src/generate/, on the model's device); a model with LoRA
// adapters or a streamed (frozen bf16 or sharded) base runs its full forward once per token (the adapters
// and the streamer apply as in training; the sample is short).
std::vector<int32_t> sample_tokens(Qwen3Model& model, std::vector<int32_t> prompt, int64_t n,
                                   int64_t max_context, uint64_t seed);

}  // namespace titan
