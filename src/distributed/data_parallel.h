// Data-parallel building blocks over flat parameter/gradient buffers (one buffer per layer group, as
// Qwen3Model::flat_params()/flat_grads() hands them out):
//
//   DDP   DdpReducer          bucketed all-reduce (average) of replicated gradients
//   FSDP  FsdpShards          ZeRO-3 sharding: each rank owns 1/N of every buffer; all-gather before use,
//                             reduce-scatter (average) gradients into the shard, sharded AdamW
//   HSDP  make_hsdp_mesh      replicate x shard mesh; FsdpShards(mesh.shard, ..., mesh.replicate.get())
//   clip  dist::clip_grad_norm global-norm clipping across ranks
//
// A DDP step (the trainer):
//   DdpReducer ddp(world, model.flat_grads(), 25 << 20);
//   AdamW opt(model.flat_params(), model.flat_grads(), cfg);
//   loop: model.zero_grad(); forward/backward (local micro-batches; loss scaled as the local mean);
//         ddp.all_reduce_mean();  norm = dist::clip_grad_norm(model.flat_grads(), max_norm, nullptr);
//         opt.step(lr);
//
// An FSDP step (model keeps full-size buffers; the optimizer state and gradients live in shards):
//   FsdpShards fsdp(world, model.flat_params(), model.flat_grads());   // copies this rank's slices
//   AdamW opt(fsdp.shard_params(), fsdp.shard_grads(), cfg);           // state is 1/N per rank
//   loop: model.zero_grad(); forward/backward;
//         fsdp.reduce_scatter_all_grads();     // full grads -> averaged shard grads
//         norm = dist::clip_grad_norm(fsdp.shard_grads(), max_norm, &fsdp.shard_group());
//         opt.step(lr);
//         fsdp.gather_all_params();            // updated shards -> full params for the next forward
// Per-group gather_params(g) / reduce_scatter_grads(g) / release_params(g) let a layer loop gather just
// before a layer's forward and free right after (ZeRO-3 memory); the buffers are then owned here
// (FsdpShards(pg, numels) constructor) and handed out by full_params(g) / full_grads(g).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "distributed/process_group.h"

namespace titan::dist {

// ---- DDP ----

class DdpReducer {
 public:
  // grads: f32 gradient buffers, identical in shape on every rank. Small neighbours share one bucket
  // (copied through a staging buffer); large buffers are reduced in place in bucket-sized chunks.
  DdpReducer(ProcessGroup& pg, std::vector<Tensor> grads, int64_t bucket_bytes = int64_t(25) << 20);
  // grads := mean over the ranks of grads (one all-reduce per bucket).
  void all_reduce_mean();
  int num_buckets() const { return int(buckets_.size()); }

 private:
  struct Segment {
    int tensor;
    int64_t offset, count;  // elements
  };
  struct Bucket {
    std::vector<Segment> segments;
    int64_t count = 0;
  };
  ProcessGroup& pg_;
  std::vector<Tensor> grads_;
  std::vector<Bucket> buckets_;
  Tensor staging_;
};

// ---- FSDP / ZeRO-3 ----

class FsdpShards {
 public:
  // Shards the given full buffers (one per layer group): this rank's shard of group g holds elements
  // [rank*s, (rank+1)*s) with s = ceil(numel/N), zero-padded past the end. The shards start as the
  // slice of full_params (all ranks must hold the same values: same seed or a broadcast). The full
  // buffers stay the caller's (e.g. the model's): gather_params writes into them, reduce_scatter reads
  // them, release_params is a no-op.
  // replicate: for HSDP, the group across which the shards are replicated (gradients are averaged over
  // it after the reduce-scatter); nullptr for plain FSDP.
  FsdpShards(ProcessGroup& shard, std::vector<Tensor> full_params, std::vector<Tensor> full_grads,
             ProcessGroup* replicate = nullptr);
  // ZeRO-3 memory mode: full buffers of these sizes are allocated by gather_params()/full_grads() and
  // dropped by release_params()/reduce_scatter_grads() (a freed buffer is re-used for the next group of
  // a fitting size). Shards start at zero: fill them with load_shards() or shard_params().
  // device: where the shards and full buffers live (the model's).
  FsdpShards(ProcessGroup& shard, const std::vector<int64_t>& group_numels, ProcessGroup* replicate = nullptr,
             Device device = Device::cpu());

