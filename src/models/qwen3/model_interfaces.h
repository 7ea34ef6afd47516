// The interfaces between Qwen3Model and what drives it: the per-op kernel choice, the parameter list, the
// forward options and result, and the hooks through which data-parallel (ParamStreamer) and tensor-parallel
// (TensorParallelComm) layouts applied from outside the model reach into its step.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace titan {

// Implementation chosen per op ("" = the device's default). Keys are op names: matmul, rmsnorm, attention,
// swiglu, embedding, cross_entropy, moe_experts ("grouped" | "reference"), rope ("fused" | "reference" |
// "fast"; q and k are rotated by one rope_qk call when the name exists for rope_qk), rope_qk.
using KernelChoice = std::map<std::string, std::string>;

struct Param {
  std::string name;  // HF name, e.g. model.layers.0.self_attn.q_proj.weight
  int group = 0;
  int64_t offset = 0;  // elements into the group's flat buffer
  Shape shape;
  Tensor value, grad;  // views into the group's flat buffers
};

struct ForwardOptions {
  // Also differentiate the loss head: the lm_head runs over row chunks and each chunk's gradient is taken at
  // once (lm_head / tied embedding gradient accumulated here, d(final norm) kept for backward()), so the
  // (N,V) logits never exist in full. backward() must follow for the rest of the gradients.
  bool compute_grad = true;
  bool keep_logits = false;  // copy the logits out before they are overwritten by their gradient
  float grad_scale = 0.0f;   // d(loss_sum)/d(row loss); 0 = 1/(number of valid targets) (HF mean)
  // false: HF semantics, labels[t + 1] is the target of position t (shifted inside, last ignored).
  // true: torchtitan semantics, labels[t] is already the target of position t (packed windows).
  bool labels_shifted = false;
  // MoE: d(loss)/d(aux_loss) used by backward(); < 0 = router_aux_loss_coef when output_router_logits, else 0
  // (HF). A trainer accumulating micro-batches passes e.g. router_aux_loss_coef / micro_batches.
  float aux_loss_scale = -1.0f;
  // Packed rows (B,T) or null: HF's position_ids of padding-free packing. Each row holds whole documents
  // one after another, positions 0, 1, 2, ... restarting at 0 where a document begins; RoPE takes these
  // positions and attention stays inside each document (the kernels' doc_start mask).
  const int32_t* position_ids = nullptr;
  // Pipeline parallel (a model holding stages): the stage to run; its input hidden states (N,H) on the
  // device (null for a stage holding the embedding); the MoE aux-loss statistics of the stages before it
  // (2E, host; null: none). A pipeline runs each stage's forward with compute_grad once per micro-batch
  // (its MoE token counts are taken there); a forward that will be run again before its backward goes
  // without.
  int stage = 0;
  const float* stage_input = nullptr;
  const double* aux_stats_in = nullptr;
  // The loss stays on the device: nothing in the forward waits for it (a graph can hold the forward:
  // compile mode). The result's loss, loss_sum, ce_loss and aux_loss are then NaN;
  // Qwen3Model::device_loss_sum() and device_aux_loss() read them once the device is done. MoE models take
  // all their layers in one stage (the aux-loss statistics of pipeline stages are combined on the host);
  // loss parallel, and the aux-loss statistics of tensor-parallel row slices and context-parallel chunks,
  // combine the ranks' values with all-reduces on the device.
  bool loss_on_device = false;
  // The ids, targets, gradient scale and (packed rows) position tables are on the device already
  // (Qwen3Model::stage_inputs with the same arrays and options): no copy of host memory in the forward, so a
  // graph can hold it and replay it for the next staged batch. The forward still reads the arrays on the
  // host (to check them and count the valid targets).
  bool inputs_staged = false;
  // With inputs_staged / loss_on_device: which micro-batch staged by stage_inputs() the forward reads, and
  // which of the device loss sums it writes (compile mode with gradient accumulation: one slot each).
  int64_t staged_slot = 0;
};

struct ForwardResult {
  double loss = 0;        // HF loss: CE mean over valid targets (+ router_aux_loss_coef * aux_loss for MoE
                          // models with output_router_logits)
  double loss_sum = 0;    // CE sum over valid targets (no aux term)
  int64_t num_valid = 0;  // targets that are not ignore_index
  double ce_loss = 0;     // CE mean alone
  double aux_loss = 0;    // MoE: HF load_balancing_loss_func over all sparse layers (computed always)
};

