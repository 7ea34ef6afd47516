// Chat templates and SFT data: the Jinja subset against jinja2 as HF configures it, the Qwen3
// template against tokenizer.apply_chat_template (text, ids, assistant mask), HF's
// return_assistant_tokens_mask for {% generation %} templates, chat data rows, resumable loader
// state, bad input, and a tiny `titan train` with training.dataset_format = "chat".
// Fixtures: tests/golden/chat (tools/golden/make_chat_golden.py).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/loader.h"
#include "models/qwen3/model.h"
#include "support/testing.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/jinja.h"
#include "tokenizer/tokenizer.h"
#include "train/config.h"
#include "train/trainer.h"

namespace titan {
namespace {

using ojson = nlohmann::ordered_json;
using testing::error_of;
using testing::TempDir;
namespace fs = std::filesystem;

const std::string kGolden = TITAN_SOURCE_DIR "/tests/golden/chat";
const std::string kQwen = TITAN_SOURCE_DIR "/../shared/assets/qwen3-tokenizer";
// The Qwen3 tokenizer and chat template are read from ../shared beside the repository (not copied in).
#define SKIP_WITHOUT_QWEN3_TOKENIZER()               \
  if (!fs::exists(kQwen + "/tokenizer_config.json")) \
  GTEST_SKIP() << "the Qwen3 tokenizer is not at " << kQwen << " (../shared beside the repo is absent)"

std::vector<ojson> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "missing fixture " << path;
  std::vector<ojson> out;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(ojson::parse(line));
  return out;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const Tokenizer& qwen_tokenizer() {
  static Tokenizer t = Tokenizer::load(kQwen);
  return t;
}

ChatOptions options_of(const ojson& c) {
  ChatOptions o;
  o.add_generation_prompt = c.at("add_generation_prompt").get<bool>();
  if (c.contains("enable_thinking")) o.enable_thinking = c["enable_thinking"].get<bool>();
  if (c.contains("tools")) o.extra["tools"] = c["tools"];
  return o;
}

// Every fixture case: rendered text, ids and assistant mask equal HF's.
void check_cases(const ChatTemplate& tmpl, const std::vector<ojson>& cases, const std::string& what) {
  ASSERT_GE(cases.size(), 40u) << what;
  int reported = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const ojson& c = cases[i];
    const ChatOptions o = options_of(c);
    const std::string text = tmpl.render(c["messages"], o).text;
    const EncodedChat enc = tmpl.encode(qwen_tokenizer(), c["messages"], o);
    std::string mask;
    for (size_t t = 0; t < enc.ids.size(); ++t) mask += enc.labels[t] == -100 ? '0' : '1';
    const bool ok = text == c["text"] && enc.ids == c["ids"].get<std::vector<int32_t>>() && mask == c["mask"];
    if (!ok && reported++ < 5)
      ADD_FAILURE() << what << " case " << i << ": text ok " << (text == c["text"]) << ", ids ok "
                    << (enc.ids == c["ids"].get<std::vector<int32_t>>()) << ", mask ok "
                    << (mask == c["mask"]) << "\n got:  " << ojson(text).dump()
                    << "\n want: " << c["text"].dump() << "\n mask: " << mask
                    << "\n want: " << c["mask"].get<std::string>();
    for (size_t t = 0; t < enc.ids.size(); ++t)
      ASSERT_TRUE(enc.labels[t] == -100 || enc.labels[t] == enc.ids[t]) << what << " case " << i;
  }
}

// ---- the Jinja subset ----

// The error of parsing and rendering `src` (named t.jinja) with `ctx` ("" when there is none).
std::string render_error_of(const std::string& src, const ojson& ctx = ojson::object()) {
  return error_of([&] { jinja::Template::parse(src, "t.jinja").render(ctx); });
}

TEST(Jinja, RendersLikeJinja2WithHfSettings) {
  const auto cases = read_jsonl(kGolden + "/jinja.jsonl");
  ASSERT_GE(cases.size(), 25u);
  for (const ojson& c : cases) {
    std::string got;
    const std::string e = error_of([&] {
      got = jinja::Template::parse(c["template"].get<std::string>(), "case").render(c["context"]).text;
    });
    EXPECT_EQ(e, "") << c["template"];
    EXPECT_EQ(got, c["text"].get<std::string>()) << c["template"];
  }
}

TEST(Jinja, UnsupportedConstructsNameTheTemplateLineAndConstruct) {
  auto parse_error = [](const std::string& src) {
    return error_of([&] { jinja::Template::parse(src, "t.jinja"); });
  };
  EXPECT_NE(parse_error("a\n{% include 'x.jinja' %}").find("t.jinja:2: unsupported statement 'include'"),
            std::string::npos);
  EXPECT_NE(parse_error("{% if x %}").find("missing {% endif %}"), std::string::npos);
  EXPECT_NE(parse_error("{{ x ** 2 }}").find("unsupported operator '**'"), std::string::npos);
  EXPECT_NE(parse_error("{{ 'abc }}").find("t.jinja:1: unclosed {{ tag"), std::string::npos);
  const auto render_error = [](const std::string& src, const ojson& ctx = ojson::object()) {
    return render_error_of(src, ctx);
  };
  EXPECT_NE(render_error("\n\n{{ x | wordwrap }}").find("t.jinja:3: unsupported filter 'wordwrap'"),
            std::string::npos);
  EXPECT_NE(render_error("{{ 'a'.zfill(3) }}").find("unsupported string method 'zfill'"), std::string::npos);
  EXPECT_NE(render_error("{{ cycler() }}").find("unsupported function 'cycler'"), std::string::npos);
  EXPECT_NE(render_error("{{ raise_exception('no tools') }}").find("the template raised an error: no tools"),
            std::string::npos);
  EXPECT_NE(render_error("{{ m.content + 'x' }}", {{"m", {{"content", nullptr}}}})
                .find("unsupported operand types for +: none and string"),
            std::string::npos);
  EXPECT_NE(render_error("{{ a.b.c }}", {{"a", ojson::object()}}).find("attribute 'c' of an undefined value"),
            std::string::npos);
}

TEST(Jinja, MacroMistakesNameTheLine) {
  const auto error = [](const std::string& src) { return render_error_of(src); };
  EXPECT_NE(error("{% macro m(a) %}{% endmacro %}\n{{ m(1, 2) }}")
                .find("t.jinja:2: macro 'm' takes 1 arguments, got 2"),
            std::string::npos);
  EXPECT_NE(error("{% macro m(a) %}{% endmacro %}{{ m(b=1) }}").find("macro 'm' has no parameter 'b'"),
            std::string::npos);
  EXPECT_NE(
      error("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}").find("macro calls nested deeper than 100"),
      std::string::npos);
  EXPECT_NE(error("{% set ns = namespace(c=none) %}{% macro m() %}{% set ns.c = caller %}{% endmacro %}"
                  "{% call m() %}x{% endcall %}{% set f = ns.c %}{{ f() }}")
                .find("caller() called after its {% call %} block ended"),
            std::string::npos);
  EXPECT_NE(error("{% set x = 1 %}{{ x() }}").find("'x' is a int, not callable"), std::string::npos);
  EXPECT_NE(error("{% call nothing() %}{% endcall %}").find("'nothing' is not a macro"), std::string::npos);
  EXPECT_NE(error_of([] {
              jinja::Template::parse("{% macro m(a=1, b) %}{% endmacro %}", "t.jinja");
            }).find("parameter 'b' without a default follows one with a default"),
            std::string::npos);
  EXPECT_NE(
      error_of([] { jinja::Template::parse("{% macro m() %}", "t.jinja"); }).find("missing {% endmacro %}"),
      std::string::npos);
}

// What a template may ask for is bounded: integer arithmetic past 64 bits, nesting, output size, range
// length and tojson's indent are errors naming the template line, never a trap, a stack overflow or an
// allocation failure. Python's results stand where 64 bits hold them.
TEST(Jinja, UntrustedTemplatesAreBounded) {
  auto render = [](const std::string& src) {
    return jinja::Template::parse(src, "t.jinja").render(ojson::object()).text;
  };
  const auto error = [](const std::string& src) { return render_error_of(src); };
  // Python semantics where they are defined in 64 bits.
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) % -1 }}"), "0");
  EXPECT_EQ(render("{{ -7 // 2 }} {{ -7 % 2 }} {{ 7 // -2 }} {{ 7 % -2 }} {{ 5 // -1 }}"), "-4 1 -4 -1 -5");
  EXPECT_EQ(render("{{ 9223372036854775806 + 1 }}"), "9223372036854775807");
  // Beyond them: one error naming the line.
  for (const char* src : {"\n{{ (-9223372036854775807 - 1) // -1 }}", "\n{{ 9223372036854775807 + 1 }}",
                          "\n{{ -9223372036854775807 - 2 }}", "\n{{ 4611686018427387904 * 2 }}",
                          "\n{{ -(-9223372036854775807 - 1) }}"}) {
    const std::string e = error(src);
    EXPECT_NE(e.find("t.jinja:2: integer overflow"), std::string::npos) << src << ": " << e;
  }
  EXPECT_NE(error("{{ 1 // 0 }}").find("division by zero"), std::string::npos);
  // Nesting: parentheses, unary operators, lists, blocks, long operator chains.
  const int deep = 100000;
  EXPECT_NE(
      error("{{ " + std::string(deep, '(') + "1" + std::string(deep, ')') + " }}").find("nested deeper than"),
      std::string::npos);
  EXPECT_NE(error("{{ " + std::string(deep, '-') + "1 }}").find("nested deeper than"), std::string::npos);
  std::string lists = "{{ ";
  for (int i = 0; i < 10000; ++i) lists += "[";
  for (int i = 0; i < 10000; ++i) lists += "]";
  EXPECT_NE(error(lists + " }}").find("nested deeper than"), std::string::npos);
  std::string chain = "{{ 1";
  for (int i = 0; i < deep; ++i) chain += " + 1";
  EXPECT_NE(error(chain + " }}").find("operands and operators in one tag"), std::string::npos);
  std::string blocks;
  for (int i = 0; i < 10000; ++i) blocks += "{% if true %}";
  EXPECT_NE(error(blocks).find("blocks nested deeper than"), std::string::npos);
  EXPECT_EQ(render("{{ ((((1 + 2)))) * -(-3) }}"), "9");
  // Output size, range length, tojson's indent.
  EXPECT_NE(error("\n{{ 'x' * 100000000 }}").find("t.jinja:2: the template's output would pass 16 MiB"),
            std::string::npos);
  EXPECT_NE(
      error("{% set ns = namespace(s='x' * 1000000) %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}"
            "{% endfor %}")
          .find("would pass 16 MiB"),
      std::string::npos);
  EXPECT_NE(error("{% for i in range(9223372036854775807) %}{% endfor %}").find("range() of"),
            std::string::npos);
  EXPECT_NE(
      error("{{ [1] | tojson(indent=1000000000) }}").find("tojson's indent 1000000000 is larger than 1024"),
      std::string::npos);
  EXPECT_EQ(render("{{ 'ab' * 3 }}{{ 'ab' * -1 }}{{ range(3, 10, 3) | list }}"), "ababab[3, 6, 9]");
  // Values nested at run time, values holding one another through namespaces, the render's work.
  EXPECT_NE(
      error("{% set ns = namespace(x=[]) %}{% for i in range(5000) %}{% set ns.x = [ns.x] %}{% endfor %}")
          .find("t.jinja:1: a value nested deeper than 1000 lists and dicts"),
      std::string::npos);
  EXPECT_EQ(render("{% set ns = namespace(c=[]) %}{% for i in range(200000) %}{% set t = namespace(x=0) %}"
                   "{% set t.x = ns.c %}{% set ns.c = [t] %}{% endfor %}{% set ns.c = ns %}ok"),
            "ok");  // a chain 400,000 values long and a cycle: freed without recursion
  EXPECT_NE(error("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
                .find("passes its work bound"),
            std::string::npos);
  EXPECT_NE(error("{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}"
                  "{% endfor %}")
                .find("passes its work bound"),
            std::string::npos);
  EXPECT_NE(
      error(
          "{% set s = 'x' * 10000000 %}{{ [s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, "
          "s,"
          " s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s,"
          " s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s,"
          " s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s] }}")
          .find("passes its work bound"),
      std::string::npos);
  EXPECT_EQ(render("{% set l = [1] %}{{ l.99999999999999999999999 }}|{{ l.0 }}"), "|1");
  EXPECT_EQ(render("{{ '' * 372036854775695 }}|{{ 'ab' * 0 }}"), "|");  // nothing repeated: at once
  EXPECT_EQ(render("{{ 'héllo'[1:3] }}{{ 'héllo'[::-2] }}{{ 'héllo' | length }}"), "élolh5");
}

