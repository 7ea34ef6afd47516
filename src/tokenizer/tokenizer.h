// HF tokenizer.json compatible byte-level BPE tokenizer (Qwen2Tokenizer, GPT-2, Llama-3 style).
// Public interface shared by the data pipeline and the CLI; the implementation lives in src/tokenizer/.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace titan {

class Tokenizer {
 public:
  // path: a tokenizer.json file or a directory holding one. Throws titan::Error naming the file and
  // the unsupported component on failure.
  static Tokenizer load(const std::string& path);

  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // The bytes token `id` stands for in decoded text (a byte-level token may hold part of a UTF-8
  // character; an added token is its content); empty for an unknown id.
  std::string token_bytes(int32_t id) const;

  // Number of ids (model vocab plus added tokens): max id + 1.
  int32_t vocab_size() const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The end-of-text token used between documents when packing (e.g. <|endoftext|>), if any.
  std::optional<int32_t> eos_id() const;

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace titan
