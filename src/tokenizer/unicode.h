// UTF-8 and Unicode helpers for the tokenizer: lossy UTF-8 repair, the GPT-2 byte <-> char map,
// normalization forms (via utf8proc) and the character classes used by added-token matching.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace titan::tok {

// Decodes one UTF-8 code point at s[i] (s must be valid UTF-8); advances i.
inline uint32_t next_codepoint(std::string_view s, size_t& i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + i;
  uint32_t c = p[0];
  if (c < 0x80) {
    i += 1;
    return c;
  }
  if (c < 0xE0) {
    i += 2;
    return ((c & 0x1F) << 6) | (p[1] & 0x3F);
  }
  if (c < 0xF0) {
    i += 3;
    return ((c & 0x0F) << 12) | ((p[1] & 0x3F) << 6) | (p[2] & 0x3F);
  }
  i += 4;
  return ((c & 0x07) << 18) | ((p[1] & 0x3F) << 12) | ((p[2] & 0x3F) << 6) | (p[3] & 0x3F);
}

// Decodes the code point that ends at s[end) (s valid UTF-8, end > 0); sets start to its first byte.
uint32_t prev_codepoint(std::string_view s, size_t end, size_t& start);

void append_utf8(std::string& out, uint32_t cp);

// True when s is well-formed UTF-8 (no overlongs, surrogates or values above U+10FFFF).
bool is_valid_utf8(std::string_view s);
// Replaces each maximal ill-formed subsequence with U+FFFD (the policy of Rust's from_utf8_lossy
// and Python's errors="replace"), so invalid input encodes the way HF sees it.
std::string repair_utf8(std::string_view s);

// GPT-2 byte-level alphabet: byte b is written as the code point byte_to_char(b); char_to_byte is
// the inverse (-1 for code points outside the alphabet).
uint32_t byte_to_char(uint8_t b);
int char_to_byte(uint32_t cp);
// The UTF-8 text of the byte-level char for each byte.
const std::string& byte_level_char(uint8_t b);
// Maps every byte of raw to its byte-level char.
std::string to_byte_level(std::string_view raw);

enum class NormForm { kNFC, kNFD, kNFKC, kNFKD };
// Normalizes valid UTF-8 text. Returns false (out untouched) when text is already in that form
// by a quick check, so callers keep the original view; true when out holds the result.
bool normalize(NormForm form, std::string_view text, std::string& out);
// Per-character lowercase as Rust's char::to_lowercase (no context-dependent final sigma).
std::string lowercase(std::string_view text);

// Rust regex's \w (alphabetic, marks, decimal digits, connector punctuation) and \s (White_Space).
bool is_word_char(uint32_t cp);
bool is_white_space(uint32_t cp);

}  // namespace titan::tok