  int num_groups() const { return int(numel_.size()); }
  int64_t group_numel(int g) const { return numel_[g]; }
  int64_t shard_numel(int g) const { return shard_numel_[g]; }  // padded size, equal on every rank
  int64_t shard_offset(int g) const { return shard_numel_[g] * shard_.rank(); }
  // Real (non-padding) elements of this rank's shard of group g.
  int64_t shard_valid(int g) const;

  std::vector<Tensor>& shard_params() { return shard_params_; }
  std::vector<Tensor>& shard_grads() { return shard_grads_; }
  ProcessGroup& shard_group() { return shard_; }
  ProcessGroup* replicate_group() { return replicate_; }

  // Full buffer of group g (owned mode: allocated on first use; its contents are only meaningful after
  // gather_params(g)).
  Tensor full_params(int g);
  // Full gradient buffer of group g (owned mode: allocated zeroed on first use after a reduce-scatter).
  Tensor full_grads(int g);

  // full_params(g) := concatenation of every rank's shard (all-gather, in place).
  void gather_params(int g);
  void gather_all_params();
  // Owned mode: drops the gathered full parameters of g (the memory goes back to the pool).
  void release_params(int g);
  // shard_grads[g] := (or += with accumulate) mean over the shard group of full_grads(g)'s slice, then
  // averaged over the replicate group (HSDP). Owned mode: the full gradient buffer is released.
  void reduce_scatter_grads(int g, bool accumulate = false);
  void reduce_scatter_all_grads(bool accumulate = false);
  // shards := this rank's slices of the given full buffers (e.g. a freshly loaded checkpoint).
  void load_shards(const std::vector<Tensor>& full);

 private:
  void setup(ProcessGroup* replicate);
  std::vector<int64_t> counts(int g) const;  // real elements per rank for the v-collectives
  Tensor take_buffer(int64_t numel, bool zero);
  void give_back(Tensor& t);

  ProcessGroup& shard_;
  ProcessGroup* replicate_ = nullptr;
  bool owned_ = false;
  Device device_;
  std::vector<int64_t> numel_, shard_numel_;
  std::vector<Tensor> full_params_, full_grads_, shard_params_, shard_grads_;
  std::vector<Tensor> pool_;  // released full buffers (owned mode)
  Tensor scratch_;            // reduce-scatter output when accumulating
};

// ---- HSDP mesh ----

// World ranks laid out as [replica][shard]: rank = replica * shard_size + shard_rank, so a shard group
// is shard_size consecutive ranks (one node with the default mapping) and a replicate group takes one
// rank from each. Collective over `world`.
struct HsdpMesh {
  std::shared_ptr<ProcessGroup> shard, replicate;
  int shard_size = 1, replicate_size = 1;
};
HsdpMesh make_hsdp_mesh(ProcessGroup& world, int shard_size);

// ---- replicas ----

// Every tensor := its value on rank `root` (DDP start from one rank's checkpoint or initialisation).
void broadcast_tensors(ProcessGroup& pg, const std::vector<Tensor>& tensors, int root = 0);
// True on every rank when the tensors are bit-identical on all ranks (a checksum per tensor is compared
// with max/min all-reduces): a cheap check that DDP replicas did not drift. Collective.
bool replicas_in_sync(ProcessGroup& pg, const std::vector<Tensor>& tensors);

// ---- global-norm clipping ----

// sqrt of the sum over ranks of the sum of squares of `grads`. shard_group: the group across which the
// gradients are partitioned (FSDP: fsdp.shard_group(), HSDP: mesh.shard); nullptr when every rank holds
// the same full gradients (DDP after all_reduce_mean: no communication needed).
double global_grad_norm(const std::vector<Tensor>& grads, ProcessGroup* shard_group);
// torch clip_grad_norm_ on the global norm; returns the norm before clipping; max_norm <= 0: no clip.
double clip_grad_norm(std::vector<Tensor>& grads, double max_norm, ProcessGroup* shard_group);

}  // namespace titan::dist
