// Text -> token ids for the data pipeline. The pipeline only sees this callback, so it can be
// tested with a trivial deterministic encoder and used with any tokenizer.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace titan::data {

struct TextEncoder {
  // Replaces `ids` with the ids of `text` (no special tokens added).
  std::function<void(std::string_view text, std::vector<int32_t>& ids)> encode;
  int32_t vocab_size = 0;
  int32_t eos_id = -1;  // -1: none
  std::string name;     // recorded in dataset metadata and loader state
};

inline constexpr const char* kByteEncoderName = "builtin:bytes";

// ids = UTF-8 bytes (0..255), EOS = 256, vocab size 257.
TextEncoder byte_encoder();

// `spec`: "builtin:bytes", or a tokenizer.json / a directory holding one (titan::Tokenizer).
TextEncoder make_text_encoder(const std::string& spec);

}  // namespace titan::data
