// The trainer: config parsing and errors, the embedded default run end to end (CI-sized),
// deterministic replay, gradient accumulation, NaN handling, the shipped configs' dry runs, and
// validation (against `titan forward`, across ranks, leaving training untouched).
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "data/loader.h"
#include "device/cpu/sgemm.h"
#include "io/safetensors.h"
#include "kernels/registry.h"
#include "models/qwen3/model.h"
#include "support/testing.h"
#include "train/config.h"
#include "train/forward_tool.h"
#include "train/plan.h"
#include "train/preemption.h"
#include "train/roofline.h"
#include "train/tensorboard.h"
#include "train/trainer.h"

namespace titan {
namespace {

using testing::TempDir;
namespace fs = std::filesystem;

using testing::error_of;

TEST(TrainConfig, UnknownSectionsKeysAndBadValuesListTheValidOnes) {
  TrainConfig c;
  auto e = error_of([&] { apply_toml(c, "[trainig]\nsteps = 3\n", "x.toml"); });
  EXPECT_NE(e.find("x.toml"), std::string::npos) << e;
  EXPECT_NE(e.find("unknown section [trainig]"), std::string::npos) << e;
  EXPECT_NE(e.find("training"), std::string::npos) << e;
  e = error_of([&] { apply_toml(c, "[training]\nstep = 3\n", "x.toml"); });
  EXPECT_NE(e.find("unknown key training.step"), std::string::npos) << e;
  EXPECT_NE(e.find("steps"), std::string::npos) << e;  // the valid keys are listed
  e = error_of([&] { apply_toml(c, "[training]\nsteps = \"many\"\n", "x.toml"); });
  EXPECT_NE(e.find("training.steps must be an integer"), std::string::npos) << e;
  e = error_of([&] { parse_train_args({"--lr_scheduler.decay_type=exp"}); });
  EXPECT_NE(e.find("lr_scheduler.decay_type"), std::string::npos) << e;
  EXPECT_NE(e.find("cosine"), std::string::npos) << e;
  e = error_of([&] { parse_train_args({"--training.local_batch_size=0"}); });
  EXPECT_NE(e.find("training.local_batch_size must be positive"), std::string::npos) << e;
  e = error_of([&] { parse_train_args({"--config", "no_such_config"}); });
  EXPECT_NE(e.find("qwen3_4b_hf"), std::string::npos) << e;  // lists the shipped configs
  e = error_of([&] { apply_toml(c, "[training\nsteps = 3\n", "broken.toml"); });
  EXPECT_NE(e.find("broken.toml: invalid TOML"), std::string::npos) << e;
}

TEST(TrainConfig, OverridesApplyAfterTheFileAndRoundTripThroughToml) {
  TrainConfig c = parse_train_args({"--training.steps=7", "--config", "debug", "--optimizer.lr", "0.002",
                                    "--training.dataset=[\"a.txt\", \"b.txt\"]",
                                    "--kernels.attention=reference", "--job.description=hello world"});
  EXPECT_EQ(c.training.steps, 7);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 0.002);
  EXPECT_EQ(c.training.dataset, (std::vector<std::string>{"a.txt", "b.txt"}));
  EXPECT_EQ(c.kernels.at("attention"), "reference");
  EXPECT_EQ(c.job.description, "hello world");
  EXPECT_EQ(c.training.local_batch_size, 8);  // from configs/debug.toml
  TrainConfig d;
  apply_toml(d, c.to_toml(), "dump");
  EXPECT_EQ(d.to_toml(), c.to_toml());
  // Floats as written: the shortest text that reads back as the same double, always a TOML float.
  const std::string text = c.to_toml();
  EXPECT_NE(text.find("beta1 = 0.9\n"), std::string::npos) << text;
  EXPECT_NE(text.find("weight_decay = 0.1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("decay_ratio = -1.0\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("0000000"), std::string::npos) << text;
  TrainConfig e;
  apply_toml(e, "[optimizer]\nlr = 3.0000000000000004e-4\nbeta2 = 1e300\n", "odd.toml");
  TrainConfig f;
  apply_toml(f, e.to_toml(), "dump");
  EXPECT_EQ(f.optimizer.lr, 3.0000000000000004e-4);
  EXPECT_EQ(f.optimizer.beta2, 1e300);
}

using testing::small_run_args;

TEST(Trainer, SameSeedGivesBitIdenticalLosses) {
  TempDir a, b;
  auto ra = run_training(parse_train_args(small_run_args(a, 4)));
  auto rb = run_training(parse_train_args(small_run_args(b, 4)));
  ASSERT_EQ(ra.losses.size(), 4u);
  EXPECT_EQ(ra.losses, rb.losses);  // bit-identical
  auto args = small_run_args(b, 4);
  args.push_back("--training.seed=7");
  EXPECT_NE(run_training(parse_train_args(args)).losses, ra.losses);
}

// One GPU trains the same run as the CPU: the same loss sequence up to f32 summation order.
TEST(Trainer, CudaLossSequenceMatchesCpu) {
  TITAN_SKIP_WITHOUT_CUDA_GPU();
  TempDir a, b;
  auto cpu = run_training(parse_train_args(small_run_args(a, 10)));
  auto args = small_run_args(b, 10);
  args.push_back("--job.device=cuda");
  auto gpu = run_training(parse_train_args(args));
  ASSERT_EQ(gpu.losses.size(), cpu.losses.size());
  for (size_t i = 0; i < cpu.losses.size(); ++i)
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 1e-4 * cpu.losses[i]) << "step " << i + 1;
  for (const char* mode :
       {"--training.mixed_precision_param=bfloat16", "--activation_checkpoint.mode=full"}) {
    TempDir c, d;
    auto cpu_args = small_run_args(c, 5), gpu_args = small_run_args(d, 5);
    cpu_args.push_back(mode), gpu_args.push_back(mode), gpu_args.push_back("--job.device=cuda");
    auto want = run_training(parse_train_args(cpu_args)).losses;
    auto got = run_training(parse_train_args(gpu_args)).losses;
    ASSERT_EQ(got.size(), want.size()) << mode;
    // bf16: the GEMM engines differ (oneDNN vs cuBLASLt) on bf16-rounded activations.
    const double tol = std::string(mode).find("bfloat16") != std::string::npos ? 1e-2 : 1e-4;
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], tol * want[i]) << mode << " " << i;
  }
}

// The same CUDA training twice in one process gives the same losses and validation losses bit for bit: the
// device's kernels are deterministic (reductions across blocks without float atomics, so a rerun, a resumed
// run and a replayed graph repeat the eager steps) and nothing of the first model carries over into the
// second.
TEST(Trainer, CudaTrainingRepeatsBitForBit) {
  TITAN_SKIP_WITHOUT_CUDA_GPU();
  for (const std::vector<std::string>& mode :
       {std::vector<std::string>{"--training.mixed_precision_param=float32"},
        std::vector<std::string>{"--training.mixed_precision_param=bfloat16",
                                 "--activation_checkpoint.mode=full"}}) {
    std::vector<TrainResult> runs;
    TempDir tmp;  // (one corpus path for both: the validation split hashes the documents' file names)
    for (const char* out : {"out_a", "out_b"}) {
      auto args = small_run_args(tmp, 4, out);
      for (const char* extra : {"--job.device=cuda", "--training.val_fraction=0.1",
                                "--validation.enable=true", "--validation.freq=2", "--validation.steps=1"})
        args.push_back(extra);
      args.insert(args.end(), mode.begin(), mode.end());
      runs.push_back(run_training(parse_train_args(args)));
    }
    ASSERT_EQ(runs[0].losses.size(), 4u) << mode[0];
    EXPECT_EQ(runs[1].losses, runs[0].losses) << mode[0];
    EXPECT_EQ(runs[1].val_losses, runs[0].val_losses) << mode[0];
  }
}

TEST(Trainer, DeviceSettingIsCheckedAndNamed) {
  TempDir a;
  auto args = small_run_args(a, 1);
  args.push_back("--job.device=tpu");
  try {
    parse_train_args(args);
    ADD_FAILURE() << "job.device = tpu accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("job.device = 'tpu': expected cpu, cuda, cuda:N or guard"),
              std::string::npos)
        << e.what();
  }
  if (!testing::have_cuda_gpu()) {
    args.back() = "--job.device=cuda";
    try {
      run_training(parse_train_args(args));
      ADD_FAILURE() << "job.device = cuda ran without a GPU";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_TRUE(msg.find("not available in this build") != std::string::npos ||
                  msg.find("finds no GPU") != std::string::npos)
          << msg;
    }
  }
}

TEST(Trainer, GradientAccumulationEqualsTheLargerBatch) {
  // global 4 = local 2 x 2 accumulation steps == local 4 in one step (same windows, same mean).
  TempDir a, b;
  auto args_a = small_run_args(a, 3);
  args_a.push_back("--training.global_batch_size=4");
  auto args_b = small_run_args(b, 3);
  args_b.push_back("--training.local_batch_size=4");
  auto ra = run_training(parse_train_args(args_a));
  auto rb = run_training(parse_train_args(args_b));
  ASSERT_EQ(ra.losses.size(), rb.losses.size());
  for (size_t i = 0; i < ra.losses.size(); ++i)
    EXPECT_NEAR(ra.losses[i], rb.losses[i], 1e-5 * rb.losses[i]) << i;
}

