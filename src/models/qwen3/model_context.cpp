// Qwen3Model's context-parallel attention: ring attention over the group of ranks that holds the chunks of
// the same sequences (ContextParallelComm's layout). Each rank's keys and values travel once around the
// ring; every rank attends its queries to each block as it arrives (attention_ring, the rows placed by their
// positions in the whole sequence) and merges the partial results by their logsumexp. The backward passes
// the keys and values around again, now with a gradient accumulator that collects every rank's share of
// their d(k), d(v) and arrives back at their rank after a last step.
#include "core/error.h"
#include "models/qwen3/model.h"

namespace titan {

void Qwen3Model::set_context_parallel(ContextParallelComm* comm) {
  cp_ = comm && comm->size() > 1 ? comm : nullptr;
  B_ = T_ = 0;  // the activation plan (and the per-token RoPE tables) depend on it
  if (!cp_) {
    kernel_names_.erase(AttentionRingKernels::kOp);
    return;
  }
  TITAN_CHECK(ring_, "context parallel: op '", AttentionRingKernels::kOp, "' has no implementation on ",
              device_type_name(device_.type));
  kernel_names_[AttentionRingKernels::kOp] = ring_name_;
}

void Qwen3Model::ring_attention_forward(int64_t l) {
  const auto& c = config_;
  const int64_t B = B_, T = T_, N = B * T, nH = c.num_attention_heads, nKV = c.num_key_value_heads,
                hd = c.head_dim, kv = N * c.kv_dim();
  const int S = cp_->size(), r = cp_->rank();
  LayerActs& a = layer_acts_[l];
  const int32_t* pos = cp_pos_.data<int32_t>();
  const int32_t* key_start = cp_docs_ ? doc_start_.data<int32_t>() : nullptr;
  float *cur = cp_kv_.f32(), *next = cur + 2 * kv;
  float *part_out = cp_part_.f32(), *part_lse = part_out + N * c.q_dim();
  dev_->copy(cur, a.kr, kv * sizeof(float));
  dev_->copy(cur + kv, a.v, kv * sizeof(float));
  for (int s = 0; s < S; ++s) {
    const int src = (r - s + S) % S;  // whose keys and values `cur` holds
    float* out = s == 0 ? a.att : part_out;
    float* lse = s == 0 ? a.attn_saved : part_lse;
    ring_->forward(out, lse, a.qr, cur, cur + kv, B, T, T, nH, nKV, hd, pos + r * T, pos + src * T,
                   key_start);
    if (s > 0) ring_->merge(a.att, a.attn_saved, part_out, part_lse, B, T, nH, hd);
    if (s + 1 < S) {
      cp_->ring_shift({cur}, {next}, 2 * kv);
      std::swap(cur, next);
    }
  }
}

void Qwen3Model::ring_attention_backward(int64_t l, float* dqr, float* dkr, float* dv, const float* datt) {
  const auto& c = config_;
  const int64_t B = B_, T = T_, N = B * T, nH = c.num_attention_heads, nKV = c.num_key_value_heads,
                hd = c.head_dim, kv = N * c.kv_dim();
  const int S = cp_->size(), r = cp_->rank();
  LayerActs& a = layer_acts_[l];
  const int32_t* pos = cp_pos_.data<int32_t>();
  const int32_t* key_start = cp_docs_ ? doc_start_.data<int32_t>() : nullptr;
  float *cur = cp_kv_.f32(), *next = cur + 2 * kv;
  float *dcur = cp_dkv_.f32(), *dnext = dcur + 2 * kv;  // d[k|v] of the block in `cur`
  dev_->copy(cur, a.kr, kv * sizeof(float));
  dev_->copy(cur + kv, a.v, kv * sizeof(float));
  zero(dcur, 2 * kv);
  for (int s = 0; s < S; ++s) {
    const int src = (r - s + S) % S;
    ring_->backward(dqr, dcur, dcur + kv, datt, a.qr, cur, cur + kv, a.att, a.attn_saved, B, T, T, nH, nKV,
                    hd, pos + r * T, pos + src * T, key_start);
    // The accumulator goes on with its block; after the last step it arrives back at the block's rank.
    if (s + 1 < S) {
      cp_->ring_shift({cur, dcur}, {next, dnext}, 2 * kv);
      std::swap(cur, next);
    } else {
      cp_->ring_shift({dcur}, {dnext}, 2 * kv);
    }
    std::swap(dcur, dnext);
  }
  elementwise_->add(dkr, dcur, kv);  // this rank's own keys' and values' gradients, from every rank
  elementwise_->add(dv, dcur + kv, kv);
}

}  // namespace titan
