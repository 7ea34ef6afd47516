#include "generate/generator.h"

#include <filesystem>
#include <set>

#include "core/error.h"
#include "io/hf_checkpoint.h"
#include "io/json_file.h"
#include "models/qwen3/lora.h"
#include "train/model_setup.h"

namespace titan {

namespace fs = std::filesystem;

std::vector<int32_t> generate(KVCacheModel& kv, std::span<const int32_t> prompt, const GenerateOptions& opts,
                              const std::function<void(int32_t)>& on_token) {
  TITAN_CHECK(!prompt.empty(), "generate: empty prompt");
  TITAN_CHECK(opts.max_new_tokens >= 0, "max_new_tokens must be >= 0, got ", opts.max_new_tokens);
  const int64_t need =
      kv.pos() + static_cast<int64_t>(prompt.size()) + std::max<int64_t>(opts.max_new_tokens - 1, 0);
  TITAN_CHECK(need <= kv.capacity(), "generate: ", kv.pos(), " cached + ", prompt.size(), " prompt + ",
              opts.max_new_tokens, " new tokens exceed the context of ", kv.capacity(), " positions");
  Sampler sampler(opts.sampling);
  std::vector<int32_t> out;
  if (opts.max_new_tokens == 0) return out;
  const int64_t V = kv.vocab_size();
  const float* logits = kv.forward(prompt.data(), static_cast<int64_t>(prompt.size()));
  for (;;) {
    const int32_t id = sampler.next(logits, V);
    out.push_back(id);
    if (on_token) on_token(id);
    const bool eos = std::find(opts.eos_ids.begin(), opts.eos_ids.end(), id) != opts.eos_ids.end();
    if (eos || static_cast<int64_t>(out.size()) >= opts.max_new_tokens) break;
    logits = kv.forward(&id, 1);
  }
  return out;
}

namespace {
void read_ids(const nlohmann::json& j, const std::string& where, std::vector<int32_t>& out) {
  if (j.is_number_integer()) {
    out = {j.get<int32_t>()};
  } else if (j.is_array()) {
    out.clear();
    for (const auto& x : j) {
      TITAN_CHECK(x.is_number_integer(), where, ": eos_token_id entries must be integers");
      out.push_back(x.get<int32_t>());
    }
  } else {
    TITAN_CHECK(j.is_null(), where, ": eos_token_id must be an integer or a list of integers");
  }
}
}  // namespace

GenerationDefaults read_generation_defaults(const std::string& model_dir) {
  GenerationDefaults d;
  const std::string cfg = (fs::path(model_dir) / "config.json").string();
  const std::string gen = (fs::path(model_dir) / "generation_config.json").string();
  if (fs::exists(cfg)) {
    const auto j = read_json_file(cfg);
    if (j.contains("eos_token_id")) read_ids(j["eos_token_id"], cfg, d.eos_ids);
  }
  if (fs::exists(gen)) {
    const auto j = read_json_file(gen);
    try {
      if (j.contains("eos_token_id")) read_ids(j["eos_token_id"], gen, d.eos_ids);
      if (j.contains("do_sample")) d.sampling.do_sample = j["do_sample"].get<bool>();
      if (j.contains("temperature") && !j["temperature"].is_null())
        d.sampling.temperature = j["temperature"].get<double>();
      if (j.contains("top_k") && !j["top_k"].is_null()) d.sampling.top_k = j["top_k"].get<int64_t>();
      if (j.contains("top_p") && !j["top_p"].is_null()) d.sampling.top_p = j["top_p"].get<double>();
    } catch (const nlohmann::json::exception& e) {
      fail(gen, ": ", e.what());
    }
  }
  return d;
}

std::unique_ptr<Qwen3Model> load_model_dir(const std::string& dir, bool bf16, const KernelChoice& kernels,
                                           const std::string& lora_dir, Device device) {
  TITAN_CHECK(!dir.empty(), "--model is required");
  TITAN_CHECK(fs::is_directory(dir), "model directory '", dir, "' does not exist");
  const std::string cfg = (fs::path(dir) / "config.json").string();
  TITAN_CHECK(fs::exists(cfg), dir, ": no config.json (not an HF model directory)");
  const Qwen3Config config = Qwen3Config::from_hf_file(cfg);
  if (device.type != DeviceType::CPU) device_interface(device.type).set_current(device.index);
  const KernelChoice chosen = kernels_for_device(kernels, device.type);
  if (bf16 && device.type == DeviceType::CPU) {
    // The weights held once, as bf16 (2 bytes a parameter): read tensor by tensor from a per-tensor
    // checkpoint; a fused-expert checkpoint or a merged adapter goes through an f32 model first.
    auto model = std::make_unique<Qwen3Model>(config, chosen, nullptr, /*allocate=*/false, device);
    bool per_tensor = lora_dir.empty();
    if (per_tensor) {  // exactly the model's tensors (else load_hf below says what does not match)
      const HFCheckpointReader ckpt(dir);
      std::set<std::string> names;
      for (const auto& p : model->params())
        names.insert(p.name), per_tensor = per_tensor && ckpt.contains(p.name);
      for (const auto& key : ckpt.keys())
        per_tensor = per_tensor && (names.count(key) || Qwen3Model::hf_key_without_parameter(config, key));
    }
    std::unique_ptr<FrozenBf16Base> weights;
    if (per_tensor) {
      weights = std::make_unique<FrozenBf16Base>(*model, dir);
    } else {
      Qwen3Model host(config);
      host.load_hf(dir);
      if (!lora_dir.empty()) apply_lora_dir(host, lora_dir);
      weights = std::make_unique<FrozenBf16Base>(*model, host);
    }
    model->own_param_streamer(std::move(weights));
    model->set_bf16_compute(true);
    return model;
  }
  auto model = std::make_unique<Qwen3Model>(config, chosen, nullptr, /*allocate=*/false, device);
  model->allocate_inference_params();
  if (lora_dir.empty() || device.type == DeviceType::CPU) {
    model->load_hf(dir);
    if (!lora_dir.empty()) apply_lora_dir(*model, lora_dir);
  } else {  // the adapter is merged in host memory, then the weights go to the device
    Qwen3Model host(config);
    host.load_hf(dir);
    apply_lora_dir(host, lora_dir);
    model->load_state_dict(host.state_dict());
  }
  if (bf16) model->set_bf16_compute(true);
  return model;
}

std::string TextStreamer::put(int32_t id) {
  ids_.push_back(id);
  const std::string text = tok_.decode(ids_, skip_special_);
  // An incomplete UTF-8 sequence at the end decodes to U+FFFD: wait for the token that completes it.
  static const std::string kReplacement = "\xEF\xBF\xBD";
  if (text.size() >= 3 && text.compare(text.size() - 3, 3, kReplacement) == 0) return "";
  // Everything decoded is whole: start afresh (byte-level decoding is concatenative), keeping the decode
  // cost per token constant.
  ids_.clear();
  return text;
}

std::string TextStreamer::finish() {
  std::string rest = ids_.empty() ? "" : tok_.decode(ids_, skip_special_);
  ids_.clear();
  return rest;
}

}  // namespace titan
