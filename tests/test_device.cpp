// Devices: the guard device (host memory at addresses the host cannot dereference, CPU kernels) proves that
// the model, the optimizer, checkpoints and the trainer reach device memory only through ops and device
// copies: every golden fixture and every training run on it equals the CPU's bit for bit, and a stray host
// access crashes. Also tensors across devices and device names.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "device/device.h"
#include "io/safetensors.h"
#include "support/testing.h"
#include "train/config.h"
#include "train/forward_tool.h"
#include "train/trainer.h"

namespace titan {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

const Device kGuard{DeviceType::GUARD, 0};

TEST(Device, NamesParse) {
  EXPECT_EQ(parse_device("cpu"), Device::cpu());
  EXPECT_EQ(parse_device("cuda"), (Device{DeviceType::CUDA, 0}));
  EXPECT_EQ(parse_device("cuda:3"), (Device{DeviceType::CUDA, 3}));
  EXPECT_EQ(parse_device("guard"), kGuard);
  for (const char* bad : {"", "gpu", "cuda:", "cuda:x", "cuda:-1", "CPU"})
    EXPECT_THROW(parse_device(bad, "job.device"), Error) << bad;
}

TEST(Device, TensorsMoveBetweenDevicesAndConvert) {
  std::vector<float> v = testing::randn(1000, 1);
  Tensor host = Tensor::from_vector(v, {10, 100});
  Tensor g = host.to(kGuard);
  EXPECT_EQ(g.device(), kGuard);
  Tensor bf = g.to(DType::BF16);  // converted on the guard device (its elementwise op)
  Tensor back = bf.to(DType::F32).to(Device::cpu());
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(back.f32()[i], round_to_bf16(v[i])) << i;
  Tensor c = g.clone();
  g.zero_();
  std::vector<float> out(1000);
  c.copy_to_host(out.data());
  EXPECT_EQ(out, v);
  g.copy_to_host(out.data());
  EXPECT_EQ(out, std::vector<float>(1000, 0.0f));
  Tensor h2 = Tensor::empty({10, 100});
  h2.copy_from(c.view_at(0, {10, 100}));  // guard -> host through copy_from
  EXPECT_EQ(std::vector<float>(h2.f32(), h2.f32() + 1000), v);
}

TEST(DeviceDeathTest, GuardMemoryFaultsOnHostAccess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Tensor g = Tensor::zeros({16}, DType::F32, kGuard);
  EXPECT_DEATH(
      {
        volatile float x = g.f32()[3];
        (void)x;
      },
      "");
}

// The forward tool (forward, gradients, AdamW steps) of one fixture on `device`: its output file's tensors.
std::vector<std::pair<std::string, Tensor>> forward_tool_outputs(const std::string& fixture, Device device,
                                                                 DType dtype, const TempDir& tmp,
                                                                 bool lora_bf16_base = false) {
  const std::string dir = testing::source_path(fixture);
  ForwardToolOptions o;
  o.model_dir = dir;
  if (std::filesystem::exists(dir + "/adapter")) o.lora_dir = dir + "/adapter";
  o.lora_bf16_base = lora_bf16_base;
  o.input_path = dir + "/input.json";
  o.output_path = tmp / (std::string(device_type_name(device.type)) + ".safetensors");
  o.grads = true;
  o.steps = 3;
  o.max_norm = 1.0;
  o.dtype = dtype;
  o.device = device;
  run_forward_tool(o);
  SafetensorsFile f(o.output_path);
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [k, _] : f.entries()) out.emplace_back(k, f.load(k));
  return out;
}

void expect_bit_equal(const std::vector<std::pair<std::string, Tensor>>& got,
                      const std::vector<std::pair<std::string, Tensor>>& want, const std::string& label) {
  ASSERT_EQ(got.size(), want.size()) << label;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].first, want[i].first) << label;
    ASSERT_EQ(got[i].second.nbytes(), want[i].second.nbytes()) << label << " " << want[i].first;
    EXPECT_EQ(std::memcmp(got[i].second.raw(), want[i].second.raw(), want[i].second.nbytes()), 0)
        << label << " " << want[i].first << " differs from the cpu run";
  }
}

