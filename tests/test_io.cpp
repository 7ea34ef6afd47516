// safetensors and HF checkpoint directories: round trips, sharding, and every kind of bad input
// giving one clear error that names the file and the tensor or field.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/hf_checkpoint.h"
#include "io/safetensors.h"
#include "models/qwen3/model.h"
#include "support/testing.h"

namespace titan {
namespace {

using testing::TempDir;
namespace fs = std::filesystem;

// Writes a raw safetensors file from a header string and a data section.
void write_raw(const std::string& path, const std::string& header, const std::string& data,
               uint64_t header_len_override = 0) {
  std::ofstream f(path, std::ios::binary);
  uint64_t n = header_len_override ? header_len_override : header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header << data;
}

// Expects `fn` to throw titan::Error whose message contains every string in `parts`.
template <class Fn>
void expect_error(Fn fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown";
  } catch (const Error& e) {
    for (auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << " lacks " << p;
  }
}

TEST(Safetensors, RoundTripKeepsValuesShapesAndMetadata) {
  TempDir tmp;
  Tensor a = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = Tensor::from_vector({-1.5f, 0.25f}, {2}).to(DType::BF16);
  Tensor s = Tensor::from_vector({7}, {});
  save_safetensors(tmp / "x.safetensors", {{"a", a}, {"b", b}, {"scalar", s}}, {{"format", "pt"}});
  SafetensorsFile f(tmp / "x.safetensors");
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.entry("a").shape, (Shape{2, 3}));
  EXPECT_EQ(f.entry("b").dtype, "BF16");
  EXPECT_EQ(f.entry("scalar").shape.size(), 0u);
  EXPECT_EQ(testing::rel_error(f.load("a"), a), 0.0);
  Tensor b32 = Tensor::zeros({2});
  f.read_into("b", b32);
  EXPECT_EQ(b32.f32()[0], -1.5f);
  EXPECT_EQ(b32.f32()[1], 0.25f);
  EXPECT_FALSE(fs::exists(tmp / "x.safetensors.tmp." + std::to_string(getpid())));
}

TEST(Safetensors, Bf16ConversionRoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.00390625f)), 1.0f);       // tie -> even
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.01171875f)), 1.015625f);  // tie -> even (up)
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xc000), -2.0f);
}

TEST(Safetensors, TruncatedFile) {
  TempDir tmp;
  std::ofstream(tmp / "t.safetensors") << "abc";
  expect_error([&] { SafetensorsFile f(tmp / "t.safetensors"); }, {"t.safetensors", "truncated"});
}

TEST(Safetensors, HeaderLengthBeyondFile) {
  TempDir tmp;
  write_raw(tmp / "h.safetensors", "{}", "", 1 << 20);
  expect_error([&] { SafetensorsFile f(tmp / "h.safetensors"); }, {"h.safetensors", "header length"});
}

TEST(Safetensors, HeaderNotJson) {
  TempDir tmp;
  write_raw(tmp / "j.safetensors", "{not json", "");
  expect_error([&] { SafetensorsFile f(tmp / "j.safetensors"); }, {"j.safetensors", "JSON"});
}

TEST(Safetensors, OffsetsOutOfRange) {
  TempDir tmp;
  write_raw(tmp / "o.safetensors", R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
            std::string(8, '\0'));
  expect_error([&] { SafetensorsFile f(tmp / "o.safetensors"); }, {"o.safetensors", "'w'", "out of range"});
}

TEST(Safetensors, OverlappingTensors) {
  TempDir tmp;
  write_raw(
      tmp / "v.safetensors",
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
      std::string(12, '\0'));
  expect_error([&] { SafetensorsFile f(tmp / "v.safetensors"); }, {"v.safetensors", "'a'", "'b'", "overlap"});
}

TEST(Safetensors, UnknownDtype) {
  TempDir tmp;
  write_raw(tmp / "d.safetensors", R"({"w":{"dtype":"F12","shape":[1],"data_offsets":[0,4]}})",
            std::string(4, '\0'));
  expect_error([&] { SafetensorsFile f(tmp / "d.safetensors"); },
               {"d.safetensors", "'w'", "unknown dtype", "F12"});
}

