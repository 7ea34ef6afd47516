// The CUDA emulator's NCCL: the calls src/distributed/nccl_process_group.cu makes, carried by MPI between the
// processes of an `mpirun` job (each process its emulated GPU), so that the NCCL process group, and with
// it DDP, FSDP and expert parallelism on `job.device = "cuda"`, run on machines without GPUs.
//
// A communicator is the table of its members' MPI_COMM_WORLD ranks: ncclGetUniqueId writes the caller's
// world rank and a counter into the id; ncclCommInitRank sends each member's (rank, world rank) to that
// creator, which must be a member (titan's group makes the id on its rank 0), and the creator returns the
// table. Every collective is point-to-point messages on MPI_COMM_WORLD under the communicator's own tag;
// reductions add the ranks' contributions in rank order. Inside ncclGroupStart/End the messages of all
// calls are posted first and completed at ncclGroupEnd, as NCCL fuses them. Buffers must be device
// memory of the emulator (as NCCL needs device pointers); anything else is ncclInvalidArgument with the
// reason on stderr. Every call completes before it returns (the emulated stream is synchronous), except a
// lone ncclSend: as on a GPU it completes once the peer has posted its receive, held by its stream
// (cuda_sim::defer_on_stream) while the host goes on.
#include <mpi.h>
#include <nccl.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "cuda_sim.h"

struct ncclComm {
  int rank = 0, size = 1;
  std::vector<int> world;                 // world[r] = the MPI_COMM_WORLD rank of member r
  int tag = 0;                            // this communicator's messages
  std::deque<std::vector<char>> to_self;  // ncclSend to the rank itself, until its ncclRecv
};

