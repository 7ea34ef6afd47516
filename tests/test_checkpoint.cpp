// Checkpoints: atomic sharded saves and checksummed reads that reshard; bad checkpoints refused before
// anything is loaded; titan train resuming bit-exactly (1 rank, 2-rank FSDP) and across world sizes
// (2 ranks -> 1); saves killed (SIGKILL) at every stage; the HF export and titan convert.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "core/error.h"
#include "distributed/process_group.h"
#include "models/qwen3/model.h"
#include "support/testing.h"
#include "train/config.h"
#include "train/trainer.h"

namespace titan {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

using testing::error_of;

Tensor ramp(int64_t n, float base) {
  Tensor t = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i) t.f32()[i] = base + static_cast<float>(i);
  return t;
}

// Saves tensors a (10 elements) and b (6) as step `step` of `folder`.
std::string save_ab(const std::string& folder, int64_t step) {
  dist::SingleProcessGroup pg;
  ckpt::SaveRequest req;
  req.folder = folder;
  req.step = step;
  req.meta = {{"note", "hello"}};
  req.slices = {{"a", 10, 0, ramp(10, 0)}, {"b", 6, 0, ramp(6, 100)}};
  req.log = false;
  return ckpt::save(pg, req);
}

TEST(CheckpointIo, SavedSlicesReadBackInAnyRange) {
  TempDir tmp;
  const std::string dir = save_ab(tmp / "ck", 3);
  EXPECT_EQ(dir, tmp / "ck/step-3");
  EXPECT_TRUE(ckpt::is_complete(dir));
  EXPECT_EQ(ckpt::latest(tmp / "ck"), dir);
  EXPECT_FALSE(fs::exists(tmp / "ck/.step-3.tmp"));
  ckpt::Reader r(dir);
  EXPECT_EQ(r.step(), 3);
  EXPECT_EQ(r.meta()["note"], "hello");
  EXPECT_EQ(r.tensor_numel("a"), 10);
  // Another sharding than the writer's: elements [2, 7) of a, all of b.
  std::vector<ckpt::Slice> want = {{"a", 10, 2, Tensor::zeros({5})}, {"b", 6, 0, Tensor::zeros({6})}};
  r.read(want);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(want[0].data.f32()[i], 2.0f + i);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(want[1].data.f32()[i], 100.0f + i);
}

