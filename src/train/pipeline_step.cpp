#include "train/pipeline_step.h"

#include <algorithm>
#include <chrono>
#include <map>

#include "core/error.h"
#include "models/qwen3/lora.h"

namespace titan {

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

PipelineStep::PipelineStep(Qwen3Model& model, const dist::PipelineLayout& layout, dist::ProcessGroup& group)
    : model_(model), layout_(layout), group_(group) {
  TITAN_CHECK(group.size() == layout.degree, "pipeline: a group of ", group.size(), " ranks for ",
              layout.degree, " pipeline ranks");
  mine_ = layout.stages_of(group.rank());
  TITAN_CHECK(static_cast<int>(mine_.size()) == model.num_stages(), "pipeline: the model holds ",
              model.num_stages(), " stages, the layout gives this rank ", mine_.size());
  actions_ = dist::pipeline_actions(layout, group.rank());
  group.connect_neighbours();  // (stages send to the next and previous pipeline rank only)
}

void PipelineStep::recv_input(int64_t stage, int64_t rows, Tensor& input, std::vector<double>& aux_in) {
  const int64_t H = model_.config().hidden_size, E = model_.config().num_experts;
  if (!input.defined() || input.numel() != rows * H)
    input = Tensor::empty({rows, H}, DType::F32, model_.device());
  group_.recv(input.raw(), rows * H, dist::CommType::F32, peer(stage - 1));
  if (model_.aux_stats().empty()) return;
  aux_in.resize(2 * static_cast<size_t>(E));
  group_.host_group().recv(aux_in.data(), 2 * E, dist::CommType::F64, peer(stage - 1));
}

void PipelineStep::send_output(int64_t stage, int64_t rows) {
  group_.send(model_.stage_output(), rows * model_.config().hidden_size, dist::CommType::F32,
              peer(stage + 1));
  const std::vector<double>& aux = model_.aux_stats();
  if (!aux.empty())
    group_.host_group().send(aux.data(), static_cast<int64_t>(aux.size()), dist::CommType::F64,
                             peer(stage + 1));
}

int PipelineStep::local_stage(int64_t stage) const {
  return static_cast<int>(std::find(mine_.begin(), mine_.end(), stage) - mine_.begin());
}

void PipelineStep::run(const data::Batch& batch, const ForwardOptions& base, PipelineTotals& totals) {
  const int64_t mb = layout_.microbatch_size, T = batch.seq_len, H = model_.config().hidden_size;
  const int64_t N = model_.stage_rows(mb, T), E = model_.config().num_experts;
  const bool moe = model_.aux_stats().size() > 0;
  TITAN_CHECK(batch.batch_size == layout_.microbatches * mb, "pipeline: a batch of ", batch.batch_size,
              " rows for ", layout_.microbatches, " micro-batches of ", mb);
  // Per (stage, micro-batch): its input hidden states and the earlier stages' aux statistics.
  struct Kept {
    Tensor input;
    std::vector<double> aux_in;
  };
  std::map<std::pair<int64_t, int64_t>, Kept> kept;
  Tensor dout = Tensor::empty({N, H}, DType::F32, model_.device());
  std::vector<float> aux_grad(static_cast<size_t>(E) + 1);  // d aux / d probs (E), then d loss / d aux
  auto timed_wait = [&](auto&& f) {
    const double t0 = now_s();
    f();
    totals.wait_s += now_s() - t0;
  };
  // LoRA dropout: every micro-batch draws the masks of its rows of the batch in this batch's pass, as one
  // rank's forward of the whole batch would (also a forward without gradients whose output goes on).
  LoraAdapters* lora = model_.lora();
  const uint64_t pass = lora ? lora->passes() + 1 : 0;
  auto forward = [&](int64_t stage, int64_t micro, bool grad) {
    Kept& k = kept[{stage, micro}];
    if (lora) lora->pin_masks(pass, micro * mb * T);
    ForwardOptions o = base;
    o.stage = local_stage(stage);
    o.compute_grad = grad;
    o.stage_input = k.input.defined() ? k.input.f32() : nullptr;
    o.aux_stats_in = k.aux_in.empty() ? nullptr : k.aux_in.data();
    const int64_t row = micro * mb * T;
    if (!batch.position_ids.empty()) o.position_ids = batch.position_ids.data() + row;
    const double t0 = now_s();
    ForwardResult r = model_.forward(batch.input_ids.data() + row, batch.labels.data() + row, mb, T, o);
    totals.busy_s += now_s() - t0;
    return r;
  };
  for (size_t i = 0; i < actions_.size(); ++i) {
    const dist::PipelineAction& a = actions_[i];
    const dist::PipelineStage& st = layout_.stages[a.stage];
    if (a.forward) {
      Kept& k = kept[{a.stage, a.micro}];
      if (!st.embedding)  // the previous stage's output (and aux statistics)
        timed_wait([&] { recv_input(a.stage, N, k.input, k.aux_in); });
      // With gradients only when this micro-batch's backward comes next here (else that backward
      // re-runs it): each stage's forward with gradients runs once per micro-batch.
      const bool grad_now = i + 1 < actions_.size() && !actions_[i + 1].forward &&
                            actions_[i + 1].stage == a.stage && actions_[i + 1].micro == a.micro;
      ForwardResult r = forward(a.stage, a.micro, grad_now);
      if (st.head) {
        totals.loss_sum += r.loss_sum;
        totals.num_valid += static_cast<double>(r.num_valid);
        totals.aux_sum += r.aux_loss;
      } else {
        send_output(a.stage, N);
      }
      continue;
    }
    // Backward: the model must hold this micro-batch's activations of this stage, with gradients.
    const bool fresh = i > 0 && actions_[i - 1].forward && actions_[i - 1].stage == a.stage &&
                       actions_[i - 1].micro == a.micro;
    if (!fresh) {
      forward(a.stage, a.micro, true);
      ++totals.recomputed;
    }
    if (!st.head)
      timed_wait([&] {
        group_.recv(dout.raw(), N * H, dist::CommType::F32, peer(a.stage + 1));
        if (moe) group_.host_group().recv(aux_grad.data(), E + 1, dist::CommType::F32, peer(a.stage + 1));
      });
    const double t0 = now_s();
    if (st.head) {
      model_.backward();
      if (moe) {
        std::copy(model_.aux_dprob().begin(), model_.aux_dprob().end(), aux_grad.begin());
        aux_grad[E] = model_.aux_scale();
      }
    } else {
      model_.backward(dout.f32(), moe ? aux_grad.data() : nullptr, moe ? aux_grad[E] : 0.0f);
    }
    totals.busy_s += now_s() - t0;
    if (!st.embedding) {
      group_.send(model_.stage_input_grad(), N * H, dist::CommType::F32, peer(a.stage - 1));
      if (moe) group_.host_group().send(aux_grad.data(), E + 1, dist::CommType::F32, peer(a.stage - 1));
    }
    kept.erase({a.stage, a.micro});
  }
  if (lora) lora->unpin_masks();  // (the pass count stays at this batch's)
  timed_wait([&] { wait_sends(); });
}

void PipelineStep::forward_only(const data::Batch& batch, const ForwardOptions& base,
                                PipelineTotals& totals) {
  const int64_t T = batch.seq_len;
  const int64_t mb =
      batch.batch_size % layout_.microbatch_size == 0 ? layout_.microbatch_size : batch.batch_size;
  const int64_t N = model_.stage_rows(mb, T);
  Tensor input;
  std::vector<double> aux_in;
  // Micro-batch by micro-batch, this rank's stages in model order: every item waits only on an earlier one.
  for (int64_t row = 0; row < batch.batch_size; row += mb)
    for (int64_t stage : mine_) {
      const dist::PipelineStage& st = layout_.stages[stage];
      ForwardOptions o = base;
      o.stage = local_stage(stage);
      o.compute_grad = false;
      if (!st.embedding) {
        recv_input(stage, N, input, aux_in);
        o.stage_input = input.f32();
        o.aux_stats_in = aux_in.empty() ? nullptr : aux_in.data();
      }
      const int64_t at = row * T;
      if (!batch.position_ids.empty()) o.position_ids = batch.position_ids.data() + at;
      const ForwardResult r = model_.forward(batch.input_ids.data() + at, batch.labels.data() + at, mb, T, o);
      if (st.head) {
        totals.loss_sum += r.loss_sum;
        totals.num_valid += static_cast<double>(r.num_valid);
      } else {
        send_output(stage, N);
      }
    }
  wait_sends();
}

void PipelineStep::wait_sends() {
  group_.wait_sends();
  if (&group_.host_group() != &group_) group_.host_group().wait_sends();
}

}  // namespace titan
