// Qwen3Model's tensor-parallel hooks (the layout is distributed/tensor_parallel.h's): the sums, gathers and
// reduce-scatters around the parallel blocks (sequence parallel), the rows the sparse layers run on, and
// the loss-parallel cross-entropy of a vocab-parallel lm_head.
#include <cmath>

#include "core/error.h"
#include "models/qwen3/model.h"

namespace titan {

void Qwen3Model::set_tensor_parallel(TensorParallelComm* comm, bool sequence_parallel,
                                     bool experts_over_group) {
  tp_ = comm;
  sp_ = sequence_parallel && comm && comm->size() > 1;
  moe_local_ = experts_over_group && sp_;
  TITAN_CHECK(!experts_over_group || (sp_ && ep_ && ep_size_ == comm->size()),
              "tensor parallel: experts over the tensor-parallel group need sequence parallel and an expert ",
              "group of the tensor-parallel group's size");
  B_ = T_ = 0;  // the activation plan depends on it
  TITAN_CHECK(!vocab_parallel() || cross_entropy_vp_, "tensor parallel: op '",
              VocabParallelCrossEntropyKernels::kOp, "' has no implementation on ",
              device_type_name(device_.type));
}

// Loss parallel over one head chunk of `rows` rows whose logits hold this rank's vocabulary columns: the
// ranks' row statistics (max, sum of exp, target logit) combine into each row's logsumexp on the device
// (all-reduces of the group: the max, then the sums relative to it); the chunk's loss sum (the same on every
// rank) is added to *loss_sum (device memory) and, with compute_grad, the chunk's logit gradient left.
void Qwen3Model::vocab_parallel_cross_entropy(float* logits, int64_t r0, int64_t rows, const float* scale,
                                              bool compute_grad, double* loss_sum) {
  const int64_t V = config_.vocab_size, v0 = vocab_start();
  const int32_t* targets = targets_.data<int32_t>() + r0;
  float* stats = ensure(ce_stats_, 4 * rows).f32();
  float* m = stats + 3 * rows;  // the rows' max, then their logsumexp
  cross_entropy_vp_->shard_stats(stats, logits, targets, rows, V, v0);
  cross_entropy_vp_->row_max(m, stats, rows);
  tp_->max(m, rows);
  cross_entropy_vp_->rescale(stats, m, rows);
  tp_->sum(stats, 3 * rows);  // {0, sum of exp relative to the global max, target logit}
  cross_entropy_vp_->loss(m, stats, targets, rows, loss_sum);
  if (compute_grad) cross_entropy_vp_->shard_grad(logits, m, targets, rows, V, v0, scale);
}

// ln2 of layer l into a.ln2. Under sequence parallel: this rank's rows for a dense layer (gathered for its
// GEMMs by gathered_ln) and for a sparse layer whose experts take the rank's rows; all N rows, gathered, for
// a sparse layer run replicated. Without: all N rows.
void Qwen3Model::norm_for_mlp(int64_t l) {
  LayerActs& a = layer_acts_[l];
  const LayerView w = layer_view(l);
  const float eps = static_cast<float>(config_.rms_norm_eps);
  if (a.resid_mid16 && a.ln2_16)  // the bf16 residual stream (no sequence parallel: all N rows)
    rmsnorm_->forward_bf16_io(a.ln2_16, a.rstd2, a.resid_mid16, w.post_norm, B_ * T_, config_.hidden_size,
                              eps);
  else if (a.resid_mid16)  // (a sparse layer's ln2, f32)
    rmsnorm_->forward_bf16_input(a.ln2, a.rstd2, a.resid_mid16, w.post_norm, B_ * T_, config_.hidden_size,
                                 eps);
  else if (a.ln2_16)  // bf16 activations (no sequence parallel: all N rows)
    rmsnorm_->forward_bf16_output(a.ln2_16, a.rstd2, a.resid_mid, w.post_norm, B_ * T_, config_.hidden_size,
                                  eps);
  else if (sp_ && (!w.router || moe_local_))
    rmsnorm_->forward(a.ln2, a.rstd2, a.resid_mid, w.post_norm, local_rows(), config_.hidden_size, eps);
  else
    norm_for_gemm(a.ln2, a.rstd2, a.resid_mid, w.post_norm);
}

const float* Qwen3Model::gathered_ln(const float* rows) {
  if (!sp_) return rows;
  tp_->all_gather(rows, ln_full_.f32(), local_rows() * config_.hidden_size);
  return ln_full_.f32();
}

void Qwen3Model::norm_for_gemm(float* full, float* rstd, const float* inp, const float* w) {
  const int64_t H = config_.hidden_size;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  if (!sp_) return rmsnorm_->forward(full, rstd, inp, w, B_ * T_, H, eps);
  rmsnorm_->forward(sp_local_.f32(), rstd, inp, w, local_rows(), H, eps);
  tp_->all_gather(sp_local_.f32(), full, local_rows() * H);
}

void Qwen3Model::sum_row_parallel(float* partial, float* out) {
  if (!tp_) return;
  if (sp_)
    tp_->reduce_scatter(partial, out, local_rows() * config_.hidden_size);
  else
    tp_->sum(partial, B_ * T_ * config_.hidden_size);
}

const float* Qwen3Model::full_rows(const float* local) {
  if (!sp_) return local;
  tp_->all_gather(local, sp_full_.f32(), local_rows() * config_.hidden_size);
  return sp_full_.f32();
}

float* Qwen3Model::sum_column_parallel_grad(float* dfull) {
  if (!sp_) {
    tp_sum(dfull, B_ * T_ * config_.hidden_size);
    return dfull;
  }
  tp_->reduce_scatter(dfull, sp_local_.f32(), local_rows() * config_.hidden_size);
  return sp_local_.f32();
}

}  // namespace titan
