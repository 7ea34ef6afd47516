#include "train/plan.h"

#include <cstdio>
#include <sstream>

#include "core/error.h"
#include "distributed/tensor_parallel.h"

namespace titan {

namespace {
std::string gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f GiB", bytes / double(int64_t(1) << 30));
  return buf;
}
std::string human(double n) {
  char buf[32];
  if (n >= 1e9)
    std::snprintf(buf, sizeof buf, "%.3fB", n / 1e9);
  else if (n >= 1e6)
    std::snprintf(buf, sizeof buf, "%.3fM", n / 1e6);
  else
    std::snprintf(buf, sizeof buf, "%.0f", n);
  return buf;
}
}  // namespace

RunPlan make_plan(const Qwen3Config& c, int64_t world, int64_t dp_replicate, int64_t dp_shard,
                  int64_t local_batch, int64_t global_batch, int64_t seq_len, CheckpointPolicy checkpointing,
                  int64_t expert_parallel, int64_t tensor_parallel, bool sequence_parallel) {
  RunPlan p;
  p.world = world;
  p.dp_replicate = dp_replicate;
  p.dp_shard = dp_shard;
  const int64_t tp = p.tensor_parallel = tensor_parallel;
  const bool sp = p.sequence_parallel = sequence_parallel && tp > 1;
  TITAN_CHECK(dp_replicate * dp_shard * tp == world, "parallelism: data_parallel_replicate_degree (",
              dp_replicate, ") x data_parallel_shard_degree (", dp_shard, ") x tensor_parallel_degree (", tp,
              ") must equal the world size (", world, ")");
  const Qwen3Config lc = dist::tensor_parallel_config(c, tp);  // one rank's slice of the layers
  const int64_t dp = dp_replicate * dp_shard;
  p.local_batch = local_batch;
  p.global_batch = global_batch > 0 ? global_batch : local_batch * dp;
  TITAN_CHECK(p.global_batch % (local_batch * dp) == 0, "training.global_batch_size (", p.global_batch,
              ") must be a multiple of local_batch_size x data-parallel degree (", local_batch, " x ", dp,
              ")");
  p.grad_accum = p.global_batch / (local_batch * dp);
  p.seq_len = seq_len;
  p.params = c.num_params();
  p.non_embedding_params = p.params - c.vocab_size * c.hidden_size * (c.tie_word_embeddings ? 1 : 2);
  p.flops_per_token = c.training_flops_per_token(seq_len);
  p.expert_parallel = expert_parallel;
  p.expert_params = c.num_moe_layers() * c.num_experts * 3 * c.moe_intermediate_size * c.hidden_size;
  if (expert_parallel != 1) {
    const int64_t e = expert_parallel;
    TITAN_CHECK(e >= 1, "parallelism.expert_parallel_degree must be >= 1, got ", e);
    TITAN_CHECK(c.is_moe(), "parallelism.expert_parallel_degree = ", e,
                ": the model is dense (num_experts = 0); expert parallel needs a MoE model");
    TITAN_CHECK(c.num_experts % e == 0, "parallelism.expert_parallel_degree = ", e,
                " does not divide the model's num_experts = ", c.num_experts);
    // With tensor and sequence parallel and e = tp the experts are split over the tensor-parallel group
    // (each rank routing its own rows, torchtitan's dp_shard x tp = edp x ep); otherwise over the ranks
    // holding the same tensor-parallel slice.
    p.experts_over_tensor_parallel = sp && e == tp;
    TITAN_CHECK(
        p.experts_over_tensor_parallel || dp % e == 0, "parallelism.expert_parallel_degree = ", e,
        " does not divide the data-parallel degree ", dp,
        tp > 1 ? str_cat(" (world size / tensor_parallel_degree: experts are split over the ranks holding "
                         "the same tensor-parallel slice, or, with sequence parallel and "
                         "expert_parallel_degree = tensor_parallel_degree = ",
                         tp, ", over the tensor-parallel group)")
               : std::string());
    // (Experts over the tensor-parallel group are the rank's own parameters to the data-parallel plan, which
    // then shards them like the rest.)
    TITAN_CHECK(
        dp_shard == 1 || p.experts_over_tensor_parallel, "parallelism.expert_parallel_degree = ", e,
        " works with DDP only: set parallelism.data_parallel_replicate_degree = world size (", world,
        ") so that data_parallel_shard_degree = 1 (got ", dp_shard,
        "; FSDP/HSDP with expert parallel is supported only with the experts over the tensor-parallel "
        "group: tensor_parallel_degree = expert_parallel_degree with sequence parallel)");
  }
  // Parameters held per rank: every non-expert parameter, 1/expert_parallel of the experts, 1/tp of the
  // tensor-parallel weights (q/k/v/o, the dense MLPs, the embedding and an untied lm_head).
  int64_t tp_sliced = c.vocab_size * c.hidden_size * (c.tie_word_embeddings ? 1 : 2);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    tp_sliced += c.hidden_size * (2 * c.q_dim() + 2 * c.kv_dim()) +
                 (c.is_moe_layer(l) ? 0 : 3 * c.intermediate_size * c.hidden_size);
  const int64_t rank_params =
      p.params - p.expert_params + p.expert_params / expert_parallel - tp_sliced + tp_sliced / tp;
  const int64_t shard_params = p.shard_params = (rank_params + dp_shard - 1) / dp_shard;
  p.param_bytes = shard_params * 4;
  p.grad_bytes = shard_params * 4;
  p.optimizer_bytes = shard_params * 8;  // AdamW exp_avg + exp_avg_sq, f32
  if (dp_shard > 1) {
    // FSDP gathers one layer group at a time (the largest: the embedding) for compute.
    const int64_t biggest = std::max(lc.vocab_size * c.hidden_size, lc.params_per_layer());
    p.param_bytes += biggest * 4;
    p.grad_bytes += biggest * 4;
  }
  // Saved activations per layer (f32), as Qwen3Model plans them (one rank's heads and MLP slice) with the
  // default tiled attention (one logsumexp per row and head, no [T, T] probabilities), plus the logits.
  // Under sequence parallel the residual stream (layer inputs, resid_mid, the norms' rstd) and the saved norm
  // outputs ln1, ln2 (re-gathered in backward) hold N / tp rows.
  const int64_t N = local_batch * seq_len, Nl = sp ? N / tp : N, H = c.hidden_size, I = lc.intermediate_size;
  const int64_t per_layer = Nl * H * 4 + Nl * 2 + N * lc.q_dim() * 3 + N * lc.kv_dim() * 3 +
                            N * (lc.num_attention_heads + lc.num_key_value_heads) +
                            N * lc.num_attention_heads + N * 3 * I;
  const int64_t every = checkpointing.every;
  const int64_t checkpointed = every > 0 ? c.num_hidden_layers / every : 0;
  const int64_t layers_saved = c.num_hidden_layers - checkpointed + (checkpointed > 0 ? 1 : 0);
  const int64_t checkpointed_inputs = checkpointed * Nl * H;
  const int64_t scratch =
      N * (3 * H + 2 * lc.q_dim() + 3 * lc.kv_dim() + 3 * I) + (sp ? Nl * H + 2 * N * H : 0);
  // Selective 'op': the saved layers keep ln1, ln2, q/k after norm + RoPE and act in one shared block.
  const int64_t pointwise = 2 * Nl * H + N * (lc.q_dim() + lc.kv_dim() + I);
  const int64_t op_layers = checkpointing.recompute_ops ? c.num_hidden_layers - checkpointed : 0;
  const int64_t recomputed = op_layers > 0 ? (op_layers - 1) * pointwise : 0;
  p.activation_bytes =
      4 * (layers_saved * per_layer - recomputed + checkpointed_inputs + scratch +
           std::min<int64_t>(N * lc.vocab_size, Qwen3Model::kHeadChunkBytes / 4));  // one logits chunk
  if (tp > 1) {
    // Collectives on (N, H) f32 per micro-batch, in units of (tp - 1) / tp of the buffer sent per rank (a
    // ring all-gather or reduce-scatter; an all-reduce is two). Without sequence parallel: an all-reduce
    // after o_proj and down_proj (forward) and q/k/v and gate/up (backward). With it, an all-gather before
    // and a reduce-scatter after each parallel block instead, and in backward the saved norm outputs
    // re-gathered and d(output) gathered for the row-parallel GEMMs; sparse layers run replicated gather ln2
    // and d(output), those with the experts over the group neither. A recomputed layer repeats its
    // forward's. The embedding and lm_head: 4 units either way.
    double units = 4;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const bool moe = c.is_moe_layer(l), local = p.experts_over_tensor_parallel;
      const int fwd = !sp ? (moe ? 2 : 4) : moe ? (local ? 2 : 3) : 4;
      const int bwd = !sp ? (moe ? 2 : 4) : moe ? (local ? 3 : 4) : 6;
      units += fwd * (1 + (every > 0 && (l + 1) % every == 0 ? 1 : 0)) + bwd;
    }
    p.tp_comm_bytes = units * 4.0 * N * H * (tp - 1) / tp * p.grad_accum;
  }
  return p;
}

