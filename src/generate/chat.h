// A chat over the KV cache: each user turn is appended to the conversation, the conversation is rendered
// with the model's chat template (add_generation_prompt) and only what the rendering adds to the cached
// ids runs before the reply is generated. The reply (its text decoded without special tokens, as HF's
// decode(skip_special_tokens=True)) becomes the assistant message of the next rendering.
#pragma once
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "generate/generator.h"
#include "tokenizer/chat_template.h"

namespace titan {

class ChatSession {
 public:
  // max_context: cache positions (0: min(4096, max_position_embeddings)). The template's eos_token joins
  // opts.eos_ids.
  ChatSession(Qwen3Model& model, const Tokenizer& tok, ChatTemplate tpl, GenerateOptions opts,
              int64_t max_context = 0, const KernelChoice& kernels = {});
  // Adds the user turn, generates and records the reply; returns the reply's ids (the stopping eos
  // included). on_token as for generate().
  std::vector<int32_t> reply(const std::string& user, const std::function<void(int32_t)>& on_token = {});
  const nlohmann::ordered_json& messages() const { return messages_; }
  // The rendered ids of the last turn's prompt, and how many of them came from the cache.
  const std::vector<int32_t>& last_prompt() const { return last_prompt_; }
  int64_t last_reused() const { return last_reused_; }

 private:
  const Tokenizer& tok_;
  ChatTemplate tpl_;
  GenerateOptions opts_;
  KVCacheModel kv_;
  nlohmann::ordered_json messages_ = nlohmann::ordered_json::array();
  std::vector<int32_t> cached_;  // the ids whose keys/values the cache holds
  std::vector<int32_t> last_prompt_;
  int64_t last_reused_ = 0;
};

}  // namespace titan
