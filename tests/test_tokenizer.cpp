// Tokenizer tests: exactness against HF `tokenizers` fixtures (tests/golden/tokenizer, made by
// tools/golden/make_tokenizer_golden.py), the trainer's determinism, the CLI, and bad input.
#include <gtest/gtest.h>
#include <omp.h>
#include <utf8proc.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/trainer.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const std::string kGolden = TITAN_SOURCE_DIR "/tests/golden/tokenizer";
const std::string kQwen = TITAN_SOURCE_DIR "/../shared/assets/qwen3-tokenizer";

struct Case {
  std::string text;
  std::vector<int32_t> ids, ids_special;
  std::string decoded, decoded_skip;
};

std::vector<Case> read_cases(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "missing fixture " << path;
  std::vector<Case> cases;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    json j = json::parse(line);
    Case c;
    c.text = j["text"].get<std::string>();
    c.ids = j["ids"].get<std::vector<int32_t>>();
    c.ids_special = j.contains("ids_special") ? j["ids_special"].get<std::vector<int32_t>>() : c.ids;
    c.decoded = j.contains("decoded") ? j["decoded"].get<std::string>() : c.text;
    c.decoded_skip = j.contains("decoded_skip") ? j["decoded_skip"].get<std::string>() : c.decoded;
    cases.push_back(std::move(c));
  }
  return cases;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string nfc(const std::string& s) {
  utf8proc_uint8_t* out = nullptr;
  utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), s.size(), &out,
                                    static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  std::string r(reinterpret_cast<char*>(out), n < 0 ? 0 : n);
  std::free(out);
  return r;
}

// Checks every case: ids with and without special tokens, decode with and without skipping.
// Returns the number of cases whose ids match exactly.
size_t check_cases(const titan::Tokenizer& tok, const std::vector<Case>& cases, const std::string& name) {
  size_t ok = 0, reported = 0;
  for (const Case& c : cases) {
    auto ids = tok.encode(c.text);
    bool good = ids == c.ids && tok.encode(c.text, true) == c.ids_special && tok.decode(c.ids) == c.decoded &&
                tok.decode(c.ids, true) == c.decoded_skip;
    ok += good;
    if (!good && reported++ < 5) {
      ADD_FAILURE() << name << ": mismatch for " << json(c.text).dump() << "\n ids ok: " << (ids == c.ids)
                    << " special ok: " << (tok.encode(c.text, true) == c.ids_special)
                    << " decode: " << json(tok.decode(c.ids)).dump() << " want " << json(c.decoded).dump();
    }
  }
  return ok;
}

struct CliRun {
  int rc;
  std::string out, err;
};