// ---- the Qwen3 template against apply_chat_template ----

TEST(ChatTemplate, Qwen3MatchesApplyChatTemplate) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  const ChatTemplate tmpl = ChatTemplate::from_tokenizer_config(kQwen);
  EXPECT_FALSE(tmpl.has_generation_blocks());
  EXPECT_EQ(tmpl.special_token("eos_token"), "<|im_end|>");
  EXPECT_EQ(tmpl.special_token("bos_token"), "");
  const auto cases = read_jsonl(kGolden + "/qwen3.jsonl");
  ASSERT_GE(cases.size(), 50u);
  check_cases(tmpl, cases, "qwen3");
}

TEST(ChatTemplate, QwenFamiliesMatchApplyChatTemplate) {
  // Qwen2.5, Qwen3 (revised), Qwen3-Instruct-2507, Qwen3-Thinking-2507 (the prompt opens <think>), QwQ and
  // Qwen3-Coder (macros, XML tool calls), each on its conversations
  // (tools/golden/make_chat_family_golden.py).
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  std::map<std::string, std::vector<ojson>> by_template;
  for (ojson& c : read_jsonl(kGolden + "/families.jsonl")) by_template[c["template"]].push_back(std::move(c));
  ASSERT_EQ(by_template.size(), 6u);
  for (const auto& [name, cases] : by_template) {
    const ChatTemplate tmpl =
        ChatTemplate::from_string(slurp(kGolden + "/templates/" + name + ".jinja"), name + ".jinja",
                                  {{"eos_token", "<|im_end|>"}, {"pad_token", "<|endoftext|>"}});
    check_cases(tmpl, cases, name);
  }
}

