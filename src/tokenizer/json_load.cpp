// tokenizer.json reader (see json_load.h): a small recursive-descent JSON parser that builds an
// nlohmann tree for everything except model.vocab and model.merges, which it scans straight
// into flat vectors. Strings are validated as UTF-8 (like nlohmann), so later stages may assume
// well-formed text.
#include "tokenizer/json_load.h"

#include <charconv>
#include <cstring>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace titan::tok {

using nlohmann::json;

namespace {
class Parser {
 public:
  Parser(const std::string& text, const std::string& file, TokenizerFile& out)
      : begin_(text.data()), p_(text.data()), end_(text.data() + text.size()), file_(file), out_(out) {}

  void parse() {
    ws();
    if (peek() != '{') error("expected a JSON object at the top level");
    out_.rest = json::object();
    object([&](std::string& key) {
      if (key == "model" && (ws(), peek() == '{')) {
        json model = json::object();
        object([&](std::string& k) {
          if (k == "vocab")
            vocab();
          else if (k == "merges")
            merges();
          else
            model[k] = value(2);
        });
        out_.rest["model"] = std::move(model);
      } else {
        out_.rest[key] = value(1);
      }
    });
    ws();
    if (p_ != end_) error("unexpected text after the top-level object");
  }

 private:
  [[noreturn]] void error(const char* what) {
    fail("tokenizer: '", file_, "' is not valid JSON (byte ", p_ - begin_, "): ", what);
  }
  [[noreturn]] void field_error(const std::string& what) { fail(file_, ": ", what); }
  void ws() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\n' || *p_ == '\r' || *p_ == '\t')) ++p_;
  }
  char peek() const { return p_ < end_ ? *p_ : '\0'; }
  void expect(char c) {
    ws();
    if (peek() != c)
      error(c == ':' ? "expected ':'" : c == '"' ? "expected a string" : "unexpected character");
    ++p_;
  }
  unsigned hex4() {
    if (end_ - p_ < 4) error("truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      char c = *p_++;
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= c - '0';
      else if (c >= 'a' && c <= 'f')
        v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        v |= c - 'A' + 10;
      else
        error("bad \\u escape");
    }
    return v;
  }
  // Reads a string (p_ at the opening quote) into s.
  void string(std::string& s) {
    expect('"');
    s.clear();
    while (true) {
      const char* q = p_;
      while (q < end_ && *q != '"' && *q != '\\' && static_cast<unsigned char>(*q) >= 0x20) ++q;
      s.append(p_, q);
      p_ = q;
      if (p_ >= end_) error("unterminated string");
      char c = *p_++;
      if (c == '"') break;
      if (c != '\\') error("control character in string");
      if (p_ >= end_) error("unterminated string");
      switch (char e = *p_++) {
        case '"':
          s += '"';
          break;
        case '\\':
          s += '\\';
          break;
        case '/':
          s += '/';
          break;
        case 'b':
          s += '\b';
          break;
        case 'f':
          s += '\f';
          break;
        case 'n':
          s += '\n';
          break;
        case 'r':
          s += '\r';
          break;
        case 't':
          s += '\t';
          break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00) {
            if (end_ - p_ < 6 || p_[0] != '\\' || p_[1] != 'u') error("lone surrogate in \\u escape");
            p_ += 2;
            unsigned lo = hex4();
            if (lo < 0xDC00 || lo >= 0xE000) error("bad surrogate pair in \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            error("lone surrogate in \\u escape");
          }
          append_utf8(s, cp);
          break;
        }
        default:
          (void)e;
          error("bad escape in string");
      }
    }
    if (!is_valid_utf8(s)) error("invalid UTF-8 in string");
  }
  // Calls on_member(key) with p_ before each member's value; the callback must consume it.
  template <class F>
  void object(F&& on_member) {
    expect('{');
    ws();
    if (peek() == '}') {
      ++p_;
      return;
    }
    std::string key;
    while (true) {
      string(key);
      expect(':');
      on_member(key);
      ws();
      char c = peek();
      ++p_;
      if (c == '}') return;
      if (c != ',') error("expected ',' or '}'");
      ws();
    }
  }
  template <class F>
  void array(F&& on_element) {
    expect('[');
    ws();
    if (peek() == ']') {
      ++p_;
      return;
    }
    for (size_t i = 0;; ++i) {
      on_element(i);
      ws();
      char c = peek();
      ++p_;
      if (c == ']') return;
      if (c != ',') error("expected ',' or ']'");
    }
  }
  json number() {
    const char* s = p_;
    bool is_float = false;
    if (peek() == '-') ++p_;
    while (p_ < end_ && ((*p_ >= '0' && *p_ <= '9') || *p_ == '.' || *p_ == 'e' || *p_ == 'E' || *p_ == '+' ||
                         *p_ == '-')) {
      is_float |= *p_ == '.' || *p_ == 'e' || *p_ == 'E';
      ++p_;
    }
    if (!is_float) {
      if (*s == '-') {
        int64_t v = 0;
        if (std::from_chars(s, p_, v).ptr == p_) return json(v);
      } else {
        uint64_t v = 0;
        if (std::from_chars(s, p_, v).ptr == p_) return json(v);
      }
    }
    double d = 0;
    auto r = std::from_chars(s, p_, d);
    if (r.ec != std::errc() || r.ptr != p_) error("bad number");
    return json(d);
  }
  bool literal(const char* word) {
    size_t n = std::strlen(word);
    if (static_cast<size_t>(end_ - p_) < n || std::memcmp(p_, word, n)) error("unexpected character");
    p_ += n;
    return true;
  }
  json value(int depth) {
    if (depth > 256) error("nesting too deep");
    ws();
    switch (peek()) {
      case '{': {
        json j = json::object();
        object([&](std::string& k) { j[k] = value(depth + 1); });
        return j;
      }
      case '[': {
        json j = json::array();
        array([&](size_t) { j.push_back(value(depth + 1)); });
        return j;
      }
      case '"': {
        std::string s;
        string(s);
        return json(std::move(s));
      }
      case 't':
        return literal("true"), json(true);
      case 'f':
        return literal("false"), json(false);
      case 'n':
        return literal("null"), json(nullptr);
      case '\0':
        error("unexpected end of input");
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) return number();
        error("unexpected character");
    }
  }
  void vocab() {
    ws();
    if (peek() != '{') field_error("model.vocab: expected an object of token -> id");
    object([&](std::string& token) {
      ws();
      const char* s = p_;
      int64_t id = -1;
      auto r = std::from_chars(p_, end_, id);
      if (r.ec != std::errc() || (r.ptr < end_ && (*r.ptr == '.' || *r.ptr == 'e' || *r.ptr == 'E')) ||
          r.ptr == s)
        field_error(str_cat("model.vocab: id of '", token, "' is not an integer"));
      p_ = r.ptr;
      if (id < 0 || id >= INT32_MAX)
        field_error(str_cat("model.vocab: id ", id, " of '", token, "' out of range"));
      out_.vocab.emplace_back(token, id);
    });
    out_.has_vocab = true;
  }
  void merges() {
    ws();
    if (peek() != '[') field_error("model.merges: expected an array");
    std::string a, b;
    array([&](size_t i) {
      ws();
      if (peek() == '"') {
        string(a);
        size_t sp = a.find(' ');
        if (sp == std::string::npos || a.find(' ', sp + 1) != std::string::npos)
          field_error(str_cat("model.merges[", i, "]: expected \"left right\", got \"", a, "\""));
        out_.merges.emplace_back(a.substr(0, sp), a.substr(sp + 1));
      } else if (peek() == '[') {
        ++p_;
        ws();
        if (peek() != '"') field_error(str_cat("model.merges[", i, "]: expected a pair of strings"));
        string(a);
        expect(',');
        ws();
        if (peek() != '"') field_error(str_cat("model.merges[", i, "]: expected a pair of strings"));
        string(b);
        ws();
        if (peek() != ']') field_error(str_cat("model.merges[", i, "]: expected a pair of strings"));
        ++p_;
        out_.merges.emplace_back(a, b);
      } else {
        field_error(str_cat("model.merges[", i, "]: expected a pair of strings"));
      }
    });
    out_.has_merges = true;
  }

  const char* begin_;
  const char* p_;
  const char* end_;
  const std::string& file_;
  TokenizerFile& out_;
};
}  // namespace

TokenizerFile parse_tokenizer_file(const std::string& text, const std::string& file) {
  TokenizerFile out;
  Parser(text, file, out).parse();
  return out;
}

}  // namespace titan::tok
