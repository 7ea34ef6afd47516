// Byte-level BPE trainer producing an HF tokenizer.json (Qwen-style pipeline: NFC normalizer,
// Qwen's Split regex + ByteLevel(use_regex=false) pre-tokenizer, ByteLevel decoder, the 256
// byte-level characters as the initial alphabet, special tokens as added tokens after the
// model vocab). Deterministic: the same input gives the same file.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace titan {

class BpeTrainer {
 public:
  BpeTrainer();
  ~BpeTrainer();
  // Adds one document (any UTF-8 text; invalid bytes become U+FFFD) to the word counts.
  void add_text(std::string_view text);
  // Merges until the vocab (256 bytes + merges + special tokens) holds vocab_size entries, or no
  // pair occurs twice or more; returns tokenizer.json text. Empty special_tokens means
  // {"<|endoftext|>"}.
  std::string train(int vocab_size, std::vector<std::string> special_tokens = {}) const;

 private:
  struct State;
  State* state_;
};

// Reads whole files as documents and trains (see BpeTrainer).
std::string train_bpe(const std::vector<std::string>& files, int vocab_size,
                      std::vector<std::string> special_tokens = {});

}  // namespace titan
