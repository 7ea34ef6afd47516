// Qwen3 causal LM, dense and MoE, with explicit forward and backward (HF modeling_qwen3.py and
// modeling_qwen3_moe.py math, fp32).
//
// Parameters live in flat buffers, one per group: group 0 = embed_tokens, 1..L = decoder layers,
// L+1 = final norm (+ lm_head when untied). Inside a layer the HF tensors are laid out so that
// q/k/v and gate/up are contiguous row blocks (one fused GEMM each). Every HF parameter is a view.
// A sparse (MoE) layer holds mlp.gate.weight (E,H), then the experts' gate/up rows as one (E,2I,H) block
// (= HF v5 mlp.experts.gate_up_proj) and their down projections as (E,H,I) (= mlp.experts.down_proj);
// the Param list names them per expert (mlp.experts.E.{gate,up,down}_proj.weight, the on-disk names).
//
// MoE usage (trainer):
//   Qwen3Model m(Qwen3Config::flavor("30B-A3B-64e-top4-4l"), {{"moe_experts", "grouped"}});
//   r = m.forward(ids, labels, B, T);   // r.loss = CE + router_aux_loss_coef * aux (output_router_logits)
//   m.backward();
//   // aux-loss-free balancing (config.load_balance_coeff > 0), before optimizer.step():
//   //   all-reduce(sum) m.expert_token_counts() across data-parallel ranks, then m.update_expert_bias().
//
// Expert parallel (torchtitan semantics): Qwen3Model(config, kernels, expert_group) with a group of e ranks
// holds experts [r*E/e, (r+1)*E/e) of every sparse layer (r = rank in the group); the router and every
// non-expert parameter are full. Each rank routes its own tokens, sends every (token, expert) row to the
// rank owning the expert (all_to_all_v), runs its local experts on what it receives and sends the
// results back; backward runs the reverse exchanges. The expert gradients then hold the contributions of
// every rank's tokens of the group (each scaled by its source rank's loss scale). forward/backward are
// collective over the group. HF names keep the global expert index.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/safetensors.h"
#include "kernels/ops.h"
#include "models/qwen3/config.h"
#include "models/qwen3/model_interfaces.h"
#include "models/qwen3/model_layers.h"

namespace titan {

class LoraAdapters;

namespace dist {
class ProcessGroup;
class AllToAllExchange;
}  // namespace dist

// RoPE tables (T, head_dim/2) of cos and sin at positions 0..T-1, as HF computes them (fp32 inv_freq and
// angles), on `device`: the training model's and the KV cache's.
void make_rope_tables(const Qwen3Config& c, int64_t T, Device device, Tensor& cos, Tensor& sin);

// Pipeline parallel: a model holding some stages of the full model, each the decoder layers [first, end).
// The model's first stage, when it starts at layer 0, also holds the embedding; its last, when it ends at
// the last layer, the final norm and lm_head (and with tied embeddings a copy of the embedding, whose
// gradient the trainer sums with the first stage's so that both copies stay equal).
struct StageRange {
  int64_t first = 0, end = 0;
  bool embedding = false;  // the first stage of the model (first == 0): embed_tokens
  bool head = false;       // the last stage (end == num_hidden_layers): the final norm and lm_head
};

class Qwen3Model {
 public:
  // expert_group: expert parallel over these ranks (nullptr or a group of one: every expert here).
  // allocate = false: no parameter or gradient buffers and no init; the caller hands the parameters to a
  // ParamStreamer at once (e.g. FrozenBf16Base, models/qwen3/lora.h).
  // device: where parameters, gradients and activations live and every op runs. Inputs (ids, labels) come
  // from host memory; state_dict()/buffers() hand out host tensors.
  // stages (pipeline parallel): the layer ranges held here, ascending and disjoint (empty: the whole
  // model). Groups of layers not held are empty (numel 0) and their parameters are not in params(); group
  // indices and HF names stay the full model's, and init draws every parameter (each held one equals the
  // same parameter of the full model).
  explicit Qwen3Model(const Qwen3Config& config, const KernelChoice& kernels = {},
                      dist::ProcessGroup* expert_group = nullptr, bool allocate = true,
                      Device device = Device::cpu(), std::vector<StageRange> stages = {});
  ~Qwen3Model();

