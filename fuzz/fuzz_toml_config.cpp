// A `titan train --config FILE` TOML file (shipped configs are copied and edited by users): applied
// over the defaults, validated, written back as TOML (what the run saves as config.toml), and that
// text read again, which must give the same settings.
#include "fuzz_target.h"
#include "train/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(titan::fuzz::as_text(data, size));
  titan::TrainConfig config;
  bool applied = false;
  titan::fuzz::expect_clean_error("fuzz.toml", [&] {
    titan::apply_toml(config, text, "fuzz.toml");
    applied = true;
  });
  if (!applied) return 0;
  // validate() names the section.key at fault (the file is named by the caller that read it).
  titan::fuzz::expect_clean_error("", [&] { config.validate(); });
  const std::string saved = config.to_toml();
  titan::TrainConfig again;
  titan::apply_toml(again, saved, "config.toml");  // titan's own output: must always read back
  if (again.to_toml() != saved) {
    std::fprintf(stderr, "fuzz: config.toml does not read back the same:\n%s\n---\n%s\n", saved.c_str(),
                 again.to_toml().c_str());
    std::abort();
  }
  return 0;
}
