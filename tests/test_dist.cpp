// Distributed: single-process collectives and sharding math, the launcher's argument and output
// handling, and multi-rank runs under mpirun (dist-selftest checks every collective, DDP, FSDP, HSDP,
// clipping, sharded AdamW and the expert exchange against 1-rank references) including failures.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "device/device.h"
#include "distributed/data_parallel.h"
#include "distributed/data_parallel_plan.h"
#include "distributed/expert_parallel.h"
#include "distributed/launcher.h"
#include "distributed/nccl.h"
#include "distributed/runtime.h"
#include "distributed/selftest.h"
#include "io/safetensors.h"
#include "models/qwen3/model.h"
#include "optim/optimizer.h"
#include "support/testing.h"

namespace titan::dist {
namespace {

namespace fs = std::filesystem;

// Reports a chosen rank and size without communicating: for the sharding arithmetic of rank r of N.
class FakeGroup final : public ProcessGroup {
 public:
  FakeGroup(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank_of(int r) const override { return r; }
  std::string backend() const override { return "fake"; }
  void all_reduce(void*, int64_t, CommType, ReduceOp) override { fail("fake group: no collectives"); }
  void reduce_scatter(const void*, void*, const std::vector<int64_t>&, CommType, ReduceOp) override {
    fail("fake group: no collectives");
  }
  void all_gather(const void*, void*, const std::vector<int64_t>&, CommType) override {
    fail("fake group: no collectives");
  }
  void broadcast(void*, int64_t, CommType, int) override { fail("fake group: no collectives"); }
  void all_to_all(const void*, void*, int64_t, CommType) override { fail("fake group: no collectives"); }
  void all_to_all_v(const void*, const std::vector<int64_t>&, void*, const std::vector<int64_t>&,
                    CommType) override {
    fail("fake group: no collectives");
  }
  void barrier() override {}
  std::shared_ptr<ProcessGroup> split(int, int) override { return nullptr; }

 private:
  int rank_, size_;
};

Tensor iota(int64_t n, float start = 0) {
  Tensor t = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i) t.f32()[i] = start + float(i);
  return t;
}

TEST(DistSingle, InitWithoutLauncherIsOneRankWithoutMpi) {
  if (detect_env().launched()) GTEST_SKIP() << "the unit tests run without a launcher";
  ProcessGroup& w = init();
  EXPECT_EQ(w.size(), 1);
  EXPECT_EQ(w.rank(), 0);
  EXPECT_EQ(w.backend(), "single");
  EXPECT_FALSE(mpi_active());
  EXPECT_EQ(rank_prefix(), "");
  EXPECT_EQ(&world(), &w);
  EXPECT_NE(mpi_library_version().find("MPI"), std::string::npos);
}

TEST(DistSingle, CollectivesAreIdentities) {
  SingleProcessGroup g;
  std::vector<float> f = {1, 2, 3};
  g.all_reduce(f.data(), 3, ReduceOp::Avg);
  EXPECT_EQ(f, (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(g.all_reduce(2.5, ReduceOp::Sum), 2.5);
  std::vector<float> out(3);
  g.reduce_scatter(f.data(), out.data(), {3}, CommType::F32, ReduceOp::Sum);
  EXPECT_EQ(out, f);
  std::vector<float> gathered(3);
  g.all_gather(f.data(), gathered.data(), {3}, CommType::F32);
  EXPECT_EQ(gathered, f);
  std::vector<int64_t> a = {4, 5}, b(2);
  g.all_to_all(a.data(), b.data(), 2, CommType::I64);
  EXPECT_EQ(b, a);
  g.all_to_all_v(a.data(), {2}, b.data(), {2}, CommType::I64);
  EXPECT_EQ(b, a);
  g.broadcast(f.data(), 3, CommType::F32, 0);
  EXPECT_THROW(g.broadcast(f.data(), 3, CommType::F32, 1), Error);
  uint16_t h[2] = {1, 2};
  EXPECT_THROW(g.all_reduce(h, 2, CommType::BF16, ReduceOp::Sum), Error);  // bf16 only moves
  EXPECT_EQ(g.split(0, 0)->size(), 1);
}

TEST(DistSingle, SelftestPassesOnOneRank) {
  SingleProcessGroup g;
  std::ostringstream log;
  EXPECT_EQ(run_selftest(g, SelftestOptions{}, log), 0) << log.str();
}

TEST(DistSharding, ShardSizesOffsetsAndPadding) {
  // 10 elements over 4 ranks: shards of 3, the last one holds 1 real element and 2 of padding.
  const int64_t expect_valid[4] = {3, 3, 3, 1};
  for (int r = 0; r < 4; ++r) {
    FakeGroup g(r, 4);
    FsdpShards s(g, {iota(10, 1), iota(5, 100)}, {Tensor::zeros({10}), Tensor::zeros({5})});
    EXPECT_EQ(s.shard_numel(0), 3);
    EXPECT_EQ(s.shard_offset(0), 3 * r);
    EXPECT_EQ(s.shard_valid(0), expect_valid[r]);
    // 5 over 4: shards of 2; rank 3 owns nothing.
    EXPECT_EQ(s.shard_numel(1), 2);
    EXPECT_EQ(s.shard_valid(1), std::vector<int64_t>({2, 2, 1, 0})[r]);
    const float* p = s.shard_params()[0].f32();
    for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(p[i], i < expect_valid[r] ? float(1 + 3 * r + i) : 0.0f);
    EXPECT_EQ(s.shard_params()[0].numel(), 3);
  }
}

TEST(DistSharding, OneRankGatherAndReduceScatterRoundTrip) {
  SingleProcessGroup g;
  Tensor p = iota(7), grad = iota(7, 10);
  FsdpShards s(g, {p}, {grad});
  EXPECT_EQ(s.shard_numel(0), 7);
  s.shard_params()[0].f32()[2] = 42;
  s.gather_params(0);
  EXPECT_EQ(p.f32()[2], 42);
  s.reduce_scatter_grads(0);
  EXPECT_EQ(s.shard_grads()[0].f32()[6], 16);
  s.reduce_scatter_grads(0, /*accumulate=*/true);
  EXPECT_EQ(s.shard_grads()[0].f32()[6], 32);
}

TEST(DistSharding, OwnedBuffersAreReleasedAndReused) {
  SingleProcessGroup g;
  FsdpShards s(g, std::vector<int64_t>{8, 8, 6});
  s.load_shards({iota(8), iota(8, 100), iota(6, 200)});
  s.gather_params(0);
  const float* first = s.full_params(0).f32();
  EXPECT_EQ(first[3], 3);
  s.release_params(0);
  s.gather_params(1);  // same size: the released buffer comes back
  EXPECT_EQ(s.full_params(1).f32(), first);
  EXPECT_EQ(s.full_params(1).f32()[3], 103);
  s.release_params(1);
  s.gather_params(2);  // smaller: re-uses it too
  EXPECT_EQ(s.full_params(2).f32(), first);
  EXPECT_EQ(s.full_params(2).f32()[5], 205);
  Tensor fg = s.full_grads(2);  // a fresh zeroed gradient buffer
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(fg.f32()[i], 0);
}

TEST(DistSharding, ShardedAdamWOnOneRankEqualsAdamW) {
  SingleProcessGroup g;
  Tensor p = iota(9, -4), grad = iota(9, 1), p_ref = p.clone(), g_ref = grad.clone();
  FsdpShards s(g, {p}, {grad});
  s.reduce_scatter_all_grads();
  AdamW sharded(s.shard_params(), s.shard_grads(), AdamWConfig{});
  AdamW full({p_ref}, {g_ref}, AdamWConfig{});
  sharded.step(1e-2f);
  full.step(1e-2f);
  s.gather_all_params();
  EXPECT_LT(testing::rel_error(p, p_ref), 1e-7);
}

TEST(DistDdp, BucketsCoalesceSmallAndChunkLargeBuffers) {
  SingleProcessGroup g;
  // 40-byte buckets (10 floats): {3, 4} share one, 25 -> 3 chunks, {2} alone.
  std::vector<Tensor> grads = {iota(3), iota(4), iota(25), iota(2)};
  DdpReducer ddp(g, grads, 40);
  EXPECT_EQ(ddp.num_buckets(), 5);
  ddp.all_reduce_mean();
  EXPECT_EQ(grads[2].f32()[24], 24);
  EXPECT_EQ(grads[1].f32()[3], 3);
  EXPECT_THROW(DdpReducer(g, {Tensor::zeros({2}, DType::BF16)}), Error);
}

TEST(DistPlan, DegreesChooseTheLayout) {
  SingleProcessGroup g;
  Tensor p = iota(5), grad = iota(5, 1);
  DataParallelPlan one(g, 1, -1, {p}, {grad});
  EXPECT_STREQ(one.mode(), "single");
  EXPECT_EQ(one.optimizer_params()[0].raw(), p.raw());  // full buffers, no copies
  EXPECT_EQ(one.grad_shard_group(), nullptr);
  one.reduce_grads();
  EXPECT_NEAR(one.clip_grad_norm(0), std::sqrt(1 + 4 + 9 + 16 + 25.0), 1e-9);
  EXPECT_THROW(DataParallelPlan(g, 2, -1, {p}, {grad}), Error);
  EXPECT_THROW(DataParallelPlan(g, 1, 2, {p}, {grad}), Error);
}

TEST(DistClip, ReplicatedNormEqualsLocalClipping) {
  Tensor a = Tensor::from_vector({3, 0}, {2}), b = Tensor::from_vector({4}, {1});
  std::vector<Tensor> grads{a, b};
  EXPECT_DOUBLE_EQ(clip_grad_norm(grads, 1.0, nullptr), 5.0);
  EXPECT_NEAR(std::sqrt(grad_sq_norm(grads)), 1.0, 1e-5);
  SingleProcessGroup g;
  EXPECT_NEAR(global_grad_norm(grads, &g), 1.0, 1e-5);
}

TEST(DistExpert, GroupRowsByDestinationIsStable) {
  auto [order, counts] = group_rows_by_destination({2, 0, 2, 1, 0}, 3);
  EXPECT_EQ(order, (std::vector<int64_t>{1, 4, 3, 0, 2}));
  EXPECT_EQ(counts, (std::vector<int64_t>{2, 1, 2}));
  EXPECT_THROW(group_rows_by_destination({3}, 3), Error);
}

TEST(DistEnv, DetectsLaunchersFromEnvironment) {
  auto with = [](std::vector<std::pair<const char*, const char*>> vars) {
    for (auto& [k, v] : vars) setenv(k, v, 1);
    DistEnv e = detect_env();
    for (auto& [k, v] : vars) unsetenv(k);
    return e;
  };
  DistEnv o = with({{"OMPI_COMM_WORLD_RANK", "5"},
                    {"OMPI_COMM_WORLD_SIZE", "8"},
                    {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(o.launcher, "openmpi");
  EXPECT_EQ(o.rank, 5);
  EXPECT_EQ(o.world_size, 8);
  EXPECT_EQ(o.local_rank, 1);
  EXPECT_EQ(o.node_rank, 1);
  DistEnv p = with({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"}});
  EXPECT_EQ(p.launcher, "pmi");
  EXPECT_EQ(p.rank, 3);
  EXPECT_EQ(p.world_size, 4);
  EXPECT_EQ(p.local_rank, 1);
  DistEnv s = with(
      {{"SLURM_PROCID", "2"}, {"SLURM_STEP_NUM_TASKS", "6"}, {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "2"}});
  EXPECT_EQ(s.launcher, "slurm");
  EXPECT_EQ(s.rank, 2);
  EXPECT_EQ(s.world_size, 6);
  EXPECT_EQ(s.node_rank, 2);
  // An sbatch script outside srun is one process.
  EXPECT_FALSE(with({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}}).launched());
}

std::vector<char*> argv_of(std::vector<std::string>& args) {
  std::vector<char*> v;
  for (auto& a : args) v.push_back(a.data());
  return v;
}

TEST(DistLauncher, ParsesTorchrunStyleArguments) {
  std::vector<std::string> args = {
      "--nproc_per_node=4",   "--nnodes", "2",         "--node-rank", "0",     "--hosts", "a,b",
      "--local-ranks-filter", "0,2",      "--timeout", "30",          "train", "--steps", "3"};
  auto argv = argv_of(args);
  LaunchOptions o = parse_launch_args(int(argv.size()), argv.data());
  EXPECT_EQ(o.nproc_per_node, 4);
  EXPECT_EQ(o.nnodes, 2);
  EXPECT_EQ(o.hosts, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(o.local_ranks_filter, (std::vector<int>{0, 2}));
  EXPECT_EQ(o.command, (std::vector<std::string>{"train", "--steps", "3"}));
  auto cmd = mpirun_command(o, "/bin/titan");
  std::string line;
  for (auto& a : cmd) line += a + " ";
  EXPECT_NE(line.find("mpirun -np 8 --oversubscribe --bind-to none --tag-output"), std::string::npos) << line;
  EXPECT_NE(line.find("--host a:4,b:4"), std::string::npos) << line;
  EXPECT_NE(line.find("-x OMP_NUM_THREADS="), std::string::npos) << line;
  EXPECT_NE(line.find("-x TITAN_DIST_TIMEOUT=30"), std::string::npos) << line;
  EXPECT_NE(line.find("/bin/titan train --steps 3"), std::string::npos) << line;

  std::vector<std::string> bad = {"--nproc-per-node", "x", "train"};
  auto bv = argv_of(bad);
  EXPECT_THROW(parse_launch_args(int(bv.size()), bv.data()), Error);
  std::vector<std::string> none = {"--nproc-per-node", "2"};
  auto nv = argv_of(none);
  EXPECT_THROW(parse_launch_args(int(nv.size()), nv.data()), Error);
}

TEST(DistLauncher, RelayPrefixesFiltersAndFindsTheFailedRank) {
  RankOutputRelay relay(2, {0});
  EXPECT_EQ(relay.relay("[1,0]<stdout>:step 1 loss 3.2").value(), "[rank0]: step 1 loss 3.2");
  EXPECT_FALSE(relay.relay("[1,1]<stdout>:step 1 loss 3.2").has_value());  // local rank 1 filtered
  EXPECT_EQ(relay.relay("[1,2]<stderr>:x").value(), "[rank2]: x");         // local rank 0 of node 1
  // Errors always pass and name the failed rank.
  EXPECT_EQ(relay.relay("[1,1]<stderr>:[rank 1] titan train: error: boom").value(),
            "[rank1]: [rank 1] titan train: error: boom");
  EXPECT_EQ(relay.failed_rank(), 1);
  EXPECT_EQ(relay.relay("MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD").value(),
            "MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD");

  RankOutputRelay exited(2, {});
  exited.relay("  Process name: [[12274,1],3]");
  exited.relay("  Exit code:    3");
  EXPECT_EQ(exited.failed_rank(), 3);
  EXPECT_EQ(exited.failure_reason(), "exit code 3");

  RankOutputRelay hang(2, {});
  hang.relay("[1,0]<stderr>:[rank 0] error: watchdog: all_reduce ... rank 1 did not arrive (hung)");
  EXPECT_EQ(hang.failed_rank(), 1);
}

// ---- multi-rank runs (mpirun as a child, bounded by `timeout 60`) ----

struct RunResult {
  int rc;
  std::string output;
  double seconds;
};

RunResult run_shell(const std::string& cmd) {
  const auto start = std::chrono::steady_clock::now();
  testing::ShellResult sr = testing::run_shell_command(cmd);
  return RunResult{sr.rc, sr.output,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
}

const std::string kTitan = TITAN_BINARY;

TEST(DistMpi, SelftestOnTwoRanks) {
  RunResult r = run_shell("timeout 60 mpirun --oversubscribe -np 2 " + kTitan + " dist-selftest --verbose");
  EXPECT_EQ(r.rc, 0) << r.output;
  // Every building block was checked on both ranks.
  for (const char* check : {"ok   all_reduce f32 avg",
                            "ok   all_reduce f64 max",
                            "ok   reduce_scatter (uneven)",
                            "ok   all_gather (uneven)",
                            "ok   broadcast f64",
                            "ok   all_to_all_v f32",
                            "ok   ddp bucketed all-reduce = mean",
                            "ok   fsdp reduce-scattered gradients = 1-rank gradient shards",
                            "ok   sharded AdamW = unsharded AdamW",
                            "ok   fsdp global grad norm (shard sums) = 1-rank norm",
                            "ok   ddp global grad norm = 1-rank norm",
                            "ok   hsdp reduce-scatter + replica average",
                            "ok   expert exchange backward",
                            "ok   plan fsdp: 1 replica(s) x 2 shard(s)",
                            "ok   expert parallel 2: expert slice initialises as the full model",
                            "ok   expert parallel 2: loss",
                            "ok   expert parallel 2: expert gradients (the group's tokens)",
                            "ok   expert parallel 2: reduced gradients = DDP gradients",
                            "ok   tensor parallel 2: loss",
                            "ok   tensor parallel 2: gradients = slices of the full gradients",
                            "ok   tensor parallel 2: global grad norm",
                            "ok   tensor parallel 2: 5 clipped AdamW steps: losses",
                            "ok   tensor parallel 2 moe: gradients = slices of the full gradients",
                            "ok   tensor parallel 2: selective op checkpointing gives the same gradients"})
    for (const char* rank : {"[rank 0] ", "[rank 1] "})
      EXPECT_NE(r.output.find(std::string(rank) + check), std::string::npos) << rank << check << "\n"
                                                                             << r.output;
  EXPECT_NE(r.output.find("all checks passed on 2 rank(s)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 1/2 (local 1/2, node 0, mpi via openmpi): ok"), std::string::npos)
      << r.output;
}

TEST(DistMpi, SelftestOnFourRanks) {
  // Four ranks: uneven shards, HSDP 2 x 2 mesh, all_to_all_v with empty blocks.
  RunResult r = run_shell("timeout 60 mpirun --oversubscribe -np 4 " + kTitan + " dist-selftest");
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("all checks passed on 4 rank(s)"), std::string::npos) << r.output;
}

TEST(DistMpi, SelftestOnThreeRanks) {
  RunResult r = run_shell("timeout 60 mpirun --oversubscribe -np 3 " + kTitan + " dist-selftest");
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("all checks passed on 3 rank(s)"), std::string::npos) << r.output;
}

TEST(DistMpi, SelftestWithoutWatchdogUsesBlockingCollectives) {
  RunResult r =
      run_shell("TITAN_DIST_TIMEOUT=0 timeout 60 mpirun --oversubscribe -np 2 " + kTitan + " dist-selftest");
  EXPECT_EQ(r.rc, 0) << r.output;
}

TEST(DistRun, PrefixesAndFiltersRanks) {
  RunResult r = run_shell("timeout 60 " + kTitan + " run --nproc-per-node 2 dist-selftest");
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("[rank1]: dist-selftest: rank 1/2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank0]: dist-selftest: all checks passed on 2 rank(s)"), std::string::npos)
      << r.output;
  RunResult f =
      run_shell("timeout 60 " + kTitan + " run --nproc-per-node 2 --local-ranks-filter 0 dist-selftest");
  EXPECT_EQ(f.rc, 0) << f.output;
  EXPECT_NE(f.output.find("[rank0]: dist-selftest: all checks passed"), std::string::npos) << f.output;
  EXPECT_EQ(f.output.find("[rank1]:"), std::string::npos) << f.output;
}

TEST(DistRun, DryRunPrintsTheMpirunCommand) {
  RunResult r = run_shell(kTitan + " run --nproc-per-node 3 --dry-run forward --help");
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("mpirun -np 3 --oversubscribe --bind-to none"), std::string::npos) << r.output;
}

// Every failure mode: non-zero exit, a message naming rank 1, well within 60 s.
void expect_job_fails(const std::string& mode, const std::string& extra = "") {
  RunResult r = run_shell("timeout 60 " + kTitan + " run --nproc-per-node 2 " + extra +
                          " dist-selftest --fail-rank 1 --fail-mode " + mode);
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.rc, 124) << "the job hung: " << r.output;
  EXPECT_NE(r.output.find("titan run: rank 1 failed"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 60) << r.output;
}

TEST(DistFailure, RankThrows) {
  expect_job_fails("throw");
}
TEST(DistFailure, RankExitsNonZero) {
  expect_job_fails("exit");
}
TEST(DistFailure, RankIsKilled) {
  expect_job_fails("kill");
}
TEST(DistFailure, RankHangsAndTheWatchdogNamesIt) {
  expect_job_fails("hang", "--timeout 3");
}

TEST(DistFailure, ThrowUnderPlainMpirunNamesTheRank) {
  RunResult r = run_shell("timeout 60 mpirun --oversubscribe -np 2 " + kTitan +
                          " dist-selftest --fail-rank 1 --fail-mode throw");
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.rc, 124) << r.output;
  EXPECT_NE(r.output.find("[rank 1] titan dist-selftest: error: injected failure"), std::string::npos)
      << r.output;
}

// ---- `titan train` runs on several ranks ----

// The arguments every multi-rank `titan train` below shares (global batch 4 of 32 tokens, the small
// tokenizer), its corpus written into `tmp`.
std::string train_args(const testing::TempDir& tmp, int steps) {
  {
    std::ofstream f(tmp / "corpus.txt");
    for (int i = 0; i < 200; ++i) f << "the quick brown fox " << i << " jumps over the lazy dog.\n%\n";
  }
  return " --training.dataset=" + (tmp / "corpus.txt") +
         " --model.tokenizer_path=" + testing::source_path("tests/golden/tokenizer/small") +
         " --model.vocab_size=1024 --training.seq_len=32 --training.steps=" + std::to_string(steps) +
         " --training.sample_tokens=0 --lr_scheduler.warmup_steps=2 --metrics.peak_tflops=1"
         " --training.global_batch_size=4 --training.val_fraction=0 --validation.enable=false";
}

// 2 steps with validation after each on the held-out tenth of train_args' corpus (3 batches). Which documents
// are held out depends on the corpus' path (a new temporary folder each run), and the f32 differences
// between two layouts grow with every AdamW step (about tenfold from step 3 to step 4, up to 1e-5 relative
// in the validation loss on some splits): the validation losses are compared after the first two steps.
const std::string kValidationArgs =
    " --training.steps=2 --training.val_fraction=0.1 --validation.enable=true"
    " --validation.freq=1 --validation.steps=3 --training.local_batch_size=4";

// Random debug-flavor weights (vocabulary 1024) as an HF checkpoint in tmp/hf; the arguments that start a run
// from them.
std::string write_debug_hf(const testing::TempDir& tmp) {
  Qwen3Config c = Qwen3Config::flavor("debug");
  c.vocab_size = 1024;
  Qwen3Model m(c);
  m.init_weights(5);
  m.save_hf(tmp / "hf", DType::F32);
  return " --checkpoint.initial_load_path=" + (tmp / "hf");
}

// ---- expert parallel through `titan train` ----

using testing::jsonl_losses;

// Every step's loss of run `name` within 1e-5 relative of the 1-rank run `ref_name`'s (`steps` each, in tmp);
// *max_rel: the largest relative difference (-1 where the runs' step counts do not fit).
void expect_losses_match(const testing::TempDir& tmp, const std::string& ref_name, const std::string& name,
                         size_t steps, double* max_rel) {
  *max_rel = -1;
  const auto ref = jsonl_losses(tmp / (ref_name + "/metrics.jsonl"));
  const auto got = jsonl_losses(tmp / (name + "/metrics.jsonl"));
  ASSERT_EQ(ref.size(), steps) << ref_name;
  ASSERT_EQ(got.size(), ref.size()) << name;
  double m = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_NEAR(got[i], ref[i], 1e-5 * ref[i]) << name << " step " << i + 1;
    m = std::max(m, std::abs(got[i] - ref[i]) / ref[i]);
  }
  *max_rel = m;
}

// The same tensors in two safetensors files (run `name`'s `have` against the reference's `want`); *worst: the
// largest relative L2 difference of a tensor (-1 where the files' tensors do not fit).
void expect_same_tensors(const std::string& want_path, const std::string& have_path, const std::string& name,
                         double* worst) {
  *worst = -1;
  SafetensorsFile want(want_path), have(have_path);
  ASSERT_EQ(have.entries().size(), want.entries().size()) << name;
  double w = 0;
  for (auto& [key, e] : want.entries()) {
    ASSERT_TRUE(have.contains(key)) << name << ": " << key;
    Tensor a = have.load(key), b = want.load(key);
    ASSERT_EQ(a.shape(), b.shape()) << key;
    w = std::max(w, testing::rel_error(a, b));
  }
  *worst = w;
}

// A parallel run `name` against the 1-rank run `ref` (both 10 steps in tmp): the loss of every step within
// 1e-5 relative, and the HF export of step 10 with the same tensors, each within 1e-4 (relative L2).
void expect_run_matches(const testing::TempDir& tmp, const std::string& ref_name, const std::string& name,
                        size_t steps = 10) {
  double max_rel = 0, max_param_rel = 0;
  expect_losses_match(tmp, ref_name, name, steps, &max_rel);
  if (max_rel < 0) return;
  std::printf("%s: max relative loss difference to 1 rank over %zu steps: %.3g\n", name.c_str(), steps,
              max_rel);
  const std::string last = "/checkpoint/step-" + std::to_string(steps) + "/model.safetensors";
  expect_same_tensors(tmp / (ref_name + last), tmp / (name + last), name, &max_param_rel);
  if (max_param_rel < 0) return;
  std::printf("%s: max relative parameter difference (per tensor, L2) after %zu steps: %.3g\n", name.c_str(),
              steps, max_param_rel);
  EXPECT_LE(max_param_rel, 1e-4) << name;
}

// The LoRA runs of the distributed LoRA tests (10 steps, checkpoints every 5) and their two bases: f32 with
// dropout, bf16 without.
std::string lora_train_args(const testing::TempDir& tmp) {
  return train_args(tmp, 10) +
         " --model.flavor=debug --optimizer.lr=1e-3 --lora.enable=true --lora.rank=4"
         " --lora.alpha=8 --checkpoint.enable=true --checkpoint.interval=5";
}
const char* const kLoraF32 = " --lora.base_dtype=float32 --lora.dropout=0.1";
const char* const kLoraBf16 = " --lora.base_dtype=bfloat16";

// The 1-rank references: "one" (f32 base) and "one_bf16", local batch 4.
void run_lora_references(const testing::TempDir& tmp, const std::string& common) {
  for (auto [name, args] : {std::pair<std::string, std::string>{"one", kLoraF32}, {"one_bf16", kLoraBf16}}) {
    RunResult r = run_shell("timeout 300 " + kTitan + " train" + common + args +
                            " --training.local_batch_size=4 --job.dump_folder=" + (tmp / name));
    ASSERT_EQ(r.rc, 0) << r.output;
  }
}

// A LoRA run `name` against the 1-rank run `ref` (both 10 steps in tmp, checkpoints at step 10): the loss of
// every step within 1e-5 relative, and the adapters of the step-10 checkpoint within 1e-4 (relative L2).
void expect_lora_run_matches(const testing::TempDir& tmp, const std::string& ref_name,
                             const std::string& name) {
  double max_rel = 0, worst = 0;
  expect_losses_match(tmp, ref_name, name, 10, &max_rel);
  if (max_rel < 0) return;
  const std::string file = "/checkpoint/step-10/adapter_model.safetensors";
  expect_same_tensors(tmp / (ref_name + file), tmp / (name + file), name, &worst);
  if (worst < 0) return;
  std::printf("%s: max relative adapter difference (per tensor, L2) after 10 steps: %.3g\n", name.c_str(),
              worst);
  EXPECT_LE(worst, 1e-4) << name;
}

// LoRA runs under several layouts (mpirun -np np, local batch each), each against its 1-rank reference;
// `shows`: a line of the log every run prints (the layout's).
struct LoraLayout {
  std::string name, ref, args;
  int np, local_batch;
};
void expect_lora_layouts_match(const testing::TempDir& tmp, const std::string& common,
                               const std::vector<LoraLayout>& layouts, const std::string& shows) {
  for (const LoraLayout& l : layouts) {
    RunResult r = run_shell("timeout 300 mpirun --oversubscribe --bind-to none -np " + std::to_string(l.np) +
                            " " + kTitan + " train" + common + l.args + " --training.local_batch_size=" +
                            std::to_string(l.local_batch) + " --job.dump_folder=" + (tmp / l.name));
    ASSERT_EQ(r.rc, 0) << l.name << "\n" << r.output;
    EXPECT_NE(r.output.find(shows), std::string::npos) << r.output;
    expect_lora_run_matches(tmp, l.ref, l.name);
  }
}

// The step-5 checkpoint of run `from` (in tmp) resumed on 1 rank with `args`: steps 6-10 as the 1-rank run
// "one"'s (1e-5 relative).
void expect_resumes_on_one_rank(const testing::TempDir& tmp, const std::string& args,
                                const std::string& from) {
  fs::create_directories(tmp / "on_one/checkpoint");
  fs::copy(tmp / (from + "/checkpoint/step-5"), tmp / "on_one/checkpoint/step-5",
           fs::copy_options::recursive);
  RunResult r =
      run_shell("timeout 300 " + kTitan + " train" + args + " --job.dump_folder=" + (tmp / "on_one"));
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("resuming from"), std::string::npos) << r.output;
  const auto ref = jsonl_losses(tmp / "one/metrics.jsonl");
  const auto got = jsonl_losses(tmp / "on_one/metrics.jsonl");
  ASSERT_EQ(got.size(), 5u);
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], ref[5 + i], 1e-5 * ref[5 + i]) << "step " << 6 + i;
}

// Same global batch and seed on the debug MoE: expert parallel 2 (world 2) and expert parallel 2 x DDP 2
// (world 4) give the 1-rank loss sequence over 10 steps, also with the HF aux loss on (world 4 against
// 1 rank accumulating 4 micro-batches of one sequence: the aux loss is per micro-batch / per rank), and
// the HF export gathers every expert (the 1-rank export's keys, shapes and values).
// (Aux-loss-free balancing is left out here: its expert bias makes near-ties in the top-k selection
// common, and a 1e-7 difference then flips a token's expert, a discrete change.)
TEST(DistExpertParallel, TrainMatchesOneRank) {
  testing::TempDir tmp;
  const std::string common = train_args(tmp, 10) + " --model.flavor=debug_moe";
  const std::string aux = " --model.moe_aux_loss=on";
  for (auto [name, args] : {std::pair<std::string, std::string>{"one", " --training.local_batch_size=4"},
                            {"one_aux", " --training.local_batch_size=1" + aux}}) {
    RunResult r =
        run_shell("timeout 300 " + kTitan + " train" + common + args + " --job.dump_folder=" + (tmp / name));
    ASSERT_EQ(r.rc, 0) << r.output;
  }
  struct Layout {
    std::string name, ref, args;
    int np, local_batch;
  };
  for (const Layout& l : {Layout{"ep2", "one", "", 2, 2}, Layout{"ep2_ddp2", "one", "", 4, 1},
                          Layout{"ep2_ddp2_aux", "one_aux", aux, 4, 1}}) {
    RunResult r = run_shell("timeout 300 mpirun --oversubscribe --bind-to none -np " + std::to_string(l.np) +
                            " " + kTitan + " train" + common + l.args +
                            " --training.local_batch_size=" + std::to_string(l.local_batch) +
                            " --parallelism.data_parallel_replicate_degree=" + std::to_string(l.np) +
                            " --parallelism.expert_parallel_degree=2 --job.dump_folder=" + (tmp / l.name));
    ASSERT_EQ(r.rc, 0) << l.name << "\n" << r.output;
    EXPECT_NE(r.output.find("experts split over 2 ranks"), std::string::npos) << r.output;
    expect_run_matches(tmp, l.ref, l.name);  // the export holds every expert
  }
}

// ---- tensor parallel through `titan train` ----

// Same global batch and seed: tensor parallel 2 (world 2; with sequence parallel, torchtitan's default, and
// without; with 2 micro-batches of gradient accumulation), TP 2 x FSDP 2 and TP 2 x DDP 2 (world 4), TP 2
// with selective op and with full checkpointing, TP 2 on the debug MoE (experts replicated in the group) and
// TP 2 x EP 2 (with sequence parallel the experts split over the tensor-parallel group, each rank routing
// its own rows; with and without the aux loss, x DDP 2 and x FSDP 2), TP 2 x FSDP 2 on the MoE, TP 2 x EP 2 x
// DDP 2 without sequence parallel (the experts split over the ranks holding the same slice), and TP 2 from HF
// weights give the 1-rank loss sequence over 10 steps, and the HF export gathers the slices (and experts)
// into the 1-rank model's tensors.
TEST(DistTensorParallel, TrainMatchesOneRank) {
  testing::TempDir tmp;
  const std::string common = train_args(tmp, 10) + " --model.flavor=debug";
  const std::string tp2 = " --parallelism.tensor_parallel_degree=2";
  // HF weights to start from (read one tensor at a time under TP, each rank keeping its slices)
  const std::string hf = write_debug_hf(tmp);
  {  // the same weights as a model-only checkpoint (read slice by slice under TP)
    std::string out;
    ASSERT_EQ(testing::run_titan("convert --input " + (tmp / "hf") + " --output " + (tmp / "ckpt"), &out), 0)
        << out;
  }
  const std::string from_ckpt =
      " --checkpoint.initial_load_path=" + (tmp / "ckpt/step-0") + " --checkpoint.initial_load_in_hf=false";
  const std::string aux = " --model.flavor=debug_moe --model.moe_aux_loss=on";
  const std::string moe_ep2 = " --model.flavor=debug_moe --parallelism.expert_parallel_degree=2";
  for (auto [name, args] : {std::pair<std::string, std::string>{"one", ""},
                            {"one_moe", " --model.flavor=debug_moe"},
                            {"one_hf", hf},
                            {"one_moe_aux", aux}}) {
    RunResult r = run_shell("timeout 300 " + kTitan + " train" + common + args +
                            " --training.local_batch_size=4 --job.dump_folder=" + (tmp / name));
    ASSERT_EQ(r.rc, 0) << r.output;
  }
  struct Layout {
    std::string name, ref, args;
    int np, local_batch;
  };
  for (const Layout& l :
       {Layout{"tp2", "one", "", 2, 4},
        Layout{"tp2_no_sp", "one", " --parallelism.enable_sequence_parallel=false", 2, 4},
        Layout{"tp2_accum2", "one", "", 2, 2}, Layout{"tp2_hf", "one_hf", hf, 2, 4},
        Layout{"tp2_from_checkpoint", "one_hf", from_ckpt, 2, 4}, Layout{"tp2_fsdp2", "one", "", 4, 2},
        Layout{"tp2_ddp2", "one", " --parallelism.data_parallel_replicate_degree=2", 4, 2},
        Layout{"tp2_op", "one",
               " --activation_checkpoint.mode=selective --activation_checkpoint.selective_ac_option=op", 2,
               4},
        Layout{"tp2_full_ac", "one", " --activation_checkpoint.mode=full", 2, 4},
        Layout{"tp2_moe", "one_moe", " --model.flavor=debug_moe", 2, 4},
        Layout{"tp2_ep2", "one_moe", moe_ep2, 2, 4},
        Layout{"tp2_ep2_aux", "one_moe_aux", moe_ep2 + aux, 2, 4},
        Layout{"tp2_ep2_ddp2", "one_moe", moe_ep2 + " --parallelism.data_parallel_replicate_degree=2", 4, 2},
        Layout{"tp2_ep2_fsdp2", "one_moe", moe_ep2, 4, 2},
        Layout{"tp2_moe_fsdp2", "one_moe", " --model.flavor=debug_moe", 4, 2},
        Layout{"tp2_no_sp_ep2_ddp2", "one_moe",
               moe_ep2 + " --parallelism.data_parallel_replicate_degree=2"
                         " --parallelism.enable_sequence_parallel=false",
               4, 2}}) {
    RunResult r = run_shell("timeout 300 mpirun --oversubscribe --bind-to none -np " + std::to_string(l.np) +
                            " " + kTitan + " train" + common + tp2 + l.args +
                            " --training.local_batch_size=" + std::to_string(l.local_batch) +
                            " --job.dump_folder=" + (tmp / l.name));
    ASSERT_EQ(r.rc, 0) << l.name << "\n" << r.output;
    EXPECT_NE(r.output.find("tensor parallel: 2 ranks per group"), std::string::npos) << r.output;
    const bool sp = l.args.find("enable_sequence_parallel=false") == std::string::npos;
    EXPECT_NE(r.output.find(sp ? "sequence parallel on" : "sequence parallel off"), std::string::npos)
        << r.output;
    expect_run_matches(tmp, l.ref, l.name);
  }
}

// Pipeline parallel through `titan train`: every schedule on 2 and 4 pipeline ranks, with FSDP and DDP over
// each stage, tensor parallel inside each stage (dense, and MoE with replicated experts or the experts over
// the tensor-parallel group), full activation checkpointing, HF weights and MoE (aux-loss statistics passed
// between the stages) give the 1-rank loss sequence (1e-5 relative) and export (1e-4). The
// 1-rank runs accumulate the same micro-batches (the MoE aux loss is per micro-batch).
TEST(DistPipelineParallel, TrainMatchesOneRank) {
  testing::TempDir tmp;
  const std::string common = train_args(tmp, 10);
  const std::string hf = write_debug_hf(tmp);
  const std::string aux = " --model.flavor=debug_moe --model.moe_aux_loss=on";
  for (auto [name, args] : {std::pair<std::string, std::string>{"one", " --model.flavor=debug"},
                            {"one_hf", " --model.flavor=debug" + hf},
                            {"one_moe", " --model.flavor=debug_moe"},
                            {"one_moe_aux", aux}}) {
    const std::string local_batch = name == "one_moe_aux" ? "1" : "4";  // (MoE: 4 micro-batches accumulated)
    RunResult r =
        run_shell("timeout 300 " + kTitan + " train" + common + args +
                  " --training.local_batch_size=" + local_batch + " --job.dump_folder=" + (tmp / name));
    ASSERT_EQ(r.rc, 0) << r.output;
  }
  struct Layout {
    std::string name, ref, args;
    int np, local_batch;
  };
  const std::string pp2 = " --model.flavor=debug --parallelism.pipeline_parallel_degree=2";
  const std::string pp4 = " --model.flavor=debug --parallelism.pipeline_parallel_degree=4";
  for (const Layout& l :
       {Layout{"pp2_1f1b", "one", pp2, 2, 4},
        Layout{"pp2_gpipe", "one", pp2 + " --parallelism.pipeline_parallel_schedule=GPipe", 2, 4},
        Layout{"pp2_interleaved", "one", pp2 + " --parallelism.pipeline_parallel_schedule=Interleaved1F1B", 2,
               4},
        Layout{"pp4_1f1b", "one", pp4, 4, 4},
        Layout{"pp4_gpipe", "one", pp4 + " --parallelism.pipeline_parallel_schedule=GPipe", 4, 4},
        Layout{"pp2_mb2", "one", pp2 + " --parallelism.pipeline_parallel_microbatch_size=2", 2, 4},
        Layout{"pp2_fsdp2", "one", pp2, 4, 2},
        Layout{"pp2_ddp2", "one", pp2 + " --parallelism.data_parallel_replicate_degree=2", 4, 2},
        Layout{"pp2_full_ac", "one", pp2 + " --activation_checkpoint.mode=full", 2, 4},
        Layout{"pp2_hf", "one_hf", pp2 + hf, 2, 4},
        Layout{"pp2_tp2", "one", pp2 + " --parallelism.tensor_parallel_degree=2", 4, 4},
        Layout{"pp2_tp2_no_sp", "one",
               pp2 + " --parallelism.tensor_parallel_degree=2 --parallelism.enable_sequence_parallel=false"
                     " --parallelism.pipeline_parallel_schedule=Interleaved1F1B",
               4, 4},
        Layout{"pp2_ep2", "one_moe",
               " --model.flavor=debug_moe --parallelism.pipeline_parallel_degree=2"
               " --parallelism.expert_parallel_degree=2 --parallelism.data_parallel_replicate_degree=2",
               4, 2},
        Layout{
            "pp2_moe_aux", "one_moe_aux",
            aux +
                " --parallelism.pipeline_parallel_degree=2 --parallelism.pipeline_parallel_microbatch_size=1",
            2, 4},
        Layout{"pp2_tp2_moe", "one_moe",
               " --model.flavor=debug_moe --parallelism.pipeline_parallel_degree=2"
               " --parallelism.tensor_parallel_degree=2",
               4, 4},
        Layout{
            "pp2_tp2_ep2_moe_aux", "one_moe_aux",
            aux +
                " --parallelism.pipeline_parallel_degree=2 --parallelism.pipeline_parallel_microbatch_size=1"
                " --parallelism.tensor_parallel_degree=2 --parallelism.expert_parallel_degree=2",
            4, 4}}) {
    RunResult r = run_shell("timeout 300 mpirun --oversubscribe --bind-to none -np " + std::to_string(l.np) +
                            " " + kTitan + " train" + common + l.args + " --training.local_batch_size=" +
                            std::to_string(l.local_batch) + " --job.dump_folder=" + (tmp / l.name));
    ASSERT_EQ(r.rc, 0) << l.name << "\n" << r.output;
    EXPECT_NE(r.output.find("pipeline parallel: "), std::string::npos) << r.output;
    expect_run_matches(tmp, l.ref, l.name);
  }
  // Validation runs forward through the pipeline: the same validation losses as one rank.
  RunResult one = run_shell("timeout 300 " + kTitan + " train" + common + " --model.flavor=debug" +
                            kValidationArgs + " --job.dump_folder=" + (tmp / "one_val"));
  ASSERT_EQ(one.rc, 0) << one.output;
  RunResult pp = run_shell("timeout 300 mpirun --oversubscribe --bind-to none -np 2 " + kTitan + " train" +
                           common + pp2 + " --parallelism.pipeline_parallel_schedule=Interleaved1F1B" +
                           kValidationArgs + " --job.dump_folder=" + (tmp / "pp2_val"));
  ASSERT_EQ(pp.rc, 0) << pp.output;
  const std::vector<double> want = testing::jsonl_val_losses(tmp / "one_val/metrics.jsonl"),
                            got = testing::jsonl_val_losses(tmp / "pp2_val/metrics.jsonl");
  ASSERT_EQ(want.size(), 2u) << one.output;
  ASSERT_EQ(got.size(), want.size()) << pp.output;
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]);
}

