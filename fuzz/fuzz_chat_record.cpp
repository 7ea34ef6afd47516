// Chat data (`[data] format = "chat"`): one JSON Lines record -> the conversation (messages, or
// prompt/completion, optional tools) -> the Qwen3 chat template -> token ids and loss labels, as the
// data loader encodes each line of a downloaded dataset.
#include <vector>

#include "data/encoder.h"
#include "fuzz_target.h"

#ifndef TITAN_SOURCE_DIR
#error "TITAN_SOURCE_DIR: the repository, whose ../shared/assets holds the Qwen3 tokenizer"
#endif

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const titan::data::TextEncoder encoder =
      titan::data::make_chat_encoder(TITAN_SOURCE_DIR "/../shared/assets/qwen3-tokenizer", "");
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
