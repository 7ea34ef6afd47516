// LoRA adapters in HF PEFT's format (adapter_config.json + adapter_model.safetensors), and merging an
// adapter into a model's base weights.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include "core/error.h"
#include "io/json_file.h"
#include "models/qwen3/lora.h"

namespace titan {

namespace fs = std::filesystem;

nlohmann::ordered_json LoraConfig::to_peft_json(const std::string& base_model) const {
  nlohmann::ordered_json j;
  j["alpha_pattern"] = nlohmann::json::object();
  j["auto_mapping"] = nullptr;
  j["base_model_name_or_path"] =
      base_model.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(base_model);
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["layers_pattern"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["lora_alpha"] = alpha;
  j["lora_dropout"] = dropout;
  j["modules_to_save"] = nullptr;
  j["peft_type"] = "LORA";
  j["r"] = rank;
  j["rank_pattern"] = nlohmann::json::object();
  j["revision"] = nullptr;
  j["target_modules"] = target_modules;
  j["task_type"] = "CAUSAL_LM";
  j["use_dora"] = false;
  j["use_rslora"] = false;
  return j;
}

LoraConfig LoraConfig::from_peft_file(const std::string& path) {
  const nlohmann::json j = read_json_file(path);
  TITAN_CHECK(j.is_object(), path, ": expected a JSON object");
  auto get = [&](const char* key) -> const nlohmann::json& {
    TITAN_CHECK(j.contains(key), path, ": missing field '", key, "'");
    return j[key];
  };
  TITAN_CHECK(get("peft_type") == "LORA", path, ": peft_type is ", get("peft_type").dump(),
              ", expected \"LORA\"");
  LoraConfig c;
  c.enable = true;
  TITAN_CHECK(get("r").is_number_integer(), path, ": field 'r' must be an integer");
  c.rank = get("r").get<int64_t>();
  TITAN_CHECK(get("lora_alpha").is_number(), path, ": field 'lora_alpha' must be a number");
  c.alpha = get("lora_alpha").get<double>();
  if (j.contains("lora_dropout") && j["lora_dropout"].is_number())
    c.dropout = j["lora_dropout"].get<double>();
  const auto& tm = get("target_modules");
  if (tm.is_string()) {
    // PEFT reads a string as a regex over module names, except "all-linear".
    TITAN_CHECK(tm == "all-linear", path, ": field 'target_modules' is the regex ", tm.dump(),
                "; only a list of module names or \"all-linear\" is supported");
    c.target_modules = {"all-linear"};
  } else {
    TITAN_CHECK(tm.is_array(), path, ": field 'target_modules' must be a list of module names");
    c.target_modules.clear();
    for (auto& t : tm) {
      TITAN_CHECK(t.is_string(), path, ": field 'target_modules' must hold strings");
      c.target_modules.push_back(t.get<std::string>());
    }
  }
  // Variants this implementation does not compute: refuse rather than load something different.
  auto must_be = [&](const char* key, const nlohmann::json& want) {
    if (!j.contains(key) || j[key].is_null()) return;
    TITAN_CHECK(j[key] == want, path, ": field '", key, "' = ", j[key].dump(), " is not supported (expected ",
                want.dump(), ")");
  };
  must_be("use_rslora", false);
  must_be("use_dora", false);
  must_be("fan_in_fan_out", false);
  must_be("bias", "none");
  must_be("lora_bias", false);
  for (const char* key : {"rank_pattern", "alpha_pattern"})
    if (j.contains(key) && !j[key].is_null())
      TITAN_CHECK(j[key].empty(), path, ": field '", key, "' (per-module ranks/alphas) is not supported");
  for (const char* key : {"layers_to_transform", "modules_to_save", "target_parameters", "layer_replication"})
    if (j.contains(key) && !j[key].is_null())
      TITAN_CHECK(j[key].empty(), path, ": field '", key, "' is not supported",
                  std::string(key) == "target_parameters" ? " (LoRA on MoE experts)" : "");
  c.validate(path);
  return c;
}

void LoraAdapters::save_peft(const std::string& dir, const std::string& base_model) const {
  fs::create_directories(dir);
  // Name the projections that actually carry adapters (on MoE models the MLP targets do not apply).
  LoraConfig written = cfg_;
  written.target_modules.clear();
  for (int pi = 0; pi < kLoraProjs; ++pi)
    for (auto& s : slots_)
      if (static_cast<int>(s.proj) == pi) {
        written.target_modules.push_back(lora_proj_name(s.proj));
        break;
      }
  NamedTensors tensors;
  for (auto& p : params_) tensors.emplace_back(p.name, p.value.to(Device::cpu()));
  const std::string st = dir + "/adapter_model.safetensors", cfg = dir + "/adapter_config.json";
  save_safetensors(st + ".tmp", tensors, {{"format", "pt"}});
  {
    std::ofstream f(cfg + ".tmp");
    f << written.to_peft_json(base_model).dump(2) << "\n";
    TITAN_CHECK(f.good(), cfg, ": write failed");
  }
  fs::rename(st + ".tmp", st);
  fs::rename(cfg + ".tmp", cfg);
}

void LoraAdapters::load_peft(const std::string& dir) {
  const std::string cfg_path = dir + "/adapter_config.json", st_path = dir + "/adapter_model.safetensors";
  const LoraConfig file = LoraConfig::from_peft_file(cfg_path);
  TITAN_CHECK(file.rank == cfg_.rank, cfg_path, ": r = ", file.rank, ", these adapters have rank ",
              cfg_.rank);
  TITAN_CHECK(std::abs(file.alpha - cfg_.alpha) <= 1e-12 * std::abs(cfg_.alpha), cfg_path,
              ": lora_alpha = ", file.alpha, ", these adapters have ", cfg_.alpha);
  SafetensorsFile st(st_path);
  std::set<std::string> mine;
  for (auto& p : params_) {
    mine.insert(p.name);
    TITAN_CHECK(st.contains(p.name), st_path, ": missing tensor '", p.name, "' (target_modules in ", cfg_path,
                " do not match the model, or the adapter was made for a model with fewer layers)");
    const SafetensorsEntry& e = st.entry(p.name);
    TITAN_CHECK(e.shape == p.shape, st_path, ": tensor '", p.name, "' has shape ", shape_str(e.shape),
                ", this model expects ", shape_str(p.shape),
                " (the adapter was made for another base model: hidden/intermediate/head sizes differ)");
    Tensor t = st.load(p.name);
    TITAN_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16, st_path, ": tensor '", p.name,
                "' has an unsupported dtype");
    p.value.copy_from(t);
  }
  for (auto& [key, _] : st.entries())
    TITAN_CHECK(mine.count(key), st_path, ": unexpected tensor '", key,
                "' (the adapter was made for another base model or adapts modules this model has none of)");
}

void merge_lora_into(Qwen3Model& model, const std::string& adapter_dir) {
  TITAN_CHECK(!model.param_streamer(),
              "merge_lora_into: the model's parameters are streamed; merge needs them");
  TITAN_CHECK(model.device().type == DeviceType::CPU, "merge_lora_into: merges a model in host memory (got ",
              model.device().str(), ")");
  LoraConfig cfg = LoraConfig::from_peft_file(adapter_dir + "/adapter_config.json");
  LoraAdapters lora(model.config(), cfg);
  lora.load_peft(adapter_dir);
  const double scale = cfg.scale();
  // W (out,in) += scale * B (out,r) A (r,in), accumulated in double per element.
  const auto& ps = lora.params();
  for (size_t i = 0; i + 1 < ps.size(); i += 2) {
    const Param& A = ps[i];
    const Param& B = ps[i + 1];
    const std::string prefix = "base_model.model.";
    std::string name = A.name.substr(prefix.size());
    name = name.substr(0, name.size() - std::string(".lora_A.weight").size()) + ".weight";
    Param& W = model.param(name);
    const int64_t out = B.shape[0], r = A.shape[0], in = A.shape[1];
    TITAN_CHECK(W.shape == Shape({out, in}), adapter_dir, ": ", A.name, " / ", B.name, " adapt ", name,
                " as ", out, "x", in, " but the model's is ", shape_str(W.shape));
    const float* a = A.value.f32();
    const float* b = B.value.f32();
    float* w = W.value.f32();
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t c = 0; c < in; ++c) {
        double acc = 0;
        for (int64_t k = 0; k < r; ++k) acc += (double)b[o * r + k] * a[k * in + c];
        w[o * in + c] = static_cast<float>(w[o * in + c] + scale * acc);
      }
  }
}

}  // namespace titan