// LoRA under pipeline parallel against 1 rank (10 steps: losses within 1e-5 relative, the adapters of the
// step-10 checkpoint within 1e-4): each stage's base layers, all the adapters on every pipeline rank (their
// gradients summed over the pipeline). With dropout the micro-batches draw the masks of their rows of the
// whole batch, also in a forward re-run before its backward: PP 2 1F1B and GPipe on an f32 base; PP 2
// Interleaved1F1B and PP 2 x FSDP 2 on a bf16 base; full activation checkpointing; PP 2 x TP 2 (the adapters
// sliced like their base weights on every pipeline rank) on both bases. The PP 2 step-5 checkpoint resumes
// on 1 rank.
TEST(DistPipelineParallel, LoraMatchesOneRank) {
  testing::TempDir tmp;
  const std::string common = lora_train_args(tmp);
  run_lora_references(tmp, common);
  if (HasFatalFailure()) return;
  const std::string f32 = kLoraF32, bf16 = kLoraBf16, pp2 = " --parallelism.pipeline_parallel_degree=2";
  expect_lora_layouts_match(
      tmp, common,
      {{"pp2", "one", pp2 + f32, 2, 4},
       {"pp2_gpipe", "one", pp2 + f32 + " --parallelism.pipeline_parallel_schedule=GPipe", 2, 4},
       {"pp2_full_ac", "one", pp2 + f32 + " --activation_checkpoint.mode=full", 2, 4},
       {"pp2_interleaved_bf16", "one_bf16",
        pp2 + bf16 + " --parallelism.pipeline_parallel_schedule=Interleaved1F1B", 2, 4},
       {"pp2_fsdp2_bf16", "one_bf16", pp2 + bf16, 4, 2},
       {"pp2_tp2", "one", pp2 + f32 + " --parallelism.tensor_parallel_degree=2", 4, 4},
       {"pp2_tp2_bf16", "one_bf16", pp2 + bf16 + " --parallelism.tensor_parallel_degree=2", 4, 4}},
      "pipeline parallel: ");
  if (HasFatalFailure()) return;
  expect_resumes_on_one_rank(tmp, common + f32 + " --training.local_batch_size=4", "pp2");
}

