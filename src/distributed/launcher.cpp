// `titan run`: mpirun as a child process, its output relayed with rank prefixes and filtering.
#include "distributed/launcher.h"

#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <regex>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "distributed/runtime.h"

namespace titan::dist {

namespace {

int parse_int(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);
  TITAN_CHECK(!v.empty() && end && *end == '\0', "", flag, " expects an integer, got '", v, "'");
  return int(x);
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

int available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  TITAN_CHECK(n > 0, "cannot resolve /proc/self/exe");
  return std::string(buf, size_t(n));
}

volatile sig_atomic_t g_child = 0;
volatile sig_atomic_t g_preempt_signals = 0;
void forward_signal(int sig) {
  if (g_child <= 0) return;
  // SIGTERM / SIGUSR1 (preemption): mpirun passes SIGUSR1 on to every rank, which finish their step, save and
  // exit (train/preemption.h); SIGTERM itself would make mpirun kill the ranks. A second one: SIGTERM, stop.
  if (sig == SIGTERM || sig == SIGUSR1) {
    sig = g_preempt_signals == 0 ? SIGUSR1 : SIGTERM;
    g_preempt_signals = 1;
  }
  kill(g_child, sig);
}

}  // namespace

std::string launch_usage() {
  return "usage: titan run --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P\n"
         "                 --hosts h1,h2,...] [--local-ranks-filter 0,1] [--timeout SECONDS] [--dry-run]\n"
         "                 [--mpirun-arg ARG]... <subcommand> [args...]\n"
         "Starts N ranks per node through mpirun; each output line is prefixed with [rankR]:.\n"
         "--timeout sets TITAN_DIST_TIMEOUT (collective watchdog, default 600 s, 0 = off).\n"
         "Also supported directly: mpirun -np N titan <subcommand> ..., srun titan <subcommand> ...\n";
}

LaunchOptions parse_launch_args(int argc, char** argv) {
  LaunchOptions o;
  int i = 0;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a.rfind("--", 0) != 0) break;  // the subcommand
    std::string value;
    bool has_value = false;
    if (auto eq = a.find('='); eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
      has_value = true;
    }
    for (char& ch : a)
      if (ch == '_') ch = '-';
    if (a == "--help" || a == "-h") {
      o.help = true;
      return o;
    }
    if (a == "--dry-run") {
      o.dry_run = true;
      continue;
    }
    if (!has_value) {
      TITAN_CHECK(i + 1 < argc, "", a, " needs a value\n", launch_usage());
      value = argv[++i];
    }
    if (a == "--nproc-per-node")
      o.nproc_per_node = parse_int(a, value);
    else if (a == "--nnodes")
      o.nnodes = parse_int(a, value);
    else if (a == "--node-rank")
      o.node_rank = parse_int(a, value);
    else if (a == "--master-addr")
      o.master_addr = value;
    else if (a == "--master-port")
      o.master_port = parse_int(a, value);
    else if (a == "--hosts")
      o.hosts = split_list(value);
    else if (a == "--local-ranks-filter") {
      for (auto& r : split_list(value)) o.local_ranks_filter.push_back(parse_int(a, r));
    } else if (a == "--timeout")
      o.timeout = std::atof(value.c_str());
    else if (a == "--mpirun-arg")
      o.mpirun_args.push_back(value);
    else
      fail("unknown option ", a, "\n", launch_usage());
  }
  for (; i < argc; ++i) o.command.push_back(argv[i]);
  TITAN_CHECK(!o.command.empty(), "no subcommand given\n", launch_usage());
  TITAN_CHECK(o.command[0] != "run", "the subcommand cannot be `run` itself");
  TITAN_CHECK(o.nproc_per_node >= 1, "--nproc-per-node must be >= 1");
  TITAN_CHECK(o.nnodes >= 1, "--nnodes must be >= 1");
  TITAN_CHECK(o.node_rank >= 0 && o.node_rank < o.nnodes, "--node-rank ", o.node_rank, " outside [0, ",
              o.nnodes, ")");
  TITAN_CHECK(o.hosts.empty() || int(o.hosts.size()) == o.nnodes, "--hosts lists ", o.hosts.size(),
              " hosts for --nnodes ", o.nnodes);
  return o;
}

