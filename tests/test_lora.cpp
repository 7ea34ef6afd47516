// LoRA against HF PEFT fixtures (tools/golden/make_lora_golden.py): logits, adapter gradients and 5 AdamW
// steps on the adapters of a tiny Qwen3 and Qwen3-MoE; PEFT file round trip; merge = merge_and_unload;
// adapters for another base are refused with an error naming the file and the tensor.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/safetensors.h"
#include "models/qwen3/lora.h"
#include "models/qwen3/model.h"
#include "support/golden.h"
#include "support/testing.h"
#include "train/forward_tool.h"

namespace titan {
namespace {

namespace fs = std::filesystem;
using testing::rel_error;
using testing::source_path;
using testing::TempDir;

const std::vector<std::string> kCases = {"dense_all_linear", "dense_tied_qv", "moe_attention"};

nlohmann::json read_meta(const std::string& dir) {
  std::ifstream f(dir + "/meta.json");
  return nlohmann::json::parse(f);
}

std::string case_dir(const std::string& name) {
  return source_path("tests/golden/lora/" + name);
}

ForwardToolOptions fixture_options(const std::string& dir, const std::string& out) {
  const nlohmann::json meta = read_meta(dir);
  ForwardToolOptions o;
  o.model_dir = dir;
  o.input_path = dir + "/input.json";
  o.output_path = out;
  o.lora_dir = dir + "/adapter";
  o.grads = true;
  o.steps = meta["steps"].get<int64_t>();
  testing::set_adamw_from_meta(o, meta);
  return o;
}

class GoldenLora : public ::testing::TestWithParam<std::string> {};

void expect_matches_peft(const std::string& name, Device device) {
  const std::string dir = case_dir(name);
  const std::string label = name + (device.type == DeviceType::CPU ? "" : " on " + device.str());
  TempDir tmp;
  ForwardToolOptions o = fixture_options(dir, tmp / "out.safetensors");
  o.device = device;
  run_forward_tool(o);
  SafetensorsFile got(o.output_path);
  testing::GoldenParams params(dir);
  const SafetensorsFile& want = params.want();
  int grads = 0, ps = 0;
  for (auto& [key, _] : want.entries()) {
    if (key.starts_with("merged.")) continue;
    ASSERT_TRUE(got.contains(key)) << key;
    if (key.starts_with("param.")) {
      params.expect_close(key, got.load(key), label);
      ++ps;
      continue;
    }
    grads += key.starts_with("grad.");
    const double tol = key == "logits" ? 1e-5 : key.starts_with("grad.") ? 1e-4 : 1e-6;  // loss, losses
    EXPECT_LE(rel_error(got.load(key), want.load(key)), tol) << label << " " << key;
  }
  params.expect_total_close(label);
  EXPECT_GT(grads, 0);
  EXPECT_EQ(grads, ps);
  // Only adapter tensors are trainable: no base gradient or parameter in the output.
  for (auto& [key, _] : got.entries())
    if (key.starts_with("grad.") || key.starts_with("param.")) {
      EXPECT_NE(key.find(".lora_"), std::string::npos) << key;
    }
}

TEST_P(GoldenLora, MatchesPeft) {
  expect_matches_peft(GetParam(), Device::cpu());
}

// The same fixtures with the model and the adapters on the GPU, at the same tolerances.
TEST_P(GoldenLora, MatchesPeftOnCuda) {
  TITAN_SKIP_WITHOUT_CUDA_GPU();
  expect_matches_peft(GetParam(), Device{DeviceType::CUDA, 0});
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenLora, ::testing::ValuesIn(kCases));

TEST(Lora, ForwardCliReproducesFixture) {
  const std::string dir = case_dir("dense_all_linear");
  const nlohmann::json meta = read_meta(dir);
  TempDir tmp;
  std::string out;
  const int rc = testing::run_titan(
      "forward --model " + dir + " --input " + dir + "/input.json --output " + (tmp / "o.safetensors") +
          " --lora " + dir + "/adapter --grads --steps 5 --lr " + std::to_string(meta["lr"].get<double>()) +
          " --weight-decay " + std::to_string(meta["weight_decay"].get<double>()) + " --max-norm " +
          std::to_string(meta["max_norm"].get<double>()),
      &out);
  ASSERT_EQ(rc, 0) << out;
  SafetensorsFile got(tmp / "o.safetensors");
  testing::GoldenParams params(dir);
  EXPECT_LE(rel_error(got.load("logits"), params.want().load("logits")), 1e-5);
  EXPECT_LE(rel_error(got.load("losses"), params.want().load("losses")), 1e-6);
  for (auto& [key, _] : params.want().entries())
    if (key.starts_with("param.")) params.expect_close(key, got.load(key), "titan forward --lora");
  params.expect_total_close("titan forward --lora");
}

// The frozen base held in bf16 (the training default): same adapters, base weights rounded to bf16.
TEST(Lora, Bf16FrozenBaseWithinBf16Tolerance) {
  const std::string dir = case_dir("dense_all_linear");
  TempDir tmp;
  ForwardToolOptions o = fixture_options(dir, tmp / "out.safetensors");
  o.lora_bf16_base = true;
  run_forward_tool(o);
  SafetensorsFile got(o.output_path), want(dir + "/expected.safetensors");
  EXPECT_LE(rel_error(got.load("logits"), want.load("logits")), 1e-2);
  for (auto& [key, _] : want.entries())
    if (key.starts_with("grad.")) {
      EXPECT_LE(rel_error(got.load(key), want.load(key)), 3e-2) << key;
    }
}

struct LoraRun {
  std::vector<float> grads;
  double loss;
};

LoraRun lora_step(const std::string& dir, double dropout, bool checkpointing, bool recompute_ops = false) {
  Qwen3Model model(Qwen3Config::from_hf_file(dir + "/config.json"));
  model.load_hf(dir);
  LoraConfig lc = LoraConfig::from_peft_file(dir + "/adapter/adapter_config.json");
  lc.dropout = dropout;
  lc.seed = 7;
  LoraAdapters lora(model.config(), lc);
  lora.load_peft(dir + "/adapter");
  model.set_lora(&lora);
  model.set_activation_checkpointing(checkpointing);
  model.set_activation_recompute_ops(recompute_ops);
  const TokenBatch b = read_token_batch_json(dir + "/input.json");
  model.zero_grad();
  LoraRun r;
  r.loss = model.forward(b.input_ids.data(), b.labels.data(), b.B, b.T).loss;
  model.backward();
  const Tensor& g = lora.flat_grads()[0];
  r.grads.assign(g.f32(), g.f32() + g.numel());
  // Frozen base: no gradient buffers for dense groups at all.
  for (int gi = 0; gi < model.num_groups(); ++gi)
    if (gi == 0 || gi > model.config().num_hidden_layers || !model.config().is_moe_layer(gi - 1)) {
      EXPECT_FALSE(model.flat_grads()[gi].defined()) << gi;
    }
  return r;
}

TEST(Lora, ActivationCheckpointingIsExactWithDropout) {
  for (const char* name : {"dense_all_linear", "moe_attention"}) {
    for (double p : {0.0, 0.3}) {
      const LoraRun a = lora_step(case_dir(name), p, false), b = lora_step(case_dir(name), p, true);
      EXPECT_EQ(a.loss, b.loss) << name << " dropout " << p;
      EXPECT_EQ(a.grads, b.grads) << name << " dropout " << p;
      const LoraRun op = lora_step(case_dir(name), p, false, true);  // selective by op
      EXPECT_EQ(a.loss, op.loss) << name << " dropout " << p;
      EXPECT_EQ(a.grads, op.grads) << name << " dropout " << p;
    }
    // Dropout changes the step (it is applied), deterministically for a seed.
    const LoraRun d = lora_step(case_dir(name), 0.3, false), n = lora_step(case_dir(name), 0.0, false);
    EXPECT_NE(d.loss, n.loss) << name;
  }
}

TEST(Lora, PeftFilesRoundTrip) {
  const std::string dir = case_dir("dense_tied_qv");
  const Qwen3Config cfg = Qwen3Config::from_hf_file(dir + "/config.json");
  LoraAdapters a(cfg, LoraConfig::from_peft_file(dir + "/adapter/adapter_config.json"));
  a.load_peft(dir + "/adapter");
  TempDir tmp;
  a.save_peft(tmp / "ad", "base");
  // Same tensors, same names and shapes as PEFT's file.
  SafetensorsFile peft(dir + "/adapter/adapter_model.safetensors"),
      ours(tmp / "ad/adapter_model.safetensors");
  ASSERT_EQ(peft.entries().size(), ours.entries().size());
  for (auto& [key, e] : peft.entries()) {
    ASSERT_TRUE(ours.contains(key)) << key;
    EXPECT_EQ(ours.entry(key).shape, e.shape) << key;
    EXPECT_EQ(rel_error(ours.load(key), peft.load(key)), 0.0) << key;
  }
  const LoraConfig back = LoraConfig::from_peft_file(tmp / "ad/adapter_config.json");
  const nlohmann::json want = read_meta(dir);
  EXPECT_EQ(back.rank, want["r"].get<int64_t>());
  EXPECT_EQ(back.alpha, want["lora_alpha"].get<double>());
  EXPECT_EQ(back.target_modules, (std::vector<std::string>{"q_proj", "v_proj", "down_proj"}));
  LoraAdapters b(cfg, back);
  b.load_peft(tmp / "ad");
  EXPECT_EQ(rel_error(b.flat_params()[0], a.flat_params()[0]), 0.0);
  EXPECT_FALSE(fs::exists(tmp / "ad/adapter_model.safetensors.tmp"));
}

TEST(Lora, InitIsPeftsKaimingUniformWithZeroB) {
  const Qwen3Config cfg = Qwen3Config::from_hf_file(case_dir("dense_all_linear") + "/config.json");
  LoraConfig lc;
  lc.rank = 8;
  LoraAdapters a(cfg, lc);
  for (auto& p : a.params()) {
    const float* v = p.value.f32();
    double maxabs = 0, sum2 = 0;
    for (int64_t i = 0; i < p.value.numel(); ++i)
      maxabs = std::max(maxabs, (double)std::abs(v[i])), sum2 += v[i] * v[i];
    if (p.name.find("lora_B") != std::string::npos) {
      EXPECT_EQ(maxabs, 0.0) << p.name;
      continue;
    }
    // U(-1/sqrt(in), 1/sqrt(in)): variance 1/(3 in).
    const double in = (double)p.shape[1];
    EXPECT_LE(maxabs, 1.0 / std::sqrt(in)) << p.name;
    EXPECT_NEAR(sum2 / p.value.numel() * 3 * in, 1.0, 0.25) << p.name;
  }
}

TEST(Lora, MergeEqualsPeftMergeAndUnload) {
  for (const std::string& name : kCases) {
    const std::string dir = case_dir(name);
    Qwen3Model model(Qwen3Config::from_hf_file(dir + "/config.json"));
    model.load_hf(dir);
    merge_lora_into(model, dir + "/adapter");
    SafetensorsFile want(dir + "/expected.safetensors");
    int n = 0;
    for (auto& [key, _] : want.entries()) {
      if (!key.starts_with("merged.")) continue;
      ++n;
      EXPECT_LE(rel_error(model.param(key.substr(7)).value, want.load(key)), 1e-6) << name << " " << key;
    }
    EXPECT_GT(n, 0) << name;
    // The merged model computes PEFT's logits (dropout 0: train and eval agree).
    const TokenBatch b = read_token_batch_json(dir + "/input.json");
    ForwardOptions fo;
    fo.compute_grad = false;
    fo.keep_logits = true;
    model.forward(b.input_ids.data(), b.labels.data(), b.B, b.T, fo);
    EXPECT_LE(rel_error(model.logits(), want.load("logits")), 1e-5) << name;
  }
}

TEST(Lora, ConvertMergeLoraWritesMergedHfDir) {
  const std::string dir = case_dir("dense_all_linear");
  TempDir tmp;
  std::string out;
  ASSERT_EQ(testing::run_titan("convert --input " + dir + " --output " + (tmp / "merged") + " --merge-lora " +
                                   dir + "/adapter",
                               &out),
            0)
      << out;
  Qwen3Model model(Qwen3Config::from_hf_file(tmp / "merged/config.json"));
  model.load_hf(tmp / "merged");
  SafetensorsFile want(dir + "/expected.safetensors");
  for (auto& [key, _] : want.entries())
    if (key.starts_with("merged.")) {
      EXPECT_LE(rel_error(model.param(key.substr(7)).value, want.load(key)), 1e-6) << key;
    }
}

// An adapter made for another base: one clear error naming the file and the tensor; no output written.
TEST(Lora, AdapterForAnotherBaseIsRefused) {
  const std::string other = case_dir("dense_all_linear") + "/adapter";
  const std::string dir = case_dir("moe_attention");  // hidden 32 with head_dim 16: q_proj differs
  Qwen3Model model(Qwen3Config::from_hf_file(dir + "/config.json"));
  model.load_hf(dir);
  try {
    merge_lora_into(model, other);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("adapter_model.safetensors"), std::string::npos) << msg;
    EXPECT_NE(msg.find("lora_"), std::string::npos) << msg;
    EXPECT_NE(msg.find("another base model"), std::string::npos) << msg;
  }
  TempDir tmp;
  std::string out;
  EXPECT_NE(testing::run_titan(
                "convert --input " + dir + " --output " + (tmp / "m") + " --merge-lora " + other, &out),
            0);
  EXPECT_NE(out.find("adapter_model.safetensors"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(tmp / "m"));
  EXPECT_NE(testing::run_titan("forward --model " + dir + " --input " + dir + "/input.json --output " +
                                   (tmp / "o.safetensors") + " --lora " + other,
                               &out),
            0);
  EXPECT_NE(out.find("another base model"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(tmp / "o.safetensors"));
}

TEST(Lora, UnsupportedPeftVariantsAreRefused) {
  TempDir tmp;
  const std::string src = case_dir("dense_tied_qv") + "/adapter/adapter_config.json";
  for (auto [field, value] : std::vector<std::pair<std::string, nlohmann::json>>{
           {"use_dora", true}, {"target_parameters", {"gate_up_proj"}}, {"target_modules", ".*proj"}}) {
    std::ifstream in(src);
    nlohmann::json j = nlohmann::json::parse(in);
    j[field] = value;
    std::ofstream(tmp / "adapter_config.json") << j.dump();
    try {
      LoraConfig::from_peft_file(tmp / "adapter_config.json");
      ADD_FAILURE() << field << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace titan

namespace titan {
namespace {

// `titan train` with [lora]: a small text run; returns the per-step losses of metrics.jsonl.
std::string lora_train_args(const TempDir& tmp, const std::string& extra) {
  {
    std::ofstream f(tmp / "corpus.txt");
    for (int i = 0; i < 200; ++i) f << "the quick brown fox " << i << " jumps over the lazy dog.\n%\n";
  }
  return " --training.dataset=" + (tmp / "corpus.txt") +
         " --model.tokenizer_path=" + source_path("tests/golden/tokenizer/small") +
         " --model.vocab_size=1024 --training.seq_len=32 --training.steps=4 --training.sample_tokens=0"
         " --training.val_fraction=0 --validation.enable=false"
         " --lr_scheduler.warmup_steps=2 --metrics.peak_tflops=1 --optimizer.lr=1e-2"
         " --lora.enable=true --lora.rank=4 --lora.alpha=8 " +
         extra;
}

// Only the adapter gradients are reduced: DDP and FSDP over 2 ranks give the 1-rank losses, and the final
// checkpoint is a PEFT adapter directory that resumes and loads.
TEST(LoraTrainer, DataParallelMatchesOneRankAndCheckpointsArePeftDirs) {
  TempDir tmp;
  const std::string common =
      lora_train_args(tmp, "--lora.base_dtype=float32 --activation_checkpoint.mode=full");
  std::string out;
  ASSERT_EQ(testing::run_titan("train" + common +
                                   " --training.local_batch_size=4 --checkpoint.enable=true"
                                   " --checkpoint.interval=2 --job.dump_folder=" +
                                   (tmp / "one"),
                               &out),
            0)
      << out;
  EXPECT_NE(out.find("LoRA adapter (PEFT format)"), std::string::npos) << out;
  const auto ref = testing::jsonl_losses(tmp / "one/metrics.jsonl");
  ASSERT_EQ(ref.size(), 4u);
  EXPECT_LT(ref.back(), ref.front());
  for (auto [name, replicate] : {std::pair<const char*, int>{"ddp2", 2}, {"fsdp2", 1}}) {
    const std::string cmd =
        "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 timeout 300 "
        "mpirun --oversubscribe --bind-to none -np 2 " +
        std::string(TITAN_BINARY) + " train" + common +
        " --training.local_batch_size=2 --parallelism.data_parallel_replicate_degree=" +
        std::to_string(replicate) + " --job.dump_folder=" + (tmp / name) + " > " + (tmp / name) + ".log 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << name;
    const auto got = testing::jsonl_losses(tmp / (std::string(name) + "/metrics.jsonl"));
    ASSERT_EQ(got.size(), ref.size()) << name;
    for (size_t i = 0; i < ref.size(); ++i)
      EXPECT_NEAR(got[i], ref[i], 1e-5 * ref[i]) << name << " step " << i + 1;
  }
  // Every checkpoint directory is a PEFT adapter dir of the trained adapters.
  const Qwen3Config cfg = Qwen3Config::flavor("debug");
  for (const char* step : {"step-2", "step-4"}) {
    const std::string dir = tmp / ("one/checkpoint/" + std::string(step));
    const LoraConfig lc = LoraConfig::from_peft_file(dir + "/adapter_config.json");
    EXPECT_EQ(lc.rank, 4);
    EXPECT_EQ(lc.alpha, 8);
    SafetensorsFile st(dir + "/adapter_model.safetensors");
    EXPECT_TRUE(st.contains("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")) << dir;
  }
  // Resume from step 2 reproduces steps 3 and 4.
  fs::remove_all(tmp / "one/checkpoint/step-4");
  ASSERT_EQ(testing::run_titan("train" + common +
                                   " --training.local_batch_size=4 --checkpoint.enable=true"
                                   " --checkpoint.interval=2 --job.dump_folder=" +
                                   (tmp / "one"),
                               &out),
            0)
      << out;
  EXPECT_NE(out.find("resuming from"), std::string::npos) << out;
  const auto resumed = testing::jsonl_losses(tmp / "one/metrics.jsonl");
  ASSERT_GE(resumed.size(), 2u);
  EXPECT_NEAR(resumed[resumed.size() - 1], ref[3], 1e-6 * ref[3]);
  EXPECT_NEAR(resumed[resumed.size() - 2], ref[2], 1e-6 * ref[2]);
}

// The default frozen base (bf16) trains from an HF directory and the adapter merges back into it.
TEST(LoraTrainer, Bf16BaseFromHfDirTrainsAndMerges) {
  TempDir tmp;
  Qwen3Config c = Qwen3Config::flavor("debug");
  c.vocab_size = 1024;
  c.num_hidden_layers = 2;
  Qwen3Model m(c);
  m.init_weights(3);
  m.save_hf(tmp / "hf", DType::BF16);
  std::string out;
  ASSERT_EQ(testing::run_titan(
                "train" + lora_train_args(
                              tmp, "--checkpoint.initial_load_path=" + (tmp / "hf") +
                                       " --model.hf_assets_path=" + (tmp / "hf") +
                                       " --training.local_batch_size=2 --job.dump_folder=" + (tmp / "run")),
                &out),
            0)
      << out;
  EXPECT_NE(out.find("frozen base " + (tmp / "hf") + " (bfloat16)"), std::string::npos) << out;
  const auto losses = testing::jsonl_losses(tmp / "run/metrics.jsonl");
  ASSERT_EQ(losses.size(), 4u);
  EXPECT_LT(losses.back(), losses.front());
  ASSERT_EQ(testing::run_titan("convert --input " + (tmp / "hf") + " --output " + (tmp / "merged") +
                                   " --merge-lora " + (tmp / "run/checkpoint/step-4"),
                               &out),
            0)
      << out;
  Qwen3Model merged(Qwen3Config::from_hf_file(tmp / "merged/config.json"));
  merged.load_hf(tmp / "merged");
  // The adapters moved the adapted weights and nothing else.
  EXPECT_GT(rel_error(merged.param("model.layers.0.self_attn.q_proj.weight").value,
                      m.param("model.layers.0.self_attn.q_proj.weight").value),
            0.0);
  EXPECT_EQ(rel_error(merged.param("model.layers.0.input_layernorm.weight").value,
                      m.param("model.layers.0.input_layernorm.weight").value),
            0.0);
}

}  // namespace
}  // namespace titan
