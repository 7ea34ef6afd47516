// A model's config.json (an HF checkpoint's, or titan's own export): parsed, validated, then the
// model laid out from it (every parameter's name, shape and offset; no weights allocated), as
// `titan forward/train/generate` do before they read any weights.
#include "fuzz_target.h"
#include "io/json_file.h"
#include "models/qwen3/config.h"
#include "models/qwen3/model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  titan::fuzz::expect_clean_error("config.json", [&] {
    const nlohmann::json j = titan::parse_json(titan::fuzz::as_text(data, size), "config.json");
    const titan::Qwen3Config config = titan::Qwen3Config::from_hf_json(j, "config.json");
    config.validate("config.json");
    (void)config.num_params();
    (void)config.num_active_params();
    (void)config.training_flops_per_token(4096);
    (void)config.to_hf_json().dump();
    titan::Qwen3Model model(config, {}, nullptr, /*allocate=*/false);
    (void)model.params().size();
  });
  return 0;
}