TEST(ChatTemplate, GenerationBlocksMatchHfAssistantTokensMask) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  const ChatTemplate tmpl =
      ChatTemplate::from_string(slurp(kGolden + "/tagged_template.jinja"), "tagged_template.jinja",
                                {{"eos_token", "<|im_end|>"}, {"pad_token", "<|endoftext|>"}});
  EXPECT_TRUE(tmpl.has_generation_blocks());
  check_cases(tmpl, read_jsonl(kGolden + "/tagged.jsonl"), "tagged");
}

TEST(ChatTemplate, AssistantLabelsCoverContentThinkBlockAndImEnd) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  const ChatTemplate tmpl = ChatTemplate::from_tokenizer_config(kQwen);
  const Tokenizer& tok = qwen_tokenizer();
  const ojson msgs = ojson::parse(
      R"([{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello!","reasoning_content":"greet"}])");
  const EncodedChat enc = tmpl.encode(tok, msgs);
  std::vector<int32_t> trained;
  for (size_t t = 0; t < enc.ids.size(); ++t)
    if (enc.labels[t] != -100) trained.push_back(enc.ids[t]);
  EXPECT_EQ(tok.decode(trained), "<think>\ngreet\n</think>\n\nHello!<|im_end|>");
  EXPECT_EQ(enc.num_assistant_tokens(), static_cast<int64_t>(trained.size()));
  EXPECT_EQ(enc.ids.back(), *tok.token_to_id("\u010a"));  // the "\n" after <|im_end|>: no loss
  EXPECT_EQ(enc.labels.back(), -100);
}

TEST(ChatTemplate, PromptCompletionTrainsOnlyTheCompletion) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  const ChatTemplate tmpl = ChatTemplate::from_tokenizer_config(kQwen);
  const Tokenizer& tok = qwen_tokenizer();
  auto trained_text = [&](const ojson& record) {
    const Conversation c = conversation_from_record(record, "x.jsonl:1");
    ChatOptions o;
    o.skip_assistant_turns = c.prompt_assistant_turns;
    const EncodedChat enc = tmpl.encode(tok, c.messages, o);
    std::vector<int32_t> trained;
    for (size_t t = 0; t < enc.ids.size(); ++t)
      if (enc.labels[t] != -100) trained.push_back(enc.ids[t]);
    return tok.decode(trained);
  };
  // Strings: a user turn and an assistant turn; the same as the equivalent messages.
  const ojson pc = {{"prompt", "2+2?"}, {"completion", "4"}};
  const ojson as_messages = ojson::parse(R"({"messages":[{"role":"user","content":"2+2?"},
                                                         {"role":"assistant","content":"4"}]})");
  EXPECT_EQ(trained_text(pc), "<think>\n\n</think>\n\n4<|im_end|>");
  EXPECT_EQ(trained_text(pc), trained_text(as_messages));
  // Message lists: the prompt's own assistant turns carry no loss.
  const ojson multi =
      ojson::parse(R"({"prompt":[{"role":"user","content":"a"},{"role":"assistant","content":"b"},
                                                 {"role":"user","content":"c"}],
                                       "completion":[{"role":"assistant","content":"d"}]})");
  EXPECT_EQ(trained_text(multi), "<think>\n\n</think>\n\nd<|im_end|>");
}

