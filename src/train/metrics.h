// Training metrics: one torchtitan-style console line per step, a progress bar with ETA on a
// terminal, <dump_folder>/metrics.jsonl, the GEMM peak used for MFU, and the loss-curve picture.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/cpu_isa.h"
#include "core/tensor.h"
#include "kernels/ops.h"
#include "train/tensorboard.h"

namespace titan {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0, grad_norm = 0, lr = 0;
  int64_t tokens = 0;  // tokens of this step on this rank
  double tps = 0;      // tokens per second per rank
  double tflops = 0, mfu = 0, mem_gib = 0, mem_pct = 0;
  double time_s = 0;  // wall time of the step
  // Validation after this step (NaN when there was none): mean loss and perplexity.
  double val_loss = std::nan(""), val_ppl = std::nan("");
};

class MetricsLogger {
 public:
  // jsonl_path empty: no file. progress: draw a bar (only if stdout is a terminal).
  // resumed_step > 0: keep the file's records up to that step and continue it (a resumed run).
  // tb_dir: also TensorBoard event files there (empty: none).
  MetricsLogger(const std::string& jsonl_path, int64_t total_steps, bool progress, bool print,
                int64_t resumed_step = 0, const std::string& tb_dir = "");
  ~MetricsLogger();
  void log(const StepMetrics& m);
  void finish();

 private:
  void draw_progress(int64_t step) const;

  FILE* jsonl_ = nullptr;
  std::unique_ptr<tb::EventWriter> tb_;
  int64_t total_steps_;
  bool progress_, print_;
  double elapsed_ = 0;
};

// Measured rate (TFLOP/s) of a GEMM engine with the current thread count: the best of 3 square 2048
// products out = inp @ w^T after a warm-up (the MFU denominator of a run: its model's engine).
// The operands live on `device` (the engine's).
double measure_gemm_tflops(const MatmulKernels& engine, Device device = Device::cpu());
// The CPU's theoretical peak (TFLOP/s) for GEMMs at instruction-set level `isa` on `threads` cores:
// threads x clock x FLOP/cycle/core (f32: 8 baseline SSE, 32 AVX2 (2 FMA x 8 lanes), 64 AVX-512; bf16 dot
// products: 128 AVX512_BF16, 2048 AMX), with the highest clock the OS reports (cpufreq's maximum, else
// /proc/cpuinfo's MHz). 0 when the clock is unknown. An upper bound: it counts two FMA units a core.
double cpu_theoretical_tflops(CpuIsa isa, bool bf16, int threads, std::string* how = nullptr);
// Physical memory of this machine in bytes.
int64_t physical_memory_bytes();

// Writes an SVG line chart of `losses` (one per step) to `path`, with the validation losses `val` as
// (index into losses, loss) points on a second line when given.
void write_loss_svg(const std::string& path, const std::vector<double>& losses, const std::string& title,
                    const std::vector<std::pair<int64_t, double>>& val = {});

}  // namespace titan
