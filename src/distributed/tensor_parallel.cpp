#include "distributed/tensor_parallel.h"

#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include "core/error.h"
#include "device/device.h"
#include "kernels/registry.h"
#include "optim/optimizer.h"

namespace titan::dist {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Rows [r0, r0 + rows) and columns [c0, c0 + cols) of the rank's block of a (R, C) matrix under `split`.
struct Block {
  int64_t r0, rows, c0, cols;
};
Block block_of(TpSplit split, const Shape& full, int tp, int rank) {
  TITAN_CHECK(full.size() == 2, "tensor parallel: a split parameter must be a matrix");
  const int64_t R = full[0], C = full[1];
  if (split == TpSplit::Rows) return {rank * (R / tp), R / tp, 0, C};
  return {0, R, rank * (C / tp), C / tp};
}

}  // namespace

namespace {
bool row_parallel_proj(const std::string& name) {
  return name.find(".self_attn.o_proj.") != std::string::npos ||
         name.find(".mlp.down_proj.") != std::string::npos;
}
}  // namespace

TpSplit tensor_parallel_split(const std::string& name) {
  if (name.find(".mlp.experts.") != std::string::npos) return TpSplit::Replicated;  // experts: EP's
  // LoRA adapters (PEFT names) follow their base weight: a column-parallel projection's B (out, r) by rows
  // and A replicated; a row-parallel one's A (r, in) by columns and B replicated.
  if (ends_with(name, ".lora_A.weight"))
    return row_parallel_proj(name) ? TpSplit::Columns : TpSplit::Replicated;
  if (ends_with(name, ".lora_B.weight")) return row_parallel_proj(name) ? TpSplit::Replicated : TpSplit::Rows;
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return TpSplit::Rows;  // vocab
  for (const char* s : {".self_attn.q_proj.weight", ".self_attn.k_proj.weight", ".self_attn.v_proj.weight",
                        ".mlp.gate_proj.weight", ".mlp.up_proj.weight"})
    if (ends_with(name, s)) return TpSplit::Rows;
  for (const char* s : {".self_attn.o_proj.weight", ".mlp.down_proj.weight"})
    if (ends_with(name, s)) return TpSplit::Columns;
  return TpSplit::Replicated;
}

Qwen3Config tensor_parallel_config(const Qwen3Config& full, int64_t tp) {
  TITAN_CHECK(tp >= 1, "parallelism.tensor_parallel_degree must be >= 1, got ", tp);
  auto divides = [tp](int64_t n, const char* field) {
    TITAN_CHECK(n % tp == 0, "parallelism.tensor_parallel_degree = ", tp, " does not divide model ", field,
                " = ", n, " (each rank holds whole heads and an equal slice of the MLP)");
  };
  divides(full.num_attention_heads, "num_attention_heads");
  divides(full.num_key_value_heads, "num_key_value_heads");
  if (full.intermediate_size > 0) divides(full.intermediate_size, "intermediate_size");
  divides(full.vocab_size, "vocab_size");
  Qwen3Config c = full;
  c.num_attention_heads /= tp;
  c.num_key_value_heads /= tp;
  c.intermediate_size /= tp;
  c.vocab_size /= tp;
  return c;
}

TensorParallel::TensorParallel(std::shared_ptr<ProcessGroup> group, bool sequence_parallel,
                               bool experts_over_group)
    : group_(std::move(group)),
      sequence_parallel_(sequence_parallel),
      experts_over_group_(experts_over_group) {
  TITAN_CHECK(group_, "tensor parallel: no group");
}

void TensorParallel::sum(float* x, int64_t n) {
  if (group_->size() > 1) group_->all_reduce(x, n, CommType::F32, ReduceOp::Sum);
}

void TensorParallel::max(float* x, int64_t n) {
  if (group_->size() > 1) group_->all_reduce(x, n, CommType::F32, ReduceOp::Max);
}

void TensorParallel::sum_host(double* x, int64_t n) {
  if (group_->size() > 1) group_->host_group().all_reduce(x, n, CommType::F64, ReduceOp::Sum);
}

void TensorParallel::sum_device(double* x, int64_t n) {
  if (group_->size() > 1) group_->all_reduce(x, n, CommType::F64, ReduceOp::Sum);
}

void TensorParallel::all_gather(const float* local, float* full, int64_t n) {
  group_->all_gather(local, full, std::vector<int64_t>(size(), n), CommType::F32);
}

void TensorParallel::reduce_scatter(const float* full, float* local, int64_t n) {
  group_->reduce_scatter(full, local, std::vector<int64_t>(size(), n), CommType::F32, ReduceOp::Sum);
}

