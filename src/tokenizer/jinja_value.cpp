// Jinja values: conversion from JSON, Python str() / repr(), json.dumps (for tojson) and Python
// string methods on code points.
#include "tokenizer/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "core/error.h"

namespace titan::jinja {

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return none();
    case nlohmann::ordered_json::value_t::boolean:
      return boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
    case nlohmann::ordered_json::value_t::number_unsigned:
      return integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_float:
      return number(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List l;
      for (const auto& x : j) l.push_back(from_json(x));
      return new_list(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      for (const auto& [k, v] : j.items()) d.emplace_back(k, from_json(v));
      return new_dict(std::move(d));
    }
    default:
      render_error(str_cat("unsupported JSON value of type ", j.type_name()));
  }
}

const Value* Value::find(const std::string& key) const {
  if (kind != DictK) return nullptr;
  for (const auto& [k, v] : *dict)
    if (k == key) return &v;
  return nullptr;
}

void Value::set(const std::string& key, Value v) {
  depth = std::max(depth, 1 + v.nested_depth());
  for (auto& [k, x] : *dict)
    if (k == key) {
      x = std::move(v);
      return;
    }
  dict->emplace_back(key, std::move(v));
}

const char* type_name(const Value& v) {
  switch (v.kind) {
    case Value::Undefined:
      return "undefined";
    case Value::None:
      return "none";
    case Value::Bool:
      return "bool";
    case Value::Int:
      return "int";
    case Value::Float:
      return "float";
    case Value::Str:
      return "string";
    case Value::ListK:
      return "list";
    case Value::DictK:
      return v.is_namespace ? "namespace" : "dict";
    case Value::MacroK:
      return "macro";
  }
  return "?";
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Undefined:
    case Value::None:
      return false;
    case Value::Bool:
      return v.b;
    case Value::Int:
      return v.i != 0;
    case Value::Float:
      return v.f != 0;
    case Value::Str:
      return !v.s.empty();
    case Value::ListK:
      return !v.list->empty();
    case Value::DictK:
      return v.is_namespace || !v.dict->empty();
    case Value::MacroK:
      return true;
  }
  return false;
}

// Python float repr: shortest round-trip digits, always with a '.' or an exponent.
std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, x);
  std::string s(buf, end);
  const auto e = s.find('e');
  const double ax = std::fabs(x);
  if (e == std::string::npos && (ax >= 1e16 || (ax != 0 && ax < 1e-4))) {
    // to_chars chose fixed notation where Python uses scientific: redo in scientific.
    auto [end2, ec2] = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
    s.assign(buf, end2);
  } else if (e != std::string::npos && ax >= 1e-4 && ax < 1e16) {
    auto [end2, ec2] = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::fixed);
    s.assign(buf, end2);
  }
  const auto e2 = s.find('e');
  if (e2 == std::string::npos) {
    if (s.find('.') == std::string::npos) s += ".0";
    return s;
  }
  // Python writes the exponent with a sign and at least two digits: 1e-05, 1e+16.
  std::string mant = s.substr(0, e2), exp = s.substr(e2 + 1);
  char sign = '+';
  if (!exp.empty() && (exp[0] == '-' || exp[0] == '+')) sign = exp[0], exp.erase(0, 1);
  if (exp.size() < 2) exp = "0" + exp;
  return mant + "e" + sign + exp;
}

std::string repr(const Value& v);

std::string to_str(const Value& v) {
  switch (v.kind) {
    case Value::Undefined:
      return "";
    case Value::None:
      return "None";
    case Value::Bool:
      return v.b ? "True" : "False";
    case Value::Int:
      return std::to_string(v.i);
    case Value::Float:
      return float_repr(v.f);
    case Value::Str:
      return v.s;
    default:
      return repr(v);
  }
}

