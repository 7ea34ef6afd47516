// titan run: torchrun-like launcher over mpirun (src/distributed/launcher.h).
#include "cli/command.h"
#include "distributed/launcher.h"

namespace {
int cmd_run(int argc, char** argv) {
  return titan::dist::launch(titan::dist::parse_launch_args(argc - 1, argv + 1));
}
}  // namespace

TITAN_COMMAND("run", "start N ranks of a subcommand through mpirun (torchrun-like)", cmd_run);
