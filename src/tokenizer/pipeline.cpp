// Normalizer, pre-tokenizer, post-processor and decoder stages (see pipeline.h). The semantics
// follow HF tokenizers: normalizers/*.rs, pre_tokenizers/{split,byte_level,digits}.rs,
// processors/*.rs and decoders/byte_level.rs.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/pipeline.h"

#include <pcre2.h>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace titan::tok {

using nlohmann::json;

namespace {
const std::string& type_of(const json& j, const std::string& where) {
  TITAN_CHECK(j.is_object(), where, ": expected an object");
  auto it = j.find("type");
  TITAN_CHECK(it != j.end() && it->is_string(), where, ".type: missing or not a string");
  return it->get_ref<const std::string&>();
}
bool get_bool(const json& j, const char* key, bool def, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  TITAN_CHECK(it->is_boolean(), where, ".", key, ": expected a boolean");
  return it->get<bool>();
}
std::string get_string(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  TITAN_CHECK(it != j.end() && it->is_string(), where, ".", key, ": missing or not a string");
  return it->get<std::string>();
}
// A Split/Replace pattern: {"String": s} (literal) or {"Regex": r}.
std::shared_ptr<Regex> get_pattern(const json& j, const std::string& where) {
  auto it = j.find("pattern");
  TITAN_CHECK(it != j.end() && it->is_object(), where, ".pattern: missing or not an object");
  if (auto s = it->find("String"); s != it->end() && s->is_string())
    return compile_regex(s->get<std::string>(), true, where + ".pattern.String");
  if (auto r = it->find("Regex"); r != it->end() && r->is_string())
    return compile_regex(r->get<std::string>(), false, where + ".pattern.Regex");
  fail(where, ".pattern: expected {\"String\": ...} or {\"Regex\": ...}");
}
}  // namespace

// --- regex ------------------------------------------------------------------------------------
class Regex {
 public:
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Regex() { pcre2_code_free(code); }
};

// HF compiles patterns with Oniguruma, whose \s is the White_Space set without U+180E; PCRE2's
// \s also matches U+180E (MONGOLIAN VOWEL SEPARATOR). Spell \s and \S out so both agree.
static std::string oniguruma_compatible(const std::string& p) {
  static const char* kSpace =
      R"(\t\n\x0B\f\r\x20\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
  std::string out;
  int class_depth = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      char e = p[++i];
      if (e == 's')
        out += class_depth ? std::string(kSpace) : str_cat("[", kSpace, "]");
      else if (e == 'S' && !class_depth)
        out += str_cat("[^", kSpace, "]");
      else
        out += c, out += e;
      continue;
    }
    if (c == '[')
      ++class_depth;
    else if (c == ']' && class_depth)
      --class_depth;
    out += c;
  }
  return out;
}

std::shared_ptr<Regex> compile_regex(const std::string& source, bool literal, const std::string& where) {
  const std::string pattern = literal ? source : oniguruma_compatible(source);
  int err = 0;
  PCRE2_SIZE offset = 0;
  uint32_t flags = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), flags, &err,
                                   &offset, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    fail(where, ": cannot compile regex at offset ", offset, ": ", reinterpret_cast<char*>(msg));
  }
  auto re = std::make_shared<Regex>();
  re->code = code;
  re->jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return re;
}

