// One object for every data-parallel layout a config can ask for, torchtitan-style:
// data_parallel_replicate_degree (R) x data_parallel_shard_degree (S) = world size.
//
//   R = world, S = 1   DDP   (replicated parameters, bucketed all-reduce of gradients)
//   R = 1, S = world   FSDP  (ZeRO-3 layout: every buffer sharded over all ranks)
//   R > 1, S > 1       HSDP  (sharded within groups of S consecutive ranks, replicated across them)
//
// The trainer's step, the same for all three:
//   DataParallelPlan dp(world, R, S, model.flat_params(), model.flat_grads());
//   AdamW opt(dp.optimizer_params(), dp.optimizer_grads(), cfg);   // full buffers or shards
//   loop: model.zero_grad(); forward/backward on this rank's micro-batches;
//         dp.reduce_grads();                 // gradients averaged over all ranks
//         double norm = dp.grad_norm();
//         opt.step(lr, clip_coefficient(norm, max_norm));   // clipping fused into the update
//         dp.after_optimizer_step();         // FSDP/HSDP: gather the updated shards into the model
//
// reduce_grads() averages over ranks, so each rank's loss gradient must be scaled as a mean over its
// own tokens (ForwardOptions::grad_scale = 0 with equal token counts per rank). With unequal counts
// (ignored labels), use grad_scale = world_size / global_valid_tokens (all-reduce the counts first).
//
// Expert parallel (ExpertParallelLayout, with DDP): the tail of some buffers holds this rank's slice of
// the experts (Qwen3Model::expert_offsets()). Non-expert elements are averaged over the whole world;
// expert elements already hold the gradients of every token of the expert group (e ranks), so they are
// summed over the ranks holding the same experts (world / e, one per group) and divided by the world
// size: the same mean as the 1-rank run. Clipping counts each expert once (the expert part of the
// squared norm is summed over the expert group).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "distributed/data_parallel.h"

namespace titan::dist {

struct ExpertParallelLayout {
  std::shared_ptr<ProcessGroup> group;  // the expert group (dist::make_expert_group); nullptr: none
  std::vector<int64_t> expert_offset;   // per buffer: where its expert elements start (numel: none)
};

class DataParallelPlan {
 public:
  // shard_degree < 0: world / replicate_degree. Parameters must be equal on all ranks, or call
  // broadcast_from(0) first. Collective (HSDP creates sub-groups).
  // stream_params (FSDP/HSDP only; ignored otherwise): ZeRO-3 memory. The parameters are broadcast from
  // rank 0 and sharded here; the plan then keeps no reference to the full buffers (the caller drops
  // them) and hands out gathered groups and gradient buffers on demand (gather_params, grad_buffer,
  // reduce_grads(g): a model's ParamStreamer).
  DataParallelPlan(ProcessGroup& world, int replicate_degree, int shard_degree, std::vector<Tensor> params,
                   std::vector<Tensor> grads, int64_t bucket_bytes = int64_t(25) << 20,
                   bool stream_params = false, ExpertParallelLayout expert = {});
  int expert_parallel_degree() const { return ep_group_ ? ep_group_->size() : 1; }

  int world_rank() const { return world_.rank(); }
  int replicate_degree() const { return replicate_; }
  int shard_degree() const { return shard_; }
  const char* mode() const;      // "single", "ddp", "fsdp" or "hsdp"
  std::string describe() const;  // e.g. "hsdp: 2 replicas x 4 shards"

  // What the optimizer steps: the full buffers (single, DDP) or this rank's shards (FSDP, HSDP).
  std::vector<Tensor>& optimizer_params();
  std::vector<Tensor>& optimizer_grads();
  // The group over which optimizer_grads() are partitioned (nullptr when replicated).
  ProcessGroup* grad_shard_group();

  // Where optimizer_params()[g] sits in the full buffer g: elements [optimizer_offset(g),
  // optimizer_offset(g) + optimizer_count(g)); the count excludes shard padding. Single/DDP: all of it.
  int64_t optimizer_offset(int g) const;
  int64_t optimizer_count(int g) const;
  // True on the ranks whose optimizer state is the copy a checkpoint saves: rank 0 for single/DDP, the
  // shard group of the first replica (world ranks 0..S-1) for FSDP/HSDP.
  bool saves_state() const;
  // Expert parallel: true on the ranks whose expert slices a checkpoint saves (the first expert group,
  // world ranks 0..e-1); without expert parallel the same as saves_state().
  bool saves_expert_state() const;

  // ZeRO-3 streaming (stream_params): only the shards persist.
  bool streams_params() const { return stream_; }
  Tensor gather_params(int g);  // all-gather group g into a pooled full buffer
  void release_params(int g);   // the buffer goes back to the pool
  Tensor grad_buffer(int g);    // a zeroed full gradient buffer for group g
  void reduce_grads(int g);     // reduce-scatter (accumulating) into the shard gradients; drops the buffer
  void zero_grads();            // shard gradients := 0 (start of an accumulation window)

  // Makes every rank's parameters (and shards) equal to rank `root`'s.
  void broadcast_from(int root);
  // After backward: optimizer_grads() := mean over all ranks of the model gradients (streaming: already
  // done group by group during the backward; nothing left to do).
  void reduce_grads();
  // The global gradient norm of optimizer_grads() (all ranks; experts counted once).
  double grad_norm();
  // grad_norm()'s square left on the device in *sq (one f64; nothing waits for it: compile mode): each
  // rank's sum of squares, summed over the shard group by a collective on the device. Not with expert
  // parallel.
  void grad_sq_norm_device(double* sq);
  // Global-norm clipping of optimizer_grads() in place; returns the norm before clipping.
  double clip_grad_norm(double max_norm);
  // After the optimizer step: FSDP/HSDP gather the shards into the model's parameter buffers.
  void after_optimizer_step();

 private:
  ProcessGroup& world_;
  int replicate_ = 1, shard_ = 1;
  bool stream_ = false;
  std::vector<Tensor> params_, grads_;
  HsdpMesh mesh_;
  std::unique_ptr<DdpReducer> ddp_;
  std::unique_ptr<FsdpShards> fsdp_;
  // Expert parallel: views of the non-expert and expert parts of the buffers.
  std::shared_ptr<ProcessGroup> ep_group_, expert_replicate_;
  std::vector<Tensor> dense_params_, dense_grads_, expert_params_, expert_grads_;
  Tensor ep_sq_;  // (2, f64) grad_sq_norm_device's dense and expert sums under expert parallel
  std::unique_ptr<DdpReducer> expert_ddp_;
};

}  // namespace titan::dist
