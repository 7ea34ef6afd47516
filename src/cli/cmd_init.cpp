// titan init --flavor NAME | --config config.json  --output DIR [--dtype f32|bf16] [--seed S]
//            [--max-shard-size BYTES] [--vocab-size V]
// Writes a freshly initialised model (HF init) as an HF checkpoint directory: a seed checkpoint.
#include <CLI/CLI.hpp>

#include "cli/cli_errors.h"
#include "cli/command.h"
#include "core/error.h"
#include "models/qwen3/model.h"

namespace {

int init_main(int argc, char** argv) {
  std::string flavor, config_path, output, dtype = "f32";
  uint64_t seed = 0;
  int64_t max_shard = int64_t(5) << 30, vocab = 0;
  CLI::App app{"Write a freshly initialised Qwen3 model as an HF checkpoint directory", "titan init"};
  auto* f = app.add_option("--flavor", flavor, "flavor: debug, 0.6B, 1.7B, 4B, 8B, 14B, 32B");
  app.add_option("--config", config_path, "HF config.json to take the shapes from")->excludes(f);
  app.add_option("--output", output, "output directory")->required();
  app.add_option("--dtype", dtype, "f32 or bf16")->capture_default_str();
  app.add_option("--seed", seed, "initialisation seed")->capture_default_str();
  app.add_option("--max-shard-size", max_shard, "shard above this many bytes")->capture_default_str();
  app.add_option("--vocab-size", vocab, "override the vocabulary size");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return titan::cli::exit_on_parse_error(app, e);
  }
  TITAN_CHECK(!flavor.empty() || !config_path.empty(), "one of --flavor or --config is required");
  titan::Qwen3Config c = config_path.empty() ? titan::Qwen3Config::flavor(flavor)
                                             : titan::Qwen3Config::from_hf_file(config_path);
  if (vocab > 0) c.vocab_size = vocab;
  titan::Qwen3Model model(c);
  model.init_weights(seed);
  model.save_hf(output, titan::parse_dtype(dtype), max_shard);
  std::printf("wrote %s: %lld parameters, %s\n", output.c_str(), static_cast<long long>(model.num_params()),
              dtype.c_str());
  return 0;
}

}  // namespace

TITAN_COMMAND("init", "write a freshly initialised model as an HF checkpoint (seed checkpoint)", init_main);