TEST(Safetensors, SizeDoesNotMatchShape) {
  TempDir tmp;
  write_raw(tmp / "s.safetensors", R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
            std::string(8, '\0'));
  expect_error([&] { SafetensorsFile f(tmp / "s.safetensors"); }, {"s.safetensors", "'w'", "do not match"});
}

TEST(Safetensors, MissingFile) {
  expect_error([] { SafetensorsFile f("/nonexistent/m.safetensors"); },
               {"/nonexistent/m.safetensors", "cannot open"});
}

Qwen3Config tiny_config(bool tied) {
  Qwen3Config c = Qwen3Config::flavor("debug");
  c.vocab_size = 64;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 6;
  c.tie_word_embeddings = tied;
  return c;
}

TEST(HFCheckpoint, SaveLoadRoundTripSingleAndSharded) {
  for (bool tied : {true, false})
    for (int64_t shard : {int64_t(1) << 30, int64_t(4096)}) {
      TempDir tmp;
      Qwen3Model a(tiny_config(tied));
      a.init_weights(42);
      a.save_hf(tmp.path.string(), DType::F32, shard);
      const bool sharded = shard == 4096;
      EXPECT_EQ(fs::exists(tmp / "model.safetensors.index.json"), sharded);
      EXPECT_EQ(fs::exists(tmp / "model.safetensors"), !sharded);
      HFCheckpointReader r(tmp.path.string());
      EXPECT_EQ(r.contains("lm_head.weight"), !tied);  // save_pretrained omits the tied head
      Qwen3Model b(Qwen3Config::from_hf_file(tmp / "config.json"));
      b.load_hf(tmp.path.string());
      for (size_t i = 0; i < a.params().size(); ++i)
        EXPECT_EQ(testing::rel_error(b.params()[i].value, a.params()[i].value), 0.0) << a.params()[i].name;
    }
}

TEST(HFCheckpoint, Bf16ExportIsHalfTheSizeAndRounded) {
  TempDir tmp;
  Qwen3Model a(tiny_config(true));
  a.save_hf(tmp.path.string(), DType::BF16);
  SafetensorsFile f(tmp / "model.safetensors");
  EXPECT_EQ(f.entry("model.embed_tokens.weight").dtype, "BF16");
  auto cfg = nlohmann::json::parse(std::ifstream(tmp / "config.json"));
  EXPECT_EQ(cfg["torch_dtype"], "bfloat16");
  Qwen3Model b(Qwen3Config::from_hf_file(tmp / "config.json"));
  b.load_hf(tmp.path.string());
  EXPECT_LE(testing::rel_error(b.params()[0].value, a.params()[0].value), 4e-3);
}

TEST(HFCheckpoint, MissingAndUnexpectedKeysAreListed) {
  TempDir tmp;
  Qwen3Model a(tiny_config(false));
  NamedTensors sd = a.state_dict();
  sd.erase(sd.begin() + 3);  // drop one layer-0 tensor
  sd.emplace_back("model.layers.0.mlp.extra.weight", Tensor::zeros({2}));
  fs::create_directories(tmp.path);
  save_hf_checkpoint(tmp.path.string(), a.config().to_hf_json(), sd, DType::F32);
  Qwen3Model b(a.config());
  expect_error([&] { b.load_hf(tmp.path.string()); },
               {tmp.path.string(), "missing keys: " + a.state_dict()[3].first,
                "unexpected keys: model.layers.0.mlp.extra.weight"});
}

TEST(HFCheckpoint, ShapeMismatchNamesFileAndTensor) {
  TempDir tmp;
  Qwen3Config c = tiny_config(true);
  Qwen3Model a(c);
  a.save_hf(tmp.path.string(), DType::F32);
  c.intermediate_size = 32;  // same keys, different MLP shapes
  Qwen3Model b(c);
  expect_error([&] { b.load_hf(tmp.path.string()); }, {"model.safetensors", "mlp.", "has shape", "expected"});
}

