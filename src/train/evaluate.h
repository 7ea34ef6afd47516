// Forward-only evaluation: the mean next-token cross-entropy of a model over the windows of a data
// loader (the trainer's validation; a standalone evaluation can call the same function).
#pragma once
#include <cmath>
#include <cstdint>
#include <functional>

#include "data/loader.h"
#include "models/qwen3/model.h"

namespace titan {

namespace dist {
class ProcessGroup;
}
class PipelineStep;

struct EvalResult {
  double loss_sum = 0;  // cross-entropy summed over the valid targets (every rank)
  int64_t targets = 0;  // valid targets (labels != -100), every rank
  int64_t batches = 0;  // batches evaluated by each rank
  // Mean cross-entropy per target (NaN when there was none) and its exponential, the perplexity.
  double loss() const { return targets > 0 ? loss_sum / static_cast<double>(targets) : std::nan(""); }
  double perplexity() const { return std::exp(loss()); }
};

// Runs `model` forward only (no gradient buffer is read or written, no MoE token counts are kept) over
// the next `max_batches` batches of `loader` (< 0: until the loader runs out, so give it max_epochs = 1),
// from wherever the loader stands. The loader's labels are the next tokens (packed windows), -100 for
// targets to ignore. The cross-entropy is the plain CE (no MoE aux term).
//
// With `pg` (world > 1) every rank reads its own windows and the sums are all-reduced: the result is the
// mean over every rank's windows, the same on each rank. Collective: every rank calls it, and the
// loaders must give every rank the same number of batches (DataLoader does).
// pipeline: the model holds pipeline stages; each batch runs forward through the pipeline (every rank of
// a pipeline reads the same batches; the loss is the last stage's).
// rows: this rank's part of each batch (context parallel: its chunks of every sequence); null: the batch.
using BatchRows = std::function<data::Batch(const data::Batch&)>;
EvalResult evaluate_loss(Qwen3Model& model, data::DataLoader& loader, int64_t max_batches,
                         dist::ProcessGroup* pg = nullptr, PipelineStep* pipeline = nullptr,
                         const BatchRows& rows = nullptr);

}  // namespace titan
