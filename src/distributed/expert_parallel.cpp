// Expert-parallel token exchange over all_to_all_v.
#include "distributed/expert_parallel.h"

#include "core/error.h"

namespace titan::dist {

AllToAllExchange::AllToAllExchange(ProcessGroup& pg, std::vector<int64_t> send_counts, int64_t row_elems)
    : pg_(pg), row_elems_(row_elems), send_rows_(std::move(send_counts)) {
  const int n = pg.size();
  TITAN_CHECK(int(send_rows_.size()) == n, "expert exchange: ", send_rows_.size(), " counts for ", n,
              " ranks");
  TITAN_CHECK(row_elems > 0, "expert exchange: row size must be positive");
  recv_rows_.assign(n, 0);
  // Each rank learns how many rows every other rank sends it.
  pg.host_group().all_to_all(send_rows_.data(), recv_rows_.data(), 1, CommType::I64);  // host counts
  for (int r = 0; r < n; ++r) {
    TITAN_CHECK(send_rows_[r] >= 0, "expert exchange: negative count for rank ", r);
    send_elems_.push_back(send_rows_[r] * row_elems);
    recv_elems_.push_back(recv_rows_[r] * row_elems);
    total_send_ += send_rows_[r];
    total_recv_ += recv_rows_[r];
  }
}

AllToAllExchange::AllToAllExchange(const AllToAllExchange& o, int64_t row_elems)
    : pg_(o.pg_),
      row_elems_(row_elems),
      send_rows_(o.send_rows_),
      recv_rows_(o.recv_rows_),
      total_send_(o.total_send_),
      total_recv_(o.total_recv_) {
  TITAN_CHECK(row_elems > 0, "expert exchange: row size must be positive");
  for (size_t r = 0; r < send_rows_.size(); ++r) {
    send_elems_.push_back(send_rows_[r] * row_elems);
    recv_elems_.push_back(recv_rows_[r] * row_elems);
  }
}

void AllToAllExchange::dispatch(const float* send, float* recv) {
  pg_.all_to_all_v(send, send_elems_, recv, recv_elems_, CommType::F32);
}

void AllToAllExchange::combine(const float* recv_side, float* send_side) {
  pg_.all_to_all_v(recv_side, recv_elems_, send_side, send_elems_, CommType::F32);
}

std::shared_ptr<ProcessGroup> make_expert_group(ProcessGroup& world, int degree) {
  TITAN_CHECK(degree >= 1 && world.size() % degree == 0, "parallelism.expert_parallel_degree ", degree,
              " does not divide the world size ", world.size());
  if (degree == 1) return nullptr;
  return world.split(/*color=*/world.rank() / degree, /*key=*/world.rank());
}

std::shared_ptr<ProcessGroup> make_expert_replicate_group(ProcessGroup& world, int degree) {
  TITAN_CHECK(degree >= 1 && world.size() % degree == 0, "parallelism.expert_parallel_degree ", degree,
              " does not divide the world size ", world.size());
  return world.split(/*color=*/world.rank() % degree, /*key=*/world.rank());
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> group_rows_by_destination(const std::vector<int>& dest,
                                                                                int world) {
  std::vector<int64_t> counts(world, 0), start(world, 0), order(dest.size());
  for (int d : dest) {
    TITAN_CHECK(d >= 0 && d < world, "destination rank ", d, " outside [0, ", world, ")");
    ++counts[d];
  }
  for (int r = 1; r < world; ++r) start[r] = start[r - 1] + counts[r - 1];
  for (size_t i = 0; i < dest.size(); ++i) order[start[dest[i]]++] = int64_t(i);
  return {order, counts};
}

}  // namespace titan::dist