TEST(HFCheckpoint, MissingShardIsNamed) {
  TempDir tmp;
  Qwen3Model a(tiny_config(false));
  a.save_hf(tmp.path.string(), DType::F32, 4096);
  fs::remove(tmp / "model-00002-of-" + [&] {
    for (auto& e : fs::directory_iterator(tmp.path)) {
      auto n = e.path().filename().string();
      if (n.starts_with("model-00001-of-")) return n.substr(15);
    }
    return std::string();
  }());
  expect_error([&] { HFCheckpointReader r(tmp.path.string()); },
               {"model.safetensors.index.json", "model-00002-of-", "missing"});
}

TEST(Qwen3Config, MissingFieldIsNamed) {
  TempDir tmp;
  auto j = tiny_config(true).to_hf_json();
  j.erase("hidden_size");
  std::ofstream(tmp / "config.json") << j.dump();
  expect_error([&] { Qwen3Config::from_hf_file(tmp / "config.json"); }, {"config.json", "hidden_size"});
}

TEST(Qwen3Config, RopeThetaFromEitherPlace) {
  auto j = tiny_config(true).to_hf_json();
  j.erase("rope_theta");
  EXPECT_EQ(Qwen3Config::from_hf_json(j, "c").rope_theta, 10000.0);  // HF default
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e6}};
  EXPECT_EQ(Qwen3Config::from_hf_json(j, "c").rope_theta, 5e6);
  j["rope_parameters"]["rope_type"] = "yarn";
  expect_error([&] { Qwen3Config::from_hf_json(j, "c"); }, {"yarn", "not supported"});
  j = tiny_config(true).to_hf_json();
  j["num_key_value_heads"] = 3;
  expect_error([&] { Qwen3Config::from_hf_json(j, "cfg.json"); },
               {"cfg.json", "multiple of num_key_value_heads"});
}

TEST(ForwardCli, BadInputsExitNonZeroWithClearMessages) {
  TempDir tmp;
  Qwen3Model a(tiny_config(true));
  a.save_hf(tmp / "m", DType::F32);
  std::ofstream(tmp / "in.json") << R"({"input_ids": [[1, 2, 3], [4, 5, 6]]})";
  std::string out;
  // Good run first.
  ASSERT_EQ(testing::run_titan("forward --model " + (tmp / "m") + " --input " + (tmp / "in.json") +
                                   " --output " + (tmp / "o.safetensors"),
                               &out),
            0)
      << out;
  // Corrupt the weights: header length beyond the end of the file.
  {
    std::fstream f(tmp / "m/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    uint64_t huge = 1ull << 40;
    f.write(reinterpret_cast<const char*>(&huge), 8);
  }
  EXPECT_EQ(testing::run_titan("forward --model " + (tmp / "m") + " --input " + (tmp / "in.json") +
                                   " --output " + (tmp / "o2.safetensors"),
                               &out),
            1);
  EXPECT_NE(out.find("model.safetensors"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(tmp / "o2.safetensors"));
  // Ragged input rows and out-of-vocabulary ids.
  a.save_hf(tmp / "m", DType::F32);
  std::ofstream(tmp / "bad.json") << R"({"input_ids": [[1, 2, 3], [4, 5]]})";
  EXPECT_EQ(testing::run_titan("forward --model " + (tmp / "m") + " --input " + (tmp / "bad.json") +
                                   " --output " + (tmp / "o3.safetensors"),
                               &out),
            1);
  EXPECT_NE(out.find("bad.json"), std::string::npos) << out;
  std::ofstream(tmp / "oov.json") << R"({"input_ids": [[1, 2, 999]]})";
  EXPECT_EQ(testing::run_titan("forward --model " + (tmp / "m") + " --input " + (tmp / "oov.json") +
                                   " --output " + (tmp / "o4.safetensors"),
                               &out),
            1);
  EXPECT_NE(out.find("outside the vocabulary"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(tmp / "o4.safetensors"));
}

}  // namespace
}  // namespace titan
