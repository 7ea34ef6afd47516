// Internals of the Jinja subset (jinja.h): values, the expression and statement trees.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/jinja.h"

namespace titan::jinja {

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // insertion ordered, like a Python dict

// What one render may make titan do, whatever the template says (a template is untrusted input):
// every string it builds stays under kMaxStringBytes (the output too), values nest at most
// kMaxValueDepth lists and dicts deep (walks of a value recurse), and the render's work -- the bytes
// of values made or copied (their strings included), loop iterations -- stays under
// kRenderWorkBudget, which so bounds its memory too. Far above any conversation (128k tokens are ~0.5 MiB of
// text), far below what would exhaust memory or the stack, or take minutes. Past a limit: a titan::Error
// naming the template and line (jinja_eval.cpp).
constexpr int64_t kMaxStringBytes = int64_t(16) << 20;
constexpr int32_t kMaxValueDepth = 1000;
constexpr int64_t kRenderWorkBudget = int64_t(1) << 30;

// The work left to the render running on this thread (a huge value outside renders).
extern thread_local int64_t render_work_left;
void render_work_exhausted();  // throws inside a render; outside one, refills
inline void charge_work(int64_t units) {
  if ((render_work_left -= units) < 0) render_work_exhausted();
}
// Throws "<template>:<line>: <what>" when a render is running on this thread, else "<what>".
[[noreturn]] void render_error(const std::string& what);
inline void check_string_size(size_t bytes) {
  if (static_cast<int64_t>(bytes) > kMaxStringBytes) [[unlikely]]
    render_error("the template's output would pass " + std::to_string(kMaxStringBytes >> 20) +
                 " MiB (a string of " + std::to_string(bytes) + " bytes)");
}
// A namespace lives until the end of the render that made it, which then empties it: values that
// hold one another through namespaces (a cycle, or a chain as long as the render's loops) are freed
// without recursion.
void render_keep_namespace(const std::shared_ptr<Dict>& ns);

// A Jinja value with Python semantics. Lists and dicts are shared (namespace attributes are set
// through any copy, as in Jinja).
struct Value {
  enum Kind { Undefined, None, Bool, Int, Float, Str, ListK, DictK, MacroK };
  Kind kind = Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;
  bool is_namespace = false;
  // MacroK: a {% macro %} (or the `caller` of a {% call %} block: then the serial of that block's
  // activation, which must still be running when caller() is called).
  const Node* macro = nullptr;
  int64_t caller_of = -1;
  // Lists and dicts: 1 + the deepest item's depth; a namespace item counts 1, since the walks of a
  // value (str, repr, tojson, ==) stop at a namespace.
  int32_t depth = 0;

  Value() = default;
  Value(const Value& o)
      : kind(o.kind),
        b(o.b),
        i(o.i),
        f(o.f),
        s(o.s),
        list(o.list),
        dict(o.dict),
        is_namespace(o.is_namespace),
        macro(o.macro),
        caller_of(o.caller_of),
        depth(o.depth) {
    charge_work(static_cast<int64_t>(sizeof(Value) + s.size()));
  }
  Value& operator=(const Value& o) {
    if (this != &o) {
      Value copy(o);
      *this = std::move(copy);
    }
    return *this;
  }
  Value(Value&&) noexcept = default;
  Value& operator=(Value&&) noexcept = default;
  int32_t nested_depth() const { return kind == DictK && is_namespace ? 1 : depth; }

  static Value none() { return make(None); }
  static Value boolean(bool v) {
    Value x = make(Bool);
    x.b = v;
    return x;
  }
  static Value integer(int64_t v) {
    Value x = make(Int);
    x.i = v;
    return x;
  }
  static Value number(double v) {
    Value x = make(Float);
    x.f = v;
    return x;
  }
  static Value string(std::string v) {
    check_string_size(v.size());
    charge_work(static_cast<int64_t>(sizeof(Value) + v.size()));
    Value x = make(Str);
    x.s = std::move(v);
    return x;
  }
  static Value new_list(List v = {}) {
    Value x = make(ListK);
    x.depth = 1;
    for (const Value& item : v) x.depth = std::max(x.depth, 1 + item.nested_depth());
    charge_work(static_cast<int64_t>(sizeof(Value) * (1 + v.size())));
    x.list = std::make_shared<List>(std::move(v));
    return x;
  }
  static Value new_dict(Dict v = {}) {
    Value x = make(DictK);
    x.depth = 1;
    for (const auto& kv : v) x.depth = std::max(x.depth, 1 + kv.second.nested_depth());
    charge_work(static_cast<int64_t>(sizeof(Value) * (1 + v.size())));
    x.dict = std::make_shared<Dict>(std::move(v));
    return x;
  }
  static Value from_json(const nlohmann::ordered_json& j);

  // Dict lookup: nullptr when absent (or not a dict).
  const Value* find(const std::string& key) const;
  void set(const std::string& key, Value v);  // dicts only

 private:
  static Value make(Kind k) {
    Value x;
    x.kind = k;
    return x;
  }
};

struct Expr;
using ExprP = std::unique_ptr<Expr>;

struct Expr {
  enum Type { Lit, Name, Attr, Index, Slice, Call, Filter, Test, Unary, Binary, Cond, ListLit, DictLit };
  Type type = Lit;
  int line = 0;
  Value lit;         // Lit
  std::string name;  // Name; Attr: attribute; Filter/Test: its name; Unary/Binary: the operator
  // Attr/Index/Filter/Test/Unary: kids[0] is the operand. Index: kids[1] the key. Slice: kids[1..3]
  // start/stop/step, null when omitted. Call: kids[0] the callee, then the arguments.
  // Filter/Test: then the arguments. Binary: the two operands. Cond: then, condition, else (null
  // when omitted). ListLit: the items. DictLit: key, value, key, value...
  std::vector<ExprP> kids;
  std::vector<std::string> kwnames;  // Call/Filter/Test: names of the last kwnames.size() arguments
  bool negate = false;               // Test: `is not`
};

struct Node {
  enum Type { Text, Output, If, For, Set, Generation, Break, Continue, Macro, CallBlock };
  Type type = Text;
  int line = 0;
  std::string text;  // Text
  ExprP expr;        // Output; For: the iterable; Set: the value
  // If: one branch per if / elif / else (cond null for else).
  std::vector<std::pair<ExprP, std::vector<Node>>> branches;
  // For: loop variables, optional filter (`for x in xs if cond`), body, else body.
  std::vector<std::string> vars;
  ExprP filter;
  std::vector<Node> body, else_body;
  std::string target, attr;  // Set: `set target = ...` or `set target.attr = ...`; Macro: its name
  // Set without expr: a block set, the rendered body is the value.
  // Macro: vars are the parameters, defaults their default values (null: none), body the macro.
  // CallBlock: expr the macro call, vars/defaults the parameters of `caller`, body caller's body.
  std::vector<ExprP> defaults;
};

// Parser entry point (jinja_parse.cpp).
std::vector<Node> parse_template(std::string_view source, const std::string& name, bool& has_generation);

}  // namespace titan::jinja