// Parameter streaming (FSDP / ZeRO-3): the model keeps no full parameter or gradient buffers. Before a
// group's forward or backward it asks for the group's gathered parameters and a gradient buffer, and
// hands the gradient back as soon as the backward has finished it (to be reduce-scattered into shards).
// Groups are the flat buffers: 0 = embed_tokens, 1..L = decoder layers, L+1 = final norm (+ lm_head).
class ParamStreamer {
 public:
  virtual ~ParamStreamer() = default;
  virtual Tensor gather_params(int group) = 0;  // the group's full parameters (collective)
  virtual void release_params(int group) = 0;   // done with them until the next gather
  virtual Tensor grad_buffer(int group) = 0;    // a zeroed full gradient buffer for the group
  virtual void reduce_grads(int group) = 0;     // the group's gradient is complete (collective); drops it
  virtual void zero_grads() = 0;                // a new gradient-accumulation window starts
  // The group's parameters as bf16 in host memory where the streamer holds them so (a frozen bf16 base),
  // else nullptr: the bf16 GEMMs then read them in place instead of a converted image.
  virtual const uint16_t* bf16_params(int /*group*/) const { return nullptr; }
};

// Tensor parallel (distributed/tensor_parallel.h): a model holding one rank's slices of the full model (whole
// heads of q/k/v and o, a slice of the dense MLP's intermediate, a 1/size slice of the vocabulary's rows of
// the embedding and lm_head) runs these collectives over its tensor-parallel group at Megatron's points:
// sums after the row-parallel o_proj and down_proj and the vocab-parallel embedding in forward (the partial
// outputs), after the column-parallel q/k/v, gate/up and lm_head in backward (the partial input gradients),
// and the loss-parallel cross-entropy's row statistics. The layout that made the slices owns the group; the
// model only calls it.
class TensorParallelComm {
 public:
  virtual ~TensorParallelComm() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  virtual void sum(float* x, int64_t n) = 0;          // in place, over the group, x on the model's device
  virtual void max(float* x, int64_t n) = 0;          // elementwise max, the same
  virtual void sum_host(double* x, int64_t n) = 0;    // in place, over the group, x on the host
  virtual void sum_device(double* x, int64_t n) = 0;  // the same with x on the model's device
  // Sequence parallel (device buffers): full := the ranks' n-float blocks in rank order; local := the sum
  // over the ranks of their full[rank() * n, (rank() + 1) * n).
  virtual void all_gather(const float* local, float* full, int64_t n) = 0;
  virtual void reduce_scatter(const float* full, float* local, int64_t n) = 0;
};

// Context parallel: every sequence of the batch split over a group of ranks for causal load balance as two
// mirrored chunks per rank. A sequence padded to a multiple of 2 x size is cut into 2 x size chunks of c
// tokens; rank r holds chunks r and 2 x size - 1 - r, in that order (its 2c rows per sequence). Every op but
// attention is row-wise; attention passes the keys and values around the ring (Qwen3Model). The layout that
// made the group owns it; the model only calls it.
class ContextParallelComm {
 public:
  virtual ~ContextParallelComm() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // One step of the ring (device buffers of n floats): sends[i] goes to the next rank (rank + 1 mod size)
  // and recvs[i] is filled from the previous rank's sends[i], every message posted at once (NCCL's grouped
  // send/receive: a rank never waits for a send before posting its receives); returns when all arrived and
  // this rank's were delivered. Every rank passes as many blocks; a recv buffer is not a send buffer.
  virtual void ring_shift(const std::vector<const float*>& sends, const std::vector<float*>& recvs,
                          int64_t n) = 0;
  virtual void sum_host(double* x, int64_t n) = 0;    // in place over the group, x on the host
  virtual void sum_device(double* x, int64_t n) = 0;  // the same with x on the model's device
};

// Position in the whole sequence of row t of rank `rank`'s rows (local_len = 2c rows per sequence).
inline int64_t context_parallel_position(int rank, int size, int64_t local_len, int64_t t) {
  const int64_t c = local_len / 2;
  return (t < c ? rank : 2 * size - 1 - rank) * c + t % c;
}

}  // namespace titan
