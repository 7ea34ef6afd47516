// NCCL implementation of dist::ProcessGroup (see distributed/nccl.h). Buffers are device pointers; every
// collective is enqueued on the CUDA device's stream (so it is ordered after the kernels that produced
// its input) and waited for before returning (but inside a graph capture). NCCL has equal-count
// reduce-scatter/all-gather only: the uneven forms of the interface run as grouped per-rank reduce/broadcast
// calls, all-to-all as grouped send/recv pairs. split() splits the bootstrap group and makes a new NCCL
// communicator from it. Point to point: send/recv between ring neighbours on their own per-direction
// communicators and streams (pipeline parallel), exchange() as one group on the main communicator (the
// context-parallel ring).
#include <nccl.h>

#include <algorithm>
#include <deque>
#include <memory>
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
    for (StagedSend& s : sends_) cudaEventDestroy(s.done);
    for (Link* l : {&up_, &down_, &from_prev_, &from_next_}) {
      if (l->comm) ncclCommDestroy(l->comm);
      if (l->ready) cudaEventDestroy(l->ready);
      if (l->stream) cudaStreamDestroy(l->stream);
    }
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
  // Point to point between ring neighbours (pipeline parallel), with MPI's meaning: a send progresses by
  // itself while the host goes on (and may next receive from the same peer). An NCCL send completes only
  // once its peer has posted the receive, and a communicator runs its operations in order, so each
  // direction between neighbours has its own two-rank communicator and stream (links rank -> rank + 1 and,
  // in groups of more than two, rank -> rank - 1): a send copies the data (the caller may reuse buf) and is
  // sent on its link's stream; a receive runs on the link from its peer and is waited for.
  void connect_neighbours() override {
    if (connected_ || size() < 2) return;
    const int n = size(), me = rank();
    // Every directed link (a -> b), the upward ones first, in one order on every rank: the first link not
    // yet made has both its ranks at it, so the pairwise inits never wait on each other in a cycle.
    for (int k = 0; k < (n > 2 ? 2 * n : n); ++k) {
      const bool up = k < n;
      const int a = k % n, b = up ? (a + 1) % n : (a - 1 + n) % n;
      if (me != a && me != b) continue;
      ncclUniqueId id{};
      if (me == a) {
        check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
        boot_.send(&id, sizeof(id), CommType::U8, b);
        boot_.wait_sends();
      } else {
        boot_.recv(&id, sizeof(id), CommType::U8, a);
      }
      Link& l = me == a ? (up ? up_ : down_) : (up ? from_prev_ : from_next_);
      TITAN_CUDA_CHECK(cudaStreamCreateWithFlags(&l.stream, cudaStreamNonBlocking));
      TITAN_CUDA_CHECK(cudaEventCreateWithFlags(&l.ready, cudaEventDisableTiming));
      check_nccl(ncclCommInitRank(&l.comm, 2, id, me == a ? 0 : 1), "ncclCommInitRank (point to point)");
    }
    connected_ = true;
  }
  void send(const void* buf, int64_t count, CommType type, int dst) override {
    Link& l = link(dst, true);
    reap_sends(false);
    const size_t bytes = static_cast<size_t>(count) * comm_type_size(type);
    StagedSend s;
    s.data = std::make_unique<cuda::Scratch<char>>(std::max<size_t>(bytes, 1));
    if (bytes > 0)
      TITAN_CUDA_CHECK(cudaMemcpyAsync(s.data->p, buf, bytes, cudaMemcpyDeviceToDevice, stream()));
    after_main_stream(l);
    if (count > 0) check_nccl(ncclSend(s.data->p, count, nccl_type(type), 1, l.comm, l.stream), "ncclSend");
    TITAN_CUDA_CHECK(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
    TITAN_CUDA_CHECK(cudaEventRecord(s.done, l.stream));
    sends_.push_back(std::move(s));
  }
  void recv(void* buf, int64_t count, CommType type, int src) override {
    Link& l = link(src, false);
    after_main_stream(l);  // (the kernels that used buf before)
    if (count > 0) check_nccl(ncclRecv(buf, count, nccl_type(type), 0, l.comm, l.stream), "ncclRecv");
    TITAN_CUDA_CHECK(cudaStreamSynchronize(l.stream));
  }
  void wait_sends() override { reap_sends(true); }

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
  // The host waits for a collective, except while the stream is captured into a graph (compile mode): the
  // graph's order then makes the collective's results ready for the ops after it, and a wait cannot be
  // captured.
  static void wait() {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    TITAN_CUDA_CHECK(cudaStreamIsCapturing(stream(), &capture));
    if (capture == cudaStreamCaptureStatusNone) TITAN_CUDA_CHECK(cudaStreamSynchronize(stream()));
  }
  static void check_reducible(CommType t) {
    TITAN_CHECK(t != CommType::BF16 && t != CommType::U8, "NCCL group: reductions take F32/F64/I32/I64, not ",
                comm_type_name(t));
  }
  void check_counts(const std::vector<int64_t>& c) const {
    TITAN_CHECK(static_cast<int>(c.size()) == size(), "NCCL group: ", c.size(), " counts for ", size(),
                " ranks");
  }
  struct Link {
    ncclComm_t comm = nullptr;  // the two ranks of one direction: the sender is rank 0
    cudaStream_t stream = nullptr;
    cudaEvent_t ready = nullptr;  // the device stream's work before a message
  };
  struct StagedSend {
    std::unique_ptr<cuda::Scratch<char>> data;
    cudaEvent_t done = nullptr;
  };
  Link& link(int peer, bool sending) {
    const int n = size(), me = rank();
    TITAN_CHECK(connected_, "NCCL group: point-to-point messages need connect_neighbours() first");
    const int next = (me + 1) % n, prev = (me - 1 + n) % n;
    if (sending ? peer == next : peer == prev) return sending ? up_ : from_prev_;
    if (n > 2 && (sending ? peer == prev : peer == next)) return sending ? down_ : from_next_;
    fail("NCCL group: a ", sending ? "send to" : "receive from", " rank ", peer, " of ", n, " (this rank is ",
         me, "): point-to-point messages go between ring neighbours only");
  }
  void after_main_stream(Link& l) {
    TITAN_CUDA_CHECK(cudaEventRecord(l.ready, stream()));
    TITAN_CUDA_CHECK(cudaStreamWaitEvent(l.stream, l.ready, 0));
  }
  // Frees the staged sends that have arrived (all of them, waiting, with `wait`), in send order.
  void reap_sends(bool wait) {
    while (!sends_.empty()) {
      StagedSend& s = sends_.front();
      if (wait)
        TITAN_CUDA_CHECK(cudaEventSynchronize(s.done));
      else if (cudaEventQuery(s.done) != cudaSuccess)
        return;
      cudaEventDestroy(s.done);
      sends_.pop_front();
    }
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
  bool connected_ = false;
  Link up_, down_, from_prev_, from_next_;  // rank -> rank + 1, rank -> rank - 1, and the reverse ones
  std::deque<StagedSend> sends_;            // in flight, in send order
};

std::shared_ptr<ProcessGroup> make_group(ProcessGroup& bootstrap) {
  return std::make_shared<NcclProcessGroup>(nullptr, bootstrap);
}

struct Register {
  Register() { nccl_group_factory() = make_group; }
} register_nccl;

}  // namespace
}  // namespace titan::dist
