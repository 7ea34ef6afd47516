// Jinja builtins used by chat templates: string and dict methods, the global functions
// namespace() / range() / raise_exception(), filters and tests. Each follows the Python / Jinja
// behaviour for the argument types chat templates pass; other uses fail with a message naming
// the construct.
#include <algorithm>

#include "core/error.h"
#include "tokenizer/jinja_value.h"

namespace titan::jinja {

namespace {

[[noreturn]] void bad(const std::string& where, const std::string& what) {
  fail(where, ": ", what);
}

const std::string& need_str(const std::string& where, const Value* v, const char* what) {
  if (!v || v->kind != Value::Str)
    bad(where, str_cat(what, " must be a string, got ", v ? type_name(*v) : "nothing"));
  return v->s;
}

int64_t need_int(const std::string& where, const Value* v, const char* what) {
  if (!v || (v->kind != Value::Int && v->kind != Value::Bool))
    bad(where, str_cat(what, " must be an integer, got ", v ? type_name(*v) : "nothing"));
  return v->kind == Value::Int ? v->i : v->b;
}

// str.startswith / endswith with a string or a list (tuple) of strings.
bool affix(const std::string& where, const std::string& s, const Value* arg, bool start) {
  auto one = [&](const std::string& x) {
    return x.size() <= s.size() &&
           (start ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0);
  };
  if (arg && arg->kind == Value::ListK) {
    for (const Value& v : *arg->list)
      if (one(need_str(where, &v, "prefix"))) return true;
    return false;
  }
  return one(need_str(where, arg, start ? "startswith's argument" : "endswith's argument"));
}

std::string lower_upper(std::string s, bool upper) {
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x80) c = upper ? std::toupper(c) : std::tolower(c);
  return s;
}

Value string_method(const std::string& where, const std::string& s, const std::string& name, const Args& a) {
  if (name == "strip" || name == "lstrip" || name == "rstrip")
    return Value::string(py_strip(s, a.get(0, "chars"), name != "rstrip", name != "lstrip"));
  if (name == "startswith" || name == "endswith")
    return Value::boolean(affix(where, s, a.get(0, "prefix"), name == "startswith"));
  if (name == "split") {
    const Value* mx = a.get(1, "maxsplit");
    List parts;
    for (auto& p : py_split(s, a.get(0, "sep"), mx ? need_int(where, mx, "maxsplit") : -1))
      parts.push_back(Value::string(std::move(p)));
    return Value::new_list(std::move(parts));
  }
  if (name == "upper" || name == "lower") return Value::string(lower_upper(s, name == "upper"));
  if (name == "replace") {
    const std::string& from = need_str(where, a.get(0, "old"), "replace's old");
    const std::string& to = need_str(where, a.get(1, "new"), "replace's new");
    const Value* cnt = a.get(2, "count");
    int64_t left = cnt ? need_int(where, cnt, "count") : -1;
    if (from.empty()) bad(where, "replace with an empty pattern is not supported");
    std::string out;
    size_t pos = 0;
    for (size_t f; left != 0 && (f = s.find(from, pos)) != std::string::npos; --left) {
      out += s.substr(pos, f - pos) + to;
      check_string_size(out.size());
      pos = f + from.size();
    }
    return Value::string(out + s.substr(pos));
  }
  if (name == "find") {
    const size_t f = s.find(need_str(where, a.get(0, "sub"), "find's argument"));
    if (f == std::string::npos) return Value::integer(-1);
    return Value::integer(static_cast<int64_t>(count_code_points(s.substr(0, f))));
  }
  if (name == "join") {
    const Value* items = a.get(0, "iterable");
    if (!items || items->kind != Value::ListK) bad(where, "join needs a list");
    std::string out;
    for (size_t k = 0; k < items->list->size(); ++k)
      out += (k ? s : "") + need_str(where, &(*items->list)[k], "join's items");
    return Value::string(out);
  }
  bad(where, str_cat("unsupported string method '", name, "'"));
}

}  // namespace