  const Qwen3Config& config() const { return config_; }
  Device device() const { return device_; }
  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  Param& param(const std::string& hf_name);
  std::vector<Tensor>& flat_params() { return flat_params_; }
  std::vector<Tensor>& flat_grads() { return flat_grads_; }
  int num_groups() const { return static_cast<int>(group_numel_.size()); }
  int64_t group_numel(int g) const { return group_numel_[g]; }
  // Hands the parameters over to `streamer`: the full parameter and gradient buffers (and every Param
  // view) are dropped; forward/backward gather group by group. nullptr takes them back: every group is
  // gathered into new full buffers (collective when the streamer's gathers are), e.g. for an HF export.
  void set_param_streamer(ParamStreamer* streamer);
  ParamStreamer* param_streamer() const { return streamer_; }
  // Keeps `streamer` (already set with set_param_streamer) alive as long as the model: an inference
  // model's bf16 weights (load_model_dir).
  void own_param_streamer(std::unique_ptr<ParamStreamer> streamer);
  // A model built with allocate = false gets its f32 parameters (zeros) and no gradient buffers, for
  // weights loaded next by an inference model (load_model_dir): no gradient memory, no random init.
  void allocate_inference_params();
  int64_t num_params() const;
  std::map<std::string, std::string> kernel_names() const { return kernel_names_; }
  // The GEMM engine the layers and head run on now (f32, or the bf16 engine under bf16 compute).
  const MatmulKernels& matmul_kernels() const { return *matmul_; }

  // HF init: Linear/Embedding ~ N(0, initializer_range), RMSNorm weights 1 (deterministic by seed).
  void init_weights(uint64_t seed);
  // One parameter of that init, drawn from rng: 1-D (norm weights) ones (no draws), else N(0, std).
  // init_weights draws every parameter in order from one mt19937_64(seed).
  static void draw_init(std::mt19937_64& rng, const Shape& shape, double std, float* out);
  // Loads HF safetensors (single or sharded). Missing/unexpected keys and shape mismatches are errors.
  // slice (tensor parallel): this model holds slices of the checkpoint's tensors; each tensor is read in
  // full, one at a time, and slice(name, full) gives this model's part.
  using TensorSlicer = std::function<Tensor(const std::string& name, const Tensor& full)>;
  void load_hf(const std::string& dir, const TensorSlicer& slice = nullptr);
  // A checkpoint key load_hf accepts without a parameter of its own (a tied lm_head, the rotary buffer).
  static bool hf_key_without_parameter(const Qwen3Config& config, const std::string& key);
  // Also accepts the transformers-v5 fused expert keys (mlp.experts.gate_up_proj / down_proj) per layer.
  // HF parameter names -> tensors, as save_pretrained writes them (tied lm_head omitted). MoE experts per
  // expert (the released layout) unless fused_experts (v5 save_original_format=False layout).
  NamedTensors state_dict(bool fused_experts = false) const;
  void save_hf(const std::string& dir, DType dtype, int64_t max_shard_bytes = int64_t(5) << 30,
               bool fused_experts = false) const;

  // ids, labels: (B,T) int32, labels may contain -100 (ignored). Labels are shifted inside (HF).
  // Pipeline parallel: runs stage opts.stage; ids are read by the stage holding the embedding, labels by
  // the one holding the head (the loss and num_valid are that stage's; the others return zeros).
  ForwardResult forward(const int32_t* ids, const int32_t* labels, int64_t B, int64_t T,
                        const ForwardOptions& opts = {});
  // Uploads a forward's ids, targets, gradient scale (opts.grad_scale, else 1 / valid targets) and, with
  // opts.position_ids, its packing tables (what forward would copy from these host arrays, checked as it
  // checks them) into staging slot `slot` of `slots` ahead of a forward with opts.inputs_staged and
  // opts.staged_slot = slot: in compile mode before the graph's launch, which cannot hold copies of host
  // memory; one slot per micro-batch of a step. Also sizes the device loss sums (one per slot).
  void stage_inputs(const int32_t* ids, const int32_t* labels, int64_t B, int64_t T,
                    const ForwardOptions& opts = {}, int64_t slot = 0, int64_t slots = 1);
  // Accumulates parameter gradients of the last forward (which must have had compute_grad).
  void backward() { backward(nullptr, nullptr, 0.0f); }
  // Pipeline parallel: the backward of the last forward's stage. A stage without the head takes
  // d(loss)/d(its output) (N,H, on the device) and, for MoE models, the head stage's aux_dprob() and
  // aux_scale() (null / 0 otherwise); a stage without the embedding leaves d(loss)/d(its input) in
  // stage_input_grad().
  void backward(const float* d_output, const float* aux_dprob, float aux_scale);