std::string RunPlan::describe() const {
  std::ostringstream os;
  os << "parameters: " << human(params) << " (" << human(non_embedding_params) << " non-embedding)\n"
     << "training FLOPs/token: " << human(flops_per_token) << " (" << flops_per_token / 1e9 << " GFLOP)\n"
     << "world " << world << " = data_parallel_replicate " << dp_replicate << " x data_parallel_shard "
     << dp_shard;
  if (tensor_parallel > 1)
    os << " x tensor_parallel " << tensor_parallel
       << " (attention heads, MLP and vocabulary slices per rank; "
       << gib(static_cast<int64_t>(tp_comm_bytes))
       << " sent per rank per step in tensor-parallel collectives; sequence parallel "
       << (sequence_parallel ? "on" : "off") << ")";
  if (expert_parallel > 1)
    os << ", experts split over " << expert_parallel
       << " ranks (expert_parallel_degree): " << human(expert_params / expert_parallel) << " of "
       << human(expert_params) << " expert parameters per rank";
  os << "\nbatch: local " << local_batch << " x seq " << seq_len << ", global " << global_batch
     << ", gradient accumulation " << grad_accum << " steps, " << global_batch * seq_len << " tokens/step\n"
     << "memory per rank: parameters " << gib(param_bytes) << ", gradients " << gib(grad_bytes)
     << ", optimizer " << gib(optimizer_bytes) << ", activations " << gib(activation_bytes) << ", total "
     << gib(total_bytes());
  return os.str();
}

}  // namespace titan
