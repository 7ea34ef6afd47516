// The MPI process group, the watchdog and the distributed runtime (init, finalize, abort).
// Only the C API: the deprecated C++ bindings would need libmpi_cxx.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <thread>

#include "core/error.h"
#include "distributed/runtime.h"

namespace titan::dist {

namespace {

struct Runtime {
  bool inited = false;
  bool mpi = false;  // MPI_Init was called by us
  bool finalized = false;
  bool env_known = false;
  DistEnv env;
  std::unique_ptr<ProcessGroup> world;
  double timeout = -1;  // < 0: not read from the environment yet
};

Runtime& rt() {
  static Runtime r;
  return r;
}

const char* getenv_any(std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (const char* v = std::getenv(n); v && *v) return v;
  return nullptr;
}

int env_int(const char* v, int fallback) {
  return v ? std::atoi(v) : fallback;
}

MPI_Datatype mpi_type(CommType t) {
  switch (t) {
    case CommType::F32:
      return MPI_FLOAT;
    case CommType::F64:
      return MPI_DOUBLE;
    case CommType::I32:
      return MPI_INT32_T;
    case CommType::I64:
      return MPI_INT64_T;
    case CommType::BF16:
      return MPI_UINT16_T;
    case CommType::U8:
      return MPI_UINT8_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      return MPI_SUM;  // Avg divides afterwards
    case ReduceOp::Max:
      return MPI_MAX;
    case ReduceOp::Min:
      return MPI_MIN;
  }
  return MPI_OP_NULL;
}

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  fail(what, " failed: ", std::string(msg, len));
}

void check_reducible(CommType t, const char* what) {
  TITAN_CHECK(t != CommType::BF16 && t != CommType::U8, what, ": reductions need f32, f64, i32 or i64, got ",
              comm_type_name(t));
}

// Divides n elements by `d` (the Avg of a Sum).
void divide(void* buf, int64_t n, CommType t, int d) {
  switch (t) {
    case CommType::F32: {
      float* p = static_cast<float*>(buf);
      const float inv = 1.0f / float(d);
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
      for (int64_t i = 0; i < n; ++i) p[i] *= inv;
      break;
    }
    case CommType::F64: {
      double* p = static_cast<double*>(buf);
      for (int64_t i = 0; i < n; ++i) p[i] /= d;
      break;
    }
    case CommType::I32: {
      int32_t* p = static_cast<int32_t*>(buf);
      for (int64_t i = 0; i < n; ++i) p[i] /= d;
      break;
    }
    case CommType::I64: {
      int64_t* p = static_cast<int64_t*>(buf);
      for (int64_t i = 0; i < n; ++i) p[i] /= d;
      break;
    }
    default:
      break;
  }
}

// MPI counts and displacements are int; the v-collectives check every count and offset fits.
void to_int_counts(const std::vector<int64_t>& counts, std::vector<int>& c, std::vector<int>& d,
                   const char* what) {
  c.resize(counts.size());
  d.resize(counts.size());
  int64_t off = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    TITAN_CHECK(counts[i] >= 0, what, ": negative count ", counts[i]);
    TITAN_CHECK(off + counts[i] <= INT_MAX, what, ": ", off + counts[i],
                " elements exceed MPI's int counts; split the buffer");
    c[i] = int(counts[i]);
    d[i] = int(off);
    off += counts[i];
  }
}

constexpr int kNoticeTag = 7301;