// ---- context parallel through `titan train` ----

// LoRA under context parallel against 1 rank (10 steps: losses within 1e-5 relative, the step-10 adapters
// within 1e-4): CP 2 with dropout (each row draws the masks of its row in the 1-rank batch: the chunks'
// rows are placed by their positions), CP 2 x PP 2 with dropout (pinned micro-batch masks and the chunk
// positions together), CP 2 x TP 2 and CP 2 x FSDP 2 on a bf16 base; the CP 2 step-5 checkpoint resumes on
// 1 rank.
TEST(DistContextParallel, LoraMatchesOneRank) {
  testing::TempDir tmp;
  const std::string common = lora_train_args(tmp);
  run_lora_references(tmp, common);
  if (HasFatalFailure()) return;
  const std::string f32 = kLoraF32, bf16 = kLoraBf16, cp2 = " --parallelism.context_parallel_degree=2";
  expect_lora_layouts_match(
      tmp, common,
      {{"cp2", "one", cp2 + f32, 2, 4},
       {"cp2_pp2", "one", cp2 + f32 + " --parallelism.pipeline_parallel_degree=2", 4, 4},
       {"cp2_tp2_bf16", "one_bf16", cp2 + bf16 + " --parallelism.tensor_parallel_degree=2", 4, 4},
       {"cp2_fsdp2_bf16", "one_bf16", cp2 + bf16, 4, 2}},
      "context parallel: 2 ranks per sequence");
  if (HasFatalFailure()) return;
  expect_resumes_on_one_rank(tmp, common + f32 + " --training.local_batch_size=4", "cp2");
}

