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

  // Chat data: one JSON Lines record (`where` = "file:line" for errors) -> the conversation's ids
  // and labels (ids on assistant tokens, -100 elsewhere; not shifted). Unset for plain text.
  std::function<void(std::string_view record, const std::string& where, std::vector<int32_t>& ids,
                     std::vector<int32_t>& labels)>
      encode_chat;
  std::string chat_template;  // where the chat template came from (loader fingerprint)
};

inline constexpr const char* kByteEncoderName = "builtin:bytes";

// ids = UTF-8 bytes (0..255), EOS = 256, vocab size 257.
TextEncoder byte_encoder();

// `spec`: "builtin:bytes", or a tokenizer.json / a directory holding one (titan::Tokenizer).
TextEncoder make_text_encoder(const std::string& spec);

// A text encoder that also encodes chat records (tokenizer/chat_template.h): `spec` a
// tokenizer.json or a directory holding one; `template_spec` a tokenizer_config.json or a
// directory holding one (empty: the directory of `spec`). Records are rendered without a
// generation prompt and with the template's default enable_thinking.
TextEncoder make_chat_encoder(const std::string& spec, const std::string& template_spec);

}  // namespace titan::data
