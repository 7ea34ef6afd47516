// `titan run`: a torchrun-like front end that starts the ranks through OpenMPI's mpirun.
//
//   titan run --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P --hosts h1,h2]
//             [--local-ranks-filter 0,1] [--timeout S] [--dry-run] [--mpirun-arg X]... <subcommand> [args]
//
// It runs `mpirun -np N*M --oversubscribe --bind-to none --tag-output [--allow-run-as-root]
// -x OMP_NUM_THREADS=... <this titan> <subcommand> [args]` as a child, reads the ranks' output and
// rewrites OpenMPI's "[1,R]<stdout>:" tags into "[rankR]: ", keeps only the ranks of
// --local-ranks-filter (error lines always pass), forwards SIGINT/SIGTERM, and when the job fails prints
// one summary line naming the failed rank. Its exit status is mpirun's (non-zero when any rank failed).
//
// Several nodes: node 0 starts every rank over ssh (mpirun --host h1:N,h2:N), so `--hosts` lists the
// nodes; the same command on the other nodes (node rank > 0) only prints a note. Under Slurm use
// `srun titan ...` directly; `mpirun -np N titan ...` works as well (see docs/distributed.md).
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace titan::dist {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";  // exported as TITAN_MASTER_ADDR (MPI wires up by itself)
  int master_port = 29500;                // exported as TITAN_MASTER_PORT
  std::vector<std::string> hosts;         // multi-node: one host per node, node 0 first
  std::vector<int> local_ranks_filter;    // empty: every rank's output
  double timeout = -1;                    // >= 0: TITAN_DIST_TIMEOUT for the ranks (watchdog, seconds)
  std::vector<std::string> mpirun_args;   // passed to mpirun before the program
  bool dry_run = false;                   // print the mpirun command instead of running it
  bool help = false;                      // --help: launch() prints the usage
  std::vector<std::string> command;       // the titan subcommand and its arguments
};

// Parses the arguments after `titan run`. Launcher options come first; the first non-option (or what
// follows `--`) starts the subcommand. Accepts --opt value, --opt=value and torchrun's underscores.
LaunchOptions parse_launch_args(int argc, char** argv);
std::string launch_usage();

// The mpirun argv for these options (titan_exe: the binary each rank runs).
std::vector<std::string> mpirun_command(const LaunchOptions& options, const std::string& titan_exe);

// Starts the job and relays its output; returns the exit status to report.
int launch(const LaunchOptions& options);

// Rewrites mpirun's tagged output and remembers which rank failed first (unit-testable, no I/O).
class RankOutputRelay {
 public:
  RankOutputRelay(int nproc_per_node, std::vector<int> local_ranks_filter)
      : nproc_per_node_(nproc_per_node), filter_(std::move(local_ranks_filter)) {}
  // One line (without '\n') from mpirun's stdout or stderr: the line to print, or nothing when filtered.
  std::optional<std::string> relay(const std::string& line);
  // After the job: the failed rank (-1 if unknown) and a short reason.
  int failed_rank() const { return failed_rank_; }
  const std::string& failure_reason() const { return reason_; }

 private:
  void note_failure(int rank, int priority, const std::string& reason);
  int nproc_per_node_;
  std::vector<int> filter_;
  int failed_rank_ = -1, priority_ = 0;
  std::string reason_;
  int pending_process_rank_ = -1;  // "Process name: [[j,1],R]" waits for its "Exit code:" line
};

}  // namespace titan::dist
