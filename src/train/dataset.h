// The trainer's data: dataset sources (the "fortunes" shorthand), the tokenizer of a text dataset
// (given, or trained by our BPE trainer on the corpus), and the loaders of this rank: training, and
// validation (validation.dataset, or the training.val_fraction held-out split of training.dataset).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/loader.h"
#include "train/config.h"

namespace titan {

namespace dist {
class ProcessGroup;
}

struct TrainData {
  std::vector<std::string> sources;  // training sources, resolved
  std::string tokenizer_path;        // text datasets: the tokenizer used ("" for token shards)
  std::unique_ptr<data::DataLoader> train;
  std::unique_ptr<data::DataLoader> validation;  // null when validation.enable is false
  std::string validation_source;                 // what the validation loader reads, for the log
};

// Builds the training loader of this rank (windows rank, rank + world, ...). Text data: rank 0 trains
// the tokenizer when one is needed, the other ranks wait and load it (collective over `pg`).
TrainData build_train_data(const TrainConfig& cfg, dist::ProcessGroup& pg, int64_t vocab_size);

// The validation loader (one pass: max_epochs = 1, rewound before each evaluation) over the same
// tokenizer and window shape; errors when it cannot fill one batch on every rank.
std::unique_ptr<data::DataLoader> build_validation_loader(const TrainConfig& cfg, const TrainData& data,
                                                          int64_t dp_rank, int64_t dp_world);

// The loader options every split of a run shares (format, tokenizer, window shape, rank layout).
data::DataConfig base_data_config(const TrainConfig& cfg, const std::vector<std::string>& sources,
                                  const std::string& tokenizer_path, int64_t dp_rank, int64_t dp_world);

// Expands the "fortunes" shorthand and checks that the other sources exist (`field` names the key in
// messages).
std::vector<std::string> resolve_sources(const std::vector<std::string>& sources, const std::string& field);

// The fortune(6) text files of the Debian `fortunes` packages (the embedded default corpus).
std::vector<std::string> fortune_files();

}  // namespace titan
