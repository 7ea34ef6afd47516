// Chat templates (the `chat_template` of a downloaded tokenizer_config.json): parse, then render with
// the variables HF passes -- a conversation with a system prompt, tool calls, tool results, reasoning
// and non-ASCII text, the tool schemas, the generation prompt and the special tokens.
#include <nlohmann/json.hpp>

#include "fuzz_target.h"
#include "tokenizer/jinja.h"

namespace {

const nlohmann::ordered_json& context() {
  static const nlohmann::ordered_json ctx = nlohmann::ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "You are helpful."},
      {"role": "user", "content": "Wie spät ist es in 東京? 🙂"},
      {"role": "assistant", "content": "<think>\nLook it up.\n</think>\n\n", "reasoning_content": "Look it up.",
       "tool_calls": [{"type": "function", "function": {"name": "clock", "arguments": {"tz": "Asia/Tokyo", "n": 3}}}]},
      {"role": "tool", "content": "{\"time\": \"09:30\"}"},
      {"role": "assistant", "content": "It is 09:30."},
      {"role": "user", "content": ""}
    ],
    "tools": [{"type": "function", "function": {"name": "clock", "description": "Current time",
               "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}],
    "add_generation_prompt": true,
    "enable_thinking": false,
    "bos_token": "<|endoftext|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>"
  })");
  return ctx;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view source = titan::fuzz::as_text(data, size);
  titan::fuzz::expect_clean_error("fuzz.jinja", [&] {
    const titan::jinja::Template t = titan::jinja::Template::parse(source, "fuzz.jinja");
    (void)t.render(context());
  });
  return 0;
}