// Context parallel against 1 rank (same global batch, 10 steps: losses within 1e-5 relative, the HF export
// within 1e-4): CP 2; CP 4 at seq_len 30, not divisible by the 8 chunks (padded to 32); CP 2 x FSDP 2; CP 2 x
// DDP 2; CP 2 x TP 2 (sequence parallel); CP 2 x PP 2 (1F1B at seq_len 30, Interleaved1F1B); CP 2 with full
// activation checkpointing (the ring runs again in the recompute); CP 2 from HF weights. The MoE model with
// the HF aux loss (its router statistics summed over the group) under CP 2, CP 2 x TP 2, CP 2 x EP 2 (the
// experts split over the two context-parallel ranks) and CP 2 x PP 2 (one micro-batch: the aux loss is per
// micro-batch) over 6 steps: this MoE run's gradient norm quadruples at step 5 and amplifies any change of
// f32 summation order from then on (1 rank with matmul=reference instead of oneDNN drifts to 6.7e-6 by step
// 9, as CP 2 does); without the aux loss (which a data-parallel rank takes over its own rows) CP 2 x DDP 2
// x EP 4, the experts split over the data-parallel and context-parallel ranks. Validation runs through the
// ring too: the same validation losses.
TEST(DistContextParallel, TrainMatchesOneRank) {
  testing::TempDir tmp;
  const std::string common = train_args(tmp, 10);
  const std::string dense = " --model.flavor=debug",
                    moe = " --model.flavor=debug_moe --model.moe_aux_loss=on --training.steps=6",
                    // (data parallel: the aux loss of a rank's rows is not that of the 1-rank batch's)
      moe_no_aux = " --model.flavor=debug_moe --model.moe_aux_loss=off --training.steps=6";
  const std::string hf = write_debug_hf(tmp);
  const std::string seq30 = dense + " --training.seq_len=30";
  for (auto [name, args] : {std::pair<std::string, std::string>{"one", dense},
                            {"one_30", seq30},
                            {"one_hf", dense + hf},
                            {"one_moe", moe},
                            {"one_moe_no_aux", moe_no_aux}}) {
    RunResult r = run_shell("timeout 300 " + kTitan + " train" + common + args +
                            " --training.local_batch_size=4 --job.dump_folder=" + (tmp / name));
    ASSERT_EQ(r.rc, 0) << r.output;
  }
  struct Layout {
    std::string name, ref, args;
    int np, local_batch;
    size_t steps = 10;
  };
  const std::string cp2 = dense + " --parallelism.context_parallel_degree=2",
                    cp2_moe = moe + " --parallelism.context_parallel_degree=2";
  for (const Layout& l :
       {Layout{"cp2", "one", cp2, 2, 4},
        Layout{"cp4_30", "one_30", seq30 + " --parallelism.context_parallel_degree=4", 4, 4},
        Layout{"cp2_fsdp2", "one", cp2, 4, 2},
        Layout{"cp2_ddp2", "one", cp2 + " --parallelism.data_parallel_replicate_degree=2", 4, 2},
        Layout{"cp2_tp2", "one", cp2 + " --parallelism.tensor_parallel_degree=2", 4, 4},
        Layout{"cp2_full_ac", "one", cp2 + " --activation_checkpoint.mode=full", 2, 4},
        Layout{"cp2_hf", "one_hf", cp2 + hf, 2, 4},
        Layout{"cp2_pp2", "one_30",
               seq30 + " --parallelism.context_parallel_degree=2 --parallelism.pipeline_parallel_degree=2", 4,
               4},
        Layout{"cp2_pp2_interleaved", "one",
               cp2 + " --parallelism.pipeline_parallel_degree=2"
                     " --parallelism.pipeline_parallel_schedule=Interleaved1F1B",
               4, 4},
        Layout{"cp2_moe", "one_moe", cp2_moe, 2, 4, 6},
        Layout{"cp2_pp2_moe", "one_moe",
               cp2_moe +
                   " --parallelism.pipeline_parallel_degree=2 --parallelism.pipeline_parallel_schedule=GPipe"
                   " --parallelism.pipeline_parallel_microbatch_size=4",
               4, 4, 6},
        Layout{"cp2_tp2_moe", "one_moe", cp2_moe + " --parallelism.tensor_parallel_degree=2", 4, 4, 6},
        Layout{"cp2_ep2_moe", "one_moe", cp2_moe + " --parallelism.expert_parallel_degree=2", 2, 4, 6},
        Layout{"cp2_ddp2_ep4_moe", "one_moe_no_aux",
               moe_no_aux +
                   " --parallelism.context_parallel_degree=2 --parallelism.data_parallel_replicate_degree=2"
                   " --parallelism.expert_parallel_degree=4",
               4, 2, 6}}) {
    RunResult r = run_shell("timeout 300 mpirun --oversubscribe --bind-to none -np " + std::to_string(l.np) +
                            " " + kTitan + " train" + common + l.args + " --training.local_batch_size=" +
                            std::to_string(l.local_batch) + " --job.dump_folder=" + (tmp / l.name));
    ASSERT_EQ(r.rc, 0) << l.name << "\n" << r.output;
    EXPECT_NE(r.output.find("context parallel: "), std::string::npos) << r.output;
    expect_run_matches(tmp, l.ref, l.name, l.steps);
  }
  RunResult one = run_shell("timeout 300 " + kTitan + " train" + common + dense + kValidationArgs +
                            " --job.dump_folder=" + (tmp / "one_val"));
  ASSERT_EQ(one.rc, 0) << one.output;
  RunResult cp = run_shell("timeout 300 mpirun --oversubscribe --bind-to none -np 2 " + kTitan + " train" +
                           common + cp2 + kValidationArgs + " --job.dump_folder=" + (tmp / "cp2_val"));
  ASSERT_EQ(cp.rc, 0) << cp.output;
  const std::vector<double> want = testing::jsonl_val_losses(tmp / "one_val/metrics.jsonl"),
                            got = testing::jsonl_val_losses(tmp / "cp2_val/metrics.jsonl");
  ASSERT_EQ(want.size(), 2u) << one.output;
  ASSERT_EQ(got.size(), want.size()) << cp.output;
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * want[i]);
}

