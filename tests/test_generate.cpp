// Generation and evaluation (src/generate/): the KV-cache forward equals the model's full forward at every
// position; greedy tokens equal HF model.generate(do_sample=False) and eval losses equal transformers' loss
// over the same packed windows (fixtures from tools/golden/make_generate_golden.py); sampling semantics;
// streaming detokenisation; the CLI's results and errors.
#include <cmath>
#include <filesystem>
#include <map>

#include "data/loader.h"
#include "generate/chat.h"
#include "generate/eval.h"
#include "generate/generator.h"
#include "io/json_file.h"
#include "models/qwen3/lora.h"
#include "support/testing.h"

namespace titan {
namespace {

const std::string kGolden = std::string(TITAN_SOURCE_DIR) + "/tests/golden/generate/";

nlohmann::json expected(const std::string& c) {
  return read_json_file(kGolden + c + "/expected.json");
}

std::vector<int32_t> ids_of(const nlohmann::json& j) {
  return j.get<std::vector<int32_t>>();
}

// max |a - b| over max |b| of two logit rows.
double row_rel(const float* a, const float* b, int64_t V) {
  double diff = 0, ref = 0;
  for (int64_t v = 0; v < V; ++v)
    diff = std::max(diff, std::fabs((double)a[v] - b[v])), ref = std::max(ref, std::fabs((double)b[v]));
  return diff / ref;
}

// KV-cache logits (prefill of 7, single steps, a chunk of 5, single steps) at every position vs the full
// forward's logits over the same ids.
void check_kv_against_full(const std::string& c, bool bf16, const KernelChoice& kv_kernels, double tol) {
  auto model = load_model_dir(kGolden + c, bf16);
  auto ids = ids_of(expected(c)["greedy"][2]["prompt_ids"]);
  ids.resize(40);
  const int64_t T = 40, V = model->config().vocab_size;
  std::vector<int32_t> labels(T, -100);
  ForwardOptions fo;
  fo.compute_grad = false;
  fo.keep_logits = true;
  model->forward(ids.data(), labels.data(), 1, T, fo);
  const std::vector<float> full(model->logits().f32(), model->logits().f32() + T * V);
  KVCacheModel kv(*model, T, kv_kernels);
  int64_t p = 0;
  double worst = 0;
  for (int64_t n : {7, 1, 1, 1, 5, 1, 20, 1, 1, 1, 1}) {
    const float* lg = kv.forward(ids.data() + p, n, true);
    for (int64_t i = 0; i < n; ++i)
      worst = std::max(worst, row_rel(lg + i * V, full.data() + (p + i) * V, V));
    p += n;
  }
  ASSERT_EQ(p, T);
  EXPECT_LE(worst, tol) << c << (bf16 ? " bf16" : " f32");
  // The last-token form returns the same row; so does re-running a tail after truncating the cache.
  kv.reset();
  const float* last = kv.forward(ids.data(), T);
  EXPECT_LE(row_rel(last, full.data() + (T - 1) * V, V), tol);
  kv.truncate(25);
  last = kv.forward(ids.data() + 25, T - 25);
  EXPECT_LE(row_rel(last, full.data() + (T - 1) * V, V), tol);
  EXPECT_THROW(kv.forward(ids.data(), 1), Error);  // full
}

TEST(Generate, KVCacheForwardEqualsFullForwardDense) {
  check_kv_against_full("dense", false, {}, 1e-5);
  check_kv_against_full("dense", false, {{"attention_kv", "reference"}}, 1e-5);
}

TEST(Generate, KVCacheForwardEqualsFullForwardMoE) {
  check_kv_against_full("moe", false, {}, 1e-5);
  check_kv_against_full("moe", false, {{"attention_kv", "reference"}}, 1e-5);
}

// bf16: both paths round at the same points; GEMMs of different row counts may sum in other orders, so a
// value can land on the other side of a bf16 rounding boundary (observed here: identical logits).
TEST(Generate, KVCacheForwardEqualsFullForwardBf16) {
  check_kv_against_full("dense", true, {}, 1e-2);
  check_kv_against_full("moe", true, {}, 1e-2);
}

// `--dtype bf16` on the CPU holds the weights once, as bf16: no f32 parameter buffer, 2 bytes a parameter,
// and the KV-cache logits equal those of an f32-held model under bf16 compute (the rounded weights' images)
// bit for bit, on every bf16 GEMM engine (the fallbacks read the bf16 weights through their images too).
// A full forward (eval) streams the bf16 groups and equals that model's forward as well.
TEST(Generate, Bf16WeightsAreHeldOnceAsBf16) {
  for (const std::string c : {"dense", "moe"})
    for (const std::string engine : {"", "sgemm", "reference"}) {
      SCOPED_TRACE(c + " " + (engine.empty() ? "default engine" : engine));
      KernelChoice kernels;
      if (!engine.empty()) kernels = {{"matmul_bf16", engine}, {"moe_experts_bf16", engine}};
      auto held = load_model_dir(kGolden + c, true, kernels);
      for (const Tensor& t : held->flat_params()) EXPECT_FALSE(t.defined());
      const auto* weights = dynamic_cast<const FrozenBf16Base*>(held->param_streamer());
      ASSERT_NE(weights, nullptr);
      EXPECT_EQ(weights->bytes(), 2 * held->num_params());
      Qwen3Model f32(held->config(), kernels);
      f32.load_hf(kGolden + c);
      f32.set_bf16_compute(true);
      EXPECT_EQ(held->kernel_names(), f32.kernel_names());

      auto ids = ids_of(expected(c)["greedy"][2]["prompt_ids"]);
      ids.resize(12);
      const int64_t T = 12, V = held->config().vocab_size;
      KVCacheModel a(*held, T), b(f32, T);
      for (auto [p, n] : {std::pair<int64_t, int64_t>{0, 9}, {9, 1}, {10, 2}}) {
        const float* la = a.forward(ids.data() + p, n, true);
        const std::vector<float> first(la, la + n * V);
        const float* lb = b.forward(ids.data() + p, n, true);
        for (int64_t i = 0; i < n * V; ++i) ASSERT_EQ(first[i], lb[i]) << "position " << p + i / V;
      }
      std::vector<int32_t> labels(ids.begin() + 1, ids.end());
      labels.push_back(-100);
      ForwardOptions fo;
      fo.compute_grad = false;
      EXPECT_EQ(held->forward(ids.data(), labels.data(), 1, T, fo).loss,
                f32.forward(ids.data(), labels.data(), 1, T, fo).loss);
    }
  // An adapter is merged into f32 weights first, then they are held as bf16.
  const std::string lora = kGolden + "dense/lora";
  auto held = load_model_dir(kGolden + "dense", true, {}, lora);
  auto f32 = load_model_dir(kGolden + "dense", false, {}, lora);
  f32->set_bf16_compute(true);
  ASSERT_NE(held->param_streamer(), nullptr);
  const auto ids = ids_of(expected("dense")["greedy"][2]["prompt_ids"]);
  const int64_t n = static_cast<int64_t>(ids.size()), V = held->config().vocab_size;
  KVCacheModel a(*held, n), b(*f32, n);
  const float* la = a.forward(ids.data(), n);
  const std::vector<float> first(la, la + V);
  const float* lb = b.forward(ids.data(), n);
  EXPECT_EQ(first, std::vector<float>(lb, lb + V));
}

void check_greedy(const std::string& c, Device device = Device::cpu()) {
  auto model = load_model_dir(kGolden + c, false, {}, "", device);
  const auto e = expected(c);
  const GenerationDefaults d = read_generation_defaults(kGolden + c);
  EXPECT_EQ(d.eos_ids, ids_of(e["eos_token_id"]));
  EXPECT_FALSE(d.sampling.do_sample);
  for (const auto& g : e["greedy"]) {
    const auto prompt = ids_of(g["prompt_ids"]);
    KVCacheModel kv(*model, static_cast<int64_t>(prompt.size()) + 20);
    GenerateOptions go;
    go.max_new_tokens = e["max_new_tokens"].get<int64_t>();
    go.eos_ids = d.eos_ids;
    std::vector<int32_t> streamed;
    auto out = generate(kv, prompt, go, [&](int32_t id) { streamed.push_back(id); });
    EXPECT_EQ(out, ids_of(g["output_ids"])) << c << " prompt of " << prompt.size() << " tokens";
    EXPECT_EQ(streamed, out);
  }
}

TEST(Generate, GreedyEqualsHFDense) {
  check_greedy("dense");
  // the fixture's first dense prompt stops at an eos id before max_new_tokens
  const auto g = expected("dense")["greedy"][0]["output_ids"];
  EXPECT_LT(g.size(), 20u);
}

TEST(Generate, GreedyEqualsHFMoE) {
  check_greedy("moe");
}

// The KV cache and the model on the guard device (host memory the host cannot read directly): the same
// greedy tokens, so generation reaches device memory only through ops and copies.
TEST(Generate, GreedyEqualsHFOnTheGuardDevice) {
  check_greedy("dense", Device{DeviceType::GUARD, 0});
  check_greedy("moe", Device{DeviceType::GUARD, 0});
}

TEST(Generate, GreedyEqualsHFOnCuda) {
  TITAN_SKIP_WITHOUT_CUDA_GPU();
  check_greedy("dense", Device{DeviceType::CUDA, 0});
  check_greedy("moe", Device{DeviceType::CUDA, 0});
}

// --lora: the PEFT adapter of tests/golden/generate/dense/lora merged into the weights gives the PeftModel's
// greedy tokens and loss (fixture by make_generate_golden.py).
void check_lora_generate(Device device) {
  const std::string lora = kGolden + "dense/lora";
  auto model = load_model_dir(kGolden + "dense", false, {}, lora, device);
  const auto e = read_json_file(lora + "/expected.json");
  for (const auto& g : e["greedy"]) {
    const auto prompt = ids_of(g["prompt_ids"]);
    KVCacheModel kv(*model, static_cast<int64_t>(prompt.size()) + 20);
    GenerateOptions go;
    go.max_new_tokens = 20;
    go.eos_ids = read_generation_defaults(kGolden + "dense").eos_ids;
    EXPECT_EQ(generate(kv, prompt, go), ids_of(g["output_ids"])) << prompt.size();
  }
  const auto cfg =
      eval_data_config({kGolden + "dense/eval.txt"}, kGolden + "dense", e["eval"]["seq_len"].get<int64_t>());
  const double hf = e["eval"]["loss"].get<double>();
  EXPECT_LE(std::fabs(evaluate_dataset(*model, cfg).loss() - hf) / hf, 1e-5);
}

TEST(Generate, LoraAdapterEqualsPeft) {
  check_lora_generate(Device::cpu());
  check_lora_generate(Device{DeviceType::GUARD, 0});  // merged in host memory, then moved
}

TEST(Generate, LoraAdapterEqualsPeftOnCuda) {
  TITAN_SKIP_WITHOUT_CUDA_GPU();
  check_lora_generate(Device{DeviceType::CUDA, 0});
}

TEST(Generate, StopsAtEosAndMaxNewTokens) {
  auto model = load_model_dir(kGolden + "dense", false);
  const auto g = expected("dense")["greedy"][1];
  const auto prompt = ids_of(g["prompt_ids"]);
  const auto full = ids_of(g["output_ids"]);
  KVCacheModel kv(*model, 64);
  GenerateOptions go;
  go.max_new_tokens = 20;
  go.eos_ids = {full[5]};  // the sixth greedy token now ends generation
  auto out = generate(kv, prompt, go);
  const size_t first = std::find(full.begin(), full.end(), full[5]) - full.begin();
  EXPECT_EQ(out, std::vector<int32_t>(full.begin(), full.begin() + first + 1));
  kv.reset();
  go.eos_ids.clear();
  go.max_new_tokens = 3;
  EXPECT_EQ(generate(kv, prompt, go), std::vector<int32_t>(full.begin(), full.begin() + 3));
  // capacity is checked before anything runs
  kv.reset();
  go.max_new_tokens = 64;
  EXPECT_NE(testing::error_of([&] { generate(kv, prompt, go); }).find("exceed the context"),
            std::string::npos);
}

TEST(Sampler, WarpersFollowHFSemantics) {
  // probabilities 0.5, 0.3, 0.15, 0.05 (ids 2, 0, 3, 1)
  const std::vector<float> lg = {std::log(0.3f), std::log(0.05f), std::log(0.5f), std::log(0.15f)};
  SamplingOptions o;
  o.do_sample = true;
  auto ids = [&](const SamplingOptions& s) {
    std::vector<int32_t> r;
    for (auto& [id, p] : Sampler(s).candidates(lg.data(), 4)) r.push_back(id);
    return r;
  };
  EXPECT_EQ(ids(o), (std::vector<int32_t>{2, 0, 3, 1}));
  o.top_k = 2;
  EXPECT_EQ(ids(o), (std::vector<int32_t>{2, 0}));
  o.top_k = 0, o.top_p = 0.75;  // HF: drop the tail whose cumulative probability is <= 1 - top_p
  EXPECT_EQ(ids(o), (std::vector<int32_t>{2, 0}));
  o.top_p = 0.9;
  EXPECT_EQ(ids(o), (std::vector<int32_t>{2, 0, 3}));
  o.top_p = 1e-6;
  EXPECT_EQ(ids(o), (std::vector<int32_t>{2}));
  o.top_k = 3, o.top_p = 0.9;  // top-k first: {0.5, 0.3, 0.15} renormalised, then top-p
  auto c = Sampler(o).candidates(lg.data(), 4);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_NEAR(c[0].second, 0.5 / 0.95, 1e-6);
  o = SamplingOptions{true, 2.0, 0, 1.0, 0};  // temperature 2 flattens: p ~ sqrt(p)
  c = Sampler(o).candidates(lg.data(), 4);
  EXPECT_NEAR(c[0].second / c[1].second, std::sqrt(0.5 / 0.3), 1e-5);
  // Empirical frequencies follow the probabilities.
  o = SamplingOptions{true, 1.0, 0, 1.0, 123};
  Sampler s(o);
  std::map<int32_t, int> count;
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++count[s.next(lg.data(), 4)];
  EXPECT_NEAR(count[2] / double(n), 0.5, 0.015);
  EXPECT_NEAR(count[0] / double(n), 0.3, 0.015);
  EXPECT_NEAR(count[3] / double(n), 0.15, 0.015);
  EXPECT_NEAR(count[1] / double(n), 0.05, 0.01);
  // Bad settings.
  EXPECT_THROW(Sampler(SamplingOptions{true, 0.0, 0, 1.0, 0}), Error);
  EXPECT_THROW(Sampler(SamplingOptions{true, 1.0, -1, 1.0, 0}), Error);
  EXPECT_THROW(Sampler(SamplingOptions{true, 1.0, 0, 1.5, 0}), Error);
}

TEST(Sampler, TopK1AndTinyTopPAreGreedyAndSeedsReproduce) {
  auto model = load_model_dir(kGolden + "moe", false);
  const auto g = expected("moe")["greedy"][1];
  const auto prompt = ids_of(g["prompt_ids"]);
  KVCacheModel kv(*model, 64);
  auto run = [&](SamplingOptions s) {
    kv.reset();
    GenerateOptions go;
    go.max_new_tokens = 20;
    go.eos_ids = ids_of(expected("moe")["eos_token_id"]);
    go.sampling = s;
    return generate(kv, prompt, go);
  };
  const auto greedy = ids_of(g["output_ids"]);
  EXPECT_EQ(run({true, 1.0, 1, 1.0, 5}), greedy);
  EXPECT_EQ(run({true, 0.7, 0, 1e-9, 6}), greedy);
  const auto a = run({true, 1.5, 50, 0.95, 42});
  EXPECT_EQ(run({true, 1.5, 50, 0.95, 42}), a);
  EXPECT_NE(run({true, 1.5, 50, 0.95, 43}), a);
  EXPECT_NE(a, greedy);
}

TEST(Generate, StreamerPrintsOnlyWholeCharacters) {
  Tokenizer tok = Tokenizer::load(kGolden + "dense");
  const std::string text = "último: ñandú 東京 ok";
  const auto ids = tok.encode(text);
  TextStreamer st(tok);
  std::string out;
  int held = 0;
  for (int32_t id : ids) {
    std::string piece = st.put(id);
    held += piece.empty();
    EXPECT_EQ(piece.find("\xEF\xBF\xBD"), std::string::npos);
    out += piece;
  }
  out += st.finish();
  EXPECT_EQ(out, text);
  EXPECT_GT(held, 0) << "no character of the test text spans two tokens";
}

// Two chat turns: the rendered prompt equals HF apply_chat_template's ids and the reply equals HF greedy
// generate on it; the second turn runs only what the first did not leave in the cache.
TEST(Chat, TurnsEqualHFGreedy) {
  for (std::string c : {"dense", "moe"}) {
    auto model = load_model_dir(kGolden + c, false);
    Tokenizer tok = Tokenizer::load(kGolden + c);
    const auto chat = expected(c)["chat"];
    GenerateOptions go;
    go.max_new_tokens = chat["max_new_tokens"].get<int64_t>();
    go.eos_ids = read_generation_defaults(kGolden + c).eos_ids;
    ChatSession session(*model, tok, ChatTemplate::from_tokenizer_config(kGolden + c), go, 256);
    for (const auto& turn : chat["turns"]) {
      auto out = session.reply(turn["user"].get<std::string>());
      EXPECT_EQ(session.last_prompt(), ids_of(turn["prompt_ids"])) << c;
      EXPECT_EQ(out, ids_of(turn["output_ids"])) << c;
      EXPECT_EQ(session.messages().back()["content"].get<std::string>(), turn["reply"].get<std::string>())
          << c;
    }
    EXPECT_GT(session.last_reused(), 0) << c;
    EXPECT_EQ(session.messages().size(), 4u);
  }
}

TEST(GenerateCli, ChatReadsTurnsFromStdin) {
  const auto chat = expected("moe")["chat"];
  testing::TempDir tmp;
  std::ofstream(tmp / "in.txt") << chat["turns"][0]["user"].get<std::string>() << "\n\n"
                                << chat["turns"][1]["user"].get<std::string>() << "\n";
  // stdout only (the stderr hint line dropped)
  const auto r = testing::run_shell_command("sh -c '" + std::string(TITAN_BINARY) + " generate --model " +
                                            kGolden + "moe --chat --greedy --max-new-tokens 8 < " +
                                            (tmp / "in.txt") + " 2>/dev/null'");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(r.output, chat["turns"][0]["reply"].get<std::string>() + "\n" +
                          chat["turns"][1]["reply"].get<std::string>() + "\n");
}

TEST(Eval, WindowsAreTheDataLayersAndLossEqualsHF) {
  for (std::string c : {"dense", "moe"}) {
    auto model = load_model_dir(kGolden + c, false);
    const auto fixture = expected(c);  // held: a range-for over expected(c)["eval"] reads a freed temporary
    for (const auto& e : fixture["eval"]) {
      const std::string file = kGolden + c + "/" + e["file"].get<std::string>();
      const int64_t T = e["seq_len"].get<int64_t>();
      const auto cfg = eval_data_config({file}, kGolden + c, T);
      // The loader's windows are the fixture's.
      data::DataLoader loader(cfg);
      data::Batch b;
      size_t w = 0;
      while (loader.next_batch(b)) {
        ASSERT_LT(w, e["windows"].size());
        auto want = ids_of(e["windows"][w++]);
        EXPECT_EQ(b.input_ids, std::vector<int32_t>(want.begin(), want.end() - 1));
        EXPECT_EQ(b.labels, std::vector<int32_t>(want.begin() + 1, want.end()));
      }
      EXPECT_EQ(w, e["windows"].size());
      for (int64_t batch : {1, 4}) {
        int64_t windows = -1;
        const EvalResult r = evaluate_dataset(*model, cfg, batch, &windows);
        EXPECT_EQ(windows, (int64_t)e["windows"].size());
        const double hf = e["loss"].get<double>();
        EXPECT_LE(std::fabs(r.loss() - hf) / hf, 1e-5) << c << " " << file << " batch " << batch;
        EXPECT_EQ(r.targets, e["num_tokens"].get<int64_t>());
        EXPECT_EQ(r.batches, ((int64_t)e["windows"].size() + batch - 1) / batch);
        EXPECT_NEAR(r.perplexity(), std::exp(r.loss()), 1e-9 * r.perplexity());
      }
    }
  }
}

// Chat files: one row per conversation from the chat data layer, loss on the assistant tokens only; equals
// transformers' loss with HF's return_assistant_tokens_mask labels.
TEST(Eval, ChatFileLossEqualsHF) {
  for (std::string c : {"dense", "moe"}) {
    auto model = load_model_dir(kGolden + c, false);
    const auto e = expected(c)["chat_eval"];
    const int64_t T = e["seq_len"].get<int64_t>();
    const auto cfg = eval_data_config({kGolden + c + "/" + e["file"].get<std::string>()}, kGolden + c, T,
                                      data::DataFormat::Chat);
    data::DataLoader loader(cfg);
    data::Batch b;
    size_t row = 0;
    while (loader.next_batch(b)) {
      ASSERT_LT(row, e["rows"].size());
      const auto ids = ids_of(e["rows"][row]["input_ids"]), hf_labels = ids_of(e["rows"][row++]["labels"]);
      for (int64_t t = 0; t < T; ++t) {
        if (t < (int64_t)ids.size()) {
          EXPECT_EQ(b.input_ids[t], ids[t]) << c << " row " << row << " t " << t;
        }
        const int32_t want = t + 1 < (int64_t)hf_labels.size() ? hf_labels[t + 1] : -100;
        EXPECT_EQ(b.labels[t], want) << c << " row " << row << " t " << t;
      }
    }
    EXPECT_EQ(row, e["rows"].size());
    for (int64_t batch : {1, 2}) {
      const EvalResult r = evaluate_dataset(*model, cfg, batch);
      const double hf = e["loss"].get<double>();
      EXPECT_LE(std::fabs(r.loss() - hf) / hf, 1e-5) << c << " batch " << batch;
      EXPECT_EQ(r.targets, e["num_tokens"].get<int64_t>());
    }
  }
}

TEST(Eval, TooShortDataIsAnError) {
  auto model = load_model_dir(kGolden + "dense", false);
  const auto cfg = eval_data_config({kGolden + "dense/eval.txt"}, kGolden + "dense", 100000);
  EXPECT_NE(testing::error_of([&] { evaluate_dataset(*model, cfg); }).find("no whole window"),
            std::string::npos);
}

TEST(GenerateCli, GreedyIdsAndTextAndEval) {
  const auto g = expected("dense")["greedy"][2];
  std::string ids, out;
  for (auto& x : g["prompt_ids"]) ids += (ids.empty() ? "" : ",") + std::to_string(x.get<int>());
  ASSERT_EQ(testing::run_titan("generate --model " + kGolden + "dense --prompt-ids " + ids +
                                   " --max-new-tokens 20 --print-ids --greedy",
                               &out),
            0)
      << out;
  std::string want;
  for (auto& x : g["output_ids"]) want += (want.empty() ? "" : " ") + std::to_string(x.get<int>());
  EXPECT_NE(out.find("\n" + want + "\n"), std::string::npos) << out;
  Tokenizer tok = Tokenizer::load(kGolden + "dense");
  EXPECT_EQ(out.rfind(tok.decode(ids_of(g["output_ids"]), true), 0), 0u) << out;
  // Prompt ids need no tokenizer: a model directory without tokenizer.json prints the ids alone.
  testing::TempDir bare;
  for (const char* f : {"config.json", "model.safetensors", "generation_config.json"})
    if (std::filesystem::exists(kGolden + "dense/" + f))
      std::filesystem::copy_file(kGolden + "dense/" + f, bare / f);
  ASSERT_EQ(testing::run_titan("generate --model " + bare.path.string() + " --prompt-ids " + ids +
                                   " --max-new-tokens 20 --greedy",
                               &out),
            0)
      << out;
  EXPECT_NE(out.find(want + "\n"), std::string::npos) << out;
  EXPECT_NE(out.find("no tokenizer.json"), std::string::npos) << out;
  // --prompt TEXT gives the same tokens (the fixture prompt ids are the text's encoding)
  ASSERT_EQ(testing::run_titan("generate --model " + kGolden +
                                   "moe --prompt 'The quick brown fox' --print-ids "
                                   "--max-new-tokens 20",
                               &out),
            0)
      << out;
  want.clear();
  const auto moe = expected("moe");
  for (auto& x : moe["greedy"][1]["output_ids"])
    want += (want.empty() ? "" : " ") + std::to_string(x.get<int>());
  EXPECT_NE(out.find("\n" + want + "\n"), std::string::npos) << out;
  // bf16 weights: runs, streams, stops at max-new-tokens
  ASSERT_EQ(testing::run_titan("generate --model " + kGolden + "moe --prompt-ids " + ids +
                                   " --dtype bf16 --greedy --max-new-tokens 5 --print-ids",
                               &out),
            0)
      << out;
  EXPECT_NE(out.find("5 new tokens"), std::string::npos) << out;
  // eval --json
  ASSERT_EQ(testing::run_titan("eval --model " + kGolden + "dense --data " + kGolden +
                                   "dense/eval.jsonl --seq-len 24 --batch 3 --json",
                               &out),
            0)
      << out;
  const auto j = nlohmann::json::parse(out.substr(out.find('{')));
  const double hf = expected("dense")["eval"][1]["loss"].get<double>();
  EXPECT_LE(std::fabs(j["loss"].get<double>() - hf) / hf, 1e-5);
}

TEST(GenerateCli, BadInputIsOneClearError) {
  const std::string m = " --model " + kGolden + "dense";
  struct Case {
    std::string args, message;
  };
  for (const Case& c : std::vector<Case>{
           {"generate --model /no/such/dir --prompt hi", "does not exist"},
           {"generate --model " + kGolden + " --prompt hi", "no config.json"},
           {"generate" + m, "--prompt"},
           {"generate" + m + " --prompt-ids 1,x", "not a token id"},
           {"generate" + m + " --prompt-ids 1,100000", "outside the vocabulary"},
           {"generate" + m + " --prompt hi --top-p 2", "top_p"},
           {"generate" + m + " --prompt hi --dtype f16", "--dtype"},
           {"generate" + m + " --prompt hi --lora /no/such/adapter", "/no/such/adapter"},
           {"eval" + m + " --data " + kGolden + "dense/eval.txt --lora /no/such/adapter", "/no/such/adapter"},
           {"eval" + m + " --data /no/such/file.txt", "does not exist"},
           {"eval --model /no/such/dir --data " + kGolden + "dense/eval.txt", "does not exist"},
           {"eval" + m + " --data " + kGolden + "dense/eval.txt --seq-len 100000", "no whole window"},
           {"eval" + m + " --data " + kGolden + "dense/eval.txt --seq-len 2147483647",
            "seq_len = 2147483647 is larger than titan accepts"},
       }) {
    std::string out;
    EXPECT_EQ(testing::run_titan(c.args, &out), 1) << c.args << "\n" << out;
    EXPECT_NE(out.find(c.message), std::string::npos) << c.args << "\n" << out;
    EXPECT_EQ(out.find("terminate"), std::string::npos) << out;
  }
}

// Command-line mistakes (CLI11's parse errors) read like every other error: "titan <cmd>: error: ...".
TEST(GenerateCli, FlagMistakesAreErrorsLikeAnyOther) {
  for (auto [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"generate --model m --prompt x --prompt-ids 1",
            "titan generate: error: --prompt excludes --prompt-ids"},
           {"generate --no-such-flag", "titan generate: error:"},
           {"eval --model m --data d --seq-len x", "titan eval: error:"},
           {"convert", "titan convert: error: --input is required"}}) {
    std::string out;
    EXPECT_NE(testing::run_titan(args, &out), 0) << args;
    EXPECT_EQ(out.rfind(message, 0), 0u) << args << "\n" << out;
  }
  std::string out;
  EXPECT_EQ(testing::run_titan("generate --help", &out), 0);
  EXPECT_NE(out.find("Usage: titan generate"), std::string::npos) << out;
}

}  // namespace
}  // namespace titan
