// Qwen3 model configuration: read from an HF config.json or taken from the flavor registry.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace titan {

struct Qwen3Config {
  int64_t vocab_size = 151936;
  int64_t hidden_size = 1024;
  int64_t intermediate_size = 3072;
  int64_t num_hidden_layers = 28;
  int64_t num_attention_heads = 16;
  int64_t num_key_value_heads = 8;
  int64_t head_dim = 128;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1e6;
  bool tie_word_embeddings = true;
  int64_t max_position_embeddings = 40960;
  double initializer_range = 0.02;
  int64_t bos_token_id = 151643;
  int64_t eos_token_id = 151645;

  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  int64_t qkv_dim() const { return q_dim() + 2 * kv_dim(); }
  int64_t params_per_layer() const;
  int64_t num_params() const;  // unique parameters (tied lm_head counted once)
  // Matmul FLOPs per token of a training step (6 * params of the GEMMs + attention), torchtitan-style.
  double training_flops_per_token(int64_t seq_len) const;

  // Parses an HF config.json; `path` is used in error messages. Throws on missing/invalid fields.
  static Qwen3Config from_hf_json(const nlohmann::json& j, const std::string& path);
  static Qwen3Config from_hf_file(const std::string& config_json_path);
  // HF config.json content (model_type qwen3, architectures Qwen3ForCausalLM), torch_dtype as given.
  nlohmann::ordered_json to_hf_json(const std::string& torch_dtype = "float32") const;
  void validate(const std::string& where) const;

  // Flavor registry: debug, 0.6B, 1.7B, 4B, 8B, 14B, 32B.
  static Qwen3Config flavor(const std::string& name);
  static std::vector<std::string> flavor_names();
};

}  // namespace titan
