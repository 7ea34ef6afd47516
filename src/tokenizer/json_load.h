// Fast tokenizer.json reading: one pass that builds a JSON tree for everything except
// model.vocab and model.merges, which are collected straight into flat vectors (no tree nodes
// for ~300k entries), so the 151k-vocab Qwen file loads in well under half a second.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace titan::tok {

struct TokenizerFile {
  nlohmann::json rest;  // the document without model.vocab / model.merges
  bool has_vocab = false, has_merges = false;
  std::vector<std::pair<std::string, int64_t>> vocab;       // in file order
  std::vector<std::pair<std::string, std::string>> merges;  // by rank
};

// Parses text (the content of file). Throws titan::Error naming the file and the field.
TokenizerFile parse_tokenizer_file(const std::string& text, const std::string& file);

}  // namespace titan::tok