std::vector<std::string> mpirun_command(const LaunchOptions& o, const std::string& titan_exe) {
  std::vector<std::string> cmd = {"mpirun",          "-np",       std::to_string(o.nproc_per_node * o.nnodes),
                                  "--oversubscribe", "--bind-to", "none",
                                  "--tag-output"};
  // OpenMPI refuses root unless told; containers and CI often run as root.
  if (geteuid() == 0) cmd.push_back("--allow-run-as-root");
  if (o.nnodes > 1) {
    std::string hosts;
    for (auto& h : o.hosts) hosts += (hosts.empty() ? "" : ",") + h + ":" + std::to_string(o.nproc_per_node);
    cmd.insert(cmd.end(), {"--host", hosts});
  }
  // Threads per rank: an explicit OMP_NUM_THREADS wins; otherwise share this node's cores (ranks x threads
  // <= cores, so ranks do not fight over cores).
  std::string omp;
  if (const char* v = std::getenv("OMP_NUM_THREADS"); v && *v)
    omp = v;
  else
    omp = std::to_string(std::max(1, available_cores() / o.nproc_per_node));
  auto export_var = [&](const std::string& kv) { cmd.insert(cmd.end(), {"-x", kv}); };
  export_var("OMP_NUM_THREADS=" + omp);
  export_var("TITAN_MASTER_ADDR=" + o.master_addr);
  export_var("TITAN_MASTER_PORT=" + std::to_string(o.master_port));
  export_var("TITAN_NNODES=" + std::to_string(o.nnodes));
  export_var("TITAN_NPROC_PER_NODE=" + std::to_string(o.nproc_per_node));
  if (o.timeout >= 0) {
    std::ostringstream t;
    t << o.timeout;
    export_var("TITAN_DIST_TIMEOUT=" + t.str());
  } else if (const char* v = std::getenv("TITAN_DIST_TIMEOUT"); v && *v) {
    export_var(std::string("TITAN_DIST_TIMEOUT=") + v);
  }
  cmd.insert(cmd.end(), o.mpirun_args.begin(), o.mpirun_args.end());
  cmd.push_back(titan_exe);
  cmd.insert(cmd.end(), o.command.begin(), o.command.end());
  return cmd;
}

// ---- output relay ----

void RankOutputRelay::note_failure(int rank, int priority, const std::string& reason) {
  if (rank < 0 || priority <= priority_) return;
  failed_rank_ = rank;
  priority_ = priority;
  reason_ = reason;
}

std::optional<std::string> RankOutputRelay::relay(const std::string& line) {
  static const std::regex tag(R"(^\[\d+,(\d+)\]<(stdout|stderr|stddiag)>:(.*)$)");
  static const std::regex not_arrived(R"(rank ([0-9]+)(, [0-9]+)* did not arrive)");
  static const std::regex process_name(R"(Process name:\s*\[\[\d+,\d+\],(\d+)\])");
  static const std::regex exit_code(R"(Exit code:\s*(-?\d+))");
  static const std::regex abort_on(R"(MPI_ABORT was invoked on rank (\d+))");
  static const std::regex process_rank(
      R"(process rank (\d+) with PID .* (exited on signal \d+[^.]*|exiting improperly))");
  std::smatch m;
  if (std::regex_match(line, m, tag)) {
    const int rank = std::stoi(m[1]);
    const std::string text = m[3];
    const bool is_error = text.find("error:") != std::string::npos || text.find("FAIL") != std::string::npos;
    std::smatch w;
    if (std::regex_search(text, w, not_arrived))
      note_failure(std::stoi(w[1]), 4, "did not arrive at a collective");
    else if (text.find("error:") != std::string::npos)
      note_failure(rank, 3, text.substr(text.find("error:")));
    if (!filter_.empty() && !is_error) {
      const int local = rank % std::max(1, nproc_per_node_);
      bool keep = false;
      for (int r : filter_) keep |= r == local;
      if (!keep) return std::nullopt;
    }
    return "[rank" + std::to_string(rank) + "]: " + text;
  }
  // mpirun's own lines: keep them, and learn which rank failed.
  if (std::regex_search(line, m, process_name))
    pending_process_rank_ = std::stoi(m[1]);
  else if (pending_process_rank_ >= 0 && std::regex_search(line, m, exit_code)) {
    note_failure(pending_process_rank_, 2, "exit code " + m[1].str());
    pending_process_rank_ = -1;
  } else if (std::regex_search(line, m, abort_on)) {
    note_failure(std::stoi(m[1]), 1, "called MPI_Abort");
  } else if (std::regex_search(line, m, process_rank)) {
    note_failure(std::stoi(m[1]), 2, m[2]);
  }
  return line;
}

