// A short text sample from a trained model (the end of a run): top-k sampling without a KV cache.
#pragma once
#include <cstdint>
#include <vector>

#include "models/qwen3/model.h"

namespace titan {

// Samples `n` tokens after `prompt` (temperature 0.8, top-k 40, seeded), recomputing the full context
// (at most max_context tokens) each token: fine for a short sample of a small model. Forward only.
std::vector<int32_t> sample_tokens(Qwen3Model& model, std::vector<int32_t> prompt, int64_t n,
                                   int64_t max_context, uint64_t seed);

}  // namespace titan
