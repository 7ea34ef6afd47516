#include "train/plan.h"

#include <cstdio>
#include <sstream>

#include "core/error.h"
#include "distributed/pipeline_layout.h"
#include "distributed/tensor_parallel.h"

namespace titan {

using dist::pipeline_schedule_name;

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
                  int64_t expert_parallel, int64_t tensor_parallel, bool sequence_parallel,
                  const dist::PipelineOptions& pipeline, int64_t context_parallel, bool bf16_compute) {
  RunPlan p;
  p.world = world;
  p.dp_replicate = dp_replicate;
  p.dp_shard = dp_shard;
  const int64_t tp = p.tensor_parallel = tensor_parallel;
  const bool sp = p.sequence_parallel = sequence_parallel && tp > 1;
  const int64_t cp = p.context_parallel = context_parallel, pp = pipeline.degree;
  TITAN_CHECK(cp >= 1, "parallelism.context_parallel_degree must be >= 1, got ", cp);
  TITAN_CHECK(pp >= 1, "parallelism.pipeline_parallel_degree must be >= 1, got ", pp);
  TITAN_CHECK(dp_replicate * dp_shard * tp * pp * cp == world,
              "parallelism: data_parallel_replicate_degree (", dp_replicate,
              ") x data_parallel_shard_degree (", dp_shard, ") x tensor_parallel_degree (", tp,
              ") x pipeline_parallel_degree (", pp, ") x context_parallel_degree (", cp,
              ") must equal the world size (", world, ")");
  // Causal load balance: the sequence is cut into 2 cp chunks, rank r taking chunks r and 2 cp - 1 - r.
  TITAN_CHECK(cp == 1 || seq_len >= 2 * cp, "parallelism.context_parallel_degree = ", cp,
              " splits training.seq_len = ", seq_len, " into 2 x ", cp, " = ", 2 * cp,
              " chunks (two mirrored chunks per rank): seq_len must be at least ", 2 * cp);
  p.pipeline = dist::make_pipeline_layout(c.num_hidden_layers, local_batch, pipeline);
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
    // (Context parallel: the ranks of the data-parallel x context-parallel group, each routing its chunks.)
    p.experts_over_tensor_parallel = sp && e == tp;
    TITAN_CHECK(
        p.experts_over_tensor_parallel || dp * cp % e == 0, "parallelism.expert_parallel_degree = ", e,
        " does not divide the data-parallel degree ", dp * cp,
        cp > 1 ? str_cat(" (data-parallel ", dp, " x context_parallel_degree ", cp, ")") : std::string(),
        tp > 1 ? str_cat(" (world size / tensor_parallel_degree: experts are split over the ranks holding "
                         "the same tensor-parallel slice, or, with sequence parallel and "
                         "expert_parallel_degree = tensor_parallel_degree = ",
                         tp, ", over the tensor-parallel group)")
               : std::string());
    // (Experts over the tensor-parallel group are the rank's own parameters to the data-parallel plan, which
    // then shards them like the rest.)
    TITAN_CHECK(
        dp_shard == 1 || p.experts_over_tensor_parallel, "parallelism.expert_parallel_degree = ", e,
        " works with DDP only: set parallelism.data_parallel_replicate_degree = the data-parallel size (",
        dp_replicate * dp_shard, ") so that data_parallel_shard_degree = 1 (got ", dp_shard,
        "; FSDP/HSDP with expert parallel is supported only with the experts over the tensor-parallel "
        "group: tensor_parallel_degree = expert_parallel_degree with sequence parallel)");
  }
  // Parameters held per rank: 1/expert_parallel of the experts, 1/tp of the tensor-parallel weights (q/k/v/o,
  // the dense MLPs, the embedding and an untied lm_head), everything else whole; under pipeline parallel
  // only the rank's stages (a tied lm_head is the embedding's copy on the last stage).
  const int64_t H = c.hidden_size, emb = lc.vocab_size * H;
  auto layer_params = [&](int64_t l) {
    const bool moe = c.is_moe_layer(l);
    const int64_t sliced = H * (2 * c.q_dim() + 2 * c.kv_dim()) + (moe ? 0 : 3 * c.intermediate_size * H);
    const int64_t experts = moe ? c.num_experts * 3 * c.moe_intermediate_size * H : 0;
    return c.params_of_layer(l) - sliced - experts + sliced / tp + experts / expert_parallel;
  };
  // Saved activations per layer (f32), as Qwen3Model plans them (one rank's heads and MLP slice) with the
  // default tiled attention (one logsumexp per row and head, no [T, T] probabilities), plus the logits. N:
  // the tokens of one forward on this rank (a micro-batch under pipeline parallel; 1/cp of each sequence
  // under context parallel). Under sequence parallel the residual stream (layer inputs, resid_mid, the
  // norms' rstd) and the saved norm outputs ln1, ln2 (re-gathered in backward) hold N / tp rows.
  const int64_t rows = pp > 1 ? pipeline.microbatch_size : local_batch;
  const int64_t N = rows * ((seq_len + cp - 1) / cp), Nl = sp ? N / tp : N, I = lc.intermediate_size;
  const int64_t forwards = (local_batch / rows) * p.grad_accum;  // per step on this rank
  // Attention's saved tensors: f32 q_raw, k_raw, the output and q/k after norm + RoPE and v; with bf16
  // attention q/k/v after RoPE become scratch shared by the layers, bf16 q/k/v and the output (half a float
  // each) are saved instead, and o_proj reads the bf16 output (no f32 copy; a LoRA adapter on o_proj keeps
  // one, N x q_dim floats more per layer).
  const bool attn16 = p.bf16_attention = bf16_compute && cp == 1;
  // q and k before their norms (q_raw, k_raw): bf16 under bf16 compute too (half a float each).
  const bool qk16 = p.bf16_qk = bf16_compute;
  const int64_t qk_raw = qk16 ? (N * (lc.q_dim() + lc.kv_dim()) + 1) / 2 : N * (lc.q_dim() + lc.kv_dim());
  const int64_t attn_qkv =
      qk_raw + (attn16 ? N * lc.q_dim() + N * lc.kv_dim() : N * lc.q_dim() * 2 + N * lc.kv_dim() * 2);
  // The MLP's gate/up and act: f32, or under bf16 compute bf16 (half a float each) in dense models.
  const bool mlp16 = p.bf16_mlp = bf16_compute && !c.is_moe();
  const int64_t mlp_acts = mlp16 ? (N * 3 * I + 1) / 2 : N * 3 * I, act = mlp16 ? (N * I + 1) / 2 : N * I;
  // The norm outputs ln1, ln2 (GEMM inputs only): bf16 under bf16 compute without sequence parallel (whose
  // all-gathers move them as f32); ln2 only in dense models (a sparse layer's router and experts read f32).
  const bool ln16 = p.bf16_norms = bf16_compute && !sp;
  const int64_t ln1 = ln16 ? (Nl * H + 1) / 2 : Nl * H, ln2 = ln16 && mlp16 ? (Nl * H + 1) / 2 : Nl * H;
  // The residual stream (a layer's input and resid_mid): bf16 with the norm outputs, but for each stage's
  // first layer's input (the embedding or the previous stage's output, f32); o_proj's and the MLP's output
  // then go through one f32 (N, H) buffer before their residual add.
  const bool resid16 = p.bf16_residual = ln16;
  const int64_t resid = resid16 ? (Nl * H + 1) / 2 : Nl * H;
  const int64_t per_layer = resid * 2 + ln1 + ln2 + Nl * 2 + attn_qkv +
                            N * (lc.num_attention_heads + lc.num_key_value_heads) +
                            N * lc.num_attention_heads + mlp_acts;
  const int64_t every = checkpointing.every;
  auto checkpointed = [&](int64_t l) { return every > 0 && (l + 1) % every == 0; };
  // (d(gate/up) of a dense layer: bf16 where its norm output is, bf16_mlp and bf16_norms)
  const int64_t scratch =
      N * (3 * H + 2 * lc.q_dim() + 3 * lc.kv_dim() + (mlp16 && ln16 ? 2 : 3) * I) +
      (sp ? Nl * H + 2 * N * H : 0) + (resid16 ? N * H : 0) +
      (pp > 1 ? 2 * Nl * H : 0) +           // the stage's received input and sent output
      (cp > 1 ? 4 * N * lc.kv_dim() : 0) +  // the ring's K/V chunks (double-buffered)
      // bf16 attention: datt/dq/dk/dv in bf16 (q/k come from qk_norm_rope, v from its
      // GEMM as bf16) in place of the f32 dq/dk RoPE's backward wrote into; with bf16
      // norm outputs the q/k projections' gradients bf16 too, read by their GEMMs with
      // dv as they are (no f32 d(q/k/v))
      (attn16 && qk16 && ln16 ? (N * (lc.q_dim() + lc.kv_dim()) + 1) / 2 - N * (lc.q_dim() + 2 * lc.kv_dim())
       : attn16 && qk16       ? 0
       : attn16               ? N * (2 * lc.q_dim() + 2 * lc.kv_dim())
                              : 0);
  // Selective 'op': the saved layers keep ln1, ln2, q/k after norm + RoPE (f32 attention: the bf16 copies
  // are GEMM-like saves) and act in one shared block.
  const int64_t pointwise = ln1 + ln2 + N * (attn16 ? 0 : lc.q_dim() + lc.kv_dim()) + act;
  const int64_t logits = std::min<int64_t>(N * lc.vocab_size, Qwen3Model::kHeadChunkBytes / 4);
  // Collectives on (N, H) f32 per forward, in units of (tp - 1) / tp of the buffer sent per rank (a ring
  // all-gather or reduce-scatter; an all-reduce is two). Without sequence parallel: an all-reduce after
  // o_proj and down_proj (forward) and q/k/v and gate/up (backward). With it, an all-gather before and a
  // reduce-scatter after each parallel block instead, and in backward the saved norm outputs re-gathered and
  // d(output) gathered for the row-parallel GEMMs; sparse layers run replicated gather ln2 and d(output),
  // those with the experts over the group neither. A recomputed layer repeats its forward's. The embedding
  // and lm_head: 2 units each.
  auto tp_units = [&](int64_t l) {
    const bool moe = c.is_moe_layer(l), local = p.experts_over_tensor_parallel;
    const int fwd = !sp ? (moe ? 2 : 4) : moe ? (local ? 2 : 3) : 4;
    const int bwd = !sp ? (moe ? 2 : 4) : moe ? (local ? 3 : 4) : 6;
    return fwd * (1 + (checkpointed(l) ? 1 : 0)) + bwd;
  };
  // Ring attention per layer and forward: each rank passes K and V chunks on cp - 1 times in forward, K, V,
  // dK and dV in backward (a recomputed layer repeats its forward's).
  // Ring traffic of a layer in units of the rank's K or V block (N x kv_dim floats): K and V go cp - 1 hops
  // in forward (again when the layer is recomputed) and in backward, where their gradients go cp hops (the
  // last one brings them home).
  auto cp_units = [&](int64_t l) { return (4.0 + (checkpointed(l) ? 2 : 0)) * (cp - 1) + 2.0 * cp; };
  // FSDP over dp_shard x cp (torchtitan's dp_shard_cp); expert parallel keeps DDP over the context-parallel
  // ranks too (its experts are split, the rest replicated).
  const int64_t shard_over =
      expert_parallel > 1 && !p.experts_over_tensor_parallel ? dp_shard : dp_shard * cp;
  int64_t worst = -1;
  for (int64_t r = 0; r < pp; ++r) {
    RunPlan::PipelineRank pr;
    int64_t params = 0, ckpt = 0, saved = 0, stage_inputs = 0;
    double units = 0, ring = 0, sends = 0;
    bool head = false;
    for (int64_t s : p.pipeline.stages_of(r)) {
      const dist::PipelineStage& st = p.pipeline.stages[s];
      head = head || st.head;
      if (st.embedding) params += emb, units += 2;
      if (st.head) params += H + (!c.tie_word_embeddings || !st.embedding ? emb : 0), units += 2;
      sends += (st.head ? 0 : 1) + (st.embedding ? 0 : 1);
      stage_inputs += st.num_layers > 0;
      for (int64_t l = st.first_layer; l < st.first_layer + st.num_layers; ++l) {
        params += layer_params(l);
        units += tp_units(l);
        ring += cp_units(l);
        (checkpointed(l) ? ckpt : saved) += 1;
      }
    }
    pr.layers = ckpt + saved;
    pr.inflight = p.pipeline.peak_inflight(r);
    pr.shard_params = (params + shard_over - 1) / shard_over;
    pr.param_bytes = pr.grad_bytes = pr.shard_params * 4;
    pr.optimizer_bytes = pr.shard_params * 8;  // AdamW exp_avg + exp_avg_sq, f32
    if (shard_over > 1) {
      // FSDP gathers one layer group at a time (the largest: the embedding) for compute.
      const int64_t biggest = std::max(emb, lc.params_per_layer());
      pr.param_bytes += biggest * 4;
      pr.grad_bytes += biggest * 4;
    }
    // Per forward in flight: the saved layers' activations (less the pointwise outputs selective 'op'
    // recomputes) and the checkpointed layers' inputs; once: the buffer a checkpointed layer is recomputed
    // into, the shared pointwise block, the scratch, and on the last stage one logits chunk.
    const int64_t kept = saved * per_layer - (checkpointing.recompute_ops ? saved * pointwise : 0) +
                         ckpt * resid + stage_inputs * (Nl * H - resid);
    const int64_t once = (ckpt > 0 ? per_layer : 0) +
                         (checkpointing.recompute_ops && saved > 0 ? pointwise : 0) + scratch +
                         (head ? logits : 0);
    pr.activation_bytes = 4 * (static_cast<int64_t>(pr.inflight * (double)kept) + once);
    pr.pp_comm_bytes = sends * 4.0 * Nl * H * forwards;
    pr.tp_comm_bytes = tp > 1 ? units * 4.0 * N * H * (tp - 1) / tp * forwards : 0;
    pr.cp_comm_bytes = cp > 1 ? ring * 4.0 * N * lc.kv_dim() * forwards : 0;
    if (r == 0 || pr.total_bytes() > p.per_stage_rank[worst].total_bytes()) worst = r;
    p.per_stage_rank.push_back(pr);
  }
  const RunPlan::PipelineRank& w = p.per_stage_rank[worst];
  p.shard_params = w.shard_params;
  p.param_bytes = w.param_bytes;
  p.grad_bytes = w.grad_bytes;
  p.optimizer_bytes = w.optimizer_bytes;
  p.activation_bytes = w.activation_bytes;
  p.pp_comm_bytes = w.pp_comm_bytes;
  p.tp_comm_bytes = w.tp_comm_bytes;
  p.cp_comm_bytes = w.cp_comm_bytes;
  return p;
}