std::vector<TensorParallel::Run> TensorParallel::runs(const std::string& name, const Shape& full) const {
  const TpSplit split = tensor_parallel_split(name);
  int64_t numel = 1;
  for (int64_t d : full) numel *= d;
  if (split == TpSplit::Replicated || size() == 1) return {{0, 0, numel}};
  const Block b = block_of(split, full, size(), rank());
  if (split == TpSplit::Rows) return {{0, b.r0 * full[1], b.rows * b.cols}};
  std::vector<Run> out;
  for (int64_t i = 0; i < b.rows; ++i) out.push_back({i * b.cols, i * full[1] + b.c0, b.cols});
  return out;
}

Tensor TensorParallel::slice(const std::string& name, const Tensor& full) const {
  const TpSplit split = tensor_parallel_split(name);
  if (split == TpSplit::Replicated || size() == 1) return full.clone();
  const Block b = block_of(split, full.shape(), size(), rank());
  const int64_t C = full.shape()[1];
  Tensor out = Tensor::empty({b.rows, b.cols});
  const float* src = full.f32();
  float* dst = out.f32();
  for (int64_t r = 0; r < b.rows; ++r) std::copy_n(src + (b.r0 + r) * C + b.c0, b.cols, dst + r * b.cols);
  return out;
}

void TensorParallel::scatter(const Qwen3Model& full, Qwen3Model& local) const {
  std::map<std::string, const Param*> by_name;
  for (const Param& f : full.params()) by_name[f.name] = &f;
  for (Param& p : local.params()) {
    const auto it = by_name.find(p.name);
    TITAN_CHECK(it != by_name.end(), "tensor parallel: the full model has no parameter ", p.name);
    const Param& f = *it->second;
    Tensor host = Tensor::empty(f.shape);
    f.value.copy_to_host(host.f32());
    Tensor s = slice(p.name, host);
    TITAN_CHECK(s.shape() == p.shape, "tensor parallel: the slice of ", p.name,
                " does not fit the local model");
    p.value.copy_from_host(s.f32());
  }
}

void TensorParallel::init_weights(Qwen3Model& local, const Qwen3Config& full_config, uint64_t seed) const {
  const Qwen3Model layout(full_config, {}, nullptr, /*allocate=*/false);  // names and shapes, no buffers
  std::mt19937_64 rng(seed);
  std::map<std::string, Param*> held;  // under expert parallel: this rank's experts only
  for (Param& p : local.params()) held[p.name] = &p;
  for (const Param& f : layout.params()) {
    Tensor host = Tensor::empty(f.shape);
    Qwen3Model::draw_init(rng, f.shape, full_config.initializer_range, host.f32());
    const auto it = held.find(f.name);
    if (it != held.end()) it->second->value.copy_from_host(slice(f.name, host).f32());
  }
}

NamedTensors TensorParallel::gather(const std::vector<Param>& local, bool keep) const {
  NamedTensors out;
  const int tp = size();
  for (const Param& p : local) {
    const TpSplit split = tensor_parallel_split(p.name);
    Tensor mine = Tensor::empty(p.shape);
    p.value.copy_to_host(mine.f32());
    if (split == TpSplit::Replicated || tp == 1) {
      if (keep) out.emplace_back(p.name, mine);
      continue;
    }
    // Every rank's block, one after another, then placed into the full matrix.
    const int64_t n = mine.numel();
    std::vector<float> blocks(static_cast<size_t>(n * tp));
    group_->host_group().all_gather(mine.f32(), blocks.data(), std::vector<int64_t>(tp, n), CommType::F32);
    if (!keep) continue;
    const Shape full_shape =
        split == TpSplit::Rows ? Shape{p.shape[0] * tp, p.shape[1]} : Shape{p.shape[0], p.shape[1] * tp};
    Tensor full = Tensor::empty(full_shape);
    for (int r = 0; r < tp; ++r) {
      const Block b = block_of(split, full_shape, tp, r);
      for (int64_t i = 0; i < b.rows; ++i)
        std::copy_n(blocks.data() + r * n + i * b.cols, b.cols,
                    full.f32() + (b.r0 + i) * full_shape[1] + b.c0);
    }
    out.emplace_back(p.name, full);
  }
  return out;
}

TensorParallel::GradBuffers TensorParallel::full_buffers(Qwen3Model& local) {
  GradBuffers b{&local.flat_grads(), {}, {}, nullptr};
  for (int g = 0; g < local.num_groups(); ++g) {
    b.offset.push_back(0);
    b.count.push_back(local.group_numel(g));
  }
  return b;
}