TEST(ChatTemplate, BadConversationsNameTheField) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  auto err = [](const std::string& line) {
    return error_of([&] { conversation_from_record(ojson::parse(line), "data.jsonl:7"); });
  };
  EXPECT_NE(err(R"({"text":"x"})").find("data.jsonl:7: field 'messages' is missing"), std::string::npos);
  EXPECT_NE(err(R"({"prompt":"x"})").find("data.jsonl:7: field 'completion' is missing"), std::string::npos);
  EXPECT_NE(err(R"({"messages":[]})").find("data.jsonl:7: the list of messages is empty"), std::string::npos);
  EXPECT_NE(
      err(R"({"messages":[{"content":"x"}]})").find("data.jsonl:7: field 'messages[0].role' is missing"),
      std::string::npos);
  EXPECT_NE(err(R"({"messages":[{"role":"user","content":"x"},{"role":"assistant"}]})")
                .find("data.jsonl:7: field 'messages[1].content' is missing"),
            std::string::npos);
  EXPECT_NE(
      err(R"({"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]})")
          .find(
              "field 'messages[0].content': expected a string, got array (content parts are not supported)"),
      std::string::npos);
  EXPECT_NE(err(R"({"messages":{"role":"user"}})").find("expected a list of messages, got object"),
            std::string::npos);
  EXPECT_NE(err(R"({"prompt":"x","completion":3})").find("field 'completion': expected a string or a list"),
            std::string::npos);
  EXPECT_NE(err(R"({"messages":[{"role":"user","content":"x"}],"tools":{"name":"f"}})")
                .find("data.jsonl:7: field 'tools': expected a list of function schemas, got object"),
            std::string::npos);
  // Per-record tools reach the template.
  const Conversation c = conversation_from_record(
      ojson::parse(R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]})"), "d:1");
  ChatOptions o;
  o.extra["tools"] = c.tools;
  EXPECT_NE(ChatTemplate::from_tokenizer_config(kQwen)
                .render(c.messages, o)
                .text.find("<tools>\n{\"type\": \"function\"}"),
            std::string::npos);
}

TEST(ChatTemplate, TemplatesItCannotHandleAreClearErrors) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  TempDir tmp;
  std::ofstream(tmp / "tokenizer_config.json")
      << R"({"chat_template": "{% for m in messages %}\n{% include 'x.jinja' %}{% endfor %}"})";
  const std::string e = error_of([&] { ChatTemplate::from_tokenizer_config(tmp.path.string()); });
  EXPECT_NE(e.find(tmp / "tokenizer_config.json"), std::string::npos) << e;
  EXPECT_NE(e.find(":2: unsupported statement 'include'"), std::string::npos) << e;
  std::ofstream(tmp / "tokenizer_config.json") << R"({"eos_token": "</s>"})";
  EXPECT_NE(error_of([&] {
              ChatTemplate::from_tokenizer_config(tmp.path.string());
            }).find("field 'chat_template' is missing"),
            std::string::npos);
  // Not ChatML and no generation blocks: which tokens are the assistant's is unknown.
  const ChatTemplate plain =
      ChatTemplate::from_string("{% for m in messages %}{{ m.content }}{% endfor %}", "plain");
  EXPECT_NE(error_of([&] {
              plain.encode(qwen_tokenizer(), ojson::parse(R"([{"role":"user","content":"x"}])"));
            }).find("cannot tell which tokens are the assistant's"),
            std::string::npos);
}

// ---- chat data ----

data::DataConfig chat_config(const std::string& file, int64_t seq_len, int64_t batch) {
  data::DataConfig c;
  c.sources = {file};
  c.format = data::DataFormat::Chat;
  c.tokenizer = kQwen;
  c.seq_len = seq_len;
  c.batch_size = batch;
  c.seed = 3;
  c.on_warning = [](const std::string&) {};
  return c;
}

TEST(ChatData, RowsAreOneConversationPaddedWithLabelsOnAssistantTokens) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  TempDir tmp;
  std::ofstream(tmp / "a.jsonl")
      << R"({"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello there."}]})"
      << "\n"
      << R"({"prompt":"Bye","completion":"Goodbye."})"
      << "\n";
  data::DataConfig cfg = chat_config(tmp / "a.jsonl", 64, 2);
  cfg.shuffle = false;
  data::DataLoader loader(cfg);
  data::Batch b;
  ASSERT_TRUE(loader.next_batch(b));
  const ChatTemplate tmpl = ChatTemplate::from_tokenizer_config(kQwen);
  const EncodedChat first = tmpl.encode(qwen_tokenizer(), ojson::parse(R"([{"role":"user","content":"Hi"},
                                                                            {"role":"assistant","content":"Hello there."}])"));
  const size_t n = first.ids.size();
  ASSERT_LT(n, 64u);
  for (size_t t = 0; t < 64; ++t) {
    EXPECT_EQ(b.input_ids[t], t < n ? first.ids[t] : loader.eos_id()) << t;
    EXPECT_EQ(b.labels[t], t + 1 < n ? first.labels[t + 1] : -100) << t;
  }
  int64_t trained = 0;
  for (int32_t y : b.labels) trained += y != -100;
  EXPECT_GT(trained, 0);
}

TEST(ChatData, LongConversationsAreTruncatedAndUntrainableOnesSkipped) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  TempDir tmp;
  const std::string long_user(400, 'x');
  std::ofstream(tmp / "a.jsonl")
      << R"({"messages":[{"role":"user","content":")" << long_user
      << R"("},{"role":"assistant","content":"late"}]})"
      << "\n"
      << R"({"messages":[{"role":"user","content":"q"},{"role":"assistant","content":")"
      << std::string(300, 'y') << R"("}]})"
      << "\n";
  std::vector<std::string> warnings;
  data::DataConfig cfg = chat_config(tmp / "a.jsonl", 16, 1);
  cfg.on_warning = [&](const std::string& w) { warnings.push_back(w); };
  data::DataLoader loader(cfg);
  data::Batch b;
  ASSERT_TRUE(loader.next_batch(b));
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("a.jsonl:1: no assistant token within the first seq_len + 1 = 17 tokens"),
            std::string::npos)
      << warnings[0];
  // The second conversation, cut to 17 tokens: its assistant text runs past the cut.
  EXPECT_NE(b.labels.back(), -100);
  EXPECT_NE(b.input_ids.back(), loader.eos_id());
}

