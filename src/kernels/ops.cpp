#include "kernels/ops.h"

#include <cmath>

namespace titan {

// torch.optim.AdamW's bias corrections in double, the step's factors rounded to float once.
AdamWStepScalars adamw_step_scalars(float lr, float beta1, float beta2, float weight_decay, int64_t step) {
  const double bc1 = 1.0 - std::pow((double)beta1, (double)step);
  const double bc2 = 1.0 - std::pow((double)beta2, (double)step);
  AdamWStepScalars s;
  s.lr = lr;
  s.step = step;
  s.decay = (float)(1.0 - (double)lr * weight_decay);
  s.step_size = (float)(lr / bc1);
  s.bc2_sqrt = (float)std::sqrt(bc2);
  return s;
}

// VocabParallelCrossEntropyKernels' combining ops for devices whose memory is the host's.
void shard_row_max_on_host(float* m, const float* stats, int64_t N) {
  for (int64_t n = 0; n < N; ++n) m[n] = stats[3 * n];
}

void shard_rescale_on_host(float* stats, const float* m, int64_t N) {
  for (int64_t n = 0; n < N; ++n) {
    stats[3 * n + 1] *= std::exp(stats[3 * n] - m[n]);
    stats[3 * n] = 0.0f;
  }
}

void shard_loss_on_host(float* m, const float* stats, const int32_t* targets, int64_t N, double* loss_sum) {
  double loss = 0;
  for (int64_t n = 0; n < N; ++n) {
    m[n] += std::log(stats[3 * n + 1]);
    if (targets[n] >= 0) loss += (double)m[n] - stats[3 * n + 2];
  }
  *loss_sum += loss;
}

}  // namespace titan
