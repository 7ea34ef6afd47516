// Greedy generation speed of titan's KV-cache generator on an HF model directory: one prefill of the prompt,
// then --new tokens one at a time (eos ignored). Prints one JSON line per repeat (bench/compare_generate.py
// reads it): prefill seconds, decode tokens/s, the ids.
//   bench_generate --model DIR --prompt-ids 1,2,3 [--new 64 --repeats 3 --dtype f32|bf16 --kernel op=impl]
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "generate/generator.h"

int main(int argc, char** argv) {
  std::string dir, ids_arg, dtype = "f32";
  titan::KernelChoice kernels;
  int64_t new_tokens = 64, repeats = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--model")
      dir = v;
    else if (k == "--prompt-ids")
      ids_arg = v;
    else if (k == "--new")
      new_tokens = std::stoll(v);
    else if (k == "--repeats")
      repeats = std::stoll(v);
    else if (k == "--dtype")
      dtype = v;
  }
  std::vector<int32_t> prompt;
  std::stringstream in(ids_arg);
  for (std::string s; std::getline(in, s, ',');) prompt.push_back(std::stoi(s));
  titan::KernelChoice model_kernels = kernels;
  model_kernels.erase("attention_kv");
  auto model = titan::load_model_dir(dir, dtype == "bf16", model_kernels);
  titan::KVCacheModel kv(*model, static_cast<int64_t>(prompt.size()) + new_tokens, kernels);
  titan::GenerateOptions go;
  go.max_new_tokens = new_tokens;
  using Clock = std::chrono::steady_clock;
  for (int64_t r = 0; r < repeats; ++r) {
    kv.reset();
    auto t0 = Clock::now();
    Clock::time_point t1;
    auto out = titan::generate(kv, prompt, go, [&](int32_t) {
      if (t1 == Clock::time_point{}) t1 = Clock::now();
    });
    auto t2 = Clock::now();
    const double prefill = std::chrono::duration<double>(t1 - t0).count();
    const double decode = std::chrono::duration<double>(t2 - t1).count();
    std::printf("{\"prefill_s\": %.6f, \"decode_tok_s\": %.3f, \"ids\": [", prefill,
                (out.size() - 1) / decode);
    for (size_t i = 0; i < out.size(); ++i) std::printf("%s%d", i ? ", " : "", out[i]);
    std::printf("]}\n");
    std::fflush(stdout);
  }
  return 0;
}
