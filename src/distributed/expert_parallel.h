// Expert-parallel token exchange: rows (tokens x hidden) go to the rank that owns their expert and come
// back, with variable counts per rank pair (all_to_all_v), forward and backward.
//
// The MoE layer (per step, per layer):
//   auto [order, counts] = group_rows_by_destination(dest_rank_of_each_row, ep.size());
//   // pack rows in `order` (rows for rank 0 first, then rank 1, ...)
//   AllToAllExchange ex(ep, counts, hidden);          // exchanges the counts (one small all_to_all)
//   ex.dispatch(packed, received);                     // forward: rows to their expert's rank
//   ... experts run on `received` (ex.total_recv() rows) ...
//   ex.combine(expert_out, back);                      // forward: results back to the owning rank
// Backward runs the same two exchanges in the opposite roles: combine's gradient is dispatch() of the
// output gradient, dispatch's gradient is combine() of the input gradient.
#pragma once
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "distributed/process_group.h"

namespace titan::dist {

class AllToAllExchange {
 public:
  // send_counts[r]: rows this rank sends to rank r; row_elems: f32 elements per row. Collective.
  AllToAllExchange(ProcessGroup& pg, std::vector<int64_t> send_counts, int64_t row_elems);
  // The same rank pairs and row counts with another row size (no communication): e.g. rows of
  // hidden + 2 floats out, hidden floats back.
  AllToAllExchange(const AllToAllExchange& counts_from, int64_t row_elems);
  const std::vector<int64_t>& send_counts() const { return send_rows_; }
  const std::vector<int64_t>& recv_counts() const { return recv_rows_; }
  int64_t total_send() const { return total_send_; }  // rows
  int64_t total_recv() const { return total_recv_; }
  // send: total_send() rows grouped by destination rank -> recv: total_recv() rows grouped by source.
  void dispatch(const float* send, float* recv);
  // The reverse exchange: recv-side rows (total_recv()) -> send-side rows (total_send()).
  void combine(const float* recv_side, float* send_side);

 private:
  ProcessGroup& pg_;
  int64_t row_elems_;
  std::vector<int64_t> send_rows_, recv_rows_, send_elems_, recv_elems_;
  int64_t total_send_ = 0, total_recv_ = 0;
};

// Expert-parallel groups: `degree` consecutive world ranks per group (rank r is member r % degree of
// group r / degree). nullptr when degree == 1. Collective over `world`.
std::shared_ptr<ProcessGroup> make_expert_group(ProcessGroup& world, int degree);
// The ranks that hold the same experts: one per expert-parallel group (member r / degree of group
// r % degree). Collective over `world`.
std::shared_ptr<ProcessGroup> make_expert_replicate_group(ProcessGroup& world, int degree);

// Stable grouping of rows by destination rank: order[i] is the row packed at position i, counts[r] the
// number of rows going to rank r.
std::pair<std::vector<int64_t>, std::vector<int64_t>> group_rows_by_destination(const std::vector<int>& dest,
                                                                                int world);

}  // namespace titan::dist
