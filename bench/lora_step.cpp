// One LoRA training step (forward + backward + clip + AdamW on the adapters; base frozen) timed in titan;
// prints one JSON line per measured step and a summary with the peak resident set (VmHWM), in the same
// shape as bench/peft_lora_step.py prints for PEFT + transformers.
//   bench_lora_step [--flavor 4B] [--layers N] [--seq 1024 --batch 1 --rank 16 --alpha 32 --steps 3
//                   --warmup 1 --ac 1 --bf16-base 1 --bf16-compute 0] [--hf-dir DIR]
// --bf16-compute 1: the base GEMMs on bf16 operands (the matmul_bf16 engine, as PEFT on a bf16 base).
// --bf16-base 1: the frozen base held in bf16 (FrozenBf16Base, up-converted per layer); 0: f32 base.
// --hf-dir: load the base from an HF directory instead of drawing a random one (shape from its config).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "models/qwen3/lora.h"
#include "models/qwen3/model.h"
#include "optim/optimizer.h"

namespace {
double status_bytes(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(field, 0) == 0) return std::atof(line.c_str() + std::string(field).size()) * 1024.0;
  return 0;
}
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

int main(int argc, char** argv) {
  std::string flavor = "4B", hf_dir;
  int64_t layers = 0, seq = 1024, batch = 1, rank = 16, steps = 3, warmup = 1, ac = 1, bf16_base = 1,
          bf16_compute = 0;
  double alpha = 32;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--flavor")
      flavor = v;
    else if (k == "--hf-dir")
      hf_dir = v;
    else if (k == "--layers")
      layers = std::atoll(v.c_str());
    else if (k == "--seq")
      seq = std::atoll(v.c_str());
    else if (k == "--batch")
      batch = std::atoll(v.c_str());
    else if (k == "--rank")
      rank = std::atoll(v.c_str());
    else if (k == "--alpha")
      alpha = std::atof(v.c_str());
    else if (k == "--steps")
      steps = std::atoll(v.c_str());
    else if (k == "--warmup")
      warmup = std::atoll(v.c_str());
    else if (k == "--ac")
      ac = std::atoll(v.c_str());
    else if (k == "--bf16-compute")
      bf16_compute = std::atoll(v.c_str());
    else if (k == "--bf16-base")
      bf16_base = std::atoll(v.c_str());
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  try {
    titan::Qwen3Config c = hf_dir.empty() ? titan::Qwen3Config::flavor(flavor)
                                          : titan::Qwen3Config::from_hf_file(hf_dir + "/config.json");
    if (layers > 0) c.num_hidden_layers = layers;
    titan::Qwen3Model model(c, {}, nullptr, /*allocate=*/!bf16_base);
    titan::LoraConfig lc;
    lc.rank = rank;
    lc.alpha = alpha;
    titan::LoraAdapters lora(c, lc);
    model.set_lora(&lora);
    std::unique_ptr<titan::FrozenBf16Base> base;
    if (bf16_base)
      base = std::make_unique<titan::FrozenBf16Base>(model, hf_dir, 1);
    else if (!hf_dir.empty())
      model.load_hf(hf_dir);
    model.set_activation_checkpointing(ac != 0);
    if (bf16_compute) model.set_bf16_compute(true);  // base GEMMs on the bf16 engine; adapters stay f32
    titan::AdamW opt(lora.flat_params(), lora.flat_grads(),
                     titan::AdamWConfig{1e-4f, 0.9f, 0.999f, 1e-8f, 0.0f});
    std::mt19937 rng(0);
    std::vector<int32_t> ids(batch * seq);
    for (auto& x : ids) x = static_cast<int32_t>(rng() % c.vocab_size);
    const double rss_after_load = status_bytes("VmRSS:");
    std::vector<double> times;
    for (int64_t s = 0; s < warmup + steps; ++s) {
      const double t0 = now();
      model.zero_grad();
      const titan::ForwardResult r = model.forward(ids.data(), ids.data(), batch, seq);
      model.backward();
      titan::clip_grad_norm(lora.flat_grads(), 1.0);
      opt.step(1e-4f);
      const double dt = now() - t0;
      if (s >= warmup) times.push_back(dt);
      std::printf("{\"step\":%lld,\"loss\":%.6f,\"time_s\":%.3f,\"tokens_per_s\":%.1f,\"warmup\":%s}\n",
                  (long long)s, r.loss, dt, batch * seq / dt, s < warmup ? "true" : "false");
      std::fflush(stdout);
    }
    std::sort(times.begin(), times.end());
    const double med = times.empty() ? 0 : times[times.size() / 2];
    std::printf(
        "{\"summary\":true,\"framework\":\"titan\",\"layers\":%lld,\"hidden\":%lld,\"params\":%lld,\"lora_"
        "params\":%lld,"
        "\"rank\":%lld,\"seq\":%lld,\"batch\":%lld,\"ac\":%lld,\"base\":\"%s\",\"bf16_compute\":%lld,"
        "\"median_step_s\":%.3f,"
        "\"median_tokens_per_s\":%.1f,\"rss_after_load_gib\":%.3f,\"peak_rss_gib\":%.3f}\n",
        (long long)c.num_hidden_layers, (long long)c.hidden_size, (long long)model.num_params(),
        (long long)lora.num_params(), (long long)rank, (long long)seq, (long long)batch, (long long)ac,
        bf16_base ? "bf16" : "f32", (long long)bf16_compute, med, med > 0 ? batch * seq / med : 0.0,
        rss_after_load / (1 << 30), status_bytes("VmHWM:") / (1 << 30));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