TEST(Trainer, NanLossStopsNamingTheStepOrIsSkipped) {
  TempDir a, b;
  auto args = small_run_args(a, 6);
  args.push_back("--optimizer.lr=1e30");
  args.push_back("--training.max_norm=0");
  args.push_back("--lr_scheduler.warmup_steps=0");
  auto e = error_of([&] { run_training(parse_train_args(args)); });
  EXPECT_NE(e.find("at step"), std::string::npos) << e;
  EXPECT_NE(e.find("skip_nan_inf"), std::string::npos) << e;
  args = small_run_args(b, 6);
  for (auto x : {"--optimizer.lr=1e30", "--training.max_norm=0", "--lr_scheduler.warmup_steps=0",
                 "--training.skip_nan_inf=true"})
    args.push_back(x);
  auto r = run_training(parse_train_args(args));
  EXPECT_EQ(r.losses.size(), 6u);
}

using testing::jsonl_losses;

// Same global batch and seed: the N-rank loss sequence equals the 1-rank one (DDP, FSDP, HSDP).
TEST(Trainer, DataParallelMatchesOneRank) {
  TempDir tmp;
  auto base = small_run_args(tmp, 10);
  std::string common;
  for (auto& a : base)
    if (!a.starts_with("--job.dump_folder") && !a.starts_with("--training.local_batch_size"))
      common += " " + a;
  std::string out;
  ASSERT_EQ(testing::run_titan(
                "train" + common + " --training.local_batch_size=4 --job.dump_folder=" + (tmp / "one"), &out),
            0)
      << out;
  const auto ref = jsonl_losses(tmp / "one/metrics.jsonl");
  ASSERT_EQ(ref.size(), 10u);
  struct Layout {
    const char* name;
    int np, replicate, local_batch;
  };
  for (Layout l : {Layout{"ddp2", 2, 2, 2}, Layout{"fsdp2", 2, 1, 2}, Layout{"ddp4", 4, 4, 1},
                   Layout{"fsdp4", 4, 1, 1}, Layout{"hsdp2x2", 4, 2, 1}}) {
    const std::string cmd =
        "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 timeout 300 "
        "mpirun --oversubscribe --bind-to none -np " +
        std::to_string(l.np) + " " + TITAN_BINARY + " train" + common +
        " --training.local_batch_size=" + std::to_string(l.local_batch) +
        " --parallelism.data_parallel_replicate_degree=" + std::to_string(l.replicate) +
        " --job.dump_folder=" + (tmp / l.name) + " > " + (tmp / l.name) + ".log 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << l.name;
    // ZeRO-3 memory: parameters + gradients + AdamW state per rank = 16 bytes/parameter / shard degree.
    std::ifstream log(tmp / (std::string(l.name) + ".log"));
    const std::string text((std::istreambuf_iterator<char>(log)), {});
    const size_t at = text.find("bytes/parameter");
    ASSERT_NE(at, std::string::npos) << text;
    const double per_param = std::stod(text.substr(text.rfind('(', at) + 1));
    const int shard = l.np / l.replicate;
    EXPECT_NEAR(per_param, 16.0 / shard, 0.01 * 16.0 / shard) << l.name;
    const auto got = jsonl_losses(tmp / (std::string(l.name) + "/metrics.jsonl"));
    ASSERT_EQ(got.size(), ref.size()) << l.name;
    for (size_t i = 0; i < ref.size(); ++i)
      EXPECT_NEAR(got[i], ref[i], 1e-5 * ref[i]) << l.name << " step " << i + 1;
  }
}

TEST(Trainer, EmbeddedDefaultRunEndToEnd) {
  // `titan train` with no arguments, cut to CI size by overrides: fortunes corpus, BPE tokenizer
  // trained by our trainer, debug flavor; checks the loss falls and every artifact is written.
  if (fortune_files().empty()) GTEST_SKIP() << "fortunes corpus not installed (scripts/setup.sh installs it)";
  TempDir tmp;
  std::string out;
  int rc = testing::run_titan("train --job.dump_folder=" + (tmp / "run") +
                                  " --training.steps=24 --training.local_batch_size=2 --training.seq_len=64"
                                  " --lr_scheduler.warmup_steps=4 --training.sample_tokens=12",
                              &out);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("step:   24"), std::string::npos) << out;
  EXPECT_NE(out.find("mfu:"), std::string::npos) << out;
  // Validation is on by default: the held-out split, after the last step (and every 100 steps).
  EXPECT_NE(out.find("validation: the held-out split of training.dataset"), std::string::npos) << out;
  EXPECT_NE(out.find("val_loss:"), std::string::npos) << out;
  EXPECT_NE(out.find("val_ppl:"), std::string::npos) << out;
  // metrics.jsonl: one object per step with the documented keys; the loss falls.
  std::ifstream f(tmp / "run/metrics.jsonl");
  std::string line;
  std::vector<double> losses;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    for (auto k : {"step", "loss", "grad_norm", "lr", "tokens", "tps", "tflops", "mfu", "mem_gib", "time_s"})
      EXPECT_TRUE(j.contains(k)) << k;
    losses.push_back(j["loss"].get<double>());
    if (j["step"] == 24) {
      ASSERT_TRUE(j.contains("val_loss") && j.contains("val_ppl")) << line;
      EXPECT_NEAR(j["val_ppl"].get<double>(), std::exp(j["val_loss"].get<double>()),
                  1e-9 * j["val_ppl"].get<double>());
      EXPECT_LT(j["val_loss"].get<double>(), losses[0]) << "the held-out loss did not fall";
    } else {
      EXPECT_FALSE(j.contains("val_loss")) << line;
    }
  }
  ASSERT_EQ(losses.size(), 24u);
  double first = (losses[0] + losses[1] + losses[2]) / 3, last = (losses[21] + losses[22] + losses[23]) / 3;
  EXPECT_LT(last, first - 0.5) << "loss did not fall: " << first << " -> " << last;
  // Artifacts: HF checkpoint that loads, tokenizer, loss curve, sample, resolved config.
  const std::string ckpt = tmp / "run/checkpoint/step-24";
  Qwen3Model m(Qwen3Config::from_hf_file(ckpt + "/config.json"));
  EXPECT_NO_THROW(m.load_hf(ckpt));
  EXPECT_TRUE(fs::exists(ckpt + "/tokenizer.json"));
  EXPECT_GT(fs::file_size(tmp / "run/loss.svg"), 500u);
  {
    std::ifstream svg(tmp / "run/loss.svg");
    const std::string text((std::istreambuf_iterator<char>(svg)), {});
    EXPECT_NE(text.find("validation loss"), std::string::npos);  // the validation curve's legend
  }
  EXPECT_TRUE(fs::exists(tmp / "run/sample.txt"));
  EXPECT_TRUE(fs::exists(tmp / "run/config.toml"));
}

TEST(Trainer, ShippedConfigsDryRun) {
  for (auto name : {"debug", "qwen3_4b_hf", "qwen3_4b_hf_lora", "qwen3_4b_native", "qwen3_moe_64e_top4_4l"}) {
    std::string out;
    int rc = testing::run_titan(std::string("train --config ") + name + " --dry-run", &out);
    EXPECT_EQ(rc, 0) << name << "\n" << out;
    EXPECT_NE(out.find("parameters:"), std::string::npos) << out;
    EXPECT_NE(out.find("FLOPs/token"), std::string::npos) << out;
    EXPECT_NE(out.find("memory per rank"), std::string::npos) << out;
  }
}

// An implementation this CPU cannot run (oneDNN's bf16 engine with the CPU capped at AVX2) is one error at
// validation naming the key, the implementation and the missing feature; a bad cap names the variable.
TEST(Trainer, KernelTheCpuCannotRunIsOneClearError) {
  auto& reg = KernelRegistry::global();
  const auto impls = reg.impls("matmul_bf16", DeviceType::CPU);
  if (std::find(impls.begin(), impls.end(), "onednn") != impls.end()) {  // a build with oneDNN
    std::string out;
    EXPECT_NE(testing::run_titan("train --dry-run --kernels.matmul_bf16=onednn", &out, "TITAN_CPU_ISA=avx2"),
              0);
    EXPECT_NE(out.find("kernels.matmul_bf16 = 'onednn': cannot run on this CPU: needs"), std::string::npos)
        << out;
    EXPECT_NE(out.find("avx512_bf16"), std::string::npos) << out;
    EXPECT_NE(out.find("(default here: sgemm)"), std::string::npos) << out;
  }
  std::string out;
  EXPECT_NE(testing::run_titan("train --dry-run", &out, "TITAN_CPU_ISA=avx3"), 0);
  EXPECT_NE(out.find("TITAN_CPU_ISA = 'avx3': unknown CPU ISA level"), std::string::npos) << out;
  EXPECT_EQ(out.find("terminate"), std::string::npos) << out;
}

