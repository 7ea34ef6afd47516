// Tensor parallel (Megatron-style) layout of a Qwen3 model over a group of tp ranks, applied from outside
// the model like torchtitan's parallelize_qwen3: each rank holds a Qwen3Model of the local config (whole
// attention heads and KV heads, a 1/tp slice of the dense MLP's intermediate size) whose parameters are
// its slices of the full model's:
//   q_proj, k_proj, v_proj, gate_proj, up_proj   column-parallel: the rank's rows (output features)
//   o_proj, down_proj                            row-parallel: the rank's columns (input features)
//   embed_tokens, lm_head                        vocab-parallel: the rank's rows (1/tp of the vocabulary)
//   LoRA adapters (PEFT names)                   as their base weight: B of q/k/v/gate/up by rows, A of
//   o/down
//                                                by columns; the other factor replicated
//   everything else                              replicated (norms, MoE router and experts: with expert
//                                                parallel each rank holds its expert group rank's experts)
// The model sums the row-parallel partial outputs (forward) and the column-parallel partial input gradients
// (backward) over the group through TensorParallelComm -- with sequence parallel as reduce-scatters onto
// each rank's rows of the residual stream, whose norms' outputs are all-gathered before the column-parallel
// GEMMs; the replicated per-head norms (q_norm, k_norm) see only the rank's heads (and under sequence
// parallel the RMSNorms only its rows), so their gradients are summed here after the backward. Every rank of
// a group sees the same batch. No rank holds the full model: checkpoints and exports gather the slices.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "distributed/process_group.h"
#include "models/qwen3/config.h"
#include "models/qwen3/model.h"

namespace titan::dist {

// How a parameter of the full model (by HF name) is split over the group.
enum class TpSplit { Replicated, Rows, Columns };
TpSplit tensor_parallel_split(const std::string& hf_name);

// One rank's model config: heads, KV heads, the vocabulary and the dense intermediate size divided by tp. One
// error naming parallelism.tensor_parallel_degree and the model field it does not divide.
Qwen3Config tensor_parallel_config(const Qwen3Config& full, int64_t tp);

class TensorParallel : public TensorParallelComm {
 public:
  // group: this rank's tensor-parallel group (the ranks holding the other slices of the same layers).
  // sequence_parallel: the models run with Qwen3Model::set_tensor_parallel(this, true) (the RMSNorms see
  // only the rank's rows, so their gradients are summed too).
  // experts_over_group: the models' experts are split over this group (expert parallel borrowing the
  // tensor-parallel dimension, with sequence parallel): each rank holds other experts (all saved), the
  // routers see only the rank's rows (their gradients summed).
  explicit TensorParallel(std::shared_ptr<ProcessGroup> group, bool sequence_parallel = false,
                          bool experts_over_group = false);
  bool sequence_parallel() const { return sequence_parallel_; }
  bool experts_over_group() const { return experts_over_group_; }
  int size() const override { return group_->size(); }
  int rank() const override { return group_->rank(); }
  ProcessGroup& group() const { return *group_; }

  void sum(float* x, int64_t n) override;
  void max(float* x, int64_t n) override;
  void sum_host(double* x, int64_t n) override;
  void sum_device(double* x, int64_t n) override;
  void all_gather(const float* local, float* full, int64_t n) override;
  void reduce_scatter(const float* full, float* local, int64_t n) override;

  // Where this rank's slice of a parameter lies in the full one, as runs of contiguous elements (offset in
  // the local parameter, offset in the full parameter, count): one run for a replicated or row-split
  // parameter, one per row for a column-split one.
  struct Run {
    int64_t local, global, count;
  };
  std::vector<Run> runs(const std::string& hf_name, const Shape& full_shape) const;
  // This rank's slice (host f32, contiguous) of a full parameter (host f32) named hf_name.
  Tensor slice(const std::string& hf_name, const Tensor& full) const;
  // The local model's parameters := this rank's slices of the full model's (any device).
  void scatter(const Qwen3Model& full, Qwen3Model& local) const;
  // The local model's parameters := this rank's slices of Qwen3Model(full_config).init_weights(seed),
  // without that model: the full parameters are drawn one at a time on the host and sliced.
  void init_weights(Qwen3Model& local, const Qwen3Config& full_config, uint64_t seed) const;
  // The full model's parameters, assembled from every rank's slices (collective; host tensors, HF names).
  // keep = false: this rank only contributes its slices (returns nothing; one full tensor at a time).
  NamedTensors gather(const std::vector<Param>& local, bool keep = true) const;
  NamedTensors gather(const Qwen3Model& local, bool keep = true) const {
    return gather(local.params(), keep);
  }
  // The gradients as the optimizer holds them: buffer g holds elements [offset[g], offset[g] + count[g]) of
  // the local model's group g (the full buffers, or this rank's FSDP shards, partitioned over
  // shard_group; the ranks of a tensor-parallel group hold the same ranges).
  struct GradBuffers {
    std::vector<Tensor>* grads;
    std::vector<int64_t> offset, count;
    ProcessGroup* shard_group = nullptr;
    ProcessGroup* expert_group = nullptr;  // expert parallel: the ranks holding the other experts
  };
  static GradBuffers full_buffers(Qwen3Model& local);
  // After the backward (gradients accumulated over the step's micro-batches): sums the gradients of the
  // replicated parameters that each rank computed over its own heads only (q_norm, k_norm; LoRA's A of a
  // column-parallel projection and B of a row-parallel one), and under sequence parallel over its own rows
  // only (the input, post-attention and final RMSNorms). Collective.
  void reduce_replicated_grads(const std::vector<Param>& params, const GradBuffers& g) const;
  void reduce_replicated_grads(Qwen3Model& local) const {
    reduce_replicated_grads(local.params(), full_buffers(local));
  }
  // Squared L2 norm of the full model's gradient (sliced parameters summed over the group, replicated
  // ones once; shards summed over their group). Collective.
  double grad_sq_norm(const std::vector<Param>& params, const GradBuffers& g) const;
  double grad_sq_norm(Qwen3Model& local) const { return grad_sq_norm(local.params(), full_buffers(local)); }
  // The same left on the device (compile mode: nothing waits for it): sums points at 4 doubles of the
  // gradients' device memory; sums[3] ends as grad_sq_norm's result, bit for bit (the three partial sums in
  // sums[0..2], reduced by collectives on the device). Not with expert parallel.
  void grad_sq_norm_device(const std::vector<Param>& params, const GradBuffers& g, double* sums) const;

 private:
  std::shared_ptr<ProcessGroup> group_;
  bool sequence_parallel_ = false, experts_over_group_ = false;
};

}  // namespace titan::dist
