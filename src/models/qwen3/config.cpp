#include "models/qwen3/config.h"

#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "io/json_file.h"

namespace titan {

int64_t Qwen3Config::params_per_layer() const {
  const int64_t H = hidden_size;
  return H * qkv_dim() + q_dim() * H + 2 * head_dim + 2 * H + 3 * H * intermediate_size;
}

bool Qwen3Config::is_moe_layer(int64_t layer) const {
  if (num_experts <= 0) return false;
  for (int64_t l : mlp_only_layers)
    if (l == layer) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

int64_t Qwen3Config::num_moe_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_hidden_layers; ++l) n += is_moe_layer(l);
  return n;
}

int64_t Qwen3Config::params_of_layer(int64_t layer) const {
  if (!is_moe_layer(layer)) return params_per_layer();
  const int64_t H = hidden_size;
  return params_per_layer() - 3 * H * intermediate_size + num_experts * H +
         num_experts * 3 * H * moe_intermediate_size;
}

int64_t Qwen3Config::active_params_of_layer(int64_t layer) const {
  if (!is_moe_layer(layer)) return params_per_layer();
  return params_of_layer(layer) -
         (num_experts - num_experts_per_tok) * 3 * hidden_size * moe_intermediate_size;
}

int64_t Qwen3Config::num_params() const {
  int64_t n = vocab_size * hidden_size * (tie_word_embeddings ? 1 : 2) + hidden_size;
  for (int64_t l = 0; l < num_hidden_layers; ++l) n += params_of_layer(l);
  return n;
}

int64_t Qwen3Config::num_active_params() const {
  int64_t n = vocab_size * hidden_size * (tie_word_embeddings ? 1 : 2) + hidden_size;
  for (int64_t l = 0; l < num_hidden_layers; ++l) n += active_params_of_layer(l);
  return n;
}

double Qwen3Config::training_flops_per_token(int64_t seq_len) const {
  // 6 FLOPs per GEMM weight a token uses (forward 2, backward 4) incl. lm_head and, for MoE layers, the
  // router and the top-k experts; attention scores and values: 12 * layers * heads * head_dim * seq
  // (torchtitan's get_dense_model_nparams_and_flops / get_moe_model_nparams_and_flops convention).
  const double H = (double)hidden_size;
  double gemm_params = (double)vocab_size * H;
  for (int64_t l = 0; l < num_hidden_layers; ++l) {
    gemm_params += H * qkv_dim() + q_dim() * H;
    gemm_params += is_moe_layer(l) ? H * num_experts + num_experts_per_tok * 3.0 * H * moe_intermediate_size
                                   : 3.0 * H * intermediate_size;
  }
  return 6.0 * gemm_params + 12.0 * num_hidden_layers * num_attention_heads * head_dim * (double)seq_len;
}

namespace {

// j[key] as a T, strictly: integers are JSON integers (or floats with an integral value, as some
// exporters write them) within int64; nothing is truncated or wrapped.
template <class T>
bool convert(const nlohmann::json& v, T& out) {
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) return false;
    out = v.get<bool>();
  } else if constexpr (std::is_same_v<T, int64_t>) {
    if (v.is_number_unsigned()) {
      if (v.get<uint64_t>() > uint64_t(INT64_MAX)) return false;
      out = static_cast<int64_t>(v.get<uint64_t>());
    } else if (v.is_number_integer()) {
      out = v.get<int64_t>();
    } else if (v.is_number_float()) {
      const double d = v.get<double>();
      if (!(std::fabs(d) < 0x1p62) || d != std::trunc(d)) return false;
      out = static_cast<int64_t>(d);
    } else {
      return false;
    }
  } else if constexpr (std::is_same_v<T, double>) {
    if (!v.is_number()) return false;
    out = v.get<double>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) return false;
    out = v.get<std::string>();
  } else {  // std::vector<int64_t>
    if (!v.is_array()) return false;
    out.clear();
    for (const auto& x : v) {
      int64_t k = 0;
      if (!convert(x, k)) return false;
      out.push_back(k);
    }
  }
  return true;
}

template <class T>
const char* type_word() {
  if constexpr (std::is_same_v<T, bool>) return "true or false";
  if constexpr (std::is_same_v<T, int64_t>) return "an integer";
  if constexpr (std::is_same_v<T, double>) return "a number";
  if constexpr (std::is_same_v<T, std::string>) return "a string";
  return "a list of integers";
}

template <class T>
T field(const nlohmann::json& j, const char* key, const std::string& path) {
  T out{};
  TITAN_CHECK(convert(j[key], out), path, ": field '", key, "' must be ", type_word<T>(), ", got ",
              j[key].dump());
  return out;
}

