// Pipeline parallel in the trainer: this rank's stages of the model and, at the end, the full model
// gathered on rank 0 for the HF export and the sample.
#include <algorithm>
#include <cstdio>
#include <map>

#include "core/error.h"
#include "distributed/expert_parallel.h"
#include "distributed/process_group.h"
#include "models/qwen3/model.h"
#include "train/pipeline_step.h"
#include "train/trainer.h"

namespace titan {

std::vector<StageRange> Trainer::pipeline_ranges() const {
  std::vector<StageRange> ranges;
  if (!pp_group_) return ranges;  // the whole model
  for (int64_t s : plan_.pipeline.stages_of(pp_group_->rank())) {
    const dist::PipelineStage& st = plan_.pipeline.stages[s];
    ranges.push_back({st.first_layer, st.first_layer + st.num_layers, st.embedding, st.head});
  }
  return ranges;
}

void Trainer::build_pipeline_model() {
  const std::vector<StageRange> ranges = pipeline_ranges();
  // Expert parallel inside each stage: groups of expert_parallel_degree ranks of its data-parallel group.
  ep_group_ = dist::make_expert_group(dp_pg(), static_cast<int>(plan_.expert_parallel));
  model_ = std::make_unique<Qwen3Model>(mc_, kernels_, ep_group_.get(), true, device_, ranges);
  model_->init_weights(cfg_.training.seed);  // every parameter drawn: the held ones equal one rank's
  model_->set_activation_checkpoint_every(cfg_.activation_checkpoint.every());
  model_->set_activation_recompute_ops(cfg_.activation_checkpoint.recompute_ops());
  export_model_ = model_.get();
  find_resume_checkpoint();
  load_initial_weights();
  start_context_parallel();
  start_pipeline();
}

void Trainer::start_pipeline() {
  const dist::PipelineLayout& layout = plan_.pipeline;
  pipeline_ = std::make_unique<PipelineStep>(*model_, layout, *pp_group_);
  if (lead_) {
    std::printf(
        "pipeline parallel: %lld ranks, schedule %s, %lld micro-batches of %lld rows, bubble %.1f%%\n",
        (long long)layout.degree, dist::pipeline_schedule_name(layout.schedule),
        (long long)layout.microbatches, (long long)layout.microbatch_size, 100.0 * layout.bubble_fraction());
    std::printf("%s\n", layout.describe().c_str());
  }
}

// Rank 0 (pipeline rank 0 of data-parallel index 0) receives every parameter it does not hold, tensor by
// tensor in the full model's order, from the rank of its pipeline group holding it (under expert parallel
// each stage's experts are first gathered on its expert group's rank 0), and the sparse layers' expert
// biases. Collective over the expert groups, then over rank 0's pipeline group.
void Trainer::gather_pipeline_model() {
  // Tensor parallel: the stage's slices (and experts) gathered on its tensor-parallel rank 0.
  const NamedTensors mine = tp_         ? gather_tensor_parallel(tp_->rank() == 0)
                            : ep_group_ ? model_->gathered_state_dict()
                                        : model_->state_dict();
  if (dp_pg().rank() != 0 || (tp_ && tp_->rank() != 0)) return;
  dist::ProcessGroup& pp = pp_group_->host_group();  // (into the host model; device tensors staged)
  const int64_t L = mc_.num_hidden_layers, E = mc_.num_experts;
  auto owner = [&](int64_t g) -> int {
    for (const dist::PipelineStage& st : plan_.pipeline.stages) {
      if ((g == 0 && st.embedding) || (g == L + 1 && st.head) ||
          (g >= 1 && g <= L && g - 1 >= st.first_layer && g - 1 < st.first_layer + st.num_layers))
        return static_cast<int>(st.rank);
    }
    fail("pipeline: no stage holds group ", g);
  };
  std::map<std::string, const Tensor*> held;
  for (const auto& [name, t] : mine) held[name] = &t;
  const bool on_cpu = model_->device().type == DeviceType::CPU;
  if (lead_) gathered_ = std::make_unique<Qwen3Model>(mc_, on_cpu ? cfg_.kernels : KernelChoice{});
  const Qwen3Model layout(mc_, {}, nullptr, /*allocate=*/false);  // the full model's parameter list
  for (const Param& p : layout.params()) {
    const int from = owner(p.group);
    const int64_t n = shape_numel(p.shape);
    if (lead_) {
      Tensor& dst = gathered_->param(p.name).value;
      if (from == 0)
        dst.copy_from(*held.at(p.name));
      else
        pp.recv(dst.raw(), n, dist::CommType::F32, from);
    } else if (pp.rank() == from) {
      std::vector<float> h(static_cast<size_t>(n));
      held.at(p.name)->copy_to_host(h.data());
      pp.send(h.data(), n, dist::CommType::F32, 0);
    }
  }
  // Expert biases: row m of the full model's is its m-th sparse layer.
  for (int64_t l = 0, m = 0; l < L; ++l) {
    if (!mc_.is_moe_layer(l)) continue;
    const int from = owner(l + 1);
    const auto& local = model_->moe_layers();
    const int64_t row = std::find(local.begin(), local.end(), l) - local.begin();
    if (lead_) {
      float* dst = gathered_->expert_bias().f32() + m * E;
      if (from == 0)
        model_->expert_bias().view_at(row * E, {E}).copy_to_host(dst);
      else
        pp.recv(dst, E, dist::CommType::F32, from);
    } else if (pp.rank() == from) {
      std::vector<float> h(static_cast<size_t>(E));
      model_->expert_bias().view_at(row * E, {E}).copy_to_host(h.data());
      pp.send(h.data(), E, dist::CommType::F32, 0);
    }
    ++m;
  }
  pp.wait_sends();
  if (lead_) export_model_ = gathered_.get();
}

// The measured bubble: each pipeline rank's share of its step time spent waiting for the stage before or
// after it, averaged over the pipeline ranks (of data-parallel index 0), beside the schedule's formula.
void Trainer::report_pipeline_bubble() {
  if (dp_pg().rank() != 0 || pp_steps_ == 0) return;
  const int p = pp_group_->size();
  std::vector<double> mine = {pp_wait_s_ / std::max(1e-12, pp_wait_s_ + pp_busy_s_),
                              static_cast<double>(pp_recomputed_) / static_cast<double>(pp_steps_)};
  std::vector<double> all(2 * static_cast<size_t>(p));
  pp_group_->host_group().all_gather(mine.data(), all.data(), dist::equal_counts(p, 2), dist::CommType::F64);
  if (!lead_) return;
  double mean = 0;
  std::string per_rank;
  for (int r = 0; r < p; ++r) {
    mean += all[2 * r] / p;
    char buf[32];
    std::snprintf(buf, sizeof buf, "%s%.1f%%", r ? ", " : "", 100 * all[2 * r]);
    per_rank += buf;
  }
  double recomputed = 0;
  for (int r = 0; r < p; ++r) recomputed += all[2 * r + 1];
  std::printf(
      "pipeline: idle %.1f%% of the step on average over %d pipeline ranks (%s; steps 2+), the schedule's "
      "bubble %.1f%%; %.0f stage forwards re-run per step\n",
      100 * mean, p, per_rank.c_str(), 100 * plan_.pipeline.bubble_fraction(), recomputed);
}

}  // namespace titan