  // ---- pipeline stages ----
  int num_stages() const { return static_cast<int>(stages_.size()); }
  const StageRange& stage(int s) const { return stages_[s]; }
  bool stage_has_embedding(int s) const { return stages_[s].embedding; }
  bool stage_has_head(int s) const { return stages_[s].head; }
  bool holds_group(int g) const { return held_[g]; }
  // The last stage's copy of a tied embedding (the first stage's is the one checkpoints keep).
  bool holds_embedding_copy() const { return held_[0] && !stages_[0].embedding; }
  // After forward of a stage without the head: its output hidden states (N,H, device); after backward of a
  // stage without the embedding: d(loss)/d(its input) (N,H, device).
  const float* stage_output() const { return final_resid_.f32(); }
  // Rows of the hidden states a stage passes on for a (B,T) batch: B x T, or this rank's share under
  // sequence parallel.
  int64_t stage_rows(int64_t B, int64_t T) const { return sp_ ? B * T / tp_->size() : B * T; }
  const float* stage_input_grad() const { return dresid_.f32(); }
  // MoE, after forward: the aux-loss statistics (2E: routed slots, then router probability sums per expert)
  // of this stage's sparse layers plus opts.aux_stats_in; after the head stage's forward, d aux / d probs
  // (E) and d loss / d aux, which the stages before it pass to backward().
  const std::vector<double>& aux_stats() const { return aux_host_; }
  const std::vector<float>& aux_dprob() const { return aux_dprob_; }
  float aux_scale() const { return aux_scale_; }
  void zero_grad();
  // Logits (B,T,V) of the last forward with keep_logits.
  const Tensor& logits() const { return logits_copy_; }
  // The CE loss sum of the last forward with loss_on_device and staged_slot = slot (a host read: waits
  // for the device).
  double device_loss_sum(int64_t slot = 0) const;
  // The same for a MoE model's aux loss (HF load_balancing_loss_func) of that forward.
  double device_aux_loss(int64_t slot = 0) const;
  // *out (device memory) += how many of the device loss sums (and MoE aux losses) of slots [0, slots) are
  // not finite; nothing waits for the device (training.skip_nan_inf in compile mode).
  void count_nonfinite_losses(double* out, int64_t slots) const;
  // Changes whenever the model replaces a buffer its steps use (the activations re-planned for another
  // shape, a scratch buffer grown): a graph captured before holds stale addresses then.
  int64_t buffers_epoch() const { return buffers_epoch_; }
  // bf16 compute emulation: parameters and every op output rounded to bfloat16 (accumulation in f32),
  // as a bf16 model in PyTorch computes. Gradients and the optimizer stay f32.
  void set_bf16_compute(bool on);
  // Under bf16 compute, keep the tensors read only by GEMMs, SwiGLU and the q/k norms (norm outputs, q/k
  // before their norms, v, the attention output, gate/up, the SwiGLU output) as bf16 (default; see
  // wants_act16) or, off, as f32 buffers holding the same bf16 values (identical results, twice their
  // memory: a debugging aid, and the tests' oracle).
  void set_bf16_activations(bool on) {
    if (on != bf16_acts_) B_ = T_ = 0;  // re-plan the activations at the next forward
    bf16_acts_ = on;
  }
  // Benchmarks: every op this model runs reports to the current OpTiming (kernels/op_timing.h) from now on
  // (its op tables swapped for timed copies; results unchanged). Once per program.
  void time_ops();
  bool bf16_compute() const { return bf16_; }
  // Activation checkpointing: a checkpointed layer keeps only its input; backward recomputes its forward
  // (bit-identical) into one shared activation buffer before differentiating it. every = 0: none; 1: every
  // layer ("full"); N: every N-th layer, layers N-1, 2N-1, ... (torchtitan's selective_ac_option = "N").
  void set_activation_checkpointing(bool on) { set_activation_checkpoint_every(on ? 1 : 0); }
  void set_activation_checkpoint_every(int64_t every);
  bool activation_checkpointing() const { return ac_every_ > 0; }
  bool layer_checkpointed(int64_t layer) const { return ac_every_ > 0 && (layer + 1) % ac_every_ == 0; }
  // Selective checkpointing by op (torchtitan's selective_ac_option = "op"): the layers not checkpointed
  // keep their GEMM and attention outputs (q/k/v, attention, o + residual, gate/up, the experts') and
  // recompute the pointwise outputs (both RMSNorms, q/k norm + RoPE, SwiGLU of dense layers) in backward,
  // with the forward's kernels on the same inputs (bit-identical), into one buffer shared by the layers.
  void set_activation_recompute_ops(bool on);
  bool layer_recomputes_ops(int64_t layer) const { return ac_ops_ && !layer_checkpointed(layer); }
  // Rows of the lm_head + cross-entropy chunk (0 = automatic: chunks of at most kHeadChunkBytes of logits).
  void set_head_chunk_rows(int64_t rows);
  int64_t head_rows() const { return head_rows_; }
  static constexpr int64_t kHeadChunkBytes = int64_t(512) << 20;
  // LoRA (models/qwen3/lora.h): the adapters' forward/backward run inside the layers, and the base is frozen:
  // no base gradient is computed or kept (the gradient buffers of dense groups are dropped; sparse layers
  // keep one as scratch for the expert kernels). nullptr detaches the adapters (the base stays frozen).
  void set_lora(LoraAdapters* lora);
  // Tensor parallel: this model holds one rank's slices (the local config), comm its group (nullptr: none).
  // sequence_parallel: the residual stream and the RMSNorms between the parallel blocks run on this rank's
  // 1/size of the batch's rows (rows [rank * N/size, (rank + 1) * N/size) of the B*T tokens), all-gathered
  // before the column-parallel GEMMs and reduce-scattered after the row-parallel ones.
  // experts_over_group (with sequence parallel, and this model's expert group being the tensor-parallel
  // group): each rank's sparse layers route its own rows to the group's experts (torchtitan's expert
  // parallel borrowing the tensor-parallel dimension) instead of running replicated on all rows.
  void set_tensor_parallel(TensorParallelComm* comm, bool sequence_parallel = false,
                           bool experts_over_group = false);
  bool sequence_parallel() const { return sp_; }
  // Context parallel (ContextParallelComm's layout; nullptr: none): forward takes this rank's rows of every
  // sequence (T = 2c, the two chunks) with targets already shifted (opts.labels_shifted) and position_ids,
  // if any, of the whole sequence; RoPE takes the rows' positions in the whole sequence and attention runs
  // as a ring over the group (attention_ring: each rank's keys and values pass around it, the partial
  // results merged by their logsumexp; in backward the key/value gradients travel with them back to their
  // rank). Losses and gradients are this rank's rows' (the trainer sums them over the group); the MoE
  // aux-loss statistics are summed over the group (every row must be a token of the sequence: no padding).
  void set_context_parallel(ContextParallelComm* comm);
  ContextParallelComm* context_parallel() const { return cp_; }
  // Vocab parallel: the embedding / lm_head rows here are the full vocabulary's [vocab_start(),
  // vocab_start() + config().vocab_size) of full_vocab_size().
  bool vocab_parallel() const { return tp_ && tp_->size() > 1; }
  int64_t vocab_start() const { return vocab_parallel() ? tp_->rank() * config_.vocab_size : 0; }
  int64_t full_vocab_size() const {
    return vocab_parallel() ? tp_->size() * config_.vocab_size : config_.vocab_size;
  }
  LoraAdapters* lora() const { return lora_; }
  bool frozen_base() const { return frozen_; }
  // Bytes of activations currently planned (for memory reports).
  int64_t activation_bytes() const;

