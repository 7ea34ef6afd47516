// Configuration of a dataset and its loader (the trainer maps its [data] config section onto this).
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data/text_reader.h"

namespace titan::data {

enum class DataFormat {
  Auto,    // per source: a directory with index.json or an index.json -> tokens; *.jsonl/*.ndjson -> jsonl;
           // anything else -> text
  Text,    // plain text files, split into documents by `delimiter`
  Jsonl,   // JSON Lines, one document per line in `text_field`
  Tokens,  // pre-tokenized shards written by `titan data prepare`
  Chat,    // JSON Lines conversations for SFT ({"messages": [...]} or prompt / completion), one row each
};
DataFormat parse_data_format(std::string_view name);  // auto | text | jsonl | tokens | chat
std::string to_string(DataFormat f);

enum class Split { Train, Validation };

// Receives warnings (empty files, repaired UTF-8). Unset: printed to stderr.
using WarningFn = std::function<void(const std::string&)>;

struct DataConfig {
  std::vector<std::string> sources;  // files and directories (searched recursively, in sorted order)
  DataFormat format = DataFormat::Auto;
  DocDelimiter delimiter = DocDelimiter::File;  // plain text: what separates documents
  std::string text_field = "text";              // JSON Lines: the field holding the text
  // Text and JSON Lines only: a tokenizer.json (or a directory holding one), or "builtin:bytes"
  // (ids = UTF-8 bytes, EOS = 256) for tests and smoke runs.
  std::string tokenizer;
  std::optional<int32_t> eos_id;  // overrides the tokenizer's / the shards' end-of-text id
  // Chat only: the tokenizer_config.json (or a directory holding one) whose chat_template renders
  // the conversations; empty: the one beside `tokenizer`.
  std::string chat_template;
  // Chat only: padding-free packing (TRL's packing): whole conversations one after another in a row, the
  // Batch's position_ids restarting at each, so attention stays inside each conversation.
  bool packing = false;

  int64_t seq_len = 2048;  // tokens per row; windows hold seq_len + 1 tokens
  int64_t batch_size = 1;  // rows per batch on this rank
  uint64_t seed = 0;       // document order; epoch e uses seed and e
  bool shuffle = true;     // token datasets: every document; text datasets: file order
  int dp_rank = 0;         // this rank sees windows dp_rank, dp_rank + dp_world, ...
  int dp_world = 1;

  double val_fraction = 0.0;   // share of documents held out for validation
  uint64_t split_seed = 1234;  // which documents are held out (independent of `seed`)
  Split split = Split::Train;  // which side this loader reads
  int64_t max_epochs = 0;      // 0: wrap around forever; n: stop after n passes (validation: 1)

  size_t read_buffer_bytes = 1 << 20;  // text readers' buffer
  size_t max_piece_bytes = 64 << 20;   // text documents larger than this are tokenized in pieces
  WarningFn on_warning;
};

// Reads the keys present in `j` over `base` (key names as the fields above; enums as strings:
// format "auto|text|jsonl|tokens|chat", delimiter "file|percent|blank", split "train|validation").
// An unknown key is an error, so a typo in a config does not silently fall back to a default.
DataConfig data_config_from_json(const nlohmann::json& j, DataConfig base = {});
nlohmann::json to_json(const DataConfig& cfg);  // every field but on_warning

// Calls on_warning, or prints "titan: warning: <message>" to stderr.
void warn(const WarningFn& on_warning, const std::string& message);

TextReaderOptions text_reader_options(const DataConfig& cfg);

}  // namespace titan::data
