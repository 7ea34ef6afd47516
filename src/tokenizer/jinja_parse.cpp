// Jinja subset parser: template text -> tags (with HF's trim_blocks / lstrip_blocks whitespace
// rules) -> statement tree; expressions by recursive descent with Jinja's operator precedence.
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <set>

#include "core/error.h"
#include "tokenizer/jinja_ast.h"

namespace titan::jinja {

namespace {

struct Tok {
  enum Kind { Name, String, Int, Float, Op, End };
  Kind kind = End;
  std::string text;
};

// A piece of the template: literal text, or the inside of a {{ }} / {% %} tag.
struct Chunk {
  enum Kind { Text, Var, Block };
  Kind kind;
  std::string text;
  int line;
};

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

class Lexer {
 public:
  Lexer(const std::string& name) : name_(name) {}

  std::vector<Chunk> chunks(std::string_view src) {
    std::vector<Chunk> out;
    size_t pos = 0;
    int line = 1;
    bool strip_next = false;  // the previous tag ended with '-'
    bool trim_newline = false;
    while (pos <= src.size()) {
      size_t open = find_open(src, pos);
      std::string text(src.substr(pos, open - pos));
      if (strip_next) {
        size_t k = 0;
        while (k < text.size() && is_space(text[k])) ++k;
        text.erase(0, k);
      } else if (trim_newline && !text.empty() && (text[0] == '\n' || text.compare(0, 2, "\r\n") == 0)) {
        text.erase(0, text[0] == '\n' ? 1 : 2);
      }
      const int text_line = line;
      for (size_t k = pos; k < open && k < src.size(); ++k) line += src[k] == '\n';
      if (open == src.size()) {
        if (!text.empty()) out.push_back({Chunk::Text, std::move(text), text_line});
        break;
      }
      const char kind = src[open + 1];
      const char mod = open + 2 < src.size() ? src[open + 2] : '\0';
      if (mod == '-') {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      } else if (kind != '{' && mod != '+') {
        // lstrip_blocks: a block or comment tag preceded on its line by spaces and tabs only.
        size_t k = open;
        while (k > pos && (src[k - 1] == ' ' || src[k - 1] == '\t')) --k;
        const bool line_start = k == 0 || src[k - 1] == '\n';
        if (line_start)
          while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.pop_back();
      }
      if (!text.empty()) out.push_back({Chunk::Text, std::move(text), text_line});
      const size_t body = open + 2 + (mod == '-' || mod == '+' ? 1 : 0);
      const size_t close = find_close(src, body, kind, line);
      size_t body_end = close;
      strip_next = close > body && src[close - 1] == '-';
      if (strip_next) --body_end;
      const bool keep_newline = close > body && src[close - 1] == '+';
      if (keep_newline) --body_end;
      for (size_t k = open; k < close + 2; ++k) line += src[k] == '\n';
      if (kind != '#')
        out.push_back(
            {kind == '{' ? Chunk::Var : Chunk::Block, std::string(src.substr(body, body_end - body)), line});
      trim_newline = kind != '{' && !keep_newline;  // trim_blocks
      pos = close + 2;
    }
    return out;
  }

