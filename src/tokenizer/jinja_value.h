// Python semantics for Jinja values: truthiness, str() / repr(), json.dumps, and the string
// helpers (code points, strip, split) the evaluator's methods and filters are built on.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/jinja_ast.h"

namespace titan::jinja {

const char* type_name(const Value& v);
bool truthy(const Value& v);
std::string float_repr(double x);    // Python repr(float)
std::string to_str(const Value& v);  // Python str(); undefined -> ""
std::string repr(const Value& v);    // Python repr()

// json.dumps options (HF's tojson filter: ensure_ascii=False, indent=None, separators None).
struct JsonStyle {
  bool ensure_ascii = false;
  int indent = -1;  // < 0: one line
  std::string item_sep = ", ", key_sep = ": ";
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonStyle& style);

// UTF-8 helpers (strings are valid UTF-8 by construction: JSON input and template literals).
uint32_t next_codepoint(const std::string& s, size_t& pos);
std::vector<std::string> code_points(const std::string& s);
size_t count_code_points(const std::string& s);  // len(s), without building the list
bool is_py_space(uint32_t cp);                   // str.isspace() for one code point
// str.strip / lstrip / rstrip (chars: null or none = whitespace).
std::string py_strip(const std::string& s, const Value* chars, bool left, bool right);
// str.split(sep, maxsplit) (sep: null or none = runs of whitespace; maxsplit < 0: no limit).
std::vector<std::string> py_split(const std::string& s, const Value* sep, int64_t maxsplit);

bool equal(const Value& a, const Value& b);  // Python ==

// Arguments of a call, filter or test.
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  // Keyword `kwname` if given, else positional argument i, else nullptr.
  const Value* get(size_t i, const char* kwname) const {
    for (const auto& [k, v] : kw)
      if (k == kwname) return &v;
    return i < pos.size() ? &pos[i] : nullptr;
  }
};

// Builtins (jinja_builtins.cpp). `where` ("template:line") prefixes error messages.
Value call_method(const std::string& where, const Value& obj, const std::string& name, const Args& args);
Value call_function(const std::string& where, const std::string& name, const Args& args);
Value apply_filter(const std::string& where, const std::string& name, const Value& input, const Args& args);
bool apply_test(const std::string& where, const std::string& name, const Value& input, const Args& args);

}  // namespace titan::jinja