class MpiProcessGroup final : public ProcessGroup {
 public:
  // Takes ownership of `comm` (a dup or split, never MPI_COMM_WORLD itself).
  explicit MpiProcessGroup(MPI_Comm comm) : comm_(comm) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    // Watchdog notices travel on their own communicator so they never match user traffic.
    MPI_Comm_dup(comm_, &notice_comm_);
    MPI_Group g, wg;
    MPI_Comm_group(comm_, &g);
    MPI_Comm_group(MPI_COMM_WORLD, &wg);
    std::vector<int> mine(size_), theirs(size_);
    for (int i = 0; i < size_; ++i) mine[i] = i;
    MPI_Group_translate_ranks(g, size_, mine.data(), wg, theirs.data());
    world_ranks_ = theirs;
    MPI_Group_free(&g);
    MPI_Group_free(&wg);
  }
  ~MpiProcessGroup() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      MPI_Comm_free(&notice_comm_);
      MPI_Comm_free(&comm_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank_of(int r) const override { return world_ranks_.at(r); }
  std::string backend() const override { return "mpi"; }
  using ProcessGroup::all_gather;
  using ProcessGroup::all_reduce;
  using ProcessGroup::broadcast;
  using ProcessGroup::reduce_scatter;

  void all_reduce(void* buf, int64_t count, CommType type, ReduceOp op) override {
    check_reducible(type, "all_reduce");
    char* p = static_cast<char*>(buf);
    // Chunks keep every call within MPI's int count.
    for (int64_t done = 0; done < count; done += INT_MAX / 2) {
      const int n = int(std::min<int64_t>(count - done, INT_MAX / 2));
      void* b = p + done * comm_type_size(type);
      run(
          "all_reduce", [&] { return MPI_Allreduce(MPI_IN_PLACE, b, n, mpi_type(type), mpi_op(op), comm_); },
          [&](MPI_Request* r) {
            return MPI_Iallreduce(MPI_IN_PLACE, b, n, mpi_type(type), mpi_op(op), comm_, r);
          });
    }
    if (op == ReduceOp::Avg) divide(buf, count, type, size_);
  }

  void reduce_scatter(const void* send, void* recv, const std::vector<int64_t>& recv_counts, CommType type,
                      ReduceOp op) override {
    check_reducible(type, "reduce_scatter");
    check_size(recv_counts, "reduce_scatter");
    std::vector<int> c, d;
    to_int_counts(recv_counts, c, d, "reduce_scatter");
    run(
        "reduce_scatter",
        [&] { return MPI_Reduce_scatter(send, recv, c.data(), mpi_type(type), mpi_op(op), comm_); },
        [&](MPI_Request* r) {
          return MPI_Ireduce_scatter(send, recv, c.data(), mpi_type(type), mpi_op(op), comm_, r);
        });
    if (op == ReduceOp::Avg) divide(recv, recv_counts[rank_], type, size_);
  }

  void all_gather(const void* send, void* recv, const std::vector<int64_t>& counts, CommType type) override {
    check_size(counts, "all_gather");
    std::vector<int> c, d;
    to_int_counts(counts, c, d, "all_gather");
    // In place when this rank's block of recv already holds its data (FSDP gathers into the full buffer).
    const bool in_place = send == static_cast<const char*>(recv) + size_t(d[rank_]) * comm_type_size(type);
    const void* s = in_place ? MPI_IN_PLACE : send;
    run(
        "all_gather",
        [&] {
          return MPI_Allgatherv(s, c[rank_], mpi_type(type), recv, c.data(), d.data(), mpi_type(type), comm_);
        },
        [&](MPI_Request* r) {
          return MPI_Iallgatherv(s, c[rank_], mpi_type(type), recv, c.data(), d.data(), mpi_type(type), comm_,
                                 r);
        });
  }

  void broadcast(void* buf, int64_t count, CommType type, int root) override {
    TITAN_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " outside a group of ", size_);
    char* p = static_cast<char*>(buf);
    for (int64_t done = 0; done < count; done += INT_MAX / 2) {
      const int n = int(std::min<int64_t>(count - done, INT_MAX / 2));
      void* b = p + done * comm_type_size(type);
      run(
          "broadcast", [&] { return MPI_Bcast(b, n, mpi_type(type), root, comm_); },
          [&](MPI_Request* r) { return MPI_Ibcast(b, n, mpi_type(type), root, comm_, r); });
    }
  }

  void all_to_all(const void* send, void* recv, int64_t count, CommType type) override {
    TITAN_CHECK(count * size_ <= INT_MAX, "all_to_all: ", count * size_, " elements exceed MPI's int counts");
    const int n = int(count);
    run(
        "all_to_all", [&] { return MPI_Alltoall(send, n, mpi_type(type), recv, n, mpi_type(type), comm_); },
        [&](MPI_Request* r) {
          return MPI_Ialltoall(send, n, mpi_type(type), recv, n, mpi_type(type), comm_, r);
        });
  }

  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                    const std::vector<int64_t>& recv_counts, CommType type) override {
    check_size(send_counts, "all_to_all_v");
    check_size(recv_counts, "all_to_all_v");
    std::vector<int> sc, sd, rc, rd;
    to_int_counts(send_counts, sc, sd, "all_to_all_v");
    to_int_counts(recv_counts, rc, rd, "all_to_all_v");
    const MPI_Datatype t = mpi_type(type);
    run(
        "all_to_all_v",
        [&] { return MPI_Alltoallv(send, sc.data(), sd.data(), t, recv, rc.data(), rd.data(), t, comm_); },
        [&](MPI_Request* r) {
          return MPI_Ialltoallv(send, sc.data(), sd.data(), t, recv, rc.data(), rd.data(), t, comm_, r);
        });
  }

  void barrier() override {
    run(
        "barrier", [&] { return MPI_Barrier(comm_); },
        [&](MPI_Request* r) { return MPI_Ibarrier(comm_, r); });
  }

  void send(const void* buf, int64_t count, CommType type, int dst) override {
    check_peer(dst, "send");
    TITAN_CHECK(count <= INT_MAX, "send: ", count, " elements exceed MPI's int counts");
    reap_sends(false);
    pending_.emplace_back();
    Pending& p = pending_.back();
    p.data.assign(static_cast<const char*>(buf),
                  static_cast<const char*>(buf) + count * comm_type_size(type));
    check_mpi(MPI_Isend(p.data.data(), int(count), mpi_type(type), dst, kP2pTag, comm_, &p.req), "send");
  }
  void recv(void* buf, int64_t count, CommType type, int src) override {
    check_peer(src, "recv");
    TITAN_CHECK(count <= INT_MAX, "recv: ", count, " elements exceed MPI's int counts");
    const int n = int(count);
    run(
        "recv", [&] { return MPI_Recv(buf, n, mpi_type(type), src, kP2pTag, comm_, MPI_STATUS_IGNORE); },
        [&](MPI_Request* r) { return MPI_Irecv(buf, n, mpi_type(type), src, kP2pTag, comm_, r); });
  }
  void wait_sends() override { reap_sends(true); }

  std::shared_ptr<ProcessGroup> split(int color, int key) override {
    MPI_Comm sub;
    check_mpi(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split");
    return std::make_shared<MpiProcessGroup>(sub);
  }

 private:
  void check_size(const std::vector<int64_t>& counts, const char* what) const {
    TITAN_CHECK(int(counts.size()) == size_, what, ": ", counts.size(), " counts for a group of ", size_);
  }

  // Runs one collective: blocking when the watchdog is off; otherwise the non-blocking form, polled
  // until it completes or the timeout passes (MPI has no timeout on blocking calls).
  template <class Blocking, class NonBlocking>
  void run(const char* what, Blocking blocking, NonBlocking nonblocking) {
    ++seq_;
    const double timeout = watchdog_timeout();
    if (timeout <= 0) {
      check_mpi(blocking(), what);
      return;
    }
    MPI_Request req;
    check_mpi(nonblocking(&req), what);
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    int64_t polls = 0;
    for (;;) {
      int done = 0;
      check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), what);
      if (done) return;
      // Spin briefly (latency), then back off so waiting ranks leave the cores to the ones computing.
      if (++polls > 2000) std::this_thread::sleep_for(std::chrono::microseconds(polls > 200000 ? 1000 : 50));
      if ((polls & 63) == 0 && std::chrono::duration<double>(clock::now() - start).count() > timeout)
        on_timeout(what, req, timeout);
    }
  }

  // This rank waited `timeout` s. Every rank stuck in the same collective sends a notice to all the
  // others; after a grace period the ranks without a notice are the ones that did not arrive.
  [[noreturn]] void on_timeout(const char* what, MPI_Request& req, double timeout) {
    const int64_t payload[2] = {seq_, rank_};
    std::vector<MPI_Request> sends;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      sends.emplace_back();
      MPI_Isend(payload, 2, MPI_INT64_T, r, kNoticeTag, notice_comm_, &sends.back());
    }
    std::vector<bool> arrived(size_, false);
    arrived[rank_] = true;
    const double grace = std::min(5.0, std::max(1.0, timeout / 2));
    const auto start = std::chrono::steady_clock::now();
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < grace) {
      int flag = 0;
      MPI_Status st;
      MPI_Iprobe(MPI_ANY_SOURCE, kNoticeTag, notice_comm_, &flag, &st);
      if (flag) {
        int64_t got[2];
        MPI_Recv(got, 2, MPI_INT64_T, st.MPI_SOURCE, kNoticeTag, notice_comm_, MPI_STATUS_IGNORE);
        if (got[0] == seq_) arrived[st.MPI_SOURCE] = true;
      } else {
        int done = 0;
        MPI_Test(&req, &done, MPI_STATUS_IGNORE);  // keep the collective progressing
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    std::string missing;
    for (int r = 0; r < size_; ++r)
      if (!arrived[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(world_rank_of(r));
    std::string msg = str_cat(rank_prefix(), "error: watchdog: ", what, " (collective #", seq_,
                              " of a group of ", size_, ") did not complete within ", timeout, " s; ");
    if (!missing.empty())
      msg += str_cat("rank ", missing, " did not arrive (hung, stuck outside collectives or dead)");
    else
      msg += "every rank arrived: mismatched collectives or sizes across ranks?";
    msg += ". Raise TITAN_DIST_TIMEOUT if this step is legitimately slow.";
    abort_job(msg, 1);
  }

  void check_peer(int peer, const char* what) const {
    TITAN_CHECK(peer >= 0 && peer < size_ && peer != rank_, what, ": peer ", peer,
                " is not another rank of a group of ", size_, " (this rank is ", rank_, ")");
  }
  // Completed sends are freed; all = true waits for every one (watched like a collective).
  void reap_sends(bool all) {
    while (!pending_.empty()) {
      MPI_Request& req = pending_.front().req;
      if (all) {
        run(
            "send", [&] { return MPI_Wait(&req, MPI_STATUS_IGNORE); },
            [&](MPI_Request* r) {
              *r = req;
              req = MPI_REQUEST_NULL;
              return MPI_SUCCESS;
            });
      } else {
        int done = 0;
        check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "send");
        if (!done) return;
      }
      pending_.pop_front();
    }
  }
  struct Pending {
    std::vector<char> data;
    MPI_Request req = MPI_REQUEST_NULL;
  };
  static constexpr int kP2pTag = 7;
  std::deque<Pending> pending_;  // sends in flight, oldest first (their data kept until delivered)

  MPI_Comm comm_, notice_comm_;
  int rank_ = 0, size_ = 1;
  std::vector<int> world_ranks_;
  int64_t seq_ = 0;
};

}  // namespace

