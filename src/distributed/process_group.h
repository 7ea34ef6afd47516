// Process groups: the collectives a distributed run needs, behind one virtual interface.
//
// Implementations: MPI (CPU ranks started by `titan run`, mpirun or srun) and a single-process group
// (world 1, no MPI at all) so that `titan forward`, the tests and a plain `titan train` never need
// mpirun. The NCCL group (distributed/nccl.h, CUDA builds) implements the same class on device buffers: every
// call is "buffer pointer + element count + element type", blocking, with the same meaning as the
// NCCL/MPI primitive of the same name.
//
// Typical use (the trainer):
//   titan::dist::ProcessGroup& world = titan::dist::init();   // once; idempotent
//   world.all_reduce(loss_sum.data(), 2, CommType::F64, ReduceOp::Sum);
//   ...
//   titan::dist::finalize();   // main() does this on a clean exit (see distributed/runtime.h)
//
// Every rank of a group must call the same collectives in the same order with matching sizes
// (as in MPI), from the thread that called init() (MPI_THREAD_FUNNELED: not inside OpenMP regions). A rank
// that never arrives is caught by the watchdog (TITAN_DIST_TIMEOUT, see runtime.h): the waiting ranks abort
// the job with a message naming the rank that did not arrive.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace titan::dist {

// Element types on the wire. BF16 only moves (gather, broadcast, all_to_all): reductions need F32/F64.
enum class CommType : uint8_t { F32, F64, I32, I64, BF16, U8 };
size_t comm_type_size(CommType t);
const char* comm_type_name(CommType t);
// F32 -> F32, BF16 -> BF16, I32 -> I32.
CommType comm_type_of(DType t);

