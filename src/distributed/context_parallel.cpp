#include "distributed/context_parallel.h"

#include "core/error.h"

namespace titan::dist {

ContextParallel::ContextParallel(std::shared_ptr<ProcessGroup> group) : group_(std::move(group)) {
  TITAN_CHECK(group_, "context parallel: no process group");
}

void ContextParallel::ring_shift(const std::vector<const float*>& sends, const std::vector<float*>& recvs,
                                 int64_t n) {
  std::vector<ProcessGroup::P2p> ops;
  for (const float* s : sends)
    ops.push_back({true, const_cast<float*>(s), n, CommType::F32, (rank() + 1) % size()});
  for (float* r : recvs) ops.push_back({false, r, n, CommType::F32, (rank() - 1 + size()) % size()});
  group_->exchange(ops);
}

void ContextParallel::sum_host(double* x, int64_t n) {
  group_->host_group().all_reduce(x, n, CommType::F64, ReduceOp::Sum);
}

void ContextParallel::sum_device(double* x, int64_t n) {
  group_->all_reduce(x, n, CommType::F64, ReduceOp::Sum);
}

int64_t ContextParallel::padded_len(int64_t seq_len) const {
  const int64_t chunks = 2 * size();
  return (seq_len + chunks - 1) / chunks * chunks;
}

std::vector<int32_t> ContextParallel::local_rows(const std::vector<int32_t>& full, int64_t B, int64_t seq_len,
                                                 int32_t pad) const {
  TITAN_CHECK(static_cast<int64_t>(full.size()) == B * seq_len, "context parallel: ", full.size(),
              " values for a batch of ", B, " x ", seq_len);
  const int64_t local = padded_len(seq_len) / size();
  std::vector<int32_t> out(B * local);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < local; ++t) {
      const int64_t g = context_parallel_position(rank(), size(), local, t);
      out[b * local + t] = g < seq_len ? full[b * seq_len + g] : pad;
    }
  return out;
}

}  // namespace titan::dist
