#include "data/config.h"

#include <cstdio>

#include "core/error.h"

namespace titan::data {

DataFormat parse_data_format(std::string_view name) {
  if (name == "auto") return DataFormat::Auto;
  if (name == "text" || name == "txt") return DataFormat::Text;
  if (name == "jsonl" || name == "ndjson") return DataFormat::Jsonl;
  if (name == "tokens") return DataFormat::Tokens;
  fail("unknown data format '", name, "' (expected auto, text, jsonl or tokens)");
}

std::string to_string(DataFormat f) {
  switch (f) {
    case DataFormat::Auto:
      return "auto";
    case DataFormat::Text:
      return "text";
    case DataFormat::Jsonl:
      return "jsonl";
    case DataFormat::Tokens:
      return "tokens";
  }
  return "?";
}

void warn(const WarningFn& on_warning, const std::string& message) {
  if (on_warning)
    on_warning(message);
  else
    std::fprintf(stderr, "titan: warning: %s\n", message.c_str());
}

TextReaderOptions text_reader_options(const DataConfig& cfg) {
  TextReaderOptions o;
  o.delimiter = cfg.delimiter;
  o.text_field = cfg.text_field;
  o.buffer_bytes = cfg.read_buffer_bytes;
  o.max_piece_bytes = cfg.max_piece_bytes;
  return o;
}

}  // namespace titan::data