template <class T>
T required(const nlohmann::json& j, const char* key, const std::string& path) {
  TITAN_CHECK(j.contains(key) && !j[key].is_null(), path, ": missing required field '", key, "'");
  return field<T>(j, key, path);
}

template <class T>
T optional(const nlohmann::json& j, const char* key, T fallback, const std::string& path) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  return field<T>(j, key, path);
}

// bos_token_id / eos_token_id: an id or a list of ids (the first counts).
int64_t first_token_id(const nlohmann::json& j, const char* key, int64_t fallback, const std::string& path) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_array()) return field<int64_t>(j, key, path);
  const std::vector<int64_t> ids = field<std::vector<int64_t>>(j, key, path);
  return ids.empty() ? fallback : ids[0];
}

}  // namespace

Qwen3Config Qwen3Config::from_hf_json(const nlohmann::json& j, const std::string& path) {
  TITAN_CHECK(j.is_object(), path, ": not a JSON object");
  std::string model_type = "qwen3";
  if (j.contains("model_type")) {
    TITAN_CHECK(j["model_type"].is_string(), path, ": field 'model_type' must be a string, got ",
                j["model_type"].type_name());
    model_type = j["model_type"].get<std::string>();
    TITAN_CHECK(model_type == "qwen3" || model_type == "qwen3_moe", path, ": model_type '", model_type,
                "' is not supported here (expected 'qwen3' or 'qwen3_moe')");
  }
  const bool moe = model_type == "qwen3_moe";
  Qwen3Config c;
  c.vocab_size = required<int64_t>(j, "vocab_size", path);
  c.hidden_size = required<int64_t>(j, "hidden_size", path);
  // Qwen3MoeConfig defaults intermediate_size to 6144 (only mlp_only / non-sparse layers use it).
  c.intermediate_size = moe ? optional<int64_t>(j, "intermediate_size", 6144, path)
                            : required<int64_t>(j, "intermediate_size", path);
  c.num_hidden_layers = required<int64_t>(j, "num_hidden_layers", path);
  c.num_attention_heads = required<int64_t>(j, "num_attention_heads", path);
  c.num_key_value_heads = optional<int64_t>(j, "num_key_value_heads", c.num_attention_heads, path);
  TITAN_CHECK(c.num_attention_heads > 0, path, ": num_attention_heads must be positive");
  c.head_dim = optional<int64_t>(j, "head_dim", c.hidden_size / c.num_attention_heads, path);
  c.rms_norm_eps = optional<double>(j, "rms_norm_eps", 1e-6, path);
  // rope_theta (transformers v4) or rope_parameters.rope_theta (v5); HF's default base is 10000.
  c.rope_theta = 10000.0;
  // The rope type of a rope_parameters / rope_scaling object: its "rope_type" (or legacy "type") string.
  auto rope_type = [&](const nlohmann::json& o, const char* field) {
    TITAN_CHECK(o.is_object(), path, ": field '", field, "' must be an object or null, got ", o.type_name());
    for (const char* key : {"rope_type", "type"})
      if (o.contains(key)) {
        TITAN_CHECK(o[key].is_string(), path, ": field '", field, ".", key, "' must be a string, got ",
                    o[key].type_name());
        return o[key].get<std::string>();
      }
    return std::string("default");
  };
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    auto& rp = j["rope_parameters"];
    std::string type = rope_type(rp, "rope_parameters");
    TITAN_CHECK(type == "default", path, ": rope_parameters.rope_type '", type,
                "' is not supported (only 'default')");
    c.rope_theta = optional<double>(rp, "rope_theta", c.rope_theta, path);
  }
  c.rope_theta = optional<double>(j, "rope_theta", c.rope_theta, path);
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    std::string type = rope_type(j["rope_scaling"], "rope_scaling");
    TITAN_CHECK(type == "default", path, ": rope_scaling type '", type,
                "' is not supported (only 'default')");
  }
  TITAN_CHECK(!optional<bool>(j, "use_sliding_window", false, path), path,
              ": use_sliding_window=true is not supported");
  TITAN_CHECK(!optional<bool>(j, "attention_bias", false, path), path,
              ": attention_bias=true is not supported");
  std::string act = optional<std::string>(j, "hidden_act", "silu", path);
  TITAN_CHECK(act == "silu", path, ": hidden_act '", act, "' is not supported (only 'silu')");
  c.tie_word_embeddings = optional<bool>(j, "tie_word_embeddings", false, path);
  c.max_position_embeddings = optional<int64_t>(j, "max_position_embeddings", 32768, path);
  c.initializer_range = optional<double>(j, "initializer_range", 0.02, path);
  c.bos_token_id = first_token_id(j, "bos_token_id", 151643, path);
  c.eos_token_id = first_token_id(j, "eos_token_id", 151645, path);
  if (moe) {
    // transformers v5 writes num_local_experts (attribute_map num_experts -> num_local_experts), v4
    // num_experts.
    c.num_experts = j.contains("num_local_experts") && !j["num_local_experts"].is_null()
                        ? optional<int64_t>(j, "num_local_experts", 0, path)
                        : optional<int64_t>(j, "num_experts", 128, path);
    c.num_experts_per_tok = optional<int64_t>(j, "num_experts_per_tok", 8, path);
    c.moe_intermediate_size = optional<int64_t>(j, "moe_intermediate_size", 768, path);
    c.norm_topk_prob = optional<bool>(j, "norm_topk_prob", false, path);
    c.decoder_sparse_step = optional<int64_t>(j, "decoder_sparse_step", 1, path);
    c.mlp_only_layers = optional<std::vector<int64_t>>(j, "mlp_only_layers", {}, path);
    c.output_router_logits = optional<bool>(j, "output_router_logits", false, path);
    c.router_aux_loss_coef = optional<double>(j, "router_aux_loss_coef", 0.001, path);
  }
  c.validate(path);
  return c;
}