  // ---- MoE ----
  // Indices of the sparse layers (config.is_moe_layer); row m of the tensors below is moe_layers()[m].
  const std::vector<int64_t>& moe_layers() const { return moe_layers_; }
  // Aux-loss-free balancing (config.load_balance_coeff > 0): every forward with compute_grad adds the tokens
  // routed to each expert here ((MoE layers, E), f32). A distributed trainer all-reduces (sum) this tensor
  // across data-parallel ranks before update_expert_bias().
  Tensor& expert_token_counts() { return expert_counts_; }
  // (MoE layers, E): added to the routing probabilities for top-k selection only (gates use the unbiased
  // probabilities). Persistent training state: checkpoint it with the optimizer state (not an HF tensor).
  Tensor& expert_bias() { return expert_bias_; }
  // torchtitan's pre-optimizer-step hook: per layer bias += coeff * sign(mean(counts) - counts), centred
  // to zero mean, then the counts are zeroed. No-op when load_balance_coeff == 0.
  void update_expert_bias();
  // ---- expert parallel ----
  int expert_parallel_degree() const { return ep_size_; }
  int64_t local_experts() const { return local_experts_; }  // experts per sparse layer held here
  int64_t first_expert() const { return first_expert_; }    // global index of the first one
  // Per flat buffer: the element offset where its expert weights start (the buffer's numel when it has
  // none). Expert weights are the tail of a sparse layer's buffer; everything before is non-expert.
  std::vector<int64_t> expert_offsets() const;
  // Every HF tensor with all experts, per-expert names (what save_pretrained writes). Under expert
  // parallel collective over the expert group: the expert slices are gathered; rank 0 of the group gets
  // the full dict, the other ranks an empty one. Without expert parallel: state_dict().
  NamedTensors gathered_state_dict() const;
  // Copies tensors by HF name into the parameters (every parameter must be present, shapes must match).
  void load_state_dict(const NamedTensors& tensors);

  // Buffers that are training state but not HF parameters: "model.layers.N.mlp.expert_bias" (E) per layer.
  NamedTensors buffers() const;

 private:
  using LayerView = qwen3_detail::LayerView;
  using LayerActs = qwen3_detail::LayerActs;
  using EpLayer = qwen3_detail::EpLayer;

