// A tokenizer.json from a model repository: loaded (model, normalizer, pre-tokenizer, added tokens,
// decoder), then used on text with special tokens, emoji, combining marks and invalid positions, and
// the ids decoded back.
#include <vector>

#include "fuzz_target.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = titan::fuzz::write_scratch("tokenizer.json", titan::fuzz::as_text(data, size));
  titan::fuzz::expect_clean_error(path, [&] {
    const titan::Tokenizer tok = titan::Tokenizer::load(path);
    static const char* const kTexts[] = {
        "Hello, world! 12345 <|im_start|>user\nÇa va? 東京 🙂\t  spaces\r\n",
        "<|endoftext|><s></s>[CLS] e\xcc\x81 \xef\xbc\xa1 'll 've don't", ""};
    for (const char* text : kTexts) {
      for (bool special : {false, true}) {
        const std::vector<int32_t> ids = tok.encode(text, special);
        (void)tok.decode(ids, false);
        (void)tok.decode(ids, true);
      }
    }
    const std::vector<int32_t> odd = {0, 1, -1, tok.vocab_size(), tok.vocab_size() - 1, 2147483647};
    (void)tok.decode(odd);
    for (int32_t id : odd) (void)tok.token_bytes(id);
    (void)tok.eos_id();
  });
  return 0;
}
