// Qwen3-MoE against fixtures made by HF Qwen3MoeForCausalLM + torch.optim.AdamW
// (tools/golden/make_qwen3_moe_golden.py): logits, loss with the aux term, aux loss, every gradient,
// 5 AdamW steps; plus layouts (per-expert / fused v5), flavors and aux-loss-free balancing.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "distributed/process_group.h"
#include "io/hf_checkpoint.h"
#include "io/safetensors.h"
#include "models/qwen3/model.h"
#include "support/golden.h"
#include "support/testing.h"
#include "train/forward_tool.h"

namespace titan {
namespace {

using testing::rel_error;
using testing::source_path;
using testing::TempDir;

std::vector<std::string> golden_cases() {
  std::vector<std::string> cases;
  for (auto& e : std::filesystem::directory_iterator(source_path("tests/golden/qwen3_moe")))
    if (e.is_directory()) cases.push_back(e.path().filename().string());
  std::sort(cases.begin(), cases.end());
  return cases;
}

nlohmann::json read_meta(const std::string& dir) {
  std::ifstream f(dir + "/meta.json");
  return nlohmann::json::parse(f);
}

ForwardToolOptions golden_options(const std::string& dir, const std::string& out, bool steps) {
  const nlohmann::json meta = read_meta(dir);
  ForwardToolOptions o;
  o.model_dir = dir;
  o.input_path = dir + "/input.json";
  o.output_path = out;
  o.grads = true;
  o.steps = steps ? meta["steps"].get<int64_t>() : 0;
  testing::set_adamw_from_meta(o, meta);
  return o;
}

// Compares a `titan forward` output with expected.safetensors at the stated tolerances.
void expect_matches_fixture(const std::string& got_path, const std::string& dir, const std::string& label,
                            bool steps) {
  SafetensorsFile got(got_path);
  testing::GoldenParams params(dir);
  const SafetensorsFile& want = params.want();
  if (steps) {
    std::vector<std::string> got_keys, want_keys;
    for (auto& [k, _] : got.entries()) got_keys.push_back(k);
    for (auto& [k, _] : want.entries()) want_keys.push_back(k);
    EXPECT_EQ(got_keys, want_keys) << label;
  }
  for (auto& [key, _] : want.entries()) {
    if (!steps && (key == "losses" || key.starts_with("param."))) continue;
    if (!got.contains(key)) {
      ADD_FAILURE() << label << ": missing " << key;
      continue;
    }
    if (key.starts_with("param.")) {
      params.expect_close(key, got.load(key), label);  // support/golden.h
      continue;
    }
    Tensor a = got.load(key), b = want.load(key);
    ASSERT_EQ(a.numel(), b.numel()) << key;
    const double tol = key == "logits" ? 1e-5 : key.starts_with("grad.") ? 1e-4 : 1e-6;  // loss, aux, losses
    EXPECT_LE(rel_error(a, b), tol) << label << " " << key;
  }
  if (steps) params.expect_total_close(label);
}

class GoldenQwen3Moe : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenQwen3Moe, MatchesTransformers) {
  const std::string dir = source_path("tests/golden/qwen3_moe/" + GetParam());
  TempDir tmp;
  ForwardToolOptions o = golden_options(dir, tmp / "out.safetensors", true);
  run_forward_tool(o);
  expect_matches_fixture(o.output_path, dir, GetParam(), true);
}

// The same fixtures with the model on the GPU (titan forward --device cuda), at the same tolerances.
TEST_P(GoldenQwen3Moe, MatchesTransformersOnCuda) {
  TITAN_SKIP_WITHOUT_CUDA_GPU();
  const std::string dir = source_path("tests/golden/qwen3_moe/" + GetParam());
  TempDir tmp;
  ForwardToolOptions o = golden_options(dir, tmp / "out.safetensors", true);
  o.device = Device{DeviceType::CUDA, 0};
  run_forward_tool(o);
  expect_matches_fixture(o.output_path, dir, GetParam() + " on cuda", true);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenQwen3Moe, ::testing::ValuesIn(golden_cases()),
                         [](const auto& info) { return info.param; });

// Every attention implementation reproduces every fixture, AdamW steps included (the parameters are
// judged against the float64 run: support/golden.h).
class GoldenQwen3MoeAttention : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(GoldenQwen3MoeAttention, MatchesTransformers) {
  const auto& [fixture, attention] = GetParam();
  const std::string dir = source_path("tests/golden/qwen3_moe/" + fixture);
  TempDir tmp;
  ForwardToolOptions o = golden_options(dir, tmp / "out.safetensors", true);
  o.kernels["attention"] = attention;
  run_forward_tool(o);
  expect_matches_fixture(o.output_path, dir, fixture + " attention=" + attention, true);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenQwen3MoeAttention,
                         ::testing::Combine(::testing::ValuesIn(golden_cases()),
                                            ::testing::Values("flash", "flash_onednn", "blas", "reference")),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::get<1>(info.param);
                         });

