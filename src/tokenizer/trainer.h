// Byte-level BPE trainer producing an HF tokenizer.json (Qwen-style pipeline: NFC normalizer,
// Qwen's Split regex + ByteLevel(use_regex=false) pre-tokenizer, ByteLevel decoder, the 256
// byte-level characters as the initial alphabet, special tokens as added tokens after the
// model vocab). Deterministic: the same input gives the same file.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace titan {

class BpeTrainer {
 public:
  // special_tokens: added as special tokens (ids after the learned vocab) and never merged
  // across; empty means {"<|endoftext|>"}.
  explicit BpeTrainer(std::vector<std::string> special_tokens = {});
  ~BpeTrainer();
  BpeTrainer(BpeTrainer&&) noexcept;
  BpeTrainer& operator=(BpeTrainer&&) noexcept;

  // Adds one document (any UTF-8 text; invalid bytes become U+FFFD) to the word counts.
  void add_text(std::string_view text);
  // Learns merges, most frequent pair first (ties: smallest id pair), until the vocab (256 bytes +
  // merged tokens + special tokens) holds vocab_size entries or no pair occurs twice; returns the
  // tokenizer.json text.
  std::string train(int vocab_size) const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

// Reads each file whole as one document and trains (see BpeTrainer).
std::string train_bpe(const std::vector<std::string>& files, int vocab_size,
                      std::vector<std::string> special_tokens = {});

}  // namespace titan
