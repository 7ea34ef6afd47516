// LoRA adapters for Qwen3 (HF PEFT semantics): y = x W^T + (alpha / r) * dropout(x) A^T B^T on the chosen
// projections of every decoder layer, with the base weights W frozen.
//
//   A (r, in) ~ kaiming_uniform(a = sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)) (PEFT's init), B (out, r) = 0.
//
// Usage (training):
//   Qwen3Model model(cfg);  model.load_hf(dir);
//   LoraAdapters lora(cfg, lora_cfg);  lora.init(seed);        // or lora.load_peft(adapter_dir)
//   model.set_lora(&lora);                                      // freezes the base: no base gradients
//   AdamW opt(lora.flat_params(), lora.flat_grads(), ...);      // optimizer state for adapters only
//   ... model.forward(...); model.backward(); opt.step(lr) ...
//   lora.save_peft(out_dir);                                    // adapter_config.json +
//   adapter_model.safetensors
//
// Frozen base storage: f32 (the model's own buffers; the golden path against PEFT's fp32 model) or bf16
// (FrozenBf16Base below: 2 bytes per base parameter, each layer up-converted to f32 while it runs; the
// default for training memory).
//
// MoE: adapters go on the attention projections of every layer and on the MLP projections of dense layers
// (mlp_only_layers / decoder_sparse_step); routed experts (fused in transformers v5, not nn.Linear) get none.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/safetensors.h"
#include "models/qwen3/config.h"
#include "models/qwen3/model.h"

namespace titan {

struct LoraConfig {
  bool enable = false;
  int64_t rank = 16;
  double alpha = 32;
  double dropout = 0;
  // PEFT module names; "all-linear" expands to every projection below.
  std::vector<std::string> target_modules = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                             "gate_proj", "up_proj", "down_proj"};
  bool bf16_base = true;  // frozen base stored as bf16 (training); false: f32 (goldens)
  uint64_t seed = 0;      // adapter init and dropout masks

  float scale() const { return static_cast<float>(alpha / static_cast<double>(rank)); }
  void validate(const std::string& where) const;
  // adapter_config.json as PEFT writes it (peft_type LORA, task_type CAUSAL_LM).
  nlohmann::ordered_json to_peft_json(const std::string& base_model) const;
  // Reads r, lora_alpha, lora_dropout, target_modules from a PEFT adapter_config.json; rejects what this
  // implementation does not do (use_rslora, use_dora, fan_in_fan_out, bias != none, rank_pattern, ...).
  static LoraConfig from_peft_file(const std::string& path);
};

// The seven projections of a decoder layer, in PEFT's module names.
enum class LoraProj : int { Q = 0, K, V, O, Gate, Up, Down };
constexpr int kLoraProjs = 7;
const char* lora_proj_name(LoraProj p);  // "q_proj", ...

// Number of adapter parameters (A and B of every adapted projection) for a model and LoRA config, without
// allocating anything (planning).
int64_t lora_num_params(const Qwen3Config& model, const LoraConfig& lora);

class LoraAdapters {
 public:
  // device: where the adapters, their gradients and the adapter activations live (the model's).
  LoraAdapters(const Qwen3Config& model, const LoraConfig& lora, Device device = Device::cpu());

  const LoraConfig& config() const { return cfg_; }
  // Every adapter tensor, named as PEFT saves it
  // (base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight), as views into one flat parameter buffer
  // and one flat gradient buffer (group 0).
  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  std::vector<Tensor>& flat_params() { return flat_params_; }
  std::vector<Tensor>& flat_grads() { return flat_grads_; }
  int64_t num_params() const { return flat_params_[0].numel(); }
  bool has(int64_t layer, LoraProj p) const { return slot(layer, p) >= 0; }

  // A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0 (deterministic by seed).
  void init(uint64_t seed);
  void zero_grad() { flat_grads_[0].zero_(); }

