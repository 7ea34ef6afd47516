// The plan of a run, computed before anything is allocated: parameters, FLOPs per token and memory
// per rank (parameters, gradients, AdamW state, activations) for a model config and a parallel layout.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "distributed/pipeline_layout.h"
#include "models/qwen3/config.h"

namespace titan {

struct RunPlan {
  int64_t params = 0;
  int64_t non_embedding_params = 0;
  double flops_per_token = 0;  // training (forward + backward)
  int64_t world = 1, dp_replicate = 1, dp_shard = 1, grad_accum = 1;
  int64_t expert_parallel = 1;                // ranks the experts are split over
  int64_t expert_params = 0;                  // routed-expert parameters (all sparse layers, all experts)
  bool experts_over_tensor_parallel = false;  // the experts split over the tensor-parallel group
  int64_t tensor_parallel = 1;                // ranks per tensor-parallel group
  bool sequence_parallel = false;
  double tp_comm_bytes = 0;  // per rank and step: bytes each rank sends in its tensor-parallel collectives
  int64_t local_batch = 1, global_batch = 1, seq_len = 1;
  // Pipeline parallel: the stages, schedule and micro-batches (one stage with everything when degree 1).
  dist::PipelineLayout pipeline;
  int64_t context_parallel = 1;  // ranks a sequence is split over (two mirrored chunks each)
  bool bf16_attention = false;   // q/k/v and the attention output saved as bf16 (bf16 compute, no CP)
  bool bf16_qk = false;          // q and k before their norms saved as bf16 (bf16 compute)
  bool bf16_mlp = false;         // gate/up and the SwiGLU output saved as bf16 (bf16 compute, dense)
  bool bf16_norms = false;       // ln1 (and ln2 where bf16_mlp) saved as bf16 (bf16 compute, no SP)
  bool bf16_residual = false;    // the layer inputs (but a stage's first) and resid_mid as bf16 (no SP)
  double pp_comm_bytes = 0;      // per rank and step: activations and their gradients sent between stages
  double cp_comm_bytes = 0;      // per rank and step: K/V chunks (and dK/dV) passed around the ring
  int64_t shard_params = 0;      // parameters this rank owns (its shard of its tensor-parallel slice)
  // Per rank (under pipeline parallel: the pipeline rank with the largest total; per_stage_rank has each).
  int64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0, activation_bytes = 0;
  struct PipelineRank {
    int64_t layers = 0;   // decoder layers on the rank (all its stages)
    double inflight = 1;  // peak micro-batches whose activations it holds (in units of all its layers)
    int64_t shard_params = 0;
    int64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0, activation_bytes = 0;
    double pp_comm_bytes = 0, tp_comm_bytes = 0, cp_comm_bytes = 0;  // sent per step, as the plan's fields
    int64_t total_bytes() const { return param_bytes + grad_bytes + optimizer_bytes + activation_bytes; }
  };
  std::vector<PipelineRank> per_stage_rank;  // one entry per pipeline rank
  int64_t total_bytes() const { return param_bytes + grad_bytes + optimizer_bytes + activation_bytes; }
  std::string describe() const;  // multi-line human-readable summary
  // " (bf16: attention, q/k projections, MLP, norm outputs)": the saved tensors bf16 compute keeps in bf16
  // ("" for none).
  std::string bf16_activations() const;
};

// Which activations a step keeps (torchtitan's activation_checkpoint): every = 0 none, 1 every layer, N every
// N-th layer checkpointed (keeps its input only); recompute_ops: the other layers keep GEMM and attention
// outputs and recompute their pointwise ops (selective_ac_option = "op").
struct CheckpointPolicy {
  int64_t every = 0;
  bool recompute_ops = false;
};

// dp_shard divides parameters, gradients and optimizer state; expert_parallel divides the routed experts;
// tensor_parallel slices the attention and dense MLP weights and their activations; pipeline gives each
// pipeline rank its stages' layers and the micro-batches its schedule keeps in flight; context_parallel
// splits every sequence (activations 1/cp; parameters sharded over dp_shard x cp, as torchtitan's FSDP
// mesh). world = dp_replicate x dp_shard x tensor_parallel x pipeline degree x context_parallel. Errors
// name the parallelism field when one cannot. bf16_compute (training.mixed_precision_param = "bfloat16"):
// attention's tensors are bf16 (the model's attention_bf16 path; not under context parallel, whose ring
// blocks stay f32), which changes the saved activations and the scratch.
RunPlan make_plan(const Qwen3Config& model, int64_t world, int64_t dp_replicate, int64_t dp_shard,
                  int64_t local_batch, int64_t global_batch, int64_t seq_len, CheckpointPolicy checkpointing,
                  int64_t expert_parallel = 1, int64_t tensor_parallel = 1, bool sequence_parallel = false,
                  const dist::PipelineOptions& pipeline = {}, int64_t context_parallel = 1,
                  bool bf16_compute = false);

}  // namespace titan
