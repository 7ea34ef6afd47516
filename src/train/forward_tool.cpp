#include "train/forward_tool.h"

#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/json_file.h"
#include "io/safetensors.h"
#include "models/qwen3/lora.h"
#include "optim/optimizer.h"

namespace titan {

namespace {
std::vector<int32_t> read_matrix(const nlohmann::json& j, const char* field, const std::string& path,
                                 int64_t& B, int64_t& T) {
  TITAN_CHECK(j.contains(field), path, ": missing field '", field, "'");
  const auto& rows = j[field];
  TITAN_CHECK(rows.is_array() && !rows.empty(), path, ": '", field, "' must be a non-empty array of arrays");
  std::vector<int32_t> out;
  B = static_cast<int64_t>(rows.size());
  T = -1;
  for (size_t b = 0; b < rows.size(); ++b) {
    TITAN_CHECK(rows[b].is_array(), path, ": ", field, "[", b, "] is not an array");
    if (T < 0) T = static_cast<int64_t>(rows[b].size());
    TITAN_CHECK(static_cast<int64_t>(rows[b].size()) == T && T > 0, path, ": ", field, "[", b, "] has ",
                rows[b].size(), " tokens; every row needs the same non-zero length (", T, ")");
    for (size_t t = 0; t < rows[b].size(); ++t) {
      TITAN_CHECK(rows[b][t].is_number_integer(), path, ": ", field, "[", b, "][", t, "] is not an integer");
      int64_t v = rows[b][t].get<int64_t>();
      TITAN_CHECK(v >= INT32_MIN && v <= INT32_MAX, path, ": ", field, "[", b, "][", t, "] out of range");
      out.push_back(static_cast<int32_t>(v));
    }
  }
  return out;
}
}  // namespace

TokenBatch read_token_batch_json(const std::string& path) {
  const nlohmann::json j = read_json_file(path);
  TITAN_CHECK(j.is_object(), path, ": expected an object with 'input_ids' (and optional 'labels')");
  TokenBatch batch;
  batch.input_ids = read_matrix(j, "input_ids", path, batch.B, batch.T);
  if (j.contains("labels") && !j["labels"].is_null()) {
    int64_t B, T;
    batch.labels = read_matrix(j, "labels", path, B, T);
    TITAN_CHECK(B == batch.B && T == batch.T, path, ": 'labels' is ", B, "x", T, " but 'input_ids' is ",
                batch.B, "x", batch.T);
  } else {
    batch.labels = batch.input_ids;
  }
  return batch;
}

void run_forward_tool(const ForwardToolOptions& opts) {
  TITAN_CHECK(!opts.model_dir.empty(), "--model is required");
  TITAN_CHECK(!opts.input_path.empty(), "--input is required");
  TITAN_CHECK(!opts.output_path.empty(), "--output is required");
  TITAN_CHECK(opts.steps >= 0, "--steps must be >= 0");
  const TokenBatch batch = read_token_batch_json(opts.input_path);
  const Qwen3Config config = Qwen3Config::from_hf_file(opts.model_dir + "/config.json");
  const bool bf16_base = !opts.lora_dir.empty() && opts.lora_bf16_base;
  if (opts.device.type != DeviceType::CPU) device_interface(opts.device.type).set_current(opts.device.index);
  Qwen3Model model(config, opts.kernels, nullptr, /*allocate=*/!bf16_base, opts.device);
  std::unique_ptr<FrozenBf16Base> frozen;
  std::unique_ptr<LoraAdapters> lora;
  if (!opts.lora_dir.empty()) {
    lora = std::make_unique<LoraAdapters>(
        config, LoraConfig::from_peft_file(opts.lora_dir + "/adapter_config.json"), opts.device);
    lora->load_peft(opts.lora_dir);
    model.set_lora(lora.get());
  }
  if (bf16_base)
    frozen = std::make_unique<FrozenBf16Base>(model, opts.model_dir);
  else
    model.load_hf(opts.model_dir);
  if (opts.dtype == DType::BF16) model.set_bf16_compute(true);
  // Trainable parameters: the adapters under LoRA, else the model's.
  std::vector<Param>& trainable = lora ? lora->params() : model.params();
  std::vector<Tensor>& train_params = lora ? lora->flat_params() : model.flat_params();
  std::vector<Tensor>& train_grads = lora ? lora->flat_grads() : model.flat_grads();

  NamedTensors out;
  model.zero_grad();
  ForwardOptions fo;
  fo.keep_logits = true;
  fo.compute_grad = opts.grads || opts.steps > 0;
  ForwardResult r = model.forward(batch.input_ids.data(), batch.labels.data(), batch.B, batch.T, fo);
  // Outputs are host copies (clones on the cpu: later steps overwrite the model's buffers).
  auto host = [](const Tensor& t) { return t.clone().to(Device::cpu()); };
  out.emplace_back("logits", host(model.logits()));
  out.emplace_back("loss", Tensor::from_vector({static_cast<float>(r.loss)}, {}));
  // MoE: HF load_balancing_loss_func value (added to `loss` times router_aux_loss_coef when the config has
  // output_router_logits).
  if (model.config().is_moe())
    out.emplace_back("aux_loss", Tensor::from_vector({static_cast<float>(r.aux_loss)}, {}));
  if (fo.compute_grad) model.backward();
  if (opts.grads)
    for (auto& p : trainable) out.emplace_back("grad." + p.name, host(p.grad));

  if (opts.steps > 0) {
    AdamWConfig ac{opts.lr, opts.beta1, opts.beta2, opts.eps, opts.weight_decay};
    AdamW optimizer(train_params, train_grads, ac,
                    opts.kernels.count("adamw") ? opts.kernels.at("adamw") : "");
    std::vector<float> losses;
    for (int64_t k = 0; k < opts.steps; ++k) {
      if (k > 0) {  // step 0 reuses the forward/backward above
        model.zero_grad();
        ForwardOptions so;
        r = model.forward(batch.input_ids.data(), batch.labels.data(), batch.B, batch.T, so);
        model.backward();
      }
      losses.push_back(static_cast<float>(r.loss));
      clip_grad_norm(train_grads, opts.max_norm);
      optimizer.step(opts.lr);
    }
    out.emplace_back("losses", Tensor::from_vector(losses, {opts.steps}));
    for (auto& p : trainable) out.emplace_back("param." + p.name, host(p.value));
  }
  save_safetensors(opts.output_path, out, {{"format", "pt"}});
}

}  // namespace titan