std::string repr(const Value& v) {
  switch (v.kind) {
    case Value::Str: {
      // Python prefers single quotes unless the string holds one and no double quote.
      const bool dq = v.s.find('\'') != std::string::npos && v.s.find('"') == std::string::npos;
      const char q = dq ? '"' : '\'';
      std::string out(1, q);
      for (char c : v.s) {
        if (c == q || c == '\\')
          out += '\\', out += c;
        else if (c == '\n')
          out += "\\n";
        else if (c == '\t')
          out += "\\t";
        else if (c == '\r')
          out += "\\r";
        else
          out += c;
      }
      return out + q;
    }
    case Value::ListK: {
      std::string out = "[";
      for (size_t k = 0; k < v.list->size(); ++k) {
        out += (k ? ", " : "") + repr((*v.list)[k]);
        check_string_size(out.size());
      }
      return out + "]";
    }
    case Value::DictK: {
      if (v.is_namespace) return "<Namespace>";
      std::string out = "{";
      bool first = true;
      for (const auto& [k, x] : *v.dict) {
        out += (first ? "'" : ", '") + k + "': " + repr(x);
        check_string_size(out.size());
        first = false;
      }
      return out + "}";
    }
    case Value::MacroK:
      return "<Macro '" + (v.caller_of >= 0 ? std::string("caller") : v.macro->target) + "'>";
    default:
      return to_str(v);
  }
}