// ---- TensorBoard event files ----

namespace {

uint64_t read_varint(const std::string& s, size_t& p) {
  uint64_t v = 0;
  for (int shift = 0; p < s.size(); shift += 7) {
    const uint8_t b = static_cast<uint8_t>(s[p++]);
    v |= uint64_t(b & 0x7F) << shift;
    if (!(b & 0x80)) break;
  }
  return v;
}

// The scalars of one Event (tag -> value) and its step, decoded field by field.
std::map<std::string, float> event_scalars(const std::string& ev, int64_t& step) {
  std::map<std::string, float> out;
  for (size_t p = 0; p < ev.size();) {
    const uint64_t key = read_varint(ev, p);
    const int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
    if (wire == 1) {
      p += 8;
    } else if (wire == 0) {
      const uint64_t v = read_varint(ev, p);
      if (field == 2) step = static_cast<int64_t>(v);
    } else if (wire == 2) {
      const uint64_t n = read_varint(ev, p);
      const std::string sub = ev.substr(p, n);
      p += n;
      if (field != 5) continue;
      for (size_t q = 0; q < sub.size();) {  // Summary.value
        read_varint(sub, q);
        const uint64_t vn = read_varint(sub, q);
        const std::string val = sub.substr(q, vn);
        q += vn;
        size_t r = 0;
        read_varint(val, r);
        const uint64_t tn = read_varint(val, r);
        const std::string tag = val.substr(r, tn);
        r += tn;
        EXPECT_EQ(read_varint(val, r), (2u << 3) | 5u);
        float x;
        std::memcpy(&x, val.data() + r, 4);
        out[tag] = x;
      }
    } else {
      ADD_FAILURE() << "unexpected wire type " << wire;
      break;
    }
  }
  return out;
}

}  // namespace

