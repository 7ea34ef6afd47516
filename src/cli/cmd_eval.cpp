// titan eval --model DIR [--lora DIR] --data FILE [--data FILE ...] [--seq-len N] [--batch B]
//            [--format auto|text|jsonl|tokens] [--text-field NAME] [--dtype f32|bf16] [--json]
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "cli/cli_errors.h"
#include "cli/command.h"
#include "core/error.h"
#include "generate/eval.h"
#include "generate/generator.h"

namespace {

int eval_main(int argc, char** argv) {
  std::string model_dir, lora_dir, format = "auto", text_field = "text", dtype = "f32", device = "cpu";
  std::vector<std::string> data;
  int64_t seq_len = 2048, batch = 1;
  bool json = false;
  CLI::App app{"Loss and perplexity of a model on a dataset, over the windows training would use",
               "titan eval"};
  app.add_option("--model", model_dir, "HF model directory (config.json, safetensors, tokenizer.json)")
      ->required();
  app.add_option("--lora", lora_dir, "PEFT LoRA adapter directory merged into the model");
  app.add_option("--data", data, "text / jsonl file(s) or directories, or a prepared token dataset")
      ->required();
  app.add_option("--seq-len", seq_len, "window length (tokens per row, as training's seq_len)")
      ->capture_default_str();
  app.add_option("--batch", batch, "windows per forward")->capture_default_str();
  app.add_option("--format", format,
                 "auto | text | jsonl | tokens (| chat: conversations, loss on assistant tokens, when the "
                 "chat data layer is built in)")
      ->capture_default_str();
  app.add_option("--text-field", text_field, "JSON Lines: the field holding the text")->capture_default_str();
  app.add_option("--dtype", dtype, "f32 or bf16")->capture_default_str();
  app.add_option("--device", device, "cpu, cuda, cuda:N or guard")->capture_default_str();
  app.add_flag("--json", json, "print one JSON object instead of text");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return titan::cli::exit_on_parse_error(app, e);
  }
  TITAN_CHECK(dtype == "f32" || dtype == "bf16", "--dtype must be f32 or bf16, got '", dtype, "'");
  for (const auto& d : data) TITAN_CHECK(std::filesystem::exists(d), "--data: '", d, "' does not exist");
  const auto cfg =
      titan::eval_data_config(data, model_dir, seq_len, titan::data::parse_data_format(format), text_field);
  auto model = titan::load_model_dir(model_dir, dtype == "bf16", {}, lora_dir,
                                     titan::parse_device(device, "--device"));
  const auto t0 = std::chrono::steady_clock::now();
  int64_t windows = 0;
  const titan::EvalResult r = titan::evaluate_dataset(*model, cfg, batch, &windows);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (json) {
    nlohmann::ordered_json j = {{"loss", r.loss()},   {"perplexity", r.perplexity()}, {"tokens", r.targets},
                                {"windows", windows}, {"seq_len", seq_len},           {"seconds", s}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("loss %.6f  perplexity %.4f  (%lld tokens in %lld windows of %lld, %.2f s)\n", r.loss(),
                r.perplexity(), (long long)r.targets, (long long)windows, (long long)seq_len, s);
  }
  return 0;
}

}  // namespace

TITAN_COMMAND("eval", "loss and perplexity of a model on a text / jsonl / token dataset", eval_main);
