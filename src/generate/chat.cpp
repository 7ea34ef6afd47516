// `titan generate --chat` and the LoRA hook: both depend on rooms built elsewhere (the chat template
// renderer in src/tokenizer/chat_template.h, the LoRA merge in src/models/qwen3/lora.h).
#include "core/error.h"
#include "generate/generator.h"

namespace titan {

void apply_lora_dir(Qwen3Model& /*model*/, const std::string& adapter_dir) {
  fail("--lora ", adapter_dir, ": this build has no LoRA merge (src/models/qwen3/lora.h) yet");
}

int run_chat(Qwen3Model& /*model*/, const Tokenizer& /*tok*/, const std::string& model_dir,
             const GenerateOptions& /*opts*/, int64_t /*max_context*/, const KernelChoice& /*kernels*/) {
  fail("--chat needs the chat template renderer (src/tokenizer/chat_template.h), not in this build (model ",
       model_dir, ")");
}

}  // namespace titan