TEST(TensorBoard, Crc32cAndRecordFraming) {
  // CRC-32C check values (RFC 3720 B.4 and the usual "123456789").
  EXPECT_EQ(tb::crc32c("123456789", 9), 0xE3069283u);
  const std::string zeros(32, '\0'), ones(32, '\xff');
  EXPECT_EQ(tb::crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(tb::crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(tb::crc32c("6789", 4, tb::crc32c("12345", 5)), 0xE3069283u);  // continued
  // A record: length, masked CRC of the length, payload, masked CRC of the payload.
  const std::string rec = tb::tfrecord("hello");
  ASSERT_EQ(rec.size(), 8u + 4 + 5 + 4);
  uint64_t len;
  uint32_t c1, c2;
  std::memcpy(&len, rec.data(), 8);
  std::memcpy(&c1, rec.data() + 8, 4);
  std::memcpy(&c2, rec.data() + 17, 4);
  EXPECT_EQ(len, 5u);
  EXPECT_EQ(c1, tb::masked_crc32c(rec.data(), 8));
  EXPECT_EQ(c2, tb::masked_crc32c("hello", 5));
  const uint32_t crc = tb::crc32c("hello", 5);
  EXPECT_EQ(c2, ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
  int64_t step = -1;
  const auto sc = event_scalars(tb::scalar_event(1.5, 300, {{"loss", 2.5f}, {"mfu(%)", 41.25f}}), step);
  EXPECT_EQ(step, 300);
  EXPECT_EQ(sc.at("loss"), 2.5f);
  EXPECT_EQ(sc.at("mfu(%)"), 41.25f);
}

TEST(TensorBoard, TrainingWritesEveryStepsScalars) {
  TempDir tmp;
  auto args = small_run_args(tmp, 4);
  args.push_back("--metrics.enable_tensorboard=true");
  args.push_back("--metrics.save_tb_folder=board");
  const TrainResult r = run_training(parse_train_args(args));
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(tmp / "out/board"))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  std::ifstream in(files[0], std::ios::binary);
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> events;
  for (size_t p = 0; p < data.size();) {
    ASSERT_LE(p + 12, data.size());
    uint64_t len;
    uint32_t c;
    std::memcpy(&len, data.data() + p, 8);
    std::memcpy(&c, data.data() + p + 8, 4);
    ASSERT_EQ(c, tb::masked_crc32c(data.data() + p, 8));
    ASSERT_LE(p + 16 + len, data.size());
    events.push_back(data.substr(p + 12, len));
    std::memcpy(&c, data.data() + p + 12 + len, 4);
    ASSERT_EQ(c, tb::masked_crc32c(events.back().data(), len));
    p += 16 + len;
  }
  ASSERT_EQ(events.size(), 5u);  // the version, then one per step
  EXPECT_NE(events[0].find("brain.Event:2"), std::string::npos);
  for (size_t k = 1; k < events.size(); ++k) {
    int64_t step = -1;
    const auto sc = event_scalars(events[k], step);
    EXPECT_EQ(step, static_cast<int64_t>(k));
    EXPECT_EQ(sc.at("loss_metrics/global_avg_loss"), static_cast<float>(r.losses[k - 1]));
    for (const char* tag :
         {"grad_norm", "lr", "throughput(tps)", "tflops", "mfu(%)", "memory/max_reserved(GiB)"})
      EXPECT_TRUE(sc.count(tag)) << tag;
  }
}

// ---- preemption (train/preemption.h) ----

namespace {

// The arguments of small_run_args without the dump folder, checkpointing on (no periodic saves).
std::string preemption_args(const TempDir& tmp, int64_t steps, const std::string& batch) {
  std::string common;
  for (auto& a : small_run_args(tmp, steps))
    if (!a.starts_with("--job.dump_folder") && !a.starts_with("--training.local_batch_size"))
      common += " " + a;
  return common + " --training.local_batch_size=" + batch +
         " --checkpoint.enable=true --checkpoint.interval=1000";
}

int shell_status(const std::string& cmd) {
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

}  // namespace

TEST(Trainer, PreemptedRunSavesItsStepAndResumesBitExactly) {
  TempDir tmp;
  const std::string common = preemption_args(tmp, 8, "2");
  std::string out;
  ASSERT_EQ(testing::run_titan("train" + common + " --job.dump_folder=" + (tmp / "one"), &out), 0) << out;
  // SIGTERM during step 3: the step finishes, its checkpoint is saved, the status says "preempted".
  const std::string pre = "train" + common + " --job.dump_folder=" + (tmp / "pre");
  ASSERT_EQ(testing::run_titan(pre, &out, "TITAN_FAULT_INJECT=signal:TERM@3"), kPreemptedExitStatus) << out;
  EXPECT_NE(out.find("preempted: stopped after step 3; checkpoint "), std::string::npos) << out;
  EXPECT_TRUE(std::filesystem::exists(tmp / "pre/checkpoint/step-3/COMPLETE"));
  EXPECT_EQ(jsonl_losses(tmp / "pre/metrics.jsonl").size(), 3u);
  // The same command again resumes: the losses equal the uninterrupted run's, bit for bit.
  ASSERT_EQ(testing::run_titan(pre, &out), 0) << out;
  EXPECT_NE(out.find("resuming from"), std::string::npos) << out;
  EXPECT_EQ(jsonl_losses(tmp / "pre/metrics.jsonl"), jsonl_losses(tmp / "one/metrics.jsonl"));
  // A second signal stops at once: status 128 + SIGTERM, nothing saved.
  EXPECT_EQ(testing::run_titan("train" + common + " --job.dump_folder=" + (tmp / "twice"), &out,
                               "TITAN_FAULT_INJECT=signal:TERM*2@2"),
            128 + SIGTERM)
      << out;
  EXPECT_FALSE(std::filesystem::exists(tmp / "twice/checkpoint/step-2"));
}

// A SIGTERM / SIGUSR1 that lands while oneDNN's JIT f32 GEMM kernels run (they point rsp at a heap
// workspace: oneDNN issue #4845) must leave the heap intact: the guard's handler runs on alternate signal
// stacks. Before, a signal mid-step aborted ~2 runs in 3 under load ("corrupted size vs. prev_size"), and
// this test's child died within its first rounds. The child, 300 times: GEMMs until the signal sent to the
// computing thread arrives, then heap traffic and one more GEMM; it exits 0 when the result is right.
[[noreturn]] void signals_during_gemms() {
  const int64_t n = 512;  // a shape whose kernel runs with rsp in the heap (as do (32 x 256) x (256 x 256)^T)
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  const pthread_t computing = pthread_self();
  for (int round = 0; round < 300; ++round) {
    PreemptionGuard guard;  // a fresh one each round: its first signal is only noted
    std::thread sender([&] {
      std::this_thread::sleep_for(std::chrono::microseconds(100 + 389 * round % 2000));
      pthread_kill(computing, SIGUSR1);
    });
    while (!guard.requested())
      cpu::sgemm(false, true, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    sender.join();
    std::vector<float> heap(size_t(1) << (10 + round % 8), 1.0f);
    cpu::sgemm(false, false, n, n, n, heap[0], a.data(), n, b.data(), n, 0.0f, c.data(), n);
  }
  std::exit(c[0] == 0.5f * 0.25f * n ? 0 : 3);
}

TEST(Trainer, PreemptionSignalDuringGemmsLeavesTheHeapIntact) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(signals_during_gemms(), ::testing::ExitedWithCode(0), "");
}

TEST(Trainer, PreemptionStopsEveryRankAfterOneStep) {
  TempDir tmp;
  const std::string common = preemption_args(tmp, 30, "1");
  const std::string mpirun =
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 timeout 300 mpirun "
      "--oversubscribe --bind-to none -np 2 -x TITAN_FAULT_INJECT " +
      std::string(TITAN_BINARY) + " train" + common;
  auto run = [&](const std::string& dir, const std::string& inject) {
    return shell_status("TITAN_FAULT_INJECT=" + inject + " " + mpirun + " --job.dump_folder=" + (tmp / dir) +
                        " >> " + (tmp / dir) + ".log 2>&1");
  };
  ASSERT_EQ(run("ref", "none"), 0);
  const auto ref = jsonl_losses(tmp / "ref/metrics.jsonl");
  ASSERT_EQ(ref.size(), 30u);
  // SIGUSR1 on rank 1 only: both ranks stop after step 4 (they agree every step) with one checkpoint.
  ASSERT_EQ(run("usr1", "signal:USR1@4:rank1"), kPreemptedExitStatus);
  EXPECT_TRUE(std::filesystem::exists(tmp / "usr1/checkpoint/step-4/COMPLETE"));
  ASSERT_EQ(run("usr1", "none"), 0);
  EXPECT_EQ(jsonl_losses(tmp / "usr1/metrics.jsonl"), ref);
  // `titan run` turns SIGTERM into a preemption of every rank (mpirun forwards SIGUSR1 to them).
  const std::string log = tmp / "run.log";
  const std::string launch = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 " +
                             std::string(TITAN_BINARY) + " run --nproc-per-node 2 train" + common +
                             " --job.dump_folder=" + (tmp / "run");
  const int rc =
      shell_status("sh -c '" + launch + " > " + log + " 2>&1 & pid=$!; while ! grep -q \"step:    2\" " +
                   log + "; do sleep 0.05; done; kill -TERM $pid; wait $pid; exit $?'");
  std::ifstream in(log);
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  ASSERT_EQ(rc, kPreemptedExitStatus) << text;
  EXPECT_NE(text.find("titan run: the job was preempted"), std::string::npos) << text;
  EXPECT_EQ(text.find("MPI_ABORT"), std::string::npos) << text;  // the ranks finalize: no rank is killed
  const size_t stopped = jsonl_losses(tmp / "run/metrics.jsonl").size();
  EXPECT_LT(stopped, 30u);
  EXPECT_TRUE(std::filesystem::exists(tmp / ("run/checkpoint/step-" + std::to_string(stopped))));
  ASSERT_EQ(shell_status(launch + " > " + log + ".2 2>&1"), 0);
  EXPECT_EQ(jsonl_losses(tmp / "run/metrics.jsonl"), ref);
}

TEST(Trainer, FilesystemErrorsNameThePath) {
  // A library's filesystem error in titan's words: the path first, then what failed and why.
  TempDir tmp;
  const std::string file = tmp / "a-file";
  std::ofstream(file) << "x";
  std::string out;
  EXPECT_NE(
      testing::run_titan(
          "train --training.steps=1 --validation.enable=false --job.dump_folder=" + file + "/run", &out),
      0);
  EXPECT_NE(out.find("titan train: error: " + file + "/run: cannot create directories: Not a directory"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("filesystem error"), std::string::npos) << out;
}

TEST(Trainer, SelectiveActivationCheckpointingGivesTheSameLosses) {
  // torchtitan's mode = "selective" with selective_ac_option = "N" (every N-th layer checkpointed) or "op"
  // (GEMM and attention outputs kept, pointwise ops recomputed).
  TempDir a, b, c;
  const auto none = run_training(parse_train_args(small_run_args(a, 4)));
  auto sel = small_run_args(b, 4);
  sel.push_back("--activation_checkpoint.mode=selective");
  sel.push_back("--activation_checkpoint.selective_ac_option=2");
  EXPECT_EQ(run_training(parse_train_args(sel)).losses, none.losses);
  auto full = small_run_args(c, 4);
  full.push_back("--activation_checkpoint.mode=full");
  EXPECT_EQ(run_training(parse_train_args(full)).losses, none.losses);
  TempDir d;
  auto op = small_run_args(d, 4);
  op.push_back("--activation_checkpoint.mode=selective");
  op.push_back("--activation_checkpoint.selective_ac_option=op");
  EXPECT_EQ(run_training(parse_train_args(op)).losses, none.losses);
  EXPECT_NE(testing::error_of([] {
              parse_train_args({"--activation_checkpoint.mode=selective",
                                "--activation_checkpoint.selective_ac_option=0"});
            }).find("or a positive integer N"),
            std::string::npos);
}

TEST(Trainer, PlanCountsEachActivationCheckpointingMode) {
  // The plan's activations (Qwen3-8B, 4 x 4096 tokens per rank): none > op > every 2nd + op, and
  // none > every 2nd > full; the op policy saves the pointwise outputs of all but one layer.
  const Qwen3Config c = Qwen3Config::flavor("8B");
  auto acts = [&](int64_t every, bool ops) {
    return make_plan(c, 1, 1, 1, 4, 4, 4096, CheckpointPolicy{every, ops}).activation_bytes;
  };
  const int64_t none = acts(0, false), op = acts(0, true), two = acts(2, false), full = acts(1, false),
                two_op = acts(2, true);
  EXPECT_LT(op, none);
  EXPECT_LT(two, none);
  EXPECT_LT(full, two);
  EXPECT_LT(two_op, op);
  EXPECT_LT(two_op, two);
  const int64_t N = 4 * 4096;
  const int64_t pointwise = N * (2 * c.hidden_size + c.q_dim() + c.kv_dim() + c.intermediate_size);
  EXPECT_EQ(none - op, 4 * (c.num_hidden_layers - 1) * pointwise);
  EXPECT_EQ(parse_train_args(
                {"--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"})
                .activation_checkpoint.policy()
                .recompute_ops,
            true);
}

TEST(Trainer, PlanCountsBf16ActivationsAsTheModelAllocatesIt) {
  // Under bf16 compute a layer saves bf16 q/k/v and attention output instead of f32 q/k/v after RoPE and the
  // f32 output (o_proj reads the bf16 one; q/k/v become scratch shared by the layers, with the backward's
  // bf16 gradients), bf16 q/k before their norms, a dense layer bf16 gate/up and SwiGLU output, bf16 norm
  // outputs (ln1, ln2) and a bf16 residual stream (resid_mid, and the layer input but the first layer's):
  // the plan's saved bytes per layer move as the model's own allocation does (up to the alignment reserve
  // of the twelve bf16 buffers).
  Qwen3Config c = Qwen3Config::flavor("debug");
  c.num_hidden_layers = 2;
  const int64_t B = 2, T = 32, N = B * T, L = c.num_hidden_layers;
  auto model_saved = [&](bool bf16) {
    Qwen3Model m(c);
    m.init_weights(1);
    m.set_bf16_compute(bf16);
    std::vector<int32_t> ids(N, 3);
    m.forward(ids.data(), ids.data(), B, T);
    return m.activation_bytes();
  };
  const int64_t model_delta = model_saved(false) - model_saved(true);
  auto plan = [&](bool bf16, int64_t cp = 1) {
    return make_plan(c, cp, 1, 1, B, B, T, CheckpointPolicy{}, 1, 1, false, {}, cp, bf16);
  };
  const RunPlan f32 = plan(false), bf16 = plan(true);
  EXPECT_FALSE(f32.bf16_attention || f32.bf16_qk || f32.bf16_mlp || f32.bf16_norms);
  EXPECT_TRUE(bf16.bf16_attention && bf16.bf16_qk && bf16.bf16_mlp && bf16.bf16_norms);
  // (bf16 dq/dk/dv/datt and the q/k projections' gradients beside the model's activations; qk_norm_rope
  // writes q16/k16 and the v GEMM v16 directly, so no f32 q/k/v scratch)
  const int64_t H = c.hidden_size, I = c.intermediate_size, qk = c.q_dim() + c.kv_dim();
  const int64_t scratch = 4 * N * qk + 2 * N * qk;
  const int64_t plan_delta = f32.activation_bytes - bf16.activation_bytes + scratch;
  // (attention: q/k/v after RoPE and the output; half of q/k before their norms; MLP: half of gate/up and
  // act; half of ln1 and ln2; half of the residual stream but the first layer's f32 input, less the f32
  // buffer o_proj and the MLP write before their residual adds; the f32 dq/dk of RoPE's backward, which
  // qk_norm_rope's does not need; half of the backward's d(gate/up); the f32 d(q/k/v) the GEMMs no longer
  // read)
  EXPECT_EQ(plan_delta, 4 * L * N * qk + 4 * L * N * qk / 2 + 4 * L * N * 3 * I / 2 + 4 * L * N * H +
                            4 * L * N * H - 2 * N * H - 4 * N * H + 4 * N * qk + 4 * N * I +
                            4 * N * (c.q_dim() + 2 * c.kv_dim()));
  // (the model reserves up to 3 floats of alignment before each of the twelve bf16 buffers of a layer)
  EXPECT_LE(std::abs(plan_delta - model_delta), 4 * L * 12 * 4) << plan_delta << " vs " << model_delta;
  EXPECT_NE(bf16.describe().find("(bf16: attention, q/k projections, MLP, norm outputs, residual stream)"),
            std::string::npos);
  // Context parallel keeps the ring's blocks f32: there bf16 compute changes the MLP's and norms' tensors.
  EXPECT_FALSE(plan(true, 2).bf16_attention);
  EXPECT_TRUE(plan(true, 2).bf16_qk && plan(true, 2).bf16_mlp && plan(true, 2).bf16_norms);
  EXPECT_NE(plan(true, 2).describe().find("(bf16: q/k projections, MLP, norm outputs, residual stream)"),
            std::string::npos);
  EXPECT_EQ(plan(false, 2).activation_bytes - plan(true, 2).activation_bytes,
            4 * L * (N / 2) * (qk / 2 + 3 * I / 2 + 2 * H) - 6 * (N / 2) * H +
                4 * (N / 2) * I);  // (+ half of d(gate/up))
}

// Pipeline stages as torchtitan splits them (the embedding and the head weigh one layer each), the
// placement of looped schedules, each schedule's bubble and in-flight micro-batches, and the plan per
// pipeline rank: every parameter on exactly one rank (a tied lm_head copied to the last), 1F1B's first
// rank holding p micro-batches, context parallel cutting activations.
TEST(Trainer, PipelineAndContextParallelPlans) {
  using dist::make_pipeline_layout;
  const auto one_f_one_b = make_pipeline_layout(36, 8, {4, "1F1B", 1, 0, 1, 1});
  ASSERT_EQ(one_f_one_b.stages.size(), 4u);
  const std::vector<std::pair<int64_t, int64_t>> want = {{0, 9}, {9, 10}, {19, 9}, {28, 8}};
  for (size_t s = 0; s < want.size(); ++s) {
    EXPECT_EQ(one_f_one_b.stages[s].first_layer, want[s].first) << s;
    EXPECT_EQ(one_f_one_b.stages[s].num_layers, want[s].second) << s;
    EXPECT_EQ(one_f_one_b.stages[s].rank, (int64_t)s);
    EXPECT_EQ(one_f_one_b.stages[s].embedding, s == 0);
    EXPECT_EQ(one_f_one_b.stages[s].head, s == 3);
  }
  EXPECT_EQ(one_f_one_b.microbatches, 8);
  EXPECT_DOUBLE_EQ(one_f_one_b.bubble_fraction(), 3.0 / 11.0);
  EXPECT_EQ(one_f_one_b.peak_inflight(0), 4.0);
  EXPECT_EQ(one_f_one_b.peak_inflight(3), 1.0);
  EXPECT_EQ(make_pipeline_layout(36, 2, {4, "1F1B", 1, 0, 1, 1}).peak_inflight(0), 2.0);
  EXPECT_EQ(make_pipeline_layout(36, 8, {4, "GPipe", 1, 0, 1, 1}).peak_inflight(3), 8.0);
  // Interleaved1F1B: two stages per rank, rank r runs stages r and r + p; the bubble shrinks by v.
  const auto looped = make_pipeline_layout(8, 4, {2, "Interleaved1F1B", 1, 0, 1, 1});
  ASSERT_EQ(looped.stages.size(), 4u);
  EXPECT_EQ(looped.stages_of(0), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(looped.stages[1].first_layer, 2);
  EXPECT_EQ(looped.stages[1].num_layers, 3);
  EXPECT_EQ(looped.stages[3].num_layers, 1);
  EXPECT_DOUBLE_EQ(looped.bubble_fraction(), 1.0 / 9.0);
  EXPECT_DOUBLE_EQ(looped.peak_inflight(0), 5.0 / 2.0);  // ((v - 1) p + 2 (p - 1) + 1) / v
  EXPECT_EQ(make_pipeline_layout(8, 4, {2, "Interleaved1F1B", 1, 2, 0, 0}).stages.size(), 4u);
  // Without a pipeline the micro-batch size is not used: the local batch is one forward.
  EXPECT_EQ(make_pipeline_layout(8, 6, {1, "1F1B", 4, 0, 1, 1}).microbatches, 1);

  // Every parameter on one pipeline rank; a tied lm_head is the embedding's copy on the last stage.
  for (const char* flavor : {"8B", "0.6B"}) {
    const Qwen3Config c = Qwen3Config::flavor(flavor);
    const RunPlan plan =
        make_plan(c, 4, 1, 1, 8, 8, 1024, CheckpointPolicy{}, 1, 1, false, {4, "1F1B", 1, 0, 1, 1});
    ASSERT_EQ(plan.per_stage_rank.size(), 4u);
    int64_t params = 0;
    for (const auto& r : plan.per_stage_rank) params += r.param_bytes / 4;
    EXPECT_EQ(params, c.num_params() + (c.tie_word_embeddings ? c.vocab_size * c.hidden_size : 0)) << flavor;
    // 1F1B: rank 0 keeps 4 micro-batches, the last rank 1; GPipe keeps all 8 everywhere.
    EXPECT_GT(plan.per_stage_rank[0].activation_bytes, 2 * plan.per_stage_rank[3].activation_bytes);
    const RunPlan gpipe =
        make_plan(c, 4, 1, 1, 8, 8, 1024, CheckpointPolicy{}, 1, 1, false, {4, "GPipe", 1, 0, 1, 1});
    EXPECT_GT(gpipe.per_stage_rank[0].activation_bytes, plan.per_stage_rank[0].activation_bytes);
    // The pipeline's own traffic: a middle rank sends each micro-batch's (1024, H) f32 activations forward
    // and their gradients backward.
    EXPECT_DOUBLE_EQ(plan.per_stage_rank[1].pp_comm_bytes, 2.0 * 8 * 1024 * c.hidden_size * 4);
  }
  // Context parallel 2: each rank keeps the activations of half of each sequence and shards the
  // parameters with the data-parallel shards; the ring passes K/V (and dK/dV) chunks.
  const Qwen3Config c = Qwen3Config::flavor("8B");
  const RunPlan one = make_plan(c, 1, 1, 1, 1, 1, 32768, CheckpointPolicy{});
  const RunPlan cp2 = make_plan(c, 2, 1, 1, 1, 1, 32768, CheckpointPolicy{}, 1, 1, false, {}, 2);
  EXPECT_LT(cp2.activation_bytes, 0.55 * one.activation_bytes);
  EXPECT_EQ(cp2.shard_params, (c.num_params() + 1) / 2);
  // (per layer: K and V one hop forward and backward, their gradients two hops)
  EXPECT_DOUBLE_EQ(cp2.cp_comm_bytes, 8.0 * c.num_hidden_layers * 16384 * c.kv_dim() * 4);

  // Bad layouts: one error naming the keys and the numbers.
  const Qwen3Config debug = Qwen3Config::flavor("debug");  // 4 layers
  EXPECT_NE(error_of([&] {
              make_plan(debug, 8, 1, 1, 8, 8, 64, {}, 1, 1, false, {8, "1F1B", 1, 0, 1, 1});
            })
                .find("parallelism.pipeline_parallel_degree = 8 x 1 stages per rank = 8 stages for model "
                      "num_hidden_layers = 4 (+ 1 + 1 for the embedding and the head: 6 effective layers): "
                      "more stages than layers"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              make_plan(debug, 2, 1, 1, 6, 6, 64, {}, 1, 1, false, {2, "1F1B", 4, 0, 1, 1});
            })
                .find("training.local_batch_size = 6 is not a multiple of "
                      "parallelism.pipeline_parallel_microbatch_size = 4"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              make_plan(debug, 2, 1, 1, 3, 3, 64, {}, 1, 1, false, {2, "Interleaved1F1B", 1, 0, 0, 0});
            }).find("3 is not a multiple of 2"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              make_plan(debug, 2, 1, 1, 4, 4, 64, {}, 1, 1, false, {2, "1F1B", 1, 2, 1, 1});
            }).find("layers_per_stage = 2 gives 3 stages"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              make_plan(debug, 2, 1, 1, 4, 4, 64, {}, 1, 1, false, {2, "ZeroBubble"});
            })
                .find("parallelism.pipeline_parallel_schedule = 'ZeroBubble' is not one of GPipe, 1F1B, "
                      "Interleaved1F1B"),
            std::string::npos);
  EXPECT_NE(error_of([&] { make_plan(debug, 4, 1, 1, 1, 1, 6, {}, 1, 1, false, {}, 4); })
                .find("parallelism.context_parallel_degree = 4 splits training.seq_len = 6 into 2 x 4 = 8 "
                      "chunks (two mirrored chunks per rank): seq_len must be at least 8"),
            std::string::npos);
  // Through the CLI: titan plan prints the layout; titan train refuses what it does not run yet.
  std::string out;
  ASSERT_EQ(testing::run_titan(
                "plan --nproc 8 --model.flavor=8B --training.local_batch_size=8 --training.seq_len=2048 "
                "--parallelism.pipeline_parallel_degree=4 --parallelism.tensor_parallel_degree=2",
                &out),
            0)
      << out;
  EXPECT_NE(out.find("pipeline: 1F1B, 4 stages (1 per rank), 8 micro-batches of 1 x 2048 tokens per "
                     "accumulation step; bubble 27.3% of the step"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("stage 3 (pipeline rank 3): layers 28-35 + norm + lm_head"), std::string::npos) << out;
  EXPECT_NE(
      testing::run_titan("plan --nproc 6 --model.flavor=8B --parallelism.pipeline_parallel_degree=4", &out),
      0);
  EXPECT_NE(out.find("--nproc 6 is not a multiple of"), std::string::npos) << out;
  // titan train: a world the pipeline degree does not divide is refused before anything else.
  EXPECT_NE(testing::run_titan("train --dry-run --parallelism.pipeline_parallel_degree=2", &out), 0);
  EXPECT_NE(out.find("parallelism.pipeline_parallel_degree = 2 does not divide the world size 1"),
            std::string::npos)
      << out;
  // ... and what context parallel does not run with yet, or a world it does not divide.
  EXPECT_NE(testing::run_titan("train --dry-run --parallelism.context_parallel_degree=2", &out), 0);
  EXPECT_NE(out.find("parallelism.context_parallel_degree (2) x tensor_parallel_degree (1) x "
                     "pipeline_parallel_degree (1) does not divide the world size 1"),
            std::string::npos)
      << out;
  EXPECT_NE(
      testing::run_titan("train --dry-run --parallelism.context_parallel_degree=2 --model.flavor=debug_moe "
                         "--training.seq_len=30",
                         &out),
      0);
  EXPECT_NE(out.find("parallelism.context_parallel_degree = 2: context parallel does not run with a MoE "
                     "model whose training.seq_len (30) is not a multiple of 2 x context_parallel_degree (4"),
            std::string::npos)
      << out;
  // Expert parallel over the data-parallel x context-parallel ranks.
  EXPECT_NE(
      testing::run_titan("plan --nproc 4 --model.flavor=debug_moe --parallelism.context_parallel_degree=2 "
                         "--parallelism.data_parallel_replicate_degree=2 "
                         "--parallelism.expert_parallel_degree=8",
                         &out),
      0);
  EXPECT_NE(
      out.find("expert_parallel_degree = 8 does not divide the data-parallel degree 4 (data-parallel 2 x "
               "context_parallel_degree 2)"),
      std::string::npos)
      << out;
}

TEST(Trainer, GpuRooflineCountsEachOpClass) {
  // Qwen3-1.7B, bf16, 1 x 4096 tokens on one H100: the GEMM class holds the model's GEMM FLOPs (the
  // training FLOPs/token less its attention term), attention the causal triangle's, the optimizer one pass
  // over the parameters; the target of the bf16 GPU step is >= 45% MFU.
  const Qwen3Config c = Qwen3Config::flavor("1.7B");
  const int64_t T = 4096;
  const RunPlan plan = make_plan(c, 1, 1, 1, 1, 1, T, CheckpointPolicy{});
  const GpuStepPrediction h100 = predict_gpu_step(c, plan, CheckpointPolicy{}, gpu_spec("h100"), true);
  ASSERT_GE(h100.ops.size(), 5u);
  const double attention_term = 12.0 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * T;
  EXPECT_NEAR(h100.ops[0].flops, (c.training_flops_per_token(T) - attention_term) * T,
              1e-9 * h100.ops[0].flops);
  const double pairs = T * (T + 1) / 2.0 * c.num_attention_heads * c.num_hidden_layers;
  EXPECT_DOUBLE_EQ(h100.ops[1].flops, 4.0 * c.head_dim * pairs);
  EXPECT_DOUBLE_EQ(h100.ops[2].flops, 2.5 * h100.ops[1].flops);
  double sum = 0;
  for (const auto& o : h100.ops) {
    sum += o.seconds;
    EXPECT_GT(o.seconds, 0) << o.name;
  }
  EXPECT_DOUBLE_EQ(h100.gpu_seconds, sum);
  EXPECT_NEAR(h100.tokens_per_s, T / h100.step_seconds, 1e-6);
  EXPECT_NEAR(h100.mfu, c.training_flops_per_token(T) * h100.tokens_per_s / 989.4e12, 1e-12);
  EXPECT_GE(h100.mfu, 0.45) << h100.describe();
  EXPECT_LE(h100.mfu, 0.75);
  // Faster memory helps only the memory-bound classes; the B200 is faster still; f32 (CUDA cores) slower.
  const auto h200 = predict_gpu_step(c, plan, CheckpointPolicy{}, gpu_spec("h200"), true);
  EXPECT_DOUBLE_EQ(h200.ops[0].seconds, h100.ops[0].seconds);
  EXPECT_LT(h200.ops[3].seconds, h100.ops[3].seconds);
  EXPECT_LT(predict_gpu_step(c, plan, CheckpointPolicy{}, gpu_spec("b200"), true).step_seconds,
            h200.step_seconds);
  EXPECT_GT(predict_gpu_step(c, plan, CheckpointPolicy{}, gpu_spec("h100"), false).step_seconds,
            4 * h100.step_seconds);
  // Full activation checkpointing runs the forward GEMMs twice: 8/6 of the GEMM FLOPs (lm_head aside).
  const auto full = predict_gpu_step(c, plan, CheckpointPolicy{1, false}, gpu_spec("h100"), true);
  EXPECT_GT(full.ops[0].flops, h100.ops[0].flops);
  EXPECT_LT(full.mfu, h100.mfu);
  // FSDP over 8 GPUs adds (mostly overlapped) collectives; tensor parallel 2 adds exposed ones.
  const auto fsdp = predict_gpu_step(c, make_plan(c, 8, 1, 8, 1, 8, T, CheckpointPolicy{}),
                                     CheckpointPolicy{}, gpu_spec("h100"), true);
  EXPECT_EQ(fsdp.ops.back().name, "data-parallel collectives (exposed)");
  const auto tp = predict_gpu_step(c, make_plan(c, 2, 1, 1, 1, 1, T, CheckpointPolicy{}, 1, 2, true),
                                   CheckpointPolicy{}, gpu_spec("h100"), true);
  EXPECT_EQ(tp.ops.back().name, "tensor-parallel collectives");
  EXPECT_NE(testing::error_of([] { gpu_spec("a100"); }).find("known: h100, h200, b200"), std::string::npos);
  // The command line.
  std::string out;
  ASSERT_EQ(testing::run_titan("plan --gpu h100 --model.flavor=1.7B --training.seq_len=4096 "
                               "--training.mixed_precision_param=bfloat16",
                               &out),
            0)
      << out;
  EXPECT_NE(out.find("roofline on one h100"), std::string::npos) << out;
  EXPECT_NE(out.find("attention backward (cuDNN SDPA)"), std::string::npos) << out;
  EXPECT_NE(out.find("MFU"), std::string::npos) << out;
  EXPECT_NE(testing::run_titan("plan --gpu a100", &out), 0);
  EXPECT_NE(out.find("unknown GPU 'a100'"), std::string::npos) << out;
}

TEST(Trainer, CompileOnTheCpuChangesNothing) {
  // The CPU step is native code with a fixed memory plan: compile.enable is accepted, said once, and the
  // losses are those of the eager run, bit for bit.
  TempDir a, b;
  const auto ref = run_training(parse_train_args(small_run_args(a, 4)));
  auto args = small_run_args(b, 4);
  args.push_back("--compile.enable=true");
  args.push_back("--compile.components=[\"model\"]");
  args.push_back("--compile.backend=inductor");
  ::testing::internal::CaptureStdout();
  const auto got = run_training(parse_train_args(args));
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(got.losses, ref.losses);
  EXPECT_NE(out.find("compile: the CPU device's step is already compiled native code"), std::string::npos);
  // Keys as torchtitan names them, validated; the CUDA device refuses it (no CUDA-graph capture yet).
  EXPECT_NE(testing::error_of([&] { parse_train_args({"--compile.backend=tvm"}); }).find("compile.backend"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] {
              parse_train_args({"--compile.components=[\"optimizer\"]"});
            }).find("compile.components"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] {
              parse_train_args({"--compile.enable=true", "--job.device=guard"});
            }).find("compile.enable = true on job.device = 'guard'"),
            std::string::npos);
}