  LayerView layer_view(int64_t layer) const { return layer_view(layer, flat_params_[layer + 1].f32()); }
  LayerView layer_view(int64_t layer, float* base) const;
  // accumulate_stats: add the aux-loss statistics (false when recomputing under checkpointing).
  void moe_forward_layer(int64_t l, float* out, bool count_tokens, bool accumulate_stats = true);
  void run_layers(const StageRange& range, const ForwardOptions& opts);
  // Where a stage's input goes: its first layer's input, or for a stage without layers (only the embedding
  // or only the head) straight into the layers' output.
  float* stage_in(const StageRange& range) {
    return range.first < range.end ? layer_acts_[range.first].resid_in : final_resid_.f32();
  }
  // Decoder layer l from layer_acts_[l].resid_in (or resid_in16) into out (N,H), or out16 where out is null
  // (the bf16 residual stream), saving its activations.
  void forward_layer(int64_t l, float* out, uint16_t* out16, bool count_tokens, bool accumulate_stats);
  // d(resid) += the backward of an RMSNorm of the residual stream (x, or x16 where x is null).
  void residual_norm_backward(float* dresid, float* dw, const float* dln, const float* x, const uint16_t* x16,
                              const float* w, const float* rstd);
  // The layer GEMMs (out = inp W^T and its backward) on the f32 buffer of each operand where it is non-null,
  // else on its bf16 one (bf16 activations).
  void linear_forward(float* out, uint16_t* out16, const float* inp, const uint16_t* inp16, const float* w,
                      int64_t N, int64_t C, int64_t OC);
  void linear_backward(float* dinp, float* dw, const float* dout, const float* inp, const uint16_t* inp16,
                       const float* w, int64_t N, int64_t C, int64_t OC, bool accumulate_dw);
  // The pointwise parts of forward_layer, shared with recompute_layer_ops (the op-selective backward).
  void input_norm(int64_t l);
  void qk_norm_rope(int64_t l);
  // Packed rows: checks position_ids (B_,T_) and makes the per-token RoPE tables and attention doc_start.
  void set_packing(const int32_t* position_ids, int64_t staged_slot = -1);
  void packing_tables(const int32_t* position_ids, std::vector<int32_t>& start, std::vector<float>& tcos,
                      std::vector<float>& tsin) const;
  // The RoPE tables the layers use and their period: the position tables (T_ rows), or with packing one row
  // per token (period N).
  struct RopeTables {
    const float *cos, *sin;
    int64_t period;
  };
  RopeTables rope_tables() const;
  const int32_t* doc_start() const { return packed_ ? doc_start_.data<int32_t>() : nullptr; }
  void recompute_layer_ops(int64_t l);
  void moe_backward_layer(int64_t l, const float* dresid, float aux_scale, bool accumulate_dw);
  // Expert-parallel experts of sparse layer l: exchange, local experts, exchange back.
  void moe_experts_ep_forward(int64_t l, float* out);
  // Expert parallel's fixed-capacity exchange (a forward with inputs_staged: compile mode) routes on the
  // device; the experts must then be the device-routed kernels.
  bool ep_fixed_ = false;
  void moe_experts_ep_backward(int64_t l, const float* dresid, float* dln, float* dtw);
  void plan_activations(int64_t B, int64_t T);
  // With a streamer: gather group g into flat_params_[g] / drop it; a gradient buffer into
  // flat_grads_[g] / hand it back for reduction. No-ops without one (the buffers are always there).
  void acquire_params(int g);
  void release_params(int g);
  void acquire_grads(int g);
  void finish_grads(int g);
  void make_param_views();
  // bf16 compute: group g's weights as bf16, registered for the matmul_bf16 kernels (one conversion per
  // forward instead of one per GEMM call); dropped before the group's buffer goes away.
  void make_bf16_image(int g);
  void drop_bf16_image(int g);
  void build_rope_tables(int64_t T);
  void zero_accumulated_grads();
  double device_memory_bytes() const;
  void zero(float* p, int64_t n) const { dev_->zero(p, static_cast<size_t>(n) * sizeof(float)); }
  void round_bf16_if(float* x, int64_t n) const {
    if (bf16_) elementwise_->round_bf16(x, n);
  }
  // A device tensor of at least n elements (reallocated only to grow).
  Tensor& ensure(Tensor& t, int64_t n, DType dtype = DType::F32) const;

