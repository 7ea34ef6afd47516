// Pipeline-parallel layout of a Qwen3 model (torchtitan's parallelism.pipeline_parallel_* keys): which
// decoder layers each (virtual) stage holds, which stages each pipeline rank runs, how many micro-batches
// a step runs, and what the schedule costs in idle time and activation memory. Used by the plan (titan
// plan, the memory checks before a run); a bad layout is one error naming the keys and the numbers.
//
// Stages (torchtitan's generate_llm_fqn_per_model_part): the embedding counts as first_stage_less_layers
// layers and norm + lm_head as last_stage_less_layers; the L + first + last "effective" layers are dealt
// evenly over the stages in order (the first stages get the remainder), and the first and last stages then
// hold that many fewer decoder layers. Placement: with one stage per rank stage s runs on rank s; looped
// schedules (Interleaved1F1B) give rank r the stages r, r + p, r + 2p, ...
//
// Schedules, for p ranks, m micro-batches and v stages per rank, counting a micro-batch's forward or
// backward through one stage as the unit of time (backward = 2 forwards):
//   GPipe           every forward, then every backward: idle (p - 1) / (m + p - 1) of the step; a rank
//                   holds all m micro-batches' activations.
//   1F1B            rank r runs p - r forwards, then alternates one backward and one forward: the same idle
//                   fraction, at most min(m, p - r) micro-batches in flight on rank r.
//   Interleaved1F1B v stages per rank in rounds of p micro-batches: idle (p - 1) / (v m + p - 1); rank r
//                   holds at most (v - 1) p + 2 (p - 1 - r) + 1 stage-micro-batches (each 1/v of its
//                   layers), never more than v m.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace titan::dist {

enum class PipelineSchedule { kGPipe, k1F1B, kInterleaved1F1B };

// torchtitan's names ("GPipe", "1F1B", "Interleaved1F1B"); any other is one error listing them.
PipelineSchedule parse_pipeline_schedule(const std::string& name);
const char* pipeline_schedule_name(PipelineSchedule s);

// The parallelism.pipeline_parallel_* settings (torchtitan's keys and defaults).
struct PipelineOptions {
  int64_t degree = 1;                   // pipeline_parallel_degree: ranks of a pipeline
  std::string schedule = "1F1B";        // pipeline_parallel_schedule
  int64_t microbatch_size = 1;          // pipeline_parallel_microbatch_size: rows of a micro-batch
  int64_t layers_per_stage = 0;         // pipeline_parallel_layers_per_stage (0: v stages per rank)
  int64_t first_stage_less_layers = 1;  // pipeline_parallel_first_stage_less_layers
  int64_t last_stage_less_layers = 1;   // pipeline_parallel_last_stage_less_layers
};

struct PipelineStage {
  int64_t first_layer = 0, num_layers = 0;  // decoder layers [first_layer, first_layer + num_layers)
  bool embedding = false;                   // the first stage: embed_tokens
  bool head = false;                        // the last stage: the final norm and lm_head
  int64_t rank = 0;                         // the pipeline rank that runs it
};

struct PipelineLayout {
  int64_t degree = 1;  // p
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  int64_t microbatches = 1, microbatch_size = 1;  // m per step and data-parallel rank (per accumulation step)
  std::vector<PipelineStage> stages;              // in model order
  int64_t stages_per_rank() const { return static_cast<int64_t>(stages.size()) / degree; }
  std::vector<int64_t> stages_of(int64_t rank) const;  // indices into stages, in the order the rank runs them
  // The fraction of a step each rank idles (the bubble), from the schedule's formula above.
  double bubble_fraction() const;
  // Peak activations rank r holds, in units of one micro-batch through all of that rank's layers.
  double peak_inflight(int64_t rank) const;
  std::string describe() const;  // the stages, one line each
};

// One unit of a schedule: a micro-batch's forward or backward through one stage (an index into
// PipelineLayout::stages).
struct PipelineAction {
  bool forward = true;
  int64_t stage = 0, micro = 0;
};
// The actions pipeline rank `rank` runs in one step, in order. GPipe: every forward, then the backwards
// from the last micro-batch down; 1F1B: p - 1 - r forwards, then one forward and one backward in turn, then
// the remaining backwards; Interleaved1F1B: the same over the rank's v stages, micro-batches in rounds of p
// (forwards through the stages in order, backwards in reverse), 2 (p - 1 - r) + (v - 1) p forwards first.
std::vector<PipelineAction> pipeline_actions(const PipelineLayout& layout, int64_t rank);

// num_layers: the model's decoder layers; local_batch: training.local_batch_size (rows per data-parallel
// rank and accumulation step), split into micro-batches of o.microbatch_size rows.
PipelineLayout make_pipeline_layout(int64_t num_layers, int64_t local_batch, const PipelineOptions& o);

}  // namespace titan::dist
