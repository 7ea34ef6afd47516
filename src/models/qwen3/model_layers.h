// Qwen3Model's per-layer views and saved activations (private to the model; in their own header so that
// model.h reads as the model's interface).
#pragma once
#include <cstdint>
#include <memory>

#include "core/tensor.h"
#include "kernels/ops.h"

namespace titan {
namespace dist {
class AllToAllExchange;
}  // namespace dist

namespace qwen3_detail {

// Pointers into one decoder layer's flat buffer. q/k/v rows are contiguous (fused wqkv), so are
// gate/up rows (fused wgu).
// Dense layer: wgu (2I,H), wdown (H,I). MoE layer: router (E,H), wgu (E,2I_moe,H), wdown (E,H,I_moe).
struct LayerView {
  float *input_norm, *wq, *wk, *wv, *q_norm, *k_norm, *wo, *post_norm, *router, *wgu, *wdown;
};

// Saved activations of one decoder layer; N = B*T. Under sequence parallel the residual stream (resid_in,
// rstd1, resid_mid, rstd2) holds this rank's N/tp rows, and so does ln2 of a sparse layer whose experts are
// split over the tensor-parallel group.
struct LayerActs {
  float* resid_in;  // (N,H) layer input
  // The bf16 residual stream (Qwen3Model::resid16_): the layer input (except a stage's first layer's, which
  // is the embedding or the previous stage's output, f32) and resid_mid as bf16 in place of resid_in and
  // resid_mid (then null); titan rounds the residual stream to bf16 values under bf16 compute anyway.
  uint16_t *resid_in16, *resid_mid16;  // (N,H), (N,H)
  float* ln1;                          // (N,H)
  float* rstd1;                        // (N)
  float* q_raw;                        // (N,nH,hd) before q_norm
  float* k_raw;                        // (N,nKV,hd)
  float* v;                            // (N,nKV,hd)
  float* q_rstd;                       // (N*nH)
  float* k_rstd;                       // (N*nKV)
  float* qr;                           // (N,nH,hd) normed + rotated
  float* kr;                           // (N,nKV,hd)
  float* attn_saved;                   // attention_->saved_floats(B,T,nH): probabilities or row logsumexp
  float* att;                          // (N,nH*hd)
  // bf16 attention (attention_bf16 under bf16 compute): its inputs and output as bf16, saved for its
  // backward; qr, kr and v are then scratch shared by the layers, and attn_saved the row logsumexp.
  uint16_t *q16, *k16, *v16, *att16;  // (N,nH*hd), (N,nKV*hd), (N,nKV*hd), (N,nH*hd)
  float* resid_mid;                   // (N,H) after the attention residual
  float* ln2;                         // (N,H)
  float* rstd2;                       // (N)
  float* gu;                          // (N,2I)    dense layers
  float* act;                         // (N,I)     dense layers
  // bf16 activations (Qwen3Model::wants_act16): gate/up and the SwiGLU output of a dense layer, the norm
  // outputs before q/k/v and gate/up, q and k before their norms, as bf16 in place of gu, act, ln1, ln2,
  // q_raw, k_raw (which are then null).
  uint16_t *gu16, *act16;       // (N,2I), (N,I)
  uint16_t *ln1_16, *ln2_16;    // (N,H), (N,H)
  uint16_t *q_raw16, *k_raw16;  // (N,nH*hd), (N,nKV*hd): q, k before their norms
  // MoE layers
  float* router_probs;    // (N,E) router softmax
  float* topk_w;          // (N,k) routing weights
  int32_t* topk_idx;      // (N,k)
  MoeExpertsBuffers moe;  // saved expert activations and routing tables
};

// Expert parallel: one sparse layer's exchange and saved expert-side activations.
struct EpLayer {
  std::unique_ptr<dist::AllToAllExchange> exchange;  // rows out: (token, expert) pairs by owner rank
  bool fixed = false;                  // exchange is the fixed-capacity one (S rows to every rank, padded)
  Tensor pos_of_slot;                  // i64 (S): token slot n*k+s -> row in the send order
  Tensor send_order;                   // i64 (S): send row i -> token slot
  Tensor x, w, gu, act;                // received rows (R,H), weights (R), saved acts
  Tensor idx, order, row_of, offsets;  // i32: local expert of each row, kernel tables
};

}  // namespace qwen3_detail
}  // namespace titan
