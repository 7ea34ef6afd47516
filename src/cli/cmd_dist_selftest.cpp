// titan dist-selftest: checks every collective and the DDP/FSDP/HSDP/EP building blocks on this job's
// ranks (src/distributed/selftest.h). Run as `titan run --nproc-per-node 2 dist-selftest` or under
// mpirun/srun.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

#include "cli/command.h"
#include "core/error.h"
#include "distributed/runtime.h"
#include "distributed/selftest.h"

namespace {

int cmd_dist_selftest(int argc, char** argv) {
  titan::dist::SelftestOptions opt;
  double bench_mb = 0;
  int bench_iters = 10;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      TITAN_CHECK(i + 1 < argc, "dist-selftest: ", a, " needs a value");
      return argv[++i];
    };
    if (a == "--fail-rank")
      opt.fail_rank = std::atoi(value().c_str());
    else if (a == "--fail-mode")
      opt.fail_mode = value();
    else if (a == "--timeout")
      titan::dist::set_watchdog_timeout(std::atof(value().c_str()));
    else if (a == "--bench-mb")
      bench_mb = std::atof(value().c_str());
    else if (a == "--bench-iters")
      bench_iters = std::atoi(value().c_str());
    else if (a == "--verbose" || a == "-v")
      opt.verbose = true;
    else if (a == "--help" || a == "-h") {
      std::printf(
          "usage: titan dist-selftest [--verbose] [--timeout SECONDS] [--bench-mb MB] [--fail-rank R "
          "--fail-mode throw|exit|kill|hang]\n"
          "Runs every collective, DDP, FSDP, HSDP, clipping, sharded AdamW and the expert exchange on this\n"
          "job's ranks and checks the results. --fail-* inject a failure on rank R (tests of the failure "
          "path).\n"
          "--bench-mb MB [--bench-iters K] then times all_reduce / reduce_scatter / all_gather of MB "
          "megabytes.\n");
      return 0;
    } else {
      titan::fail("dist-selftest: unknown argument '", a, "' (see --help)");
    }
  }
  titan::dist::ProcessGroup& world = titan::dist::init();
  const auto& env = titan::dist::env();
  const int failed = titan::dist::run_selftest(world, opt, std::cerr);
  std::printf("dist-selftest: rank %d/%d (local %d/%d, node %d, %s via %s): %s\n", world.rank(), world.size(),
              env.local_rank, env.local_world_size, env.node_rank, world.backend().c_str(),
              env.launcher.c_str(), failed == 0 ? "ok" : "FAILED");
  std::fflush(stdout);
  world.barrier();
  if (world.rank() == 0)
    std::printf(failed == 0 ? "dist-selftest: all checks passed on %d rank(s)\n"
                            : "dist-selftest: %d check(s) failed\n",
                failed == 0 ? world.size() : failed);
  if (failed == 0 && bench_mb > 0)
    titan::dist::run_collective_bench(world, int64_t(bench_mb * 1e6), std::max(1, bench_iters), std::cout);
  return failed == 0 ? 0 : 1;
}

}  // namespace

TITAN_COMMAND("dist-selftest", "check collectives and data-parallel building blocks on this job's ranks",
              cmd_dist_selftest);