// "loss": ..., "grad_norm": ... and "val_loss": ... of every logged step of a metrics.jsonl, as written.
std::vector<std::string> logged_losses(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> out;
  for (std::string line; std::getline(f, line);)
    for (const char* key : {"\"loss\": ", "\"grad_norm\": ", "\"val_loss\": "})
      if (auto at = line.find(key); at != std::string::npos)
        out.push_back(line.substr(at, line.find_first_of(",}", at) - at));
  return out;
}

// `titan train` (args: small_run_args' for `steps` steps, then `extra`) on the CUDA device eagerly and in
// compile mode, each its own process (on the emulator: titan_sim): the logged losses, norms and validation
// losses are equal as written (17 digits); `entries` of them. `prepare` may set up files in the run's
// directory and return more arguments.
void expect_compile_equals_eager(int64_t steps, std::string extra, size_t entries,
                                 const std::function<std::string(const TempDir&)>& prepare = {}) {
  TempDir tmp;
  if (prepare) extra += " " + prepare(tmp);
  std::vector<std::string> logs;
  for (const char* compile : {"false", "true"}) {
    std::string args = "train";
    for (const std::string& a : small_run_args(tmp, steps, std::string("out_") + compile)) args += " " + a;
    args += " --job.device=cuda --metrics.log_freq=1 " + extra + " --compile.enable=" + compile;
    std::string out;
    ASSERT_EQ(testing::run_titan(args, &out), 0) << extra << "\n" << out;
    if (std::string(compile) == "true") {
      EXPECT_NE(out.find("compile: the training step is captured into a CUDA graph"), std::string::npos)
          << out;
    }
    logs.push_back(tmp / (std::string("out_") + compile + "/metrics.jsonl"));
  }
  const auto eager = logged_losses(logs[0]), compiled = logged_losses(logs[1]);
  EXPECT_EQ(eager.size(), entries) << extra;
  EXPECT_EQ(compiled, eager) << extra;
}

