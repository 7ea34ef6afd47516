// Added-token matching (see added_tokens.h).
#include "tokenizer/added_tokens.h"

#include "tokenizer/unicode.h"

namespace titan::tok {

void AddedTokenMatcher::build(std::vector<AddedToken> tokens, const std::vector<std::string>& patterns) {
  tokens_ = std::move(tokens);
  nodes_.assign(1, Node{});
  for (auto& b : first_byte_) b = false;
  for (size_t t = 0; t < tokens_.size(); ++t) {
    const std::string& p = patterns[t];
    if (p.empty()) continue;
    first_byte_[static_cast<unsigned char>(p[0])] = true;
    int32_t node = 0;
    for (unsigned char c : p) {
      int32_t child = -1;
      for (auto [ch, idx] : nodes_[node].children)
        if (ch == c) child = idx;
      if (child < 0) {
        child = static_cast<int32_t>(nodes_.size());
        nodes_[node].children.push_back({c, child});
        nodes_.push_back(Node{});
      }
      node = child;
    }
    if (nodes_[node].token < 0) nodes_[node].token = static_cast<int32_t>(t);  // first pattern wins ties
  }
}

int32_t AddedTokenMatcher::longest_at(std::string_view text, size_t pos, size_t& len) const {
  int32_t node = 0, best = -1;
  for (size_t i = pos; i < text.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(text[i]);
    int32_t child = -1;
    for (auto [ch, idx] : nodes_[node].children)
      if (ch == c) {
        child = idx;
        break;
      }
    if (child < 0) break;
    node = child;
    if (nodes_[node].token >= 0) best = nodes_[node].token, len = i + 1 - pos;
  }
  return best;
}

void AddedTokenMatcher::split(std::string_view text, std::vector<Segment>& out) const {
  out.clear();
  size_t start_offset = 0;
  size_t pos = 0;
  const size_t n = text.size();
  while (pos < n) {
    if (!first_byte_[static_cast<unsigned char>(text[pos])]) {
      ++pos;
      continue;
    }
    size_t len = 0;
    int32_t t = longest_at(text, pos, len);
    if (t < 0) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + len;
    pos = stop;  // matches never overlap, even when one is discarded below
    const AddedToken& tok = tokens_[t];
    if (tok.single_word) {
      size_t s;
      bool word_before = start > 0 && is_word_char(prev_codepoint(text, start, s));
      size_t i = stop;
      bool word_after = stop < n && is_word_char(next_codepoint(text, i));
      if (word_before || word_after) continue;
    }
    if (tok.lstrip) {
      // Absorb the whitespace run before the token, except what the previous match took.
      size_t b = start;
      while (b > 0) {
        size_t s;
        if (!is_white_space(prev_codepoint(text, b, s))) break;
        b = s;
      }
      start = std::max(b, start_offset);
    }
    if (tok.rstrip) {
      while (stop < n) {
        size_t i = stop;
        if (!is_white_space(next_codepoint(text, i))) break;
        stop = i;
      }
    }
    if (start_offset < start) out.push_back({start_offset, start, -1});
    out.push_back({start, stop, tok.id});
    start_offset = stop;
  }
  if (start_offset < n) out.push_back({start_offset, n, -1});
}

}  // namespace titan::tok