// ---- the launch ----

int launch(const LaunchOptions& o) {
  if (o.help) {
    std::printf("%s", launch_usage().c_str());
    return 0;
  }
  if (o.nnodes > 1 && o.node_rank > 0) {
    std::fprintf(
        stderr,
        "titan run: node %d of %d: the ranks of this node are started by node 0's mpirun (over ssh); "
        "nothing to do here\n",
        o.node_rank, o.nnodes);
    return 0;
  }
  TITAN_CHECK(o.nnodes == 1 || !o.hosts.empty(), "--nnodes ", o.nnodes,
              " needs --hosts h1,h2,... (node 0 starts every rank through "
              "mpirun over ssh); under Slurm use `srun titan ...` instead");
  const std::vector<std::string> cmd = mpirun_command(o, self_exe());
  if (o.dry_run) {
    std::string line;
    for (auto& a : cmd) line += (line.empty() ? "" : " ") + a;
    std::printf("%s\n", line.c_str());
    return 0;
  }
  int out_pipe[2], err_pipe[2];
  TITAN_CHECK(pipe(out_pipe) == 0 && pipe(err_pipe) == 0, "pipe failed: ", std::strerror(errno));
  std::fflush(nullptr);
  const pid_t pid = fork();
  TITAN_CHECK(pid >= 0, "fork failed: ", std::strerror(errno));
  if (pid == 0) {
    dup2(out_pipe[1], 1);
    dup2(err_pipe[1], 2);
    close(out_pipe[0]);
    close(out_pipe[1]);
    close(err_pipe[0]);
    close(err_pipe[1]);
    std::vector<char*> argv;
    for (auto& a : cmd) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    std::fprintf(stderr, "titan run: cannot start mpirun: %s (is OpenMPI installed?)\n",
                 std::strerror(errno));
    _exit(127);
  }
  close(out_pipe[1]);
  close(err_pipe[1]);
  g_child = pid;
  // Ctrl-C goes to mpirun, which forwards it to every rank and then exits; SIGTERM / SIGUSR1 become a
  // preemption (forward_signal).
  struct sigaction sa {};
  sa.sa_handler = forward_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);

  RankOutputRelay relay(o.nproc_per_node, o.local_ranks_filter);
  struct Stream {
    int fd;
    FILE* out;
    std::string buf;
  } streams[2] = {{out_pipe[0], stdout, {}}, {err_pipe[0], stderr, {}}};
  auto emit = [&](Stream& s, const std::string& line) {
    if (auto l = relay.relay(line)) {
      std::fputs(l->c_str(), s.out);
      std::fputc('\n', s.out);
      std::fflush(s.out);
    }
  };
  int open_streams = 2;
  char chunk[65536];
  while (open_streams > 0) {
    pollfd fds[2];
    int nfds = 0;
    Stream* which[2];
    for (auto& s : streams)
      if (s.fd >= 0) {
        fds[nfds] = {s.fd, POLLIN, 0};
        which[nfds++] = &s;
      }
    if (poll(fds, nfds, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int k = 0; k < nfds; ++k) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Stream& s = *which[k];
      const ssize_t n = read(s.fd, chunk, sizeof(chunk));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        if (!s.buf.empty()) emit(s, s.buf);
        s.buf.clear();
        close(s.fd);
        s.fd = -1;
        --open_streams;
        continue;
      }
      s.buf.append(chunk, size_t(n));
      for (size_t nl; (nl = s.buf.find('\n')) != std::string::npos;) {
        emit(s, s.buf.substr(0, nl));
        s.buf.erase(0, nl + 1);
      }
    }
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  g_child = 0;
  int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (rc == kStoppedTogetherStatus) {  // a preempted training run (train/preemption.h)
    std::fprintf(stderr,
                 "titan run: the job was preempted: stopped after a step with a checkpoint; run the same "
                 "command again to resume\n");
  } else if (rc != 0) {
    if (relay.failed_rank() >= 0)
      std::fprintf(stderr,
                   "titan run: rank %d failed (%s); the job was stopped on every rank (exit status %d)\n",
                   relay.failed_rank(), relay.failure_reason().c_str(), rc);
    else
      std::fprintf(stderr, "titan run: the job failed (mpirun exit status %d)\n", rc);
  }
  return rc;
}

}  // namespace titan::dist
