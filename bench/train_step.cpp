// One Qwen3 training step (forward + backward + clip + AdamW) timed in titan; prints one JSON line per
// measured step and a summary, in the same format as bench/pytorch_train_step.py.
//   bench_train_step [--flavor 0.6B] [--hidden 1024 --layers 4 --heads 16 --kv-heads 8 --head-dim 128
//                     --intermediate 3072 --vocab 151936 --tied 1 --experts 0 --top-k 0 --moe-intermediate 0]
//                    [--seq 512 --batch 1 --steps 5 --warmup 1 --ac 0 --bf16 0] [--serve 1]
// --serve 1: after the warm-up print {"ready":true}, then run one measured step per "step" line read from
// stdin and print the summary at "quit" (bench/compare_pytorch.py interleaves frameworks step by step).
// The summary carries the process's peak resident set (VmHWM).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "device/device.h"
#include "models/qwen3/model.h"
#include "optim/optimizer.h"

namespace {
// Peak resident set of this process in bytes (VmHWM from /proc/self/status), 0 if unavailable.
double peak_rss_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::atof(line.c_str() + 6) * 1024.0;
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  std::string flavor = "0.6B";
  for (int i = 1; i + 1 < argc; i += 2)
    if (std::string(argv[i]) == "--flavor") flavor = argv[i + 1];
  titan::Qwen3Config c = titan::Qwen3Config::flavor(flavor);
  if (flavor == "0.6B") c.num_hidden_layers = 4;
  int64_t seq = 512, batch = 1, steps = 5, warmup = 1, ac = 0, serve = 0, bf16 = 0, head_chunk = 0;
  titan::KernelChoice kernels;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    int64_t v = std::atoll(argv[i + 1]);
    if (k == "--flavor")
      continue;
    else if (k == "--kernel") {  // op=impl
      std::string s = argv[i + 1];
      kernels[s.substr(0, s.find('='))] = s.substr(s.find('=') + 1);
    } else if (k == "--hidden")
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
    else if (k == "--tied")
      c.tie_word_embeddings = v != 0;
    else if (k == "--experts")
      c.num_experts = v;
    else if (k == "--top-k")
      c.num_experts_per_tok = v;
    else if (k == "--moe-intermediate")
      c.moe_intermediate_size = v;
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
    else if (k == "--bf16")
      bf16 = v;  // 1: training.mixed_precision_param = "bfloat16"
    else if (k == "--head-chunk")
      head_chunk = v;  // rows of the lm_head + cross-entropy chunk (0 = automatic)
    else if (k == "--serve")
      serve = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (c.num_experts > 0) c.norm_topk_prob = true;
  titan::Qwen3Model model(c, kernels);
  model.init_weights(0);
  model.set_activation_checkpointing(ac != 0);
  model.set_head_chunk_rows(head_chunk);
  if (bf16) model.set_bf16_compute(true);
  titan::AdamW opt(model.flat_params(), model.flat_grads(),
                   titan::AdamWConfig{1e-4f, 0.9f, 0.999f, 1e-8f, 0.01f});
  std::mt19937 rng(0);
  std::vector<int32_t> ids(batch * seq);
  for (auto& x : ids) x = static_cast<int32_t>(rng() % c.vocab_size);
  std::vector<double> times;
  const double tokens = static_cast<double>(batch * seq);
  auto one_step = [&](int64_t s, bool measured) {
    using clock = std::chrono::steady_clock;
    auto since = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
    auto t0 = clock::now();
    model.zero_grad();
    auto t1 = clock::now();
    auto r = model.forward(ids.data(), ids.data(), batch, seq);
    auto t2 = clock::now();
    model.backward();
    auto t3 = clock::now();
    const double norm = std::sqrt(titan::grad_sq_norm(model.flat_grads()));
    auto t4 = clock::now();
    opt.step(1e-4f, titan::clip_coefficient(norm, 1.0));  // clip_grad_norm_(max_norm=1) fused into AdamW
    auto t5 = clock::now();
    double dt = since(t0, t5);
    if (measured) {
      times.push_back(dt);
      std::printf("{\"impl\":\"titan\",\"step\":%lld,\"seconds\":%.6f,\"tokens_per_s\":%.2f,\"loss\":%.6f,"
                  "\"phases\":{\"zero_grad\":%.4f,\"forward\":%.4f,\"backward\":%.4f,\"clip\":%.4f,"
                  "\"optimizer\":%.4f}}\n",
                  static_cast<long long>(s), dt, tokens / dt, r.loss, since(t0, t1), since(t1, t2),
                  since(t2, t3), since(t3, t4), since(t4, t5));
      std::fflush(stdout);
    }
  };
  for (int64_t s = 0; s < warmup; ++s) one_step(s, false);
  if (serve) {
    std::printf("{\"ready\":true}\n");
    std::fflush(stdout);
    std::string cmd;
    int64_t s = 0;
    while (std::getline(std::cin, cmd) && cmd == "step") one_step(s++, true);
  } else {
    for (int64_t s = 0; s < steps; ++s) one_step(s, true);
  }
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  const double med = sorted.empty() ? 0 : sorted[sorted.size() / 2];
  const auto& stats = titan::device_interface(titan::DeviceType::CPU).allocator->stats;
  std::string names;
  for (auto& [op, impl] : model.kernel_names()) names += (names.empty() ? "" : ",") + op + "=" + impl;
  std::printf(
      "{\"impl\":\"titan\",\"summary\":true,\"threads\":%d,\"params\":%lld,\"median_seconds\":%.6f,"
      "\"median_tokens_per_s\":%.2f,\"peak_alloc_gib\":%.3f,\"activation_gib\":%.3f,\"peak_rss_bytes\":%.0f,"
      "\"kernels\":\"%s\"}\n",
      omp_get_max_threads(), static_cast<long long>(model.num_params()), med, tokens / med,
      stats.peak.load() / double(1 << 30), model.activation_bytes() / double(1 << 30), peak_rss_bytes(),
      names.c_str());
  return 0;
}