// The 6-step debug runs of the checkpoint tests below (a checkpoint at step 3), in tmp.
struct Step3Runs {
  const testing::TempDir& tmp;
  std::string common = train_args(tmp, 6) +
                       " --model.flavor=debug --training.local_batch_size=4 --checkpoint.enable=true"
                       " --checkpoint.interval=3 --checkpoint.last_save_in_hf=false";
  std::vector<double> train(int np, const std::string& args, const std::string& name) const {
    const std::string cmd =
        np == 1 ? kTitan : "mpirun --oversubscribe --bind-to none -np " + std::to_string(np) + " " + kTitan;
    RunResult r =
        run_shell("timeout 300 " + cmd + " train" + common + args + " --job.dump_folder=" + (tmp / name));
    EXPECT_EQ(r.rc, 0) << name << "\n" << r.output;
    return jsonl_losses(tmp / (name + "/metrics.jsonl"));
  }
  // Run `src`'s step-3 checkpoint (as a run stopped there leaves it) resumed as run `name` on np ranks with
  // `args`: its steps 4-6 equal the straight run's.
  void expect_resumes(int np, const std::string& args, const std::string& src, const std::string& name,
                      const std::vector<double>& straight) const {
    fs::create_directories(tmp / name);
    fs::copy(tmp / (src + "/checkpoint"), tmp / (name + "/checkpoint"), fs::copy_options::recursive);
    fs::remove_all(tmp / (name + "/checkpoint/step-6"));
    const std::vector<double> got = train(np, args, name);
    ASSERT_EQ(got.size(), 3u) << name;
    for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(got[i], straight[3 + i], 1e-5 * straight[3 + i]) << name;
  }
};

