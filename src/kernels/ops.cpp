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

}  // namespace titan
