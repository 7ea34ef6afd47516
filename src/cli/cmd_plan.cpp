// titan plan [--config FILE|NAME] [--nproc N] [--gpu h100|h200|b200] [--section.key=value ...]
// The plan of a run for N ranks (parameters, FLOPs/token, memory per rank) without allocating it; with
// --gpu, the roofline prediction of its step on that GPU (train/roofline.h).
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cli/command.h"
#include "core/error.h"
#include "train/config.h"
#include "train/plan.h"
#include "train/roofline.h"
#include "train/trainer.h"

namespace {

int plan_main(int argc, char** argv) {
  int64_t nproc = 1;
  std::string gpu;
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf(
          "usage: titan plan [--config FILE|NAME] [--nproc N] [--gpu h100|h200|b200] [--section.key=value "
          "...]\n"
          "  --gpu: also predict the step on that GPU from each op class's FLOPs and bytes (roofline)\n");
      return 0;
    }
    if (a == "--gpu" || a.starts_with("--gpu=")) {
      gpu = a.find('=') != std::string::npos ? a.substr(a.find('=') + 1) : (i + 1 < argc ? argv[++i] : "");
      titan::gpu_spec(gpu);  // an unknown name is an error before anything else
      continue;
    }
    if (a == "--nproc" || a.starts_with("--nproc=")) {
      std::string v =
          a.find('=') != std::string::npos ? a.substr(a.find('=') + 1) : (i + 1 < argc ? argv[++i] : "");
      nproc = std::atoll(v.c_str());
      TITAN_CHECK(nproc >= 1, "--nproc must be a positive integer, got '", v, "'");
      continue;
    }
    args.push_back(a);
  }
  titan::TrainConfig cfg = titan::parse_train_args(args);
  titan::Qwen3Config mc = titan::resolve_model_config(cfg);
  const int64_t rep = cfg.parallelism.data_parallel_replicate_degree;
  TITAN_CHECK(nproc % rep == 0, "--nproc ", nproc, " is not a multiple of data_parallel_replicate_degree ",
              rep);
  const auto& par = cfg.parallelism;
  const int64_t tp = par.tensor_parallel_degree, pp = par.pipeline_parallel_degree,
                cp = par.context_parallel_degree;
  const int64_t fixed = rep * tp * pp * cp;
  TITAN_CHECK(nproc % fixed == 0, "--nproc ", nproc,
              " is not a multiple of data_parallel_replicate_degree x tensor_parallel_degree x "
              "pipeline_parallel_degree x context_parallel_degree = ",
              fixed);
  const int64_t shard = par.data_parallel_shard_degree > 0 ? par.data_parallel_shard_degree : nproc / fixed;
  auto plan = titan::make_plan(
      mc, nproc, rep, shard, cfg.training.local_batch_size, cfg.training.global_batch_size,
      cfg.training.seq_len, cfg.activation_checkpoint.policy(), par.expert_parallel_degree, tp,
      par.enable_sequence_parallel, par.pipeline(), cp, cfg.training.mixed_precision_param == "bfloat16");
  std::printf("%s\n", plan.describe().c_str());
  if (!gpu.empty()) {
    TITAN_CHECK(pp == 1 && cp == 1, "--gpu: the roofline predicts layouts without pipeline or context ",
                "parallel (parallelism.pipeline_parallel_degree = ", pp, ", context_parallel_degree = ", cp,
                ")");
    const auto pred =
        titan::predict_gpu_step(mc, plan, cfg.activation_checkpoint.policy(), titan::gpu_spec(gpu),
                                cfg.training.mixed_precision_param == "bfloat16");
    std::printf("%s\n", pred.describe().c_str());
  }
  return 0;
}

}  // namespace

TITAN_COMMAND("plan", "parameters, FLOPs/token and memory per rank of a config for N ranks", plan_main);
