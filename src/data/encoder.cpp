#include "data/encoder.h"

#include <memory>

#include "core/error.h"
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

}  // namespace titan::data