namespace {

constexpr uint32_t kIdMagic = 0x74697461;  // marks ids made here

struct IdFields {
  uint32_t magic;
  int32_t creator_world_rank;
  uint32_t serial;
};

thread_local std::string last_error;

ncclResult_t reject(ncclResult_t r, const std::string& what) {
  last_error = "CUDA emulator: NCCL: " + what;
  std::fprintf(stderr, "%s\n", last_error.c_str());
  return r;
}

bool mpi_running() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

int world_rank() {
  if (!mpi_running()) return 0;
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int tag_upper_bound() {
  void* v = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &v, &flag);
  return flag ? *static_cast<int*>(v) : 32767;
}

size_t type_bytes(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

template <class T>
void combine_as(T* acc, const T* x, size_t n, ncclRedOp_t op) {
  for (size_t i = 0; i < n; ++i) {
    switch (op) {
      case ncclSum:
      case ncclAvg:
        acc[i] = acc[i] + x[i];
        break;
      case ncclProd:
        acc[i] = acc[i] * x[i];
        break;
      case ncclMax:
        acc[i] = x[i] > acc[i] ? x[i] : acc[i];
        break;
      case ncclMin:
        acc[i] = x[i] < acc[i] ? x[i] : acc[i];
        break;
      default:
        break;
    }
  }
}

template <class T>
void divide_as(T* acc, size_t n, int by) {
  for (size_t i = 0; i < n; ++i) acc[i] = static_cast<T>(acc[i] / static_cast<T>(by));
}

// bf16 reductions in f32, rounded back to nearest-even after each addition (as the device adds them).
void combine_bf16(uint16_t* acc, const uint16_t* x, size_t n, ncclRedOp_t op) {
  for (size_t i = 0; i < n; ++i) {
    float a = titan::bf16_to_f32(acc[i]), b = titan::bf16_to_f32(x[i]);
    combine_as(&a, &b, 1, op);
    acc[i] = titan::f32_to_bf16(a);
  }
}

bool reducible(ncclDataType_t t) {
  return t == ncclInt32 || t == ncclUint32 || t == ncclInt64 || t == ncclUint64 || t == ncclFloat32 ||
         t == ncclFloat64 || t == ncclBfloat16;
}

// acc (op)= x, n elements of t; ncclAvg sums here and divides in finish_avg.
void combine(void* acc, const void* x, size_t n, ncclDataType_t t, ncclRedOp_t op) {
  switch (t) {
    case ncclInt32:
      combine_as(static_cast<int32_t*>(acc), static_cast<const int32_t*>(x), n, op);
      break;
    case ncclUint32:
      combine_as(static_cast<uint32_t*>(acc), static_cast<const uint32_t*>(x), n, op);
      break;
    case ncclInt64:
      combine_as(static_cast<int64_t*>(acc), static_cast<const int64_t*>(x), n, op);
      break;
    case ncclUint64:
      combine_as(static_cast<uint64_t*>(acc), static_cast<const uint64_t*>(x), n, op);
      break;
    case ncclFloat32:
      combine_as(static_cast<float*>(acc), static_cast<const float*>(x), n, op);
      break;
    case ncclFloat64:
      combine_as(static_cast<double*>(acc), static_cast<const double*>(x), n, op);
      break;
    case ncclBfloat16:
      combine_bf16(static_cast<uint16_t*>(acc), static_cast<const uint16_t*>(x), n, op);
      break;
    default:
      break;
  }
}

void finish_avg(void* acc, size_t n, ncclDataType_t t, int ranks) {
  switch (t) {
    case ncclInt32:
      divide_as(static_cast<int32_t*>(acc), n, ranks);
      break;
    case ncclUint32:
      divide_as(static_cast<uint32_t*>(acc), n, ranks);
      break;
    case ncclInt64:
      divide_as(static_cast<int64_t*>(acc), n, ranks);
      break;
    case ncclUint64:
      divide_as(static_cast<uint64_t*>(acc), n, ranks);
      break;
    case ncclFloat32:
      divide_as(static_cast<float*>(acc), n, ranks);
      break;
    case ncclFloat64:
      divide_as(static_cast<double*>(acc), n, ranks);
      break;
    case ncclBfloat16: {
      auto* p = static_cast<uint16_t*>(acc);
      for (size_t i = 0; i < n; ++i) p[i] = titan::f32_to_bf16(titan::bf16_to_f32(p[i]) / float(ranks));
      break;
    }
    default:
      break;
  }
}

// The calls of one group (or of one call outside a group): their messages are posted as the calls come
// and completed, with the reductions and copies that wait on them, at the end.
struct Pending {
  std::vector<MPI_Request> requests;
  std::vector<std::function<void()>> after;  // in call order, once every message has arrived
  std::vector<std::vector<char>*> buffers;   // receive buffers the `after` steps read
  ~Pending() {
    for (auto* b : buffers) delete b;
  }
};

thread_local int group_depth = 0;
thread_local Pending* group = nullptr;

void post_send(ncclComm* c, const void* p, size_t bytes, int peer, Pending& q) {
  q.requests.emplace_back();
  MPI_Isend(p, static_cast<int>(bytes), MPI_BYTE, c->world[peer], c->tag, MPI_COMM_WORLD, &q.requests.back());
}
void post_recv(ncclComm* c, void* p, size_t bytes, int peer, Pending& q) {
  q.requests.emplace_back();
  MPI_Irecv(p, static_cast<int>(bytes), MPI_BYTE, c->world[peer], c->tag, MPI_COMM_WORLD, &q.requests.back());
}
// ncclSend: completes only once the peer's ncclRecv has taken the data (MPI's synchronous mode), as an NCCL
// send holds its stream until the peer receives. Two ranks that each send to the other outside a group
// before receiving hang here as on GPUs, instead of passing through MPI's eager buffering.
void post_synchronous_send(ncclComm* c, const void* p, size_t bytes, int peer, Pending& q) {
  q.requests.emplace_back();
  MPI_Issend(p, static_cast<int>(bytes), MPI_BYTE, c->world[peer], c->tag, MPI_COMM_WORLD,
             &q.requests.back());
}
char* scratch(size_t bytes, Pending& q) {
  q.buffers.push_back(new std::vector<char>(bytes));
  return q.buffers.back()->data();
}

ncclResult_t complete(Pending& q) {
  if (!q.requests.empty()) {
    const int rc = MPI_Waitall(static_cast<int>(q.requests.size()), q.requests.data(), MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) return reject(ncclSystemError, "an MPI transfer failed");
  }
  for (auto& f : q.after) f();
  return ncclSuccess;
}

// Runs `post` (which posts messages into a Pending) now, or adds it to the open group.
ncclResult_t run(const std::function<void(Pending&)>& post) {
  if (group_depth > 0) {
    post(*group);
    return ncclSuccess;
  }
  Pending q;
  post(q);
  return complete(q);
}

ncclResult_t check_comm(ncclComm* c, const char* call) {
  if (!c) return reject(ncclInvalidArgument, std::string(call) + ": null communicator");
  if (c->size > 1 && !mpi_running())
    return reject(ncclInvalidUsage,
                  std::string(call) + ": MPI is not running (the emulator's NCCL rides on it)");
  return ncclSuccess;
}

ncclResult_t check_buffer(const void* p, size_t count, ncclDataType_t t, const char* call,
                          const char* which) {
  if (type_bytes(t) == 0) return reject(ncclInvalidArgument, std::string(call) + ": data type");
  if (count == 0) return ncclSuccess;
  if (!p || !titan::cuda_sim::is_device_range(p, count * type_bytes(t)))
    return reject(ncclInvalidArgument, titan::str_cat(call, ": ", which, " (", p, ", ", count,
                                                      " elements) is not ", "device memory"));
  return ncclSuccess;
}

ncclResult_t check_root(ncclComm* c, int root, const char* call) {
  if (root < 0 || root >= c->size)
    return reject(ncclInvalidArgument, titan::str_cat(call, ": root ", root, " of ", c->size, " ranks"));
  return ncclSuccess;
}

ncclResult_t check_op(ncclDataType_t t, ncclRedOp_t op, const char* call) {
  if (!reducible(t))
    return reject(ncclInvalidArgument, std::string(call) + ": the emulator does not reduce this type");
  if (op < ncclSum || op > ncclAvg) return reject(ncclInvalidArgument, std::string(call) + ": reduction op");
  return ncclSuccess;
}

#define TITAN_NCCL_TRY(call)          \
  do {                                \
    const ncclResult_t r_ = (call);   \
    if (r_ != ncclSuccess) return r_; \
  } while (0)

constexpr int kAllRanks = -1;

// Every rank's `count` elements at `send` reduced in rank order into `recv` on `root`, or on every rank
// for kAllRanks (each adds the same parts in the same order, so all get the same bits), in `q`.
void post_reduce(ncclComm* c, const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                 int root, Pending& q) {
  const size_t bytes = count * type_bytes(t);
  for (int r = 0; r < c->size; ++r)
    if (r != c->rank && (root == kAllRanks || r == root)) post_send(c, send, bytes, r, q);
  if (root != kAllRanks && c->rank != root) return;
  std::vector<const char*> parts(c->size);
  for (int r = 0; r < c->size; ++r) {
    if (r == c->rank) {
      char* own = scratch(bytes, q);  // the send buffer may be the receive buffer
      std::memcpy(own, send, bytes);
      parts[r] = own;
    } else {
      char* b = scratch(bytes, q);
      post_recv(c, b, bytes, r, q);
      parts[r] = b;
    }
  }
  const int ranks = c->size;
  q.after.push_back([=] {
    std::memcpy(recv, parts[0], bytes);
    for (int r = 1; r < ranks; ++r) combine(recv, parts[r], count, t, op);
    if (op == ncclAvg) finish_avg(recv, count, t, ranks);
  });
}

void post_broadcast(ncclComm* c, const void* send, void* recv, size_t count, ncclDataType_t t, int root,
                    Pending& q) {
  const size_t bytes = count * type_bytes(t);
  if (c->rank == root) {
    for (int r = 0; r < c->size; ++r)
      if (r != root) post_send(c, send, bytes, r, q);
    if (send != recv) q.after.push_back([=] { std::memmove(recv, send, bytes); });
  } else {
    post_recv(c, recv, bytes, root, q);
  }
}

}  // namespace

// Under stream capture a call is checked now and recorded; the graph's launch issues it again, with the same
// arguments (its errors are then the launch's).
static bool replay_later(cudaStream_t stream, std::function<ncclResult_t()> call) {
  return titan::cuda_sim::record_if_capturing(stream, [call] {
    if (call() != ncclSuccess) titan::fail("CUDA emulator: NCCL: a captured call failed when its graph ran");
  });
}

extern "C" {

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error";
    case ncclSystemError:
      return "unhandled system error";
    case ncclInternalError:
      return "internal error";
    case ncclInvalidArgument:
      return last_error.empty() ? "invalid argument" : last_error.c_str();
    case ncclInvalidUsage:
      return last_error.empty() ? "invalid usage" : last_error.c_str();
    default:
      return "unknown result";
  }
}