  // Expression tokens of a tag's inside.
  std::vector<Tok> tokens(const std::string& s, int line) const {
    std::vector<Tok> out;
    size_t i = 0;
    while (i < s.size()) {
      const char c = s[i];
      if (is_space(c)) {
        ++i;
      } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t j = i;
        while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
        out.push_back({Tok::Name, s.substr(i, j - i)});
        i = j;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t j = i;
        bool is_float = false;
        while (j < s.size() &&
               (std::isdigit(static_cast<unsigned char>(s[j])) || s[j] == '.' || s[j] == '_')) {
          if (s[j] == '.') {
            if (is_float || j + 1 >= s.size() || !std::isdigit(static_cast<unsigned char>(s[j + 1]))) break;
            is_float = true;
          }
          ++j;
        }
        // Exponent: 2.5e-7, 1e3.
        if (j < s.size() && (s[j] == 'e' || s[j] == 'E')) {
          size_t k = j + 1;
          if (k < s.size() && (s[k] == '+' || s[k] == '-')) ++k;
          if (k < s.size() && std::isdigit(static_cast<unsigned char>(s[k]))) {
            while (k < s.size() && std::isdigit(static_cast<unsigned char>(s[k]))) ++k;
            j = k;
            is_float = true;
          }
        }
        out.push_back({is_float ? Tok::Float : Tok::Int, s.substr(i, j - i)});
        i = j;
      } else if (c == '\'' || c == '"') {
        out.push_back({Tok::String, read_string(s, i, line)});
      } else {
        static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "(", ")", "[", "]", "{", "}", ".",
                                     ",",  ":",  "|",  "+",  "-",  "*",  "/", "%", "~", "<", ">", "="};
        bool found = false;
        for (const char* op : kOps) {
          const size_t n = std::char_traits<char>::length(op);
          if (s.compare(i, n, op) == 0) {
            out.push_back({Tok::Op, op});
            i += n;
            found = true;
            break;
          }
        }
        if (!found) fail(name_, ":", line, ": unexpected character '", c, "' in an expression");
      }
    }
    out.push_back({Tok::End, ""});
    return out;
  }

 private:
  static size_t find_open(std::string_view src, size_t pos) {
    for (size_t k = pos; k + 1 < src.size(); ++k)
      if (src[k] == '{' && (src[k + 1] == '{' || src[k + 1] == '%' || src[k + 1] == '#')) return k;
    return src.size();
  }
  size_t find_close(std::string_view src, size_t from, char kind, int line) const {
    const char want = kind == '{' ? '}' : kind;
    char quote = 0;
    for (size_t k = from; k + 1 < src.size(); ++k) {
      const char c = src[k];
      if (kind != '#' && quote) {
        if (c == '\\')
          ++k;
        else if (c == quote)
          quote = 0;
        continue;
      }
      if (kind != '#' && (c == '\'' || c == '"')) {
        quote = c;
        continue;
      }
      if (c == want && src[k + 1] == '}') return k;
    }
    fail(name_, ":", line, ": unclosed ", kind == '{' ? "{{" : kind == '%' ? "{%" : "{#", " tag");
  }
  std::string read_string(const std::string& s, size_t& i, int line) const {
    const char q = s[i++];
    std::string out;
    while (i < s.size() && s[i] != q) {
      char c = s[i++];
      if (c == '\\' && i < s.size()) {
        const char e = s[i++];
        switch (e) {
          case 'n':
            out += '\n';
            break;
          case 't':
            out += '\t';
            break;
          case 'r':
            out += '\r';
            break;
          case '\\':
            out += '\\';
            break;
          case '\'':
            out += '\'';
            break;
          case '"':
            out += '"';
            break;
          case '0':
            out += '\0';
            break;
          default:
            fail(name_, ":", line, ": unsupported string escape '\\", e, "'");
        }
      } else {
        out += c;
      }
    }
    if (i >= s.size()) fail(name_, ":", line, ": unterminated string literal");
    ++i;
    return out;
  }
  const std::string& name_;
};

// Bounds on what a template may ask of the parser and the renderer, whose recursion follows the tree:
// nesting of sub-expressions (parentheses, lists, unary operators) and of block tags, and nodes per tag (a
// chain of 10,000 `+` is a tree that deep). Chat templates stay far below them (Qwen3's: depth <= 6, <= 60
// nodes per tag).
constexpr int kMaxExprNesting = 100;
constexpr int kMaxNodesPerTag = 2000;
constexpr int kMaxBlockNesting = 100;

// Recursive descent over one tag's tokens, with Jinja's precedence (lowest first): conditional
// expression, or, and, not, comparisons / in / is, + -, ~, * / // %, unary -, postfix and filters.
class ExprParser {
 public:
  ExprParser(std::vector<Tok> toks, const std::string& name, int line)
      : t_(std::move(toks)), name_(name), line_(line) {}