TEST(ChatData, LoaderCountsRowsTrainedTruncatedSkippedAndPadding) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  TempDir tmp;
  std::ofstream(tmp / "a.jsonl")
      << R"({"messages":[{"role":"user","content":")" << std::string(400, 'x')
      << R"("},{"role":"assistant","content":"late"}]})"
      << "\n"
      << R"({"messages":[{"role":"user","content":"q"},{"role":"assistant","content":")"
      << std::string(300, 'y') << R"("}]})"
      << "\n"
      << R"({"prompt":"Bye","completion":"Goodbye."})"
      << "\n";
  data::DataConfig cfg = chat_config(tmp / "a.jsonl", 32, 1);
  cfg.shuffle = false;
  cfg.max_epochs = 1;
  cfg.on_warning = [](const std::string&) {};
  data::DataLoader loader(cfg);
  data::Batch b;
  int64_t trained = 0, padding = 0, rows = 0;
  while (loader.next_batch(b)) {
    ++rows;
    for (int32_t y : b.labels) trained += y != -100;
    for (int64_t t = 31; t >= 0 && b.labels[t] == -100 && b.input_ids[t] == loader.eos_id(); --t) ++padding;
  }
  const data::LoaderStats s = loader.stats();
  EXPECT_EQ(rows, 2);
  EXPECT_EQ(s.rows, 2u);
  EXPECT_EQ(s.skipped, 1u);    // no assistant token in the first 33
  EXPECT_EQ(s.truncated, 1u);  // the 300-character answer
  EXPECT_EQ(s.trained, static_cast<uint64_t>(trained));
  EXPECT_EQ(s.padding, static_cast<uint64_t>(padding));
  EXPECT_EQ(s.tokens + s.padding, 64u);
}

TEST(ChatData, DataShowMarksTheTrainedTokensOfEachRow) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  std::string out;
  ASSERT_EQ(testing::run_titan("data show " + kGolden + "/train.jsonl --format chat --tokenizer " + kQwen +
                                   " --seq-len 64 --rows 2 --ids --color never",
                               &out),
            0)
      << out;
  // The rows are the loader's: the bracketed text of row 1 is the decoded trained tokens.
  data::DataConfig cfg = chat_config(kGolden + "/train.jsonl", 64, 1);
  cfg.shuffle = false;
  data::DataLoader loader(cfg);
  data::Batch b;
  ASSERT_TRUE(loader.next_batch(b));
  std::vector<int32_t> trained;
  for (int64_t t = 1; t < 64; ++t)
    if (b.labels[t - 1] != -100) trained.push_back(b.input_ids[t]);
  const std::string want = "[[" + qwen_tokenizer().decode(trained) + "]]";
  EXPECT_NE(out.find(want), std::string::npos) << out << "\nwant " << want;
  EXPECT_NE(out.find("--- row 2: "), std::string::npos) << out;
  EXPECT_EQ(out.find("--- row 3: "), std::string::npos) << out;
  EXPECT_NE(out.find("ids: 151644 "), std::string::npos) << out;
  EXPECT_NE(out.find(" [151645]"), std::string::npos) << out;  // <|im_end|> of the assistant turn: trained
  EXPECT_NE(out.find("--- whole epoch: 24 conversations, 24 row(s) of 64"), std::string::npos) << out;
  EXPECT_NE(out.find("0 truncated, 0 skipped, padding "), std::string::npos) << out;
  // A record's tools and an assistant turn's tool_calls come through as the template writes them.
  testing::TempDir tmp;
  std::ofstream(tmp / "tools.jsonl")
      << R"({"tools": [{"type": "function", "function": {"name": "clock", "description": "Time now",)"
      << R"( "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}], "messages": [)"
      << R"({"role": "user", "content": "Time?"}, {"role": "assistant", "content": "", "tool_calls": [)"
      << R"({"type": "function", "function": {"name": "clock", "arguments": {"tz": "UTC"}}}]},)"
      << R"( {"role": "tool", "content": "12:00"}, {"role": "assistant", "content": "Noon."}]})"
      << "\n";
  ASSERT_EQ(testing::run_titan("data show " + (tmp / "tools.jsonl") + " --format chat --tokenizer " + kQwen +
                                   " --seq-len 512 --color never",
                               &out),
            0)
      << out;
  EXPECT_NE(out.find("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"clock\""),
            std::string::npos)
      << out;
  EXPECT_NE(
      out.find(
          "[[<tool_call>\n{\"name\": \"clock\", \"arguments\": {\"tz\": \"UTC\"}}\n</tool_call><|im_end|>]]"),
      std::string::npos)
      << out;
  EXPECT_NE(out.find("<tool_response>\n12:00\n</tool_response>"), std::string::npos) << out;
  // Text data: packed windows, every next token trained.
  std::ofstream(tmp / "t.txt") << "hello world\n%\nsecond doc here\n";
  ASSERT_EQ(
      testing::run_titan("data show " + (tmp / "t.txt") + " --delimiter percent --tokenizer " +
                             std::string(TITAN_SOURCE_DIR) + "/tests/golden/tokenizer/small --seq-len 8",
                         &out),
      0)
      << out;
  EXPECT_NE(out.find("--- row 1: 8 tokens, 8 trained (every next token)\nhello world<|endoftext|>"),
            std::string::npos)
      << out;
}