TEST(GuardDevice, EveryFixtureEqualsTheCpuBitForBit) {
  std::vector<std::string> fixtures;
  for (const char* root : {"tests/golden/qwen3", "tests/golden/qwen3_moe", "tests/golden/lora"})
    for (auto& e : fs::directory_iterator(testing::source_path(root)))
      if (e.is_directory()) fixtures.push_back(std::string(root) + "/" + e.path().filename().string());
  ASSERT_GE(fixtures.size(), 9u);
  for (auto& fixture : fixtures)
    for (DType dtype : {DType::F32, DType::BF16}) {
      TempDir tmp;
      const std::string label = fixture + (dtype == DType::BF16 ? " bf16" : " f32");
      expect_bit_equal(forward_tool_outputs(fixture, kGuard, dtype, tmp),
                       forward_tool_outputs(fixture, Device::cpu(), dtype, tmp), label);
      if (fixture.find("lora") != std::string::npos && dtype == DType::F32)  // a frozen bf16 base too
        expect_bit_equal(forward_tool_outputs(fixture, kGuard, dtype, tmp, true),
                         forward_tool_outputs(fixture, Device::cpu(), dtype, tmp, true),
                         label + " bf16 base");
    }
}

// The tests' small run (support/testing.h) with a held-out split, validation every 3 steps and a sample.
// Which documents are held out hangs on the corpus's path (a fresh temporary directory per test), so the
// fraction is large enough that every path holds out a batch: 20% of 200 documents (5% failed ~2.6% of
// paths).
std::vector<std::string> small_run(const TempDir& tmp, const std::string& name, int64_t steps) {
  auto args = testing::small_run_args(tmp, steps, name);
  for (const char* a : {"--training.sample_tokens=4", "--training.val_fraction=0.2",
                        "--validation.enable=true", "--validation.freq=3"})
    args.push_back(a);
  return args;
}

// The trainer on the guard device equals the cpu run: losses, validation losses, the exported HF
// checkpoint (or the PEFT adapter) and the sample; f32 and bf16 mixed precision with activation checkpointing
// and gradient accumulation; MoE with the aux loss and with aux-loss-free balancing; LoRA.
TEST(GuardDevice, TrainingEqualsTheCpuBitForBit) {
  const std::vector<std::vector<std::string>> variants = {
      {},
      {"--training.mixed_precision_param=bfloat16", "--activation_checkpoint.mode=full",
       "--training.global_batch_size=4"},
      {"--model.flavor=debug_moe", "--model.moe_aux_loss=on"},
      {"--model.flavor=debug_moe", "--model.load_balance_coeff=0.001"},
      // LoRA: adapters (dropout masks from the counter hash) on a frozen bf16 base streamed from the device.
      {"--lora.enable=true", "--lora.dropout=0.1", "--activation_checkpoint.mode=full"},
      {"--lora.enable=true", "--lora.base_dtype=float32", "--training.mixed_precision_param=bfloat16"},
  };
  for (auto& extra : variants) {
    TempDir tmp;
    std::string label;
    for (auto& e : extra) label += e + " ";
    auto run = [&](const std::string& device) {
      auto args = small_run(tmp, device, 6);
      args.insert(args.end(), extra.begin(), extra.end());
      args.push_back("--job.device=" + device);
      return run_training(parse_train_args(args));
    };
    const TrainResult cpu = run("cpu"), guard = run("guard");
    EXPECT_EQ(guard.losses, cpu.losses) << label;
    EXPECT_EQ(guard.val_losses, cpu.val_losses) << label;
    EXPECT_EQ(guard.sample, cpu.sample) << label;
    ASSERT_FALSE(cpu.export_dir.empty());
    const std::string file =
        label.find("lora") != std::string::npos ? "/adapter_model.safetensors" : "/model.safetensors";
    SafetensorsFile a(guard.export_dir + file), b(cpu.export_dir + file);
    ASSERT_FALSE(b.entries().empty());
    for (auto& [k, _] : b.entries()) {
      Tensor x = a.load(k), y = b.load(k);
      EXPECT_EQ(std::memcmp(x.raw(), y.raw(), y.nbytes()), 0) << label << k;
    }
  }
}

