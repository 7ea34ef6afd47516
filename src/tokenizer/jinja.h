// A small Jinja2 subset: what HF chat templates (Qwen2/Qwen3 and similar ChatML templates) use.
//
// Supported: text, {{ expr }}, {# comments #}, whitespace control ({%- -%}, {{- -}}) with the
// trim_blocks and lstrip_blocks behaviour HF enables for chat templates; statements if / elif /
// else, for (with tuple unpacking, an `if` filter, `else`, loop.index / index0 / revindex /
// revindex0 / first / last / length / previtem / nextitem, break / continue), set (name,
// namespace attribute), generation / endgeneration (HF's assistant-span marker); expressions with
// Python semantics for literals, lists, dicts, attribute / item access, slicing, calls of
// namespace() / range() / raise_exception(), string and dict methods, filters, tests, `in`,
// `~`, arithmetic, comparisons, `and` / `or` / `not` and `a if c else b`.
//
// Anything else fails at parse or render time with a titan::Error that names the template, the
// line and the construct ("chat template foo.json:12: unsupported filter 'wordwrap'").
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace titan::jinja {

struct Node;

struct RenderResult {
  std::string text;
  // [begin, end) byte ranges of text written inside {% generation %} blocks, in order.
  std::vector<std::pair<size_t, size_t>> generation_spans;
};

class Template {
 public:
  // Parses `source`; `name` prefixes every error message (e.g. the file it came from).
  static Template parse(std::string_view source, std::string name);

  // Renders with the variables of `context` (a JSON object; key order of objects is kept, which
  // matters for tojson). Variables not in the context are undefined.
  RenderResult render(const nlohmann::ordered_json& context) const;

  bool has_generation_blocks() const { return has_generation_; }
  const std::string& name() const { return name_; }

 private:
  std::shared_ptr<const std::vector<Node>> body_;
  std::string name_;
  bool has_generation_ = false;
};

}  // namespace titan::jinja
