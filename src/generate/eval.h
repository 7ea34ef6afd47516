// Perplexity of a model on a dataset, over exactly the windows training would see: the data layer
// (data::DataLoader) packs the documents of the file(s), each followed by EOS, into one stream in file
// order (no shuffling), cut into consecutive windows of seq_len + 1 tokens, one pass, incomplete tail
// dropped. The loss is the mean cross-entropy over every target token of every window (HF
// ForCausalLMLoss per window, token-weighted across windows); perplexity = exp(loss).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/config.h"
#include "models/qwen3/model.h"

namespace titan {

struct EvalResult {
  double loss = 0;
  double perplexity = 0;
  int64_t tokens = 0;   // target tokens scored
  int64_t windows = 0;  // windows of seq_len + 1 tokens
};

// The loader configuration of an eval of `sources` (text / jsonl / tokens, as training) with the
// tokenizer at `tokenizer` (a tokenizer.json or the model directory holding one).
data::DataConfig eval_data_config(const std::vector<std::string>& sources, const std::string& tokenizer,
                                  int64_t seq_len, data::DataFormat format = data::DataFormat::Auto,
                                  const std::string& text_field = "text");

// Runs the model over the windows, `batch` windows per forward. Errors when there is no whole window.
EvalResult evaluate(Qwen3Model& model, const data::DataConfig& cfg, int64_t batch = 1);

}  // namespace titan