// Compile mode on a GPU: the step captured into a CUDA graph after one eager step and launched on every
// step after gives the eager run's losses bit for bit, in f32, under bf16 mixed precision (the bf16 weight
// refresh inside the graph) and with activation checkpointing plus gradient accumulation (two micro-batches
// staged and run in one graph), across validations (the graph captured again after another shape ran),
// and with training.skip_nan_inf.
TEST(Trainer, CudaCompileModeEqualsEagerBitForBit) {
  TITAN_SKIP_WITHOUT_CUDA_GPU();
  const std::string validation =
      "--training.val_fraction=0.1 --validation.enable=true --validation.freq=2 --validation.steps=1 ";
  for (const char* mode :
       {"--training.mixed_precision_param=float32", "--training.mixed_precision_param=bfloat16",
        "--activation_checkpoint.mode=full --training.global_batch_size=4"}) {
    // 5 steps, validations after steps 2, 4 and 5
    expect_compile_equals_eager(5, validation + mode, 2 * 5u + 3u);
  }
  // training.skip_nan_inf: the losses turn non-finite after the second step (a huge learning rate); the
  // graph's AdamW skips such steps (the count of non-finite losses taken on the device) as eager mode does.
  expect_compile_equals_eager(4,
                              "--optimizer.lr=1e30 --training.max_norm=0 --lr_scheduler.warmup_steps=0"
                              " --training.skip_nan_inf=true",
                              2 * 2u);  // (steps 3 and 4 skipped, not logged)
}