  Qwen3Config config_;
  std::vector<StageRange> stages_;
  std::vector<bool> held_;        // per group
  int cur_stage_ = 0;             // the stage of the last forward
  int64_t total_moe_layers_ = 0;  // sparse layers of the full model (the aux loss averages over all)
  Device device_;
  DeviceInterface* dev_;
  std::vector<Param> params_;
  std::vector<Tensor> flat_params_, flat_grads_;
  std::vector<int64_t> group_numel_;
  std::vector<std::vector<uint16_t>> bf16_image_;  // per group (empty: none)
  std::vector<const float*> bf16_image_base_;      // the buffer each image was made from
  ParamStreamer* streamer_ = nullptr;
  std::unique_ptr<ParamStreamer> owned_streamer_;
  TensorParallelComm* tp_ = nullptr;
  bool sp_ = false;
  Tensor sp_local_, sp_full_;  // sequence parallel scratch: (N/size, H) and (N, H)
  Tensor ln_full_;             // sequence parallel: a layer's ln1 or ln2 gathered for its GEMMs (N, H)
  // A layer norm output saved as this rank's rows, gathered for the column-parallel GEMMs (forward, and
  // again in backward): ln_full_ under sequence parallel, else `rows` itself.
  const float* gathered_ln(const float* rows);
  int64_t local_rows() const { return sp_ ? B_ * T_ / tp_->size() : B_ * T_; }
  bool moe_local_ = false;  // sparse layers on this rank's rows, experts over the tensor-parallel group
  int64_t moe_rows() const { return moe_local_ ? local_rows() : B_ * T_; }
  void norm_for_mlp(int64_t layer);
  // A layer norm's output for the column-parallel GEMMs: full (N,H) rows of rmsnorm(inp) (inp and rstd:
  // this rank's rows under sequence parallel, gathered).
  void norm_for_gemm(float* full, float* rstd, const float* inp, const float* w);
  // After a row-parallel GEMM whose partial (N,H) output is `partial`: out (this rank's rows) := the sum
  // over the group. Without sequence parallel partial is out, summed in place.
  void sum_row_parallel(float* partial, float* out);
  // d(residual) as the row-parallel GEMMs' backward reads it: all N rows (gathered under sequence parallel).
  const float* full_rows(const float* local);
  // d(norm output) from the column-parallel GEMMs' partial input gradients (N,H): this rank's rows, summed.
  float* sum_column_parallel_grad(float* dfull);
  void vocab_parallel_cross_entropy(float* logits, int64_t r0, int64_t rows, const float* scale,
                                    bool compute_grad, double* loss_sum);
  void tp_sum(float* x, int64_t n) {
    if (tp_) tp_->sum(x, n);
  }
  // Context parallel: the ring attention of layer l (forward into a.att and its logsumexp into a.attn_saved;
  // backward accumulating into dqr, dkr, dv).
  void ring_attention_forward(int64_t l);
  void ring_attention_backward(int64_t l, float* dqr, float* dkr, float* dv, const float* datt);
  int64_t attn_saved_floats(int64_t B, int64_t T, int64_t nH) const {
    return cp_ || attn16_ ? B * nH * T : attention_->saved_floats(B, T, nH);
  }
  // bf16 attention: under bf16 compute, where the device has attention_bf16 and without context parallel
  // (the ring blocks are f32). Fixed by plan_activations (the layers' buffers depend on it).
  bool wants_attn16() const { return bf16_ && attention_bf16_ && !cp_; }
  // bf16 activations: tensors read only by GEMMs (and SwiGLU) are kept as bf16 and handed to matmul_bf16's
  // bf16-input/-output GEMMs as they are: under bf16 compute, where the bf16 GEMM engine runs and no LoRA
  // adapter (whose projections read and write f32) is attached. Then o_proj reads the bf16 attention
  // output and the v GEMM writes v's bf16 copy (with bf16 attention: o16_), dense layers keep gate/up and
  // the SwiGLU output in bf16 (mlp16_), the q/k GEMMs write bf16 read by the q/k norms' bf16-input forms,
  // and without sequence parallel (whose all-gathers move f32 norm outputs) the norms before q/k/v and
  // gate/up write bf16 (ln16_; ln2 in dense layers only: a sparse layer's router and experts read f32).
  bool wants_act16() const {
    return bf16_ && bf16_acts_ && matmul_ == &matmul_bf16_ && matmul16_.forward_bf16_io &&
           swiglu_->forward_bf16 && rmsnorm_->forward_bf16_output && rmsnorm_->forward_bf16_input &&
           rmsnorm_->backward_bf16_input && !lora_;
  }
  // Where the i-th of datt | dq | dk | dv | d(q projection) | d(k projection) of N rows starts in
  // attn16_grads_ (bf16 elements; 16-byte aligned; the last two under qk_fused_).
  int64_t attn16_grad_offset(int i, int64_t N) const {
    const int64_t q = N * config_.q_dim(), kv = N * config_.kv_dim(), sizes[] = {q, q, kv, kv, q};
    int64_t at = 0;
    for (int j = 0; j < i; ++j) at += (sizes[j] + 7) / 8 * 8;
    return at;
  }
  void attention_bf16_forward(int64_t l);
  // (dqr, dkr null: dq and dk stay bf16 in attn16_grads_, for qk_norm_rope's backward; dv null likewise)
  void attention_bf16_backward(int64_t l, float* dqr, float* dkr, float* dv, const float* datt);
  ContextParallelComm* cp_ = nullptr;
  const AttentionRingKernels* ring_ = nullptr;  // null where the device has none
  std::string ring_name_;
  bool cp_docs_ = false;             // packed documents under context parallel: doc_start_ holds positions
  bool cp_tables_ready_ = false;     // the per-token RoPE tables hold this shape's context-parallel positions
  Tensor cp_pos_;                    // (size, T_) int32: every rank's rows' positions in the whole sequence
  Tensor cp_kv_, cp_dkv_, cp_part_;  // ring scratch: 2 x [k|v], 2 x [dk|dv], a block's out and lse
  std::map<std::string, std::string> kernel_names_;
  const MatmulKernels* matmul_;  // matmul_f32_, or &matmul_bf16_ under bf16 compute
  const MatmulKernels* matmul_f32_;
  MatmulKernels matmul_bf16_{};   // the matmul_bf16 engine (null when only the reference exists)
  MatmulBf16Kernels matmul16_{};  // its whole table (with the bf16-input GEMMs)
  void use_matmul16(const MatmulBf16Kernels& k) {
    matmul16_ = k;
    matmul_bf16_ = MatmulKernels{k.forward, k.backward};
  }
  std::string matmul_f32_name_, matmul_bf16_name_;
  const RmsNormKernels* rmsnorm_;
  const RopeKernels* rope_;
  const RopeQKKernels* rope_qk_ = nullptr;           // null: rope_ on q, then on k
  const QKNormRopeKernels* qk_norm_rope_ = nullptr;  // null where the device has none or [kernels] says so
  std::string qk_norm_rope_name_;
  const MoeExpertsKernels* moe_ = nullptr;  // moe_f32_, or &moe_bf16_ under bf16 compute
  const MoeExpertsKernels* moe_f32_ = nullptr;
  MoeExpertsKernels moe_bf16_{};  // the moe_experts_bf16 engine (null when only the reference exists)
  std::string moe_f32_name_, moe_bf16_name_;
  const AttentionKernels* attention_;
  const AttentionBf16Kernels* attention_bf16_ = nullptr;  // null where the device has none
  std::string attention_bf16_name_, attention_f32_name_;
  bool attn16_ = false;       // this plan's layers run attention_bf16
  bool o16_ = false;          // ... and their o_proj reads att16 (a.att is null), v is written as v16 only
  bool mlp16_ = false;        // this plan's dense layers keep gu16 and act16 (wants_act16)
  bool qk_fused_ = false;     // ... and q16/k16 come from q_raw16/k_raw16 by qk_norm_rope (no f32 q/k)
  bool qkv16_grads_ = false;  // ... and (with ln16_) the q/k/v GEMMs' backward reads bf16 d(q/k/v) (no f32)
  bool dgu16_ = false;        // ... and (with ln16_) a dense layer's d(gate/up) is bf16 (dgu_ holds bf16)
  bool resid16_ = false;      // ... and (with ln16_) the residual stream inside a stage is bf16 (resid_y_)
  bool bf16_acts_ = true;     // set_bf16_activations
  bool ln16_ = false;         // ... and its layers ln1_16 (every layer) and ln2_16 (dense layers)
  bool ops_timed_ = false;    // time_ops() swapped the op tables
  Tensor attn_scratch_;  // attn16_: qr | kr (not under qk_fused_) | v (not under o16_), f32, of the layer run
  Tensor attn16_grads_;  // attn16_: datt | dq | dk | dv (bf16) of the layer's backward
  Tensor resid_y_;       // resid16_: o_proj's or the MLP's f32 output, before its residual add (N,H)
  uint16_t* attn16_grad(int i) { return attn16_grads_.data<uint16_t>() + attn16_grad_offset(i, B_ * T_); }
  const SwigluKernels* swiglu_;
  const EmbeddingKernels* embedding_;
  const CrossEntropyKernels* cross_entropy_;
  const VocabParallelCrossEntropyKernels* cross_entropy_vp_ = nullptr;  // null where the device has none
  const ElementwiseKernels* elementwise_;
  const MoeRouterKernels* router_ = nullptr;
  const ExpertParallelKernels* ep_kernels_ = nullptr;