const char* ncclGetLastError(ncclComm_t) {
  return last_error.c_str();
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (!id) return reject(ncclInvalidArgument, "ncclGetUniqueId: null id");
  static uint32_t serial = 0;
  std::memset(id, 0, sizeof(*id));
  const IdFields f{kIdMagic, world_rank(), ++serial};
  std::memcpy(id->internal, &f, sizeof f);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  IdFields f;
  std::memcpy(&f, id.internal, sizeof f);
  if (!comm) return reject(ncclInvalidArgument, "ncclCommInitRank: null communicator");
  if (f.magic != kIdMagic)
    return reject(ncclInvalidArgument, "ncclCommInitRank: the id was not made by ncclGetUniqueId");
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return reject(ncclInvalidArgument, titan::str_cat("ncclCommInitRank: rank ", rank, " of ", nranks));
  auto* c = new ncclComm;
  c->rank = rank;
  c->size = nranks;
  c->world.assign(nranks, world_rank());
  if (nranks > 1) {
    if (!mpi_running()) {
      delete c;
      return reject(ncclInvalidUsage, "ncclCommInitRank: more than one rank needs MPI (run under mpirun)");
    }
    const int ub = tag_upper_bound();
    c->tag = 1 + static_cast<int>((uint64_t(f.creator_world_rank) * 4096 + f.serial) % uint64_t(ub - 1));
    const int me[2] = {rank, world_rank()};
    if (me[1] != f.creator_world_rank) {
      MPI_Send(me, 2, MPI_INT, f.creator_world_rank, c->tag, MPI_COMM_WORLD);
      MPI_Recv(c->world.data(), nranks, MPI_INT, f.creator_world_rank, c->tag, MPI_COMM_WORLD,
               MPI_STATUS_IGNORE);
    } else {
      std::vector<int> seen(nranks, 0);
      c->world[rank] = me[1];
      seen[rank] = 1;
      for (int i = 1; i < nranks; ++i) {
        int other[2];
        MPI_Status st;
        MPI_Recv(other, 2, MPI_INT, MPI_ANY_SOURCE, c->tag, MPI_COMM_WORLD, &st);
        if (other[0] < 0 || other[0] >= nranks || seen[other[0]]) {
          delete c;
          return reject(ncclInvalidUsage, titan::str_cat("ncclCommInitRank: rank ", other[0],
                                                         " claimed twice or out of ", nranks));
        }
        seen[other[0]] = 1;
        c->world[other[0]] = other[1];
      }
      for (int r = 0; r < nranks; ++r)
        if (r != rank) MPI_Send(c->world.data(), nranks, MPI_INT, c->world[r], c->tag, MPI_COMM_WORLD);
    }
  }
  *comm = c;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  if (titan::cuda_sim::record_if_capture_active([] { ncclGroupStart(); })) return ncclSuccess;
  if (group_depth++ == 0) group = new Pending;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (titan::cuda_sim::record_if_capture_active([] {
        if (ncclGroupEnd() != ncclSuccess) titan::fail("CUDA emulator: NCCL: a captured group failed");
      }))
    return ncclSuccess;
  if (group_depth == 0) return reject(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--group_depth > 0) return ncclSuccess;
  Pending* q = group;
  group = nullptr;
  const ncclResult_t r = complete(*q);
  delete q;
  return r;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                           ncclComm_t c, cudaStream_t stream) {
  TITAN_NCCL_TRY(check_comm(c, "ncclAllReduce"));
  TITAN_NCCL_TRY(check_op(t, op, "ncclAllReduce"));
  TITAN_NCCL_TRY(check_buffer(send, count, t, "ncclAllReduce", "send buffer"));
  TITAN_NCCL_TRY(check_buffer(recv, count, t, "ncclAllReduce", "receive buffer"));
  if (replay_later(stream, [=] { return ncclAllReduce(send, recv, count, t, op, c, stream); }))
    return ncclSuccess;
  return run([&](Pending& q) { post_reduce(c, send, recv, count, t, op, kAllRanks, q); });
}