Value call_method(const std::string& where, const Value& obj, const std::string& name, const Args& a) {
  if (obj.kind == Value::Str) return string_method(where, obj.s, name, a);
  if (obj.kind == Value::DictK && !obj.is_namespace) {
    if (name == "items" || name == "keys" || name == "values") {
      List out;
      for (const auto& [k, v] : *obj.dict) {
        if (name == "items")
          out.push_back(Value::new_list({Value::string(k), v}));
        else
          out.push_back(name == "keys" ? Value::string(k) : v);
      }
      return Value::new_list(std::move(out));
    }
    if (name == "get") {
      const Value* v = obj.find(need_str(where, a.get(0, "key"), "get's key"));
      if (v) return *v;
      const Value* d = a.get(1, "default");
      return d ? *d : Value::none();
    }
  }
  if (obj.kind == Value::Undefined) bad(where, str_cat("cannot call '", name, "' on an undefined value"));
  bad(where, str_cat("unsupported method '", name, "' of a ", type_name(obj)));
}

Value call_function(const std::string& where, const std::string& name, const Args& a) {
  if (name == "namespace") {
    Value ns = Value::new_dict();
    ns.is_namespace = true;
    render_keep_namespace(ns.dict);
    if (!a.pos.empty()) bad(where, "namespace() takes keyword arguments only");
    for (const auto& [k, v] : a.kw) ns.set(k, v);
    return ns;
  }
  if (name == "range") {
    int64_t start = 0, stop, step = 1;
    if (a.pos.size() == 1) {
      stop = need_int(where, &a.pos[0], "range's argument");
    } else if (a.pos.size() == 2 || a.pos.size() == 3) {
      start = need_int(where, &a.pos[0], "range's start");
      stop = need_int(where, &a.pos[1], "range's stop");
      if (a.pos.size() == 3) step = need_int(where, &a.pos[2], "range's step");
    } else {
      bad(where, "range() takes 1 to 3 arguments");
    }
    if (step == 0) bad(where, "range() step must not be zero");
    // Its length, computed without overflow, is bounded: a loop over it runs in the render.
    constexpr int64_t kMaxRange = 10'000'000;
    const __int128 span = step > 0 ? (__int128)stop - start : (__int128)start - stop;
    const __int128 len =
        span <= 0 ? 0
                  : (span + (step > 0 ? step : -(__int128)step) - 1) / (step > 0 ? step : -(__int128)step);
    if (len > kMaxRange)
      bad(where, str_cat("range() of ", (long long)len, " items (at most ", kMaxRange, ")"));
    List out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back(Value::integer(i));
    return Value::new_list(std::move(out));
  }
  if (name == "raise_exception") {
    const Value* msg = a.get(0, "message");
    bad(where, str_cat("the template raised an error: ", msg ? to_str(*msg) : ""));
  }
  bad(where, str_cat("unsupported function '", name, "'"));
}