TEST(ChatData, ResumesExactlyFromItsState) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  for (bool packing : {false, true}) {
    data::DataConfig cfg = chat_config(kGolden + "/train.jsonl", packing ? 160 : 48, 2);
    cfg.packing = packing;
    cfg.max_epochs = 0;
    data::DataLoader ref(cfg);
    std::vector<data::Batch> want(9);
    nlohmann::json state;
    for (int s = 0; s < 9; ++s) {
      ASSERT_TRUE(ref.next_batch(want[s]));
      if (s == 4) state = ref.state();
    }
    // Another layout (2 ranks x batch 1 each) from the same state continues with the same rows.
    for (int rank = 0; rank < 2; ++rank) {
      data::DataConfig c2 = cfg;
      c2.batch_size = 1;
      c2.dp_world = 2;
      c2.dp_rank = rank;
      data::DataLoader resumed(c2);
      resumed.load_state(state);
      for (int s = 5; s < 9; ++s) {
        data::Batch b;
        ASSERT_TRUE(resumed.next_batch(b));
        const size_t L = cfg.seq_len;
        EXPECT_TRUE(std::equal(b.input_ids.begin(), b.input_ids.end(), want[s].input_ids.begin() + rank * L));
        EXPECT_TRUE(std::equal(b.labels.begin(), b.labels.end(), want[s].labels.begin() + rank * L));
        if (packing) {
          EXPECT_TRUE(std::equal(b.position_ids.begin(), b.position_ids.end(),
                                 want[s].position_ids.begin() + rank * L));
        }
      }
    }
  }
}

// The conversations of a file in loader order, whole (one per row of a loader with rows longer than any).
struct Conversation {
  std::vector<int32_t> ids, labels;  // labels[t]: the target of position t (-100 at the last token)
};
std::vector<Conversation> whole_conversations(data::DataConfig cfg) {
  cfg.seq_len = 4096;
  cfg.batch_size = 1;
  cfg.packing = false;
  cfg.max_epochs = 1;
  data::DataLoader loader(cfg);
  std::vector<Conversation> out;
  data::Batch b;
  for (uint64_t tokens = 0; loader.next_batch(b);) {
    const uint64_t n = loader.stats().tokens - tokens;
    tokens = loader.stats().tokens;
    EXPECT_LT(n, 4096u);
    out.push_back({{b.input_ids.begin(), b.input_ids.begin() + n}, {b.labels.begin(), b.labels.begin() + n}});
  }
  return out;
}

TEST(ChatData, PackedRowsHoldWholeConversationsInOrder) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  data::DataConfig cfg = chat_config(kGolden + "/train.jsonl", 160, 2);
  cfg.max_epochs = 1;
  const std::vector<Conversation> convs = whole_conversations(cfg);
  ASSERT_GT(convs.size(), 10u);
  cfg.packing = true;
  data::DataLoader loader(cfg);
  data::Batch b;
  size_t next = 0;
  int64_t rows = 0, padding = 0, max_per_row = 0;
  const int64_t L = cfg.seq_len;
  while (loader.next_batch(b)) {
    ASSERT_EQ(b.position_ids.size(), b.input_ids.size());
    for (int64_t r = 0; r < b.batch_size; ++r, ++rows) {
      const int32_t* ids = b.input_ids.data() + r * L;
      const int32_t* labels = b.labels.data() + r * L;
      const int32_t* pos = b.position_ids.data() + r * L;
      int64_t t = 0, in_row = 0;
      // Conversations in order while the next one fits (a longer-than-row one fills a row alone), then
      // padding; none is split.
      while (next < convs.size() && (t == 0 || t + (int64_t)convs[next].ids.size() <= L)) {
        const Conversation& c = convs[next++];
        const int64_t n = std::min<int64_t>(c.ids.size(), L);
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(ids[t + i], c.ids[i]) << "row " << rows << " conversation " << next - 1;
          ASSERT_EQ(labels[t + i], c.labels[i]) << "row " << rows << " conversation " << next - 1;
          ASSERT_EQ(pos[t + i], i);
        }
        t += n;
        ++in_row;
      }
      ASSERT_GT(in_row, 0) << "row " << rows;
      max_per_row = std::max(max_per_row, in_row);
      for (; t < L; ++t, ++padding) {
        EXPECT_EQ(ids[t], loader.eos_id());
        EXPECT_EQ(labels[t], -100);
        EXPECT_EQ(pos[t], 0);
      }
    }
  }
  EXPECT_EQ(next, convs.size());  // every conversation, once
  EXPECT_GT(max_per_row, 1);      // rows do hold several
  const data::LoaderStats st = loader.stats();
  EXPECT_EQ(st.rows, uint64_t(rows));
  EXPECT_EQ(st.padding, uint64_t(padding));
  EXPECT_LT(rows, int64_t(convs.size()));
}

TEST(ChatData, PackingIsForChatData) {
  TempDir tmp;
  std::ofstream(tmp / "a.txt") << "text";
  data::DataConfig c;
  c.sources = {tmp / "a.txt"};
  c.format = data::DataFormat::Text;
  c.tokenizer = "builtin:bytes";
  c.packing = true;
  EXPECT_NE(error_of([&] { data::DataLoader loader(c); }).find("packing applies to chat data"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_train_args({"--training.packing=true"}); }).find("training.packing"),
            std::string::npos);
}

TEST(ChatData, BadLinesNameFileLineAndField) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  TempDir tmp;
  std::ofstream(tmp / "bad.jsonl")
      << R"({"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}]})"
      << "\n\n"
      << R"({"text":"plain text"})"
      << "\n";
  data::DataConfig cfg = chat_config(tmp / "bad.jsonl", 32, 2);
  cfg.shuffle = false;
  const std::string e = error_of([&] {
    data::DataLoader loader(cfg);
    data::Batch b;
    loader.next_batch(b);
  });
  EXPECT_NE(e.find(tmp / "bad.jsonl" + ":3: field 'messages' is missing"), std::string::npos) << e;
  std::ofstream(tmp / "bad.jsonl")
      << R"({"messages":[{"role":"user","content":"a"},{"role":"assistant","content":7}]})";
  const std::string e2 = error_of([&] { data::DataLoader loader(cfg); });
  EXPECT_NE(e2.find(tmp / "bad.jsonl" + ":1: field 'messages[1].content': expected a string, got number"),
            std::string::npos)
      << e2;
  // A tokenizer directory without tokenizer_config.json.
  data::DataConfig c3 = cfg;
  c3.tokenizer = testing::source_path("tests/golden/tokenizer/small");
  EXPECT_NE(error_of([&] { data::DataLoader loader(c3); }).find("tokenizer_config.json: no such file"),
            std::string::npos);
}

// ---- titan train with chat data ----

