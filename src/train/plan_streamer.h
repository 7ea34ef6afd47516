// The model's parameter streamer over a data-parallel plan (FSDP/HSDP with stream_params: ZeRO-3).
#pragma once
#include "distributed/data_parallel_plan.h"
#include "models/qwen3/model.h"

namespace titan {

class PlanStreamer final : public ParamStreamer {
 public:
  explicit PlanStreamer(dist::DataParallelPlan& dp) : dp_(dp) {}
  Tensor gather_params(int g) override { return dp_.gather_params(g); }
  void release_params(int g) override { dp_.release_params(g); }
  Tensor grad_buffer(int g) override { return dp_.grad_buffer(g); }
  void reduce_grads(int g) override { dp_.reduce_grads(g); }
  void zero_grads() override { dp_.zero_grads(); }

 private:
  dist::DataParallelPlan& dp_;
};

}  // namespace titan