Value apply_filter(const std::string& where, const std::string& name, const Value& in, const Args& a) {
  if (name == "length" || name == "count") {
    if (in.kind == Value::Str) return Value::integer(static_cast<int64_t>(count_code_points(in.s)));
    if (in.kind == Value::ListK) return Value::integer(static_cast<int64_t>(in.list->size()));
    if (in.kind == Value::DictK && !in.is_namespace)
      return Value::integer(static_cast<int64_t>(in.dict->size()));
    if (in.kind == Value::Undefined) return Value::integer(0);
    bad(where, str_cat("length of a ", type_name(in)));
  }
  if (name == "trim") return Value::string(py_strip(to_str(in), a.get(0, "chars"), true, true));
  if (name == "string") return Value::string(to_str(in));
  if (name == "safe") return in;
  if (name == "lower" || name == "upper") return Value::string(lower_upper(to_str(in), name == "upper"));
  if (name == "tojson") {
    JsonStyle st;
    if (const Value* ind = a.get(0, "indent"); ind && ind->kind != Value::None) {
      const int64_t indent = need_int(where, ind, "tojson's indent");
      if (indent > 1024) bad(where, str_cat("tojson's indent ", indent, " is larger than 1024"));
      st.indent = static_cast<int>(std::max<int64_t>(indent, -1));
    }
    if (const Value* sk = a.get(99, "sort_keys")) st.sort_keys = truthy(*sk);
    if (const Value* ea = a.get(99, "ensure_ascii")) st.ensure_ascii = truthy(*ea);
    if (const Value* sep = a.get(99, "separators");
        sep && sep->kind == Value::ListK && sep->list->size() == 2) {
      st.item_sep = need_str(where, &(*sep->list)[0], "separators");
      st.key_sep = need_str(where, &(*sep->list)[1], "separators");
    }
    return Value::string(to_json(in, st));
  }
  if (name == "default" || name == "d") {
    const Value* dflt = a.get(0, "default_value");
    const Value* boolean = a.get(1, "boolean");
    const bool use = in.kind == Value::Undefined || (boolean && truthy(*boolean) && !truthy(in));
    return use ? (dflt ? *dflt : Value::string("")) : in;
  }
  if (name == "first" || name == "last") {
    if (in.kind == Value::ListK) {
      if (in.list->empty()) return Value();
      return name == "first" ? in.list->front() : in.list->back();
    }
    if (in.kind == Value::Str) {
      const auto cps = code_points(in.s);
      if (cps.empty()) return Value();
      return Value::string(name == "first" ? cps.front() : cps.back());
    }
    bad(where, str_cat(name, " of a ", type_name(in)));
  }
  if (name == "join") {
    if (in.kind != Value::ListK) bad(where, str_cat("join of a ", type_name(in)));
    const Value* sep = a.get(0, "d");
    std::string out;
    for (size_t k = 0; k < in.list->size(); ++k) {
      out += (k && sep ? to_str(*sep) : "") + to_str((*in.list)[k]);
      check_string_size(out.size());
    }
    return Value::string(out);
  }
  if (name == "list") {
    if (in.kind == Value::ListK) return Value::new_list(*in.list);
    if (in.kind == Value::Str) {
      List out;
      for (auto& c : code_points(in.s)) out.push_back(Value::string(c));
      return Value::new_list(std::move(out));
    }
    if (in.kind == Value::DictK) return call_method(where, in, "keys", {});
    bad(where, str_cat("list of a ", type_name(in)));
  }
  if (name == "items") return call_method(where, in, "items", {});
  if (name == "reverse") {
    if (in.kind == Value::Str) {
      auto cps = code_points(in.s);
      std::string out;
      for (auto it = cps.rbegin(); it != cps.rend(); ++it) out += *it;
      return Value::string(out);
    }
    if (in.kind != Value::ListK) bad(where, str_cat("reverse of a ", type_name(in)));
    List l(in.list->rbegin(), in.list->rend());
    return Value::new_list(std::move(l));
  }
  bad(where, str_cat("unsupported filter '", name, "'"));
}

bool apply_test(const std::string& where, const std::string& name, const Value& in, const Args& a) {
  if (name == "defined") return in.kind != Value::Undefined;
  if (name == "undefined") return in.kind == Value::Undefined;
  if (name == "none") return in.kind == Value::None;
  if (name == "string") return in.kind == Value::Str;
  if (name == "boolean") return in.kind == Value::Bool;
  if (name == "true") return in.kind == Value::Bool && in.b;
  if (name == "false") return in.kind == Value::Bool && !in.b;
  if (name == "integer") return in.kind == Value::Int;
  if (name == "float") return in.kind == Value::Float;
  if (name == "number") return in.kind == Value::Int || in.kind == Value::Float;
  if (name == "mapping") return in.kind == Value::DictK && !in.is_namespace;
  if (name == "sequence" || name == "iterable")
    return in.kind == Value::ListK || in.kind == Value::Str || (in.kind == Value::DictK && !in.is_namespace);
  if (name == "eq" || name == "equalto" || name == "sameas") {
    const Value* other = a.get(0, "other");
    if (!other) bad(where, str_cat("test '", name, "' needs an argument"));
    return equal(in, *other);
  }
  if (name == "odd" || name == "even") {
    const int64_t v = need_int(where, &in, "the value of an odd/even test");
    return (v % 2 != 0) == (name == "odd");
  }
  bad(where, str_cat("unsupported test '", name, "'"));
}

}  // namespace titan::jinja
