// Function tables of the ops a model step needs. All buffers are contiguous, row-major, f32, on the
// op's device. Convention: forward kernels overwrite their outputs; backward kernels ACCUMULATE (+=)
// into every gradient they produce (input and parameter grads), so residual branches and gradient
// accumulation need no extra adds. N = B*T rows.
#pragma once
#include <cmath>
#include <compare>
#include <cstdint>

#include "kernels/host_device.h"

namespace titan {

// out = inp @ weight^T        inp (N,C), weight (OC,C), out (N,OC)
// dinp += dout @ weight       dweight += dout^T @ inp      (dinp or dweight may be null: skipped)
// accumulate_dweight = false: dweight = dout^T @ inp, its old contents never read (the first gradient
// written into a zeroed buffer: the lm_head's, where reading 4 bytes x vocab x hidden back costs).
struct MatmulKernels {
  static constexpr const char* kOp = "matmul";
  void (*forward)(float* out, const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC);
  void (*backward)(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                   int64_t N, int64_t C, int64_t OC, bool accumulate_dweight);
};

// The same GEMMs with bfloat16 inputs and f32 accumulation/outputs (mixed precision): every input element is
// rounded to bf16 (nearest even) first, so the result is the f32 matmul of the bf16-rounded operands up to
// the summation order. Used for `training.mixed_precision_param = "bfloat16"`.
struct MatmulBf16Kernels {
  static constexpr const char* kOp = "matmul_bf16";
  void (*forward)(float* out, const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC);
  void (*backward)(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                   int64_t N, int64_t C, int64_t OC, bool accumulate_dweight);
  // The same GEMMs with the input held as bf16 already (inp16: N x C bit patterns), so that a tensor the
  // step keeps in bf16 (the attention output, read by o_proj) needs no f32 copy: equal to forward/backward
  // on the f32 values of those bits.
  void (*forward_bf16_input)(float* out, const uint16_t* inp16, const float* weight, int64_t N, int64_t C,
                             int64_t OC);
  void (*backward_bf16_input)(float* dinp, float* dweight, const float* dout, const uint16_t* inp16,
                              const float* weight, int64_t N, int64_t C, int64_t OC, bool accumulate_dweight);
  // forward with the output written as bf16 (out16: N x OC bit patterns), for an output the step keeps in
  // bf16 (a dense layer's gate/up): the nearest bf16 (ties to even) of forward's f32 result.
  void (*forward_bf16_output)(uint16_t* out16, const float* inp, const float* weight, int64_t N, int64_t C,
                              int64_t OC);
  // Both: bf16 input and bf16 output (a dense layer's gate/up from its bf16 norm output).
  void (*forward_bf16_io)(uint16_t* out16, const uint16_t* inp16, const float* weight, int64_t N, int64_t C,
                          int64_t OC);
  // backward with the output gradient held as bf16 as well (dout16: N x OC bit patterns; the bf16 engines
  // round dout to bf16 anyway, so a gradient kept in bf16 loses nothing): equal to backward_bf16_input on the
  // f32 values of dout16's bits.
  void (*backward_bf16_io)(float* dinp, float* dweight, const uint16_t* dout16, const uint16_t* inp16,
                           const float* weight, int64_t N, int64_t C, int64_t OC, bool accumulate_dweight);
};

// bf16 images of f32 weight ranges, kept up to date by their owner (a model under bf16 compute makes them
// at the start of every forward, or when it gathers a streamed group): a matmul_bf16 implementation reads
// a weight's bf16 copy from here instead of converting the weight on every call. find_bf16_image returns
// the image of [p, p + n) when that range lies inside a registered one, else nullptr.
void register_bf16_image(const float* base, int64_t n, const uint16_t* image);
void unregister_bf16_image(const float* base);
const uint16_t* find_bf16_image(const float* p, int64_t n);

// y = weight * (x * rsqrt(mean(x^2) + eps)), per row; rstd (N) saved for backward.
// inp (N,C), weight (C), out (N,C)
struct RmsNormKernels {
  static constexpr const char* kOp = "rmsnorm";
  void (*forward)(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C,
                  float eps);
  void (*backward)(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                   const float* rstd, int64_t N, int64_t C);
  // forward with the output written as bf16 (bf16 compute keeps a norm read only by GEMMs so): out16 = the
  // nearest bf16 of forward's out; rstd as forward's.
  void (*forward_bf16_output)(uint16_t* out16, float* rstd, const float* inp, const float* weight, int64_t N,
                              int64_t C, float eps);
  // forward and backward with the input held as bf16 (inp16: N x C bit patterns; q/k before their norms):
  // equal to forward/backward on the f32 values of those bits.
  void (*forward_bf16_input)(float* out, float* rstd, const uint16_t* inp16, const float* weight, int64_t N,
                             int64_t C, float eps);
  void (*backward_bf16_input)(float* dinp, float* dweight, const float* dout, const uint16_t* inp16,
                              const float* weight, const float* rstd, int64_t N, int64_t C);
  // forward with both held as bf16 (the bf16 residual stream into a bf16 norm output): out16 = the nearest
  // bf16 of forward's out on the f32 values of inp16's bits.
  void (*forward_bf16_io)(uint16_t* out16, float* rstd, const uint16_t* inp16, const float* weight, int64_t N,
                          int64_t C, float eps);
};

// Rotate-half RoPE (NeoX layout, HF `rotate_half`) at position t = row % T.
// x (N, nh, hd), out may alias inp; cos, sin (T_max, hd/2) tables: x1' = x1 cos - x2 sin, x2' = x2 cos + x1
// sin.
struct RopeKernels {
  static constexpr const char* kOp = "rope";
  void (*forward)(float* out, const float* inp, const float* cos, const float* sin, int64_t N, int64_t T,
                  int64_t nh, int64_t hd);
  void (*backward)(float* dinp, const float* dout, const float* cos, const float* sin, int64_t N, int64_t T,
                   int64_t nh, int64_t hd);
};

// Causal GQA attention, scale = hd^-0.5; query head h reads kv head h / (nH / nKV).
// q (B,T,nH,hd), k/v (B,T,nKV,hd), out (B,T,nH,hd). `saved` holds saved_floats(B,T,nH) floats that the
// forward writes for the backward; its layout belongs to the implementation ("reference" / "blas": the
// softmax probabilities (B,nH,T,T), upper triangle 0; "flash": the row logsumexp (B,nH,T), no [T,T] matrix).
// The backward also reads the forward's output `out`.
// doc_start (B,T) or null: packed rows (several documents per row), query t of row b attends to the keys
// j with doc_start[b,t] <= j <= t only (document-masked causal attention; doc_start[b,t] <= t).
struct AttentionKernels {
  static constexpr const char* kOp = "attention";
  void (*forward)(float* out, float* saved, const float* q, const float* k, const float* v, int64_t B,
                  int64_t T, int64_t nH, int64_t nKV, int64_t hd, const int32_t* doc_start);
  void (*backward)(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                   const float* v, const float* out, const float* saved, int64_t B, int64_t T, int64_t nH,
                   int64_t nKV, int64_t hd, const int32_t* doc_start);
  int64_t (*saved_floats)(int64_t B, int64_t T, int64_t nH);
};

// The same causal GQA attention on bf16 tensors (mixed precision; cuDNN's fused attention on a GPU), read
// through row strides: element (b,t,h,d) of q lies at q[(b*T + t) * ldq + h*hd + d]; k and v likewise with
// ldk / ldv over nKV heads, out and dout with ldo over nH heads (so q, k and v may be column ranges of one
// fused QKV row). bf16 values are uint16_t bit patterns. Scores, softmax and sums run in f32; out is the f32
// result rounded to bf16 (nearest even); lse (B,nH,T) f32 is the row logsumexp of the scaled scores, saved
// for the backward. backward WRITES dq, dk, dv (the f32 sums rounded to bf16 once; a bf16 buffer cannot
// carry a running sum) with the strides of q, k, v, from the forward's out and lse. doc_start as
// AttentionKernels.
struct AttentionBf16Shape {
  int64_t B = 0, T = 0, nH = 0, nKV = 0, hd = 0;
  int64_t ldq = 0, ldk = 0, ldv = 0, ldo = 0;
  auto operator<=>(const AttentionBf16Shape&) const = default;  // (a cache key)
};
struct AttentionBf16Kernels {
  static constexpr const char* kOp = "attention_bf16";
  void (*forward)(uint16_t* out, float* lse, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                  const AttentionBf16Shape& s, const int32_t* doc_start);
  void (*backward)(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout, const uint16_t* q,
                   const uint16_t* k, const uint16_t* v, const uint16_t* out, const float* lse,
                   const AttentionBf16Shape& s, const int32_t* doc_start);
};

// The first key query t of row b attends to (0 without a document mask).
inline int64_t attention_key_start(const int32_t* doc_start, int64_t b, int64_t T, int64_t t) {
  return doc_start ? doc_start[b * T + t] : 0;
}

// Context parallel (ring attention): causal GQA attention of a rank's queries against one block of keys and
// values, every row placed by its position in the whole sequence. q (B,Tq,nH,hd), k/v (B,Tk,nKV,hd); q_pos
// (Tq) and k_pos (Tk): the rows' positions (the same in every batch row); query i reads key j iff
// k_pos[j] <= q_pos[i] and, with key_start (B,Tq) (packed documents: the position of the query's
// document's first token), k_pos[j] >= key_start[b,i]. scale = hd^-0.5. lse is (B,nH,Tq).
// forward: out := the attention over this block's keys alone, lse := its row logsumexp (a row that reads no
//   key of the block: out 0, lse -inf).
// merge: (out, lse) := the attention over the keys of both, from (out, lse) and another block's (part_out,
//   part_lse): lse' = log(e^lse + e^part_lse), out' = e^(lse - lse') out + e^(part_lse - lse') part_out.
// backward: accumulates this block's share of dq (B,Tq,nH,hd) and dk/dv (B,Tk,nKV,hd) from the final out
//   and lse (merged over every block): P = exp(scale q k^T - lse), D = rowsum(dout * out).
struct AttentionRingKernels {
  static constexpr const char* kOp = "attention_ring";
  void (*forward)(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                  int64_t Tq, int64_t Tk, int64_t nH, int64_t nKV, int64_t hd, const int32_t* q_pos,
                  const int32_t* k_pos, const int32_t* key_start);
  void (*merge)(float* out, float* lse, const float* part_out, const float* part_lse, int64_t B, int64_t T,
                int64_t nH, int64_t hd);
  void (*backward)(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                   const float* v, const float* out, const float* lse, int64_t B, int64_t Tq, int64_t Tk,
                   int64_t nH, int64_t nKV, int64_t hd, const int32_t* q_pos, const int32_t* k_pos,
                   const int32_t* key_start);
};

// Attention of n new queries against a KV cache (generation): query i sits at position p + i and reads
// the keys/values at positions [0, p + i] (causal), scale = hd^-0.5, GQA as AttentionKernels. Batch 1.
// q (n,nH,hd), k/v (p+n,nKV,hd) (the first p + n rows of a cache: p cached, then the n new ones),
// out (n,nH,hd). Forward only.
struct AttentionKVKernels {
  static constexpr const char* kOp = "attention_kv";
  void (*forward)(float* out, const float* q, const float* k, const float* v, int64_t n, int64_t p,
                  int64_t nH, int64_t nKV, int64_t hd);
};

// SwiGLU on a fused gate|up row: out = silu(gu[:, :I]) * gu[:, I:].   gu (N,2I), out (N,I)
struct SwigluKernels {
  static constexpr const char* kOp = "swiglu";
  void (*forward)(float* out, const float* gu, int64_t N, int64_t I);
  void (*backward)(float* dgu, const float* dout, const float* gu, int64_t N, int64_t I);
  // The same with gate/up and the output as bf16 bit patterns (bf16 compute keeps them so): out16 = the
  // nearest bf16 of forward on the f32 values of gu16; backward_bf16 = backward on those values (dgu f32).
  void (*forward_bf16)(uint16_t* out16, const uint16_t* gu16, int64_t N, int64_t I);
  void (*backward_bf16)(float* dgu, const float* dout, const uint16_t* gu16, int64_t N, int64_t I);
  // backward_bf16 with d(gate/up) written as bf16 (dgu16 overwritten: the nearest bf16 of what backward_bf16
  // adds to a cleared f32 buffer), for the gate/up GEMM's bf16 output gradient (matmul_bf16
  // backward_bf16_io).
  void (*backward_bf16_output)(uint16_t* dgu16, const float* dout, const uint16_t* gu16, int64_t N,
                               int64_t I);
};

// out[n] = table[ids[n]]     table (V,C), out (N,C); backward: dtable[ids[n]] += dout[n]
// An id < 0 is a token whose row another rank holds (vocab-parallel embedding): out[n] = 0, no gradient.
struct EmbeddingKernels {
  static constexpr const char* kOp = "embedding";
  void (*forward)(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C);
  void (*backward)(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t C, int64_t V);
};

// Cross-entropy over rows with target >= 0 (ignore_index rows have target < 0), fused with its
// gradient: losses[n] = logsumexp(logits[n]) - logits[n][t]; logits is overwritten in place with
// grad_scale * (softmax - onehot) (0 for ignored rows). Returns the sum of losses (double).
struct CrossEntropyKernels {
  static constexpr const char* kOp = "cross_entropy";
  double (*forward_backward)(float* logits, const int32_t* targets, int64_t N, int64_t V, float grad_scale,
                             bool compute_grad);
  // The same with the sum of losses added to *loss_sum (one double in the op's device memory) instead of
  // returned, and grad_scale read from the op's device memory (one float): nothing waits for the device and
  // nothing is a host value, so a graph can hold it and replay it for other batches (compile mode; chat
  // data's scale changes per step). *loss_sum ends equal to its old value plus forward_backward's result,
  // bit for bit.
  void (*forward_backward_device)(double* loss_sum, float* logits, const int32_t* targets, int64_t N,
                                  int64_t V, const float* grad_scale, bool compute_grad);
};

// forward_backward_device for devices whose memory is the host's: the returned sum, added.
template <double (*F)(float*, const int32_t*, int64_t, int64_t, float, bool)>
void add_loss_sum(double* loss_sum, float* logits, const int32_t* targets, int64_t N, int64_t V,
                  const float* grad_scale, bool compute_grad) {
  *loss_sum += F(logits, targets, N, V, *grad_scale, compute_grad);
}

// Cross-entropy with the vocabulary split over ranks (loss parallel): logits (N,V) are the columns
// [v0, v0 + V) of the full vocabulary's, targets are full-vocabulary ids (< 0: ignored).
// shard_stats: stats[3n..3n+2] = {max_j x[n][j], sum_j exp(x[n][j] - that max), x[n][target - v0] when the
// target lies in this shard, else 0}; ignored rows get {0, 0, 0}.
// shard_grad: with lse[n] the full row's logsumexp (the ranks' stats combined), logits := *grad_scale *
// (softmax - onehot) over the shard's columns (0 for ignored rows); grad_scale is one float in the op's
// device memory (as for forward_backward_device).
// Combining the ranks' stats on the device (Qwen3Model, with all-reduces of the group in between):
// row_max: m[n] = stats[3n], then the group's max of m; rescale: stats[3n+1] *= exp(stats[3n] - m[n]) (the
// sum of exp relative to the global max), stats[3n] = 0, then the group's sum of stats; loss: m[n] := the
// row's logsumexp m[n] + log(stats[3n+1]) (shard_grad's lse), and *loss_sum += the sum over rows with a
// target of (double)lse - stats[3n+2], summed from 0 in row order in double, then added.
struct VocabParallelCrossEntropyKernels {
  static constexpr const char* kOp = "cross_entropy_vocab_parallel";
  void (*shard_stats)(float* stats, const float* logits, const int32_t* targets, int64_t N, int64_t V,
                      int64_t v0);
  void (*shard_grad)(float* logits, const float* lse, const int32_t* targets, int64_t N, int64_t V,
                     int64_t v0, const float* grad_scale);
  void (*row_max)(float* m, const float* stats, int64_t N);
  void (*rescale)(float* stats, const float* m, int64_t N);
  void (*loss)(float* m, const float* stats, const int32_t* targets, int64_t N, double* loss_sum);
};

// torch.optim.AdamW step on a flat buffer (decoupled weight decay, bias correction, eps after sqrt).
// The gradient used is grad * grad_scale: the gradient-norm clip's scaling fused into the step (one pass
// over the gradients fewer); grad itself is not written.
// The scalars of one AdamW step (compile mode stages them in device memory before a graph's launch, the
// learning rate and the step count being host values): lr and step, and what the implementations derive
// from them, computed as they do (adamw_step_scalars).
struct AdamWStepScalars {
  float lr = 0, decay = 1, step_size = 0, bc2_sqrt = 1;  // decay = 1 - lr wd; lr / (1 - b1^t); sqrt(1 - b2^t)
  int64_t step = 0;
  // step_device leaves everything as it is when this is not 0 (training.skip_nan_inf in compile mode: the
  // step's non-finite losses, counted on the device after the host staged 0).
  double nonfinite = 0;
};
AdamWStepScalars adamw_step_scalars(float lr, float beta1, float beta2, float weight_decay, int64_t step);

struct AdamWKernels {
  static constexpr const char* kOp = "adamw";
  void (*step)(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,
               float beta2, float eps, float weight_decay, int64_t step, float grad_scale);
  // The same step with its scalars in device memory, so that a graph can hold it: s (one AdamWStepScalars)
  // and the gradient-norm clip taken on the device from *sq_sum (the sum of squares of every gradient):
  // grad_scale = clip_scale(*sq_sum, max_norm) (sq_sum null: 1). Equal to step() with s->lr, s->step and
  // that scale, bit for bit.
  void (*step_device)(float* param, const float* grad, float* m, float* v, int64_t n, float beta1,
                      float beta2, float eps, float weight_decay, const AdamWStepScalars* s,
                      const double* sq_sum, float max_norm);
};

// torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6) in float, clamped to 1; 1 when
// max_norm <= 0. The one formula of the host's clip_coefficient and of every AdamW step_device.
TITAN_HOST_DEVICE inline float clip_factor(float norm, float max_norm) {
  if (max_norm <= 0) return 1.0f;
  const float coef = max_norm / (norm + 1e-6f);
  return coef < 1.0f ? coef : 1.0f;
}
// The factor from the gradients' sum of squares.
TITAN_HOST_DEVICE inline float clip_scale(double sq_sum, float max_norm) {
  return clip_factor(static_cast<float>(sqrt(sq_sum)), max_norm);
}

// step_device for devices whose memory is the host's: the scalars read, the step taken.
template <void (*F)(float*, const float*, float*, float*, int64_t, float, float, float, float, float, int64_t,
                    float)>
void adamw_step_from_scalars(float* p, const float* g, float* m, float* v, int64_t n, float beta1,
                             float beta2, float eps, float wd, const AdamWStepScalars* s,
                             const double* sq_sum, float max_norm) {
  if (s->nonfinite != 0) return;
  F(p, g, m, v, n, s->lr, beta1, beta2, eps, wd, s->step, sq_sum ? clip_scale(*sq_sum, max_norm) : 1.0f);
}

// Sum of squares of a flat buffer, accumulated in double (the global gradient norm is the square root of
// its sum over all gradients). Returns to the host, so a device implementation waits for its stream.
struct SumSquaresKernels {
  static constexpr const char* kOp = "sum_squares";
  double (*sum_squares)(const float* x, int64_t n);
  // The same added to *acc (one double in the op's device memory) instead of returned: nothing waits for
  // the device (compile mode). *acc ends equal to its old value plus sum_squares's result, bit for bit.
  void (*sum_squares_device)(double* acc, const float* x, int64_t n);
  // *out = ((parts[0] + parts[1]) + ...) + parts[n-1] (n doubles in the op's device memory): a total of
  // partial sums taken on the device in the order the host adds them.
  void (*total_device)(double* out, const double* parts, int64_t n);
  // *out += the number of x[0..n) that are not finite (one double in the op's device memory; nothing waits).
  void (*count_nonfinite)(double* out, const double* x, int64_t n);
};

template <double (*F)(const float*, int64_t)>
void add_sum_squares(double* acc, const float* x, int64_t n) {
  *acc += F(x, n);
}

// VocabParallelCrossEntropyKernels' row_max, rescale and loss for devices whose memory is the host's
// (ops.cpp).
void shard_row_max_on_host(float* m, const float* stats, int64_t N);
void shard_rescale_on_host(float* stats, const float* m, int64_t N);
void shard_loss_on_host(float* m, const float* stats, const int32_t* targets, int64_t N, double* loss_sum);

// total_device for devices whose memory is the host's.
inline void total_on_host(double* out, const double* parts, int64_t n) {
  double t = n > 0 ? parts[0] : 0.0;
  for (int64_t i = 1; i < n; ++i) t += parts[i];
  *out = t;
}
// count_nonfinite's formula (every device's).
TITAN_HOST_DEVICE inline void count_nonfinite_into(double* out, const double* x, int64_t n) {
  double c = 0;
  for (int64_t i = 0; i < n; ++i) c += x[i] - x[i] == 0.0 ? 0.0 : 1.0;  // (inf - inf and NaN: NaN)
  *out += c;
}

// ---- Mixture of experts -------------------------------------------------------------------------------
// Routed SwiGLU experts (Qwen3-MoE). Token n goes to experts e = idx[n,s], s < k, with weight w[n,s]:
//   out[n] = sum_s w[n,s] * down_e( silu(gate_e x[n]) * up_e x[n] )          (slots summed in order s)
// x (N,H), idx (N,k) int32 in [0,E), w (N,k), w_gu (E,2I,H): gate rows then up rows per expert (the HF v5
// `mlp.experts.gate_up_proj`), w_down (E,H,I), out (N,H) overwritten.
// backward: dx += dL/dx (N,H), dw += dL/dw (N,k), dw_gu += (E,2I,H), dw_down += (E,H,I).
// Saved activations and routing tables live in caller buffers planned once per N (no allocation per call);
// their layout belongs to the implementation, so one implementation runs both forward and backward.
struct MoeExpertsBuffers {
  float* gu = nullptr;         // saved (N*k, 2I)   gate|up pre-activations, one row per routed token slot
  float* act = nullptr;        // saved (N*k, I)    silu(gate) * up
  int32_t* order = nullptr;    // saved (N*k)       row r of the expert-sorted layout -> token slot n*k+s
  int32_t* row_of = nullptr;   // saved (N*k)       token slot n*k+s -> sorted row
  int32_t* offsets = nullptr;  // saved (E+1)       expert e owns sorted rows [offsets[e], offsets[e+1])
  float* scratch = nullptr;    // moe_experts_scratch_floats(N,k,H,I); contents not kept between calls
};
inline int64_t moe_experts_scratch_floats(int64_t N, int64_t k, int64_t H, int64_t I) {
  return N * k * (2 * H + 4 * I);
}

struct MoeExpertsKernels {
  static constexpr const char* kOp = "moe_experts";
  void (*forward)(float* out, const MoeExpertsBuffers& buf, const float* x, const int32_t* idx,
                  const float* w, const float* w_gu, const float* w_down, int64_t N, int64_t k, int64_t E,
                  int64_t H, int64_t I);
  void (*backward)(float* dx, float* dw, float* dw_gu, float* dw_down, const MoeExpertsBuffers& buf,
                   const float* dout, const float* x, const int32_t* idx, const float* w, const float* w_gu,
                   const float* w_down, int64_t N, int64_t k, int64_t E, int64_t H, int64_t I);
};

// The same routed experts with the expert GEMMs on bf16 operands and f32 accumulation (mixed precision,
// `training.mixed_precision_param = "bfloat16"`): every GEMM input of the implementation's pipeline is
// rounded to bf16 (nearest even) first; routing, SwiGLU and the combine stay f32. Same buffers and
// conventions as MoeExpertsKernels.
struct MoeExpertsBf16Kernels : MoeExpertsKernels {
  static constexpr const char* kOp = "moe_experts_bf16";
};

// RoPE of q and k in one call (rotate-half, position t = row % T, tables as for RopeKernels).
// q (N,nH,hd) and k (N,nKV,hd) rotated in place; backward: dq += R^T dq_rot, dk += R^T dk_rot.
struct RopeQKKernels {
  static constexpr const char* kOp = "rope_qk";
  void (*forward)(float* q, float* k, const float* cos, const float* sin, int64_t N, int64_t T, int64_t nH,
                  int64_t nKV, int64_t hd);
  void (*backward)(float* dq, float* dk, const float* dq_rot, const float* dk_rot, const float* cos,
                   const float* sin, int64_t N, int64_t T, int64_t nH, int64_t nKV, int64_t hd);
};

// q and k of a layer under bf16 activations, from their bf16 projections to the bf16 tensors attention
// reads, in one pass: per head row (q: N x nH rows of hd, k: N x nKV), RMSNorm with the head's norm weight
// (q_w or k_w, hd; HF q_norm / k_norm), rotate-half RoPE at position t = token % T (tables as for
// RopeKernels), then the nearest bf16 (ties to even); the rows' rstd saved. Equal, bit for bit, to
// rmsnorm.forward_bf16_input, rope_qk.forward and elementwise.to_bf16 run in turn (a device's default
// implementations), without their f32 tensors.
// backward, from the bf16 gradients of q16/k16 (attention_bf16's dq/dk): dq_raw16, dk_raw16 = the gradients
// of the q/k projections as bf16 (overwritten; the bf16 GEMMs round their output gradient to bf16 anyway),
// dq_w += d(q_w), dk_w += d(k_w) (null: not wanted); equal to elementwise.from_bf16, rope_qk.backward and
// rmsnorm.backward_bf16_input (into cleared f32 buffers, then rounded) in turn.
struct QKNormRopeKernels {
  static constexpr const char* kOp = "qk_norm_rope";
  void (*forward)(uint16_t* q16, uint16_t* k16, float* q_rstd, float* k_rstd, const uint16_t* q_raw16,
                  const uint16_t* k_raw16, const float* q_w, const float* k_w, const float* cos,
                  const float* sin, int64_t N, int64_t T, int64_t nH, int64_t nKV, int64_t hd, float eps);
  void (*backward)(uint16_t* dq_raw16, uint16_t* dk_raw16, float* dq_w, float* dk_w, const uint16_t* dq16,
                   const uint16_t* dk16, const uint16_t* q_raw16, const uint16_t* k_raw16, const float* q_w,
                   const float* k_w, const float* q_rstd, const float* k_rstd, const float* cos,
                   const float* sin, int64_t N, int64_t T, int64_t nH, int64_t nKV, int64_t hd);
};

}  // namespace titan