// The per-token reference kernels (experts, rope) reproduce the fixtures too.
TEST(Qwen3MoeGolden, ReferenceKernelsMatchFixture) {
  for (const std::string name : {"e8k2_norm", "sparse_step2"}) {
    const std::string dir = source_path("tests/golden/qwen3_moe/" + name);
    TempDir tmp;
    ForwardToolOptions o = golden_options(dir, tmp / "out.safetensors", false);
    o.kernels = {{"moe_experts", "reference"}, {"rope", "reference"}, {"matmul", "reference"}};
    run_forward_tool(o);
    expect_matches_fixture(o.output_path, dir, name + " (reference kernels)", false);
  }
}

TEST(Qwen3MoeGolden, ForwardCliWritesAuxLoss) {
  const std::string dir = source_path("tests/golden/qwen3_moe/e8k2_fused_v5");
  TempDir tmp;
  std::string out;
  int rc =
      testing::run_titan("forward --model " + dir + " --input " + dir + "/input.json --output " +
                             (tmp / "o.safetensors") + " --kernel moe_experts=grouped --kernel rope=fused",
                         &out);
  ASSERT_EQ(rc, 0) << out;
  SafetensorsFile got(tmp / "o.safetensors"), want(dir + "/expected.safetensors");
  EXPECT_EQ(got.entry("aux_loss").shape.size(), 0u);
  EXPECT_LE(rel_error(got.load("aux_loss"), want.load("aux_loss")), 1e-6);
  EXPECT_LE(rel_error(got.load("loss"), want.load("loss")), 1e-6);
  EXPECT_LE(rel_error(got.load("logits"), want.load("logits")), 1e-5);
}

// Implementations are chosen by name per op; "rope" names a rope_qk implementation (fused, reference) or a
// per-tensor rope one (fast). Every choice reproduces the fixture.
TEST(Qwen3MoeGolden, KernelChoiceByName) {
  const std::string dir = source_path("tests/golden/qwen3_moe/mlp_only_layer");
  const std::vector<KernelChoice> choices = {{{"rope", "fused"}, {"moe_experts", "grouped"}},
                                             {{"rope", "fast"}},
                                             {{"rope", "reference"}},
                                             {{"rope_qk", "reference"}, {"moe_experts", "reference"}}};
  for (auto& choice : choices) {
    TempDir tmp;
    ForwardToolOptions o = golden_options(dir, tmp / "out.safetensors", false);
    o.kernels = choice;
    run_forward_tool(o);
    std::string label;
    for (auto& [op, impl] : choice) label += op + "=" + impl + " ";
    expect_matches_fixture(o.output_path, dir, label, false);
  }
  const Qwen3Config c = Qwen3Config::from_hf_file(dir + "/config.json");
  EXPECT_EQ(Qwen3Model(c, {{"rope", "fused"}}).kernel_names().at("rope_qk"), "fused");
  EXPECT_EQ(Qwen3Model(c, {{"rope", "fast"}}).kernel_names().at("rope"), "fast");
  EXPECT_EQ(Qwen3Model(c).kernel_names().at("moe_experts"), "grouped");  // highest priority by default
  EXPECT_THROW(Qwen3Model(c, {{"moe_experts", "no-such"}}), Error);
  EXPECT_THROW(Qwen3Model(c, {{"rope", "no-such"}}), Error);
}

