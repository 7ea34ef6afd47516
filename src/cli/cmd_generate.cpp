// titan generate --model DIR [--lora DIR] (--prompt TEXT | --prompt-ids IDS | --chat) [--max-new-tokens N]
//                [--greedy | --do-sample] [--temperature T] [--top-k K] [--top-p P] [--seed S]
//                [--dtype f32|bf16] [--max-context N] [--print-ids] [--kernel op=impl ...]
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <sstream>

#include "cli/cli_errors.h"
#include "cli/command.h"
#include "core/error.h"
#include "generate/generator.h"

namespace {

using Clock = std::chrono::steady_clock;

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::string item;
  std::stringstream in(s);
  while (std::getline(in, item, ',')) {
    std::stringstream one(item);
    long long v;
    std::string rest;
    TITAN_CHECK(one >> v && !(one >> rest) && v >= 0 && v <= INT32_MAX, "--prompt-ids: '", item,
                "' is not a token id (expected comma-separated non-negative integers)");
    ids.push_back(static_cast<int32_t>(v));
  }
  TITAN_CHECK(!ids.empty(), "--prompt-ids: no ids given");
  return ids;
}

int generate_main(int argc, char** argv) {
  std::string model_dir, lora_dir, prompt, prompt_ids, dtype = "f32", device = "cpu";
  bool chat = false, greedy = false, do_sample = false, print_ids = false;
  int64_t max_new = 256, max_context = 0;
  double temperature = -1, top_p = -1;
  int64_t top_k = -1;
  uint64_t seed = 0;
  std::vector<std::string> kernels;
  CLI::App app{"Generate text with an HF Qwen3 / Qwen3-MoE model (KV cache, streamed to stdout)",
               "titan generate"};
  app.add_option("--model", model_dir, "HF model directory (config.json, safetensors, tokenizer.json)")
      ->required();
  app.add_option("--lora", lora_dir, "PEFT LoRA adapter directory merged into the model");
  auto* p_text = app.add_option("--prompt", prompt, "prompt text");
  auto* p_ids = app.add_option("--prompt-ids", prompt_ids, "prompt as comma-separated token ids");
  auto* p_chat = app.add_flag("--chat", chat, "interactive chat: user turns from stdin, one per line");
  p_text->excludes(p_ids)->excludes(p_chat);
  p_ids->excludes(p_chat);
  app.add_option("--max-new-tokens", max_new, "tokens to generate at most (per reply)")
      ->capture_default_str();
  app.add_flag("--greedy", greedy, "greedy decoding (argmax), whatever generation_config.json says");
  app.add_flag("--do-sample", do_sample, "sample, whatever generation_config.json says");
  app.add_option("--temperature", temperature,
                 "sampling temperature (> 0; default: generation_config.json or 1)");
  app.add_option("--top-k", top_k, "keep the k most likely tokens (0: off)");
  app.add_option("--top-p", top_p, "nucleus sampling threshold in (0, 1] (1: off)");
  app.add_option("--seed", seed, "sampling RNG seed")->capture_default_str();
  app.add_option("--dtype", dtype, "f32, or bf16 (weights and activations rounded to bf16, bf16 GEMMs)")
      ->capture_default_str();
  app.add_option("--max-context", max_context,
                 "KV cache positions (default: prompt + max-new-tokens; --chat: min(4096, model maximum))");
  app.add_flag("--print-ids", print_ids, "after the text, print the generated ids on one line");
  app.add_option("--device", device, "cpu, cuda, cuda:N or guard")->capture_default_str();
  app.add_option("--kernel", kernels, "kernel override op=impl (e.g. attention_kv=reference)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return titan::cli::exit_on_parse_error(app, e);
  }
  TITAN_CHECK(!prompt.empty() || !prompt_ids.empty() || chat,
              "give --prompt TEXT, --prompt-ids IDS or --chat");
  TITAN_CHECK(!(greedy && do_sample), "--greedy and --do-sample exclude each other");
  TITAN_CHECK(dtype == "f32" || dtype == "bf16", "--dtype must be f32 or bf16, got '", dtype, "'");
  TITAN_CHECK(max_new >= 1, "--max-new-tokens must be >= 1, got ", max_new);
  titan::KernelChoice kc;
  for (auto& k : kernels) {
    auto eq = k.find('=');
    TITAN_CHECK(eq != std::string::npos, "--kernel expects op=impl, got '", k, "'");
    kc[k.substr(0, eq)] = k.substr(eq + 1);
  }
  titan::KernelChoice model_kernels = kc;
  model_kernels.erase("attention_kv");

  // Settings: generation_config.json, then the flags.
  titan::GenerationDefaults defaults = titan::read_generation_defaults(model_dir);
  titan::GenerateOptions go;
  go.max_new_tokens = max_new;
  go.eos_ids = defaults.eos_ids;
  go.sampling = defaults.sampling;
  if (temperature >= 0) {
    if (temperature == 0)
      greedy = true;  // temperature 0 reads as greedy
    else
      go.sampling.temperature = temperature, go.sampling.do_sample = true;
  }
  if (top_k >= 0) go.sampling.top_k = top_k;
  if (top_p >= 0) go.sampling.top_p = top_p;
  if (do_sample) go.sampling.do_sample = true;
  if (greedy) go.sampling.do_sample = false;
  go.sampling.seed = seed;
  titan::Sampler check(go.sampling);  // validates the settings before the model loads

  std::unique_ptr<titan::Qwen3Model> model = titan::load_model_dir(
      model_dir, dtype == "bf16", model_kernels, lora_dir, titan::parse_device(device, "--device"));
  // Prompt ids need no tokenizer: without a tokenizer.json beside the model the output is the ids alone.
  std::optional<titan::Tokenizer> tok;
  const bool have_tokenizer = std::filesystem::exists(std::filesystem::path(model_dir) / "tokenizer.json") ||
                              !std::filesystem::is_directory(model_dir);
  if (prompt_ids.empty() || have_tokenizer) tok.emplace(titan::Tokenizer::load(model_dir));
  if (!tok) {
    print_ids = true;
    std::fprintf(stderr, "[no tokenizer.json in %s: printing the generated ids only]\n", model_dir.c_str());
  }

  if (chat) return titan::run_chat(*model, *tok, model_dir, go, max_context, kc);

  std::vector<int32_t> ids = prompt_ids.empty() ? tok->encode(prompt) : parse_ids(prompt_ids);
  TITAN_CHECK(!ids.empty(), "--prompt: the prompt encodes to no tokens");
  const int64_t limit = model->config().max_position_embeddings;
  const int64_t want = static_cast<int64_t>(ids.size()) + max_new;
  if (max_context <= 0) max_context = std::min(want, limit);
  titan::KVCacheModel kv(*model, max_context, kc);
  std::optional<titan::TextStreamer> streamer;
  if (tok) streamer.emplace(*tok);
  const auto t0 = Clock::now();
  double t_first = 0;
  std::vector<int32_t> out = titan::generate(kv, ids, go, [&](int32_t id) {
    if (t_first == 0) t_first = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!streamer) return;
    std::fputs(streamer->put(id).c_str(), stdout);
    std::fflush(stdout);
  });
  if (streamer) {
    std::fputs(streamer->finish().c_str(), stdout);
    std::fputs("\n", stdout);
  }
  const double total = std::chrono::duration<double>(Clock::now() - t0).count();
  if (print_ids) {
    for (size_t i = 0; i < out.size(); ++i) std::printf("%s%d", i ? " " : "", out[i]);
    std::printf("\n");
  }
  const double decode_s = total - t_first;
  std::fprintf(stderr,
               "[prompt %zu tokens in %.3f s (%.1f tok/s); %zu new tokens, %.1f tok/s after the first]\n",
               ids.size(), t_first, ids.size() / std::max(t_first, 1e-9), out.size(),
               out.size() > 1 ? (out.size() - 1) / std::max(decode_s, 1e-9) : 0.0);
  return 0;
}

}  // namespace

TITAN_COMMAND("generate", "generate text with a model (KV cache; greedy / temperature / top-k / top-p)",
              generate_main);