// Compile mode with a MoE model: the routed experts' 'device_routed' kernels (routing and GEMM sizes on the
// device), the aux loss kept on the device per micro-batch, the aux-loss-free bias update inside the graph.
// Losses and norms equal eager mode's on the same kernels bit for bit: with the HF aux loss over two
// micro-batches, and with the expert bias under bf16 mixed precision.
TEST(Trainer, CudaCompileModeTrainsMoeBitForBit) {
  TITAN_SKIP_WITHOUT_CUDA_GPU();
  const std::string moe =
      "--model.flavor=debug_moe --kernels.moe_experts=device_routed --kernels.moe_experts_bf16=device_routed";
  expect_compile_equals_eager(3, moe + " --model.moe_aux_loss=on --training.global_batch_size=4", 2 * 3u);
  expect_compile_equals_eager(
      3, moe + " --model.load_balance_coeff=0.001 --training.mixed_precision_param=bfloat16", 2 * 3u);
  // The host-routed kernel is swapped for the device-routed one, said once.
  TempDir c;
  std::string args = "train";
  for (const std::string& a : small_run_args(c, 1)) args += " " + a;
  std::string out;
  ASSERT_EQ(
      testing::run_titan(args + " --job.device=cuda --model.flavor=debug_moe --kernels.moe_experts=grouped"
                                " --compile.enable=true",
                         &out),
      0)
      << out;
  EXPECT_NE(out.find("compile: kernels.moe_experts = 'grouped' routes on the host; the captured step runs "
                     "'device_routed'"),
            std::string::npos)
      << out;
}

// Compile mode with LoRA: the adapters' step captured, on the frozen bf16 base with dropout (each
// micro-batch's pass number, the masks' key, staged on the device; the activation-checkpointing recompute
// redraws them), and on an f32 base under bf16 mixed precision.
TEST(Trainer, CudaCompileModeTrainsLoraBitForBit) {
  TITAN_SKIP_WITHOUT_CUDA_GPU();
  expect_compile_equals_eager(3,
                              "--lora.enable=true --lora.dropout=0.1 --activation_checkpoint.mode=full "
                              "--training.global_batch_size=4",
                              2 * 3u);
  expect_compile_equals_eager(
      3, "--lora.enable=true --lora.base_dtype=float32 --training.mixed_precision_param=bfloat16", 2 * 3u);
}

// Compile mode with chat data: each step's loss scale (1 / the step's assistant targets, counted on the
// host) and, for packed rows, the RoPE rows and document starts are staged before the launch. Over two
// micro-batches per step, unpacked and packed, the losses and norms equal eager mode's bit for bit.
TEST(Trainer, CudaCompileModeTrainsChatDataBitForBit) {
  TITAN_SKIP_WITHOUT_CUDA_GPU();
  const std::string qwen = testing::source_path("../shared/assets/qwen3-tokenizer");
  if (!fs::exists(qwen + "/tokenizer_config.json"))
    GTEST_SKIP() << "the Qwen3 chat template is not at " << qwen << " (../shared beside the repo is absent)";
  // The small tokenizer with the Qwen3 chat template beside it (a small model).
  auto chat_tokenizer = [&](const TempDir& tmp) {
    fs::create_directories(tmp / "tok");
    fs::copy_file(testing::source_path("tests/golden/tokenizer/small/tokenizer.json"),
                  tmp / "tok/tokenizer.json");
    fs::copy_file(qwen + "/tokenizer_config.json", tmp / "tok/tokenizer_config.json");
    return "--model.tokenizer_path=" + (tmp / "tok");
  };
  for (const char* packing : {"false", "true"}) {
    expect_compile_equals_eager(
        3,
        "--training.dataset=" + testing::source_path("tests/golden/chat/train.jsonl") +
            " --training.dataset_format=chat --training.seq_len=48"
            " --training.global_batch_size=4 --training.packing=" +
            packing,
        2 * 3u, chat_tokenizer);
  }
}

TEST(Trainer, MoeConfigTrainsWhenScaledDown) {
  // Configuration 3 (64 experts, top-4, 4 layers, kernels from the override registry) cut to the
  // debug_moe flavor; once with the HF aux loss, once with aux-loss-free balancing.
  for (const char* balance : {"0.0", "0.001"}) {
    TempDir tmp;
    std::string common;
    for (auto& a : small_run_args(tmp, 8))
      if (!a.starts_with("--training.steps")) common += " " + a;
    std::string out;
    int rc = testing::run_titan(
        "train --config qwen3_moe_64e_top4_4l --model.flavor=debug_moe --training.steps=8" + common +
            " --model.load_balance_coeff=" + balance,
        &out);
    ASSERT_EQ(rc, 0) << out;
    EXPECT_NE(out.find("moe_experts=grouped"), std::string::npos) << out;
    EXPECT_NE(out.find("rope=fused"), std::string::npos) << out;
    auto losses = jsonl_losses(tmp / "out/metrics.jsonl");
    ASSERT_EQ(losses.size(), 8u);
    EXPECT_LT(losses.back(), losses.front()) << balance;
    Qwen3Model back(Qwen3Config::from_hf_file(tmp / "out/checkpoint/step-8/config.json"));
    EXPECT_EQ(back.config().num_experts, 8);
    EXPECT_NO_THROW(back.load_hf(tmp / "out/checkpoint/step-8"));
  }
}

