// DataParallelPlan: DDP, FSDP or HSDP from the replicate x shard degrees.
#include "dist/data_parallel_plan.h"

#include <algorithm>

#include "core/error.h"

namespace titan::dist {

DataParallelPlan::DataParallelPlan(ProcessGroup& world, int replicate_degree, int shard_degree,
                                   std::vector<Tensor> params, std::vector<Tensor> grads,
                                   int64_t bucket_bytes, bool stream_params)
    : world_(world), params_(std::move(params)), grads_(std::move(grads)) {
  const int n = world.size();
  TITAN_CHECK(replicate_degree >= 1, "data_parallel_replicate_degree must be >= 1, got ", replicate_degree);
  if (shard_degree < 0) {
    TITAN_CHECK(n % replicate_degree == 0, "data_parallel_replicate_degree ", replicate_degree,
                " does not divide the world size ", n);
    shard_degree = n / replicate_degree;
  }
  TITAN_CHECK(replicate_degree * shard_degree == n, "data_parallel_replicate_degree ", replicate_degree,
              " x data_parallel_shard_degree ", shard_degree, " must equal the world size ", n);
  replicate_ = replicate_degree;
  shard_ = shard_degree;
  if (n == 1 || shard_ == 1) {
    ddp_ = std::make_unique<DdpReducer>(world, grads_, bucket_bytes);
  } else if (stream_params) {
    // ZeRO-3: shards of rank 0's values; no reference to the full buffers is kept.
    stream_ = true;
    broadcast_tensors(world, params_, 0);
    std::vector<int64_t> numels;
    for (auto& p : params_) numels.push_back(p.numel());
    if (replicate_ > 1) mesh_ = make_hsdp_mesh(world, shard_);
    fsdp_ = replicate_ > 1 ? std::make_unique<FsdpShards>(*mesh_.shard, numels, mesh_.replicate.get())
                           : std::make_unique<FsdpShards>(world, numels);
    fsdp_->load_shards(params_);
    params_.clear();
    grads_.clear();
  } else if (replicate_ == 1) {
    fsdp_ = std::make_unique<FsdpShards>(world, params_, grads_);
  } else {
    mesh_ = make_hsdp_mesh(world, shard_);
    fsdp_ = std::make_unique<FsdpShards>(*mesh_.shard, params_, grads_, mesh_.replicate.get());
  }
}

const char* DataParallelPlan::mode() const {
  if (world_.size() == 1) return "single";
  if (ddp_) return "ddp";
  return replicate_ == 1 ? "fsdp" : "hsdp";
}

std::string DataParallelPlan::describe() const {
  return str_cat(mode(), ": ", replicate_, " replica(s) x ", shard_, " shard(s)");
}

std::vector<Tensor>& DataParallelPlan::optimizer_params() {
  return fsdp_ ? fsdp_->shard_params() : params_;
}
std::vector<Tensor>& DataParallelPlan::optimizer_grads() {
  return fsdp_ ? fsdp_->shard_grads() : grads_;
}
ProcessGroup* DataParallelPlan::grad_shard_group() {
  return fsdp_ ? &fsdp_->shard_group() : nullptr;
}

int64_t DataParallelPlan::optimizer_offset(int g) const {
  return fsdp_ ? std::min(fsdp_->shard_offset(g), fsdp_->group_numel(g)) : 0;
}

int64_t DataParallelPlan::optimizer_count(int g) const {
  return fsdp_ ? fsdp_->shard_valid(g) : params_[g].numel();
}

Tensor DataParallelPlan::gather_params(int g) {
  TITAN_CHECK(stream_, "gather_params: the plan does not stream parameters");
  fsdp_->gather_params(g);
  return fsdp_->full_params(g);
}

void DataParallelPlan::release_params(int g) {
  fsdp_->release_params(g);
}

Tensor DataParallelPlan::grad_buffer(int g) {
  TITAN_CHECK(stream_, "grad_buffer: the plan does not stream parameters");
  return fsdp_->full_grads(g);
}

void DataParallelPlan::reduce_grads(int g) {
  fsdp_->reduce_scatter_grads(g, /*accumulate=*/true);
}

void DataParallelPlan::zero_grads() {
  for (auto& t : fsdp_->shard_grads()) t.zero_();
}

bool DataParallelPlan::saves_state() const {
  // HSDP mesh: world rank = replica * shard_degree + shard rank.
  return fsdp_ ? world_.rank() < shard_ : world_.rank() == 0;
}

void DataParallelPlan::broadcast_from(int root) {
  if (stream_) return;  // sharded from rank 0's values at construction
  broadcast_tensors(world_, params_, root);
  if (fsdp_) fsdp_->load_shards(params_);
}

void DataParallelPlan::reduce_grads() {
  if (stream_) return;
  if (ddp_) {
    if (world_.size() > 1) ddp_->all_reduce_mean();
  } else {
    fsdp_->reduce_scatter_all_grads();
  }
}

double DataParallelPlan::clip_grad_norm(double max_norm) {
  return dist::clip_grad_norm(optimizer_grads(), max_norm, grad_shard_group());
}

void DataParallelPlan::after_optimizer_step() {
  if (fsdp_ && !stream_) fsdp_->gather_all_params();
}

}  // namespace titan::dist