// ---- runtime ----

DistEnv detect_env() {
  DistEnv e;
  if (const char* r = getenv_any({"OMPI_COMM_WORLD_RANK"})) {
    e.launcher = "openmpi";
    e.rank = env_int(r, 0);
    e.world_size = env_int(getenv_any({"OMPI_COMM_WORLD_SIZE"}), 1);
    e.local_rank = env_int(getenv_any({"OMPI_COMM_WORLD_LOCAL_RANK"}), 0);
    e.local_world_size = env_int(getenv_any({"OMPI_COMM_WORLD_LOCAL_SIZE"}), 1);
    // OMPI_COMM_WORLD_NODE_RANK is the process's index on its node, not the node's: assume the default
    // by-slot mapping here; init() replaces it with the node index MPI reports.
    e.node_rank = e.local_world_size > 0 ? e.rank / e.local_world_size : 0;
  } else if (const char* r = getenv_any({"PMI_RANK", "PMIX_RANK"})) {
    e.launcher = "pmi";
    e.rank = env_int(r, 0);
    e.world_size = env_int(getenv_any({"PMI_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"}), 1);
    e.local_rank = env_int(getenv_any({"MPI_LOCALRANKID", "SLURM_LOCALID"}), 0);
    e.local_world_size = env_int(getenv_any({"MPI_LOCALNRANKS"}), 1);
    e.node_rank = env_int(getenv_any({"SLURM_NODEID"}), 0);
  } else if (getenv_any({"SLURM_STEP_NUM_TASKS"}) && getenv_any({"SLURM_PROCID"})) {
    // Only inside an srun step: an sbatch script alone also has SLURM_PROCID=0 but is one process.
    e.launcher = "slurm";
    e.rank = env_int(getenv_any({"SLURM_PROCID"}), 0);
    e.world_size = env_int(getenv_any({"SLURM_STEP_NUM_TASKS"}), 1);
    e.local_rank = env_int(getenv_any({"SLURM_LOCALID"}), 0);
    e.local_world_size = env_int(getenv_any({"SLURM_STEP_TASKS_PER_NODE"}), 1);  // "2(x3)" -> 2
    e.node_rank = env_int(getenv_any({"SLURM_NODEID"}), 0);
  }
  return e;
}

