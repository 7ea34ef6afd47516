// One training step's forward and backward under pipeline parallel: the rank's stages of the model (a
// Qwen3Model holding those layer ranges) run the schedule's actions (distributed/pipeline_layout.h) over the
// micro-batches of a batch, hidden states sent to the next stage's rank and their gradients back over the
// pipeline group (device buffers: NCCL on GPUs), the MoE aux statistics (host values) over its host group.
//
// Activations: a stage keeps each in-flight micro-batch's input (N x H) and the model one set of layer
// activations, those of its last forward. A backward whose micro-batch is not the last forward on this rank
// first runs that stage's forward again from the kept input (bit-identical: the same kernels on the same
// input), as GPipe's re-materialisation; a forward followed at once by its own backward (the last stage
// under 1F1B) is not repeated. Each micro-batch's forward with gradients runs exactly once per stage, so MoE
// token counts and the head's gradient are taken once.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "data/loader.h"
#include "distributed/pipeline_layout.h"
#include "distributed/process_group.h"
#include "models/qwen3/model.h"

namespace titan {

struct PipelineTotals {
  double loss_sum = 0;     // CE sum over the batch's valid targets (the last stage's; 0 elsewhere)
  double num_valid = 0;    // its valid targets
  double aux_sum = 0;      // MoE: sum over the micro-batches of their aux loss
  double busy_s = 0;       // seconds in the model's forward/backward
  double wait_s = 0;       // seconds waiting for messages (the bubble, as this rank sees it)
  int64_t recomputed = 0;  // stage forwards run again before their backward
};

class PipelineStep {
 public:
  // model: holds the stages layout.stages_of(group.rank()), in that order (model stage k = the k-th).
  PipelineStep(Qwen3Model& model, const dist::PipelineLayout& layout, dist::ProcessGroup& group);
  // Forward and backward of `batch` (layout.microbatches x layout.microbatch_size rows); gradients
  // accumulate in the model. base: the options of every micro-batch's forward (grad_scale,
  // labels_shifted, aux_loss_scale). Collective over the pipeline group.
  void run(const data::Batch& batch, const ForwardOptions& base, PipelineTotals& totals);
  // Forward only (validation): every micro-batch through the stages, micro-batch by micro-batch (rows of
  // layout.microbatch_size when they divide the batch, else the whole batch at once); adds the last
  // stage's CE sum and valid targets to totals. Collective over the pipeline group.
  void forward_only(const data::Batch& batch, const ForwardOptions& base, PipelineTotals& totals);

 private:
  int local_stage(int64_t stage) const;  // the model's stage index of layout stage `stage`
  int peer(int64_t stage) const { return static_cast<int>(layout_.stages[stage].rank); }
  // The messages between stages: stage `stage`'s input (rows x H) and the earlier stages' MoE aux
  // statistics (2E, MoE models) from its predecessor; its output and the statistics so far to its successor.
  void recv_input(int64_t stage, int64_t rows, Tensor& input, std::vector<double>& aux_in);
  void send_output(int64_t stage, int64_t rows);
  void wait_sends();  // every send of this rank delivered, on the group and its host group

  Qwen3Model& model_;
  const dist::PipelineLayout& layout_;
  dist::ProcessGroup& group_;
  std::vector<dist::PipelineAction> actions_;
  std::vector<int64_t> mine_;
};

}  // namespace titan
