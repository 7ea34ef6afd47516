// The non-model stages of an HF tokenizer.json: normalizer, pre-tokenizer, post-processor and
// decoder, parsed from JSON into flat step lists. Unsupported types throw titan::Error naming
// the file, the field and the type.
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/unicode.h"

namespace titan::tok {

// --- normalizer -------------------------------------------------------------------------------
struct NormStep {
  enum Kind { kForm, kLowercase, kStrip, kPrepend, kReplace } kind = kForm;
  NormForm form = NormForm::kNFC;
  bool strip_left = false, strip_right = false;
  std::string a, b;  // Prepend: a = prefix; Replace: a -> b
};

class Normalizer {
 public:
  void load(const nlohmann::json& j, const std::string& where);
  bool empty() const { return steps_.empty(); }
  // Returns a view of the normalized text: text itself when nothing changes, else storage.
  std::string_view apply(std::string_view text, std::string& storage) const;

 private:
  void add(const nlohmann::json& j, const std::string& where);
  std::vector<NormStep> steps_;
};

// --- pre-tokenizer ----------------------------------------------------------------------------
class Regex;  // PCRE2 pattern, JIT compiled

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreStep {
  enum Kind { kSplit, kByteLevel, kDigits } kind = kSplit;
  std::shared_ptr<Regex> regex;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false, use_regex = true;  // ByteLevel
  bool individual_digits = false;                   // Digits
};

class PreTokenizer {
 public:
  void load(const nlohmann::json& j, const std::string& where);
  // Splits text into words (views into text or into arena, which keeps prefixed copies alive).
  void apply(std::string_view text, std::vector<std::string_view>& words,
             std::deque<std::string>& arena) const;
  // True when a ByteLevel step maps words to the byte alphabet (the model then sees raw bytes).
  bool byte_level() const { return byte_level_; }

 private:
  void add(const nlohmann::json& j, const std::string& where);
  std::vector<PreStep> steps_;
  bool byte_level_ = false;
};

// Finds all matches of a regex step in text as (start, end, is_match) pieces covering text.
struct Piece {
  size_t start, end;
  bool match;
};
void find_pieces(const Regex& re, std::string_view text, std::vector<Piece>& out);
std::shared_ptr<Regex> compile_regex(const std::string& pattern, bool literal, const std::string& where);

// --- post-processor ---------------------------------------------------------------------------
class PostProcessor {
 public:
  void load(const nlohmann::json& j, const std::string& where);
  // Wraps the ids of a single sequence with the template's special tokens.
  void apply(std::vector<int32_t>& ids) const;

 private:
  void add(const nlohmann::json& j, const std::string& where);
  bool has_template_ = false;
  std::vector<int32_t> prefix_, suffix_;
};

// --- decoder ----------------------------------------------------------------------------------
class Decoder {
 public:
  void load(const nlohmann::json& j, const std::string& where);
  std::string apply(const std::vector<const std::string*>& tokens) const;
  // Byte-level: the raw bytes of the tokens, not repaired to valid UTF-8 (apply() repairs them).
  std::string raw_bytes(const std::vector<const std::string*>& tokens) const;

 private:
  bool byte_level_ = false;
  bool none_ = true;
};

}  // namespace titan::tok
