#include "data/encoder.h"

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/json_file.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace titan::data {

TextEncoder byte_encoder() {
  TextEncoder e;
  e.encode = [](std::string_view text, std::vector<int32_t>& ids) {
    ids.resize(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  };
  e.vocab_size = 257;
  e.eos_id = 256;
  e.name = kByteEncoderName;
  return e;
}

TextEncoder make_text_encoder(const std::string& spec) {
  TITAN_CHECK(!spec.empty(), "text data needs a tokenizer (a tokenizer.json path or \"", kByteEncoderName,
              "\")");
  if (spec == kByteEncoderName) return byte_encoder();
  auto tokenizer = std::make_shared<Tokenizer>(Tokenizer::load(spec));
  TextEncoder e;
  e.encode = [tokenizer](std::string_view text, std::vector<int32_t>& ids) {
    ids = tokenizer->encode(text, /*add_special_tokens=*/false);
  };
  e.vocab_size = tokenizer->vocab_size();
  e.eos_id = tokenizer->eos_id().value_or(-1);
  e.name = spec;
  return e;
}

TextEncoder make_chat_encoder(const std::string& spec, const std::string& template_spec) {
  namespace fs = std::filesystem;
  TITAN_CHECK(!spec.empty() && spec != kByteEncoderName,
              "chat data needs the model's tokenizer (a tokenizer.json path or its directory, with the "
              "tokenizer_config.json holding the chat template beside it)");
  std::string where = template_spec;
  if (where.empty()) where = fs::is_directory(spec) ? spec : fs::path(spec).parent_path().string();
  auto tmpl = std::make_shared<ChatTemplate>(ChatTemplate::from_tokenizer_config(where));
  auto tokenizer = std::make_shared<Tokenizer>(Tokenizer::load(spec));
  TextEncoder e;
  e.vocab_size = tokenizer->vocab_size();
  e.eos_id = tokenizer->eos_id().value_or(-1);
  e.name = spec;
  e.encode = [tokenizer](std::string_view text, std::vector<int32_t>& ids) {
    ids = tokenizer->encode(text, /*add_special_tokens=*/false);
  };
  e.encode_chat = [tokenizer, tmpl](std::string_view record, const std::string& at, std::vector<int32_t>& ids,
                                    std::vector<int32_t>& labels) {
    const nlohmann::ordered_json j = parse_ordered_json(record, at);
    const Conversation c = conversation_from_record(j, at);
    ChatOptions options;
    options.skip_assistant_turns = c.prompt_assistant_turns;
    if (!c.tools.is_null()) options.extra["tools"] = c.tools;
    EncodedChat enc;
    try {
      enc = tmpl->encode(*tokenizer, c.messages, options);
    } catch (const Error& ex) {
      fail(at, ": ", ex.what());
    }
    ids = std::move(enc.ids);
    labels = std::move(enc.labels);
  };
  e.chat_template = tmpl->name();
  return e;
}

}  // namespace titan::data