  ExprP parse_expression() { return conditional(); }
  ExprP parse_expression_no_if() { return or_expr(); }  // a for loop's iterable: `if` filters it
  bool at_end() const { return t_[p_].kind == Tok::End; }
  bool peek_name(const char* n) const { return t_[p_].kind == Tok::Name && t_[p_].text == n; }
  bool peek_op(const char* o) const { return t_[p_].kind == Tok::Op && t_[p_].text == o; }
  std::string take_name() {
    if (t_[p_].kind != Tok::Name) error("expected a name, got '", t_[p_].text, "'");
    return t_[p_++].text;
  }
  void expect_op(const char* o) {
    if (!peek_op(o)) error("expected '", o, "', got '", t_[p_].text, "'");
    ++p_;
  }
  void expect_name(const char* n) {
    if (!peek_name(n)) error("expected '", n, "', got '", t_[p_].text, "'");
    ++p_;
  }
  void expect_end() {
    if (!at_end()) error("unexpected '", t_[p_].text, "'");
  }
  template <class... A>
  [[noreturn]] void error(A&&... a) const {
    fail(name_, ":", line_, ": ", std::forward<A>(a)...);
  }

 private:
  // One level of sub-expression nesting for the guard's lifetime.
  struct Nesting {
    explicit Nesting(ExprParser& p) : p_(p) {
      if (++p_.depth_ > kMaxExprNesting)
        p_.error("expression nested deeper than ", kMaxExprNesting, " levels");
    }
    ~Nesting() { --p_.depth_; }
    ExprParser& p_;
  };
  int depth_ = 0, nodes_ = 0;

