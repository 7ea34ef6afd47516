// titan train [--config FILE|NAME] [--dry-run] [--section.key=value ...]
// With no arguments: the embedded default run (debug flavor on the fortunes corpus).
#include <cstdio>
#include <cstring>

#include "cli/command.h"
#include "train/config.h"
#include "train/preemption.h"
#include "train/trainer.h"

namespace {

int train_main(int argc, char** argv) {
  if (argc > 1 && (!std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h"))) {
    std::printf(
        "usage: titan train [--config FILE|NAME] [--dry-run] [--section.key=value ...]\n\n"
        "Trains a Qwen3 model. Sections (torchtitan names): job, model, optimizer, lr_scheduler, training,\n"
        "validation, parallelism, checkpoint, metrics, compile, kernels, activation_checkpoint. With no\n"
        "arguments it runs the embedded default: the debug flavor with a BPE tokenizer trained on the\n"
        "fortunes corpus, validated on 1%% of it held out.\n"
        "--dry-run validates the config and prints the plan (parameters, FLOPs/token, memory per rank).\n"
        "SIGTERM or SIGUSR1 stops the run after the current step with a checkpoint (checkpoint.enable) and\n"
        "exit status 75; the same command resumes it. A second signal stops at once.\n");
    return 0;
  }
  std::vector<std::string> args(argv + 1, argv + argc);
  titan::TrainConfig config = titan::parse_train_args(args);
  const titan::TrainResult result = titan::run_training(config);
  // Preempted (SIGTERM / SIGUSR1): a distinct status, so a job script or scheduler can requeue the run.
  return result.preempted_at > 0 ? titan::kPreemptedExitStatus : 0;
}

}  // namespace

TITAN_COMMAND("train", "train a model (no arguments: the embedded default run)", train_main);
