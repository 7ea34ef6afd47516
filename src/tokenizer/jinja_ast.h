// Internals of the Jinja subset (jinja.h): values, the expression and statement trees.
#pragma once
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

// A Jinja value with Python semantics. Lists and dicts are shared (namespace attributes are set
// through any copy, as in Jinja).
struct Value {
  enum Kind { Undefined, None, Bool, Int, Float, Str, ListK, DictK };
  Kind kind = Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;
  bool is_namespace = false;

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
    Value x = make(Str);
    x.s = std::move(v);
    return x;
  }
  static Value new_list(List v = {}) {
    Value x = make(ListK);
    x.list = std::make_shared<List>(std::move(v));
    return x;
  }
  static Value new_dict(Dict v = {}) {
    Value x = make(DictK);
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
  enum Type { Text, Output, If, For, Set, Generation, Break, Continue };
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
  std::string target, attr;  // Set: `set target = ...` or `set target.attr = ...`
};

// Parser entry point (jinja_parse.cpp).
std::vector<Node> parse_template(std::string_view source, const std::string& name, bool& has_generation);

}  // namespace titan::jinja