ProcessGroup& init() {
  Runtime& r = rt();
  if (r.inited) return *r.world;
  r.env = detect_env();
  r.env_known = true;
  if (!r.env.launched()) {
    r.world = std::make_unique<SingleProcessGroup>();
    r.inited = true;
    return *r.world;
  }
  int already = 0;
  MPI_Initialized(&already);
  if (!already) {
    int provided = 0;
    // FUNNELED: only the main thread calls MPI; OpenMP threads compute.
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    r.mpi = true;
  }
  MPI_Comm world;
  MPI_Comm_dup(MPI_COMM_WORLD, &world);
  auto g = std::make_unique<MpiProcessGroup>(world);
  // srun without PMI support (or a launcher MPI does not understand) starts N singletons of world 1:
  // every rank would train alone. Refuse instead of silently diverging.
  TITAN_CHECK(!(g->size() == 1 && r.env.world_size > 1), "the launcher (", r.env.launcher, ") started ",
              r.env.world_size, " ranks but MPI sees a world of ", g->size(),
              "; under Slurm use `srun --mpi=pmix`");
  r.env.rank = g->rank();
  r.env.world_size = g->size();
  // Ranks sharing memory are on one node: local rank/size and the node index come from MPI itself, so
  // they are right under any launcher.
  MPI_Comm node, leaders;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, r.env.rank, MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &r.env.local_rank);
  MPI_Comm_size(node, &r.env.local_world_size);
  MPI_Comm_split(MPI_COMM_WORLD, r.env.local_rank == 0 ? 0 : MPI_UNDEFINED, r.env.rank, &leaders);
  int node_index = 0;
  if (leaders != MPI_COMM_NULL) {
    MPI_Comm_rank(leaders, &node_index);
    MPI_Comm_free(&leaders);
  }
  MPI_Bcast(&node_index, 1, MPI_INT, 0, node);
  r.env.node_rank = node_index;
  MPI_Comm_free(&node);
  r.world = std::move(g);
  r.inited = true;
  return *r.world;
}

