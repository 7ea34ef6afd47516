// Time per op class of a model step, measured on the device (CUDA events; the host clock where ops run on
// the host), for setting beside the roofline prediction (train/roofline.h, `titan plan --gpu`).
//
// timed(table, ...) returns a copy of an op table whose every function runs the original between two
// marks of the current OpTiming; a model swaps its tables for timed ones (Qwen3Model::time_ops) and its
// code stays as it is. Marks are collected during the step and read once at the end (collect()), so the
// device is not synchronised per op. Only one OpTiming is current at a time (a benchmark's).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "device/device.h"
#include "kernels/ops.h"

namespace titan {

// The classes of train/roofline.h's prediction.
enum class OpClass : int { kGemm, kAttentionForward, kAttentionBackward, kPointwise, kHead, kCount };
const char* op_class_name(OpClass c);

class OpTiming {
 public:
  explicit OpTiming(DeviceType device);
  ~OpTiming();
  OpTiming(const OpTiming&) = delete;
  OpTiming& operator=(const OpTiming&) = delete;

  // The timing the timed tables report to (null: they only run the ops).
  static OpTiming* current();
  void make_current();

  void begin(OpClass c);
  void end();
  // Milliseconds per class since the last collect() (waits for the device once), and their op calls.
  std::array<double, static_cast<int>(OpClass::kCount)> collect();
  const std::array<int64_t, static_cast<int>(OpClass::kCount)>& calls() const { return calls_; }

 private:
  struct Span {
    OpClass cls;
    void* from;
    void* to;
    double host_ms;  // host clock (devices without marks)
  };
  DeviceInterface& dev_;
  std::vector<Span> spans_;
  std::array<int64_t, static_cast<int>(OpClass::kCount)> calls_{};
  double begun_ms_ = 0;
  bool open_ = false;
};

// Timed copies of the op tables a model runs; each function keeps its class (a table's forward and backward
// may differ: attention). Each returns a pointer to storage that lives as long as the program; calling it
// again for the same kind of table replaces the previous copy's target (one timed model at a time).
const MatmulKernels* timed(const MatmulKernels* k);
const MatmulBf16Kernels* timed(const MatmulBf16Kernels* k);
const RmsNormKernels* timed(const RmsNormKernels* k);
const RopeKernels* timed(const RopeKernels* k);
const RopeQKKernels* timed(const RopeQKKernels* k);
const QKNormRopeKernels* timed(const QKNormRopeKernels* k);
const AttentionKernels* timed(const AttentionKernels* k);
const AttentionBf16Kernels* timed(const AttentionBf16Kernels* k);
const SwigluKernels* timed(const SwigluKernels* k);
const EmbeddingKernels* timed(const EmbeddingKernels* k);
const CrossEntropyKernels* timed(const CrossEntropyKernels* k);
const ElementwiseKernels* timed(const ElementwiseKernels* k);
const MoeExpertsKernels* timed(const MoeExpertsKernels* k, int slot);  // f32, bf16
const MoeRouterKernels* timed(const MoeRouterKernels* k);

}  // namespace titan