  ExprP node(Expr::Type type) {
    if (++nodes_ > kMaxNodesPerTag)
      error("more than ", kMaxNodesPerTag, " operands and operators in one tag");
    auto e = std::make_unique<Expr>();
    e->type = type;
    e->line = line_;
    return e;
  }
  ExprP binary(std::string op, ExprP a, ExprP b) {
    auto e = node(Expr::Binary);
    e->name = std::move(op);
    e->kids.push_back(std::move(a));
    e->kids.push_back(std::move(b));
    return e;
  }
  ExprP conditional() {
    Nesting nest(*this);
    ExprP e = or_expr();
    while (peek_name("if")) {
      ++p_;
      auto c = node(Expr::Cond);
      c->kids.push_back(std::move(e));
      c->kids.push_back(or_expr());
      if (peek_name("else")) {
        ++p_;
        c->kids.push_back(conditional());
      } else {
        c->kids.push_back(nullptr);
      }
      e = std::move(c);
    }
    return e;
  }
  ExprP or_expr() {
    ExprP e = and_expr();
    while (peek_name("or")) ++p_, e = binary("or", std::move(e), and_expr());
    return e;
  }
  ExprP and_expr() {
    ExprP e = not_expr();
    while (peek_name("and")) ++p_, e = binary("and", std::move(e), not_expr());
    return e;
  }
  ExprP not_expr() {
    if (!peek_name("not")) return compare();
    Nesting nest(*this);
    ++p_;
    auto e = node(Expr::Unary);
    e->name = "not";
    e->kids.push_back(not_expr());
    return e;
  }
  // a < b < c chains like Python: (a < b) and (b < c), each operand evaluated once.
  ExprP compare() {
    ExprP first = additive();
    auto chain = node(Expr::Binary);
    chain->kids.push_back(std::move(first));
    for (;;) {
      static const char* kCmp[] = {"==", "!=", "<=", ">=", "<", ">"};
      std::string op;
      for (const char* c : kCmp)
        if (peek_op(c)) op = c;
      if (!op.empty()) {
        ++p_;
      } else if (peek_name("in")) {
        ++p_;
        op = "in";
      } else if (peek_name("not") && t_[p_ + 1].kind == Tok::Name && t_[p_ + 1].text == "in") {
        p_ += 2;
        op = "not in";
      } else {
        break;
      }
      chain->kwnames.push_back(op);
      chain->kids.push_back(additive());
    }
    if (chain->kwnames.empty()) return std::move(chain->kids[0]);
    if (chain->kwnames.size() == 1)
      return binary(chain->kwnames[0], std::move(chain->kids[0]), std::move(chain->kids[1]));
    chain->name = "chain";  // kwnames holds the operators
    return chain;
  }
  ExprP additive() {
    ExprP e = concat();
    while (peek_op("+") || peek_op("-")) {
      std::string op = t_[p_++].text;
      e = binary(op, std::move(e), concat());
    }
    return e;
  }
  ExprP concat() {
    ExprP e = multiplicative();
    while (peek_op("~")) ++p_, e = binary("~", std::move(e), multiplicative());
    return e;
  }
  ExprP multiplicative() {
    ExprP e = unary();
    while (peek_op("*") || peek_op("/") || peek_op("//") || peek_op("%") || peek_op("**")) {
      if (peek_op("**")) error("unsupported operator '**'");
      std::string op = t_[p_++].text;
      e = binary(op, std::move(e), unary());
    }
    return e;
  }
  ExprP unary() {
    if (peek_op("-") || peek_op("+")) {
      Nesting nest(*this);
      auto e = node(Expr::Unary);
      e->name = t_[p_++].text;
      e->kids.push_back(unary());
      return e;
    }
    return filtered(postfix(primary()));
  }
  // Filters (`x | f(args)`) and tests (`x is [not] t(args)`) bind tighter than binary operators.
  ExprP filtered(ExprP e) {
    for (;;) {
      if (peek_op("|")) {
        ++p_;
        auto f = node(Expr::Filter);
        f->name = take_name();
        f->kids.push_back(std::move(e));
        if (peek_op("(")) arguments(*f);
        e = postfix(std::move(f));
      } else if (peek_name("is")) {
        ++p_;
        auto t = node(Expr::Test);
        if (peek_name("not")) ++p_, t->negate = true;
        // Tests named like keywords: none, true, false.
        t->name = t_[p_].kind == Tok::Name ? t_[p_++].text : (peek_op("==") ? (++p_, "eq") : take_name());
        t->kids.push_back(std::move(e));
        if (peek_op("(")) {
          arguments(*t);
        } else if (t_[p_].kind == Tok::String || t_[p_].kind == Tok::Int || t_[p_].kind == Tok::Float) {
          t->kids.push_back(primary());  // `x is divisibleby 3` style single argument
        }
        e = std::move(t);
      } else {
        return e;
      }
    }
  }
  ExprP postfix(ExprP e) {
    for (;;) {
      if (peek_op(".")) {
        ++p_;
        auto a = node(Expr::Attr);
        a->name = t_[p_].kind == Tok::Int ? t_[p_++].text : take_name();
        a->kids.push_back(std::move(e));
        e = std::move(a);
      } else if (peek_op("[")) {
        ++p_;
        e = subscript(std::move(e));
      } else if (peek_op("(")) {
        auto c = node(Expr::Call);
        c->kids.push_back(std::move(e));
        arguments(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }
  ExprP subscript(ExprP obj) {
    ExprP parts[3];
    int colons = 0;
    for (;;) {
      if (peek_op("]")) break;
      if (peek_op(":")) {
        if (++colons > 2) error("bad slice");
        ++p_;
        continue;
      }
      parts[colons] = conditional();
    }
    expect_op("]");
    if (colons == 0) {
      if (!parts[0]) error("empty subscript");
      auto e = node(Expr::Index);
      e->kids.push_back(std::move(obj));
      e->kids.push_back(std::move(parts[0]));
      return e;
    }
    auto e = node(Expr::Slice);
    e->kids.push_back(std::move(obj));
    for (auto& part : parts) e->kids.push_back(std::move(part));
    return e;
  }
  void arguments(Expr& call) {
    expect_op("(");
    while (!peek_op(")")) {
      if (t_[p_].kind == Tok::Name && t_[p_ + 1].kind == Tok::Op && t_[p_ + 1].text == "=") {
        call.kwnames.push_back(t_[p_].text);
        p_ += 2;
      } else if (!call.kwnames.empty()) {
        error("positional argument after a keyword argument");
      }
      call.kids.push_back(conditional());
      if (!peek_op(")")) expect_op(",");
    }
    ++p_;
  }
  ExprP primary() {
    const Tok& t = t_[p_];
    auto lit = [&](Value v) {
      auto e = node(Expr::Lit);
      e->lit = std::move(v);
      ++p_;
      return e;
    };
    switch (t.kind) {
      case Tok::String: {
        std::string s = t.text;
        ++p_;
        while (t_[p_].kind == Tok::String) s += t_[p_++].text;  // adjacent literals concatenate
        auto e = node(Expr::Lit);
        e->lit = Value::string(std::move(s));
        return e;
      }
      case Tok::Int:
        return lit(Value::integer(std::strtoll(strip_underscores(t.text).c_str(), nullptr, 10)));
      case Tok::Float:
        return lit(Value::number(std::strtod(strip_underscores(t.text).c_str(), nullptr)));
      case Tok::Name: {
        if (t.text == "true" || t.text == "True") return lit(Value::boolean(true));
        if (t.text == "false" || t.text == "False") return lit(Value::boolean(false));
        if (t.text == "none" || t.text == "None") return lit(Value::none());
        auto e = node(Expr::Name);
        e->name = t.text;
        ++p_;
        return e;
      }
      case Tok::Op:
        if (t.text == "(") {
          ++p_;
          ExprP e = conditional();
          if (peek_op(",")) error("tuples are not supported");
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          ++p_;
          auto e = node(Expr::ListLit);
          while (!peek_op("]")) {
            e->kids.push_back(conditional());
            if (!peek_op("]")) expect_op(",");
          }
          ++p_;
          return e;
        }
        if (t.text == "{") {
          ++p_;
          auto e = node(Expr::DictLit);
          while (!peek_op("}")) {
            e->kids.push_back(conditional());
            expect_op(":");
            e->kids.push_back(conditional());
            if (!peek_op("}")) expect_op(",");
          }
          ++p_;
          return e;
        }
        error("unexpected '", t.text, "'");
      case Tok::End:
        error("unexpected end of expression");
    }
    error("unexpected token");
  }
  static std::string strip_underscores(std::string s) {
    s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
    return s;
  }

  std::vector<Tok> t_;
  size_t p_ = 0;
  const std::string& name_;
  int line_;
};

class Parser {
 public:
  Parser(std::vector<Chunk> chunks, const std::string& name, Lexer& lexer)
      : chunks_(std::move(chunks)), name_(name), lexer_(lexer) {}

  std::vector<Node> parse_all(bool& has_generation) {
    std::string end;
    std::vector<Node> body = parse_body({}, end);
    has_generation = has_generation_;
    return body;
  }

 private:
  // Parses nodes until a block tag whose keyword is in `stops` (returned in `stop`, with the
  // parser positioned on it) or the end of the template (stop empty).
  std::vector<Node> parse_body(const std::set<std::string>& stops, std::string& stop) {
    if (++block_depth_ > kMaxBlockNesting)
      fail(name_, ":", i_ < chunks_.size() ? chunks_[i_].line : 0, ": blocks nested deeper than ",
           kMaxBlockNesting, " levels");
    struct Leave {
      int& d;
      ~Leave() { --d; }
    } leave{block_depth_};
    std::vector<Node> out;
    while (i_ < chunks_.size()) {
      const Chunk& c = chunks_[i_];
      if (c.kind == Chunk::Text) {
        Node n;
        n.type = Node::Text;
        n.text = c.text;
        n.line = c.line;
        out.push_back(std::move(n));
        ++i_;
        continue;
      }
      ExprParser ep(lexer_.tokens(c.text, c.line), name_, c.line);
      if (c.kind == Chunk::Var) {
        Node n;
        n.type = Node::Output;
        n.line = c.line;
        n.expr = ep.parse_expression();
        ep.expect_end();
        out.push_back(std::move(n));
        ++i_;
        continue;
      }
      if (ep.at_end()) ep.error("empty {% %} tag");
      const std::string kw = ep.take_name();
      if (stops.count(kw)) {
        stop = kw;
        return out;
      }
      ++i_;
      out.push_back(statement(kw, ep, c.line));
    }
    if (!stops.empty()) fail(name_, ": missing {% ", *stops.rbegin(), " %} at the end of the template");
    stop.clear();
    return out;
  }

  Node statement(const std::string& kw, ExprParser& ep, int line) {
    Node n;
    n.line = line;
    std::string stop;
    if (kw == "if") {
      n.type = Node::If;
      ExprP cond = ep.parse_expression();
      ep.expect_end();
      for (;;) {
        std::vector<Node> body = parse_body({"elif", "else", "endif"}, stop);
        n.branches.emplace_back(std::move(cond), std::move(body));
        ExprParser next(lexer_.tokens(chunks_[i_].text, chunks_[i_].line), name_, chunks_[i_].line);
        next.take_name();
        ++i_;
        if (stop == "endif") break;
        if (stop == "else") {
          next.expect_end();
          n.branches.emplace_back(nullptr, parse_body({"endif"}, stop));
          ++i_;
          break;
        }
        cond = next.parse_expression();
        next.expect_end();
      }
    } else if (kw == "for") {
      n.type = Node::For;
      n.vars.push_back(ep.take_name());
      while (ep.peek_op(",")) ep.expect_op(","), n.vars.push_back(ep.take_name());
      ep.expect_name("in");
      n.expr = ep.parse_expression_no_if();
      if (ep.peek_name("if")) {
        ep.take_name();
        n.filter = ep.parse_expression();
      }
      if (ep.peek_name("recursive")) ep.error("unsupported: recursive for loops");
      ep.expect_end();
      n.body = parse_body({"else", "endfor"}, stop);
      ++i_;
      if (stop == "else") {
        n.else_body = parse_body({"endfor"}, stop);
        ++i_;
      }
    } else if (kw == "set") {
      n.type = Node::Set;
      n.target = ep.take_name();
      if (ep.peek_op(".")) {
        ep.expect_op(".");
        n.attr = ep.take_name();
      }
      if (ep.peek_op(",")) ep.error("unsupported: set with several targets");
      if (ep.at_end()) {  // {% set x %}...{% endset %}: the rendered body
        n.body = parse_body({"endset"}, stop);
        ++i_;
        return n;
      }
      ep.expect_op("=");
      n.expr = ep.parse_expression();
      ep.expect_end();
    } else if (kw == "macro") {
      n.type = Node::Macro;
      n.target = ep.take_name();
      parameters(ep, n);
      ep.expect_end();
      n.body = parse_body({"endmacro"}, stop);
      ++i_;
    } else if (kw == "call") {
      n.type = Node::CallBlock;
      if (ep.peek_op("(")) parameters(ep, n);
      n.expr = ep.parse_expression();
      if (n.expr->type != Expr::Call) ep.error("{% call %} needs a macro call, e.g. {% call m(x) %}");
      ep.expect_end();
      n.body = parse_body({"endcall"}, stop);
      ++i_;
    } else if (kw == "generation") {
      n.type = Node::Generation;
      ep.expect_end();
      has_generation_ = true;
      n.body = parse_body({"endgeneration"}, stop);
      ++i_;
    } else if (kw == "break" || kw == "continue") {
      n.type = kw == "break" ? Node::Break : Node::Continue;
      ep.expect_end();
    } else {
      ep.error("unsupported statement '", kw, "'");
    }
    return n;
  }

  // `(a, b=default, ...)` of a macro or a call block: names into n.vars, defaults into n.defaults.
  void parameters(ExprParser& ep, Node& n) {
    ep.expect_op("(");
    while (!ep.peek_op(")")) {
      n.vars.push_back(ep.take_name());
      if (ep.peek_op("=")) {
        ep.expect_op("=");
        n.defaults.push_back(ep.parse_expression());
      } else {
        if (!n.defaults.empty() && n.defaults.back())
          ep.error("parameter '", n.vars.back(), "' without a default follows one with a default");
        n.defaults.push_back(nullptr);
      }
      if (!ep.peek_op(")")) ep.expect_op(",");
    }
    ep.expect_op(")");
  }

  std::vector<Chunk> chunks_;
  size_t i_ = 0;
  const std::string& name_;
  Lexer& lexer_;
  bool has_generation_ = false;
  int block_depth_ = 0;
};

}  // namespace

std::vector<Node> parse_template(std::string_view source, const std::string& name, bool& has_generation) {
  Lexer lexer(name);
  Parser parser(lexer.chunks(source), name, lexer);
  return parser.parse_all(has_generation);
}

}  // namespace titan::jinja
