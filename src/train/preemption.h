// Preemption: SIGTERM (Kubernetes' termination, Slurm at the end of a job) or SIGUSR1 (Slurm's
// `--signal=USR1@T`) asks a training run to stop cleanly: every rank finishes the step it is in, the ranks
// agree on the step (an all-reduce of the flag after each step), a training checkpoint of that step is
// saved (checkpoint.enable), and `titan train` exits with status kPreemptedExitStatus; started again it
// resumes from that checkpoint, bit-exactly. A second signal ends the process at once (status 128 + signal).
//
// Fault injection for tests: TITAN_FAULT_INJECT=signal:<TERM|USR1>[*2]@<step>[:rank<r>] raises the signal
// (twice with *2) in the process (of rank r only, with :rank<r>) at the end of that step.
#pragma once
#include <cstdint>

#include "distributed/runtime.h"

namespace titan {

constexpr int kPreemptedExitStatus = dist::kStoppedTogetherStatus;  // 75, EX_TEMPFAIL: "try again later"

// While alive, SIGTERM and SIGUSR1 request a stop instead of ending the process; the previous handlers
// come back after.
class PreemptionGuard {
 public:
  PreemptionGuard();
  ~PreemptionGuard();
  PreemptionGuard(const PreemptionGuard&) = delete;
  PreemptionGuard& operator=(const PreemptionGuard&) = delete;

  bool requested() const;  // a signal arrived in this process
  // TITAN_FAULT_INJECT=signal:...: raises the signal when `step` (and `rank`) match.
  static void inject_fault(int64_t step, int rank);
};

}  // namespace titan