// Runs the titan binary with args, stdin from input; captures stdout and stderr.
CliRun run_titan(const std::string& args, const std::string& input) {
  fs::path dir = fs::temp_directory_path() / ("titan_tok_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "in") << input;
  std::string cmd = std::string("\"") + TITAN_BINARY + "\" " + args + " < \"" + (dir / "in").string() +
                    "\" > \"" + (dir / "out").string() + "\" 2> \"" + (dir / "err").string() + "\"";
  int status = std::system(cmd.c_str());
  CliRun r{WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp((dir / "out").string()),
           slurp((dir / "err").string())};
  fs::remove_all(dir);
  return r;
}

std::string write_temp(const std::string& name, const std::string& text) {
  fs::path p = fs::temp_directory_path() / (std::to_string(::getpid()) + "_" + name);
  std::ofstream(p, std::ios::binary) << text;
  return p.string();
}

std::string expect_load_error(const std::string& path) {
  try {
    titan::Tokenizer::load(path);
  } catch (const titan::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "loading " << path << " did not throw";
  return "";
}

}  // namespace

TEST(Tokenizer, Qwen3MatchesHF) {
  if (!fs::exists(kQwen + "/tokenizer.json"))
    GTEST_SKIP() << "the Qwen3 tokenizer is not at " << kQwen << " (../shared beside the repo is absent)";
  auto tok = titan::Tokenizer::load(kQwen);
  auto cases = read_cases(kGolden + "/qwen3_cases.jsonl");
  ASSERT_GE(cases.size(), 5000u);
  EXPECT_EQ(check_cases(tok, cases, "qwen3"), cases.size());
  // decode(encode(s)) == NFC(s) for text without added tokens.
  for (const Case& c : cases)
    if (c.text.find('<') == std::string::npos) {
      ASSERT_EQ(tok.decode(tok.encode(c.text)), nfc(c.text)) << c.text;
    }
}

TEST(Tokenizer, Qwen3Vocab) {
  if (!fs::exists(kQwen + "/tokenizer.json")) GTEST_SKIP() << "the Qwen3 tokenizer is not at " << kQwen;
  auto tok = titan::Tokenizer::load(kQwen + "/tokenizer.json");
  EXPECT_EQ(tok.vocab_size(), 151669);
  EXPECT_EQ(tok.eos_id(), 151643);
  EXPECT_EQ(tok.token_to_id("<|im_end|>"), 151645);
  EXPECT_EQ(tok.token_to_id("</think>"), 151668);
  EXPECT_EQ(tok.token_to_id("Hello"), 9707);
  EXPECT_EQ(tok.token_to_id("no such token"), std::nullopt);
  std::vector<int32_t> ids = {151644, 872, 198, 6023, 151645, 151667, 151668};
  EXPECT_EQ(tok.decode(ids, true), "user\nhi<think></think>");  // <think> is not special
}

TEST(Tokenizer, SmallTrainedMatchesHF) {
  auto tok = titan::Tokenizer::load(kGolden + "/small");
  auto cases = read_cases(kGolden + "/small/cases.jsonl");
  ASSERT_GE(cases.size(), 500u);
  EXPECT_EQ(check_cases(tok, cases, "small"), cases.size());
  EXPECT_EQ(tok.vocab_size(), 600);  // 597 learned tokens + 3 special tokens
  EXPECT_EQ(tok.eos_id(), 597);
}

TEST(Tokenizer, VariantsMatchHF) {
  int n = 0;
  for (const auto& entry : fs::directory_iterator(kGolden + "/variants")) {
    if (entry.path().extension() != ".json") continue;
    std::string name = entry.path().stem().string();
    auto tok = titan::Tokenizer::load(entry.path().string());
    auto cases = read_cases((entry.path().parent_path() / (name + ".jsonl")).string());
    EXPECT_EQ(check_cases(tok, cases, name), cases.size()) << name;
    ++n;
  }
  EXPECT_GE(n, 6);
}

TEST(Tokenizer, LoadsEscapedJson) {
  // The same tokenizer written with \uXXXX escapes (surrogate pairs included) and indentation.
  json j = json::parse(slurp(kGolden + "/small/tokenizer.json"));
  auto path = write_temp("escaped.json", j.dump(2, ' ', true));
  auto escaped = titan::Tokenizer::load(path);
  auto cases = read_cases(kGolden + "/small/cases.jsonl");
  EXPECT_EQ(check_cases(escaped, cases, "escaped"), cases.size());
  fs::remove(path);
  for (const char* bad : {"{\"model\": {}} x", "{\"a\": \"\\ud800\"}", "{\"a\": [1, 2,]}", "{\"a\": tru}",
                          "{\"a\": \"\x01\"}", "{\"a\": \"\xff\"}", "[]"}) {
    std::string e = expect_load_error(write_temp("bad.json", bad));
    EXPECT_NE(e.find("not valid JSON"), std::string::npos) << bad << " -> " << e;
  }
}

TEST(Tokenizer, TrainerReproducesCommittedFile) {
  std::string got =
      titan::train_bpe({kGolden + "/small/train.txt"}, 600, {"<|endoftext|>", "<|im_start|>", "<|im_end|>"});
  json a = json::parse(got), b = json::parse(slurp(kGolden + "/small/tokenizer.json"));
  EXPECT_EQ(a["model"]["vocab"], b["model"]["vocab"]);
  EXPECT_EQ(a["model"]["merges"], b["model"]["merges"]);
  EXPECT_EQ(a["added_tokens"], b["added_tokens"]);
  EXPECT_EQ(a, b);
}

TEST(Tokenizer, TrainerStreamingAndDefaults) {
  titan::BpeTrainer trainer;  // default special token <|endoftext|>
  for (int i = 0; i < 50; ++i)
    trainer.add_text("the cat sat on the mat<|endoftext|>the dog sat on the log\n");
  json j = json::parse(trainer.train(300));
  EXPECT_EQ(j["added_tokens"].size(), 1u);
  EXPECT_EQ(j["added_tokens"][0]["content"], "<|endoftext|>");
  EXPECT_LE(j["model"]["vocab"].size() + 1, 300u);
  auto path = write_temp("streamed.json", j.dump());
  auto tok = titan::Tokenizer::load(path);
  auto ids = tok.encode("the cat sat<|endoftext|>");
  EXPECT_EQ(tok.decode(ids), "the cat sat<|endoftext|>");
  EXPECT_EQ(ids.back(), *tok.eos_id());
  EXPECT_LT(ids.size(), 6u);  // " cat" and " sat" were learned
  EXPECT_THROW(titan::train_bpe({"/nonexistent/file.txt"}, 300), titan::Error);
  EXPECT_THROW(trainer.train(100), titan::Error);
  fs::remove(path);
}

TEST(Tokenizer, InvalidUtf8BecomesReplacementChar) {
  auto tok = titan::Tokenizer::load(kGolden + "/small/tokenizer.json");
  EXPECT_EQ(tok.encode("a\xff"
                       "b"),
            tok.encode("a\xEF\xBF\xBD"
                       "b"));
  EXPECT_EQ(tok.encode("x\xE2\x82"), tok.encode("x\xEF\xBF\xBD"));  // truncated sequence: one U+FFFD
  EXPECT_EQ(tok.encode("\xC0\xAF"), tok.encode("\xEF\xBF\xBD\xEF\xBF\xBD"));  // overlong: one per byte
  EXPECT_EQ(tok.encode("\xED\xA0\x80"), tok.encode("\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"));  // surrogate
  EXPECT_EQ(tok.decode(tok.encode("a\xff")), "a\xEF\xBF\xBD");
  // Ids that decode to broken UTF-8 come back with U+FFFD; unknown ids are dropped.
  auto ids = tok.encode("\xE7\x81\xAF");
  ASSERT_GE(ids.size(), 2u);
  EXPECT_EQ(tok.decode(std::vector<int32_t>{ids[0], 999999, -5}), "\xEF\xBF\xBD");
}

TEST(Tokenizer, ParallelEncodeIsConsistent) {
  auto tok = titan::Tokenizer::load(kGolden + "/small");
  auto cases = read_cases(kGolden + "/small/cases.jsonl");
  std::vector<int> bad(cases.size(), 0);
#pragma omp parallel for num_threads(4) schedule(dynamic)
  for (int i = 0; i < static_cast<int>(cases.size()); ++i) bad[i] = tok.encode(cases[i].text) != cases[i].ids;
  int total = 0;
  for (int b : bad) total += b;
  EXPECT_EQ(total, 0);
}

TEST(Tokenizer, AlternatingTokenizersOnOneThread) {
  // Each thread caches words for one model at a time; switching must never serve stale ids.
  auto a = titan::Tokenizer::load(kGolden + "/small");
  auto b = titan::Tokenizer::load(kGolden + "/variants/gpt2.json");
  auto ca = read_cases(kGolden + "/small/cases.jsonl");
  auto cb = read_cases(kGolden + "/variants/gpt2.jsonl");
  for (size_t i = 0; i < 200; ++i) {
    ASSERT_EQ(a.encode(ca[i % ca.size()].text), ca[i % ca.size()].ids);
    ASSERT_EQ(b.encode(cb[i % cb.size()].text), cb[i % cb.size()].ids);
  }
}

TEST(Tokenizer, BadFilesGiveClearErrors) {
  std::string small = slurp(kGolden + "/small/tokenizer.json");
  EXPECT_NE(expect_load_error("/nonexistent/tok.json").find("/nonexistent/tok.json"), std::string::npos);
  auto p = write_temp("malformed.json", "{\"model\": {\"type\": \"BPE\", ");
  EXPECT_NE(expect_load_error(p).find("not valid JSON"), std::string::npos);
  auto with = [&](const char* field, json value) {
    json j = json::parse(small);
    j[field] = value;
    return write_temp(std::string(field) + ".json", j.dump());
  };
  std::string e = expect_load_error(with("normalizer", {{"type", "BertNormalizer"}}));
  EXPECT_NE(e.find("BertNormalizer"), std::string::npos) << e;
  EXPECT_NE(e.find("normalizer"), std::string::npos) << e;
  e = expect_load_error(with("pre_tokenizer", {{"type", "Metaspace"}}));
  EXPECT_NE(e.find("unsupported pre-tokenizer type 'Metaspace'"), std::string::npos) << e;
  e = expect_load_error(with("decoder", {{"type", "WordPiece"}}));
  EXPECT_NE(e.find("WordPiece"), std::string::npos) << e;
  e = expect_load_error(with("post_processor", {{"type", "Weird"}}));
  EXPECT_NE(e.find("Weird"), std::string::npos) << e;
  json j = json::parse(small);
  j["model"]["type"] = "WordPiece";
  e = expect_load_error(write_temp("wp.json", j.dump()));
  EXPECT_NE(e.find("model.type"), std::string::npos) << e;
  EXPECT_NE(e.find("wp.json"), std::string::npos) << e;
  j = json::parse(small);
  j["model"]["merges"][3] = "no_such_token x";
  e = expect_load_error(write_temp("merge.json", j.dump()));
  EXPECT_NE(e.find("model.merges[3]"), std::string::npos) << e;
  j = json::parse(small);
  j["model"]["vocab"] = json::array();
  e = expect_load_error(write_temp("vocab.json", j.dump()));
  EXPECT_NE(e.find("model.vocab"), std::string::npos) << e;
  j = json::parse(small);
  j["added_tokens"][0]["id"] = "x";
  e = expect_load_error(write_temp("added.json", j.dump()));
  EXPECT_NE(e.find("added_tokens[0].id"), std::string::npos) << e;
  j = json::parse(small);
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  e = expect_load_error(write_temp("regex.json", j.dump()));
  EXPECT_NE(e.find("cannot compile regex"), std::string::npos) << e;
}

TEST(TokenizerCli, EncodeDecodeRoundTrip) {
  std::string path = kGolden + "/small";
  auto cases = read_cases(kGolden + "/small/cases.jsonl");
  std::string input, want;
  for (size_t i = 0; i < 200; ++i) {
    input += json(cases[i].text).dump() + "\n";
    want += json(cases[i].ids).dump() + "\n";
  }
  CliRun enc = run_titan("tokenizer encode --tokenizer " + path, input);
  ASSERT_EQ(enc.rc, 0) << enc.err;
  EXPECT_EQ(enc.out, want);
  CliRun dec = run_titan("tokenizer decode --tokenizer " + path + "/tokenizer.json", enc.out);
  ASSERT_EQ(dec.rc, 0) << dec.err;
  std::istringstream lines(dec.out);
  std::string line;
  for (size_t i = 0; i < 200; ++i) {
    ASSERT_TRUE(std::getline(lines, line));
    EXPECT_EQ(json::parse(line).get<std::string>(), cases[i].decoded);
  }
  CliRun skip = run_titan("tokenizer decode --skip-special-tokens --tokenizer " + path, "[597, 72, 599]\n");
  CliRun keep = run_titan("tokenizer decode --tokenizer " + path, "[597, 72, 599]\n");
  ASSERT_EQ(skip.rc, 0) << skip.err;
  auto tok = titan::Tokenizer::load(path);
  std::vector<int32_t> one = {72};
  EXPECT_EQ(json::parse(skip.out).get<std::string>(), tok.decode(one));
  EXPECT_EQ(json::parse(keep.out).get<std::string>(), "<|endoftext|>" + tok.decode(one) + "<|im_end|>");
}

TEST(TokenizerCli, InvalidUtf8InInputIsReplaced) {
  std::string path = kGolden + "/small";
  auto tok = titan::Tokenizer::load(path);
  CliRun r = run_titan("tokenizer encode --tokenizer " + path, "\"a\xff\xfe b\"\n");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(json::parse(r.out).get<std::vector<int32_t>>(), tok.encode("a\xEF\xBF\xBD\xEF\xBF\xBD b"));
}

TEST(TokenizerCli, AddSpecialTokens) {
  std::string path = kGolden + "/variants/llama3_style.json";
  auto tok = titan::Tokenizer::load(path);
  CliRun r = run_titan("tokenizer encode --add-special-tokens --tokenizer " + path, "\"hello there\"\n");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(json::parse(r.out).get<std::vector<int32_t>>(), tok.encode("hello there", true));
  EXPECT_EQ(json::parse(r.out)[0], 597);
}

TEST(TokenizerCli, ErrorsExitNonZero) {
  CliRun r = run_titan("tokenizer encode --tokenizer /nonexistent/dir", "\"x\"\n");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("/nonexistent/dir"), std::string::npos) << r.err;
  r = run_titan("tokenizer encode --tokenizer " + kGolden + "/small", "not json\n");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("line 1"), std::string::npos) << r.err;
  r = run_titan("tokenizer decode --tokenizer " + kGolden + "/small", "\"a string\"\n");
  EXPECT_NE(r.rc, 0);
  r = run_titan("tokenizer train --input /nonexistent.txt --vocab-size 300 --output /tmp/never.json", "");
  EXPECT_NE(r.rc, 0);
  EXPECT_FALSE(fs::exists("/tmp/never.json"));
  r = run_titan("tokenizer encode", "");
  EXPECT_NE(r.rc, 0);
}

TEST(TokenizerCli, TrainWritesLoadableFile) {
  std::string out = write_temp("cli_trained.json", "");
  CliRun r = run_titan("tokenizer train --input " + kGolden +
                           "/small/train.txt --vocab-size 600 --special-tokens "
                           "'<|endoftext|>' '<|im_start|>' '<|im_end|>' --output " +
                           out,
                       "");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(json::parse(slurp(out)), json::parse(slurp(kGolden + "/small/tokenizer.json")));
  fs::remove(out);
}
