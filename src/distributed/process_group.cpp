// Element types, the single-process group and the Tensor conveniences of ProcessGroup.
#include "distributed/process_group.h"

#include <cstring>

#include "core/error.h"

namespace titan::dist {

size_t comm_type_size(CommType t) {
  switch (t) {
    case CommType::F32:
      return 4;
    case CommType::F64:
      return 8;
    case CommType::I32:
      return 4;
    case CommType::I64:
      return 8;
    case CommType::BF16:
      return 2;
    case CommType::U8:
      return 1;
  }
  return 0;
}

const char* comm_type_name(CommType t) {
  switch (t) {
    case CommType::F32:
      return "f32";
    case CommType::F64:
      return "f64";
    case CommType::I32:
      return "i32";
    case CommType::I64:
      return "i64";
    case CommType::BF16:
      return "bf16";
    case CommType::U8:
      return "u8";
  }
  return "?";
}

void ProcessGroup::send(const void*, int64_t, CommType, int) {
  fail("send: the ", backend(), " process group has no point-to-point messages (pipeline parallel)");
}
void ProcessGroup::recv(void*, int64_t, CommType, int) {
  fail("recv: the ", backend(), " process group has no point-to-point messages (pipeline parallel)");
}
void ProcessGroup::exchange(const std::vector<P2p>& ops) {
  for (const P2p& op : ops)
    if (op.is_send) send(op.buf, op.count, op.type, op.peer);
  for (const P2p& op : ops)
    if (!op.is_send) recv(op.buf, op.count, op.type, op.peer);
  wait_sends();
}

CommType comm_type_of(DType t) {
  switch (t) {
    case DType::F32:
      return CommType::F32;
    case DType::BF16:
      return CommType::BF16;
    case DType::I32:
      return CommType::I32;
    case DType::I64:
    case DType::F64:
      break;
  }
  fail("no communication type for dtype ", dtype_name(t));
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Avg:
      return "avg";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
  }
  return "?";
}

std::vector<int64_t> equal_counts(int size, int64_t n) {
  return std::vector<int64_t>(size, n);
}

void ProcessGroup::all_gather(const Tensor& send, const Tensor& recv) {
  TITAN_CHECK(send.dtype() == recv.dtype(), "all_gather: dtypes differ (", dtype_name(send.dtype()), " vs ",
              dtype_name(recv.dtype()), ")");
  TITAN_CHECK(recv.numel() == send.numel() * size(), "all_gather: recv has ", recv.numel(),
              " elements, expected ", size(), " x ", send.numel());
  all_gather(send.raw(), recv.raw(), equal_counts(size(), send.numel()), comm_type_of(send.dtype()));
}

void ProcessGroup::reduce_scatter(const Tensor& send, const Tensor& recv, ReduceOp op) {
  TITAN_CHECK(send.dtype() == recv.dtype(), "reduce_scatter: dtypes differ");
  TITAN_CHECK(send.numel() == recv.numel() * size(), "reduce_scatter: send has ", send.numel(),
              " elements, expected ", size(), " x ", recv.numel());
  reduce_scatter(send.raw(), recv.raw(), equal_counts(size(), recv.numel()), comm_type_of(send.dtype()), op);
}

// ---- SingleProcessGroup: one rank, so every collective is the identity (or a copy) ----

namespace {
void check_reducible(CommType t, const char* what) {
  TITAN_CHECK(t != CommType::BF16 && t != CommType::U8, what, ": reductions need f32, f64, i32 or i64, got ",
              comm_type_name(t));
}
void copy_elems(void* dst, const void* src, int64_t n, CommType t) {
  if (dst != src && n > 0) std::memmove(dst, src, size_t(n) * comm_type_size(t));
}
}  // namespace

void SingleProcessGroup::all_reduce(void*, int64_t, CommType type, ReduceOp) {
  check_reducible(type, "all_reduce");
}

void SingleProcessGroup::reduce_scatter(const void* send, void* recv, const std::vector<int64_t>& recv_counts,
                                        CommType type, ReduceOp) {
  check_reducible(type, "reduce_scatter");
  TITAN_CHECK(recv_counts.size() == 1, "reduce_scatter: ", recv_counts.size(), " counts for a group of 1");
  copy_elems(recv, send, recv_counts[0], type);
}

void SingleProcessGroup::all_gather(const void* send, void* recv, const std::vector<int64_t>& counts,
                                    CommType type) {
  TITAN_CHECK(counts.size() == 1, "all_gather: ", counts.size(), " counts for a group of 1");
  copy_elems(recv, send, counts[0], type);
}

void SingleProcessGroup::broadcast(void*, int64_t, CommType, int root) {
  TITAN_CHECK(root == 0, "broadcast: root ", root, " outside a group of 1");
}

void SingleProcessGroup::all_to_all(const void* send, void* recv, int64_t count, CommType type) {
  copy_elems(recv, send, count, type);
}

void SingleProcessGroup::all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                      const std::vector<int64_t>& recv_counts, CommType type) {
  TITAN_CHECK(send_counts.size() == 1 && recv_counts.size() == 1 && send_counts[0] == recv_counts[0],
              "all_to_all_v: counts do not match a group of 1");
  copy_elems(recv, send, send_counts[0], type);
}

std::shared_ptr<ProcessGroup> SingleProcessGroup::split(int, int) {
  return std::make_shared<SingleProcessGroup>(world_rank_);
}

}  // namespace titan::dist