TEST(Qwen3MoeGolden, Bf16ComputeWithinTolerance) {
  const std::string dir = source_path("tests/golden/qwen3_moe/e8k2_norm");
  TempDir tmp;
  ForwardToolOptions o = golden_options(dir, tmp / "out.safetensors", false);
  o.grads = false;
  o.dtype = DType::BF16;
  run_forward_tool(o);
  SafetensorsFile got(o.output_path), want(dir + "/expected.safetensors");
  EXPECT_LE(rel_error(got.load("logits"), want.load("logits")), 2e-2);
  EXPECT_GT(rel_error(got.load("logits"), want.load("logits")), 0.0);
  EXPECT_LE(rel_error(got.load("loss"), want.load("loss")), 2e-2);
}

TEST(Qwen3Moe, ConfigFromHfJson) {
  const auto c = Qwen3Config::from_hf_file(source_path("tests/golden/qwen3_moe/mlp_only_layer/config.json"));
  EXPECT_TRUE(c.is_moe());
  EXPECT_EQ(c.num_experts, 8);  // v5 writes num_local_experts
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe_intermediate_size, 16);
  EXPECT_TRUE(c.output_router_logits);
  EXPECT_EQ(c.mlp_only_layers, std::vector<int64_t>{1});
  EXPECT_TRUE(c.is_moe_layer(0));
  EXPECT_FALSE(c.is_moe_layer(1));
  EXPECT_TRUE(c.is_moe_layer(2));
  const auto s = Qwen3Config::from_hf_file(source_path("tests/golden/qwen3_moe/sparse_step2/config.json"));
  EXPECT_EQ(s.num_moe_layers(), 2);
  EXPECT_FALSE(s.is_moe_layer(0));
  EXPECT_TRUE(s.is_moe_layer(1));
  // to_hf_json -> from_hf_json keeps every MoE field.
  auto j = nlohmann::json::parse(c.to_hf_json().dump());
  EXPECT_EQ(j["model_type"], "qwen3_moe");
  EXPECT_EQ(j["architectures"][0], "Qwen3MoeForCausalLM");
  const auto r = Qwen3Config::from_hf_json(j, "roundtrip");
  EXPECT_EQ(r.num_experts, 8);
  EXPECT_EQ(r.mlp_only_layers, c.mlp_only_layers);
  EXPECT_EQ(r.norm_topk_prob, c.norm_topk_prob);
  EXPECT_EQ(r.router_aux_loss_coef, c.router_aux_loss_coef);
  j["num_experts_per_tok"] = 9;
  EXPECT_THROW(Qwen3Config::from_hf_json(j, "bad"), Error);
  // Dense configs stay dense.
  EXPECT_FALSE(Qwen3Config::flavor("0.6B").is_moe());
  EXPECT_EQ(Qwen3Config::flavor("0.6B").to_hf_json()["model_type"], "qwen3");
}

