// NCCL implementation of dist::ProcessGroup (see distributed/nccl.h). Buffers are device pointers; every
// collective is enqueued on the CUDA device's stream (so it is ordered after the kernels that produced
// its input) and waited for before returning. NCCL has equal-count reduce-scatter/all-gather only: the
// uneven forms of the interface run as grouped per-rank reduce/broadcast calls, all-to-all as grouped
// send/recv pairs. split() splits the bootstrap group and makes a new NCCL communicator from it.
#include <nccl.h>

#include <algorithm>
#include <numeric>

#include "device/cuda/cuda_common.cuh"
#include "distributed/nccl.h"

namespace titan::dist {
namespace {

void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) fail("NCCL error in ", what, ": ", ncclGetErrorString(r));
}

ncclDataType_t nccl_type(CommType t) {
  switch (t) {
    case CommType::F32:
      return ncclFloat32;
    case CommType::F64:
      return ncclFloat64;
    case CommType::I32:
      return ncclInt32;
    case CommType::I64:
      return ncclInt64;
    case CommType::BF16:
      return ncclBfloat16;
    case CommType::U8:
      return ncclUint8;
  }
  fail("NCCL: unknown comm type");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Avg:
      return ncclAvg;
    case ReduceOp::Max:
      return ncclMax;
    case ReduceOp::Min:
      return ncclMin;
  }
  fail("NCCL: unknown reduce op");
}

const char* at(const void* p, int64_t elems, CommType t) {
  return static_cast<const char*>(p) + elems * comm_type_size(t);
}
char* at(void* p, int64_t elems, CommType t) {
  return static_cast<char*>(p) + elems * comm_type_size(t);
}

