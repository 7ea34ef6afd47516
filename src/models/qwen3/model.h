// Qwen3 dense causal LM with explicit forward and backward (HF modeling_qwen3.py math, fp32).
//
// Parameters live in flat buffers, one per group: group 0 = embed_tokens, 1..L = decoder layers,
// L+1 = final norm (+ lm_head when untied). Inside a layer the HF tensors are laid out so that
// q/k/v and gate/up are contiguous row blocks (one fused GEMM each). Every HF parameter is a view.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/safetensors.h"
#include "kernels/ops.h"
#include "models/qwen3/config.h"

namespace titan {

// Implementation chosen per op ("" = the device's default). Keys are op names: matmul, rmsnorm, ...
using KernelChoice = std::map<std::string, std::string>;

struct Param {
  std::string name;  // HF name, e.g. model.layers.0.self_attn.q_proj.weight
  int group = 0;
  int64_t offset = 0;  // elements into the group's flat buffer
  Shape shape;
  Tensor value, grad;  // views into the group's flat buffers
};

struct ForwardOptions {
  bool compute_grad = true;   // prepare dlogits (in place) for backward()
  bool keep_logits = false;   // copy the logits out before they are overwritten by their gradient
  float grad_scale = 0.0f;    // d(loss_sum)/d(row loss); 0 = 1/(number of valid targets) (HF mean)
};

struct ForwardResult {
  double loss = 0;           // mean over valid targets (HF ForCausalLMLoss)
  double loss_sum = 0;
  int64_t num_valid = 0;     // targets that are not ignore_index
};

class Qwen3Model {
 public:
  explicit Qwen3Model(const Qwen3Config& config, const KernelChoice& kernels = {});

  const Qwen3Config& config() const { return config_; }
  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  Param& param(const std::string& hf_name);
  std::vector<Tensor>& flat_params() { return flat_params_; }
  std::vector<Tensor>& flat_grads() { return flat_grads_; }
  int64_t num_params() const;
  std::map<std::string, std::string> kernel_names() const { return kernel_names_; }

  // HF init: Linear/Embedding ~ N(0, initializer_range), RMSNorm weights 1 (deterministic by seed).
  void init_weights(uint64_t seed);
  // Loads HF safetensors (single or sharded). Missing/unexpected keys and shape mismatches are errors.
  void load_hf(const std::string& dir);
  // HF parameter names -> tensors, as save_pretrained writes them (tied lm_head omitted).
  NamedTensors state_dict() const;
  void save_hf(const std::string& dir, DType dtype, int64_t max_shard_bytes = int64_t(5) << 30) const;

  // ids, labels: (B,T) int32, labels may contain -100 (ignored). Labels are shifted inside (HF).
  ForwardResult forward(const int32_t* ids, const int32_t* labels, int64_t B, int64_t T,
                        const ForwardOptions& opts = {});
  // Accumulates parameter gradients of the last forward (which must have had compute_grad).
  void backward();
  void zero_grad();
  // Logits (B,T,V) of the last forward with keep_logits.
  const Tensor& logits() const { return logits_copy_; }
  // bf16 compute emulation: parameters and every op output rounded to bfloat16 (accumulation in f32),
  // as a bf16 model in PyTorch computes. Gradients and the optimizer stay f32.
  void set_bf16_compute(bool on);
  bool bf16_compute() const { return bf16_; }
  // Bytes of activations currently planned (for memory reports).
  int64_t activation_bytes() const;

 private:
  // Pointers into one decoder layer's flat buffer. q/k/v rows are contiguous (fused wqkv), so are
  // gate/up rows (fused wgu).
  struct LayerView {
    float *input_norm, *wq, *wk, *wv, *q_norm, *k_norm, *wo, *post_norm, *wgu, *wdown;
  };

  // Saved activations of one decoder layer; N = B*T.
  struct LayerActs {
    float* resid_in;  // (N,H) layer input
    float* ln1;       // (N,H)
    float* rstd1;     // (N)
    float* q_raw;     // (N,nH,hd) before q_norm
    float* k_raw;     // (N,nKV,hd)
    float* v;         // (N,nKV,hd)
    float* q_rstd;    // (N*nH)
    float* k_rstd;    // (N*nKV)
    float* qr;        // (N,nH,hd) normed + rotated
    float* kr;        // (N,nKV,hd)
    float* probs;     // (B,nH,T,T)
    float* att;       // (N,nH*hd)
    float* resid_mid; // (N,H) after the attention residual
    float* ln2;       // (N,H)
    float* rstd2;     // (N)
    float* gu;        // (N,2I)
    float* act;       // (N,I)
  };

  LayerView layer_view(float* base) const;
  void plan_activations(int64_t B, int64_t T);
  void build_rope_tables(int64_t T);

  Qwen3Config config_;
  std::vector<Param> params_;
  std::vector<Tensor> flat_params_, flat_grads_;
  std::map<std::string, std::string> kernel_names_;
  const MatmulKernels* matmul_;
  const RmsNormKernels* rmsnorm_;
  const RopeKernels* rope_;
  const AttentionKernels* attention_;
  const SwigluKernels* swiglu_;
  const EmbeddingKernels* embedding_;
  const CrossEntropyKernels* cross_entropy_;

  // Activation plan: (re)allocated only when (B,T) changes.
  int64_t B_ = 0, T_ = 0;
  std::vector<Tensor> acts_;        // owning storage
  std::vector<LayerActs> layer_acts_;
  Tensor ids_, targets_, rope_cos_, rope_sin_;
  Tensor final_resid_, lnf_, rstdf_, logits_, logits_copy_;
  // Backward scratch shared by all layers.
  Tensor dresid_, dln_, dq_, dk_, dv_, dqr_, dkr_, datt_, dgu_, dact_;
  bool grad_ready_ = false;
  bool bf16_ = false;
  int64_t rope_T_ = 0;
};

}  // namespace titan
