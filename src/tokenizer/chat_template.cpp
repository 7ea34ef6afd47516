#include "tokenizer/chat_template.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "core/error.h"
#include "io/json_file.h"
#include "tokenizer/jinja.h"
#include "tokenizer/tokenizer.h"

namespace titan {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

struct ChatTemplate::Impl {
  jinja::Template tmpl;
  std::string name;
  ojson special_tokens;
  bool chatml = false;  // the template writes <|im_start|> turns
};

namespace {

constexpr const char* kTurnStart = "<|im_start|>assistant\n";
constexpr const char* kTurnEnd = "<|im_end|>";

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TITAN_CHECK(in.good(), path, ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// HF's special_tokens_map entries (a token is a string or an AddedToken object with `content`).
ojson special_tokens_of(const ojson& config) {
  ojson out = ojson::object();
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
    if (!config.contains(key)) continue;
    const ojson& v = config[key];
    if (v.is_string()) out[key] = v;
    if (v.is_object() && v.contains("content") && v["content"].is_string()) out[key] = v["content"];
  }
  return out;
}

// Assistant turns of ChatML text: after each "<|im_start|>assistant\n" through its "<|im_end|>".
std::vector<std::pair<size_t, size_t>> chatml_spans(const std::string& text) {
  std::vector<std::pair<size_t, size_t>> spans;
  const std::string start = kTurnStart, end = kTurnEnd;
  for (size_t pos = text.find(start); pos != std::string::npos; pos = text.find(start, pos)) {
    const size_t begin = pos + start.size();
    const size_t close = text.find(end, begin);
    if (close == std::string::npos) break;  // an open generation prompt
    spans.emplace_back(begin, close + end.size());
    pos = close + end.size();
  }
  return spans;
}

std::string nfc(std::string_view s) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                          static_cast<utf8proc_ssize_t>(s.size()), &out,
                                          static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  std::string r = n >= 0 ? std::string(reinterpret_cast<char*>(out), static_cast<size_t>(n)) : std::string(s);
  std::free(out);
  return r;
}

std::string field_type(const ojson& v) {
  return v.type_name();
}

}  // namespace

int64_t EncodedChat::num_assistant_tokens() const {
  int64_t n = 0;
  for (int32_t l : labels) n += l != -100;
  return n;
}

