// `titan tokenizer encode|decode|train`: JSON Lines in, JSON Lines out.
//   encode: one JSON string per line -> one JSON array of ids per line
//   decode: one JSON array of ids per line -> one JSON string per line
//   train:  byte-level BPE on text files -> tokenizer.json
//   bench:  load time and encode throughput (single thread, all OpenMP threads) on a JSONL corpus
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/cli_errors.h"
#include "cli/command.h"
#include "core/error.h"
#include "io/json_file.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/trainer.h"
#include "tokenizer/unicode.h"

namespace {

using nlohmann::json;

// Writes a JSON string, replacing invalid UTF-8 instead of throwing.
std::string dump_string(const std::string& s) {
  return json(s).dump(-1, ' ', false, json::error_handler_t::replace);
}

int run_encode(const std::string& path, bool add_special) {
  titan::Tokenizer tok = titan::Tokenizer::load(path);
  std::string line, out;
  size_t lineno = 0;
  while (std::getline(std::cin, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    // Raw invalid UTF-8 inside a JSON string becomes U+FFFD, as the library does for its input.
    if (!titan::tok::is_valid_utf8(line)) line = titan::tok::repair_utf8(line);
    const json j = titan::parse_json(line, titan::str_cat("stdin line ", lineno));
    TITAN_CHECK(j.is_string(), "stdin line ", lineno, ": expected a JSON string");
    std::vector<int32_t> ids = tok.encode(j.get_ref<const std::string&>(), add_special);
    out.clear();
    out += '[';
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) out += ',';
      out += std::to_string(ids[i]);
    }
    out += "]\n";
    std::fwrite(out.data(), 1, out.size(), stdout);
  }
  return std::fflush(stdout) == 0 ? 0 : 1;
}

int run_decode(const std::string& path, bool skip_special) {
  titan::Tokenizer tok = titan::Tokenizer::load(path);
  std::string line;
  size_t lineno = 0;
  while (std::getline(std::cin, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    const json j = titan::parse_json(line, titan::str_cat("stdin line ", lineno));
    TITAN_CHECK(j.is_array(), "stdin line ", lineno, ": expected a JSON array of ids");
    std::vector<int32_t> ids;
    ids.reserve(j.size());
    for (const json& v : j) {
      TITAN_CHECK(v.is_number_integer(), "stdin line ", lineno, ": ids must be integers");
      ids.push_back(v.get<int32_t>());
    }
    std::string s = dump_string(tok.decode(ids, skip_special)) + "\n";
    std::fwrite(s.data(), 1, s.size(), stdout);
  }
  return std::fflush(stdout) == 0 ? 0 : 1;
}

int run_train(const std::vector<std::string>& inputs, int vocab_size,
              const std::vector<std::string>& specials, const std::string& output) {
  std::string text = titan::train_bpe(inputs, vocab_size, specials);
  // Write to a temporary name and rename, so a failure never leaves a partial file.
  std::string tmp = output + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    TITAN_CHECK(out.good(), "cannot write '", tmp, "'");
    out << text;
    TITAN_CHECK(out.good(), "cannot write '", tmp, "'");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, output, ec);
  TITAN_CHECK(!ec, "cannot rename '", tmp, "' to '", output, "': ", ec.message());
  std::fprintf(stderr, "wrote %s\n", output.c_str());
  return 0;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Prints one JSON object: median load seconds and median encode MB/s, single- and multi-threaded.
int run_bench(const std::string& path, const std::string& input, int runs) {
  std::vector<std::string> docs;
  {
    std::ifstream in(input);
    TITAN_CHECK(in.good(), "cannot open '", input, "'");
    std::string line;
    while (std::getline(in, line))
      if (!line.empty()) docs.push_back(json::parse(line).get<std::string>());
  }
  size_t bytes = 0;
  for (const auto& d : docs) bytes += d.size();
  std::vector<double> load_s, single_s, parallel_s;
  std::vector<std::vector<int32_t>> first(docs.size()), again(docs.size());
  size_t tokens = 0;
  for (int r = 0; r < runs; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    titan::Tokenizer tok = titan::Tokenizer::load(path);
    load_s.push_back(seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < docs.size(); ++i) first[i] = tok.encode(docs[i]);
    single_s.push_back(seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(dynamic, 4)
    for (long i = 0; i < static_cast<long>(docs.size()); ++i) again[i] = tok.encode(docs[i]);
    parallel_s.push_back(seconds_since(t0));
    TITAN_CHECK(first == again, "bench: parallel encode differs from single-threaded encode");
  }
  for (const auto& ids : first) tokens += ids.size();
  json out{{"docs", docs.size()},
           {"bytes", bytes},
           {"tokens", tokens},
           {"threads", omp_get_max_threads()},
           {"runs", runs},
           {"load_s", median(load_s)},
           {"single_mb_s", bytes / 1e6 / median(single_s)},
           {"parallel_mb_s", bytes / 1e6 / median(parallel_s)}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

int tokenizer_main(int argc, char** argv) {
  CLI::App app{"HF tokenizer.json compatible byte-level BPE: encode, decode, train", "titan tokenizer"};
  app.require_subcommand(1);
  std::string path;
  bool add_special = false, skip_special = false;
  auto* enc = app.add_subcommand("encode", "JSON string per line on stdin -> JSON array of ids per line");
  enc->add_option("--tokenizer", path, "tokenizer.json or a directory holding one")->required();
  enc->add_flag("--add-special-tokens", add_special, "apply the post-processor's special tokens");
  auto* dec = app.add_subcommand("decode", "JSON array of ids per line on stdin -> JSON string per line");
  dec->add_option("--tokenizer", path, "tokenizer.json or a directory holding one")->required();
  dec->add_flag("--skip-special-tokens", skip_special, "drop special added tokens");
  std::vector<std::string> inputs, specials;
  int vocab_size = 0;
  std::string output;
  auto* tr = app.add_subcommand("train", "train a byte-level BPE tokenizer on text files");
  tr->add_option("--input", inputs, "text files (each file is one document)")->required();
  tr->add_option("--vocab-size", vocab_size, "total vocab size, special tokens included")->required();
  tr->add_option("--special-tokens", specials, "special tokens (default: <|endoftext|>)");
  tr->add_option("--output", output, "tokenizer.json to write")->required();
  std::string bench_input;
  int runs = 5;
  auto* bench =
      app.add_subcommand("bench", "load time and encode MB/s on a JSONL corpus (one JSON string per line)");
  bench->add_option("--tokenizer", path, "tokenizer.json or a directory holding one")->required();
  bench->add_option("--input", bench_input, "JSONL corpus")->required();
  bench->add_option("--runs", runs, "repetitions (the median is reported)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return titan::cli::exit_on_parse_error(app, e);
  }
  std::ios::sync_with_stdio(false);
  if (*enc) return run_encode(path, add_special);
  if (*dec) return run_decode(path, skip_special);
  if (*bench) return run_bench(path, bench_input, std::max(1, runs));
  return run_train(inputs, vocab_size, specials, output);
}

}  // namespace

TITAN_COMMAND("tokenizer", "encode/decode JSON Lines with an HF tokenizer.json; train a byte-level BPE",
              tokenizer_main);