namespace {

// The part of parameter p inside buffer g's range: [lo, hi) in group coordinates (empty when hi <= lo).
std::pair<int64_t, int64_t> overlap(const Param& p, const TensorParallel::GradBuffers& b) {
  int64_t numel = 1;
  for (int64_t d : p.shape) numel *= d;
  const int64_t lo = std::max(p.offset, b.offset[p.group]);
  const int64_t hi = std::min(p.offset + numel, b.offset[p.group] + b.count[p.group]);
  return {lo, hi};
}

bool per_head_norm(const std::string& name) {
  return ends_with(name, ".self_attn.q_norm.weight") || ends_with(name, ".self_attn.k_norm.weight");
}

// A LoRA adapter replicated over the group computes a partial gradient on each rank: A of a column-parallel
// projection (from the rank's output rows), B of a row-parallel one (from the rank's input columns).
bool replicated_adapter(const std::string& name) {
  return name.find(".lora_") != std::string::npos && tensor_parallel_split(name) == TpSplit::Replicated;
}

bool residual_norm(const std::string& name) {
  return ends_with(name, ".input_layernorm.weight") || ends_with(name, ".post_attention_layernorm.weight") ||
         name == "model.norm.weight";
}

}  // namespace

void TensorParallel::reduce_replicated_grads(const std::vector<Param>& params, const GradBuffers& b) const {
  if (size() == 1) return;
  for (const Param& p : params) {
    const bool router = experts_over_group_ && ends_with(p.name, ".mlp.gate.weight");
    if (!per_head_norm(p.name) && !replicated_adapter(p.name) && !router &&
        !(sequence_parallel_ && residual_norm(p.name)))
      continue;
    const auto [lo, hi] = overlap(p, b);
    Tensor& buf = (*b.grads)[p.group];
    if (hi > lo && buf.defined())
      group_->all_reduce(buf.f32() + (lo - b.offset[p.group]), hi - lo, CommType::F32, ReduceOp::Sum);
  }
}

namespace {

// The part of each parameter's gradient in the buffers with its kind: 0 sliced (summed over the group),
// 1 replicated (the same on every rank), 2 an expert under expert parallel (replicated in the group, each
// expert group's rank holding others: summed over the expert group).
template <class Fn>
void for_each_grad_part(const std::vector<Param>& params, const TensorParallel::GradBuffers& b, Fn&& fn) {
  const bool ep = b.expert_group && b.expert_group->size() > 1;
  for (const Param& p : params) {
    const auto [lo, hi] = overlap(p, b);
    Tensor& buf = (*b.grads)[p.group];
    if (hi <= lo || !buf.defined()) continue;
    const int kind = tensor_parallel_split(p.name) != TpSplit::Replicated      ? 0
                     : ep && p.name.find(".mlp.experts.") != std::string::npos ? 2
                                                                               : 1;
    fn(kind, buf.view_at(lo - b.offset[p.group], {hi - lo}));  // (a view: no copy of the gradients)
  }
}

}  // namespace

double TensorParallel::grad_sq_norm(const std::vector<Param>& params, const GradBuffers& b) const {
  double sums[3] = {0, 0, 0};
  const bool ep = b.expert_group && b.expert_group->size() > 1;
  for_each_grad_part(params, b,
                     [&](int kind, const Tensor& part) { sums[kind] += titan::grad_sq_norm({part}); });
  if (b.shard_group && b.shard_group->size() > 1)
    b.shard_group->host_group().all_reduce(sums, 3, CommType::F64, ReduceOp::Sum);
  if (size() > 1) group_->host_group().all_reduce(sums, 1, CommType::F64, ReduceOp::Sum);
  if (ep) b.expert_group->host_group().all_reduce(sums + 2, 1, CommType::F64, ReduceOp::Sum);
  return sums[0] + sums[1] + sums[2];
}

void TensorParallel::grad_sq_norm_device(const std::vector<Param>& params, const GradBuffers& b,
                                         double* sums) const {
  TITAN_CHECK(!(b.expert_group && b.expert_group->size() > 1),
              "grad_sq_norm_device: expert parallel sums its experts' part on the host");
  const std::vector<Tensor>& bufs = *b.grads;
  const auto it = std::find_if(bufs.begin(), bufs.end(), [](const Tensor& t) { return t.defined(); });
  TITAN_CHECK(it != bufs.end(), "grad_sq_norm_device: no gradient buffer");
  const DeviceType type = it->device().type;
  const SumSquaresKernels& k = get_kernel<SumSquaresKernels>(type);
  device_interface(type).zero(sums, 3 * sizeof(double));
  // (grad_sq_norm adds each part's sum_squares to its kind's total: the same adds, on the device)
  for_each_grad_part(params, b, [&](int kind, const Tensor& part) {
    k.sum_squares_device(sums + kind, part.f32(), part.numel());
  });
  if (b.shard_group && b.shard_group->size() > 1)
    b.shard_group->all_reduce(sums, 3, CommType::F64, ReduceOp::Sum);
  if (size() > 1) group_->all_reduce(sums, 1, CommType::F64, ReduceOp::Sum);
  k.total_device(sums + 3, sums, 3);
}

}  // namespace titan::dist