namespace titan {

// ---- Glue of the model step -----------------------------------------------------------------------------
// Everything a model does to tensor memory besides the ops above: residual adds, bf16 rounding and
// conversion, fills. With these (and the device's copies), a model step touches no tensor memory itself.
struct ElementwiseKernels {
  static constexpr const char* kOp = "elementwise";
  void (*add)(float* y, const float* x, int64_t n);               // y += x
  void (*round_bf16)(float* x, int64_t n);                        // x = nearest bf16 (ties to even), f32
  void (*to_bf16)(uint16_t* dst, const float* src, int64_t n);    // nearest even; NaN stays NaN
  void (*from_bf16)(float* dst, const uint16_t* src, int64_t n);  // exact
  void (*fill)(float* x, float value, int64_t n);
  void (*scale)(float* x, float a, int64_t n);  // x *= a
  // out16 = nearest bf16 of (y + x16's f32 value), the sum in f32 (add, then to_bf16, in one pass: a residual
  // add into the bf16 residual stream)
  void (*add_to_bf16)(uint16_t* out16, const float* y, const uint16_t* x16, int64_t n);
};

// Router of a sparse layer (HF Qwen3MoeTopKRouter, torchtitan's expert bias) and its statistics.
struct MoeRouterKernels {
  static constexpr const char* kOp = "moe_router";
  // x (N,E) in place: row softmax in f32 (HF softmax(router_logits, dtype=float)).
  void (*softmax)(float* x, int64_t N, int64_t E);
  // Per row: the k experts with the largest probs[n] + bias (bias may be null: it only steers selection),
  // in descending order (torch.topk; ties to the lower index); w = probs there, divided by their sum when
  // norm. probs (N,E), bias (E), idx/w (N,k).
  void (*select_topk)(int32_t* idx, float* w, const float* probs, const float* bias, int64_t N, int64_t E,
                      int64_t k, bool norm);
  // counts[e] += slots routed to e (f32: the expert-bias token counts).   idx (n_slots)
  void (*count_tokens)(float* counts, const int32_t* idx, int64_t n_slots, int64_t E);
  // Aux-loss statistics in double: counts[e] += slots of idx (N*k) routed to e; prob_sum[e] += sum_n
  // probs[n,e].
  void (*aux_stats)(double* counts, double* prob_sum, const int32_t* idx, const float* probs, int64_t N,
                    int64_t E, int64_t k);
  // dw (N,k): gradient of the routing weights; dprob_bias (E): a gradient added to every row's probabilities
  // (the aux loss term, may be null). Writes dlogits (N,E) (overwrites): renormalisation backward (norm),
  // scatter to the selected experts, then softmax backward.
  void (*backward)(float* dlogits, const float* probs, const int32_t* idx, const float* dw,
                   const float* dprob_bias, int64_t N, int64_t E, int64_t k, bool norm);
  // torchtitan's aux-loss-free update of one layer: delta = coeff * sign(mean(counts) - counts), centred to
  // zero mean, bias += delta; then counts = 0.   bias, counts (E)
  void (*update_bias)(float* bias, float* counts, int64_t E, double coeff);
  // HF load_balancing_loss_func from the statistics aux_stats accumulated over R routed rows (every sparse
  // layer's): *aux = moe_aux_loss(stats, E, R, dprob), dprob (E) its gradient per row (below). On the
  // device: nothing waits for it (compile mode's forward keeps its aux loss there).   stats (2E)
  void (*aux_loss)(double* aux, float* dprob, const double* stats, int64_t E, double R);
};

// The MoE aux loss of HF's load_balancing_loss_func: aux = E * sum_e (slots routed to e / R) * (mean router
// probability of e), stats = {counts (E), probability sums (E)} over R rows; dprob[e] = d aux / d probs[n,e]
// = E * f_e / R, the same for every row (the counts are constants). The one formula of the host (Qwen3Model)
// and of every aux_loss implementation.
TITAN_HOST_DEVICE inline double moe_aux_loss(const double* stats, int64_t E, double R, float* dprob) {
  const double* counts = stats;
  const double* prob_sum = stats + E;
  double aux = 0;
  for (int64_t e = 0; e < E; ++e) aux += (counts[e] / R) * (prob_sum[e] / R);
  for (int64_t e = 0; e < E; ++e) dprob[e] = (float)((double)E * (counts[e] / R) / R);
  return aux * (double)E;
}

// Row packing of expert parallel (the all-to-all payloads). Token slot n*k+s of a rank's N tokens routes to
// expert idx[n*k+s]; order (S = N*k) lists the slots by destination rank; El experts per rank. An order
// entry of -1 is a padding row (the fixed-capacity layout of route_fixed).
struct ExpertParallelKernels {
  static constexpr const char* kOp = "expert_parallel";
  // send row i (width H+2) = [x[slot / k] (H) | w[slot] | idx[slot] mod El], slot = order[i]; a padding
  // row is [0 (H) | 0 | -1].
  void (*pack)(float* send, const float* x, const float* w, const int32_t* idx, const int64_t* order,
               int64_t S, int64_t k, int64_t H, int64_t El);
  // Received rows (R, H+2) -> x (R,H), w (R), local expert (R). Returns how many rows name an expert
  // outside [0, El) (a malformed exchange; waits for the device).
  int64_t (*unpack)(float* x, float* w, int32_t* idx, const float* recv, int64_t R, int64_t H, int64_t El);
  // send row i = src[order[i] / k]  (rows of H; 0 for padding): the gradients of the outputs, sent the same
  // way.
  void (*gather_rows)(float* send, const float* src, const int64_t* order, int64_t S, int64_t k, int64_t H);
  // dst row r (width H+1) = [dx[r] (H) | dw[r]].
  void (*pack_grads)(float* dst, const float* dx, const float* dw, int64_t R, int64_t H);
  // Returned rows (width `row` >= H) back to tokens, slots summed in order s:
  //   out[n] (= or += when accumulate) sum_s rows[pos[n*k+s]][0:H];
  //   dtw[n*k+s] += rows[pos[n*k+s]][H] when dtw is not null (row = H+1).
  void (*combine)(float* out, float* dtw, const float* rows, const int64_t* pos, int64_t N, int64_t k,
                  int64_t H, int64_t row, bool accumulate);
  // The fixed-capacity layout (compile mode: the all-to-all's sizes cannot depend on the routing): `ranks`
  // blocks of S rows, block d holding the slots routed to rank d (idx / El = d) in ascending order, then
  // padding. order (ranks * S): the slot at each position, -1 for padding; pos (S): each slot's position.
  // Nothing waits for the device.
  void (*route_fixed)(int64_t* order, int64_t* pos, const int32_t* idx, int64_t S, int64_t El, int64_t ranks);
  // unpack without the check (nothing waits for the device): padding rows keep their expert index -1 (the
  // device-routed experts leave such rows unrouted).
  void (*unpack_padded)(float* x, float* w, int32_t* idx, const float* recv, int64_t R, int64_t H);
};

// General GEMM as cblas_sgemm(CblasRowMajor, ...): C (M,N) = alpha op(A) op(B) + beta C with leading
// dimensions; op(A) (M,K) is A, or A^T of a stored (K,M); op(B) (K,N) likewise. beta = 0 never reads C.
// For the strided and scaled products of adapters (LoRA) that MatmulKernels does not express.
struct GemmKernels {
  static constexpr const char* kOp = "gemm";
  void (*gemm)(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
               const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
};

// Inverted dropout with a counter-based mask (no RNG state) over a contiguous (rows, cols) buffer: element
// (r, c) is kept when u(key + r * key_stride + c) >= p, u = the top 24 bits of splitmix64(.) / 2^24, and
// scaled by 1 / (1 - p). key_stride = cols numbers the elements in order; a larger one gives a column slice
// the masks of the full matrix's columns (tensor parallel: key + rank * cols, key_stride = size * cols).
// forward: out = mask * x / (1-p);   backward_add: dx += mask * g / (1-p)  (the same key redraws the mask).
// key_add (one u64 in the op's device memory, or null) is added to key: a part of the key that changes per
// step without the host (compile mode's forward count).
struct DropoutKernels {
  static constexpr const char* kOp = "dropout";
  void (*forward)(float* out, const float* x, int64_t rows, int64_t cols, uint64_t key, uint64_t key_stride,
                  float p, const uint64_t* key_add);
  void (*backward_add)(float* dx, const float* g, int64_t rows, int64_t cols, uint64_t key,
                       uint64_t key_stride, float p, const uint64_t* key_add);
};

}  // namespace titan