std::string RunPlan::bf16_activations() const {
  std::string parts;
  for (auto [on, what] : {std::pair{bf16_attention, "attention"},
                          {bf16_qk, "q/k projections"},
                          {bf16_mlp, "MLP"},
                          {bf16_norms, "norm outputs"},
                          {bf16_residual, "residual stream"}})
    if (on) parts += (parts.empty() ? "" : ", ") + std::string(what);
  return parts.empty() ? "" : " (bf16: " + parts + ")";
}

std::string RunPlan::describe() const {
  std::ostringstream os;
  os << "parameters: " << human(params) << " (" << human(non_embedding_params) << " non-embedding)\n"
     << "training FLOPs/token: " << human(flops_per_token) << " (" << flops_per_token / 1e9 << " GFLOP)\n"
     << "world " << world << " = data_parallel_replicate " << dp_replicate << " x data_parallel_shard "
     << dp_shard;
  if (pipeline.degree > 1) os << " x pipeline_parallel " << pipeline.degree;
  if (context_parallel > 1) os << " x context_parallel " << context_parallel;
  if (tensor_parallel > 1)
    os << " x tensor_parallel " << tensor_parallel
       << " (attention heads, MLP and vocabulary slices per rank; "
       << gib(static_cast<int64_t>(tp_comm_bytes))
       << " sent per rank per step in tensor-parallel collectives; sequence parallel "
       << (sequence_parallel ? "on" : "off") << ")";
  if (expert_parallel > 1)
    os << ", experts split over " << expert_parallel
       << " ranks (expert_parallel_degree): " << human(expert_params / expert_parallel) << " of "
       << human(expert_params) << " expert parameters per rank"
       << (pipeline.degree > 1 ? " over all layers (a pipeline rank: its stages' share)" : "");
  os << "\nbatch: local " << local_batch << " x seq " << seq_len << ", global " << global_batch
     << ", gradient accumulation " << grad_accum << " steps, " << global_batch * seq_len << " tokens/step\n"
     << "memory per rank: parameters " << gib(param_bytes) << ", gradients " << gib(grad_bytes)
     << ", optimizer " << gib(optimizer_bytes) << ", activations " << gib(activation_bytes)
     << bf16_activations() << ", total " << gib(total_bytes());
  if (pipeline.degree > 1) {
    const int64_t p = pipeline.degree, m = pipeline.microbatches, v = pipeline.stages_per_rank();
    char bubble[64];
    std::snprintf(bubble, sizeof bubble, "%.1f%%", 100.0 * pipeline.bubble_fraction());
    os << " (the largest pipeline rank)\npipeline: " << pipeline_schedule_name(pipeline.schedule) << ", "
       << pipeline.stages.size() << " stages (" << v << " per rank), " << m << " micro-batches of "
       << pipeline.microbatch_size << " x " << seq_len << " tokens per accumulation step; bubble " << bubble
       << " of the step ((p - 1) / (" << (v > 1 ? "v m" : "m") << " + p - 1) = " << p - 1 << " / "
       << v * m + p - 1 << "); " << gib(static_cast<int64_t>(pp_comm_bytes))
       << " sent per rank per step between stages (activations forward, their gradients backward)\n"
       << pipeline.describe();
    for (size_t r = 0; r < per_stage_rank.size(); ++r) {
      const PipelineRank& pr = per_stage_rank[r];
      char inflight[32];
      std::snprintf(inflight, sizeof inflight, "%g", pr.inflight);
      os << "\n  pipeline rank " << r << ": " << pr.layers << " layers, " << inflight
         << (pr.inflight == 1 ? " micro-batch" : " micro-batches") << " in flight at peak: parameters "
         << gib(pr.param_bytes) << ", gradients " << gib(pr.grad_bytes) << ", optimizer "
         << gib(pr.optimizer_bytes) << ", activations " << gib(pr.activation_bytes) << ", total "
         << gib(pr.total_bytes());
    }
  }
  if (context_parallel > 1)
    os << "\ncontext parallel: each sequence split over " << context_parallel << " ranks (chunks r and "
       << 2 * context_parallel << " - 1 - r of " << 2 * context_parallel
       << ", causal load balance), ring attention: " << gib(static_cast<int64_t>(cp_comm_bytes))
       << " of K/V and dK/dV sent per rank per step; parameters sharded over data_parallel_shard x "
          "context_parallel";
  return os.str();
}

}  // namespace titan
