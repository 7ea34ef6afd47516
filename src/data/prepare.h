// `titan data prepare`: tokenizes text / JSON Lines corpora once into token shards (see
// token_shard.h), so training reads memory-mapped ids and can shuffle every document.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/config.h"
#include "data/encoder.h"

namespace titan::data {

struct PrepareOptions {
  std::vector<std::string> inputs;  // files and directories
  std::string output;               // dataset directory to create
  DataFormat format = DataFormat::Auto;
  DocDelimiter delimiter = DocDelimiter::File;
  std::string text_field = "text";
  std::optional<int32_t> eos_id;       // overrides the tokenizer's end-of-text id
  uint64_t shard_tokens = 1ull << 28;  // a new shard starts at the first document boundary past this
  bool overwrite = false;              // replace an existing output directory
  int threads = 1;                     // documents tokenized in parallel (the encoder must be thread-safe)
  size_t read_buffer_bytes = 1 << 20;
  size_t max_piece_bytes = 64 << 20;
  WarningFn on_warning;
};

struct PrepareStats {
  uint64_t files = 0, empty_files = 0, docs = 0, tokens = 0, shards = 0, invalid_utf8 = 0, bytes = 0;
  double seconds = 0;
};

// Writes everything into a temporary sibling directory and renames it to `output` only when
// complete: on any error (thrown as titan::Error) no partial output is left behind.
PrepareStats prepare_token_dataset(const PrepareOptions& options, const TextEncoder& encoder);

}  // namespace titan::data