// A CP 2 x FSDP 2 run's step-3 checkpoint resumes on 1 rank and on CP 2 x TP 2; a 1-rank one on CP 4, each
// continuing with the straight 1-rank run's losses.
TEST(DistContextParallel, CheckpointsResumeOnAnyLayout) {
  testing::TempDir tmp;
  const Step3Runs runs{tmp};
  const std::string cp2 = " --parallelism.context_parallel_degree=2";
  const std::vector<double> straight = runs.train(1, "", "one");
  ASSERT_EQ(straight.size(), 6u);
  runs.train(4, cp2 + " --training.local_batch_size=2", "cp2_fsdp2");
  runs.expect_resumes(1, "", "cp2_fsdp2", "from_cp2_on_one", straight);
  runs.expect_resumes(4, cp2 + " --parallelism.tensor_parallel_degree=2", "cp2_fsdp2", "from_cp2_on_cp2_tp2",
                      straight);
  runs.expect_resumes(4, " --parallelism.context_parallel_degree=4", "one", "from_one_on_cp4", straight);
}

// Pipeline checkpoints hold the full model's groups (each stage writes its own): a PP 2 run's step-3
// checkpoint resumes on 1 rank, on PP 2 with another schedule and on PP 2 x TP 2, a PP 2 x TP 2 one on 1
// rank, and a 1-rank checkpoint under PP 2 x DDP 2, each continuing with the straight 1-rank run's losses.
TEST(DistPipelineParallel, CheckpointsResumeOnAnyLayout) {
  testing::TempDir tmp;
  const Step3Runs runs{tmp};
  const std::string pp2 = " --parallelism.pipeline_parallel_degree=2";
  const std::string tp2 = " --parallelism.tensor_parallel_degree=2";
  const std::vector<double> straight = runs.train(1, "", "one");
  ASSERT_EQ(straight.size(), 6u);
  runs.train(2, pp2, "pp2");
  runs.train(4, pp2 + tp2, "pp2_tp2");
  runs.expect_resumes(1, "", "pp2", "from_pp2_on_one", straight);
  runs.expect_resumes(2, pp2 + " --parallelism.pipeline_parallel_schedule=GPipe", "pp2",
                      "from_pp2_on_pp2_gpipe", straight);
  runs.expect_resumes(4, pp2 + tp2, "pp2", "from_pp2_on_pp2_tp2", straight);
  runs.expect_resumes(1, "", "pp2_tp2", "from_pp2_tp2_on_one", straight);
  runs.expect_resumes(4,
                      pp2 + " --parallelism.data_parallel_replicate_degree=2 --training.local_batch_size=2",
                      "one", "from_one_on_pp2_ddp2", straight);
}

// Checkpoints hold the full model's groups whatever the layout: a TP 2 run killed after its step-5
// checkpoint resumes bit for bit; the same checkpoint resumes on 1 rank and on TP 2 x DDP 2 with the
// straight run's losses (to f32 rounding), and a 1-rank checkpoint resumes under TP 2.
TEST(DistTensorParallel, CheckpointsResumeOnAnyLayout) {
  testing::TempDir tmp;
  const std::string common = train_args(tmp, 10) +
                             " --model.flavor=debug --checkpoint.enable=true --checkpoint.interval=5"
                             " --checkpoint.last_save_in_hf=false";
  auto tp = [](int t) { return " --parallelism.tensor_parallel_degree=" + std::to_string(t); };
  auto mpi = [&](int np, const std::string& args, const std::string& dir, const std::string& env = "") {
    return run_shell(env + "timeout 300 mpirun --oversubscribe --bind-to none -np " + std::to_string(np) +
                     " " + kTitan + " train" + common + args + " --job.dump_folder=" + (tmp / dir));
  };
  // TP 2 x FSDP 2 (4 ranks): straight, and killed after its step-5 checkpoint then restarted.
  const std::string tp2_fsdp2 = tp(2) + " --training.local_batch_size=2";
  RunResult r = mpi(4, tp2_fsdp2, "straight");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("fsdp"), std::string::npos) << r.output;
  r = mpi(4, tp2_fsdp2, "killed", "TITAN_FAULT_INJECT=checkpoint:after-rename@5 ");
  ASSERT_NE(r.rc, 0) << r.output;
  r = mpi(4, tp2_fsdp2, "killed");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("resuming from"), std::string::npos) << r.output;
  const auto ref = jsonl_losses(tmp / "straight/metrics.jsonl");
  ASSERT_EQ(ref.size(), 10u);
  EXPECT_EQ(jsonl_losses(tmp / "killed/metrics.jsonl"), ref);
  struct Resume {
    std::string dir, from, args;
    int np;
  };
  r = run_shell("timeout 300 " + kTitan + " train" + common + " --training.local_batch_size=4" +
                " --job.dump_folder=" + (tmp / "one"));
  ASSERT_EQ(r.rc, 0) << r.output;
  // The TP 2 x FSDP 2 checkpoint on 1 rank, TP 4 and FSDP 4; a 1-rank checkpoint under TP 2 x DDP 2.
  for (const Resume& c :
       {Resume{"on_one", "killed", " --training.local_batch_size=4", 1},
        Resume{"on_tp4", "killed", tp(4) + " --training.local_batch_size=4", 4},
        Resume{"on_fsdp4", "killed", " --training.local_batch_size=1", 4},
        Resume{"one_on_tp2_ddp2", "one",
               tp(2) + " --training.local_batch_size=2 --parallelism.data_parallel_replicate_degree=2", 4}}) {
    fs::create_directories(tmp / (c.dir + "/checkpoint"));
    fs::copy(tmp / (c.from + "/checkpoint/step-5"), tmp / (c.dir + "/checkpoint/step-5"),
             fs::copy_options::recursive);
    r = mpi(c.np, c.args, c.dir);
    ASSERT_EQ(r.rc, 0) << c.dir << "\n" << r.output;
    EXPECT_NE(r.output.find("resuming from"), std::string::npos) << r.output;
    const auto got = jsonl_losses(tmp / (c.dir + "/metrics.jsonl"));
    ASSERT_EQ(got.size(), 5u) << c.dir;  // steps 6-10
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_NEAR(got[i], ref[5 + i], 1e-5 * ref[5 + i]) << c.dir << " step " << 6 + i;
  }
  // The TP 2 x FSDP 2 checkpoint as an HF model (titan convert): titan eval gives the 1-rank checkpoint's
  // loss, and titan generate runs on it.
  double evals[2];
  for (int i = 0; i < 2; ++i) {
    const std::string run = i == 0 ? "straight" : "one", hf = tmp / (run + "_hf");
    ASSERT_EQ(testing::run_titan(
                  "convert --input " + (tmp / (run + "/checkpoint/step-10")) + " --output " + hf, &r.output),
              0)
        << r.output;
    fs::copy_file(testing::source_path("tests/golden/tokenizer/small/tokenizer.json"),
                  hf + "/tokenizer.json");
    ASSERT_EQ(
        testing::run_titan("eval --model " + hf + " --data " + (tmp / "corpus.txt") + " --seq-len 32 --json",
                           &r.output),
        0)
        << r.output;
    evals[i] = nlohmann::json::parse(r.output.substr(r.output.find('{')))["loss"].get<double>();
  }
  EXPECT_NEAR(evals[0], evals[1], 1e-5 * evals[1]);
  ASSERT_EQ(testing::run_titan("generate --model " + (tmp / "straight_hf") +
                                   " --prompt 'the quick' --max-new-tokens 5 --greedy",
                               &r.output),
            0)
      << r.output;
}

