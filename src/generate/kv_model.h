// Inference forward of a loaded Qwen3Model (dense or MoE) with a per-layer KV cache: each call runs only
// the new tokens (a prompt prefill of n tokens is one batched forward; a decode step is n = 1) and
// appends their keys (after k_norm and RoPE) and values to the cache. The weights are read in place from
// the model's parameters (nothing is copied or re-loaded); the ops come from the kernel registry, the
// model's own choices for the shared ones, and attention_kv for attention against the cache.
//
// bf16: when the model is under bf16 compute (Qwen3Model::set_bf16_compute), the GEMMs run on the bf16
// engine, and every op output is rounded to bf16 at the same points as the model's forward (a bf16 model in
// PyTorch). A model holding f32 weights gets bf16 images of them made here once; a model whose weights are
// held only as bf16 (load_model_dir's bf16 CPU model, a FrozenBf16Base) is read in place: its bf16 groups
// are registered as the images of reserved address ranges (no memory behind them) that stand for the f32
// weights the GEMM engines look images up by, the norm weights are converted to f32 once and the
// embedding rows as they are looked up. No f32 copy of the weights exists then.
//
//   Qwen3Model m(Qwen3Config::from_hf_file(dir + "/config.json"));  m.load_hf(dir);
//   KVCacheModel kv(m, 4096);
//   const float* logits = kv.forward(prompt.data(), prompt.size());  // (V) of the last prompt token
//   logits = kv.forward(&next, 1);                                    // one more position
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "models/qwen3/model.h"

namespace titan {

class KVCacheModel {
 public:
  // max_seq: cache capacity in positions (<= max_position_embeddings). kernels: overrides by op name
  // (attention_kv; the other ops follow the model's choice).
  KVCacheModel(Qwen3Model& model, int64_t max_seq, const KernelChoice& kernels = {});
  ~KVCacheModel();
  KVCacheModel(const KVCacheModel&) = delete;
  KVCacheModel& operator=(const KVCacheModel&) = delete;

  // Runs ids[0..n) at positions [pos(), pos() + n). Returns the logits of the last one (V), or with
  // all_logits of every one (n,V). The pointer is valid until the next call.
  const float* forward(const int32_t* ids, int64_t n, bool all_logits = false);
  int64_t pos() const { return pos_; }  // positions in the cache
  int64_t capacity() const { return max_seq_; }
  void reset() { pos_ = 0; }  // empty the cache
  // Keeps the first p positions (p <= pos()): e.g. re-use a shared prompt prefix.
  void truncate(int64_t p);
  int64_t vocab_size() const { return cfg_.vocab_size; }
  std::string kernels_line() const;  // "matmul=..., attention_kv=..." for logs

 private:
  struct Layer {  // pointers into the model's parameters
    const float *input_norm, *wq, *wk, *wv, *q_norm, *k_norm, *wo, *post_norm;
    const float *router = nullptr, *wgu, *wdown, *expert_bias = nullptr;
  };
  void plan(int64_t n);
  void layer_forward(int64_t l, int64_t n);
  void moe_mlp(const Layer& w, int64_t n, float* out);

  Qwen3Model& model_;
  Qwen3Config cfg_;
  int64_t max_seq_, pos_ = 0, planned_n_ = 0;
  bool bf16_ = false;
  std::vector<Layer> layers_;
  const float *embed_ = nullptr, *final_norm_ = nullptr, *lm_head_ = nullptr;
  const MatmulKernels* matmul_;
  const RmsNormKernels* rmsnorm_;
  const RopeKernels* rope_;
  const RopeQKKernels* rope_qk_ = nullptr;
  const SwigluKernels* swiglu_;
  const EmbeddingKernels* embedding_;
  const MoeExpertsKernels* moe_ = nullptr;
  const AttentionKVKernels* attention_;
  const ElementwiseKernels* elementwise_;
  const MoeRouterKernels* router_ = nullptr;
  std::string attention_name_;
  std::vector<Tensor> k_cache_, v_cache_;  // per layer (max_seq, nKV, hd)
  Tensor rope_cos_, rope_sin_;             // (max_seq, hd/2)
  // Activations for n tokens.
  Tensor x_, ln_, rstd_, q_, k_, att_, h_, gu_, act_, logits_, probs_, topk_w_, moe_out_;
  Tensor topk_idx_;
  Tensor moe_i32_, moe_f32_;        // the expert kernel's buffers (moe_buf_ points into them)
  Tensor ids_;                      // this call's ids on the model's device
  std::vector<float> host_logits_;  // the returned logits when the model is not in host memory
  MoeExpertsBuffers moe_buf_{};
  std::vector<std::vector<uint16_t>> bf16_images_;
  std::vector<const float*> bf16_bases_;
  // Weights held only as bf16: per parameter group, a reserved inaccessible range of group_numel floats (a
  // stray f32 read faults at once); the f32 norm weights; the embedding's bf16 rows.
  struct ReservedRange {
    void* p = nullptr;
    size_t bytes = 0;
  };
  std::vector<ReservedRange> keys_;
  std::vector<std::vector<float>> norms_;
  const uint16_t* embed_bf16_ = nullptr;
};

}  // namespace titan
