// One Qwen3 training step (forward + backward + clip + AdamW) timed in titan; prints one JSON line per
// measured step and a summary, in the same format as bench/pytorch_train_step.py.
//   bench_train_step [--hidden 1024 --layers 4 --heads 16 --kv-heads 8 --head-dim 128
//                     --intermediate 3072 --vocab 151936 --seq 512 --batch 1 --steps 5 --warmup 1]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "device/device.h"
#include "models/qwen3/model.h"
#include "optim/optimizer.h"

int main(int argc, char** argv) {
  titan::Qwen3Config c = titan::Qwen3Config::flavor("0.6B");
  c.num_hidden_layers = 4;
  int64_t seq = 512, batch = 1, steps = 5, warmup = 1, ac = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    int64_t v = std::atoll(argv[i + 1]);
    if (k == "--hidden")
      c.hidden_size = v;
    else if (k == "--layers")
      c.num_hidden_layers = v;
    else if (k == "--heads")
      c.num_attention_heads = v;
    else if (k == "--kv-heads")
      c.num_key_value_heads = v;
    else if (k == "--head-dim")
      c.head_dim = v;
    else if (k == "--intermediate")
      c.intermediate_size = v;
    else if (k == "--vocab")
      c.vocab_size = v;
    else if (k == "--seq")
      seq = v;
    else if (k == "--batch")
      batch = v;
    else if (k == "--steps")
      steps = v;
    else if (k == "--warmup")
      warmup = v;
    else if (k == "--ac")
      ac = v;  // 1: activation checkpointing (full)
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  titan::Qwen3Model model(c);
  model.init_weights(0);
  model.set_activation_checkpointing(ac != 0);
  titan::AdamW opt(model.flat_params(), model.flat_grads(),
                   titan::AdamWConfig{1e-4f, 0.9f, 0.999f, 1e-8f, 0.01f});
  std::mt19937 rng(0);
  std::vector<int32_t> ids(batch * seq);
  for (auto& x : ids) x = static_cast<int32_t>(rng() % c.vocab_size);
  std::vector<double> times;
  const double tokens = static_cast<double>(batch * seq);
  for (int64_t s = 0; s < warmup + steps; ++s) {
    auto t0 = std::chrono::steady_clock::now();
    model.zero_grad();
    auto r = model.forward(ids.data(), ids.data(), batch, seq);
    model.backward();
    titan::clip_grad_norm(model.flat_grads(), 1.0);
    opt.step(1e-4f);
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s >= warmup) {
      times.push_back(dt);
      std::printf("{\"impl\":\"titan\",\"step\":%lld,\"seconds\":%.6f,\"tokens_per_s\":%.2f,\"loss\":%.6f}\n",
                  static_cast<long long>(s - warmup), dt, tokens / dt, r.loss);
      std::fflush(stdout);
    }
  }
  std::sort(times.begin(), times.end());
  const double med = times.empty() ? 0 : times[times.size() / 2];
  const auto& stats = titan::device_interface(titan::DeviceType::CPU).allocator->stats;
  std::printf(
      "{\"impl\":\"titan\",\"summary\":true,\"threads\":%d,\"params\":%lld,\"median_seconds\":%.6f,"
      "\"median_tokens_per_s\":%.2f,\"peak_alloc_gib\":%.3f,\"activation_gib\":%.3f}\n",
      omp_get_max_threads(), static_cast<long long>(model.num_params()), med, tokens / med,
      stats.peak.load() / double(1 << 30), model.activation_bytes() / double(1 << 30));
  return 0;
}
