// Distributed self-test (`titan dist-selftest`): runs every collective and every data-parallel building
// block on the current world and checks the results against values computed locally (like a
// torch.distributed sanity check). Used by CI under `mpirun -np 2/4` and by users to check a cluster.
#pragma once
#include <iosfwd>
#include <string>

#include "distributed/process_group.h"

namespace titan::dist {

struct SelftestOptions {
  // Failure injection (tests of the failure path): rank `fail_rank` fails with `fail_mode` right after
  // start-up, while the other ranks wait in a collective. Modes: throw (titan::Error), exit (exit code
  // 3 without MPI_Finalize), kill (SIGKILL itself), hang (sleeps forever: the watchdog must fire).
  int fail_rank = -1;
  std::string fail_mode = "throw";
  bool verbose = false;  // one line per check
};

// Runs the checks; returns the number of failed checks summed over all ranks (the same on every rank).
// Failures are reported on `log` as "[rank R] FAIL <check>: <detail>".
int run_selftest(ProcessGroup& world, const SelftestOptions& options, std::ostream& log);

// Times all_reduce, reduce_scatter and all_gather of `bytes` of f32 (mean of `iters` after a warm-up),
// with the watchdog on (non-blocking MPI, polled) and off (blocking MPI); rank 0 prints one line per
// collective with its time and bus bandwidth (nccl-tests convention). Collective.
void run_collective_bench(ProcessGroup& world, int64_t bytes, int iters, std::ostream& out);

}  // namespace titan::dist