TEST(Qwen3Moe, FlavorsHaveReleasedShapes) {
  const auto a3b = Qwen3Config::flavor("30B-A3B");
  EXPECT_EQ(a3b.num_experts, 128);
  EXPECT_EQ(a3b.num_experts_per_tok, 8);
  EXPECT_EQ(a3b.moe_intermediate_size, 768);
  EXPECT_EQ(a3b.num_hidden_layers, 48);
  EXPECT_EQ(a3b.num_moe_layers(), 48);
  EXPECT_FALSE(a3b.tie_word_embeddings);
  // Model card: 30.5B total, 3.3B activated (3.35B here, embedding and lm_head included).
  EXPECT_NEAR(a3b.num_params() / 1e9, 30.5, 0.1);
  EXPECT_NEAR(a3b.num_active_params() / 1e9, 3.3, 0.1);
  const auto big = Qwen3Config::flavor("235B-A22B");
  EXPECT_NEAR(big.num_params() / 1e9, 235, 1.0);
  EXPECT_NEAR(big.num_active_params() / 1e9, 22, 0.3);
  const auto cut = Qwen3Config::flavor("30B-A3B-64e-top4-4l");
  EXPECT_EQ(cut.num_experts, 64);
  EXPECT_EQ(cut.num_experts_per_tok, 4);
  EXPECT_EQ(cut.num_hidden_layers, 4);
  EXPECT_EQ(cut.hidden_size, 2048);
  EXPECT_EQ(cut.moe_intermediate_size, 768);
  // FLOPs count the active experts only: 6 * (router + top-k experts) per sparse layer.
  const double dense_part = Qwen3Config::flavor("30B-A3B-64e-top4-4l").training_flops_per_token(0);
  const double H = 2048, expect_mlp = 4 * 6 * (H * 64 + 4 * 3 * H * 768);
  const double attn = 4 * 6 * (H * cut.qkv_dim() + cut.q_dim() * H), head = 6 * 151936 * H;
  EXPECT_NEAR(dense_part, expect_mlp + attn + head, 1.0);
  const auto dbg = Qwen3Config::flavor("debug_moe");
  EXPECT_TRUE(dbg.is_moe());
  for (auto& name : Qwen3Config::flavor_names()) EXPECT_NO_THROW(Qwen3Config::flavor(name).validate(name));
}

Qwen3Config tiny_moe() {
  Qwen3Config c = Qwen3Config::flavor("debug_moe");
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.moe_intermediate_size = 16;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.mlp_only_layers = {1};
  return c;
}

TEST(Qwen3Moe, SavePerExpertByDefaultAndLoadBothLayouts) {
  Qwen3Model a(tiny_moe());
  a.init_weights(7);
  TempDir tmp;
  a.save_hf(tmp / "per_expert", DType::F32);
  a.save_hf(tmp / "fused", DType::F32, int64_t(5) << 30, /*fused_experts=*/true);
  HFCheckpointReader per(tmp / "per_expert"), fused(tmp / "fused");
  EXPECT_TRUE(per.contains("model.layers.0.mlp.experts.7.down_proj.weight"));
  EXPECT_TRUE(per.contains("model.layers.2.mlp.gate.weight"));
  EXPECT_TRUE(per.contains("model.layers.1.mlp.gate_proj.weight"));
  EXPECT_FALSE(per.contains("model.layers.0.mlp.experts.gate_up_proj"));
  EXPECT_TRUE(fused.contains("model.layers.0.mlp.experts.gate_up_proj"));
  EXPECT_EQ(fused.file_of("model.layers.0.mlp.experts.gate_up_proj")
                .entry("model.layers.0.mlp.experts.gate_up_proj")
                .shape,
            (Shape{8, 32, 32}));
  EXPECT_FALSE(fused.contains("model.layers.0.mlp.experts.0.gate_proj.weight"));
  auto cfg = nlohmann::json::parse(std::ifstream(tmp / "per_expert/config.json"));
  EXPECT_EQ(cfg["model_type"], "qwen3_moe");
  for (auto dir : {"per_expert", "fused"}) {
    Qwen3Model b(Qwen3Config::from_hf_file(tmp / (std::string(dir) + "/config.json")));
    b.load_hf(tmp / dir);
    for (size_t g = 0; g < a.flat_params().size(); ++g)
      EXPECT_EQ(rel_error(b.flat_params()[g], a.flat_params()[g]), 0.0) << dir << " group " << g;
  }
  // gate rows first, then up rows, in the fused tensor.
  Tensor gu = fused.file_of("model.layers.2.mlp.experts.gate_up_proj")
                  .load("model.layers.2.mlp.experts.gate_up_proj");
  const Param& up3 = a.param("model.layers.2.mlp.experts.3.up_proj.weight");
  EXPECT_EQ(gu.f32()[(3 * 32 + 16) * 32 + 5], up3.value.f32()[5]);
}