// Avg = Sum followed by a division by the group size (MPI has no average; NCCL does).
enum class ReduceOp : uint8_t { Sum, Avg, Max, Min };
const char* reduce_op_name(ReduceOp op);

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  // Rank of this process in the group and the group size.
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Rank of group rank `r` in the world group (for messages: "rank 3 did not arrive").
  virtual int world_rank_of(int r) const = 0;
  // "mpi" or "single".
  virtual std::string backend() const = 0;

  // buf[0..count) := op over all ranks of buf[0..count). In place.
  virtual void all_reduce(void* buf, int64_t count, CommType type, ReduceOp op) = 0;
  // recv[0..recv_counts[rank]) := op over ranks of send[displ(rank) .. + recv_counts[rank]), where
  // displ(r) = sum of recv_counts[0..r). send holds sum(recv_counts) elements. Counts may differ (the
  // last shard of an unevenly divisible buffer) and may be 0.
  virtual void reduce_scatter(const void* send, void* recv, const std::vector<int64_t>& recv_counts,
                              CommType type, ReduceOp op) = 0;
  // recv[displ(r) .. + counts[r]) := send of rank r (send holds counts[rank] elements). recv may alias
  // recv + displ(rank) == send (in place), as FSDP does when gathering into the full buffer.
  virtual void all_gather(const void* send, void* recv, const std::vector<int64_t>& counts,
                          CommType type) = 0;
  // buf := buf of rank `root`.
  virtual void broadcast(void* buf, int64_t count, CommType type, int root) = 0;
  // Block r of send (count elements at send + r*count) goes to rank r, which receives it as its block
  // `rank`. send and recv hold size()*count elements.
  virtual void all_to_all(const void* send, void* recv, int64_t count, CommType type) = 0;
  // Variable blocks: send_counts[r] elements (from offset sum(send_counts[0..r))) go to rank r;
  // recv_counts[r] elements come from rank r (stored at offset sum(recv_counts[0..r))).
  virtual void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                            const std::vector<int64_t>& recv_counts, CommType type) = 0;
  virtual void barrier() = 0;

  // Point to point (pipeline parallel): send starts sending count elements of buf to rank `dst` and returns
  // at once (the data are copied first, so buf may be reused); recv blocks until count elements from rank
  // `src` are in buf. Messages between two ranks arrive in the order they were sent. wait_sends() returns
  // when every send of this rank has been delivered. The base class has none (a group that cannot). The
  // NCCL group sends and receives between ring neighbours (rank +- 1 mod size) only, after
  // connect_neighbours() (collective over the group); elsewhere that call does nothing.
  virtual void connect_neighbours() {}
  virtual void send(const void* buf, int64_t count, CommType type, int dst);
  virtual void recv(void* buf, int64_t count, CommType type, int src);
  virtual void wait_sends() {}
  // Several point-to-point messages as one (torch's batch_isend_irecv): every send and receive of `ops` is
  // posted together; returns when all have completed. On NCCL, whose send completes only once its peer has
  // posted the receive, the one safe form: every rank's exchange must be matched by its peers' exchanges
  // (a ring step: each rank sends to the next and receives from the previous). The base class: the sends
  // (send()), the receives in order (recv()), then wait_sends().
  struct P2p {
    bool is_send;
    void* buf;  // (read only for a send)
    int64_t count;
    CommType type;
    int peer;
  };
  virtual void exchange(const std::vector<P2p>& ops);

  // Sub-groups: ranks with the same `color` form a new group, ordered by `key` (MPI_Comm_split).
  // Collective over this group.
  virtual std::shared_ptr<ProcessGroup> split(int color, int key) = 0;

  // The same ranks for collectives of host memory (scalars, counts, checksums). A group of device buffers
  // (NCCL, host-staged) answers its host group; MPI and single groups answer themselves.
  virtual ProcessGroup& host_group() { return *this; }

  // ---- typed conveniences (the calls the trainer normally makes) ----
  void all_reduce(float* buf, int64_t n, ReduceOp op) { all_reduce(buf, n, CommType::F32, op); }
  void all_reduce(double* buf, int64_t n, ReduceOp op) { all_reduce(buf, n, CommType::F64, op); }
  void all_reduce(int64_t* buf, int64_t n, ReduceOp op) { all_reduce(buf, n, CommType::I64, op); }
  double all_reduce(double v, ReduceOp op) {
    all_reduce(&v, 1, op);
    return v;
  }
  // Tensor forms (contiguous tensors; dtype F32 for reductions).
  void all_reduce(const Tensor& t, ReduceOp op) {
    all_reduce(t.raw(), t.numel(), comm_type_of(t.dtype()), op);
  }
  void broadcast(const Tensor& t, int root) { broadcast(t.raw(), t.numel(), comm_type_of(t.dtype()), root); }
  // Equal blocks: recv (size()*n) from send (n) / send (size()*n) to recv (n).
  void all_gather(const Tensor& send, const Tensor& recv);
  void reduce_scatter(const Tensor& send, const Tensor& recv, ReduceOp op);
  bool is_distributed() const { return size() > 1; }
};

// Equal counts {n, n, ..., n} for a group of `size` ranks.
std::vector<int64_t> equal_counts(int size, int64_t n);

// World 1 without MPI: every collective is a copy (or nothing). Used when the process was not started
// by a launcher, and as the "self" group.
class SingleProcessGroup final : public ProcessGroup {
 public:
  explicit SingleProcessGroup(int world_rank = 0) : world_rank_(world_rank) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  int world_rank_of(int) const override { return world_rank_; }
  std::string backend() const override { return "single"; }
  void all_reduce(void*, int64_t, CommType type, ReduceOp) override;
  void reduce_scatter(const void* send, void* recv, const std::vector<int64_t>& recv_counts, CommType type,
                      ReduceOp op) override;
  void all_gather(const void* send, void* recv, const std::vector<int64_t>& counts, CommType type) override;
  void broadcast(void*, int64_t, CommType, int root) override;
  void all_to_all(const void* send, void* recv, int64_t count, CommType type) override;
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                    const std::vector<int64_t>& recv_counts, CommType type) override;
  void barrier() override {}
  std::shared_ptr<ProcessGroup> split(int, int) override;
  using ProcessGroup::all_gather;
  using ProcessGroup::all_reduce;
  using ProcessGroup::broadcast;
  using ProcessGroup::reduce_scatter;

 private:
  int world_rank_;
};

}  // namespace titan::dist
