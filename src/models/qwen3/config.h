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

  // Mixture of experts (HF Qwen3MoeConfig, model_type qwen3_moe). num_experts == 0: dense Qwen3.
  // Layer l is sparse when l is not in mlp_only_layers and (l + 1) % decoder_sparse_step == 0; the other
  // layers of a MoE model use a dense SwiGLU MLP of intermediate_size.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;  // HF default false; every released MoE config sets true
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  bool output_router_logits = false;  // HF: add router_aux_loss_coef * aux_loss to the loss
  double router_aux_loss_coef = 0.001;
  // torchtitan aux-loss-free balancing (arXiv 2408.15664): a per-expert bias added to the routing scores for
  // top-k selection only, moved by this step size in Qwen3Model::update_expert_bias(). 0 = off. Not an HF
  // field (training option; never written to config.json).
  double load_balance_coeff = 0.0;

  bool is_moe() const { return num_experts > 0; }
  bool is_moe_layer(int64_t layer) const;
  int64_t num_moe_layers() const;

  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  int64_t qkv_dim() const { return q_dim() + 2 * kv_dim(); }
  int64_t params_per_layer() const;                     // a dense layer
  int64_t params_of_layer(int64_t layer) const;         // every expert counted
  int64_t active_params_of_layer(int64_t layer) const;  // router + top-k experts per token
  int64_t num_params() const;  // unique parameters (tied lm_head counted once), all experts
  int64_t num_active_params()
      const;  // parameters a token touches (MoE: top-k experts); = num_params if dense
  // Matmul FLOPs per token of a training step (6 * active GEMM params + attention), torchtitan-style.
  double training_flops_per_token(int64_t seq_len) const;

  // Parses an HF config.json; `path` is used in error messages. Throws on missing/invalid fields.
  static Qwen3Config from_hf_json(const nlohmann::json& j, const std::string& path);
  static Qwen3Config from_hf_file(const std::string& config_json_path);
  // HF config.json content, torch_dtype as given: model_type qwen3 / Qwen3ForCausalLM, or qwen3_moe /
  // Qwen3MoeForCausalLM with the MoE fields when num_experts > 0.
  nlohmann::ordered_json to_hf_json(const std::string& torch_dtype = "float32") const;
  void validate(const std::string& where) const;

  // Flavor registry: debug, 0.6B, 1.7B, 4B, 8B, 14B, 32B; MoE: debug_moe, 30B-A3B, 235B-A22B (released HF
  // shapes) and 30B-A3B-64e-top4-4l (the 30B-A3B layer cut to 64 experts, top-4, 4 layers).
  static Qwen3Config flavor(const std::string& name);
  static std::vector<std::string> flavor_names();
};

}  // namespace titan