  // Activation plan: (re)allocated only when (B,T) changes.
  int64_t B_ = 0, T_ = 0;
  std::vector<Tensor> acts_;  // owning storage
  std::vector<LayerActs> layer_acts_;
  Tensor ids_, targets_, rope_cos_, rope_sin_;
  bool packed_ = false;
  Tensor doc_start_, token_cos_, token_sin_;  // packing: (N) first key of each token's document, (N,hd/2)
  std::vector<int32_t> host_targets_, host_ids_;
  Tensor ce_stats_;  // vocab parallel: one head chunk's row statistics (3 per row), then its logsumexp
  Tensor final_resid_, lnf_, rstdf_, logits_, logits_copy_;  // logits_: one (head_rows_, V) chunk
  // Backward scratch shared by all layers.
  Tensor dresid_, dln_, dq_, dk_, dv_, dqr_, dkr_, datt_, dgu_, dact_;
  bool grad_ready_ = false;
  // Set by zero_grad() (unstreamed gradients): the buffers hold zeros, so the first weight-gradient GEMM
  // into each writes it instead of adding to it (the head's in the next forward, the layers' in the next
  // backward).
  bool head_grad_zeroed_ = false;
  std::vector<bool> layer_grads_zeroed_;  // per stage (its layers' weight gradients hold zeros)
  bool bf16_ = false;
  int64_t ac_every_ = 0;
  bool ac_ops_ = false;
  LoraAdapters* lora_ = nullptr;
  bool frozen_ = false;
  bool frozen_scratch_grads(int g) const;  // frozen: group g still needs a (scratch) gradient buffer
  int64_t rope_T_ = 0;
  int64_t head_chunk_rows_ = 0, head_rows_ = 0;  // requested (0 = automatic) and planned head chunk rows
  // MoE state and scratch.
  std::vector<int64_t> moe_layers_;
  std::vector<int> moe_row_;            // layer -> row in expert_bias_/expert_counts_ (-1: dense)
  Tensor expert_bias_, expert_counts_;  // (MoE layers, E)
  Tensor moe_scratch_, dtopk_w_, dlogits_router_;
  // Aux-loss statistics accumulated over the sparse layers of a forward, on the device (f64): routed slots
  // per expert (E), then the router probabilities summed per expert (E); aux_host_ is their host copy.
  Tensor aux_stats_;
  Tensor loss_sum_;  // (slots, f64) the CE loss sums of forwards with loss_on_device, by staged_slot
  // stage_inputs()' micro-batches, by slot: ids and targets (slots x N, i32), the gradient scale (slots),
  // packed rows' doc starts (slots x N, i32) and RoPE rows (slots x N x hd/2)
  Tensor staged_ids_, staged_targets_, staged_scale_, staged_doc_start_, staged_cos_, staged_sin_;
  Tensor eager_scale_;  // (1) the gradient scale of a forward that is not staged, for the device forms
  Tensor vp_loss_sum_;  // (1, f64) loss parallel's loss sum of an eager forward
  mutable int64_t buffers_epoch_ = 0;
  void check_ids(const int32_t* ids, int64_t B, int64_t T) const;
  void copy_staged(Tensor& dst, const Tensor& staged, int64_t slot, int64_t n);
  void upload_ids(const int32_t* ids, int64_t N, Tensor dst);
  int64_t prepare_targets(const int32_t* labels, int64_t B, int64_t T, const ForwardOptions& opts);
  // d(loss)/d(row loss) of a forward: opts.grad_scale, else 1 / its valid targets.
  static float loss_grad_scale(const ForwardOptions& opts, int64_t num_valid);
  std::vector<double> aux_host_;
  std::vector<float> aux_dprob_;  // (E) d aux / d probs[n,e] (same for every row)
  Tensor aux_scaled_;             // (E) aux_scale_ * aux_dprob_ (backward, on the device)
  Tensor aux_loss_dev_;         // (slots, f64) the aux losses of forwards with loss_on_device, by staged_slot
  bool aux_on_device_ = false;  // the last forward left its aux loss and aux_scaled_ on the device
  float aux_scale_ = 0.0f;      // d loss / d aux of the last forward
  double aux_loss_ = 0;
  // Expert parallel.
  dist::ProcessGroup* ep_ = nullptr;
  int ep_size_ = 1, ep_rank_ = 0;
  int64_t local_experts_ = 0, first_expert_ = 0;
  std::vector<int64_t> init_skip_;  // per param: random draws of non-local experts before it (init)
  std::vector<EpLayer> ep_layers_;
  MoeExpertsBuffers ep_buffers(EpLayer& s);                          // per sparse layer
  Tensor ep_send_, ep_recv_, ep_rows_, ep_scratch_, ep_dx_, ep_dw_;  // shared scratch (device)
  std::vector<int32_t> ep_idx_host_;                                 // routing, host copy
};

}  // namespace titan
