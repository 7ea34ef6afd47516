// DataParallelPlan: DDP, FSDP or HSDP from the replicate x shard degrees.
#include "distributed/data_parallel_plan.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "distributed/expert_parallel.h"
#include "kernels/registry.h"
#include "optim/optimizer.h"

namespace titan::dist {

DataParallelPlan::DataParallelPlan(ProcessGroup& world, int replicate_degree, int shard_degree,
                                   std::vector<Tensor> params, std::vector<Tensor> grads,
                                   int64_t bucket_bytes, bool stream_params, ExpertParallelLayout expert)
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
  if (expert.group && expert.group->size() > 1) {
    const int e = expert.group->size();
    TITAN_CHECK(shard_ == 1, "parallelism.expert_parallel_degree = ", e,
                " works with DDP only (data_parallel_shard_degree = 1); got data_parallel_shard_degree = ",
                shard_, " (FSDP/HSDP with expert parallel is not supported yet)");
    TITAN_CHECK(expert.expert_offset.size() == grads_.size(),
                "expert parallel layout: ", expert.expert_offset.size(), " offsets for ", grads_.size(),
                " buffers");
    ep_group_ = expert.group;
    expert_replicate_ = make_expert_replicate_group(world, e);
    for (size_t g = 0; g < grads_.size(); ++g) {
      const int64_t numel = grads_[g].numel(), off = expert.expert_offset[g];
      TITAN_CHECK(off >= 0 && off <= numel, "expert parallel layout: bad offset for buffer ", g);
      if (off > 0) {
        dense_params_.push_back(params_[g].view_at(0, {off}));
        dense_grads_.push_back(grads_[g].view_at(0, {off}));
      }
      if (off < numel) {
        expert_params_.push_back(params_[g].view_at(off, {numel - off}));
        expert_grads_.push_back(grads_[g].view_at(off, {numel - off}));
      }
    }
    ddp_ = std::make_unique<DdpReducer>(world, dense_grads_, bucket_bytes);
    expert_ddp_ = std::make_unique<DdpReducer>(*expert_replicate_, expert_grads_, bucket_bytes);
  } else if (n == 1 || shard_ == 1) {
    ddp_ = std::make_unique<DdpReducer>(world, grads_, bucket_bytes);
  } else if (stream_params) {
    // ZeRO-3: shards of rank 0's values; no reference to the full buffers is kept.
    stream_ = true;
    broadcast_tensors(world, params_, 0);
    std::vector<int64_t> numels;
    for (auto& p : params_) numels.push_back(p.numel());
    if (replicate_ > 1) mesh_ = make_hsdp_mesh(world, shard_);
    const Device device = params_.empty() ? Device::cpu() : params_[0].device();
    fsdp_ = replicate_ > 1 ? std::make_unique<FsdpShards>(*mesh_.shard, numels, mesh_.replicate.get(), device)
                           : std::make_unique<FsdpShards>(world, numels, nullptr, device);
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
  if (ep_group_)
    return str_cat(mode(), ": ", replicate_, " replica(s) x ", shard_, " shard(s); experts split over ",
                   ep_group_->size(), " ranks, each slice replicated on ", expert_replicate_->size());
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

bool DataParallelPlan::saves_expert_state() const {
  return expert_replicate_ ? expert_replicate_->rank() == 0 : saves_state();
}

void DataParallelPlan::broadcast_from(int root) {
  if (stream_) return;  // sharded from rank 0's values at construction
  if (ep_group_) {
    // Experts: from the rank of this slice's replicate group that sits in root's expert group.
    broadcast_tensors(world_, dense_params_, root);
    broadcast_tensors(*expert_replicate_, expert_params_, root / ep_group_->size());
    return;
  }
  broadcast_tensors(world_, params_, root);
  if (fsdp_) fsdp_->load_shards(params_);
}

void DataParallelPlan::reduce_grads() {
  if (stream_) return;
  if (ep_group_) {
    // sum over the ranks holding these experts / world = mean over replicas / expert degree.
    ddp_->all_reduce_mean();
    if (expert_replicate_->size() > 1) expert_ddp_->all_reduce_mean();
    scale_grads(expert_grads_, 1.0f / static_cast<float>(ep_group_->size()));
    return;
  }
  if (ddp_) {
    if (world_.size() > 1) ddp_->all_reduce_mean();
  } else {
    fsdp_->reduce_scatter_all_grads();
  }
}

double DataParallelPlan::grad_norm() {
  if (ep_group_) {
    // Non-expert gradients are replicated (count once); each expert lives on one rank of the group.
    const double sq = grad_sq_norm(dense_grads_) +
                      ep_group_->host_group().all_reduce(grad_sq_norm(expert_grads_), ReduceOp::Sum);
    return std::sqrt(sq);
  }
  return dist::global_grad_norm(optimizer_grads(), grad_shard_group());
}

void DataParallelPlan::grad_sq_norm_device(double* sq) {
  if (ep_group_) {  // as grad_norm(): the replicated gradients once, plus the experts' sums over the group
    const DeviceType type = optimizer_grads()[0].device().type;
    if (!ep_sq_.defined()) ep_sq_ = Tensor::zeros({2}, DType::F64, optimizer_grads()[0].device());
    double* parts = ep_sq_.data<double>();
    device_interface(type).zero(parts, 2 * sizeof(double));
    titan::grad_sq_norm_device(dense_grads_, parts);
    titan::grad_sq_norm_device(expert_grads_, parts + 1);
    ep_group_->all_reduce(parts + 1, 1, CommType::F64, ReduceOp::Sum);
    get_kernel<SumSquaresKernels>(type).total_device(sq, parts, 2);
    return;
  }
  titan::grad_sq_norm_device(optimizer_grads(), sq);
  if (ProcessGroup* shard = grad_shard_group(); shard && shard->size() > 1)
    shard->all_reduce(sq, 1, CommType::F64, ReduceOp::Sum);
}

double DataParallelPlan::clip_grad_norm(double max_norm) {
  const double norm = grad_norm();
  const float coef = clip_coefficient(norm, max_norm);
  if (coef < 1.0f) scale_grads(optimizer_grads(), coef);
  return norm;
}

void DataParallelPlan::after_optimizer_step() {
  if (fsdp_ && !stream_) fsdp_->gather_all_params();
}

}  // namespace titan::dist
