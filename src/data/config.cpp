#include "data/config.h"

#include <cstdio>

#include "core/error.h"

namespace titan::data {

DataFormat parse_data_format(std::string_view name) {
  if (name == "auto") return DataFormat::Auto;
  if (name == "text" || name == "txt") return DataFormat::Text;
  if (name == "jsonl" || name == "ndjson") return DataFormat::Jsonl;
  if (name == "tokens") return DataFormat::Tokens;
  if (name == "chat") return DataFormat::Chat;
  fail("unknown data format '", name, "' (expected auto, text, jsonl, tokens or chat)");
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
    case DataFormat::Chat:
      return "chat";
  }
  return "?";
}

DataConfig data_config_from_json(const nlohmann::json& j, DataConfig c) {
  TITAN_CHECK(j.is_object(), "data config: expected an object, got ", j.type_name());
  for (const auto& [key, v] : j.items()) {
    try {
      if (key == "sources")
        c.sources = v.is_string() ? std::vector<std::string>{v.get<std::string>()}
                                  : v.get<std::vector<std::string>>();
      else if (key == "format")
        c.format = parse_data_format(v.get<std::string>());
      else if (key == "delimiter")
        c.delimiter = parse_doc_delimiter(v.get<std::string>());
      else if (key == "text_field")
        c.text_field = v.get<std::string>();
      else if (key == "tokenizer")
        c.tokenizer = v.get<std::string>();
      else if (key == "chat_template")
        c.chat_template = v.get<std::string>();
      else if (key == "packing")
        c.packing = v.get<bool>();
      else if (key == "eos_id")
        c.eos_id = v.is_null() ? std::nullopt : std::optional<int32_t>(v.get<int32_t>());
      else if (key == "seq_len")
        c.seq_len = v.get<int64_t>();
      else if (key == "batch_size")
        c.batch_size = v.get<int64_t>();
      else if (key == "seed")
        c.seed = v.get<uint64_t>();
      else if (key == "shuffle")
        c.shuffle = v.get<bool>();
      else if (key == "dp_rank")
        c.dp_rank = v.get<int>();
      else if (key == "dp_world")
        c.dp_world = v.get<int>();
      else if (key == "val_fraction")
        c.val_fraction = v.get<double>();
      else if (key == "split_seed")
        c.split_seed = v.get<uint64_t>();
      else if (key == "split") {
        const auto s = v.get<std::string>();
        TITAN_CHECK(s == "train" || s == "validation", "data config: split must be train or validation, got ",
                    s);
        c.split = s == "train" ? Split::Train : Split::Validation;
      } else if (key == "max_epochs")
        c.max_epochs = v.get<int64_t>();
      else if (key == "read_buffer_bytes")
        c.read_buffer_bytes = v.get<size_t>();
      else if (key == "max_piece_bytes")
        c.max_piece_bytes = v.get<size_t>();
      else
        fail("data config: unknown key '", key, "'");
    } catch (const nlohmann::json::exception& e) {
      fail("data config: key '", key, "': ", e.what());
    }
  }
  return c;
}

nlohmann::json to_json(const DataConfig& c) {
  return {{"sources", c.sources},
          {"format", to_string(c.format)},
          {"delimiter", to_string(c.delimiter)},
          {"text_field", c.text_field},
          {"tokenizer", c.tokenizer},
          {"chat_template", c.chat_template},
          {"eos_id", c.eos_id ? nlohmann::json(*c.eos_id) : nlohmann::json()},
          {"seq_len", c.seq_len},
          {"batch_size", c.batch_size},
          {"seed", c.seed},
          {"shuffle", c.shuffle},
          {"dp_rank", c.dp_rank},
          {"dp_world", c.dp_world},
          {"val_fraction", c.val_fraction},
          {"split_seed", c.split_seed},
          {"split", c.split == Split::Train ? "train" : "validation"},
          {"max_epochs", c.max_epochs},
          {"read_buffer_bytes", c.read_buffer_bytes},
          {"max_piece_bytes", c.max_piece_bytes}};
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
  o.raw_jsonl = cfg.format == DataFormat::Chat;
  o.buffer_bytes = cfg.read_buffer_bytes;
  o.max_piece_bytes = cfg.max_piece_bytes;
  return o;
}

}  // namespace titan::data