Qwen3Config Qwen3Config::from_hf_file(const std::string& path) {
  return from_hf_json(read_json_file(path), path);
}

void Qwen3Config::validate(const std::string& where) const {
  auto positive = [&](int64_t v, const char* name) {
    TITAN_CHECK(v > 0, where, ": ", name, " must be positive, got ", v);
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(intermediate_size, "intermediate_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(num_attention_heads, "num_attention_heads");
  positive(num_key_value_heads, "num_key_value_heads");
  positive(head_dim, "head_dim");
  // Upper bounds far above every released Qwen3 (hidden 8192, 94 layers, 128 experts, vocab 151936): a
  // file asking for more is refused here, before a layer table or a tensor is built from it.
  auto at_most = [&](int64_t v, int64_t limit, const char* name) {
    TITAN_CHECK(v <= limit, where, ": ", name, " = ", v, " is larger than titan accepts (at most ", limit,
                ")");
  };
  at_most(vocab_size, int64_t(1) << 24, "vocab_size");
  at_most(hidden_size, int64_t(1) << 17, "hidden_size");
  at_most(intermediate_size, int64_t(1) << 20, "intermediate_size");
  at_most(num_hidden_layers, int64_t(1) << 12, "num_hidden_layers");
  at_most(num_attention_heads, int64_t(1) << 12, "num_attention_heads");
  at_most(num_key_value_heads, int64_t(1) << 12, "num_key_value_heads");
  at_most(head_dim, int64_t(1) << 12, "head_dim");
  at_most(max_position_embeddings, int64_t(1) << 24, "max_position_embeddings");
  TITAN_CHECK(num_attention_heads % num_key_value_heads == 0, where, ": num_attention_heads (",
              num_attention_heads, ") must be a multiple of num_key_value_heads (", num_key_value_heads, ")");
  TITAN_CHECK(head_dim % 2 == 0, where, ": head_dim must be even for rotary embeddings, got ", head_dim);
  TITAN_CHECK(rms_norm_eps > 0, where, ": rms_norm_eps must be positive");
  TITAN_CHECK(rope_theta > 0, where, ": rope_theta must be positive");
  if (num_experts > 0) {
    TITAN_CHECK(num_experts_per_tok >= 1 && num_experts_per_tok <= num_experts, where,
                ": num_experts_per_tok must be in [1, num_experts=", num_experts, "], got ",
                num_experts_per_tok);
    positive(moe_intermediate_size, "moe_intermediate_size");
    at_most(num_experts, int64_t(1) << 12, "num_experts");
    at_most(moe_intermediate_size, int64_t(1) << 20, "moe_intermediate_size");
    positive(decoder_sparse_step, "decoder_sparse_step");
    TITAN_CHECK(load_balance_coeff >= 0, where, ": load_balance_coeff must be >= 0");
  }
}

nlohmann::ordered_json Qwen3Config::to_hf_json(const std::string& torch_dtype) const {
  nlohmann::ordered_json j;
  j["architectures"] = {is_moe() ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"};
  j["model_type"] = is_moe() ? "qwen3_moe" : "qwen3";
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["bos_token_id"] = bos_token_id;
  j["eos_token_id"] = eos_token_id;
  j["head_dim"] = head_dim;
  j["hidden_act"] = "silu";
  j["hidden_size"] = hidden_size;
  j["initializer_range"] = initializer_range;
  j["intermediate_size"] = intermediate_size;
  j["max_position_embeddings"] = max_position_embeddings;
  j["max_window_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_key_value_heads"] = num_key_value_heads;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_scaling"] = nullptr;
  j["rope_theta"] = rope_theta;
  j["sliding_window"] = nullptr;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["torch_dtype"] = torch_dtype;
  j["use_cache"] = true;
  j["use_sliding_window"] = false;
  j["vocab_size"] = vocab_size;
  if (is_moe()) {
    j["decoder_sparse_step"] = decoder_sparse_step;
    j["mlp_only_layers"] = mlp_only_layers;
    j["moe_intermediate_size"] = moe_intermediate_size;
    j["norm_topk_prob"] = norm_topk_prob;
    j["num_experts"] = num_experts;  // read by v4 and (through attribute_map) v5
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["output_router_logits"] = output_router_logits;
    j["router_aux_loss_coef"] = router_aux_loss_coef;
  }
  return j;
}

namespace {
struct FlavorShape {
  int64_t H, I, L, nH, nKV;
  bool tied;
  int64_t E = 0, k = 0, moe_I = 0;  // MoE: experts, top-k, expert intermediate size
};
const std::map<std::string, FlavorShape>& flavors() {
  // Released HF shapes (vocab 151936, head_dim 128, theta 1e6); "debug" is tiny for CPU runs.
  static const std::map<std::string, FlavorShape> f = {
      {"0.6B", {1024, 3072, 28, 16, 8, true}},
      {"1.7B", {2048, 6144, 28, 16, 8, true}},
      {"4B", {2560, 9728, 36, 32, 8, true}},
      {"8B", {4096, 12288, 36, 32, 8, false}},
      {"14B", {5120, 17408, 40, 40, 8, false}},
      {"32B", {5120, 25600, 64, 64, 8, false}},
      // MoE releases (norm_topk_prob true, every layer sparse, router_aux_loss_coef 0.001).
      {"30B-A3B", {2048, 6144, 48, 32, 4, false, 128, 8, 768}},
      {"235B-A22B", {4096, 12288, 94, 64, 4, false, 128, 8, 1536}},
      {"30B-A3B-64e-top4-4l", {2048, 6144, 4, 32, 4, false, 64, 4, 768}},
  };
  return f;
}
}  // namespace

Qwen3Config Qwen3Config::flavor(const std::string& name) {
  Qwen3Config c;
  if (name == "debug") {
    // Small enough to train hundreds of steps in minutes on 2 cores; vocab fits a small BPE tokenizer.
    c.vocab_size = 2048;
    c.hidden_size = 256;
    c.intermediate_size = 768;
    c.num_hidden_layers = 4;
    c.num_attention_heads = 8;
    c.num_key_value_heads = 4;
    c.head_dim = 32;
    c.tie_word_embeddings = true;
    c.max_position_embeddings = 4096;
    c.bos_token_id = 0;
    c.eos_token_id = 0;
    return c;
  }
  if (name == "debug_moe") {
    // The debug model with every layer sparse: 8 experts, top-2 (CPU-sized; torchtitan's debugmodel_moe is
    // 64 experts of 768 on 8 layers).
    c = flavor("debug");
    c.tie_word_embeddings = false;
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 256;
    c.norm_topk_prob = true;
    return c;
  }
  auto it = flavors().find(name);
  if (it == flavors().end()) {
    std::string valid = "debug, debug_moe";
    for (auto& [n, _] : flavors()) valid += ", " + n;
    fail("unknown Qwen3 flavor '", name, "' (valid: ", valid, ")");
  }
  const FlavorShape& s = it->second;
  c.hidden_size = s.H;
  c.intermediate_size = s.I;
  c.num_hidden_layers = s.L;
  c.num_attention_heads = s.nH;
  c.num_key_value_heads = s.nKV;
  c.head_dim = 128;
  c.tie_word_embeddings = s.tied;
  c.rope_theta = 1e6;
  c.vocab_size = 151936;
  if (s.E > 0) {
    c.num_experts = s.E;
    c.num_experts_per_tok = s.k;
    c.moe_intermediate_size = s.moe_I;
    c.norm_topk_prob = true;
  }
  return c;
}

std::vector<std::string> Qwen3Config::flavor_names() {
  std::vector<std::string> names = {"debug", "debug_moe"};
  for (auto& [n, _] : flavors()) names.push_back(n);
  return names;
}

}  // namespace titan
