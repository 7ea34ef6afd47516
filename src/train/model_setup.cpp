#include "train/model_setup.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "core/error.h"
#include "device/device.h"
#include "kernels/registry.h"

namespace titan {

namespace fs = std::filesystem;

Qwen3Config resolve_model_config(const TrainConfig& cfg) {
  Qwen3Config c;
  const std::string hf_config = cfg.model.hf_assets_path + "/config.json";
  if (!cfg.model.hf_assets_path.empty() && fs::exists(hf_config)) {
    c = Qwen3Config::from_hf_file(hf_config);
  } else {
    if (!cfg.model.hf_assets_path.empty())
      std::printf("note: %s not present; planning with flavor '%s'\n", hf_config.c_str(),
                  cfg.model.flavor.c_str());
    c = Qwen3Config::flavor(cfg.model.flavor);
  }
  if (cfg.model.vocab_size > 0) c.vocab_size = cfg.model.vocab_size;
  if (cfg.model.num_hidden_layers > 0) c.num_hidden_layers = cfg.model.num_hidden_layers;
  if (cfg.model.moe_aux_loss != "auto") c.output_router_logits = cfg.model.moe_aux_loss == "on";
  if (cfg.model.load_balance_coeff >= 0) c.load_balance_coeff = cfg.model.load_balance_coeff;
  c.validate("model");
  return c;
}

void validate_kernel_choice(const std::map<std::string, std::string>& kernels, DeviceType device) {
  for (auto& [op, impl] : kernels) {
    auto ops = KernelRegistry::global().ops();
    std::string valid_ops;
    for (auto& o : ops) valid_ops += (valid_ops.empty() ? "" : ", ") + o;
    TITAN_CHECK(std::find(ops.begin(), ops.end(), op) != ops.end(), "kernels.", op,
                ": unknown op (valid: ", valid_ops, ")");
    auto impls = KernelRegistry::global().impls(op, device);
    std::string valid;
    for (auto& i : impls) valid += (valid.empty() ? "" : ", ") + i;
    TITAN_CHECK(std::find(impls.begin(), impls.end(), impl) != impls.end(), "kernels.", op, " = '", impl,
                "': no such implementation on ", device_type_name(device), " (valid: ", valid, ")");
    const std::string why = KernelRegistry::global().why_not_runnable(op, device, impl);
    TITAN_CHECK(why.empty(), "kernels.", op, " = '", impl, "': cannot run on this CPU: ", why,
                " (default here: ", KernelRegistry::global().default_impl(op, device), ")");
  }
}

std::map<std::string, std::string> kernels_for_device(const std::map<std::string, std::string>& kernels,
                                                      DeviceType device, std::string* notes) {
  if (device == DeviceType::CPU) return kernels;
  auto& reg = KernelRegistry::global();
  auto has = [&](const std::string& op, const std::string& impl, DeviceType d) {
    auto v = reg.impls(op, d);
    return std::find(v.begin(), v.end(), impl) != v.end();
  };
  std::map<std::string, std::string> out;
  for (auto& [op, impl] : kernels) {
    // rope names either a rope or a rope_qk implementation (Qwen3Model's choice).
    const bool here = has(op, impl, device) || (op == "rope" && has("rope_qk", impl, device));
    const bool cpu =
        has(op, impl, DeviceType::CPU) || (op == "rope" && has("rope_qk", impl, DeviceType::CPU));
    if (!here && cpu) {
      if (notes)
        *notes += str_cat("kernels.", op, " = '", impl, "' is a cpu implementation; ",
                          device_type_name(device), " uses its default\n");
      continue;
    }
    out[op] = impl;
  }
  return out;
}

}  // namespace titan
