// Jinja subset evaluator: walks the statement tree with Jinja's scoping (a for loop's body is its
// own scope; namespaces carry values out of it) and Python semantics for expressions.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <optional>
#include <unordered_map>

#include "core/error.h"
#include "tokenizer/jinja_value.h"

namespace titan::jinja {

namespace {

enum class Flow { Normal, Break, Continue };

// The render running on this thread: where it is (for the limits' messages) and its namespaces.
struct RenderState {
  const std::string* name = nullptr;
  int line = 0;
  std::vector<std::shared_ptr<Dict>> namespaces;
};
thread_local RenderState* current_render = nullptr;

class Renderer {
 public:
  Renderer(const std::string& name, RenderResult& out) : name_(name), out_(out) {
    state_.name = &name_;
    outer_ = current_render;
    outer_work_ = render_work_left;
    current_render = &state_;
    render_work_left = kRenderWorkBudget;
  }
  ~Renderer() {
    // Empty the namespaces first: every one is still held here, so no release recurses through them.
    for (auto& ns : state_.namespaces) ns->clear();
    current_render = outer_;
    render_work_left = outer_work_;
  }
  Renderer(const Renderer&) = delete;
  Renderer& operator=(const Renderer&) = delete;

  // A new innermost scope whose names shadow `parent`'s (default: the innermost one so far). Lookups go
  // from a scope to its parent: a macro's body sees its arguments and the template's globals, a call
  // block's `caller` body the scope of the {% call %} tag.
  void push_scope(int parent = -2) {
    parents_.push_back(parent == -2 ? static_cast<int>(scopes_.size()) - 1 : parent);
    scopes_.emplace_back();
  }
  void pop_scope() {
    scopes_.pop_back();
    parents_.pop_back();
  }
  void define(const std::string& k, Value v) { scopes_.back()[k] = std::move(v); }