TEST(Trainer, HfConfigTrainsWhenScaledDown) {
  // Configuration 1 with a tiny local HF directory standing in for Qwen3-4B-Instruct-2507.
  TempDir tmp;
  Qwen3Config c = Qwen3Config::flavor("debug");
  c.vocab_size = 1024;
  c.num_hidden_layers = 2;
  Qwen3Model m(c);
  m.init_weights(3);
  m.save_hf(tmp / "hf", DType::BF16);
  fs::copy_file(testing::source_path("tests/golden/tokenizer/small/tokenizer.json"),
                tmp / "hf/tokenizer.json");
  std::ofstream(tmp / "corpus.txt") << std::string(4000, 'a') << " hello world";
  std::string out;
  int rc = testing::run_titan("train --config qwen3_4b_hf --job.dump_folder=" + (tmp / "run") +
                                  " --model.hf_assets_path=" + (tmp / "hf") +
                                  " --checkpoint.initial_load_path=" + (tmp / "hf") +
                                  " --training.dataset=" + (tmp / "corpus.txt") +
                                  " --training.seq_len=32 --training.global_batch_size=4 --training.steps=2"
                                  " --training.sample_tokens=4 --metrics.peak_tflops=1"
                                  " --training.val_fraction=0 --validation.enable=false",
                              &out);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("gradient accumulation 4 steps"), std::string::npos) << out;
  EXPECT_NE(out.find("loading HF weights"), std::string::npos) << out;
  Qwen3Model back(Qwen3Config::from_hf_file(tmp / "run/checkpoint/step-2/config.json"));
  EXPECT_NO_THROW(back.load_hf(tmp / "run/checkpoint/step-2"));
}

// ---- validation ----

// small_run_args with validation on the 20% held-out split of the corpus.
std::vector<std::string> validation_args(const TempDir& tmp, int64_t steps, int64_t freq) {
  auto args = small_run_args(tmp, steps);
  for (const std::string a : {"--validation.enable=true", "--training.val_fraction=0.2"}) args.push_back(a);
  args.push_back("--validation.freq=" + std::to_string(freq));
  return args;
}

// step -> val_loss of the records of metrics.jsonl that have one.
std::map<int64_t, double> jsonl_val_losses(const std::string& path) {
  std::map<int64_t, double> out;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) out[j["step"].get<int64_t>()] = j["val_loss"].get<double>();
  }
  return out;
}

TEST(Validation, LossEqualsTheForwardToolMeanOverTheSameWindows) {
  // 3 steps, validation after the last; then `titan forward` on the exported model over the windows of
  // the held-out split, read by a loader of our own (each window of seq_len + 1 tokens as one row: its
  // seq_len targets are the window's next tokens, as in training).
  TempDir tmp;
  const auto r = run_training(parse_train_args(validation_args(tmp, 3, 100)));
  ASSERT_EQ(r.val_losses.size(), 1u);
  EXPECT_EQ(r.val_losses[0].first, 3);
  const double val = r.val_losses[0].second;
  EXPECT_EQ(jsonl_val_losses(tmp / "out/metrics.jsonl"), (std::map<int64_t, double>{{3, val}}));

  data::DataConfig dc;
  dc.sources = {tmp / "corpus.txt"};
  dc.delimiter = data::DocDelimiter::Percent;
  dc.tokenizer = testing::source_path("tests/golden/tokenizer/small");
  dc.seq_len = 32;
  dc.batch_size = 2;
  dc.seed = 42;
  dc.val_fraction = 0.2;
  dc.split = data::Split::Validation;
  dc.max_epochs = 1;
  data::DataLoader loader(dc);
  nlohmann::json rows = nlohmann::json::array();
  for (data::Batch b; loader.next_batch(b);)
    for (int64_t i = 0; i < b.batch_size; ++i) {
      std::vector<int32_t> w(b.input_ids.begin() + i * 32, b.input_ids.begin() + (i + 1) * 32);
      w.push_back(b.labels[i * 32 + 31]);
      rows.push_back(w);
    }
  ASSERT_GE(rows.size(), 4u);
  std::ofstream(tmp / "windows.json") << nlohmann::json{{"input_ids", rows}}.dump();
  ForwardToolOptions fo;
  fo.model_dir = tmp / "out/checkpoint/step-3";
  fo.input_path = tmp / "windows.json";
  fo.output_path = tmp / "forward.safetensors";
  run_forward_tool(fo);
  const double forward = SafetensorsFile(fo.output_path).load("loss").f32()[0];
  // Within the float32 rounding of the tool's stored loss (half an ulp is 5e-8 relative).
  EXPECT_NEAR(val, forward, 1e-7 * forward) << rows.size() << " windows";
}

TEST(Validation, TouchesNoGradientAndNoTrainingState) {
  TempDir tmp;  // one corpus path: the held-out split depends on it
  // A validation after every step changes nothing in training: the same losses bit for bit as one
  // validation at the end, and the same final validation loss.
  auto run = [&](int64_t freq, const std::string& dump) {
    auto args = validation_args(tmp, 4, freq);
    args.push_back("--job.dump_folder=" + (tmp / dump));
    return run_training(parse_train_args(args));
  };
  const auto every = run(1, "every"), end = run(100, "end");
  EXPECT_EQ(every.losses, end.losses);
  ASSERT_EQ(every.val_losses.size(), 4u);
  ASSERT_EQ(end.val_losses.size(), 1u);
  EXPECT_EQ(every.val_losses.back(), end.val_losses.back());
  EXPECT_LT(every.val_losses.back().second, every.val_losses.front().second);
  // Directly: after a step's backward, validate() leaves every gradient as it was; it rewinds its loader
  // (the same value twice); validation.steps = 1 evaluates one batch per rank.
  auto args = validation_args(tmp, 4, 100);
  args.push_back("--validation.steps=1");
  Trainer t(parse_train_args(args));
  t.train_step(1);
  std::vector<Tensor> grads;
  for (auto& g : t.model().flat_grads()) grads.push_back(g.clone());
  const EvalResult v1 = t.validate(), v2 = t.validate();
  EXPECT_EQ(v1.batches, 1);
  EXPECT_EQ(v1.targets, 2 * 32);
  EXPECT_EQ(v1.loss(), v2.loss());
  for (size_t i = 0; i < grads.size(); ++i)
    EXPECT_EQ(std::memcmp(grads[i].f32(), t.model().flat_grads()[i].f32(), grads[i].nbytes()), 0) << i;
}

TEST(Validation, TwoRanksGiveTheOneRankValue) {
  // Same global batch (4 windows per validation batch), a learning rate too small to move the weights
  // visibly, so the comparison is of the validation's own sums: FSDP and DDP over 2 ranks.
  TempDir tmp;
  std::string common;
  for (auto& a : validation_args(tmp, 2, 1))
    if (!a.starts_with("--job.dump_folder") && !a.starts_with("--training.local_batch_size"))
      common += " " + a;
  common += " --optimizer.lr=1e-9";
  std::string out;
  ASSERT_EQ(testing::run_titan(
                "train" + common + " --training.local_batch_size=4 --job.dump_folder=" + (tmp / "one"), &out),
            0)
      << out;
  const auto ref = jsonl_val_losses(tmp / "one/metrics.jsonl");
  ASSERT_EQ(ref.size(), 2u);
  for (auto [name, replicate] : {std::pair<std::string, int>{"fsdp2", 1}, {"ddp2", 2}}) {
    const auto r = testing::run_shell_command(
        "timeout 300 mpirun --oversubscribe --bind-to none -np 2 " + std::string(TITAN_BINARY) + " train" +
        common + " --training.local_batch_size=2 --parallelism.data_parallel_replicate_degree=" +
        std::to_string(replicate) + " --job.dump_folder=" + (tmp / name));
    ASSERT_EQ(r.rc, 0) << r.output;
    const auto got = jsonl_val_losses(tmp / (name + "/metrics.jsonl"));
    ASSERT_EQ(got.size(), ref.size()) << name;
    for (auto& [step, loss] : ref) EXPECT_NEAR(got.at(step), loss, 1e-6 * loss) << name << " step " << step;
  }
}

TEST(Validation, OwnDatasetAndBadSettingsNameTheField) {
  TempDir tmp;
  {
    std::ofstream f(tmp / "val.txt");
    for (int i = 0; i < 20; ++i) f << "a lazy dog " << i << " sleeps under the quick brown fox.\n%\n";
  }
  auto args = small_run_args(tmp, 2);
  for (std::string a : {std::string("--validation.enable=true"), "--validation.dataset=" + (tmp / "val.txt")})
    args.push_back(a);
  const auto r = run_training(parse_train_args(args));
  ASSERT_EQ(r.val_losses.size(), 1u);
  EXPECT_TRUE(std::isfinite(r.val_losses[0].second));
  auto e = error_of([&] { parse_train_args({"--training.val_fraction=0"}); });  // validation on by default
  EXPECT_NE(e.find("validation.dataset"), std::string::npos) << e;
  EXPECT_NE(e.find("training.val_fraction"), std::string::npos) << e;
  e = error_of([&] { parse_train_args({"--validation.freq=0"}); });
  EXPECT_NE(e.find("validation.freq must be positive"), std::string::npos) << e;
  e = error_of([&] { parse_train_args({"--validation.steps=0"}); });
  EXPECT_NE(e.find("validation.steps must be -1"), std::string::npos) << e;
  // A held-out split too small for one batch: an error before the first step, naming the settings.
  args = small_run_args(tmp, 2);
  for (std::string a : {"--validation.enable=true", "--training.val_fraction=0.001"}) args.push_back(a);
  e = error_of([&] { run_training(parse_train_args(args)); });
  EXPECT_NE(e.find("validation"), std::string::npos) << e;
  EXPECT_NE(e.find("training.val_fraction"), std::string::npos) << e;
}

}  // namespace
}  // namespace titan
