#include "data/utf8.h"

namespace titan::data {

namespace {

// Length of the valid UTF-8 sequence starting at s[i], or 0 when invalid. On failure *valid_prefix
// is how many bytes form the maximal subpart to replace by one U+FFFD (at least 1).
size_t valid_sequence_length(std::string_view s, size_t i, size_t* valid_prefix) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  *valid_prefix = 1;
  if (b0 < 0x80) return 1;
  size_t len;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    if (b0 == 0xE0) lo = 0xA0;  // no overlongs
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    if (b0 == 0xF0) lo = 0x90;  // no overlongs
    if (b0 == 0xF4) hi = 0x8F;  // <= U+10FFFF
  } else {
    return 0;
  }
  for (size_t k = 1; k < len; ++k) {
    if (i + k >= s.size()) return 0;
    const unsigned char b = byte(i + k);
    const bool ok = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
    if (!ok) return 0;
    *valid_prefix = k + 1;
  }
  return len;
}

}  // namespace

std::string sanitize_utf8(std::string_view text, size_t* replaced) {
  std::string out;
  // Fast path: most corpora are valid; validate first and copy once.
  size_t i = 0, prefix = 0;
  while (i < text.size()) {
    const size_t len = valid_sequence_length(text, i, &prefix);
    if (!len) break;
    i += len;
  }
  if (i == text.size()) return std::string(text);
  out.reserve(text.size() + 16);
  out.append(text.substr(0, i));
  size_t count = 0;
  while (i < text.size()) {
    const size_t len = valid_sequence_length(text, i, &prefix);
    if (len) {
      out.append(text.substr(i, len));
      i += len;
    } else {
      out.append("\xEF\xBF\xBD");
      ++count;
      i += prefix;
    }
  }
  if (replaced) *replaced += count;
  return out;
}

size_t utf8_boundary_before(std::string_view text, size_t pos) {
  if (pos >= text.size()) return text.size();
  size_t p = pos;
  for (int back = 0; back < 3 && p > 0 && (static_cast<unsigned char>(text[p]) & 0xC0) == 0x80; ++back) --p;
  return (static_cast<unsigned char>(text[p]) & 0xC0) == 0x80 ? pos : p;
}

}  // namespace titan::data
