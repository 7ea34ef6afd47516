// Chat data (`[data] format = "chat"`): one JSON Lines record -> the conversation (messages, or
// prompt/completion, optional tools) -> the Qwen3 chat template -> token ids and loss labels, as the
// data loader encodes each line of a downloaded dataset.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <vector>

#include "data/encoder.h"
#include "fuzz_target.h"

#ifndef TITAN_SOURCE_DIR
#error "TITAN_SOURCE_DIR: the repository, whose ../shared/assets holds the Qwen3 tokenizer"
#endif

namespace {

// The Qwen3 tokenizer and template from ../shared beside the repository; without it, the repository's small
// test tokenizer with the Qwen3 template of the jinja seeds.
titan::data::TextEncoder make_encoder() {
  const std::string qwen = TITAN_SOURCE_DIR "/../shared/assets/qwen3-tokenizer";
  if (std::filesystem::exists(qwen + "/tokenizer_config.json"))
    return titan::data::make_chat_encoder(qwen, "");
  std::ifstream in(TITAN_SOURCE_DIR "/fuzz/corpus/jinja/qwen3.jinja");
  const std::string tmpl((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const nlohmann::json config = {{"chat_template", tmpl}, {"eos_token", "<|im_end|>"}};
  const std::string path = titan::fuzz::write_scratch("tokenizer_config.json", config.dump());
  return titan::data::make_chat_encoder(TITAN_SOURCE_DIR "/tests/golden/tokenizer/small", path);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const titan::data::TextEncoder encoder = make_encoder();
  std::vector<int32_t> ids, labels;
  titan::fuzz::expect_clean_error("chat.jsonl:7", [&] {
    encoder.encode_chat(titan::fuzz::as_text(data, size), "chat.jsonl:7", ids, labels);
    if (ids.size() != labels.size()) {
      std::fprintf(stderr, "fuzz: %zu ids but %zu labels\n", ids.size(), labels.size());
      std::abort();
    }
  });
  return 0;
}