  Flow run(const std::vector<Node>& nodes) {
    for (const Node& n : nodes) {
      const Flow f = run(n);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

 private:
  template <class... A>
  [[noreturn]] void error(int line, A&&... a) const {
    fail(name_, ":", line, ": ", std::forward<A>(a)...);
  }

  Flow run(const Node& n) {
    state_.line = n.line;
    switch (n.type) {
      case Node::Text:
        out_.text += n.text;
        check_string_size(out_.text.size());
        return Flow::Normal;
      case Node::Output: {
        const Value v = eval(*n.expr);
        out_.text += to_str(v);
        check_string_size(out_.text.size());
        return Flow::Normal;
      }
      case Node::If:
        for (const auto& [cond, body] : n.branches)
          if (!cond || truthy(eval(*cond))) return run(body);
        return Flow::Normal;
      case Node::For:
        return run_for(n);
      case Node::Set: {
        Value v = n.expr ? eval(*n.expr) : Value::string(capture(n.body));
        if (n.attr.empty()) {
          scopes_.back()[n.target] = std::move(v);
          return Flow::Normal;
        }
        Value* ns = lookup(n.target);
        if (!ns || ns->kind != Value::DictK || !ns->is_namespace)
          error(n.line, "cannot set attribute '", n.attr, "' of '", n.target, "': it is not a namespace");
        ns->set(n.attr, std::move(v));
        return Flow::Normal;
      }
      case Node::Generation: {
        const size_t begin = out_.text.size();
        const Flow f = run(n.body);
        out_.generation_spans.emplace_back(begin, out_.text.size());
        return f;
      }
      case Node::Macro: {
        Value m;
        m.kind = Value::MacroK;
        m.macro = &n;
        define(n.target, std::move(m));
        return Flow::Normal;
      }
      case Node::CallBlock: {
        // caller: the block's body, run in this scope when the macro calls it.
        const Expr& call = *n.expr;
        const Value callee = call.kids[0]->type == Expr::Name ? lookup_value(call.kids[0]->name) : Value();
        if (callee.kind != Value::MacroK)
          error(n.line, "{% call %}: '", call.kids[0]->name, "' is not a macro");
        Value caller;
        caller.kind = Value::MacroK;
        caller.macro = &n;
        caller.caller_of = next_call_serial_++;
        call_blocks_.emplace_back(caller.caller_of, static_cast<int>(scopes_.size()) - 1);
        struct Leave {
          std::vector<std::pair<int64_t, int>>& blocks;
          ~Leave() { blocks.pop_back(); }
        } leave{call_blocks_};
        out_.text += call_macro(call, callee, args_of(call, 1), &caller).s;
        state_.line = n.line;
        check_string_size(out_.text.size());
        return Flow::Normal;
      }
      case Node::Break:
        return Flow::Break;
      case Node::Continue:
        return Flow::Continue;
    }
    return Flow::Normal;
  }

  Flow run_for(const Node& n) {
    const Value seq = eval(*n.expr);
    List items;
    if (seq.kind == Value::ListK) {
      items = *seq.list;
    } else if (seq.kind == Value::DictK && !seq.is_namespace) {
      for (const auto& kv : *seq.dict) items.push_back(Value::string(kv.first));
    } else if (seq.kind == Value::Str) {
      for (auto& c : code_points(seq.s)) items.push_back(Value::string(c));
    } else if (seq.kind != Value::Undefined) {
      error(n.line, "cannot iterate over a ", type_name(seq));
    }
    if (n.filter) {
      List kept;
      for (const Value& item : items) {
        push_scope();
        bind(n, item);
        const bool keep = truthy(eval(*n.filter));
        pop_scope();
        if (keep) kept.push_back(item);
      }
      items = std::move(kept);
    }
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < len; ++k) {
      charge_work(1);
      push_scope();
      bind(n, items[k]);
      Value loop = Value::new_dict({{"index", Value::integer(k + 1)},
                                    {"index0", Value::integer(k)},
                                    {"revindex", Value::integer(len - k)},
                                    {"revindex0", Value::integer(len - k - 1)},
                                    {"first", Value::boolean(k == 0)},
                                    {"last", Value::boolean(k == len - 1)},
                                    {"length", Value::integer(len)},
                                    {"previtem", k > 0 ? items[k - 1] : Value()},
                                    {"nextitem", k + 1 < len ? items[k + 1] : Value()}});
      define("loop", std::move(loop));
      const Flow f = run(n.body);
      pop_scope();
      if (f == Flow::Break) break;
    }
    if (len == 0 && !n.else_body.empty()) {
      push_scope();
      const Flow f = run(n.else_body);
      pop_scope();
      return f;
    }
    return Flow::Normal;
  }

  void bind(const Node& n, const Value& item) {
    if (n.vars.size() == 1) {
      define(n.vars[0], item);
      return;
    }
    if (item.kind != Value::ListK || item.list->size() != n.vars.size())
      error(n.line, "cannot unpack a ", type_name(item), " into ", n.vars.size(), " loop variables");
    for (size_t k = 0; k < n.vars.size(); ++k) define(n.vars[k], (*item.list)[k]);
  }

  Value* lookup(const std::string& k) {
    for (int i = static_cast<int>(scopes_.size()) - 1; i >= 0; i = parents_[i]) {
      auto f = scopes_[i].find(k);
      if (f != scopes_[i].end()) return &f->second;
    }
    return nullptr;
  }
  Value lookup_value(const std::string& k) {
    const Value* v = lookup(k);
    return v ? *v : Value();
  }

  // What `body` writes, as a string (a macro's result, a block set's value). Generation spans inside it
  // are dropped: the text is a value now, not output.
  std::string capture(const std::vector<Node>& body) {
    const size_t mark = out_.text.size(), spans = out_.generation_spans.size();
    run(body);
    std::string text = out_.text.substr(mark);
    out_.text.resize(mark);
    out_.generation_spans.resize(spans);
    return text;
  }

  // Calls macro `m` (or a call block's `caller`) with `args`; its output is the result.
  Value call_macro(const Expr& e, const Value& m, const Args& args, const Value* caller) {
    const Node& def = *m.macro;
    int parent = 1;  // a macro: the template's top-level variables, then the render's context
    if (m.caller_of >= 0) {
      auto it = std::find_if(call_blocks_.begin(), call_blocks_.end(),
                             [&](const auto& b) { return b.first == m.caller_of; });
      if (it == call_blocks_.end()) error(e.line, "caller() called after its {% call %} block ended");
      parent = it->second;
    }
    if (++macro_depth_ > kMaxMacroDepth) error(e.line, "macro calls nested deeper than ", kMaxMacroDepth);
    struct Leave {
      int& depth;
      ~Leave() { --depth; }
    } leave{macro_depth_};
    const std::string what = m.caller_of >= 0 ? "caller()" : "macro '" + def.target + "'";
    if (args.pos.size() > def.vars.size())
      error(e.line, what, " takes ", def.vars.size(), " arguments, got ", args.pos.size());
    for (const auto& [k, v] : args.kw)
      if (std::find(def.vars.begin(), def.vars.end(), k) == def.vars.end())
        error(e.line, what, " has no parameter '", k, "'");
    push_scope(parent);
    struct Pop {
      Renderer& r;
      ~Pop() { r.pop_scope(); }
    } pop{*this};
    for (size_t k = 0; k < def.vars.size(); ++k) {
      const Value* v = args.get(k, def.vars[k].c_str());
      define(def.vars[k], v ? *v : def.defaults[k] ? eval(*def.defaults[k]) : Value());
    }
    if (caller) define("caller", *caller);
    return Value::string(capture(def.body));
  }

  Value eval(const Expr& e);
  Value eval_expr(const Expr& e);
  Value call(const Expr& e);
  Value filter(const Expr& e) {
    const Value input = eval(*e.kids[0]);
    return apply_filter(where(e), e.name, input, args_of(e, 1));
  }
  bool test(const Expr& e) {
    const Value input = eval(*e.kids[0]);
    return apply_test(where(e), e.name, input, args_of(e, 1));
  }
  std::string where(const Expr& e) const { return str_cat(name_, ":", e.line); }
  Value binary(const Expr& e);
  Value apply_op(const Expr& e, const std::string& op, const Value& a, const Value& b);
  Value index(const Expr& e, const Value& obj, const Value& key);
  Value slice(const Expr& e);

  // Positional and keyword arguments of a call, filter or test (skipping `skip` leading kids).
  Args args_of(const Expr& e, size_t skip) {
    Args a;
    const size_t nkw = e.kwnames.size(), n = e.kids.size();
    for (size_t k = skip; k < n; ++k) {
      Value v = eval(*e.kids[k]);
      if (k + nkw >= n)
        a.kw.emplace_back(e.kwnames[k + nkw - n], std::move(v));
      else
        a.pos.push_back(std::move(v));
    }
    return a;
  }
  int64_t as_int(const Expr& e, const Value& v, const char* what) const {
    if (v.kind == Value::Int) return v.i;
    if (v.kind == Value::Bool) return v.b;
    error(e.line, what, " must be an integer, got ", type_name(v));
  }

  static constexpr int kMaxMacroDepth = 100;

  const std::string& name_;
  RenderResult& out_;
  RenderState state_;
  std::vector<int> parents_;  // per scope: the scope its lookups continue in (-1: none)
  std::vector<std::pair<int64_t, int>> call_blocks_;  // running {% call %} blocks: serial, scope
  int64_t next_call_serial_ = 0;
  int macro_depth_ = 0;
  RenderState* outer_ = nullptr;
  int64_t outer_work_ = 0;
  std::vector<std::unordered_map<std::string, Value>> scopes_;
};

}  // namespace

thread_local int64_t render_work_left = INT64_MAX;

void render_work_exhausted() {
  // Outside a render: refill. Inside: refill too (the error's own copies must not throw again while it
  // unwinds; the Renderer restores the outer value), then stop the render.
  render_work_left = INT64_MAX;
  if (!current_render) return;
  render_error(str_cat("the render passes its work bound (", kRenderWorkBudget >> 30,
                       " GiB of values made or copied, loop iterations counted too)"));
}

void render_error(const std::string& what) {
  if (current_render) fail(*current_render->name, ":", current_render->line, ": ", what);
  fail(what);
}

void render_keep_namespace(const std::shared_ptr<Dict>& ns) {
  if (current_render) current_render->namespaces.push_back(ns);
}

namespace {

Value Renderer::eval(const Expr& e) {
  state_.line = e.line;
  Value v = eval_expr(e);
  if (v.depth > kMaxValueDepth)
    error(e.line, "a value nested deeper than ", kMaxValueDepth, " lists and dicts");
  return v;
}

Value Renderer::eval_expr(const Expr& e) {
  switch (e.type) {
    case Expr::Lit:
      return e.lit;
    case Expr::Name: {
      const Value* v = lookup(e.name);
      return v ? *v : Value();
    }
    case Expr::Attr: {
      const Value obj = eval(*e.kids[0]);
      if (obj.kind == Value::Undefined)
        error(e.line, "cannot read attribute '", e.name, "' of an undefined value");
      if (obj.kind == Value::None) error(e.line, "cannot read attribute '", e.name, "' of none");
      const Value* v = obj.find(e.name);
      if (v) return *v;
      if (obj.kind == Value::ListK && !e.name.empty() &&
          std::isdigit(static_cast<unsigned char>(e.name[0]))) {
        int64_t k = 0;
        const auto [end, ec] = std::from_chars(e.name.data(), e.name.data() + e.name.size(), k);
        if (ec != std::errc() || end != e.name.data() + e.name.size()) return Value();
        return index(e, obj, Value::integer(k));
      }
      return Value();
    }
    case Expr::Index: {
      const Value obj = eval(*e.kids[0]);
      return index(e, obj, eval(*e.kids[1]));
    }
    case Expr::Slice:
      return slice(e);
    case Expr::Call:
      return call(e);
    case Expr::Filter:
      return filter(e);
    case Expr::Test:
      return Value::boolean(test(e) != e.negate);
    case Expr::Unary: {
      const Value v = eval(*e.kids[0]);
      if (e.name == "not") return Value::boolean(!truthy(v));
      if (v.kind == Value::Int) {
        if (e.name == "-" && v.i == INT64_MIN)
          error(e.line, "integer overflow in -(", v.i, ") (beyond 64 bits)");
        return Value::integer(e.name == "-" ? -v.i : v.i);
      }
      if (v.kind == Value::Float) return Value::number(e.name == "-" ? -v.f : v.f);
      error(e.line, "bad operand type for unary ", e.name, ": ", type_name(v));
    }
    case Expr::Binary:
      return binary(e);
    case Expr::Cond:
      if (truthy(eval(*e.kids[1]))) return eval(*e.kids[0]);
      return e.kids[2] ? eval(*e.kids[2]) : Value();
    case Expr::ListLit: {
      List l;
      for (const auto& k : e.kids) l.push_back(eval(*k));
      return Value::new_list(std::move(l));
    }
    case Expr::DictLit: {
      Value d = Value::new_dict();
      for (size_t k = 0; k < e.kids.size(); k += 2) {
        const Value key = eval(*e.kids[k]);
        if (key.kind != Value::Str) error(e.line, "dict keys must be strings, got ", type_name(key));
        d.set(key.s, eval(*e.kids[k + 1]));
      }
      return d;
    }
  }
  error(e.line, "unsupported expression");
}

Value Renderer::index(const Expr& e, const Value& obj, const Value& key) {
  switch (obj.kind) {
    case Value::DictK: {
      if (key.kind != Value::Str) return Value();
      const Value* v = obj.find(key.s);
      return v ? *v : Value();
    }
    case Value::ListK:
    case Value::Str: {
      const int64_t i = as_int(e, key, "an index");
      if (obj.kind == Value::ListK) {
        const int64_t n = static_cast<int64_t>(obj.list->size());
        const int64_t j = i < 0 ? i + n : i;
        return j >= 0 && j < n ? (*obj.list)[j] : Value();
      }
      const auto cps = code_points(obj.s);
      const int64_t n = static_cast<int64_t>(cps.size());
      const int64_t j = i < 0 ? i + n : i;
      return j >= 0 && j < n ? Value::string(cps[j]) : Value();
    }
    case Value::Undefined:
      error(e.line, "cannot index an undefined value");
    default:
      error(e.line, "cannot index a ", type_name(obj));
  }
}

Value Renderer::slice(const Expr& e) {
  const Value obj = eval(*e.kids[0]);
  std::vector<std::string> chars;  // a string's code points
  if (obj.kind == Value::Str)
    chars = code_points(obj.s);
  else if (obj.kind != Value::ListK)
    error(e.line, "cannot slice a ", type_name(obj));
  const int64_t n = static_cast<int64_t>(obj.kind == Value::ListK ? obj.list->size() : chars.size());
  auto part = [&](int k) -> std::optional<int64_t> {
    if (!e.kids[k]) return std::nullopt;
    const Value v = eval(*e.kids[k]);
    if (v.kind == Value::None) return std::nullopt;
    return as_int(e, v, "a slice bound");
  };
  const int64_t step = part(3).value_or(1);
  if (step == 0) error(e.line, "slice step cannot be zero");
  // Python's slice.indices().
  auto clamp = [&](std::optional<int64_t> b, int64_t dflt) {
    if (!b) return dflt;
    int64_t v = *b < 0 ? *b + n : *b;
    return step > 0 ? std::clamp<int64_t>(v, 0, n) : std::clamp<int64_t>(v, -1, n - 1);
  };
  const int64_t start = clamp(part(1), step > 0 ? 0 : n - 1);
  const int64_t stop = clamp(part(2), step > 0 ? n : -1);
  if (obj.kind == Value::ListK) {
    List out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back((*obj.list)[i]);
    return Value::new_list(std::move(out));
  }
  std::string s;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) s += chars[i];
  return Value::string(std::move(s));
}

Value Renderer::binary(const Expr& e) {
  const std::string& op = e.name;
  if (op == "and") {
    Value a = eval(*e.kids[0]);
    return truthy(a) ? eval(*e.kids[1]) : a;
  }
  if (op == "or") {
    Value a = eval(*e.kids[0]);
    return truthy(a) ? a : eval(*e.kids[1]);
  }
  if (op == "chain") {
    Value left = eval(*e.kids[0]);
    for (size_t k = 0; k < e.kwnames.size(); ++k) {
      Value right = eval(*e.kids[k + 1]);
      if (!truthy(apply_op(e, e.kwnames[k], left, right))) return Value::boolean(false);
      left = std::move(right);
    }
    return Value::boolean(true);
  }
  return apply_op(e, op, eval(*e.kids[0]), eval(*e.kids[1]));
}

Value Renderer::apply_op(const Expr& e, const std::string& op, const Value& a, const Value& b) {
  if (op == "~") {
    std::string s = to_str(a) + to_str(b);
    check_string_size(s.size());
    return Value::string(std::move(s));
  }
  if (op == "in" || op == "not in") {
    bool found = false;
    if (b.kind == Value::Str) {
      if (a.kind != Value::Str) error(e.line, "'in <string>' needs a string on the left, got ", type_name(a));
      found = b.s.find(a.s) != std::string::npos;
    } else if (b.kind == Value::ListK) {
      for (const Value& x : *b.list) found = found || equal(x, a);
    } else if (b.kind == Value::DictK) {
      found = a.kind == Value::Str && b.find(a.s);
    } else {
      error(e.line, "'in' needs a string, list or dict on the right, got ", type_name(b));
    }
    return Value::boolean(found == (op == "in"));
  }
  if (op == "==" || op == "!=") return Value::boolean(equal(a, b) == (op == "=="));
  const bool num = (a.kind == Value::Int || a.kind == Value::Float || a.kind == Value::Bool) &&
                   (b.kind == Value::Int || b.kind == Value::Float || b.kind == Value::Bool);
  const bool ints = num && a.kind != Value::Float && b.kind != Value::Float;
  auto fa = [](const Value& v) {
    return v.kind == Value::Float ? v.f : v.kind == Value::Int ? double(v.i) : v.b;
  };
  auto ia = [](const Value& v) { return v.kind == Value::Int ? v.i : int64_t(v.b); };
  if (op == "<" || op == ">" || op == "<=" || op == ">=") {
    int c;
    if (num)
      c = fa(a) < fa(b) ? -1 : fa(a) > fa(b) ? 1 : 0;
    else if (a.kind == Value::Str && b.kind == Value::Str)
      c = a.s.compare(b.s) < 0 ? -1 : a.s == b.s ? 0 : 1;
    else
      error(e.line, "cannot compare ", type_name(a), " and ", type_name(b), " with ", op);
    return Value::boolean(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
  }
  if (op == "+") {
    if (a.kind == Value::Str && b.kind == Value::Str) {
      check_string_size(a.s.size() + b.s.size());
      return Value::string(a.s + b.s);
    }
    if (a.kind == Value::ListK && b.kind == Value::ListK) {
      List l = *a.list;
      l.insert(l.end(), b.list->begin(), b.list->end());
      return Value::new_list(std::move(l));
    }
  }
  if (op == "*" && a.kind == Value::Str && b.kind == Value::Int) {
    if (b.i <= 0 || a.s.empty()) return Value::string("");
    check_string_size(static_cast<size_t>(b.i > kMaxStringBytes ? b.i : (int64_t)a.s.size() * b.i));
    std::string s;
    s.reserve(a.s.size() * b.i);
    for (int64_t k = 0; k < b.i; ++k) s += a.s;
    return Value::string(std::move(s));
  }
  if (!num)
    error(
        e.line, "unsupported operand types for ", op, ": ", type_name(a), " and ", type_name(b),
        a.kind == Value::Undefined || b.kind == Value::Undefined ? " (is a variable or field missing?)" : "");
  if (op == "/") {
    if (fa(b) == 0) error(e.line, "division by zero");
    return Value::number(fa(a) / fa(b));
  }
  if (ints) {
    // Python's integers are unbounded; ours are 64-bit: a result outside them is an error, never a trap.
    const int64_t x = ia(a), y = ia(b);
    int64_t r = 0;
    if (op == "+" || op == "-" || op == "*") {
      const bool over = op == "+"   ? __builtin_add_overflow(x, y, &r)
                        : op == "-" ? __builtin_sub_overflow(x, y, &r)
                                    : __builtin_mul_overflow(x, y, &r);
      if (over) error(e.line, "integer overflow in ", x, " ", op, " ", y, " (beyond 64 bits)");
      return Value::integer(r);
    }
    if (y == 0) error(e.line, "division by zero");
    if (y == -1) {  // x // -1 = -x (overflows for the smallest integer); x % -1 = 0
      if (op == "%") return Value::integer(0);
      if (x == INT64_MIN) error(e.line, "integer overflow in ", x, " // -1 (beyond 64 bits)");
      return Value::integer(-x);
    }
    const int64_t q = x / y - ((x % y != 0 && ((x < 0) != (y < 0))) ? 1 : 0);  // floor division
    return Value::integer(op == "//" ? q : x - q * y);
  }
  const double x = fa(a), y = fa(b);
  if (op == "+") return Value::number(x + y);
  if (op == "-") return Value::number(x - y);
  if (op == "*") return Value::number(x * y);
  if (y == 0) error(e.line, "division by zero");
  if (op == "//") return Value::number(std::floor(x / y));
  return Value::number(x - std::floor(x / y) * y);
}

// A method call (`x.strip()`), namespace() / range() / raise_exception(), or an error.
Value Renderer::call(const Expr& e) {
  const Expr& callee = *e.kids[0];
  if (callee.type == Expr::Attr) {
    const Value obj = eval(*callee.kids[0]);
    return call_method(where(e), obj, callee.name, args_of(e, 1));
  }
  if (callee.type != Expr::Name) error(e.line, "unsupported call expression");
  if (const Value* v = lookup(callee.name)) {
    if (v->kind != Value::MacroK) error(e.line, "'", callee.name, "' is a ", type_name(*v), ", not callable");
    const Value m = *v;
    return call_macro(e, m, args_of(e, 1), nullptr);
  }
  return call_function(where(e), callee.name, args_of(e, 1));
}

}  // namespace

Template Template::parse(std::string_view source, std::string name) {
  Template t;
  t.name_ = std::move(name);
  t.body_ = std::make_shared<const std::vector<Node>>(parse_template(source, t.name_, t.has_generation_));
  return t;
}

RenderResult Template::render(const nlohmann::ordered_json& context) const {
  TITAN_CHECK(context.is_object(), name_, ": the render context must be a JSON object");
  RenderResult out;
  Renderer r(name_, out);
  r.push_scope();
  for (const auto& [k, v] : context.items()) r.define(k, Value::from_json(v));
  r.push_scope();  // the template's own top-level variables
  r.run(*body_);
  return out;
}

}  // namespace titan::jinja
