// Chat templates: conversations -> the text and token ids a model is trained or prompted with,
// as HF `tokenizer.apply_chat_template` renders them, plus which tokens are the assistant's.
//
// The template is the Jinja `chat_template` of the model's tokenizer_config.json, rendered by our
// Jinja subset (tokenizer/jinja.h) with the variables HF passes: messages, tools (none),
// documents (none), add_generation_prompt, the special tokens of tokenizer_config.json
// (bos_token, eos_token, pad_token, unk_token when set) and extra ones such as enable_thinking.
//
// Assistant tokens (the tokens that carry the loss in SFT):
//  - a template with {% generation %} blocks: the tokens overlapping the text written inside them,
//    exactly HF's return_assistant_tokens_mask;
//  - a ChatML template without them (Qwen2/Qwen3): each assistant turn's text after its
//    "<|im_start|>assistant\n" header, through its closing "<|im_end|>" (the same rule TRL's
//    training templates mark with {% generation %}): the content, any <think> block the template
//    writes, tool calls and the end-of-turn token; not the header, not the "\n" after <|im_end|>,
//    not an unclosed generation prompt. A token that straddles a span boundary counts as the
//    assistant's (HF maps the span's first and last character to the tokens that hold them).
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace titan {

class Tokenizer;

struct ChatOptions {
  bool add_generation_prompt = false;
  std::optional<bool> enable_thinking;  // unset: the variable is undefined (the template's default)
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();  // more template variables
  // encode(): the first n assistant turns carry no loss (a prompt's own assistant turns).
  size_t skip_assistant_turns = 0;
};

struct ChatRendering {
  std::string text;
  std::vector<std::pair<size_t, size_t>> assistant_spans;  // [begin, end) bytes of `text`
};

struct EncodedChat {
  std::vector<int32_t> ids;
  // labels[i] = ids[i] for assistant tokens, -100 elsewhere (not shifted: HF's labels convention).
  std::vector<int32_t> labels;
  int64_t num_assistant_tokens() const;
};

class ChatTemplate {
 public:
  // The `chat_template` of a tokenizer_config.json (a file or a directory holding one). Throws
  // titan::Error naming the file and line of a construct the renderer does not support.
  static ChatTemplate from_tokenizer_config(const std::string& path);
  // A template from its source; `special_tokens` (e.g. {"eos_token": "<|im_end|>"}) are passed to it.
  static ChatTemplate from_string(const std::string& source, const std::string& name,
                                  nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object());

  // `messages`: a JSON array of {role, content, ...} objects (see check_messages).
  ChatRendering render(const nlohmann::ordered_json& messages, const ChatOptions& options = {}) const;
  // Renders and tokenizes (special tokens in the text become their ids, nothing else is added).
  EncodedChat encode(const Tokenizer& tokenizer, const nlohmann::ordered_json& messages,
                     const ChatOptions& options = {}) const;

  const std::string& name() const;  // the file it came from
  bool has_generation_blocks() const;
  // A special token of tokenizer_config.json passed to the template ("eos_token": the end of an
  // assistant turn for Qwen, <|im_end|>, where generation stops); empty when not set.
  std::string special_token(const std::string& key) const;

  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;
  ~ChatTemplate();

  struct Impl;

 private:
  explicit ChatTemplate(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Checks a conversation: a non-empty array of objects, each with a string `role` and a `content`
// that is a string (or null/absent for an assistant turn with `tool_calls`). Throws titan::Error
// "<where>: field 'messages[2].content': ..." otherwise.
void check_messages(const nlohmann::ordered_json& messages, const std::string& where);

struct Conversation {
  nlohmann::ordered_json messages;
  size_t prompt_assistant_turns = 0;  // assistant turns of a prompt: no loss on them
  nlohmann::ordered_json tools;       // the record's "tools" (function schemas), null when absent
};

// The conversation of one chat JSON Lines record: {"messages": [...]}, or {"prompt": ...,
// "completion": ...} where prompt and completion are strings (a user turn and an assistant turn)
// or message lists (TRL's conversational prompt-completion: the prompt messages, then the
// completion messages; loss only on the completion's assistant turns). An optional "tools" list
// goes to the template as `tools` (TRL's per-example tools). Throws titan::Error "<where>: ..."
// naming the missing or malformed field.
Conversation conversation_from_record(const nlohmann::ordered_json& record, const std::string& where);

}  // namespace titan
