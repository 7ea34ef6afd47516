// Qwen3-MoE router math: HF Qwen3MoeTopKRouter (softmax in fp32, top-k, optional renormalisation),
// HF load_balancing_loss_func (the aux loss) and torchtitan's expert-bias selection and update.
#pragma once
#include <cstdint>

namespace titan::moe_router {

// x (N,E) in place: row softmax (HF softmax(router_logits, dtype=float)).
void softmax_rows(float* x, int64_t N, int64_t E);

// Per row: the k experts with the largest probs[n] + bias (bias may be null; it only steers selection),
// in descending order (torch.topk); w = probs at those experts, divided by their sum when norm.
// probs (N,E), bias (E), idx/w (N,k).
void select_topk(int32_t* idx, float* w, const float* probs, const float* bias, int64_t N, int64_t E,
                 int64_t k, bool norm);

// counts[e] += number of slots routed to e.    idx (n_slots)
void count_slots(double* counts, const int32_t* idx, int64_t n_slots, int64_t E);
// prob_sum[e] += sum_n probs[n,e]              probs (N,E)
void sum_probs(double* prob_sum, const float* probs, int64_t N, int64_t E);

// Router backward for one layer. dw (N,k): gradient of the routing weights; dprob_bias (E): a gradient added
// to every row's probabilities (the aux loss term, may be null). Writes dlogits (N,E) (overwrites):
// renormalisation backward (norm), scatter to the selected experts, then softmax backward.
void backward(float* dlogits, const float* probs, const int32_t* idx, const float* dw,
              const float* dprob_bias, int64_t N, int64_t E, int64_t k, bool norm);

// torchtitan aux-loss-free update for one layer: delta = coeff * sign(mean(counts) - counts),
// delta -= mean(delta), bias += delta.   bias, counts (E)
void update_bias(float* bias, const float* counts, int64_t E, double coeff);

}  // namespace titan::moe_router
