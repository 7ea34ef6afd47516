#include "train/evaluate.h"

#include "distributed/process_group.h"
#include "train/pipeline_step.h"

namespace titan {

EvalResult evaluate_loss(Qwen3Model& model, data::DataLoader& loader, int64_t max_batches,
                         dist::ProcessGroup* pg, PipelineStep* pipeline, const BatchRows& rows) {
  EvalResult out;
  data::Batch batch;
  double sums[2] = {0, 0};  // CE sum, valid targets: summed over the ranks at the end
  while ((max_batches < 0 || out.batches < max_batches) && loader.next_batch(batch)) {
    if (rows) batch = rows(batch);
    ForwardOptions fo;
    fo.compute_grad = false;
    fo.labels_shifted = true;  // loader labels: labels[t] is the target of position t
    if (pipeline) {
      PipelineTotals t;
      pipeline->forward_only(batch, fo, t);
      sums[0] += t.loss_sum;
      sums[1] += t.num_valid;
      ++out.batches;
      continue;
    }
    if (!batch.position_ids.empty()) fo.position_ids = batch.position_ids.data();  // packed chat rows
    const ForwardResult r =
        model.forward(batch.input_ids.data(), batch.labels.data(), batch.batch_size, batch.seq_len, fo);
    sums[0] += r.loss_sum;
    sums[1] += static_cast<double>(r.num_valid);
    ++out.batches;
  }
  if (pg && pg->size() > 1) pg->all_reduce(sums, 2, dist::ReduceOp::Sum);
  out.loss_sum = sums[0];
  out.targets = static_cast<int64_t>(sums[1]);
  return out;
}

}  // namespace titan