TEST(CheckpointIo, BadCheckpointsAreRefusedBeforeAnythingIsCopied) {
  TempDir tmp;
  const std::string shard = "shard-00000-of-00001.safetensors";
  // Every read fills these; after a refused read they must still hold the sentinel.
  auto refused = [&](const std::string& dir, std::vector<ckpt::Slice> want) {
    for (auto& s : want)
      for (int64_t i = 0; i < s.data.numel(); ++i) s.data.f32()[i] = -7.0f;
    std::string e = error_of([&] { ckpt::Reader(dir).read(want); });
    for (auto& s : want)
      for (int64_t i = 0; i < s.data.numel(); ++i)
        EXPECT_EQ(s.data.f32()[i], -7.0f) << "partial load of " << s.name;
    return e;
  };
  std::vector<ckpt::Slice> both = {{"a", 10, 0, Tensor::zeros({10})}, {"b", 6, 0, Tensor::zeros({6})}};

  {  // one flipped byte in the data section
    const std::string dir = save_ab(tmp / "flip", 1);
    std::fstream f(dir + "/" + shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x55');
    f.close();
    const std::string e = refused(dir, both);
    EXPECT_NE(e.find(shard + ": checksum mismatch"), std::string::npos) << e;
  }
  {  // a missing shard
    const std::string dir = save_ab(tmp / "missing", 1);
    fs::remove(dir + "/" + shard);
    const std::string e = refused(dir, both);
    EXPECT_NE(e.find("shard file " + shard + " is missing"), std::string::npos) << e;
  }
  {  // a truncated shard
    const std::string dir = save_ab(tmp / "short", 1);
    fs::resize_file(dir + "/" + shard, fs::file_size(dir + "/" + shard) - 8);
    const std::string e = refused(dir, both);
    EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  }
  {  // a tensor of another size (another model config) and a tensor that is not there
    const std::string dir = save_ab(tmp / "foreign", 1);
    std::string e = refused(dir, {{"b", 6, 0, Tensor::zeros({6})}, {"a", 12, 0, Tensor::zeros({12})}});
    EXPECT_NE(e.find("tensor 'a' has 10 elements, this run expects 12"), std::string::npos) << e;
    e = refused(dir, {{"b", 6, 0, Tensor::zeros({6})}, {"c", 4, 0, Tensor::zeros({4})}});
    EXPECT_NE(e.find("has no tensor 'c'"), std::string::npos) << e;
  }
  {  // edited metadata, then a missing marker
    const std::string dir = save_ab(tmp / "meta", 1);
    std::ofstream(dir + "/metadata.json", std::ios::app) << " ";
    EXPECT_FALSE(ckpt::is_complete(dir));
    std::string e = error_of([&] { ckpt::Reader r(dir); });
    EXPECT_NE(e.find("metadata.json: checksum does not match the COMPLETE marker"), std::string::npos) << e;
    fs::remove(dir + "/COMPLETE");
    e = error_of([&] { ckpt::Reader r(dir); });
    EXPECT_NE(e.find("no COMPLETE marker (the save did not finish)"), std::string::npos) << e;
    EXPECT_EQ(ckpt::latest(tmp / "meta"), "");
  }
  {  // metadata that lacks a field or has one of the wrong type, consistently checksummed: named at open
    for (auto [edit, message] : std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>>{
             {[](nlohmann::json& m) { m["files"][0].erase("slices"); },
              "field 'files[0].slices' must be a list"},
             {[](nlohmann::json& m) { m["files"][0]["slices"][0]["offset"] = "x"; },
              "field 'files[0].slices[0].offset' must be a non-negative integer"},
             {[](nlohmann::json& m) { m["tensors"]["a"] = -1; },
              "field 'tensors.a' must be a non-negative integer"}}) {
      const std::string dir = save_ab(tmp / "fields", 1);
      nlohmann::json m = nlohmann::json::parse(std::ifstream(dir + "/metadata.json"));
      edit(m);
      std::ofstream(dir + "/metadata.json") << m.dump();
      std::ofstream(dir + "/COMPLETE")
          << nlohmann::json{{"step", 1}, {"metadata_xxh3", ckpt::file_checksum(dir + "/metadata.json")}}
                 .dump();
      const std::string e = error_of([&] { ckpt::Reader r(dir); });
      EXPECT_NE(e.find("metadata.json: " + message), std::string::npos) << e;
      fs::remove_all(tmp / "fields");
    }
  }
  EXPECT_NE(error_of([&] { ckpt::Reader r(tmp / "nowhere"); }).find("no such directory"), std::string::npos);
}

TEST(CheckpointIo, LatestSkipsUnfinishedSavesAndPruneKeepsTheNewest) {
  TempDir tmp;
  const std::string folder = tmp / "ck";
  for (int s = 1; s <= 4; ++s) save_ab(folder, s * 10);
  fs::create_directories(folder + "/step-50");  // an unfinished save that was somehow renamed
  fs::create_directories(folder + "/.step-60.tmp");
  // A complete checkpoint under a step number past 64 bits is not a step of ours: skipped, not a crash.
  fs::copy(folder + "/step-40", folder + "/step-18446744073709551617", fs::copy_options::recursive);
  EXPECT_EQ(ckpt::latest(folder), folder + "/step-40");
  ckpt::prune(folder, 2);
  EXPECT_FALSE(fs::exists(folder + "/step-10"));
  EXPECT_FALSE(fs::exists(folder + "/step-20"));
  EXPECT_TRUE(ckpt::is_complete(folder + "/step-30"));
  EXPECT_TRUE(ckpt::is_complete(folder + "/step-40"));
  EXPECT_FALSE(fs::exists(folder + "/.step-60.tmp"));
  ckpt::prune(folder, 0);  // keep all
  EXPECT_TRUE(fs::exists(folder + "/step-30"));
}

TEST(CheckpointIo, PublishDirectoryReplacesAWholeDirectory) {
  TempDir tmp;
  const std::string out = tmp / "export";
  ckpt::publish_directory(out, [](const std::string& d) { std::ofstream(d + "/one") << 1; });
  ckpt::publish_directory(out, [](const std::string& d) { std::ofstream(d + "/two") << 2; });
  EXPECT_FALSE(fs::exists(out + "/one"));
  EXPECT_TRUE(fs::exists(out + "/two"));
  EXPECT_FALSE(fs::exists(tmp / ".export.tmp"));
  EXPECT_FALSE(fs::exists(tmp / ".export.old"));
}

// ---- titan train: resume ----

// A small run: byte-level corpus, the committed small tokenizer, debug-sized model, 20 steps with a
// checkpoint every 10.
std::string train_args(const TempDir& tmp, const std::string& dump, int64_t local_batch = 2) {
  if (!fs::exists(tmp / "corpus.txt")) {
    std::ofstream f(tmp / "corpus.txt");
    for (int i = 0; i < 400; ++i) f << "the quick brown fox " << i << " jumps over the lazy dog.\n%\n";
  }
  return " train --job.dump_folder=" + dump + " --training.dataset=" + (tmp / "corpus.txt") +
         " --model.tokenizer_path=" + testing::source_path("tests/golden/tokenizer/small") +
         " --model.vocab_size=1024 --training.seq_len=32 --training.local_batch_size=" +
         std::to_string(local_batch) +
         " --training.steps=20 --training.sample_tokens=0 --lr_scheduler.warmup_steps=2 "
         "--metrics.peak_tflops=1"
         " --job.print_config=false --checkpoint.enable=true --checkpoint.interval=10"
         " --training.val_fraction=0 --validation.enable=false";
}

// step -> loss (full precision) from metrics.jsonl; every step at most once.
std::map<int64_t, double> jsonl_losses(const std::string& path) {
  std::map<int64_t, double> out;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) {
    auto j = nlohmann::json::parse(line);
    EXPECT_EQ(out.count(j["step"]), 0u) << "step " << j["step"] << " twice in " << path;
    out[j["step"]] = j["loss"];
  }
  return out;
}

