// A training checkpoint's metadata.json (with a COMPLETE marker that matches it, as a checkpoint copied
// from elsewhere has): opened, its model config read and validated, checked as `titan train` checks a
// checkpoint it resumes, then a slice of its first tensor asked for, as a load does (the shard files
// named by the metadata are not there: that must be one clean error too).
#include <xxhash.h>

#include <cstdio>

#include "checkpoint/checkpoint.h"
#include "fuzz_target.h"
#include "train/checkpointing.h"
#include "train/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text = titan::fuzz::as_text(data, size);
  const std::string meta_path = titan::fuzz::write_scratch("ckpt/step-3/metadata.json", text);
  char hash[17];
  std::snprintf(hash, sizeof hash, "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(text.data(), text.size())));
  titan::fuzz::write_scratch("ckpt/step-3/COMPLETE",
                             std::string("{\"step\": 3, \"metadata_xxh3\": \"") + hash + "\"}\n");
  const std::string dir = meta_path.substr(0, meta_path.size() - std::string("/metadata.json").size());
  titan::fuzz::expect_clean_error(dir, [&] {
    const titan::ckpt::Reader reader(dir);
    (void)reader.step();
    const titan::Qwen3Config config = titan::saved_model_config(reader);
    titan::check_same_model(reader, config);
    if (titan::has_training_state(reader)) {
      // A run with the saved batch shape where the metadata has one, so the checks go on past it.
      const nlohmann::json& t =
          reader.meta().contains("training") ? reader.meta()["training"] : nlohmann::json();
      auto saved = [&](const char* key, int64_t dflt) {
        return t.is_object() && t.contains(key) && t[key].is_number_integer() ? t[key].get<int64_t>() : dflt;
      };
      titan::TrainConfig cfg;
      cfg.training.steps = 1000;
      cfg.training.seq_len = saved("seq_len", 64);
      titan::check_resumable(reader, config, cfg, saved("global_batch_size", 8));
    }
    for (const auto& [name, numel] : reader.meta()["tensors"].items()) {
      const int64_t n = reader.tensor_numel(name);
      std::vector<titan::ckpt::Slice> wanted;
      const int64_t count = n < 16 ? n : 16;
      wanted.push_back(titan::ckpt::Slice{name, n, n - count, titan::Tensor::zeros({count})});
      reader.read(wanted);
      break;
    }
  });
  return 0;
}