// ---- expert parallel: layout, init and loading of a rank's expert slice (no communication needed) ----

// Reports a rank and size without communicating (the model's constructor and loading only ask for them).
class RankOnlyGroup final : public dist::ProcessGroup {
 public:
  RankOnlyGroup(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank_of(int r) const override { return r; }
  std::string backend() const override { return "rank-only"; }
  void all_reduce(void*, int64_t, dist::CommType, dist::ReduceOp) override { fail("no collectives"); }
  void reduce_scatter(const void*, void*, const std::vector<int64_t>&, dist::CommType,
                      dist::ReduceOp) override {
    fail("no collectives");
  }
  void all_gather(const void*, void*, const std::vector<int64_t>&, dist::CommType) override {
    fail("no collectives");
  }
  void broadcast(void*, int64_t, dist::CommType, int) override { fail("no collectives"); }
  void all_to_all(const void*, void*, int64_t, dist::CommType) override { fail("no collectives"); }
  void all_to_all_v(const void*, const std::vector<int64_t>&, void*, const std::vector<int64_t>&,
                    dist::CommType) override {
    fail("no collectives");
  }
  void barrier() override {}
  std::shared_ptr<dist::ProcessGroup> split(int, int) override { return nullptr; }

 private:
  int rank_, size_;
};

TEST(Qwen3MoeExpertParallel, SliceLayoutInitAndLoading) {
  const Qwen3Config c = tiny_moe();  // 8 experts, layers 0 and 2 sparse
  Qwen3Model full(c);
  full.init_weights(7);
  TempDir tmp;
  full.save_hf(tmp / "per_expert", DType::F32);
  full.save_hf(tmp / "fused", DType::F32, int64_t(5) << 30, /*fused_experts=*/true);
  for (int e : {2, 4, 8}) {
    for (int r = 0; r < e; ++r) {
      RankOnlyGroup g(r, e);
      Qwen3Model m(c, {}, &g);
      const int64_t El = 8 / e;
      EXPECT_EQ(m.local_experts(), El);
      EXPECT_EQ(m.first_expert(), r * El);
      // Only the local experts exist, under their global names; everything else is complete.
      EXPECT_NO_THROW(m.param("model.layers.2.mlp.experts." + std::to_string(r * El) + ".down_proj.weight"));
      EXPECT_THROW(
          m.param("model.layers.2.mlp.experts." + std::to_string((r * El + El) % 8) + ".up_proj.weight"),
          Error);
      EXPECT_EQ(m.num_params(), full.num_params() - 2 * (8 - El) * 3 * 16 * 32);
      // init: the slice equals the same experts of the full model (same seed).
      m.init_weights(7);
      for (auto& p : m.params())
        EXPECT_EQ(rel_error(p.value, full.param(p.name).value), 0.0) << p.name << " rank " << r << "/" << e;
      // Expert weights are the tail of a sparse layer's buffer.
      const auto off = m.expert_offsets();
      const Param& first =
          m.param("model.layers.0.mlp.experts." + std::to_string(r * El) + ".gate_proj.weight");
      EXPECT_EQ(off[1], first.offset);
      EXPECT_EQ(off[2], m.flat_params()[2].numel());  // the dense layer
      EXPECT_EQ(off[0], m.flat_params()[0].numel());
      // HF loading keeps this rank's slice (per-expert and fused v5 keys).
      for (auto dir : {"per_expert", "fused"}) {
        Qwen3Model l(c, {}, &g);
        l.init_weights(99);
        l.load_hf(tmp / dir);
        for (auto& p : l.params())
          EXPECT_EQ(rel_error(p.value, full.param(p.name).value), 0.0)
              << dir << " " << p.name << " rank " << r;
      }
    }
  }
  RankOnlyGroup two(0, 2), three(0, 3);
  Qwen3Model ep(c, {}, &two);
  EXPECT_NE(testing::error_of([&] { ep.save_hf(tmp / "x", DType::F32); }).find("gathered_state_dict"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] { Qwen3Model bad(c, {}, &three); }).find("does not divide num_experts = 8"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] {
              Qwen3Model dense(Qwen3Config::flavor("debug"), {}, &two);
            }).find("parallelism.expert_parallel_degree = 2: the model is dense"),
            std::string::npos);
}

