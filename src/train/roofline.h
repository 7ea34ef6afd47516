// A roofline prediction of one training step of a run plan on a GPU (`titan plan --gpu h100|h200|b200`):
// each op class's time from its FLOPs and bytes at stated rates, and the step's tokens/s and MFU. The
// rates are the published peaks times stated efficiencies: GEMMs at cuBLAS's large-shape efficiency,
// attention at cuDNN's fused SDPA rates (forward and backward separately), memory-bound ops at a fraction
// of HBM bandwidth, NCCL at a fraction of the NVLink bandwidth, and a host cost per kernel launch (the
// eager step is launch-bound when the host needs longer than the GPU). On a GPU the measured op classes
// are set beside these predictions (scripts/gpu_session.sh); without one they are the plan to confirm.
#pragma once
#include <string>
#include <vector>

#include "models/qwen3/config.h"
#include "train/plan.h"

namespace titan {

struct GpuSpec {
  std::string name;
  double bf16_tflops = 0;  // dense bf16 tensor-core peak: the MFU denominator
  double f32_tflops = 0;   // f32 on CUDA cores (titan's f32 GEMMs compute in strict f32, no TF32)
  double hbm_tbps = 0;     // HBM bandwidth, TB/s
  double link_gbps = 0;    // NVLink bandwidth per GPU and direction, GB/s
  double memory_gib = 0;
};

// "h100" (SXM), "h200", "b200" (HGX); anything else is an error listing them.
const GpuSpec& gpu_spec(const std::string& name);

// The efficiencies the prediction applies (fractions of the peaks above).
struct RooflineRates {
  double gemm = 0.75;           // cuBLAS(Lt) bf16 GEMMs of transformer shapes (~740 TFLOPS on an H100)
  double attention_fwd = 0.49;  // cuDNN SDPA, causal, head dim 128: 484 TFLOPS forward on an H200
  double attention_bwd = 0.37;  // ... and 370 TFLOPS backward (cudnn-frontend's benchmark at 2k)
  double f32_attention = 0.50;  // titan's own f32 tile kernel on CUDA cores
  double hbm = 0.80;            // elementwise / reduction kernels reach ~80% of HBM bandwidth
  double link = 0.80;           // NCCL bus bandwidth over NVLink
  double launch_us = 4.0;       // host time per kernel launch in eager mode
};

struct OpClassTime {
  std::string name;
  double flops = 0, bytes = 0;  // per rank and step
  double seconds = 0;
  std::string rate;  // how the time was taken, e.g. "742 TFLOPS (75% of 989)"
};

struct GpuStepPrediction {
  GpuSpec gpu;
  bool bf16 = true;
  std::vector<OpClassTime> ops;
  double gpu_seconds = 0;   // the op classes, serial, plus exposed communication
  double launches = 0;      // kernel launches per step
  double host_seconds = 0;  // launches x launch_us
  double step_seconds = 0;  // max(gpu, host)
  double tokens_per_s = 0;  // per GPU
  double mfu = 0;           // flops_per_token x tokens/s / bf16 peak
  double memory_bytes = 0;  // per rank: the run plan's, activations in the step's dtype
  std::string describe() const;
};

// One step of `plan` (one rank's share: its micro-batches, its tensor-parallel slice, its shard of the
// optimizer) with bf16 mixed precision (activations and GEMM operands bf16, f32 master weights and AdamW
// state) or f32. Data-parallel collectives are taken as overlapped with compute except one layer's
// all-gather and reduce-scatter; tensor-parallel collectives are exposed (they sit between the GEMMs).
GpuStepPrediction predict_gpu_step(const Qwen3Config& model, const RunPlan& plan,
                                   CheckpointPolicy checkpointing, const GpuSpec& gpu, bool bf16,
                                   const RooflineRates& rates = {});

}  // namespace titan
