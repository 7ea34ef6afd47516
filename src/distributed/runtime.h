// Distributed runtime: rank detection, MPI initialisation, the world group, the watchdog and the
// error path that turns one rank's failure into a job-wide, bounded, named failure.
//
// Rank detection reads the launcher's environment (first match wins):
//   OpenMPI (mpirun, titan run):  OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE
//   PMI / PMIx (MPICH, srun):     PMI_RANK / PMI_SIZE, PMIX_RANK, MPI_LOCALRANKID
//   Slurm step (srun):            SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID / SLURM_NODEID
// Without any of them the process is alone: world 1, SingleProcessGroup, MPI is never initialised
// (an MPI singleton init may try to start a daemon, which is slow or impossible in containers).
// When a launcher is found, MPI_Init_thread(FUNNELED) runs and MPI's own rank/size are authoritative.
//
// Failure semantics (docs/distributed.md):
//   - a rank that throws: main() calls report_fatal_error(): "[rank R] titan <cmd>: error: ..." on
//     stderr, then MPI_Abort, which makes mpirun kill every rank (exit status non-zero);
//   - a rank that exits non-zero or dies by a signal: mpirun kills the others and names the rank;
//   - a rank that hangs (never arrives at a collective): the others' watchdog fires after
//     TITAN_DIST_TIMEOUT seconds (default 600, 0 = off), names the rank(s) missing and aborts.
#pragma once
#include <string>

#include "distributed/process_group.h"

namespace titan::dist {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  std::string launcher = "none";  // "openmpi", "pmi", "slurm" or "none"
  bool launched() const { return launcher != "none"; }
};

// What the environment says (no MPI calls).
DistEnv detect_env();

// Initialises the distributed runtime once (later calls return the same group) and returns the world
// group. Under a launcher this is a MPI group even for one rank; otherwise a SingleProcessGroup.
ProcessGroup& init();
bool initialized();
// The world group (calls init() if needed).
ProcessGroup& world();
// Rank facts after init() (before: from the environment). local_rank counts ranks on this node.
const DistEnv& env();
// True when MPI was initialised by init() and not yet finalised.
bool mpi_active();

// Clean shutdown: a watched barrier (so a rank that hangs cannot make the others hang in
// MPI_Finalize) then MPI_Finalize. Only call on success; on failure call abort_job().
void finalize();

// Kills the whole job now: prints `message` (if not empty) to stderr, then MPI_Abort(code) under MPI
// or exit(code) alone. Never returns.
[[noreturn]] void abort_job(const std::string& message, int code = 1);

// Watchdog timeout in seconds for every collective of MPI groups; 0 disables it (collectives then
// use the blocking MPI calls). Initial value from TITAN_DIST_TIMEOUT, default 600 (torch's NCCL
// default of 10 minutes).
double watchdog_timeout();
void set_watchdog_timeout(double seconds);

// The MPI library's version line (e.g. "Open MPI v4.1.4, ..."); callable before init (for `titan env`).
std::string mpi_library_version();

// "[rank R] " when the job has more than one rank, "" otherwise: the prefix of error messages.
std::string rank_prefix();

// ---- hooks for main() ----
// Called with a command's exception message: in a multi-rank job prints
// "[rank R] titan <command>: error: <what>" and aborts the job (never returns); in a single process
// returns so main prints its usual line.
void report_fatal_error(const char* command, const char* what);
// The status every rank of a job returns together when they stopped at the same point on purpose (a
// preempted training run: train/preemption.h): not a failure, so the ranks finalize and exit with it.
constexpr int kStoppedTogetherStatus = 75;  // EX_TEMPFAIL: "try again later"
// Called with a command's return code: 0 or kStoppedTogetherStatus -> finalize() and that status; another
// non-zero status in a multi-rank job -> abort the job naming this rank (a plain exit would leave the others
// waiting in a collective).
int finish_command(const char* command, int rc);

}  // namespace titan::dist