TEST(Qwen3Moe, GradientsAccumulateAcrossBackwardCalls) {
  const std::string dir = source_path("tests/golden/qwen3_moe/mlp_only_layer");
  Qwen3Model model(Qwen3Config::from_hf_file(dir + "/config.json"));
  model.load_hf(dir);
  TokenBatch batch = read_token_batch_json(dir + "/input.json");
  model.zero_grad();
  model.forward(batch.input_ids.data(), batch.labels.data(), batch.B, batch.T);
  model.backward();
  std::vector<Tensor> once;
  for (auto& g : model.flat_grads()) once.push_back(g.clone());
  model.forward(batch.input_ids.data(), batch.labels.data(), batch.B, batch.T);
  model.backward();
  for (size_t i = 0; i < once.size(); ++i) {
    Tensor twice = once[i].clone();
    for (int64_t j = 0; j < twice.numel(); ++j) twice.f32()[j] *= 2;
    EXPECT_LE(rel_error(model.flat_grads()[i], twice), 1e-6);
  }
}

// torchtitan aux-loss-free balancing: counts from training forwards, bias update, bias steers selection only.
TEST(Qwen3Moe, AuxLossFreeBalancing) {
  const std::string dir = source_path("tests/golden/qwen3_moe/e8k2_norm");
  Qwen3Config c = Qwen3Config::from_hf_file(dir + "/config.json");
  Qwen3Model plain(c);
  plain.load_hf(dir);
  c.load_balance_coeff = 1e-3;
  Qwen3Model model(c);
  model.load_hf(dir);
  TokenBatch batch = read_token_batch_json(dir + "/input.json");
  const int64_t N = batch.B * batch.T, E = c.num_experts, k = c.num_experts_per_tok;
  ASSERT_EQ(model.moe_layers(), (std::vector<int64_t>{0, 1}));

  // Zero bias: identical to the plain model (fixture numbers), counts = N*k per layer.
  ForwardResult r0 = plain.forward(batch.input_ids.data(), batch.labels.data(), batch.B, batch.T);
  ForwardResult r1 = model.forward(batch.input_ids.data(), batch.labels.data(), batch.B, batch.T);
  EXPECT_EQ(r0.loss, r1.loss);
  SafetensorsFile want(dir + "/expected.safetensors");
  EXPECT_NEAR(r1.loss, want.load("loss").f32()[0], 1e-6 * r1.loss);
  EXPECT_NEAR(r1.aux_loss, want.load("aux_loss").f32()[0], 1e-6 * r1.aux_loss);
  Tensor& counts = model.expert_token_counts();
  ASSERT_EQ(counts.shape(), (Shape{2, E}));
  for (int m = 0; m < 2; ++m) {
    double total = 0;
    for (int64_t e = 0; e < E; ++e) total += counts.f32()[m * E + e];
    EXPECT_EQ(total, double(N * k));
  }
  // No counting without compute_grad (evaluation).
  ForwardOptions eval;
  eval.compute_grad = false;
  Tensor before = counts.clone();
  model.forward(batch.input_ids.data(), batch.labels.data(), batch.B, batch.T, eval);
  EXPECT_EQ(rel_error(counts, before), 0.0);

  // update_expert_bias: delta = coeff * sign(mean - counts), centred; counts reset.
  std::vector<float> expect(2 * E);
  for (int m = 0; m < 2; ++m) {
    double mean = 0, dmean = 0;
    for (int64_t e = 0; e < E; ++e) mean += counts.f32()[m * E + e] / E;
    auto sgn = [](double x) { return x > 0 ? 1.0 : x < 0 ? -1.0 : 0.0; };
    for (int64_t e = 0; e < E; ++e) dmean += 1e-3 * sgn(mean - counts.f32()[m * E + e]) / E;
    for (int64_t e = 0; e < E; ++e)
      expect[m * E + e] = float(1e-3 * sgn(mean - counts.f32()[m * E + e]) - dmean);
  }
  model.update_expert_bias();
  for (int64_t i = 0; i < 2 * E; ++i) EXPECT_NEAR(model.expert_bias().f32()[i], expect[i], 1e-9) << i;
  for (int64_t i = 0; i < 2 * E; ++i) EXPECT_EQ(counts.f32()[i], 0.0f);
  EXPECT_EQ(model.buffers().size(), 2u);
  EXPECT_EQ(model.buffers()[1].first, "model.layers.1.mlp.expert_bias");

  // A large bias on expert 5 of the last sparse layer routes every token there; the aux loss keeps using
  // the unbiased selection (HF recomputes top-k of the raw probabilities) and the router inputs of both
  // sparse layers are unchanged, so it does not change.
  model.expert_bias().zero_();
  model.expert_bias().f32()[E + 5] = 10.0f;
  ForwardResult rb = model.forward(batch.input_ids.data(), batch.labels.data(), batch.B, batch.T);
  EXPECT_EQ(model.expert_token_counts().f32()[E + 5], float(N));
  EXPECT_NEAR(rb.aux_loss, r0.aux_loss, 1e-12);
  EXPECT_NE(rb.ce_loss, r0.ce_loss);
  model.backward();  // gradients stay finite with a steered selection
  double sq = 0;
  for (auto& g : model.flat_grads())
    for (int64_t i = 0; i < g.numel(); ++i) sq += double(g.f32()[i]) * g.f32()[i];
  EXPECT_TRUE(std::isfinite(sq) && sq > 0);

  // Without load_balance_coeff the bias is not used and update_expert_bias is a no-op.
  plain.expert_bias().f32()[5] = 10.0f;
  ForwardResult rp = plain.forward(batch.input_ids.data(), batch.labels.data(), batch.B, batch.T);
  EXPECT_EQ(rp.loss, r0.loss);
  plain.update_expert_bias();
  EXPECT_EQ(plain.expert_bias().f32()[5], 10.0f);
}