class NcclProcessGroup final : public ProcessGroup {
 public:
  explicit NcclProcessGroup(std::shared_ptr<ProcessGroup> bootstrap_owned, ProcessGroup& bootstrap)
      : owned_(std::move(bootstrap_owned)), boot_(bootstrap) {
    ncclUniqueId id{};
    if (boot_.rank() == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    boot_.broadcast(&id, sizeof(id), CommType::U8, 0);
    check_nccl(ncclCommInitRank(&comm_, boot_.size(), id, boot_.rank()), "ncclCommInitRank");
  }
  ~NcclProcessGroup() override {
    if (comm_) ncclCommDestroy(comm_);
  }
  int rank() const override { return boot_.rank(); }
  int size() const override { return boot_.size(); }
  int world_rank_of(int r) const override { return boot_.world_rank_of(r); }
  ProcessGroup& host_group() override { return boot_; }
  std::string backend() const override { return "nccl"; }

  void all_reduce(void* buf, int64_t count, CommType type, ReduceOp op) override {
    check_reducible(type);
    check_nccl(ncclAllReduce(buf, buf, count, nccl_type(type), nccl_op(op), comm_, stream()),
               "ncclAllReduce");
    wait();
  }
  void reduce_scatter(const void* send, void* recv, const std::vector<int64_t>& recv_counts, CommType type,
                      ReduceOp op) override {
    check_reducible(type);
    check_counts(recv_counts);
    if (std::all_of(recv_counts.begin(), recv_counts.end(), [&](int64_t c) { return c == recv_counts[0]; })) {
      check_nccl(ncclReduceScatter(send, recv, recv_counts[0], nccl_type(type), nccl_op(op), comm_, stream()),
                 "ncclReduceScatter");
    } else {
      group([&] {
        int64_t displ = 0;
        for (int r = 0; r < size(); ++r) {
          check_nccl(ncclReduce(at(send, displ, type), recv, recv_counts[r], nccl_type(type), nccl_op(op), r,
                                comm_, stream()),
                     "ncclReduce");
          displ += recv_counts[r];
        }
      });
    }
    wait();
  }
  void all_gather(const void* send, void* recv, const std::vector<int64_t>& counts, CommType type) override {
    check_counts(counts);
    if (std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; })) {
      check_nccl(ncclAllGather(send, recv, counts[0], nccl_type(type), comm_, stream()), "ncclAllGather");
    } else {
      group([&] {
        int64_t displ = 0;
        for (int r = 0; r < size(); ++r) {
          check_nccl(
              ncclBroadcast(send, at(recv, displ, type), counts[r], nccl_type(type), r, comm_, stream()),
              "ncclBroadcast");
          displ += counts[r];
        }
      });
    }
    wait();
  }
  void broadcast(void* buf, int64_t count, CommType type, int root) override {
    check_nccl(ncclBroadcast(buf, buf, count, nccl_type(type), root, comm_, stream()), "ncclBroadcast");
    wait();
  }
  void all_to_all(const void* send, void* recv, int64_t count, CommType type) override {
    std::vector<int64_t> counts(size(), count);
    all_to_all_v(send, counts, recv, counts, type);
  }
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                    const std::vector<int64_t>& recv_counts, CommType type) override {
    check_counts(send_counts);
    check_counts(recv_counts);
    group([&] {
      int64_t sd = 0, rd = 0;
      for (int r = 0; r < size(); ++r) {
        if (send_counts[r] > 0)
          check_nccl(ncclSend(at(send, sd, type), send_counts[r], nccl_type(type), r, comm_, stream()),
                     "ncclSend");
        if (recv_counts[r] > 0)
          check_nccl(ncclRecv(at(recv, rd, type), recv_counts[r], nccl_type(type), r, comm_, stream()),
                     "ncclRecv");
        sd += send_counts[r], rd += recv_counts[r];
      }
    });
    wait();
  }
  void barrier() override {
    cuda::Scratch<float> one(1);
    check_nccl(ncclAllReduce(one.p, one.p, 1, ncclFloat32, ncclSum, comm_, stream()),
               "ncclAllReduce (barrier)");
    wait();
  }
  // Point to point: only as one exchange() (NCCL's grouped send/receive). An NCCL send completes only once
  // its peer has posted the receive, and a communicator runs its operations in order, so lone sends and
  // receives in the interface's MPI sense (a send that progresses by itself) could hang two ranks that
  // each send before receiving; inside one group the messages progress together. (Pipeline parallel on
  // GPUs stages its messages through the host group instead: see Trainer.)
  void send(const void*, int64_t, CommType, int) override {
    fail("NCCL group: a lone send could wait for its receiver forever; pass the messages to exchange()");
  }
  void recv(void*, int64_t, CommType, int) override {
    fail("NCCL group: a lone recv could wait for its sender forever; pass the messages to exchange()");
  }
  void exchange(const std::vector<P2p>& ops) override {
    for (const P2p& op : ops)
      TITAN_CHECK(op.peer >= 0 && op.peer < size() && op.peer != rank(), "NCCL group: a message with rank ",
                  op.peer, " of a group of ", size(), " (this rank is ", rank(), ")");
    group([&] {
      for (const P2p& op : ops) {
        if (op.count == 0) continue;
        if (op.is_send)
          check_nccl(ncclSend(op.buf, op.count, nccl_type(op.type), op.peer, comm_, stream()), "ncclSend");
        else
          check_nccl(ncclRecv(op.buf, op.count, nccl_type(op.type), op.peer, comm_, stream()), "ncclRecv");
      }
    });
    wait();
  }

  std::shared_ptr<ProcessGroup> split(int color, int key) override {
    auto sub = boot_.split(color, key);
    ProcessGroup& ref = *sub;
    return std::make_shared<NcclProcessGroup>(std::move(sub), ref);
  }

 private:
  static cudaStream_t stream() { return cuda::cuda_stream(); }
  static void wait() { TITAN_CUDA_CHECK(cudaStreamSynchronize(stream())); }
  static void check_reducible(CommType t) {
    TITAN_CHECK(t != CommType::BF16 && t != CommType::U8, "NCCL group: reductions take F32/F64/I32/I64, not ",
                comm_type_name(t));
  }
  void check_counts(const std::vector<int64_t>& c) const {
    TITAN_CHECK(static_cast<int>(c.size()) == size(), "NCCL group: ", c.size(), " counts for ", size(),
                " ranks");
  }
  template <class F>
  void group(F&& f) {
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    f();
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  }

  std::shared_ptr<ProcessGroup> owned_;  // a split's bootstrap sub-group (null for the world)
  ProcessGroup& boot_;
  ncclComm_t comm_ = nullptr;
};

std::shared_ptr<ProcessGroup> make_group(ProcessGroup& bootstrap) {
  return std::make_shared<NcclProcessGroup>(nullptr, bootstrap);
}

struct Register {
  Register() { nccl_group_factory() = make_group; }
} register_nccl;

}  // namespace
}  // namespace titan::dist
