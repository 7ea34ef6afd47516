// DDP bucketed all-reduce, FSDP/ZeRO-3 shards, the HSDP mesh and global-norm clipping.
#include "distributed/data_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "kernels/ops.h"
#include "kernels/registry.h"
#include "optim/optimizer.h"

namespace titan::dist {

// ---- DDP ----

DdpReducer::DdpReducer(ProcessGroup& pg, std::vector<Tensor> grads, int64_t bucket_bytes)
    : pg_(pg), grads_(std::move(grads)) {
  TITAN_CHECK(bucket_bytes >= 4, "DDP bucket size must be at least 4 bytes, got ", bucket_bytes);
  const int64_t cap = bucket_bytes / 4;
  Bucket cur;
  auto flush = [&] {
    if (cur.count > 0) buckets_.push_back(std::move(cur));
    cur = Bucket{};
  };
  for (int i = 0; i < int(grads_.size()); ++i) {
    TITAN_CHECK(grads_[i].dtype() == DType::F32, "DDP gradients must be f32, buffer ", i, " is ",
                dtype_name(grads_[i].dtype()));
    const int64_t n = grads_[i].numel();
    if (n >= cap) {
      // A large buffer: reduced in place, chunk by chunk (no copy).
      flush();
      for (int64_t off = 0; off < n; off += cap) {
        cur.segments.push_back({i, off, std::min(cap, n - off)});
        cur.count = cur.segments.back().count;
        flush();
      }
      continue;
    }
    if (cur.count + n > cap) flush();
    cur.segments.push_back({i, 0, n});
    cur.count += n;
  }
  flush();
  int64_t staging = 0;
  for (auto& b : buckets_)
    if (b.segments.size() > 1) staging = std::max(staging, b.count);
  if (staging > 0) staging_ = Tensor::empty({staging}, DType::F32, grads_[0].device());
}

void DdpReducer::all_reduce_mean() {
  for (auto& b : buckets_) {
    if (b.segments.size() == 1) {
      const Segment& s = b.segments[0];
      pg_.all_reduce(grads_[s.tensor].f32() + s.offset, s.count, ReduceOp::Avg);
      continue;
    }
    // Small segments travel together through one staging buffer (on the gradients' device).
    float* st = staging_.f32();
    auto copy = device_interface(staging_.device().type).copy;
    int64_t at = 0;
    for (auto& s : b.segments) {
      copy(st + at, grads_[s.tensor].f32() + s.offset, s.count * sizeof(float));
      at += s.count;
    }
    pg_.all_reduce(st, b.count, ReduceOp::Avg);
    at = 0;
    for (auto& s : b.segments) {
      copy(grads_[s.tensor].f32() + s.offset, st + at, s.count * sizeof(float));
      at += s.count;
    }
  }
}

// ---- FSDP ----

FsdpShards::FsdpShards(ProcessGroup& shard, std::vector<Tensor> full_params, std::vector<Tensor> full_grads,
                       ProcessGroup* replicate)
    : shard_(shard),
      device_(full_params.empty() ? Device::cpu() : full_params[0].device()),
      full_params_(std::move(full_params)),
      full_grads_(std::move(full_grads)) {
  TITAN_CHECK(full_params_.size() == full_grads_.size(), "FSDP: ", full_params_.size(),
              " parameter buffers but ", full_grads_.size(), " gradient buffers");
  for (size_t g = 0; g < full_params_.size(); ++g) {
    TITAN_CHECK(full_params_[g].dtype() == DType::F32 && full_grads_[g].dtype() == DType::F32,
                "FSDP buffers must be f32 (group ", g, ")");
    TITAN_CHECK(full_params_[g].numel() == full_grads_[g].numel(), "FSDP group ", g, ": parameters have ",
                full_params_[g].numel(), " elements, gradients ", full_grads_[g].numel());
    numel_.push_back(full_params_[g].numel());
  }
  setup(replicate);
  load_shards(full_params_);
}

FsdpShards::FsdpShards(ProcessGroup& shard, const std::vector<int64_t>& group_numels, ProcessGroup* replicate,
                       Device device)
    : shard_(shard), owned_(true), device_(device), numel_(group_numels) {
  full_params_.resize(numel_.size());
  full_grads_.resize(numel_.size());
  setup(replicate);
}

void FsdpShards::setup(ProcessGroup* replicate) {
  replicate_ = replicate;
  const int n = shard_.size();
  for (int64_t numel : numel_) {
    const int64_t s = (numel + n - 1) / n;
    shard_numel_.push_back(s);
    shard_params_.push_back(Tensor::zeros({s}, DType::F32, device_));
    shard_grads_.push_back(Tensor::zeros({s}, DType::F32, device_));
  }
}

int64_t FsdpShards::shard_valid(int g) const {
  return std::clamp<int64_t>(numel_[g] - shard_offset(g), 0, shard_numel_[g]);
}

std::vector<int64_t> FsdpShards::counts(int g) const {
  std::vector<int64_t> c(shard_.size());
  for (int r = 0; r < shard_.size(); ++r)
    c[r] = std::clamp<int64_t>(numel_[g] - r * shard_numel_[g], 0, shard_numel_[g]);
  return c;
}

Tensor FsdpShards::take_buffer(int64_t numel, bool zero) {
  // Best fit among released buffers, so layers of one size keep re-using the same memory.
  int best = -1;
  for (int i = 0; i < int(pool_.size()); ++i)
    if (pool_[i].numel() >= numel && (best < 0 || pool_[i].numel() < pool_[best].numel())) best = i;
  Tensor t;
  if (best >= 0) {
    t = pool_[best].view_at(0, {numel});
    pool_.erase(pool_.begin() + best);
    if (zero) t.zero_();
  } else {
    t = zero ? Tensor::zeros({numel}, DType::F32, device_) : Tensor::empty({numel}, DType::F32, device_);
  }
  return t;
}

void FsdpShards::give_back(Tensor& t) {
  if (!t.defined()) return;
  pool_.push_back(t);
  t = Tensor();
}

Tensor FsdpShards::full_params(int g) {
  if (!full_params_[g].defined()) full_params_[g] = take_buffer(numel_[g], false);
  return full_params_[g];
}

Tensor FsdpShards::full_grads(int g) {
  if (!full_grads_[g].defined()) full_grads_[g] = take_buffer(numel_[g], true);
  return full_grads_[g];
}

void FsdpShards::gather_params(int g) {
  Tensor full = full_params(g);
  float* dst = full.f32();
  // In place: this rank's shard is first copied to its slot in the full buffer.
  const int64_t valid = shard_valid(g);
  if (valid > 0) full.view_at(shard_offset(g), {valid}).copy_from(shard_params_[g].view_at(0, {valid}));
  // This rank's slot starts at min(offset, numel) (an empty tail shard sits at the end).
  shard_.all_gather(dst + std::min(shard_offset(g), numel_[g]), dst, counts(g), CommType::F32);
}

void FsdpShards::gather_all_params() {
  for (int g = 0; g < num_groups(); ++g) gather_params(g);
}

void FsdpShards::release_params(int g) {
  if (owned_) give_back(full_params_[g]);
}

void FsdpShards::reduce_scatter_grads(int g, bool accumulate) {
  Tensor full = full_grads(g);
  const int64_t valid = shard_valid(g);
  float* out = shard_grads_[g].f32();
  if (accumulate) {
    if (!scratch_.defined() || scratch_.numel() < shard_numel_[g])
      scratch_ = Tensor::empty({shard_numel_[g]}, DType::F32, device_);
    out = scratch_.f32();
  }
  shard_.reduce_scatter(full.f32(), out, counts(g), CommType::F32, ReduceOp::Avg);
  // HSDP: every replica reduced the same shard of different data; average those too.
  if (replicate_ && replicate_->size() > 1) replicate_->all_reduce(out, valid, ReduceOp::Avg);
  if (accumulate && valid > 0)
    get_kernel<ElementwiseKernels>(device_.type).add(shard_grads_[g].f32(), out, valid);
  if (owned_) give_back(full_grads_[g]);
}

void FsdpShards::reduce_scatter_all_grads(bool accumulate) {
  for (int g = 0; g < num_groups(); ++g) reduce_scatter_grads(g, accumulate);
}

void FsdpShards::load_shards(const std::vector<Tensor>& full) {
  TITAN_CHECK(int(full.size()) == num_groups(), "FSDP: ", full.size(), " buffers for ", num_groups(),
              " groups");
  for (int g = 0; g < num_groups(); ++g) {
    TITAN_CHECK(full[g].numel() == numel_[g], "FSDP group ", g, ": buffer has ", full[g].numel(),
                " elements, expected ", numel_[g]);
    shard_params_[g].zero_();
    const int64_t valid = shard_valid(g);
    if (valid > 0) shard_params_[g].view_at(0, {valid}).copy_from(full[g].view_at(shard_offset(g), {valid}));
  }
}

// ---- HSDP ----

HsdpMesh make_hsdp_mesh(ProcessGroup& world, int shard_size) {
  const int n = world.size();
  TITAN_CHECK(shard_size >= 1 && n % shard_size == 0, "HSDP: shard size ", shard_size,
              " does not divide the world size ", n);
  HsdpMesh m;
  m.shard_size = shard_size;
  m.replicate_size = n / shard_size;
  const int r = world.rank();
  m.shard = world.split(/*color=*/r / shard_size, /*key=*/r);
  m.replicate = world.split(/*color=*/r % shard_size, /*key=*/r);
  return m;
}

// ---- replicas ----

void broadcast_tensors(ProcessGroup& pg, const std::vector<Tensor>& tensors, int root) {
  for (const Tensor& t : tensors) pg.broadcast(t, root);
}

bool replicas_in_sync(ProcessGroup& pg, const std::vector<Tensor>& tensors) {
  // FNV-1a over the bytes, folded to 52 bits so it is exact in a double for the max/min comparison.
  std::vector<double> sums;
  for (const Tensor& t : tensors) {
    const Tensor host = t.to(Device::cpu());  // (the same tensor on the cpu)
    const unsigned char* p = static_cast<const unsigned char*>(host.raw());
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < t.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
    sums.push_back(double(h >> 12));
  }
  std::vector<double> hi = sums, lo = sums;
  pg.host_group().all_reduce(hi.data(), int64_t(hi.size()), ReduceOp::Max);
  pg.host_group().all_reduce(lo.data(), int64_t(lo.size()), ReduceOp::Min);
  return hi == lo;
}

// ---- clipping ----

double global_grad_norm(const std::vector<Tensor>& grads, ProcessGroup* shard_group) {
  double sq = grad_sq_norm(grads);
  if (shard_group && shard_group->size() > 1) sq = shard_group->host_group().all_reduce(sq, ReduceOp::Sum);
  return std::sqrt(sq);
}

double clip_grad_norm(std::vector<Tensor>& grads, double max_norm, ProcessGroup* shard_group) {
  const double norm = global_grad_norm(grads, shard_group);
  const float coef = clip_coefficient(norm, max_norm);  // torch's clip_grad_norm_, on the global norm
  if (coef < 1.0f) scale_grads(grads, coef);
  return norm;
}

}  // namespace titan::dist