// bf16 compute: a tensor-parallel run sums the row-parallel partial outputs in another order than one rank
// before their bf16 rounding, so its losses are not those of the 1-rank bf16 run to f32 precision; they must
// stay closer to them than bf16 itself is to f32 (the 1-rank bf16 run against the 1-rank f32 run), over 10
// steps, for TP 2 (sequence parallel) and TP 2 x FSDP 2.
TEST(DistTensorParallel, Bf16StaysWithinTheBf16Error) {
  testing::TempDir tmp;
  const std::string common = train_args(tmp, 10) + " --model.flavor=debug";
  const std::string bf16 = " --training.mixed_precision_param=bfloat16";
  for (auto [name, args] : {std::pair<std::string, std::string>{"f32", ""}, {"bf16", bf16}}) {
    RunResult r = run_shell("timeout 300 " + kTitan + " train" + common + args +
                            " --training.local_batch_size=4 --job.dump_folder=" + (tmp / name));
    ASSERT_EQ(r.rc, 0) << r.output;
  }
  auto max_rel = [](const std::vector<double>& a, const std::vector<double>& b) {
    double m = 0;
    for (size_t i = 0; i < b.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]) / b[i]);
    return m;
  };
  const auto f32 = jsonl_losses(tmp / "f32/metrics.jsonl"), one = jsonl_losses(tmp / "bf16/metrics.jsonl");
  ASSERT_EQ(f32.size(), 10u);
  ASSERT_EQ(one.size(), 10u);
  const double bf16_error = max_rel(one, f32);
  for (auto [name, np] : {std::pair<std::string, int>{"tp2", 2}, {"tp2_fsdp2", 4}}) {
    RunResult r = run_shell(
        "timeout 300 mpirun --oversubscribe --bind-to none -np " + std::to_string(np) + " " + kTitan +
        " train" + common + bf16 + " --parallelism.tensor_parallel_degree=2" +
        " --training.local_batch_size=" + std::to_string(8 / np) + " --job.dump_folder=" + (tmp / name));
    ASSERT_EQ(r.rc, 0) << name << "\n" << r.output;
    const auto got = jsonl_losses(tmp / (name + "/metrics.jsonl"));
    ASSERT_EQ(got.size(), 10u) << name;
    const double d = max_rel(got, one);
    std::printf(
        "%s bf16: max relative loss difference to the 1-rank bf16 run %.3g (bf16 vs f32 on 1 rank: %.3g)\n",
        name.c_str(), d, bf16_error);
    EXPECT_LT(d, bf16_error) << name;
  }
}

// LoRA under tensor parallel (adapters sliced like their base weights: B of q/k/v/gate/up by rows, A of
// o/down by columns): TP 2 with sequence parallel and dropout (the masks as on one rank), and TP 2 x FSDP 2
// and TP 2 with selective op checkpointing on a bf16 frozen base give the 1-rank losses over 10 steps and the
// same PEFT adapter; the TP 2 run's step-5 checkpoint resumes on 1 rank. (Dropout with data parallel cannot
// match one rank: a sequence's masks depend on its row in the rank's batch.) The learning rate is 1e-3:
// at 1e-2 with dropout AdamW amplifies f32 summation-order differences ~8x a step (two 1-rank runs with 1
// and 2 threads drift apart by 1.9e-6 at step 8, a TP 2 run by 5e-5 on an AVX2 EPYC), so the comparison
// would measure the chaos, not the layout.
TEST(DistTensorParallel, LoraMatchesOneRank) {
  testing::TempDir tmp;
  const std::string common = lora_train_args(tmp);
  run_lora_references(tmp, common);
  if (HasFatalFailure()) return;
  const std::string f32 = kLoraF32, bf16 = kLoraBf16, tp2 = " --parallelism.tensor_parallel_degree=2";
  expect_lora_layouts_match(
      tmp, common,
      {{"tp2", "one", tp2 + f32, 2, 4},
       {"tp2_fsdp2", "one_bf16", tp2 + bf16, 4, 2},
       {"tp2_bf16", "one_bf16",
        tp2 + bf16 + " --activation_checkpoint.mode=selective --activation_checkpoint.selective_ac_option=op",
        2, 4}},
      "x tensor_parallel 2 (attention heads");
  if (HasFatalFailure()) return;
  // The TP 2 checkpoint (full adapters' layout) resumes on 1 rank: steps 6-10 as the straight run's.
  expect_resumes_on_one_rank(tmp, common + f32 + " --training.local_batch_size=4", "tp2");
}

TEST(DistTensorParallel, BadLayoutsNameTheKeysAndNumbers) {
  std::string out;
  const std::string nosp = " --parallelism.enable_sequence_parallel=false";
  // debug: 8 heads, 4 KV heads, intermediate 768.
  EXPECT_NE(testing::run_titan(
                "plan --nproc 3 --model.flavor=debug --parallelism.tensor_parallel_degree=3" + nosp, &out),
            0);
  EXPECT_NE(out.find("parallelism.tensor_parallel_degree = 3 does not divide model num_attention_heads = 8"),
            std::string::npos)
      << out;
  EXPECT_NE(testing::run_titan(
                "plan --nproc 8 --model.flavor=debug --parallelism.tensor_parallel_degree=8" + nosp, &out),
            0);
  EXPECT_NE(out.find("does not divide model num_key_value_heads = 4"), std::string::npos) << out;
  EXPECT_NE(testing::run_titan(
                "plan --nproc 6 --model.flavor=debug --parallelism.tensor_parallel_degree=4" + nosp, &out),
            0);
  EXPECT_NE(
      out.find("--nproc 6 is not a multiple of data_parallel_replicate_degree x tensor_parallel_degree x "
               "pipeline_parallel_degree x context_parallel_degree = 4"),
      std::string::npos)
      << out;
  EXPECT_NE(testing::run_titan("plan --nproc 2 --model.flavor=debug --model.vocab_size=2049 "
                               "--parallelism.tensor_parallel_degree=2" +
                                   nosp,
                               &out),
            0);
  EXPECT_NE(out.find("parallelism.tensor_parallel_degree = 2 does not divide model vocab_size = 2049"),
            std::string::npos)
      << out;
  EXPECT_NE(
      testing::run_titan("plan --nproc 4 --model.flavor=debug_moe --parallelism.tensor_parallel_degree=2 "
                         "--parallelism.data_parallel_replicate_degree=2 "
                         "--parallelism.expert_parallel_degree=4",
                         &out),
      0);
  EXPECT_NE(out.find("parallelism.expert_parallel_degree = 4 does not divide the data-parallel degree 2"),
            std::string::npos)
      << out;
  // Sequence parallel (torchtitan's default) splits each micro-batch's tokens over the group.
  EXPECT_NE(testing::run_titan("train --dry-run --parallelism.tensor_parallel_degree=2 "
                               "--training.local_batch_size=1 --training.seq_len=255",
                               &out),
            0);
  EXPECT_NE(out.find("training.local_batch_size x training.seq_len = 255 tokens"), std::string::npos) << out;
  // The plan reports the layout and the tensor-parallel traffic.
  EXPECT_EQ(testing::run_titan(
                "plan --nproc 4 --model.flavor=debug --parallelism.tensor_parallel_degree=2 "
                "--parallelism.data_parallel_replicate_degree=2 --parallelism.enable_sequence_parallel=false",
                &out),
            0)
      << out;
  EXPECT_NE(out.find("x tensor_parallel 2 (attention heads, MLP and vocabulary slices per rank;"),
            std::string::npos)
      << out;
  // The shipped TP 4 x FSDP 16 + SAC recipe (Qwen3-8B) plans on its 64 ranks.
  EXPECT_EQ(testing::run_titan("plan --nproc 64 --config qwen3_8b_tp4_fsdp16_sac", &out), 0) << out;
  EXPECT_NE(out.find("world 64 = data_parallel_replicate 1 x data_parallel_shard 16 x tensor_parallel 4"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("memory per rank:"), std::string::npos) << out;
}

// ---- several GPUs: the NCCL process group through `titan train` ----

// DDP 2 and FSDP 2 (dense), expert parallel 2 x DDP 2 (MoE) and tensor parallel 2 (dense with sequence
// parallel, MoE without) on two GPUs (rank r on cuda:r, the collectives on NCCL) give the 1-rank CPU loss
// sequence over 6 steps. On the CUDA emulator
// (test_dist_sim, TITAN_CUDA_SIM_GPUS=2) each rank is a process emulating its GPU and NCCL rides on MPI.
TEST(DistCuda, TrainOnTwoGpusMatchesOneRankOnCpu) {
  if (!testing::have_cuda_gpu() || device_interface(DeviceType::CUDA).device_count() < 2)
    GTEST_SKIP() << "needs 2 CUDA GPUs (none or one here, or a build without CUDA)";
  if (!nccl_available()) GTEST_SKIP() << "titan was built without NCCL";
  testing::TempDir tmp;
  const std::string common = train_args(tmp, 6);
  for (const char* flavor : {"debug", "debug_moe"}) {
    RunResult r = run_shell("timeout 300 " + kTitan + " train" + common + " --model.flavor=" + flavor +
                            " --training.local_batch_size=4 --job.dump_folder=" + (tmp / flavor));
    ASSERT_EQ(r.rc, 0) << r.output;
  }
  struct Layout {
    std::string name, flavor, args;
  };
  for (const Layout& l :
       {Layout{"ddp2", "debug", " --parallelism.data_parallel_replicate_degree=2"},
        Layout{"fsdp2", "debug", " --parallelism.data_parallel_shard_degree=2"},
        Layout{"ep2", "debug_moe",
               " --parallelism.data_parallel_replicate_degree=2 --parallelism.expert_parallel_degree=2"},
        Layout{"tp2", "debug", " --parallelism.tensor_parallel_degree=2 --training.local_batch_size=4"},
        Layout{"tp2_no_sp_moe", "debug_moe",
               " --parallelism.tensor_parallel_degree=2 --parallelism.enable_sequence_parallel=false"
               " --training.local_batch_size=4"}}) {
    RunResult r = run_shell(
        "timeout 300 " + kTitan + " run --nproc-per-node 2 train" + common + " --model.flavor=" + l.flavor +
        " --training.local_batch_size=2 --job.device=cuda" + l.args + " --job.dump_folder=" + (tmp / l.name));
    ASSERT_EQ(r.rc, 0) << l.name << "\n" << r.output;
    EXPECT_NE(r.output.find("device: cuda:0 ("), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("collectives: nccl"), std::string::npos) << r.output;
    const auto ref = jsonl_losses(tmp / (l.flavor + "/metrics.jsonl"));
    const auto got = jsonl_losses(tmp / (l.name + "/metrics.jsonl"));
    ASSERT_EQ(ref.size(), 6u) << l.flavor;
    ASSERT_EQ(got.size(), ref.size()) << l.name;
    for (size_t i = 0; i < ref.size(); ++i)
      EXPECT_NEAR(got[i], ref[i], 1e-5 * ref[i]) << l.name << " step " << i + 1;
  }
}

// Each configuration trained on two (emulated) GPUs eagerly and in compile mode, 4 steps: the losses and
// gradient norms of metrics.jsonl are equal as written.
void expect_compile_equals_eager_on_two_gpus(
    const std::vector<std::pair<std::string, std::string>>& configs) {
  testing::TempDir tmp;
  const std::string common = train_args(tmp, 4) + " --model.flavor=debug --job.device=cuda";
  auto logged = [](const std::string& path) {
    std::ifstream f(path);
    std::vector<std::string> out;
    for (std::string line; std::getline(f, line);)
      for (const char* key : {"\"loss\": ", "\"grad_norm\": "})
        if (auto at = line.find(key); at != std::string::npos)
          out.push_back(line.substr(at, line.find_first_of(",}", at) - at));
    return out;
  };
  for (const auto& [name, args] : configs) {
    std::vector<std::string> runs;
    for (const char* compile : {"false", "true"}) {
      const std::string dir = tmp / (name + "_" + compile);
      RunResult r = run_shell("timeout 300 " + kTitan + " run --nproc-per-node 2 train" + common + args +
                              " --compile.enable=" + compile + " --job.dump_folder=" + dir);
      ASSERT_EQ(r.rc, 0) << name << " compile " << compile << "\n" << r.output;
      if (std::string(compile) == "true") {
        EXPECT_NE(r.output.find("compile: the training step is captured into a CUDA graph"),
                  std::string::npos)
            << r.output;
      }
      runs.push_back(dir + "/metrics.jsonl");
    }
    const auto eager = logged(runs[0]), compiled = logged(runs[1]);
    EXPECT_EQ(eager.size(), 2 * 4u) << name;
    EXPECT_EQ(compiled, eager) << name;
  }
}

#define SKIP_WITHOUT_TWO_GPUS_AND_NCCL()                                                  \
  if (!testing::have_cuda_gpu() || device_interface(DeviceType::CUDA).device_count() < 2) \
    GTEST_SKIP() << "needs 2 CUDA GPUs (none or one here, or a build without CUDA)";      \
  if (!nccl_available()) GTEST_SKIP() << "titan was built without NCCL"

// Compile mode on two GPUs: DDP with gradient accumulation (two micro-batches per step), FSDP, tensor
// parallel (sequence parallel, loss parallel) and context parallel, each rank's step captured into a CUDA
// graph (the NCCL all-reduce / reduce-scatter / all-gather, the sequence-parallel gathers, loss parallel's
// max and sum of the row statistics, the ring attention's grouped sends and receives and the norm's
// all-reduces inside it), give the eager runs' losses and gradient norms bit for bit; pipeline parallel is
// refused naming the reason.
TEST(DistCuda, CompileModeEqualsEagerOnTwoGpus) {
  SKIP_WITHOUT_TWO_GPUS_AND_NCCL();
  expect_compile_equals_eager_on_two_gpus({
      {"ddp2_accum2", " --parallelism.data_parallel_replicate_degree=2 --training.local_batch_size=1"},
      {"fsdp2", " --parallelism.data_parallel_shard_degree=2 --training.local_batch_size=2"},
      {"tp2", " --parallelism.tensor_parallel_degree=2 --training.local_batch_size=2"},
      {"cp2", " --parallelism.context_parallel_degree=2 --training.local_batch_size=2"},
  });
  testing::TempDir tmp;
  RunResult r = run_shell(
      "timeout 300 " + kTitan + " run --nproc-per-node 2 train" + train_args(tmp, 4) +
      " --model.flavor=debug --job.device=cuda"
      " --parallelism.pipeline_parallel_degree=2 --training.local_batch_size=2 --compile.enable=true"
      " --job.dump_folder=" +
      (tmp / "pp2"));
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("compile.enable = true: pipeline parallel"), std::string::npos) << r.output;
}