namespace {
// Per-thread match state shared by all patterns: match data and a JIT stack large enough for
// long whitespace runs under `\s+(?!\S)`.
struct MatchState {
  pcre2_match_data* data = pcre2_match_data_create(32, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  MatchState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~MatchState() {
    pcre2_match_data_free(data);
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
  }
};
thread_local MatchState t_match;
}  // namespace

void find_pieces(const Regex& re, std::string_view text, std::vector<Piece>& out) {
  out.clear();
  const size_t n = text.size();
  if (n == 0) {
    out.push_back({0, 0, false});
    return;
  }
  MatchState& ms = t_match;
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0, prev = 0, last_end = SIZE_MAX;
  while (pos <= n) {
    int rc = re.jit ? pcre2_jit_match(re.code, subject, n, pos, 0, ms.data, ms.context)
                    : pcre2_match(re.code, subject, n, pos, PCRE2_NO_UTF_CHECK, ms.data, ms.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      fail("tokenizer: regex match failed: ", reinterpret_cast<char*>(msg));
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(ms.data);
    size_t s = ov[0], e = ov[1];
    if (s == e && last_end == e) {
      // An empty match right after the previous match: step one character, as Oniguruma does.
      if (pos >= n) break;
      ++pos;
      while (pos < n && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80) ++pos;
      continue;
    }
    if (prev != s) out.push_back({prev, s, false});
    out.push_back({s, e, true});
    prev = e;
    last_end = e;
    pos = e;
  }
  if (prev != n) out.push_back({prev, n, false});
}

// --- normalizer -------------------------------------------------------------------------------
void Normalizer::load(const json& j, const std::string& where) {
  steps_.clear();
  if (!j.is_null()) add(j, where);
}

void Normalizer::add(const json& j, const std::string& where) {
  const std::string& type = type_of(j, where);
  NormStep step;
  if (type == "Sequence") {
    auto it = j.find("normalizers");
    TITAN_CHECK(it != j.end() && it->is_array(), where, ".normalizers: missing or not an array");
    for (size_t i = 0; i < it->size(); ++i) add((*it)[i], str_cat(where, ".normalizers[", i, "]"));
    return;
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    step.form = type == "NFC"    ? NormForm::kNFC
                : type == "NFD"  ? NormForm::kNFD
                : type == "NFKC" ? NormForm::kNFKC
                                 : NormForm::kNFKD;
  } else if (type == "Lowercase") {
    step.kind = NormStep::kLowercase;
  } else if (type == "Strip") {
    step.kind = NormStep::kStrip;
    step.strip_left = get_bool(j, "strip_left", true, where);
    step.strip_right = get_bool(j, "strip_right", true, where);
  } else if (type == "Prepend") {
    step.kind = NormStep::kPrepend;
    step.a = get_string(j, "prepend", where);
  } else if (type == "Replace") {
    step.kind = NormStep::kReplace;
    auto p = j.find("pattern");
    TITAN_CHECK(p != j.end() && p->is_object() && p->contains("String") && (*p)["String"].is_string(), where,
                ".pattern: only {\"String\": ...} Replace patterns are supported");
    step.a = (*p)["String"].get<std::string>();
    step.b = get_string(j, "content", where);
    TITAN_CHECK(!step.a.empty(), where, ".pattern.String: empty");
  } else {
    fail(where, ": unsupported normalizer type '", type, "'");
  }
  steps_.push_back(std::move(step));
}

std::string_view Normalizer::apply(std::string_view text, std::string& storage) const {
  std::string_view cur = text;
  std::string tmp;
  for (const NormStep& st : steps_) {
    switch (st.kind) {
      case NormStep::kForm:
        if (normalize(st.form, cur, tmp)) storage.swap(tmp), cur = storage;
        break;
      case NormStep::kLowercase:
        tmp = lowercase(cur);
        storage.swap(tmp), cur = storage;
        break;
      case NormStep::kStrip: {
        size_t b = 0, e = cur.size();
        while (st.strip_left && b < e) {
          size_t i = b;
          if (!is_white_space(next_codepoint(cur, i))) break;
          b = i;
        }
        while (st.strip_right && e > b) {
          size_t s;
          if (!is_white_space(prev_codepoint(cur, e, s))) break;
          e = s;
        }
        cur = cur.substr(b, e - b);
        break;
      }
      case NormStep::kPrepend:
        if (!cur.empty()) tmp = st.a + std::string(cur), storage.swap(tmp), cur = storage;
        break;
      case NormStep::kReplace: {
        tmp.clear();
        size_t i = 0;
        for (size_t f; (f = cur.find(st.a, i)) != std::string_view::npos; i = f + st.a.size())
          tmp.append(cur.substr(i, f - i)).append(st.b);
        tmp.append(cur.substr(i));
        storage.swap(tmp), cur = storage;
        break;
      }
    }
  }
  return cur;
}

// --- pre-tokenizer ----------------------------------------------------------------------------
void PreTokenizer::load(const json& j, const std::string& where) {
  steps_.clear();
  byte_level_ = false;
  if (!j.is_null()) add(j, where);
}

void PreTokenizer::add(const json& j, const std::string& where) {
  const std::string& type = type_of(j, where);
  TITAN_CHECK(!byte_level_, where, ": a '", type,
              "' pre-tokenizer after ByteLevel is unsupported (ByteLevel must come last)");
  PreStep step;
  if (type == "Sequence") {
    auto it = j.find("pretokenizers");
    TITAN_CHECK(it != j.end() && it->is_array(), where, ".pretokenizers: missing or not an array");
    for (size_t i = 0; i < it->size(); ++i) add((*it)[i], str_cat(where, ".pretokenizers[", i, "]"));
    return;
  } else if (type == "Split") {
    step.regex = get_pattern(j, where);
    std::string b = get_string(j, "behavior", where);
    if (b == "Removed")
      step.behavior = SplitBehavior::kRemoved;
    else if (b == "Isolated")
      step.behavior = SplitBehavior::kIsolated;
    else if (b == "MergedWithPrevious")
      step.behavior = SplitBehavior::kMergedWithPrevious;
    else if (b == "MergedWithNext")
      step.behavior = SplitBehavior::kMergedWithNext;
    else if (b == "Contiguous")
      step.behavior = SplitBehavior::kContiguous;
    else
      fail(where, ".behavior: unsupported split behavior '", b, "'");
    step.invert = get_bool(j, "invert", false, where);
  } else if (type == "ByteLevel") {
    step.kind = PreStep::kByteLevel;
    step.add_prefix_space = get_bool(j, "add_prefix_space", true, where);
    step.use_regex = get_bool(j, "use_regex", true, where);
    if (step.use_regex) {
      static const std::string kGpt2 =
          R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
      step.regex = compile_regex(kGpt2, false, where);
    }
    byte_level_ = true;
  } else if (type == "Digits") {
    step.individual_digits = get_bool(j, "individual_digits", false, where);
    step.regex = compile_regex(step.individual_digits ? R"(\p{N})" : R"(\p{N}+)", false, where);
  } else {
    fail(where, ": unsupported pre-tokenizer type '", type, "'");
  }
  steps_.push_back(std::move(step));
}

namespace {
// Turns matched/unmatched pieces into the kept word ranges for a split behavior (HF's
// NormalizedString::split); empty words are dropped.
void split_by_behavior(std::string_view w, const std::vector<Piece>& pieces, SplitBehavior behavior,
                       bool invert, std::vector<std::string_view>& out) {
  std::vector<std::pair<size_t, size_t>> acc;
  bool prev_match = false;
  for (size_t k = 0; k < pieces.size(); ++k) {
    Piece p = pieces[k];
    bool m = p.match != invert;
    switch (behavior) {
      case SplitBehavior::kIsolated:
        acc.push_back({p.start, p.end});
        break;
      case SplitBehavior::kRemoved:
        if (!m) acc.push_back({p.start, p.end});
        break;
      case SplitBehavior::kContiguous:
        if (m == prev_match && !acc.empty())
          acc.back().second = p.end;
        else
          acc.push_back({p.start, p.end});
        break;
      case SplitBehavior::kMergedWithPrevious:
        if (m && !prev_match && !acc.empty())
          acc.back().second = p.end;
        else
          acc.push_back({p.start, p.end});
        break;
      case SplitBehavior::kMergedWithNext:
        break;  // handled below, right to left
    }
    prev_match = m;
  }
  if (behavior == SplitBehavior::kMergedWithNext) {
    prev_match = false;
    for (size_t k = pieces.size(); k-- > 0;) {
      Piece p = pieces[k];
      bool m = p.match != invert;
      if (m && !prev_match && !acc.empty())
        acc.back().first = p.start;
      else
        acc.push_back({p.start, p.end});
      prev_match = m;
    }
    std::reverse(acc.begin(), acc.end());
  }
  for (auto [s, e] : acc)
    if (e > s) out.push_back(w.substr(s, e - s));
}
}  // namespace

void PreTokenizer::apply(std::string_view text, std::vector<std::string_view>& words,
                         std::deque<std::string>& arena) const {
  words.clear();
  if (!text.empty()) words.push_back(text);
  std::vector<std::string_view> next;
  std::vector<Piece> pieces;
  for (const PreStep& st : steps_) {
    next.clear();
    for (std::string_view w : words) {
      if (st.kind == PreStep::kByteLevel) {
        if (st.add_prefix_space && w[0] != ' ') {
          arena.emplace_back(1, ' ');
          arena.back().append(w);
          w = arena.back();
        }
        if (!st.use_regex) {
          next.push_back(w);
          continue;
        }
      }
      find_pieces(*st.regex, w, pieces);
      split_by_behavior(w, pieces, st.behavior, st.invert, next);
    }
    words.swap(next);
  }
}

// --- post-processor ---------------------------------------------------------------------------
void PostProcessor::load(const json& j, const std::string& where) {
  has_template_ = false;
  prefix_.clear();
  suffix_.clear();
  if (!j.is_null()) add(j, where);
}

void PostProcessor::add(const json& j, const std::string& where) {
  const std::string& type = type_of(j, where);
  if (type == "Sequence") {
    auto it = j.find("processors");
    TITAN_CHECK(it != j.end() && it->is_array(), where, ".processors: missing or not an array");
    for (size_t i = 0; i < it->size(); ++i) add((*it)[i], str_cat(where, ".processors[", i, "]"));
  } else if (type == "ByteLevel") {
    // Only trims offsets; ids are unchanged.
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    TITAN_CHECK(!has_template_, where, ": more than one template post-processor");
    auto id_of = [&](const char* key) {
      auto it = j.find(key);
      TITAN_CHECK(it != j.end() && it->is_array() && it->size() == 2 && (*it)[1].is_number_integer(), where,
                  ".", key, ": expected [token, id]");
      return (*it)[1].get<int32_t>();
    };
    prefix_ = {id_of("cls")};
    suffix_ = {id_of("sep")};
    has_template_ = true;
  } else if (type == "TemplateProcessing") {
    TITAN_CHECK(!has_template_, where, ": more than one template post-processor");
    auto single = j.find("single");
    TITAN_CHECK(single != j.end() && single->is_array(), where, ".single: missing or not an array");
    auto specials = j.find("special_tokens");
    bool seen_sequence = false;
    for (size_t i = 0; i < single->size(); ++i) {
      const json& piece = (*single)[i];
      std::string at = str_cat(where, ".single[", i, "]");
      if (piece.contains("Sequence")) {
        TITAN_CHECK(!seen_sequence, at, ": more than one sequence in the single template");
        seen_sequence = true;
        continue;
      }
      TITAN_CHECK(piece.contains("SpecialToken") && piece["SpecialToken"].contains("id"), at,
                  ": expected Sequence or SpecialToken");
      std::string name = piece["SpecialToken"]["id"].get<std::string>();
      TITAN_CHECK(specials != j.end() && specials->contains(name) && (*specials)[name].contains("ids"), where,
                  ".special_tokens: missing entry for '", name, "'");
      for (const json& id : (*specials)[name]["ids"])
        (seen_sequence ? suffix_ : prefix_).push_back(id.get<int32_t>());
    }
    has_template_ = true;
  } else {
    fail(where, ": unsupported post-processor type '", type, "'");
  }
}

void PostProcessor::apply(std::vector<int32_t>& ids) const {
  if (!has_template_) return;
  ids.insert(ids.begin(), prefix_.begin(), prefix_.end());
  ids.insert(ids.end(), suffix_.begin(), suffix_.end());
}

// --- decoder ----------------------------------------------------------------------------------
void Decoder::load(const json& j, const std::string& where) {
  none_ = j.is_null();
  byte_level_ = false;
  if (none_) return;
  const std::string& type = type_of(j, where);
  if (type == "ByteLevel") {
    byte_level_ = true;
  } else if (type == "Sequence" && j.contains("decoders") && j["decoders"].is_array() &&
             j["decoders"].size() == 1) {
    load(j["decoders"][0], where + ".decoders[0]");
  } else {
    fail(where, ": unsupported decoder type '", type, "'");
  }
}

std::string Decoder::apply(const std::vector<const std::string*>& tokens) const {
  std::string out;
  if (!byte_level_) {
    // No decoder: HF joins the tokens with spaces.
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i) out += ' ';
      out += *tokens[i];
    }
    return out;
  }
  std::string bytes = raw_bytes(tokens);
  return is_valid_utf8(bytes) ? bytes : repair_utf8(bytes);
}

std::string Decoder::raw_bytes(const std::vector<const std::string*>& tokens) const {
  std::string bytes;
  for (const std::string* t : tokens) {
    if (!byte_level_) {
      bytes += *t;
      continue;
    }
    // A token whose characters are all in the byte alphabet becomes those bytes; any other
    // token (e.g. an added token with foreign characters) is copied as UTF-8.
    size_t mark = bytes.size();
    bool ok = true;
    for (size_t i = 0; i < t->size();) {
      int b = char_to_byte(next_codepoint(*t, i));
      if (b < 0) {
        ok = false;
        break;
      }
      bytes.push_back(static_cast<char>(b));
    }
    if (!ok) bytes.resize(mark), bytes += *t;
  }
  return bytes;
}

}  // namespace titan::tok