  // PEFT format: adapter_config.json + adapter_model.safetensors (f32). Files appear complete or not at all.
  void save_peft(const std::string& dir, const std::string& base_model = "") const;
  // Loads the adapter tensors of a PEFT dir saved for this config (same r and targets); every tensor must be
  // present with this model's shapes (errors name the file and the key).
  void load_peft(const std::string& dir);

  // Tensor parallel (this rank `rank` of `size`, adapters of the local model's slices): the row-parallel
  // projections (o_proj, down_proj) see the rank's columns of their input, so their dropout masks are the
  // full input's mask at those columns (the same masks as on one rank).
  void set_tensor_parallel(int rank, int size) { tp_rank_ = rank, tp_size_ = size; }
  // Context parallel (this rank `rank` of `size`): a training forward's rows are local_len per sequence of
  // seq_len tokens (its two chunks, ContextParallelComm's layout), and each row draws the masks of its
  // sequence's row in one rank's batch. size 1: the rows are the batch's own.
  void set_context_parallel(int rank, int size, int64_t local_len, int64_t seq_len) {
    cp_rank_ = rank, cp_size_ = size, cp_local_len_ = local_len, cp_seq_len_ = seq_len;
  }

  // ---- hooks called by Qwen3Model (N rows) ----
  // Marks the start of a forward: training applies dropout (masks keyed by seed and pass number, so the
  // activation-checkpointing recompute draws the same ones).
  // staged_slot >= 0: the forward of a micro-batch staged by stage_pass(slot) (compile mode): its pass
  // number is read from device memory, and nothing is counted here.
  void begin_forward(bool training, int64_t staged_slot = -1);
  // Counts the forward of micro-batch `slot` of a step ahead of it (before a graph's launch) and stages its
  // pass number on the device for the forward with staged_slot = slot (slots per step: `slots`).
  void stage_pass(int64_t slot, int64_t slots);
  // Pipeline parallel: until unpin_masks, every forward is a training forward that draws the masks of pass
  // `pass` at rows [row0, row0 + N) of that pass's batch (a micro-batch of the batch one rank's forward
  // would run; a stage forward run again before its backward draws the same masks).
  void pin_masks(uint64_t pass, int64_t row0) {
    pinned_ = true;
    pass_ = pass;
    row0_ = row0;
  }
  void unpin_masks() {
    pinned_ = false;
    row0_ = 0;
  }
  // Forwards so far (the dropout masks' pass number): checkpoints keep it, so a resumed run draws the masks
  // the uninterrupted one would.
  uint64_t passes() const { return pass_; }
  void set_passes(uint64_t n) { pass_ = n; }
  // y (N,out; row stride ldy) += scale * dropout(x) A^T B^T, x (N,in). Saves u = dropout(x) A^T (N,r).
  void forward(int64_t layer, LoraProj p, const float* x, int64_t N, float* y, int64_t ldy);
  // dy (N,out; stride ldy): dB += scale dy^T u, du = scale dy B, dA += du^T dropout(x), dx (N,in) += mask(du
  // A).
  void backward(int64_t layer, LoraProj p, const float* x, const float* dy, int64_t ldy, float* dx,
                int64_t N);

 private:
  struct Slot {
    int64_t layer;
    LoraProj proj;
    int64_t in, out;
    int64_t a_off, b_off;  // offsets of A (r,in) and B (out,r) in the flat buffers
    Tensor u;              // (N,r) saved for backward (on the device)
    int64_t u_rows = 0;    // N of the saved u
  };
  int slot(int64_t layer, LoraProj p) const { return slot_of_[layer * kLoraProjs + static_cast<int>(p)]; }
  // x with the slot's dropout mask applied (x itself when no dropout is active).
  const float* dropped(const Slot& s, const float* x, int64_t N);

