// Chat over the KV cache (chat.h), `titan generate --chat`, and the LoRA hook of generate / eval (the PEFT
// adapter merged into the weights by src/models/qwen3/lora.h).
#include "generate/chat.h"

#include <cstdio>
#include <iostream>

#include "core/error.h"
#include "models/qwen3/lora.h"

namespace titan {

void apply_lora_dir(Qwen3Model& model, const std::string& adapter_dir) {
  merge_lora_into(model, adapter_dir);
}

namespace {
int64_t chat_context(const Qwen3Model& model, int64_t max_context) {
  return max_context > 0 ? max_context : std::min<int64_t>(4096, model.config().max_position_embeddings);
}
}  // namespace

ChatSession::ChatSession(Qwen3Model& model, const Tokenizer& tok, ChatTemplate tpl, GenerateOptions opts,
                         int64_t max_context, const KernelChoice& kernels)
    : tok_(tok),
      tpl_(std::move(tpl)),
      opts_(std::move(opts)),
      kv_(model, chat_context(model, max_context), kernels) {
  const std::string eos = tpl_.special_token("eos_token");
  if (!eos.empty())
    if (auto id = tok.token_to_id(eos);
        id && std::find(opts_.eos_ids.begin(), opts_.eos_ids.end(), *id) == opts_.eos_ids.end())
      opts_.eos_ids.push_back(*id);
}

std::vector<int32_t> ChatSession::reply(const std::string& user,
                                        const std::function<void(int32_t)>& on_token) {
  messages_.push_back({{"role", "user"}, {"content", user}});
  ChatOptions co;
  co.add_generation_prompt = true;
  last_prompt_ = tpl_.encode(tok_, messages_, co).ids;
  const std::vector<int32_t>& ids = last_prompt_;
  TITAN_CHECK(!ids.empty(), "chat: the template rendered no tokens");
  TITAN_CHECK(static_cast<int64_t>(ids.size()) + opts_.max_new_tokens <= kv_.capacity(),
              "chat: the conversation (", ids.size(), " tokens) + --max-new-tokens ", opts_.max_new_tokens,
              " exceed the context of ", kv_.capacity(), " positions (--max-context)");
  // Only what the rendering adds to the cached conversation runs; a template that renders earlier turns
  // differently (e.g. dropping thinking blocks) re-runs from the first difference.
  size_t keep = 0;
  while (keep < cached_.size() && keep < ids.size() && cached_[keep] == ids[keep]) ++keep;
  keep = std::min(keep, ids.size() - 1);
  kv_.truncate(static_cast<int64_t>(keep));
  last_reused_ = static_cast<int64_t>(keep);
  std::vector<int32_t> out =
      generate(kv_, std::span<const int32_t>(ids.data() + keep, ids.size() - keep), opts_, on_token);
  cached_ = ids;
  cached_.insert(cached_.end(), out.begin(), out.end() - 1);  // the last id has not run
  messages_.push_back({{"role", "assistant"}, {"content", tok_.decode(out, true)}});
  return out;
}

int run_chat(Qwen3Model& model, const Tokenizer& tok, const std::string& model_dir,
             const GenerateOptions& opts, int64_t max_context, const KernelChoice& kernels) {
  ChatSession chat(model, tok, ChatTemplate::from_tokenizer_config(model_dir), opts, max_context, kernels);
  std::fprintf(stderr, "[chat: one user turn per line; end with EOF (Ctrl-D)]\n");
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    TextStreamer streamer(tok);
    chat.reply(line, [&](int32_t id) {
      std::fputs(streamer.put(id).c_str(), stdout);
      std::fflush(stdout);
    });
    std::fputs(streamer.finish().c_str(), stdout);
    std::fputs("\n", stdout);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace titan