std::vector<std::string> chat_train_args(const TempDir& tmp, int64_t steps) {
  return {"--job.dump_folder=" + (tmp / "out"),
          "--training.dataset=" + kGolden + "/train.jsonl",
          "--training.dataset_format=chat",
          "--model.tokenizer_path=" + kQwen,
          "--model.vocab_size=151936",
          "--training.seq_len=48",
          "--training.local_batch_size=2",
          "--training.steps=" + std::to_string(steps),
          "--training.sample_tokens=0",
          "--training.val_fraction=0",
          "--validation.enable=false",
          "--lr_scheduler.warmup_steps=1",
          "--metrics.peak_tflops=1",
          "--job.print_config=false"};
}

TEST(ChatTrain, TinyRunHasFiniteLossOnAssistantTokens) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  TempDir tmp;
  TrainConfig c = parse_train_args(chat_train_args(tmp, 3));
  const TrainResult r = run_training(c);
  ASSERT_EQ(r.losses.size(), 3u);
  for (double l : r.losses) {
    EXPECT_TRUE(std::isfinite(l));
    EXPECT_GT(l, 5.0);  // about ln(151936) = 11.9 at init: a mean over real targets, not diluted by padding
  }
}

// The committed 1024-token tokenizer with the Qwen3 chat template beside it keeps the model small
// (its ChatML markers are plain text to it, which the assistant-span rule does not mind).
std::vector<std::string> small_chat_args(const TempDir& tmp, int64_t steps) {
  fs::create_directories(tmp / "tok");
  fs::copy_file(testing::source_path("tests/golden/tokenizer/small/tokenizer.json"),
                tmp / "tok/tokenizer.json");
  fs::copy_file(kQwen + "/tokenizer_config.json", tmp / "tok/tokenizer_config.json");
  auto args = chat_train_args(tmp, steps);
  args.push_back("--model.tokenizer_path=" + (tmp / "tok"));
  args.push_back("--model.vocab_size=1024");
  return args;
}

TEST(ChatTrain, GradientIsTheMeanOverAssistantTargets) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  // The step's gradient is HF's: CE averaged over the real (assistant) targets, not over all
  // positions of the padded rows. Step 1's logged grad_norm equals the norm of the model's own
  // HF-mean gradient (grad_scale 0) on the same rows from the same initialisation.
  TempDir tmp;
  const TrainConfig cfg = parse_train_args(small_chat_args(tmp, 1));
  run_training(cfg);
  std::ifstream metrics(tmp / "out/metrics.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(metrics, line));
  const double logged = nlohmann::json::parse(line)["grad_norm"].get<double>();

  data::DataConfig dc =
      chat_config(kGolden + "/train.jsonl", cfg.training.seq_len, cfg.training.local_batch_size);
  dc.tokenizer = tmp / "tok";
  dc.seed = cfg.training.seed;
  data::DataLoader loader(dc);
  data::Batch b;
  ASSERT_TRUE(loader.next_batch(b));
  int64_t targets = 0;
  for (int32_t y : b.labels) targets += y != -100;
  ASSERT_LT(targets, b.batch_size * b.seq_len / 2);  // padding and prompts: far fewer targets than positions
  Qwen3Model model(resolve_model_config(cfg), cfg.kernels);
  model.init_weights(cfg.training.seed);
  ForwardOptions fo;
  fo.labels_shifted = true;  // grad_scale 0: HF's mean over valid targets
  model.forward(b.input_ids.data(), b.labels.data(), b.batch_size, b.seq_len, fo);
  model.backward();
  double sq = 0;
  for (Tensor& g : model.flat_grads())
    for (int64_t i = 0; i < g.numel(); ++i) sq += double(g.f32()[i]) * g.f32()[i];
  EXPECT_NEAR(logged, std::sqrt(sq), 1e-4 * std::sqrt(sq));
}

TEST(ChatTrain, GradientAccumulationEqualsTheLargerBatch) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  // local 2 x 2 accumulation steps == local 4 in one step: the same rows, and the loss and gradient
  // are the mean over all the step's real targets (not a mean of per-micro-batch means).
  TempDir a, b;
  auto args_a = small_chat_args(a, 3);
  args_a.push_back("--training.global_batch_size=4");
  auto args_b = small_chat_args(b, 3);
  args_b.push_back("--training.local_batch_size=4");
  const auto ra = run_training(parse_train_args(args_a)), rb = run_training(parse_train_args(args_b));
  ASSERT_EQ(ra.losses.size(), 3u);
  ASSERT_EQ(rb.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(ra.losses[i], rb.losses[i], 1e-5 * rb.losses[i]) << i;
}

// step -> loss bits from metrics.jsonl.
std::map<int64_t, double> step_losses(const std::string& path) {
  std::map<int64_t, double> out;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    out[j["step"].get<int64_t>()] = j["loss"].get<double>();
  }
  return out;
}

// `titan train` with `args` (steps, checkpoint.interval = every) straight, and killed after its checkpoint
// at step `every` then restarted: the same loss bits at every step (all finite).
void expect_killed_and_resumed_equals_straight(const TempDir& tmp, std::string args, int steps, int every) {
  args += " --checkpoint.enable=true --checkpoint.interval=" + std::to_string(every) +
          " --checkpoint.last_save_in_hf=false";
  const std::string titan = std::string(TITAN_BINARY) + " train";
  auto straight =
      testing::run_shell_command("timeout 300 " + titan + args + " --job.dump_folder=" + (tmp / "a"));
  ASSERT_EQ(straight.rc, 0) << straight.output;
  auto r = testing::run_shell_command("TITAN_FAULT_INJECT=checkpoint:after-rename@" + std::to_string(every) +
                                      " timeout 300 " + titan + args + " --job.dump_folder=" + (tmp / "b"));
  ASSERT_NE(r.rc, 0) << r.output;
  r = testing::run_shell_command("timeout 300 " + titan + args + " --job.dump_folder=" + (tmp / "b"));
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("resuming from"), std::string::npos) << r.output;
  const auto ref = step_losses(tmp / "a/metrics.jsonl"), got = step_losses(tmp / "b/metrics.jsonl");
  ASSERT_EQ(ref.size(), size_t(steps));
  ASSERT_EQ(got.size(), size_t(steps));
  for (const auto& [step, loss] : ref) {
    EXPECT_TRUE(std::isfinite(loss)) << "step " << step;
    EXPECT_EQ(std::memcmp(&got.at(step), &loss, sizeof loss), 0)
        << "step " << step << ": " << got.at(step) << " vs " << loss;
  }
}