  Qwen3Config model_;
  LoraConfig cfg_;
  std::vector<Slot> slots_;
  std::vector<int> slot_of_;  // layer*7+proj -> index into slots_ (-1: none)
  std::vector<Param> params_;
  std::vector<Tensor> flat_params_, flat_grads_;
  Tensor xdrop_, du_, dxg_;  // device scratch: dropout(x), du, the masked dx term
  Device device_;
  const GemmKernels* gemm_;
  const DropoutKernels* dropout_;
  // The slot's dropout mask key for this pass (the recompute under activation checkpointing redraws it).
  uint64_t mask_key(int slot) const;
  // out := dropout(x) (backward = false) or dx += mask * g (true) over the slot's (N, in) input; under
  // tensor parallel a row-parallel slot's masks are the full input's at this rank's columns.
  void apply_dropout(const Slot& s, int si, float* out, const float* x, int64_t N, bool backward);
  int tp_rank_ = 0, tp_size_ = 1;
  int cp_rank_ = 0, cp_size_ = 1;
  int64_t cp_local_len_ = 0, cp_seq_len_ = 0;
  bool training_ = false, pinned_ = false;
  uint64_t pass_ = 0;
  Tensor staged_passes_;                   // (slots, i64) stage_pass()' pass numbers, as mask key parts
  const uint64_t* staged_pass_ = nullptr;  // this forward's, or null (pass_ is)
  int64_t row0_ = 0;                       // pinned: the first row's index in its pass's batch
};

// Adds (alpha / r) B A of the PEFT adapter in `adapter_dir` to the model's base weights in place (what PEFT's
// merge_and_unload computes). Checks adapter_config.json and every tensor's shape against the model; errors
// name the file and the key. The model must hold its parameters (not streamed). Used by
// `titan convert --merge-lora`, `titan generate --lora` and `titan eval --lora`.
void merge_lora_into(Qwen3Model& model, const std::string& adapter_dir);

// Frozen base held in bf16: the model's parameters live here as bf16 (2 bytes each); each group is
// up-converted to a temporary f32 buffer while the model runs it (a ParamStreamer). The model must be
// built with allocate = false and never asks for gradients: set frozen (set_lora) for LoRA training, or
// an inference model (load_model_dir with bf16 on the CPU: eval's forward streams the groups, and the
// KV-cache model reads the bf16 groups in place).
class FrozenBf16Base : public ParamStreamer {
 public:
  // Tensor parallel: the model holds slices of the model of config `full`; each parameter is read or drawn
  // in full (one tensor at a time, the draws as for the full model) and `slice` keeps this rank's part.
  struct Slicer {
    Qwen3Config full;
    std::function<Tensor(const std::string& name, const Tensor& full)> slice;
  };
  // Reads the HF checkpoint in `hf_dir` group by group (dense models and per-expert MoE checkpoints), or
  // draws HF's normal init (std initializer_range, norms = 1) per group when hf_dir is empty.
  FrozenBf16Base(Qwen3Model& model, const std::string& hf_dir, uint64_t seed = 0,
                 const Slicer* slicer = nullptr);
  // The parameters of `source` (same config, f32 parameters allocated: e.g. a fused-expert checkpoint's
  // weights, or an adapter merged in), converted group by group.
  FrozenBf16Base(Qwen3Model& model, Qwen3Model& source);
  ~FrozenBf16Base() override;
  const Tensor& group(int g) const { return groups_[g]; }  // bf16 (group_numel(g)), the model's layout
  Tensor gather_params(int group) override;
  void release_params(int group) override;
  Tensor grad_buffer(int group) override;
  void reduce_grads(int) override {}
  void zero_grads() override {}
  const uint16_t* bf16_params(int group) const override;
  int64_t bytes() const;

 private:
  Qwen3Model& model_;
  std::vector<Tensor> groups_;  // bf16, on the model's device
  // f32 buffers handed out (per group) and given back: reused without page faults, and without
  // re-converting when a buffer still holds the group asked for (the base never changes).
  struct Buffer {
    Tensor t;
    int group = -1;
  };
  std::vector<Buffer> live_, free_;
};

}  // namespace titan