void expect_bit_identical(const std::map<int64_t, double>& got, const std::map<int64_t, double>& ref,
                          const std::string& what) {
  ASSERT_EQ(got.size(), 20u) << what;
  for (auto& [step, loss] : ref)
    EXPECT_EQ(std::memcmp(&got.at(step), &loss, sizeof loss), 0)
        << what << " step " << step << ": " << got.at(step) << " vs " << loss;
}

const std::string kTitan = TITAN_BINARY;
const std::string kMpirun2 = "timeout 300 mpirun --oversubscribe --bind-to none -np 2 ";

// The uninterrupted 20-step reference, 1 rank.
const std::map<int64_t, double>& straight_run(const TempDir& tmp) {
  static std::map<int64_t, double> losses;
  if (losses.empty()) {
    auto r = testing::run_shell_command("timeout 300 " + kTitan + train_args(tmp, tmp / "straight"));
    EXPECT_EQ(r.rc, 0) << r.output;
    losses = jsonl_losses(tmp / "straight/metrics.jsonl");
  }
  return losses;
}

TEST(Resume, TenStepsThenResumedTenEqualTwentyStraightBitForBit) {
  TempDir tmp;
  const auto& ref = straight_run(tmp);
  ASSERT_EQ(ref.size(), 20u);
  // The first process dies (SIGKILL) right after its step-10 checkpoint is in place.
  auto r = testing::run_shell_command("TITAN_FAULT_INJECT=checkpoint:after-rename@10 timeout 300 " + kTitan +
                                      train_args(tmp, tmp / "b"));
  ASSERT_NE(r.rc, 0) << r.output;
  EXPECT_EQ(r.output.find("step:   11"), std::string::npos) << r.output;
  r = testing::run_shell_command("timeout 300 " + kTitan + train_args(tmp, tmp / "b"));
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("checkpoint: resuming from " + (tmp / "b/checkpoint/step-10") + " (step 10)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("GB/s"), std::string::npos) << r.output;
  expect_bit_identical(jsonl_losses(tmp / "b/metrics.jsonl"), ref, "resumed");
  // The final checkpoint carries the HF export; keep_latest_k (default 10) kept both.
  EXPECT_TRUE(ckpt::is_complete(tmp / "b/checkpoint/step-10"));
  EXPECT_TRUE(ckpt::is_complete(tmp / "b/checkpoint/step-20"));
  Qwen3Model back(Qwen3Config::from_hf_file(tmp / "b/checkpoint/step-20/config.json"));
  EXPECT_NO_THROW(back.load_hf(tmp / "b/checkpoint/step-20"));
}

TEST(Resume, SaveKilledAtAnyStageLeavesThePreviousCheckpointUsable) {
  TempDir tmp;
  const auto& ref = straight_run(tmp);
  ASSERT_EQ(ref.size(), 20u);
  for (const char* point : {"mid-shard", "after-shards", "after-metadata", "before-rename"}) {
    const std::string dump = tmp / point;
    auto r = testing::run_shell_command("TITAN_FAULT_INJECT=checkpoint:" + std::string(point) +
                                        "@20 timeout 300 " + kTitan + train_args(tmp, dump));
    ASSERT_NE(r.rc, 0) << point << "\n" << r.output;
    EXPECT_EQ(r.output.find("saved " + dump + "/checkpoint/step-20"), std::string::npos) << point;
    EXPECT_FALSE(ckpt::is_complete(dump + "/checkpoint/step-20")) << point;
    EXPECT_EQ(ckpt::latest(dump + "/checkpoint"), dump + "/checkpoint/step-10") << point;
    r = testing::run_shell_command("timeout 300 " + kTitan + train_args(tmp, dump));
    ASSERT_EQ(r.rc, 0) << point << "\n" << r.output;
    EXPECT_NE(r.output.find("resuming from " + dump + "/checkpoint/step-10"), std::string::npos) << point;
    expect_bit_identical(jsonl_losses(dump + "/metrics.jsonl"), ref, point);
    EXPECT_FALSE(fs::exists(dump + "/checkpoint/.step-20.tmp")) << point;
  }
}

TEST(Resume, FsdpTwoRanksResumeExactlyAndOnOneRankWithinTolerance) {
  TempDir tmp;
  // 2-rank FSDP reference (local batch 2 each), then the same run killed after step 10 and resumed.
  auto r = testing::run_shell_command(kMpirun2 + kTitan + train_args(tmp, tmp / "a2"));
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto ref = jsonl_losses(tmp / "a2/metrics.jsonl");
  r = testing::run_shell_command("TITAN_FAULT_INJECT=checkpoint:after-rename@10 " + kMpirun2 + kTitan +
                                 train_args(tmp, tmp / "b2"));
  ASSERT_NE(r.rc, 0) << r.output;
  {
    ckpt::Reader saved(tmp / "b2/checkpoint/step-10");
    EXPECT_EQ(saved.meta()["world_size"], 2);
    EXPECT_EQ(saved.meta()["parallelism"]["mode"], "fsdp");
    EXPECT_EQ(saved.meta()["files"].size(), 2u);  // each rank wrote its shard
  }
  fs::create_directories(tmp / "c1/checkpoint");
  fs::copy(tmp / "b2/checkpoint/step-10", tmp / "c1/checkpoint/step-10", fs::copy_options::recursive);
  r = testing::run_shell_command(kMpirun2 + kTitan + train_args(tmp, tmp / "b2"));
  ASSERT_EQ(r.rc, 0) << r.output;
  expect_bit_identical(jsonl_losses(tmp / "b2/metrics.jsonl"), ref, "fsdp-2 resumed");

  // The 2-rank checkpoint on 1 rank (local batch 4 = the same global batch): resharded on load.
  r = testing::run_shell_command("timeout 300 " + kTitan + train_args(tmp, tmp / "c1", 4));
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto one = jsonl_losses(tmp / "c1/metrics.jsonl");
  ASSERT_EQ(one.size(), 10u);
  for (auto& [step, loss] : one) EXPECT_NEAR(loss, ref.at(step), 1e-5 * ref.at(step)) << "step " << step;

  // The same checkpoint on HSDP 2 x 2 (local batch 1): each shard group reads halves of the 2-rank
  // shards; its own saves come from the first replica only.
  fs::create_directories(tmp / "h4/checkpoint");
  fs::copy(tmp / "b2/checkpoint/step-10", tmp / "h4/checkpoint/step-10", fs::copy_options::recursive);
  r = testing::run_shell_command("timeout 300 mpirun --oversubscribe --bind-to none -np 4 " + kTitan +
                                 train_args(tmp, tmp / "h4", 1) +
                                 " --parallelism.data_parallel_replicate_degree=2");
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto hsdp = jsonl_losses(tmp / "h4/metrics.jsonl");
  ASSERT_EQ(hsdp.size(), 10u);
  for (auto& [step, loss] : hsdp)
    EXPECT_NEAR(loss, ref.at(step), 1e-5 * ref.at(step)) << "hsdp step " << step;
  {
    ckpt::Reader saved(tmp / "h4/checkpoint/step-20");
    EXPECT_EQ(saved.meta()["parallelism"]["mode"], "hsdp");
    EXPECT_EQ(saved.meta()["files"].size(), 2u);
  }

  // A world size whose global batch differs cannot continue this checkpoint.
  fs::create_directories(tmp / "d1/checkpoint");
  fs::copy(tmp / "b2/checkpoint/step-10", tmp / "d1/checkpoint/step-10", fs::copy_options::recursive);
  r = testing::run_shell_command("timeout 300 " + kTitan + train_args(tmp, tmp / "d1", 2));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.output.find("cannot be resharded onto this run"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("training.global_batch_size = 4"), std::string::npos) << r.output;
}

TEST(Resume, ExpertParallelResumesExactlyAndReshardsOntoOneRank) {
  // debug_moe, expert parallel 2 with DDP 2: each rank writes its own experts (rank 0 also the rest).
  TempDir tmp;
  const std::string ep =
      " --model.flavor=debug_moe --parallelism.data_parallel_replicate_degree=2"
      " --parallelism.expert_parallel_degree=2";
  auto r = testing::run_shell_command(kMpirun2 + kTitan + train_args(tmp, tmp / "a") + ep);
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto ref = jsonl_losses(tmp / "a/metrics.jsonl");
  r = testing::run_shell_command("TITAN_FAULT_INJECT=checkpoint:after-rename@10 " + kMpirun2 + kTitan +
                                 train_args(tmp, tmp / "b") + ep);
  ASSERT_NE(r.rc, 0) << r.output;
  {
    ckpt::Reader saved(tmp / "b/checkpoint/step-10");
    EXPECT_EQ(saved.meta()["files"].size(), 2u);
  }
  fs::create_directories(tmp / "c/checkpoint");
  fs::copy(tmp / "b/checkpoint/step-10", tmp / "c/checkpoint/step-10", fs::copy_options::recursive);
  r = testing::run_shell_command(kMpirun2 + kTitan + train_args(tmp, tmp / "b") + ep);
  ASSERT_EQ(r.rc, 0) << r.output;
  expect_bit_identical(jsonl_losses(tmp / "b/metrics.jsonl"), ref, "ep-2 resumed");
  // The same checkpoint on one rank holding every expert (local batch 4: the same global batch).
  r = testing::run_shell_command("timeout 300 " + kTitan + train_args(tmp, tmp / "c", 4) +
                                 " --model.flavor=debug_moe");
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto one = jsonl_losses(tmp / "c/metrics.jsonl");
  ASSERT_EQ(one.size(), 10u);
  for (auto& [step, loss] : one) EXPECT_NEAR(loss, ref.at(step), 1e-5 * ref.at(step)) << "step " << step;
  // The final export holds every expert.
  Qwen3Model full(Qwen3Config::from_hf_file(tmp / "b/checkpoint/step-20/config.json"));
  EXPECT_NO_THROW(full.load_hf(tmp / "b/checkpoint/step-20"));
}

TEST(Resume, CheckpointOfAnotherModelIsRefused) {
  TempDir tmp;
  fs::create_directories(tmp / "x");
  auto r = testing::run_shell_command("TITAN_FAULT_INJECT=checkpoint:after-rename@10 timeout 300 " + kTitan +
                                      train_args(tmp, tmp / "x"));
  ASSERT_TRUE(ckpt::is_complete(tmp / "x/checkpoint/step-10")) << r.output;
  r = testing::run_shell_command("timeout 300 " + kTitan + train_args(tmp, tmp / "x") +
                                 " --model.vocab_size=2048");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(
      r.output.find("is of another model: field 'vocab_size' is 1024 in the checkpoint, 2048 in this run"),
      std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("step:"), std::string::npos) << r.output;
}

TEST(Resume, CheckpointSettingsAreValidated) {
  EXPECT_NE(error_of([] {
              parse_train_args({"--checkpoint.interval=0"});
            }).find("checkpoint.interval must be positive"),
            std::string::npos);
  EXPECT_NE(
      error_of([] { parse_train_args({"--checkpoint.keep_latest_k=-1"}); }).find("checkpoint.keep_latest_k"),
      std::string::npos);
  EXPECT_NE(error_of([] { parse_train_args({"--checkpoint.export_dtype=fp8"}); }).find("bfloat16"),
            std::string::npos);
}

// ---- HF export and titan convert ----

TEST(Convert, CheckpointToHfAndBackKeepsEveryParameter) {
  TempDir tmp;
  auto r = testing::run_shell_command("TITAN_FAULT_INJECT=checkpoint:after-rename@10 timeout 300 " + kTitan +
                                      train_args(tmp, tmp / "run"));
  ASSERT_TRUE(ckpt::is_complete(tmp / "run/checkpoint/step-10")) << r.output;
  // Training checkpoint -> HF (f32) -> model-only checkpoint -> HF again: identical tensors.
  r = testing::run_shell_command(kTitan + " convert --input " + (tmp / "run/checkpoint") + " --output " +
                                 (tmp / "hf"));
  ASSERT_EQ(r.rc, 0) << r.output;
  r = testing::run_shell_command(kTitan + " convert --input " + (tmp / "hf") + " --output " + (tmp / "ck"));
  ASSERT_EQ(r.rc, 0) << r.output;
  ASSERT_TRUE(ckpt::is_complete(tmp / "ck/step-0"));
  r = testing::run_shell_command(kTitan + " convert --input " + (tmp / "ck/step-0") + " --output " +
                                 (tmp / "hf2") + " --dtype bfloat16");
  ASSERT_EQ(r.rc, 0) << r.output;
  Qwen3Config c = Qwen3Config::from_hf_file(tmp / "hf/config.json");
  Qwen3Model a(c), b(c), bf(c);
  a.load_hf(tmp / "hf");
  b.load_hf(tmp / "hf2");  // bf16 on disk
  const NamedTensors sa = a.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i)
    EXPECT_LE(testing::rel_error(sb[i].second, sa[i].second), 4e-3) << sa[i].first;
  // The f32 export equals the checkpoint's parameters exactly.
  Qwen3Model direct(c);
  r = testing::run_shell_command(kTitan + " convert --input " + (tmp / "ck/step-0") + " --output " +
                                 (tmp / "hf3"));
  ASSERT_EQ(r.rc, 0) << r.output;
  direct.load_hf(tmp / "hf3");
  const NamedTensors sd = direct.state_dict();
  for (size_t i = 0; i < sa.size(); ++i)
    EXPECT_EQ(std::memcmp(sd[i].second.raw(), sa[i].second.raw(), sa[i].second.nbytes()), 0) << sa[i].first;
  // The model-only checkpoint starts a run as its initial weights.
  r = testing::run_shell_command("timeout 300 " + kTitan + train_args(tmp, tmp / "ft") +
                                 " --training.steps=2 --checkpoint.initial_load_in_hf=false"
                                 " --checkpoint.initial_load_path=" +
                                 (tmp / "ck/step-0"));
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("loading model weights from checkpoint"), std::string::npos) << r.output;
  // Bad input: a directory that is neither.
  fs::create_directories(tmp / "empty");
  r = testing::run_shell_command(kTitan + " convert --input " + (tmp / "empty") + " --output " + (tmp / "o"));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.output.find("neither a training checkpoint"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(tmp / "o"));
  // A write failing part-way (a file-size limit standing in for a full disk): one error, exit 1, and
  // neither a temporary nor a final output left, in both directions.
  for (auto [input, output] : std::vector<std::pair<std::string, std::string>>{
           {tmp / "ck/step-0", tmp / "full/hf"}, {tmp / "hf", tmp / "full/ck"}}) {
    r = testing::run_shell_command("ulimit -f 64; " + kTitan + " convert --input " + input + " --output " +
                                   output);
    EXPECT_EQ(r.rc, 1) << r.output;
    EXPECT_NE(r.output.find("write failed (File too large)"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(tmp / "full")) << output;
  }
}

}  // namespace
}  // namespace titan