ncclResult_t ncclReduce(const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                        int root, ncclComm_t c, cudaStream_t stream) {
  TITAN_NCCL_TRY(check_comm(c, "ncclReduce"));
  TITAN_NCCL_TRY(check_root(c, root, "ncclReduce"));
  TITAN_NCCL_TRY(check_op(t, op, "ncclReduce"));
  TITAN_NCCL_TRY(check_buffer(send, count, t, "ncclReduce", "send buffer"));
  if (c->rank == root) TITAN_NCCL_TRY(check_buffer(recv, count, t, "ncclReduce", "receive buffer"));
  if (replay_later(stream, [=] { return ncclReduce(send, recv, count, t, op, root, c, stream); }))
    return ncclSuccess;
  return run([&](Pending& q) { post_reduce(c, send, recv, count, t, op, root, q); });
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t t, int root,
                           ncclComm_t c, cudaStream_t stream) {
  TITAN_NCCL_TRY(check_comm(c, "ncclBroadcast"));
  TITAN_NCCL_TRY(check_root(c, root, "ncclBroadcast"));
  if (c->rank == root) TITAN_NCCL_TRY(check_buffer(send, count, t, "ncclBroadcast", "send buffer"));
  TITAN_NCCL_TRY(check_buffer(recv, count, t, "ncclBroadcast", "receive buffer"));
  if (replay_later(stream, [=] { return ncclBroadcast(send, recv, count, t, root, c, stream); }))
    return ncclSuccess;
  return run([&](Pending& q) { post_broadcast(c, send, recv, count, t, root, q); });
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recv_count, ncclDataType_t t,
                               ncclRedOp_t op, ncclComm_t c, cudaStream_t stream) {
  TITAN_NCCL_TRY(check_comm(c, "ncclReduceScatter"));
  TITAN_NCCL_TRY(check_op(t, op, "ncclReduceScatter"));
  TITAN_NCCL_TRY(check_buffer(send, recv_count * c->size, t, "ncclReduceScatter", "send buffer"));
  TITAN_NCCL_TRY(check_buffer(recv, recv_count, t, "ncclReduceScatter", "receive buffer"));
  if (replay_later(stream, [=] { return ncclReduceScatter(send, recv, recv_count, t, op, c, stream); }))
    return ncclSuccess;
  const size_t bytes = recv_count * type_bytes(t);
  return run([&](Pending& q) {
    for (int r = 0; r < c->size; ++r)
      post_reduce(c, static_cast<const char*>(send) + r * bytes, recv, recv_count, t, op, r, q);
  });
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t send_count, ncclDataType_t t, ncclComm_t c,
                           cudaStream_t stream) {
  TITAN_NCCL_TRY(check_comm(c, "ncclAllGather"));
  TITAN_NCCL_TRY(check_buffer(send, send_count, t, "ncclAllGather", "send buffer"));
  TITAN_NCCL_TRY(check_buffer(recv, send_count * c->size, t, "ncclAllGather", "receive buffer"));
  if (replay_later(stream, [=] { return ncclAllGather(send, recv, send_count, t, c, stream); }))
    return ncclSuccess;
  const size_t bytes = send_count * type_bytes(t);
  return run([&](Pending& q) {
    for (int r = 0; r < c->size; ++r)
      post_broadcast(c, send, static_cast<char*>(recv) + r * bytes, send_count, t, r, q);
  });
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t t, int peer, ncclComm_t c,
                      cudaStream_t stream) {
  TITAN_NCCL_TRY(check_comm(c, "ncclSend"));
  TITAN_NCCL_TRY(check_root(c, peer, "ncclSend"));
  TITAN_NCCL_TRY(check_buffer(send, count, t, "ncclSend", "send buffer"));
  if (replay_later(stream, [=] { return ncclSend(send, count, t, peer, c, stream); })) return ncclSuccess;
  const size_t bytes = count * type_bytes(t);
  if (peer == c->rank) {  // kept until the matching ncclRecv of this rank
    const char* p = static_cast<const char*>(send);
    c->to_self.emplace_back(p, p + bytes);
    return ncclSuccess;
  }
  if (group_depth == 0) {  // held by its stream until the peer receives; the host goes on
    auto q = std::make_shared<Pending>();
    post_synchronous_send(c, send, bytes, peer, *q);
    titan::cuda_sim::defer_on_stream(stream, {[q] {
                                                int flag = 0;
                                                MPI_Testall(static_cast<int>(q->requests.size()),
                                                            q->requests.data(), &flag, MPI_STATUSES_IGNORE);
                                                return flag != 0;
                                              },
                                              [q] { complete(*q); }});
    return ncclSuccess;
  }
  return run([&](Pending& q) { post_synchronous_send(c, send, bytes, peer, q); });
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t t, int peer, ncclComm_t c,
                      cudaStream_t stream) {
  TITAN_NCCL_TRY(check_comm(c, "ncclRecv"));
  TITAN_NCCL_TRY(check_root(c, peer, "ncclRecv"));
  TITAN_NCCL_TRY(check_buffer(recv, count, t, "ncclRecv", "receive buffer"));
  if (replay_later(stream, [=] { return ncclRecv(recv, count, t, peer, c, stream); })) return ncclSuccess;
  const size_t bytes = count * type_bytes(t);
  if (peer == c->rank) {
    return run([&](Pending& q) {
      q.after.push_back([c, recv, bytes] {
        TITAN_CHECK(!c->to_self.empty(),
                    "CUDA emulator: NCCL: ncclRecv from the rank itself with no ncclSend");
        TITAN_CHECK(c->to_self.front().size() == bytes, "CUDA emulator: NCCL: ncclRecv of ", bytes,
                    " bytes from the rank itself, whose ncclSend had ", c->to_self.front().size());
        std::memcpy(recv, c->to_self.front().data(), bytes);
        c->to_self.pop_front();
      });
    });
  }
  return run([&](Pending& q) { post_recv(c, recv, bytes, peer, q); });
}

}  // extern "C"