TEST(ChatTrain, KilledAfterACheckpointAndResumedEqualsTheStraightRunBitForBit) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  TempDir tmp;
  std::string args;
  for (const auto& a : small_chat_args(tmp, 6)) args += " " + a;
  expect_killed_and_resumed_equals_straight(tmp, args, 6, 3);
}

TEST(ChatTrain, PackedRunTrainsAndResumesBitForBit) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  // training.packing: rows of whole conversations (attention and positions per conversation); killed
  // after a checkpoint and restarted, the run continues with the straight run's losses.
  TempDir tmp;
  std::string args;
  for (const auto& a : small_chat_args(tmp, 4)) args += " " + a;
  expect_killed_and_resumed_equals_straight(tmp, args + " --training.packing=true --training.seq_len=160", 4,
                                            2);
}

TEST(ChatTrain, TwoDataParallelRanksMatchOneRank) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  // Rows dealt to 2 ranks, the target count summed over them: the same losses as one rank of 4.
  TempDir tmp;
  std::string common;
  for (const auto& a : small_chat_args(tmp, 3))
    if (!a.starts_with("--job.dump_folder") && !a.starts_with("--training.local_batch_size"))
      common += " " + a;
  auto one = testing::run_shell_command(std::string(TITAN_BINARY) + " train" + common +
                                        " --training.local_batch_size=4 --job.dump_folder=" + (tmp / "one"));
  ASSERT_EQ(one.rc, 0) << one.output;
  auto two = testing::run_shell_command("timeout 300 mpirun --oversubscribe --bind-to none -np 2 " +
                                        std::string(TITAN_BINARY) + " train" + common +
                                        " --training.local_batch_size=2 --job.dump_folder=" + (tmp / "two"));
  ASSERT_EQ(two.rc, 0) << two.output;
  const auto ref = step_losses(tmp / "one/metrics.jsonl"), got = step_losses(tmp / "two/metrics.jsonl");
  ASSERT_EQ(ref.size(), 3u);
  ASSERT_EQ(got.size(), 3u);
  for (const auto& [step, loss] : ref) EXPECT_NEAR(got.at(step), loss, 1e-5 * loss) << "step " << step;
}

TEST(ChatTrain, PackedTensorParallelMatchesOneRank) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  // Packed chat SFT under tensor parallel 2 with sequence parallel: the document mask and per-conversation
  // positions over the gathered rows, the assistant-only loss through the vocab-parallel head.
  TempDir tmp;
  std::string common;
  for (const auto& a : small_chat_args(tmp, 3))
    if (!a.starts_with("--job.dump_folder")) common += " " + a;
  common += " --training.packing=true --training.seq_len=160";
  auto one = testing::run_shell_command(std::string(TITAN_BINARY) + " train" + common +
                                        " --job.dump_folder=" + (tmp / "one"));
  ASSERT_EQ(one.rc, 0) << one.output;
  auto tp = testing::run_shell_command(
      "timeout 300 mpirun --oversubscribe --bind-to none -np 2 " + std::string(TITAN_BINARY) + " train" +
      common + " --parallelism.tensor_parallel_degree=2 --job.dump_folder=" + (tmp / "tp2"));
  ASSERT_EQ(tp.rc, 0) << tp.output;
  const auto ref = step_losses(tmp / "one/metrics.jsonl"), got = step_losses(tmp / "tp2/metrics.jsonl");
  ASSERT_EQ(ref.size(), 3u);
  ASSERT_EQ(got.size(), 3u);
  for (const auto& [step, loss] : ref) EXPECT_NEAR(got.at(step), loss, 1e-5 * loss) << "step " << step;
}

TEST(ChatTrain, PackedContextParallelMatchesOneRank) {
  SKIP_WITHOUT_QWEN3_TOKENIZER();
  // Packed chat SFT under context parallel: each rank's two chunks of every row, the document mask and the
  // per-conversation positions taken at whole-sequence positions, conversations running across the chunk
  // boundaries; the assistant-only loss mean over the ranks' targets. seq_len 150 is padded to 152 (CP 2:
  // four chunks of 38; CP 2 x TP 2 with sequence parallel).
  TempDir tmp;
  std::string common;
  for (const auto& a : small_chat_args(tmp, 3))
    if (!a.starts_with("--job.dump_folder")) common += " " + a;
  common += " --training.packing=true --training.seq_len=150";
  auto one = testing::run_shell_command(std::string(TITAN_BINARY) + " train" + common +
                                        " --job.dump_folder=" + (tmp / "one"));
  ASSERT_EQ(one.rc, 0) << one.output;
  const auto ref = step_losses(tmp / "one/metrics.jsonl");
  ASSERT_EQ(ref.size(), 3u);
  for (auto [np, args, name] : {std::tuple<int, std::string, std::string>{2, "", "cp2"},
                                {4, " --parallelism.tensor_parallel_degree=2", "cp2_tp2"}}) {
    auto r = testing::run_shell_command("timeout 300 mpirun --oversubscribe --bind-to none -np " +
                                        std::to_string(np) + " " + std::string(TITAN_BINARY) + " train" +
                                        common + " --parallelism.context_parallel_degree=2" + args +
                                        " --job.dump_folder=" + (tmp / name));
    ASSERT_EQ(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find("seq_len 150 padded to 152"), std::string::npos) << r.output;
    const auto got = step_losses(tmp / (name + "/metrics.jsonl"));
    ASSERT_EQ(got.size(), 3u) << name;
    for (const auto& [step, loss] : ref)
      EXPECT_NEAR(got.at(step), loss, 1e-5 * loss) << name << " step " << step;
  }
}

}  // namespace
}  // namespace titan