// Compile mode with the MoE model on two GPUs (device-routed experts, the aux loss on the device): DDP with
// the expert bias (its counts all-reduced inside the graph), expert parallel 2 (the fixed-capacity
// all-to-all routed on the device; eager mode's exact exchange gives the same bits), tensor parallel 2 (the
// experts over the group, each rank routing its rows) and context parallel 2 (the aux-loss statistics of
// the ranks' rows / chunks all-reduced on the device).
TEST(DistCuda, CompileModeTrainsMoeOnTwoGpus) {
  SKIP_WITHOUT_TWO_GPUS_AND_NCCL();
  const std::string moe =
      " --model.flavor=debug_moe --kernels.moe_experts=device_routed --model.moe_aux_loss=on";
  expect_compile_equals_eager_on_two_gpus({
      {"moe_ddp2", " --parallelism.data_parallel_replicate_degree=2 --training.local_batch_size=2" + moe +
                       " --model.load_balance_coeff=0.001"},
      {"ep2",
       " --parallelism.expert_parallel_degree=2 --parallelism.data_parallel_replicate_degree=2"
       " --training.local_batch_size=2" +
           moe},
      {"moe_tp2", " --parallelism.tensor_parallel_degree=2 --training.local_batch_size=2" + moe},
      {"moe_cp2", " --parallelism.context_parallel_degree=2 --training.local_batch_size=2" + moe},
  });
}

// Pipeline parallel 2 (1F1B, Interleaved1F1B; GPipe on the MoE model), pipeline parallel 4 (two ranks per
// GPU) and context parallel 2 (dense and MoE) on GPUs: hidden states and their gradients move between the
// stages on NCCL's per-direction links, the ring's keys and values as grouped sends and receives; the
// 1-rank CPU loss sequence over 6 steps. On the CUDA emulator an NCCL send completes only once its peer has
// posted the receive, as on GPUs (a lone send held by its stream while the host goes on), so a send and
// receive order that would hang GPUs hangs here too.
TEST(DistCuda, PipelineAndContextParallelOnTwoGpus) {
  if (!testing::have_cuda_gpu() || device_interface(DeviceType::CUDA).device_count() < 2)
    GTEST_SKIP() << "needs 2 CUDA GPUs (none or one here, or a build without CUDA)";
  if (!nccl_available()) GTEST_SKIP() << "titan was built without NCCL";
  testing::TempDir tmp;
  const std::string common = train_args(tmp, 6) + " --training.local_batch_size=4";
  for (const char* flavor : {"debug", "debug_moe"}) {
    RunResult r = run_shell("timeout 300 " + kTitan + " train" + common + " --model.flavor=" + flavor +
                            " --job.dump_folder=" + (tmp / flavor));
    ASSERT_EQ(r.rc, 0) << r.output;
  }
  const std::string pp2 = " --parallelism.pipeline_parallel_degree=2";
  struct Layout {
    std::string name, flavor, args;
    int np = 2;
  };
  for (const Layout& l :
       {Layout{"pp2_1f1b", "debug", pp2 + " --parallelism.pipeline_parallel_microbatch_size=1"},
        Layout{"pp2_interleaved", "debug", pp2 + " --parallelism.pipeline_parallel_schedule=Interleaved1F1B"},
        Layout{"pp2_gpipe_moe", "debug_moe", pp2 + " --parallelism.pipeline_parallel_schedule=GPipe"},
        Layout{"cp2", "debug", " --parallelism.context_parallel_degree=2"},
        Layout{"cp2_moe", "debug_moe", " --parallelism.context_parallel_degree=2"},
        // (4 ranks on the 2 GPUs: messages to the previous pipeline rank take the downward links)
        Layout{"pp4_1f1b", "debug", " --parallelism.pipeline_parallel_degree=4", 4}}) {
    RunResult r = run_shell("timeout 300 " + kTitan + " run --nproc-per-node " + std::to_string(l.np) +
                            " train" + common + " --model.flavor=" + l.flavor + " --job.device=cuda" +
                            l.args + " --job.dump_folder=" + (tmp / l.name));
    ASSERT_EQ(r.rc, 0) << l.name << "\n" << r.output;
    EXPECT_NE(r.output.find("collectives: nccl"), std::string::npos) << r.output;
    const auto ref = jsonl_losses(tmp / (l.flavor + "/metrics.jsonl"));
    const auto got = jsonl_losses(tmp / (l.name + "/metrics.jsonl"));
    ASSERT_EQ(ref.size(), 6u) << l.flavor;
    ASSERT_EQ(got.size(), ref.size()) << l.name;
    for (size_t i = 0; i < ref.size(); ++i)
      EXPECT_NEAR(got[i], ref[i], 1e-5 * ref[i]) << l.name << " step " << i + 1;
  }
}

// Bad layouts are clear errors naming the field.
TEST(DistExpertParallel, ConfigErrorsNameTheField) {
  std::string out;
  EXPECT_NE(
      testing::run_titan("train --dry-run --model.flavor=debug --parallelism.expert_parallel_degree=2", &out),
      0);
  EXPECT_NE(out.find("parallelism.expert_parallel_degree"), std::string::npos) << out;
  EXPECT_NE(out.find("dense"), std::string::npos) << out;
  EXPECT_NE(testing::run_titan(
                "plan --nproc 3 --model.flavor=debug_moe --parallelism.data_parallel_replicate_degree=3"
                " --parallelism.expert_parallel_degree=3",
                &out),
            0);
  EXPECT_NE(out.find("does not divide the model's num_experts = 8"), std::string::npos) << out;
  EXPECT_NE(testing::run_titan(
                "plan --nproc 2 --model.flavor=debug_moe --parallelism.expert_parallel_degree=2", &out),
            0);
  EXPECT_NE(out.find("data_parallel_shard_degree"), std::string::npos) << out;
  EXPECT_EQ(testing::run_titan(
                "plan --nproc 4 --model.flavor=debug_moe --parallelism.data_parallel_replicate_degree=4"
                " --parallelism.expert_parallel_degree=2",
                &out),
            0)
      << out;
  EXPECT_NE(out.find("experts split over 2 ranks"), std::string::npos) << out;
}

}  // namespace
}  // namespace titan::dist
