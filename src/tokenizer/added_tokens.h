// Added tokens of an HF tokenizer.json: matched in the text before the model, leftmost-longest
// like HF's aho-corasick tries, with the single_word / lstrip / rstrip rules of
// added_vocabulary.rs. Tokens with normalized=false match the raw input; normalized=true tokens
// match the normalized text.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace titan::tok {

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
};

// A piece of the input: [start, end) bytes; id >= 0 for an added token, -1 for plain text.
struct Segment {
  size_t start, end;
  int32_t id;
};

class AddedTokenMatcher {
 public:
  // patterns[i] is what token i must match (its content, or normalized content).
  void build(std::vector<AddedToken> tokens, const std::vector<std::string>& patterns);
  bool empty() const { return tokens_.empty(); }
  // Splits text into plain and added-token segments covering it (empty text gives no segments).
  void split(std::string_view text, std::vector<Segment>& out) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;
    int32_t token = -1;  // index into tokens_ when a pattern ends here
  };
  // Longest pattern starting at text[pos]: returns its token index and sets len, or -1.
  int32_t longest_at(std::string_view text, size_t pos, size_t& len) const;
  std::vector<AddedToken> tokens_;
  std::vector<Node> nodes_;
  bool first_byte_[256] = {};
};

}  // namespace titan::tok
