// Perplexity of a model on a dataset, over exactly the windows training would see: the data layer
// (data::DataLoader) packs the documents of the file(s), each followed by EOS, into one stream in file
// order (no shuffling), cut into consecutive windows of seq_len + 1 tokens, one pass, incomplete tail
// dropped. The loss is the mean cross-entropy over every target token of every window (HF
// ForCausalLMLoss per window, token-weighted across windows); perplexity = exp(loss). The trainer's
// validation (train/evaluate.h) computes the same quantity over its held-out loader; the result type is
// shared.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/config.h"
#include "models/qwen3/model.h"
#include "train/evaluate.h"

namespace titan {

// The loader configuration of an eval of `sources` (text / jsonl / tokens, as training) with the
// tokenizer at `tokenizer` (a tokenizer.json or the model directory holding one).
data::DataConfig eval_data_config(const std::vector<std::string>& sources, const std::string& tokenizer,
                                  int64_t seq_len, data::DataFormat format = data::DataFormat::Auto,
                                  const std::string& text_field = "text");

// Runs the model forward only over every window of `cfg` (a loader of batch 1, read to its end), `batch`
// windows per forward (the last forward takes the rest: no window is dropped). result.batches counts the
// forwards; *windows (when given) the windows (rows). Errors when there is no whole window.
EvalResult evaluate_dataset(Qwen3Model& model, const data::DataConfig& cfg, int64_t batch = 1,
                            int64_t* windows = nullptr);

}  // namespace titan