namespace {

void json_string(const std::string& s, bool ensure_ascii, std::string& out) {
  out += '"';
  for (size_t k = 0; k < s.size(); ++k) {
    const unsigned char c = static_cast<unsigned char>(s[k]);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20 || (ensure_ascii && c >= 0x80)) {
          uint32_t cp = c;
          if (c >= 0x80) {
            size_t pos = k;
            cp = next_codepoint(s, pos);
            k = pos - 1;
          }
          char buf[16];
          if (cp >= 0x10000) {
            cp -= 0x10000;
            std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
          } else {
            std::snprintf(buf, sizeof buf, "\\u%04x", cp);
          }
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void json_dump(const Value& v, const JsonStyle& st, int depth, std::string& out) {
  std::string nl, nl_end;  // line breaks and indents of json.dumps(indent=n)
  if (st.indent >= 0) {
    nl.append(1, '\n').append(static_cast<size_t>(st.indent * (depth + 1)), ' ');
    nl_end.append(1, '\n').append(static_cast<size_t>(st.indent * depth), ' ');
  }
  const std::string item_sep = st.indent >= 0 ? "," : st.item_sep;
  switch (v.kind) {
    case Value::Undefined:
      render_error("tojson: cannot serialize an undefined value");
    case Value::MacroK:
      render_error("tojson: cannot serialize a macro");
    case Value::None:
      out += "null";
      return;
    case Value::Bool:
      out += v.b ? "true" : "false";
      return;
    case Value::Int:
      out += std::to_string(v.i);
      return;
    case Value::Float:
      out += std::isnan(v.f)   ? "NaN"
             : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity")
                               : float_repr(v.f);
      return;
    case Value::Str:
      json_string(v.s, st.ensure_ascii, out);
      return;
    case Value::ListK:
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += "[";
      for (size_t k = 0; k < v.list->size(); ++k) {
        out += k ? item_sep + nl : nl;
        json_dump((*v.list)[k], st, depth + 1, out);
        check_string_size(out.size());
      }
      out += nl_end + "]";
      return;
    case Value::DictK: {
      if (v.is_namespace) render_error("tojson: cannot serialize a namespace");
      if (v.dict->empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : *v.dict) items.push_back(&kv);
      if (st.sort_keys)
        std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += "{";
      for (size_t k = 0; k < items.size(); ++k) {
        out += k ? item_sep + nl : nl;
        json_string(items[k]->first, st.ensure_ascii, out);
        out += st.key_sep;
        json_dump(items[k]->second, st, depth + 1, out);
        check_string_size(out.size());
      }
      out += nl_end + "}";
      return;
    }
  }
}

}  // namespace

std::string to_json(const Value& v, const JsonStyle& style) {
  std::string out;
  json_dump(v, style, 0, out);
  return out;
}

uint32_t next_codepoint(const std::string& s, size_t& pos) {
  const unsigned char c = static_cast<unsigned char>(s[pos]);
  const int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  uint32_t cp = n == 1 ? c : c & (0x7F >> n);
  for (int k = 1; k < n && pos + k < s.size(); ++k)
    cp = (cp << 6) | (static_cast<unsigned char>(s[pos + k]) & 0x3F);
  pos += n;
  return cp;
}

size_t count_code_points(const std::string& s) {
  size_t n = 0;
  for (size_t pos = 0; pos < s.size(); ++n) next_codepoint(s, pos);
  return n;
}

std::vector<std::string> code_points(const std::string& s) {
  charge_work(static_cast<int64_t>(s.size() + sizeof(std::string) * count_code_points(s)));
  std::vector<std::string> out;
  for (size_t pos = 0; pos < s.size();) {
    const size_t start = pos;
    next_codepoint(s, pos);
    out.push_back(s.substr(start, pos - start));
  }
  return out;
}

bool is_py_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

std::string py_strip(const std::string& s, const Value* chars, bool left, bool right) {
  std::vector<uint32_t> set;
  const bool ws = chars == nullptr || chars->kind == Value::None;
  if (!ws) {
    if (chars->kind != Value::Str)
      render_error(str_cat("strip: the characters must be a string, got ", type_name(*chars)));
    for (size_t p = 0; p < chars->s.size();) set.push_back(next_codepoint(chars->s, p));
  }
  auto strip_it = [&](uint32_t cp) {
    return ws ? is_py_space(cp) : std::find(set.begin(), set.end(), cp) != set.end();
  };
  size_t begin = 0, end = s.size();
  if (left)
    while (begin < end) {
      size_t p = begin;
      if (!strip_it(next_codepoint(s, p))) break;
      begin = p;
    }
  if (right)
    while (end > begin) {
      size_t start = end - 1;
      while (start > begin && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
      size_t p = start;
      if (!strip_it(next_codepoint(s, p))) break;
      end = start;
    }
  return s.substr(begin, end - begin);
}

std::vector<std::string> py_split(const std::string& s, const Value* sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep == nullptr || sep->kind == Value::None) {
    // Runs of whitespace separate; no empty strings at the ends.
    size_t pos = 0;
    while (pos < s.size()) {
      size_t p = pos;
      if (is_py_space(next_codepoint(s, p))) {
        pos = p;
        continue;
      }
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        out.push_back(py_strip(s.substr(pos), nullptr, false, true));
        return out;
      }
      size_t end = pos;
      while (end < s.size()) {
        size_t q = end;
        if (is_py_space(next_codepoint(s, q))) break;
        end = q;
      }
      out.push_back(s.substr(pos, end - pos));
      pos = end;
    }
    return out;
  }
  if (sep->kind != Value::Str)
    render_error(str_cat("split: the separator must be a string, got ", type_name(*sep)));
  if (sep->s.empty()) render_error("split: empty separator");
  size_t pos = 0;
  for (;;) {
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) break;
    const size_t f = s.find(sep->s, pos);
    if (f == std::string::npos) break;
    out.push_back(s.substr(pos, f - pos));
    pos = f + sep->s.size();
  }
  out.push_back(s.substr(pos));
  return out;
}

}  // namespace titan::jinja

namespace titan::jinja {

bool equal(const Value& a, const Value& b) {
  auto is_num = [](const Value& v) {
    return v.kind == Value::Int || v.kind == Value::Float || v.kind == Value::Bool;
  };
  if (is_num(a) && is_num(b)) {
    auto f = [](const Value& v) {
      return v.kind == Value::Float ? v.f : v.kind == Value::Int ? double(v.i) : v.b;
    };
    if (a.kind != Value::Float && b.kind != Value::Float)
      return (a.kind == Value::Int ? a.i : a.b) == (b.kind == Value::Int ? b.i : b.b);
    return f(a) == f(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Undefined:
    case Value::None:
      return true;
    case Value::Str:
      return a.s == b.s;
    case Value::ListK:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equal((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case Value::DictK:
      if (a.dict == b.dict) return true;
      if (a.is_namespace || b.is_namespace || a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, v] : *a.dict) {
        const Value* w = b.find(k);
        if (!w || !equal(v, *w)) return false;
      }
      return true;
    case Value::MacroK:
      return a.macro == b.macro && a.caller_of == b.caller_of;
    default:
      return false;
  }
}

}  // namespace titan::jinja