// Data parallel with device buffers: DDP buckets, FSDP gathers and reduce-scatters (bf16 compute), the
// expert-parallel token exchange (MoE, balancing) and sharded LoRA adapters go through the host-staged group
// (distributed/staged_process_group.h); host scalars through its host group. Each equals the cpu's 2-rank run
// bit for bit; the MFU peak is measured on the device (no metrics.peak_tflops) in the DDP run.
TEST(GuardDevice, DataParallelEqualsTheCpuBitForBit) {
  TempDir tmp;
  std::string common;
  for (auto& a : small_run(tmp, "unused", 4))
    if (!a.starts_with("--job.dump_folder") && !a.starts_with("--metrics.peak_tflops")) common += " " + a;
  const std::vector<std::pair<std::string, std::string>> layouts = {
      {"ddp", " --parallelism.data_parallel_replicate_degree=2"},
      {"fsdp", " --training.mixed_precision_param=bfloat16 --metrics.peak_tflops=1"},
      {"ep",
       " --parallelism.data_parallel_replicate_degree=2 --parallelism.expert_parallel_degree=2"
       " --model.flavor=debug_moe --model.load_balance_coeff=0.001 --metrics.peak_tflops=1"},
      {"lora_fsdp", " --lora.enable=true --lora.dropout=0.1 --metrics.peak_tflops=1"},
  };
  for (auto& [name, layout] : layouts) {
    std::vector<std::vector<double>> losses;
    std::vector<std::string> samples;
    for (const char* device : {"cpu", "guard"}) {
      const std::string dir = tmp / (name + "_" + device);
      const std::string cmd =
          "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 timeout 300 "
          "mpirun --oversubscribe --bind-to none -np 2 " +
          std::string(TITAN_BINARY) + " train" + common + layout + " --job.device=" + device +
          " --job.dump_folder=" + dir + " > " + dir + ".log 2>&1";
      ASSERT_EQ(std::system(cmd.c_str()), 0) << name << " on " << device << ": see " << dir << ".log";
      losses.push_back(testing::jsonl_losses(dir + "/metrics.jsonl"));
      std::ifstream f(dir + "/sample.txt");
      samples.emplace_back((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    }
    ASSERT_EQ(losses[0].size(), 4u) << name;
    EXPECT_EQ(losses[1], losses[0]) << name;
    EXPECT_FALSE(samples[0].empty()) << name;
    EXPECT_EQ(samples[1], samples[0]) << name;
  }
}

// A configuration's [kernels] name cpu implementations (the shipped MoE config: rope = "fused",
// moe_experts = "grouped"); on another device those give way to its defaults, said once; a name that exists
// nowhere is still an error naming the key.
TEST(GuardDevice, CpuKernelChoicesGiveWayToTheDeviceDefaults) {
  TempDir tmp;
  std::string common;
  for (auto& a : small_run(tmp, "run", 2)) common += " " + a;
  std::string out;
  ASSERT_EQ(testing::run_titan("train --config qwen3_moe_64e_top4_4l --model.flavor=debug_moe" + common +
                                   " --job.device=guard",
                               &out),
            0)
      << out;
  EXPECT_NE(out.find("kernels.rope = 'fused' is a cpu implementation; guard uses its default"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("kernels: attention=cpu"), std::string::npos) << out;
  EXPECT_NE(testing::run_titan("train" + common + " --job.device=guard --kernels.rope=nosuch", &out), 0);
  EXPECT_NE(out.find("kernels.rope = 'nosuch'"), std::string::npos) << out;
}

// Checkpoints written from device memory resume exactly: 3 steps, stop, resume to 6 == 6 straight.
TEST(GuardDevice, CheckpointResumeIsExact) {
  TempDir tmp;
  auto args = [&](const std::string& name, int64_t steps) {
    auto a = small_run(tmp, name, steps);
    a.push_back("--job.device=guard");
    a.push_back("--checkpoint.enable=true");
    a.push_back("--checkpoint.interval=3");
    a.push_back("--model.flavor=debug_moe");
    a.push_back("--model.load_balance_coeff=0.001");
    return a;
  };
  const TrainResult straight = run_training(parse_train_args(args("straight", 6)));
  run_training(parse_train_args(args("resumed", 3)));
  const TrainResult resumed = run_training(parse_train_args(args("resumed", 6)));
  EXPECT_EQ(resumed.first_step, 4);
  ASSERT_EQ(resumed.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(resumed.losses[i], straight.losses[3 + i]) << i;
}

}  // namespace
}  // namespace titan