// The aux-loss gradient: finite differences of the aux loss alone (CE removed by ignoring every label) along
// the router weights, with output_router_logits and a coefficient of 1.
TEST(Qwen3Moe, AuxLossGradientMatchesFiniteDifferences) {
  const std::string dir = source_path("tests/golden/qwen3_moe/e8k2_norm");
  Qwen3Config c = Qwen3Config::from_hf_file(dir + "/config.json");
  Qwen3Model model(c);
  model.load_hf(dir);
  TokenBatch batch = read_token_batch_json(dir + "/input.json");
  std::vector<int32_t> labels(batch.labels.size(), -100);
  ForwardOptions o;
  o.aux_loss_scale = 1.0f;
  model.zero_grad();
  ForwardResult r = model.forward(batch.input_ids.data(), labels.data(), batch.B, batch.T, o);
  model.backward();
  Param& gate = model.param("model.layers.1.mlp.gate.weight");
  const Tensor grad = gate.grad.clone();
  ForwardOptions no_grad;
  no_grad.compute_grad = false;
  double worst = 0;
  for (int64_t i = 0; i < gate.value.numel(); i += 13) {
    const float saved = gate.value.f32()[i], h = 1e-3f;
    gate.value.f32()[i] = saved + h;
    const double lp =
        model.forward(batch.input_ids.data(), labels.data(), batch.B, batch.T, no_grad).aux_loss;
    gate.value.f32()[i] = saved - h;
    const double lm =
        model.forward(batch.input_ids.data(), labels.data(), batch.B, batch.T, no_grad).aux_loss;
    gate.value.f32()[i] = saved;
    worst = std::max(worst, std::abs((lp - lm) / (2 * h) - grad.f32()[i]));
  }
  EXPECT_GT(r.aux_loss, 0);
  EXPECT_LE(worst, 2e-3);
}

}  // namespace
}  // namespace titan
