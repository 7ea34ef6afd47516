// UTF-8 and Unicode helpers (see unicode.h).
#include "tokenizer/unicode.h"

#include <utf8proc.h>

#include <array>
#include <cstdlib>
#include <mutex>
#include <vector>

namespace titan::tok {

uint32_t prev_codepoint(std::string_view s, size_t end, size_t& start) {
  start = end - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  size_t i = start;
  return next_codepoint(s, i);
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Length of the well-formed UTF-8 sequence at s[i], or 0 when it is ill-formed; *bad is then the
// length of the maximal ill-formed prefix (at least 1), per Unicode's "maximal subpart" rule.
static size_t utf8_sequence(const unsigned char* p, size_t n, size_t* bad) {
  unsigned c = p[0];
  size_t len;
  unsigned lo = 0x80, hi = 0xBF;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    *bad = 1;
    return 0;
  }
  for (size_t k = 1; k < len; ++k) {
    unsigned b = k < n ? p[k] : 0x100;
    unsigned l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) {
      *bad = k;
      return 0;
    }
  }
  return len;
}

bool is_valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size(), i = 0, bad;
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    size_t len = utf8_sequence(p + i, n - i, &bad);
    if (!len) return false;
    i += len;
  }
  return true;
}

std::string repair_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size(), i = 0, bad;
  std::string out;
  out.reserve(n + 8);
  while (i < n) {
    size_t len = utf8_sequence(p + i, n - i, &bad);
    if (len) {
      out.append(s.substr(i, len));
      i += len;
    } else {
      out.append("\xEF\xBF\xBD");
      i += bad;
    }
  }
  return out;
}

namespace {
struct ByteTables {
  std::array<uint32_t, 256> to_char{};
  std::array<std::string, 256> to_text;
  std::vector<int16_t> from_char = std::vector<int16_t>(512, -1);
  ByteTables() {
    // Printable bytes map to themselves; the rest to U+0100 upward, in byte order (GPT-2).
    uint32_t n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_char[b] = printable ? b : 256 + n++;
      from_char[to_char[b]] = static_cast<int16_t>(b);
      append_utf8(to_text[b], to_char[b]);
    }
  }
};
const ByteTables& byte_tables() {
  static const ByteTables t;
  return t;
}
}  // namespace

uint32_t byte_to_char(uint8_t b) {
  return byte_tables().to_char[b];
}
int char_to_byte(uint32_t cp) {
  return cp < 512 ? byte_tables().from_char[cp] : -1;
}
const std::string& byte_level_char(uint8_t b) {
  return byte_tables().to_text[b];
}

std::string to_byte_level(std::string_view raw) {
  const auto& t = byte_tables();
  std::string out;
  out.reserve(raw.size() * 2);
  for (unsigned char b : raw) out += t.to_text[b];
  return out;
}

namespace {
// Per code point: may a string made only of "safe" characters skip normalization? Bit 0: NFC,
// bit 1: NFD, bit 2: NFKC, bit 3: NFKD. A safe character is a starter that no form changes and
// that never composes with a preceding character.
struct QuickCheck {
  std::vector<uint8_t> safe = std::vector<uint8_t>(0x110000, 0);
  QuickCheck() {
    std::vector<uint8_t> second(0x110000, 0);
    for (uint32_t cp = 0; cp < 0x110000; ++cp) {
      const utf8proc_property_t* p = utf8proc_get_property(cp);
      if (p->decomp_seqindex == UINT16_MAX || p->decomp_type != 0) continue;
      utf8proc_int32_t buf[8];
      utf8proc_ssize_t n = utf8proc_decompose_char(cp, buf, 8, UTF8PROC_DECOMPOSE, nullptr);
      for (utf8proc_ssize_t k = 1; k < n && k < 8; ++k) second[buf[k]] = 1;
    }
    for (uint32_t cp = 0x1161; cp <= 0x1175; ++cp) second[cp] = 1;  // Hangul V jamo
    for (uint32_t cp = 0x11A8; cp <= 0x11C2; ++cp) second[cp] = 1;  // Hangul T jamo
    for (uint32_t cp = 0; cp < 0x110000; ++cp) {
      const utf8proc_property_t* p = utf8proc_get_property(cp);
      if (p->combining_class != 0 || second[cp] || (cp >= 0xD800 && cp < 0xE000)) continue;
      bool hangul = cp >= 0xAC00 && cp <= 0xD7A3;
      bool none = p->decomp_seqindex == UINT16_MAX && !hangul;
      bool canonical_only = none || p->decomp_type != 0;  // no canonical decomposition
      uint8_t bits = 0;
      if (none) bits |= 0xF;
      if (canonical_only) bits |= 0x2;
      if (hangul) bits |= 0x1 | 0x4;
      if (!none && !hangul && p->decomp_type == 0 && !p->comp_exclusion) {
        // Has a canonical decomposition: NFC keeps it only when it recomposes to itself.
        utf8proc_int32_t buf[8];
        utf8proc_ssize_t n = utf8proc_decompose_char(cp, buf, 8, UTF8PROC_DECOMPOSE, nullptr);
        if (n >= 2) {
          utf8proc_uint8_t* out = nullptr;
          std::string s;
          append_utf8(s, cp);
          utf8proc_ssize_t m = utf8proc_map(
              reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
              &out, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
          if (m >= 0 && std::string_view(reinterpret_cast<char*>(out), m) == s) bits |= 0x1;
          std::free(out);
        }
      }
      safe[cp] = bits;
    }
  }
};
const QuickCheck& quick_check() {
  static const QuickCheck q;
  return q;
}
}  // namespace

bool normalize(NormForm form, std::string_view text, std::string& out) {
  bool ascii = true;
  for (unsigned char c : text)
    if (c >= 0x80) {
      ascii = false;
      break;
    }
  if (ascii) return false;
  const uint8_t bit = 1u << static_cast<int>(form);
  const auto& safe = quick_check().safe;
  bool all_safe = true;
  for (size_t i = 0; i < text.size();) {
    if (!(safe[next_codepoint(text, i)] & bit)) {
      all_safe = false;
      break;
    }
  }
  if (all_safe) return false;
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormForm::kNFC:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormForm::kNFD:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormForm::kNFKC:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormForm::kNFKD:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* buf = nullptr;
  utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   static_cast<utf8proc_ssize_t>(text.size()), &buf, static_cast<utf8proc_option_t>(options));
  if (n < 0) {
    std::free(buf);
    return false;  // cannot happen on valid UTF-8; keep the text as is
  }
  out.assign(reinterpret_cast<char*>(buf), static_cast<size_t>(n));
  std::free(buf);
  return true;
}

std::string lowercase(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    uint32_t cp = next_codepoint(text, i);
    if (cp == 0x130) {  // the one unconditional multi-character lowercase mapping
      out += "i\xCC\x87";
      continue;
    }
    append_utf8(out, static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))));
  }
  return out;
}

bool is_word_char(uint32_t cp) {
  if (cp < 0x80)
    return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || cp == '_';
  if (cp == 0x200C || cp == 0x200D) return true;
  if ((cp >= 0x24B6 && cp <= 0x24E9) || (cp >= 0x1F130 && cp <= 0x1F189)) return true;  // Other_Alphabetic So
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

}  // namespace titan::tok
