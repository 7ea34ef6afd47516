// The trainer's state in checkpoints (src/checkpoint): which tensors a training checkpoint holds, the
// metadata that makes a resume exact, and the checks that refuse a checkpoint of another run.
//
// Tensors (1-D, f32, in the model's flat layer-group layout, so any sharding can read any other):
//   model/<group>        parameters (the f32 master copy under bf16 mixed precision)
//   exp_avg/<group>      AdamW first moment
//   exp_avg_sq/<group>   AdamW second moment
//   buffer/<name>        non-parameter model state (MoE expert bias), written by rank 0
// with <group> = embed | layers.N | final. Metadata: step, model config (HF config.json form), optimizer
// step count and hyper-parameters, LR schedule, data-loader position, batch shape, seed.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "distributed/data_parallel_plan.h"
#include "distributed/tensor_parallel.h"
#include "models/qwen3/model.h"
#include "optim/optimizer.h"
#include "train/config.h"

namespace titan {

// "embed", "layers.N" or "final" for flat group g of a model with `num_layers` layers.
std::string group_name(int64_t num_layers, int g);

// Tensor parallel: checkpoint slices placing each of `local` (this rank's slices) at its place in the full
// layout `full` (the same names): under the keys group_keys(group) (values, exp_avg, exp_avg_sq), each of
// full_numel(group) elements; the values, moments and FSDP shard ranges are the optimizer's (dp's).
void tensor_parallel_slices(const std::vector<Param>& local, const std::vector<Param>& full,
                            const std::function<std::array<std::string, 3>(int group)>& group_keys,
                            const std::function<int64_t(int group)>& full_numel, dist::DataParallelPlan& dp,
                            AdamW& optimizer, bool for_save, const dist::TensorParallel& tp,
                            std::vector<ckpt::Slice>& out);

// This rank's slices of the training state: parameters and optimizer moments where dp puts them (full
// buffers or FSDP shards; under expert parallel the non-expert part and this rank's experts, placed in
// the group's all-experts layout), plus the buffers. for_save: only what this rank writes (one copy of
// everything across the ranks); otherwise everything it holds (a load).
// Under tensor parallel (tp, with the full model's config) the slices are this rank's parts of the full
// model's groups, so a checkpoint reads back on any layout; replicated parameters are written by tensor-
// parallel rank 0.
std::vector<ckpt::Slice> training_slices(Qwen3Model& model, dist::DataParallelPlan& dp, AdamW& optimizer,
                                         bool for_save, const dist::TensorParallel* tp = nullptr,
                                         const Qwen3Config* full_config = nullptr);
// The parameter groups (this rank's experts under expert parallel) and buffers of `model` (a
// model-only load or a conversion).
std::vector<ckpt::Slice> model_slices(Qwen3Model& model);

// Metadata of a training checkpoint (everything but the tensors).
nlohmann::json training_metadata(const Qwen3Config& model_config, const TrainConfig& cfg,
                                 const AdamW& optimizer, const nlohmann::json& loader_state,
                                 const dist::DataParallelPlan& dp, int64_t global_batch_size);

// The model config a checkpoint was saved with (its metadata's model_config), validated.
Qwen3Config saved_model_config(const ckpt::Reader& reader);

// Throws (naming the checkpoint and the field) unless `reader` holds this model's state and a run with
// this batch shape can continue it exactly; every field a resume reads is checked here.
void check_same_model(const ckpt::Reader& reader, const Qwen3Config& config);
void check_resumable(const ckpt::Reader& reader, const Qwen3Config& config, const TrainConfig& cfg,
                     int64_t global_batch_size);

// True when the checkpoint holds training state (optimizer, data position), false for a model-only
// (seed) checkpoint, which a run loads as its initial weights.
inline bool has_training_state(const ckpt::Reader& reader) {
  return reader.meta().contains("optimizer");
}

// Writes a model-only checkpoint of `model`: zero optimizer moments, no data position (titan convert
// HF -> checkpoint; a seed checkpoint). Single process.
std::string save_model_checkpoint(Qwen3Model& model, const std::string& folder, int64_t step);

// Loads a model's parameters and buffers from a training checkpoint (the optimizer state is ignored).
void load_model_from_checkpoint(Qwen3Model& model, const std::string& dir, bool log);
// Tensor parallel: this rank's slices of a checkpoint of the full model (config full_config), read slice
// by slice (no rank reads the full model).
void load_model_from_checkpoint(Qwen3Model& local, const std::string& dir, bool log,
                                const dist::TensorParallel& tp, const Qwen3Config& full_config);

}  // namespace titan
