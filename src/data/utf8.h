// UTF-8 repair for corpora: invalid sequences become U+FFFD so the tokenizer always sees valid
// text, and the caller counts the replacements to report them.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace titan::data {

// Returns `text` with every maximal invalid subpart (Unicode 15, section 3.9, "U+FFFD substitution
// of maximal subparts") replaced by U+FFFD; adds the number of replacements to *replaced.
// Overlong forms, surrogates and code points above U+10FFFF are invalid.
std::string sanitize_utf8(std::string_view text, size_t* replaced);

// Largest position <= pos that does not split a UTF-8 sequence of `text` (at most 3 bytes back).
size_t utf8_boundary_before(std::string_view text, size_t pos);

}  // namespace titan::data
