// Context parallel over a group of ranks (ContextParallelComm's layout, models/qwen3/model_interfaces.h):
// every sequence of the batch, zero-padded to a multiple of 2 x size tokens, is cut into 2 x size chunks and
// rank r of the group holds chunks r and 2 x size - 1 - r (the causal attention's work balanced: an early
// chunk with few keys beside a late one with many). The ring of the model's attention runs over the
// group's point-to-point messages. Every rank of a group sees the same batch; the ranks' losses and
// gradients are summed like data parallel's (the trainer's data-parallel group holds the context-parallel
// ranks).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "distributed/process_group.h"
#include "models/qwen3/model_interfaces.h"

namespace titan::dist {

class ContextParallel : public ContextParallelComm {
 public:
  explicit ContextParallel(std::shared_ptr<ProcessGroup> group);
  int size() const override { return group_->size(); }
  int rank() const override { return group_->rank(); }
  void ring_shift(const std::vector<const float*>& sends, const std::vector<float*>& recvs,
                  int64_t n) override;
  void sum_host(double* x, int64_t n) override;
  void sum_device(double* x, int64_t n) override;
  ProcessGroup& group() { return *group_; }

  // A sequence of seq_len tokens padded to a multiple of 2 x size.
  int64_t padded_len(int64_t seq_len) const;
  // This rank's rows (B, padded_len / size) of a (B, seq_len) array; `pad` where the padding lies.
  std::vector<int32_t> local_rows(const std::vector<int32_t>& full, int64_t B, int64_t seq_len,
                                  int32_t pad) const;

 private:
  std::shared_ptr<ProcessGroup> group_;
};

}  // namespace titan::dist
