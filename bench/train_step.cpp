// One Qwen3 training step (forward + backward + clip + AdamW) timed in titan; prints one JSON line per
// measured step and a summary, in the same format as bench/pytorch_train_step.py.
//   bench_train_step [--flavor 0.6B | --preset 1.7B] [--hidden 1024 --layers 4 --heads 16 --kv-heads 8
//                     --head-dim 128 --intermediate 3072 --vocab 151936 --tied 1 --experts 0 --top-k 0
//                     --moe-intermediate 0] [--seq 512 --batch 1 --steps 5 --warmup 1 --ac 0 --bf16 0
//                     --bf16-activations 1 --op-times 0]
//                    [--device cpu|cuda[:i]] [--peak-tflops 989.4] [--init hf|tiled]
//                    [--serve 1] [--graph 1]
// --ac: 0 none, 1 every layer ("full"), N every N-th layer, op (selective by op: pointwise ops recomputed).
// --flavor 0.6B cuts the 0.6B shape to 4 layers (the CPU default); --preset NAME is the released shape of
// Qwen3Config::flavor(NAME) with all its layers. --device cuda: parameters, gradients, activations and the
// AdamW state live on the GPU; the gradient norm (sum_squares op) and AdamW (adamw op) run there too;
// seq defaults to 2048 and the peak for MFU to 989.4 TFLOP/s (H100/H200 dense bf16). --op-times 1 adds the
// device time of each op class (GEMMs, attention forward / backward, pointwise ops, embedding + loss; CUDA
// events around every op, kernels/op_timing.h; the host clock on the CPU) as "op_ms", to set beside
// `titan plan --gpu`'s prediction (the marks cost a little: time the step itself without them). Each phase
// ends with a device synchronization, so step and phase times are the GPU's. MFU = flops_per_token * tokens/s
// / peak with flops_per_token = Qwen3Config::training_flops_per_token(seq) (torchtitan's 6N +
// 12*L*heads*hd*seq, N = GEMM weights incl. lm_head); 0 when no peak is given (CPU default). AdamW and the
// gradient norm are titan's (optim/optimizer.h): their state and ops are on the parameters' device.
// --serve 1: after the warm-up print {"ready":true}, then run one measured step per "step" line read from
// stdin and print the summary at "quit" (bench/compare_pytorch.py interleaves frameworks step by step).
// The summary carries the process's peak resident set (VmHWM).
// --graph 1 (a device with graphs: CUDA): compile mode as the trainer runs it (src/train/train_compiled.cpp):
// after the warm-up the step (zero_grad, forward with the loss on the device, backward, the gradients' sum of
// squares, AdamW with the clip computed on the device) is captured once and launched on every measured step,
// after staging the batch and the learning rate. Each line then has "host_seconds", the host's time to
// stage and launch the step (the CPU cost per step that a graph removes), and no phases.
#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "device/device.h"
#include "kernels/op_timing.h"
#include "kernels/registry.h"
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

// A quick stand-in for init_weights on big shapes (init_weights draws every weight on one host thread,
// ~40 s at 1.7B): RMSNorm weights 1, every matrix a tiling of one block of 2^20 N(0, std) draws. The
// values are random-looking (a GPU's GEMM rate depends on the data), the step's work is the same.
void init_tiled(titan::Qwen3Model& model, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, static_cast<float>(model.config().initializer_range));
  std::vector<float> block(size_t(1) << 20);
  for (auto& x : block) x = normal(rng);
  int64_t largest = 0, largest_1d = 0;
  for (auto& p : model.params()) {
    int64_t& m = p.shape.size() == 1 ? largest_1d : largest;
    m = std::max(m, p.value.numel());
  }
  std::vector<float> host(static_cast<size_t>(largest)), ones(static_cast<size_t>(largest_1d), 1.0f);
  for (size_t i = 0; i < host.size(); i += block.size())
    std::memcpy(host.data() + i, block.data(), std::min(block.size(), host.size() - i) * sizeof(float));
  size_t shift = 0;  // a different phase of the block per tensor
  for (auto& p : model.params()) {
    const size_t start = (shift += 7919) % block.size();
    p.value.copy_from_host(p.shape.size() == 1
                               ? ones.data()
                               : host.data() + (start < host.size() - p.value.numel() ? start : 0));
  }
}

