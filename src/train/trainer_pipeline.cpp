// Pipeline parallel in the trainer: this rank's stages of the model and, at the end, the full model
// gathered on rank 0 for the HF export and the sample.
#include <cstdio>

#include "core/error.h"
#include "distributed/process_group.h"
#include "models/qwen3/model.h"
#include "train/pipeline_step.h"
#include "train/trainer.h"

namespace titan {

void Trainer::build_pipeline_model() {
  const dist::PipelineLayout& layout = plan_.pipeline;
  std::vector<StageRange> ranges;
  for (int64_t s : layout.stages_of(pp_group_->rank())) {
    const dist::PipelineStage& st = layout.stages[s];
    ranges.push_back({st.first_layer, st.first_layer + st.num_layers, st.embedding, st.head});
  }
  model_ = std::make_unique<Qwen3Model>(mc_, kernels_, nullptr, true, device_, ranges);
  model_->init_weights(cfg_.training.seed);  // every parameter drawn: the held ones equal one rank's
  model_->set_activation_checkpoint_every(cfg_.activation_checkpoint.every());
  model_->set_activation_recompute_ops(cfg_.activation_checkpoint.recompute_ops());
  export_model_ = model_.get();
  find_resume_checkpoint();
  load_initial_weights();
  pipeline_ = std::make_unique<PipelineStep>(*model_, layout, *pp_group_);
  if (lead_) {
    std::printf(
        "pipeline parallel: %lld ranks, schedule %s, %lld micro-batches of %lld rows, bubble %.1f%%\n",
        (long long)layout.degree, dist::pipeline_schedule_name(layout.schedule),
        (long long)layout.microbatches, (long long)layout.microbatch_size, 100.0 * layout.bubble_fraction());
    std::printf("%s", layout.describe().c_str());
  }
}

// Rank 0 (pipeline rank 0 of data-parallel index 0) receives every group it does not hold from the rank
// of its pipeline group that does, and the sparse layers' expert biases; collective over that group.
void Trainer::gather_pipeline_model() {
  if (dp_pg().rank() != 0) return;
  dist::ProcessGroup& pp = *pp_group_;
  const int64_t L = mc_.num_hidden_layers;
  auto owner = [&](int g) -> int {
    for (const dist::PipelineStage& st : plan_.pipeline.stages) {
      if (g == 0 && st.embedding) return static_cast<int>(st.rank);
      if (g == L + 1 && st.head) return static_cast<int>(st.rank);
      if (g >= 1 && g <= L && g - 1 >= st.first_layer && g - 1 < st.first_layer + st.num_layers)
        return static_cast<int>(st.rank);
    }
    fail("pipeline: no stage holds group ", g);
  };
  if (lead_) {
    const bool on_cpu = model_->device().type == DeviceType::CPU;
    gathered_ = std::make_unique<Qwen3Model>(mc_, on_cpu ? cfg_.kernels : KernelChoice{});
  }
  std::vector<int64_t> bias_row(static_cast<size_t>(L), -1);  // row of layer l in a full model's bias
  for (int64_t l = 0, m = 0; l < L; ++l)
    if (mc_.is_moe_layer(l)) bias_row[l] = m++;
  const int64_t E = mc_.num_experts;
  for (int g = 0; g < model_->num_groups(); ++g) {
    const int from = owner(g);
    if (lead_) {
      Tensor& dst = gathered_->flat_params()[g];
      if (from == 0)
        dst.copy_from(model_->flat_params()[g]);
      else
        pp.recv(dst.raw(), dst.numel(), dist::CommType::F32, from);
    } else if (pp.rank() == from) {
      pp.send(model_->flat_params()[g].raw(), model_->group_numel(g), dist::CommType::F32, 0);
    }
    if (g == 0 || g > L || bias_row[g - 1] < 0) continue;
    const int64_t l = g - 1;
    if (lead_) {
      float* dst = gathered_->expert_bias().f32() + bias_row[l] * E;
      if (from == 0) {
        const auto& mine = model_->moe_layers();
        const int64_t row = std::find(mine.begin(), mine.end(), l) - mine.begin();
        model_->expert_bias().view_at(row * E, {E}).copy_to_host(dst);
      } else {
        pp.recv(dst, E, dist::CommType::F32, from);
      }
    } else if (pp.rank() == from) {
      const auto& mine = model_->moe_layers();
      const int64_t row = std::find(mine.begin(), mine.end(), l) - mine.begin();
      pp.send(model_->expert_bias().f32() + row * E, E, dist::CommType::F32, 0);
    }
  }
  pp.wait_sends();
  if (lead_) export_model_ = gathered_.get();
}

}  // namespace titan
