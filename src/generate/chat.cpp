// `titan generate --chat` and the LoRA hook. Both use rooms built elsewhere: the chat template renderer
// (src/tokenizer/chat_template.h) and the LoRA merge (src/models/qwen3/lora.h); without them in the build
// the features say so.
#include <cstdio>
#include <iostream>

#include "core/error.h"
#include "generate/generator.h"

#if __has_include("tokenizer/chat_template.h")
#include "tokenizer/chat_template.h"
#define TITAN_HAVE_CHAT_TEMPLATE 1
#endif
#if __has_include("models/qwen3/lora.h")
#include "models/qwen3/lora.h"
#define TITAN_HAVE_LORA 1
#endif

namespace titan {

void apply_lora_dir(Qwen3Model& model, const std::string& adapter_dir) {
#ifdef TITAN_HAVE_LORA
  merge_lora_into(model, adapter_dir);
#else
  (void)model;
  fail("--lora ", adapter_dir, ": this build has no LoRA merge (src/models/qwen3/lora.h)");
#endif
}

#ifdef TITAN_HAVE_CHAT_TEMPLATE
namespace {
// Length of the common prefix of a and b.
size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return i;
}
}  // namespace

int run_chat(Qwen3Model& model, const Tokenizer& tok, const std::string& model_dir,
             const GenerateOptions& opts, int64_t max_context, const KernelChoice& kernels) {
  const ChatTemplate tpl = ChatTemplate::from_tokenizer_config(model_dir);
  if (max_context <= 0) max_context = std::min<int64_t>(4096, model.config().max_position_embeddings);
  KVCacheModel kv(model, max_context, kernels);
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  std::vector<int32_t> cached;  // the ids whose keys/values the cache holds
  ChatOptions co;
  co.add_generation_prompt = true;
  std::string line;
  std::fprintf(stderr, "[chat: one user turn per line; end with EOF (Ctrl-D)]\n");
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    messages.push_back({{"role", "user"}, {"content", line}});
    const std::vector<int32_t> ids = tpl.encode(tok, messages, co).ids;
    // Only what the rendering adds to the cached conversation runs (a template that re-renders earlier turns
    // differently, e.g. dropping thinking blocks, re-runs from the first difference).
    size_t keep = std::min(common_prefix(cached, ids), ids.size() - 1);
    kv.truncate(static_cast<int64_t>(keep));
    const std::span<const int32_t> fresh(ids.data() + keep, ids.size() - keep);
    TITAN_CHECK(static_cast<int64_t>(ids.size()) + opts.max_new_tokens <= kv.capacity(),
                "chat: the conversation (", ids.size(), " tokens) + --max-new-tokens ", opts.max_new_tokens,
                " exceed the context of ", kv.capacity(), " positions (--max-context)");
    TextStreamer streamer(tok);
    std::vector<int32_t> out = generate(kv, fresh, opts, [&](int32_t id) {
      std::fputs(streamer.put(id).c_str(), stdout);
      std::fflush(stdout);
    });
    std::fputs(streamer.finish().c_str(), stdout);
    std::fputs("\n", stdout);
    std::fflush(stdout);
    cached = ids;
    cached.insert(cached.end(), out.begin(), out.end() - 1);  // the last id was not run
    messages.push_back({{"role", "assistant"}, {"content", tok.decode(out, true)}});
  }
  return 0;
}
#else
int run_chat(Qwen3Model& /*model*/, const Tokenizer& /*tok*/, const std::string& model_dir,
             const GenerateOptions& /*opts*/, int64_t /*max_context*/, const KernelChoice& /*kernels*/) {
  fail("--chat needs the chat template renderer (src/tokenizer/chat_template.h), not in this build (model ",
       model_dir, ")");
}
#endif

}  // namespace titan