bool initialized() {
  return rt().inited;
}
ProcessGroup& world() {
  return init();
}
bool mpi_active() {
  return rt().mpi && !rt().finalized;
}

const DistEnv& env() {
  Runtime& r = rt();
  if (!r.env_known) {
    r.env = detect_env();
    r.env_known = true;
  }
  return r.env;
}

void finalize() {
  Runtime& r = rt();
  if (!mpi_active()) return;
  r.world->barrier();  // watched: a hung rank makes this abort instead of hanging in MPI_Finalize
  r.world.reset();
  r.finalized = true;
  MPI_Finalize();
}

void abort_job(const std::string& message, int code) {
  if (!message.empty()) std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(nullptr);
  if (mpi_active()) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

double watchdog_timeout() {
  Runtime& r = rt();
  if (r.timeout < 0) {
    const char* v = std::getenv("TITAN_DIST_TIMEOUT");
    r.timeout = v && *v ? std::atof(v) : 600.0;
    if (r.timeout < 0) r.timeout = 0;
  }
  return r.timeout;
}

void set_watchdog_timeout(double seconds) {
  rt().timeout = seconds < 0 ? 0 : seconds;
}

std::string mpi_library_version() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(buf, &len);
  std::string v(buf, size_t(len));
  if (auto nl = v.find('\n'); nl != std::string::npos) v.resize(nl);
  return v;
}

std::string rank_prefix() {
  const DistEnv& e = env();
  return e.world_size > 1 ? str_cat("[rank ", e.rank, "] ") : std::string();
}

void report_fatal_error(const char* command, const char* what) {
  if (env().world_size <= 1) return;
  abort_job(str_cat(rank_prefix(), "titan ", command, ": error: ", what), 1);
}

int finish_command(const char* command, int rc) {
  if (rc == 0 || rc == kStoppedTogetherStatus) {
    // A preempted run's ranks agreed on the step and saved it together; an MPI_Abort here would kill the
    // others mid-way (possibly in their checkpoint write) and turn the status into mpirun's SIGTERM.
    finalize();
    return rc;
  }
  if (env().world_size > 1)
    abort_job(str_cat(rank_prefix(), "titan ", command, ": exited with status ", rc), rc);
  return rc;
}

}  // namespace titan::dist