// "cpu", "cuda", "cuda:1".
titan::Device parse_device(const std::string& s) {
  titan::Device d;
  const std::string type = s.substr(0, s.find(':'));
  if (type == "cuda")
    d.type = titan::DeviceType::CUDA;
  else if (type != "cpu")
    titan::fail("--device '", s, "' is not cpu, cuda or cuda:N");
  if (s.find(':') != std::string::npos) d.index = std::atoi(s.c_str() + s.find(':') + 1);
  return d;
}
}  // namespace

int main(int argc, char** argv) try {
  std::string flavor = "0.6B", preset, device_name = "cpu";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--flavor") flavor = argv[i + 1];
    if (std::string(argv[i]) == "--preset") preset = argv[i + 1];
    if (std::string(argv[i]) == "--device") device_name = argv[i + 1];
  }
  const titan::Device device = parse_device(device_name);
  const bool on_gpu = device.type != titan::DeviceType::CPU;
  titan::Qwen3Config c = titan::Qwen3Config::flavor(preset.empty() ? flavor : preset);
  if (preset.empty() && flavor == "0.6B") c.num_hidden_layers = 4;
  int64_t seq = on_gpu ? 2048 : 512, batch = 1, steps = 5, warmup = 1, ac = 0, serve = 0, bf16 = 0,
          bf16_acts = 1, op_times = 0, head_chunk = 0, graph = 0;
  bool ac_ops = false;
  double peak_tflops = on_gpu ? 989.4 : 0.0;
  std::string init = on_gpu ? "tiled" : "hf";
  titan::KernelChoice kernels;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    int64_t v = std::atoll(argv[i + 1]);
    if (k == "--flavor" || k == "--preset" || k == "--device")
      continue;
    else if (k == "--init") {  // hf: Qwen3Model::init_weights (CPU default); tiled: init_tiled (GPU default)
      init = argv[i + 1];
      TITAN_CHECK(init == "hf" || init == "tiled", "--init '", init, "' is not hf or tiled");
    } else if (k == "--peak-tflops")
      peak_tflops = std::atof(argv[i + 1]);
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
    else if (k == "--ac")  // 0 none, 1 every layer (full), N every N-th layer, op (selective by op)
      ac_ops = std::strcmp(argv[i + 1], "op") == 0, ac = ac_ops ? 0 : v;
    else if (k == "--op-times")
      op_times = v;  // 1: device time per op class (kernels/op_timing.h) in every step's line and the summary
    else if (k == "--bf16")
      bf16 = v;  // 1: training.mixed_precision_param = "bfloat16"
    else if (k == "--bf16-activations")
      bf16_acts = v;  // 0: bf16 compute's GEMM-only tensors as f32 buffers (Qwen3Model::set_bf16_activations)
    else if (k == "--head-chunk")
      head_chunk = v;  // rows of the lm_head + cross-entropy chunk (0 = automatic)
    else if (k == "--serve")
      serve = v;
    else if (k == "--graph")
      graph = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (c.num_experts > 0) c.norm_topk_prob = true;
  auto& dev = titan::device_interface(device.type);
  if (on_gpu)
    TITAN_CHECK(dev.device_count && dev.device_count() > device.index, "--device ", device_name,
                ": no such GPU (", dev.device_count ? dev.device_count() : 0, " found)");
  auto sync = [&] {
    if (dev.synchronize) dev.synchronize();
  };
  if (graph && c.num_experts > 0)  // (as compile mode: the routed experts a graph can hold)
    for (const char* op : {"moe_experts", "moe_experts_bf16"}) kernels.emplace(op, "device_routed");
  titan::Qwen3Model model(c, kernels, nullptr, true, device);
  if (init == "tiled")
    init_tiled(model, 0);
  else
    model.init_weights(0);
  model.set_activation_checkpoint_every(ac);
  model.set_activation_recompute_ops(ac_ops);
  model.set_head_chunk_rows(head_chunk);
  if (bf16) model.set_bf16_compute(true);
  model.set_bf16_activations(bf16_acts != 0);
  std::optional<titan::OpTiming> timing;
  if (op_times) {
    timing.emplace(device.type);
    timing->make_current();
    model.time_ops();
  }
  constexpr int kClasses = static_cast<int>(titan::OpClass::kCount);
  std::vector<std::array<double, kClasses>> op_ms;  // per measured step
  auto op_json = [&](const std::array<double, kClasses>& ms) {
    std::string j = "{";
    for (int i = 0; i < kClasses; ++i)
      j += titan::str_cat(i ? "," : "", "\"", titan::op_class_name(static_cast<titan::OpClass>(i)),
                          "\":", ms[i]);
    return j + "}";
  };
  const titan::AdamWConfig adamw_cfg{1e-4f, 0.9f, 0.999f, 1e-8f, 0.01f};
  // titan's AdamW and grad_sq_norm as the trainer runs them (on the model's device).
  titan::AdamW optimizer(model.flat_params(), model.flat_grads(), adamw_cfg);
  const double flops_per_token = c.training_flops_per_token(seq);
  auto mfu = [&](double tokens_per_s) {
    return peak_tflops > 0 ? flops_per_token * tokens_per_s / (peak_tflops * 1e12) : 0.0;
  };
  std::mt19937 rng(0);
  std::vector<int32_t> ids(batch * seq);
  for (auto& x : ids) x = static_cast<int32_t>(rng() % c.vocab_size);
  std::vector<double> times;
  const double tokens = static_cast<double>(batch * seq);
  TITAN_CHECK(!graph || (dev.capture && !op_times), "--graph 1 needs a device with graphs (", device.str(),
              " has none) and no --op-times");
  // --graph: the captured step, the trainer's compile mode (one micro-batch, clip at max_norm 1).
  titan::ForwardOptions graph_fo;
  graph_fo.loss_on_device = graph_fo.inputs_staged = true;
  titan::Tensor sq_dev;
  void* step_graph = nullptr;
  auto graph_ops = [&] {
    model.zero_grad();
    model.forward(ids.data(), ids.data(), batch, seq, graph_fo);
    model.backward();
    titan::grad_sq_norm_device(model.flat_grads(), sq_dev.data<double>());
    optimizer.step_staged(sq_dev.data<double>(), 1.0f);
  };
  auto graph_step = [&](int64_t s, bool measured) {
    using clock = std::chrono::steady_clock;
    sync();
    const auto t0 = clock::now();
    model.stage_inputs(ids.data(), ids.data(), batch, seq, graph_fo);
    optimizer.stage_step(1e-4f);
    if (!sq_dev.defined()) sq_dev = titan::Tensor::zeros({1}, titan::DType::F64, device);
    if (step_graph) {
      dev.graph_launch(step_graph);
    } else {  // eagerly once (what the ops make on first use), then captured
      graph_ops();
      step_graph = dev.capture(graph_ops);
    }
    const auto t1 = clock::now();
    sync();
    const double loss = model.device_loss_sum() / static_cast<double>(batch * (seq - 1));  // (HF's shift)
    const auto t2 = clock::now();
    const double dt = std::chrono::duration<double>(t2 - t0).count();
    if (!measured) return;
    times.push_back(dt);
    std::printf(
        "{\"impl\":\"titan\",\"step\":%lld,\"seconds\":%.6f,\"tokens_per_s\":%.2f,\"mfu\":%.4f,"
        "\"loss\":%.6f,\"host_seconds\":%.6f}\n",
        static_cast<long long>(s), dt, tokens / dt, mfu(tokens / dt), loss,
        std::chrono::duration<double>(t1 - t0).count());
    std::fflush(stdout);
  };
  auto one_step = [&](int64_t s, bool measured) {
    if (graph) return graph_step(s, measured);
    using clock = std::chrono::steady_clock;
    auto since = [](clock::time_point a, clock::time_point b) {
      return std::chrono::duration<double>(b - a).count();
    };
    sync();
    auto t0 = clock::now();
    model.zero_grad();
    sync();
    auto t1 = clock::now();
    auto r = model.forward(ids.data(), ids.data(), batch, seq);
    sync();
    auto t2 = clock::now();
    model.backward();
    sync();
    auto t3 = clock::now();
    const double sq = titan::grad_sq_norm(model.flat_grads());
    const float coef =
        titan::clip_coefficient(std::sqrt(sq), 1.0);  // clip_grad_norm_(max_norm=1) fused into AdamW
    auto t4 = clock::now();
    optimizer.step(1e-4f, coef);
    sync();
    auto t5 = clock::now();
    double dt = since(t0, t5);
    std::string ops;
    if (timing) {
      const auto ms = timing->collect();
      if (measured) op_ms.push_back(ms);
      ops = ",\"op_ms\":" + op_json(ms);
    }
    if (measured) {
      times.push_back(dt);
      std::printf(
          "{\"impl\":\"titan\",\"step\":%lld,\"seconds\":%.6f,\"tokens_per_s\":%.2f,\"mfu\":%.4f,"
          "\"loss\":%.6f,\"phases\":{\"zero_grad\":%.4f,\"forward\":%.4f,\"backward\":%.4f,"
          "\"clip\":%.4f,\"optimizer\":%.4f}%s}\n",
          static_cast<long long>(s), dt, tokens / dt, mfu(tokens / dt), r.loss, since(t0, t1), since(t1, t2),
          since(t2, t3), since(t3, t4), since(t4, t5), ops.c_str());
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
  // Peak bytes allocated on the model's device (the GPU's memory under --device cuda).
  const auto& stats = dev.allocator->stats;
  std::string names;
  for (auto& [op, impl] : model.kernel_names()) names += (names.empty() ? "" : ",") + op + "=" + impl;
  std::string ops;  // the op classes of the median step
  if (!op_ms.empty()) {
    const size_t at = std::find(times.begin(), times.end(), med) - times.begin();
    ops = ",\"op_ms\":" + op_json(op_ms[std::min(at, op_ms.size() - 1)]);
  }
  std::printf(
      "{\"impl\":\"titan\",\"summary\":true,\"device\":\"%s\",\"bf16\":%s,\"threads\":%d,\"params\":%lld,"
      "\"steps\":%zu,\"tokens_per_step\":%.0f,\"median_seconds\":%.6f,\"median_tokens_per_s\":%.2f,"
      "\"flops_per_token\":%.0f,\"peak_tflops\":%.2f,\"median_mfu\":%.4f,\"peak_alloc_gib\":%.3f,"
      "\"peak_alloc_bytes\":%lld,\"activation_gib\":%.3f,\"peak_rss_bytes\":%.0f,\"kernels\":\"%s\"%s}\n",
      device.str().c_str(), bf16 ? "true" : "false", omp_get_max_threads(),
      static_cast<long long>(model.num_params()), times.size(), tokens, med, med > 0 ? tokens / med : 0.0,
      flops_per_token, peak_tflops, med > 0 ? mfu(tokens / med) : 0.0, stats.peak.load() / double(1 << 30),
      static_cast<long long>(stats.peak.load()), model.activation_bytes() / double(1 << 30), peak_rss_bytes(),
      names.c_str(), ops.c_str());
  if (step_graph) dev.graph_release(step_graph);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_train_step: %s\n", e.what());
  return 1;
}