ChatTemplate::ChatTemplate(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;
ChatTemplate::~ChatTemplate() = default;

ChatTemplate ChatTemplate::from_string(const std::string& source, const std::string& name,
                                       ojson special_tokens) {
  auto impl = std::make_unique<Impl>();
  impl->tmpl = jinja::Template::parse(source, "chat template " + name);
  impl->name = name;
  impl->special_tokens = std::move(special_tokens);
  impl->chatml = source.find("<|im_start|>") != std::string::npos;
  return ChatTemplate(std::move(impl));
}

ChatTemplate ChatTemplate::from_tokenizer_config(const std::string& path) {
  const fs::path file = fs::is_directory(path) ? fs::path(path) / "tokenizer_config.json" : fs::path(path);
  const std::string f = file.string();
  TITAN_CHECK(fs::exists(file), f,
              ": no such file (chat data needs the model's tokenizer_config.json with a "
              "chat_template)");
  const ojson config = parse_ordered_json(read_text(f), f);
  TITAN_CHECK(config.is_object(), f, ": expected a JSON object");
  std::string source;
  std::string name = f;
  if (config.contains("chat_template") && config["chat_template"].is_string()) {
    source = config["chat_template"].get<std::string>();
  } else if (config.contains("chat_template") && config["chat_template"].is_array()) {
    // Named templates: use "default", as HF does without a template name.
    for (const auto& t : config["chat_template"])
      if (t.is_object() && t.value("name", "") == "default" && t.contains("template") &&
          t["template"].is_string())
        source = t["template"].get<std::string>();
    TITAN_CHECK(!source.empty(), f, ": field 'chat_template': no template named \"default\"");
  } else {
    // Newer HF saves the template beside the config.
    const fs::path jinja_file = file.parent_path() / "chat_template.jinja";
    TITAN_CHECK(fs::exists(jinja_file), f, ": field 'chat_template' is missing (and there is no ",
                jinja_file.string(), ")");
    source = read_text(jinja_file.string());
    name = jinja_file.string();
  }
  return from_string(source, name, special_tokens_of(config));
}

const std::string& ChatTemplate::name() const {
  return impl_->name;
}
bool ChatTemplate::has_generation_blocks() const {
  return impl_->tmpl.has_generation_blocks();
}
std::string ChatTemplate::special_token(const std::string& key) const {
  const auto it = impl_->special_tokens.find(key);
  return it != impl_->special_tokens.end() && it->is_string() ? it->get<std::string>() : std::string();
}

ChatRendering ChatTemplate::render(const ojson& messages, const ChatOptions& options) const {
  check_messages(messages, impl_->name + ": messages");
  ojson ctx = impl_->special_tokens;
  ctx["messages"] = messages;
  ctx["tools"] = nullptr;
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = options.add_generation_prompt;
  if (options.enable_thinking) ctx["enable_thinking"] = *options.enable_thinking;
  for (const auto& [k, v] : options.extra.items()) ctx[k] = v;
  jinja::RenderResult r = impl_->tmpl.render(ctx);
  ChatRendering out;
  out.text = std::move(r.text);
  if (impl_->tmpl.has_generation_blocks())
    out.assistant_spans = std::move(r.generation_spans);
  else if (impl_->chatml)
    out.assistant_spans = chatml_spans(out.text);
  return out;
}

EncodedChat ChatTemplate::encode(const Tokenizer& tokenizer, const ojson& messages,
                                 const ChatOptions& options) const {
  TITAN_CHECK(impl_->tmpl.has_generation_blocks() || impl_->chatml, "chat template ", impl_->name,
              " has no {% generation %} blocks and does not write ChatML turns (<|im_start|>role ... "
              "<|im_end|>): cannot tell which tokens are the assistant's");
  ChatRendering r = render(messages, options);
  EncodedChat out;
  out.ids = tokenizer.encode(r.text, /*add_special_tokens=*/false);
  out.labels.assign(out.ids.size(), -100);
  // Byte offset of every token in the text the tokenizer saw (its normalizer's output).
  std::vector<size_t> offset(out.ids.size() + 1, 0);
  std::string seen;
  for (size_t t = 0; t < out.ids.size(); ++t) {
    seen += tokenizer.token_bytes(out.ids[t]);
    offset[t + 1] = seen.size();
  }
  // Span boundaries in that text: the same, unless normalization (NFC) changed the text.
  std::function<size_t(size_t)> map = [](size_t b) { return b; };
  if (seen != r.text) {
    TITAN_CHECK(
        seen == nfc(r.text), "chat template ", impl_->name,
        ": the tokens do not spell the rendered text (a tokenizer normalizer other than NFC?); cannot "
        "place the assistant tokens");
    map = [&r](size_t b) { return nfc(std::string_view(r.text).substr(0, b)).size(); };
  }
  // A token is the assistant's when its bytes overlap a span.
  for (size_t k = options.skip_assistant_turns; k < r.assistant_spans.size(); ++k) {
    const size_t begin = map(r.assistant_spans[k].first), end = map(r.assistant_spans[k].second);
    size_t t =
        static_cast<size_t>(std::upper_bound(offset.begin() + 1, offset.end(), begin) - offset.begin() - 1);
    for (; begin < end && t < out.ids.size() && offset[t] < end; ++t) out.labels[t] = out.ids[t];
  }
  return out;
}

void check_messages(const ojson& messages, const std::string& where) {
  TITAN_CHECK(messages.is_array(), where, ": expected a list of messages, got ", field_type(messages));
  TITAN_CHECK(!messages.empty(), where, ": the list of messages is empty");
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    const std::string field = str_cat("messages[", i, "]");
    TITAN_CHECK(m.is_object(), where, ": field '", field, "': expected an object {role, content}, got ",
                field_type(m));
    TITAN_CHECK(m.contains("role"), where, ": field '", field, ".role' is missing");
    TITAN_CHECK(m["role"].is_string(), where, ": field '", field, ".role': expected a string, got ",
                field_type(m["role"]));
    const bool tool_calls = m.contains("tool_calls") && !m["tool_calls"].is_null();
    if (!m.contains("content") || m["content"].is_null()) {
      TITAN_CHECK(tool_calls && m["role"] == "assistant", where, ": field '", field, ".content' is missing");
    } else {
      TITAN_CHECK(m["content"].is_string(), where, ": field '", field, ".content': expected a string, got ",
                  field_type(m["content"]),
                  m["content"].is_array() ? " (content parts are not supported)" : "");
    }
    if (m.contains("reasoning_content"))
      TITAN_CHECK(m["reasoning_content"].is_string() || m["reasoning_content"].is_null(), where, ": field '",
                  field, ".reasoning_content': expected a string, got ", field_type(m["reasoning_content"]));
    if (tool_calls)
      TITAN_CHECK(m["tool_calls"].is_array(), where, ": field '", field,
                  ".tool_calls': expected a list, got ", field_type(m["tool_calls"]));
  }
}

Conversation conversation_from_record(const ojson& record, const std::string& where) {
  TITAN_CHECK(record.is_object(), where, ": expected a JSON object, got ", field_type(record));
  Conversation c;
  if (record.contains("tools") && !record["tools"].is_null()) {
    TITAN_CHECK(record["tools"].is_array(), where,
                ": field 'tools': expected a list of function schemas, got ", field_type(record["tools"]));
    c.tools = record["tools"];
  }
  if (record.contains("messages")) {
    c.messages = record["messages"];
    check_messages(c.messages, where);
    return c;
  }
  const bool p = record.contains("prompt"), q = record.contains("completion");
  TITAN_CHECK(p || q, where,
              ": field 'messages' is missing (a chat record needs 'messages', or 'prompt' and "
              "'completion')");
  TITAN_CHECK(p && q, where, ": field '", p ? "completion" : "prompt", "' is missing");
  auto turns = [&](const char* key, const char* role) {
    const ojson& v = record[key];
    if (v.is_string()) return ojson::array({{{"role", role}, {"content", v}}});
    TITAN_CHECK(v.is_array(), where, ": field '", key, "': expected a string or a list of messages, got ",
                field_type(v));
    check_messages(v, str_cat(where, ": field '", key, "'"));
    return v;
  };
  const ojson prompt = turns("prompt", "user"), completion = turns("completion", "assistant");
  c.messages = prompt;
  for (const auto& m : prompt) c.prompt_assistant_turns += m["role"] == "assistant";
  for (const auto& m : completion) c.messages.push_back(m);
  return c;
}

}  // namespace titan
