// titan data prepare | info: pre-tokenize corpora into token shards, and describe a dataset.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "cli/cli_errors.h"
#include "cli/command.h"
#include "core/error.h"
#include "data/encoder.h"
#include "data/loader.h"
#include "data/prepare.h"
#include "data/sources.h"
#include "data/token_shard.h"

namespace {

using namespace titan::data;

int run_prepare(const std::string& tokenizer, PrepareOptions& options, const std::string& format,
                const std::string& delimiter, int eos_id) {
  options.format = parse_data_format(format);
  options.delimiter = parse_doc_delimiter(delimiter);
  if (eos_id >= 0) options.eos_id = eos_id;
  const TextEncoder encoder = make_text_encoder(tokenizer);
  const PrepareStats s = prepare_token_dataset(options, encoder);
  std::printf("wrote %s: %llu documents, %llu tokens in %llu shard(s) from %llu file(s) (%.1f MB) in %.1f s",
              options.output.c_str(), static_cast<unsigned long long>(s.docs),
              static_cast<unsigned long long>(s.tokens), static_cast<unsigned long long>(s.shards),
              static_cast<unsigned long long>(s.files), s.bytes / 1e6, s.seconds);
  if (s.seconds > 0) std::printf(" (%.2f MB/s)", s.bytes / 1e6 / s.seconds);
  std::printf("\n");
  if (s.empty_files)
    std::printf("skipped %llu empty file(s)\n", static_cast<unsigned long long>(s.empty_files));
  if (s.invalid_utf8)
    std::printf("replaced %llu invalid UTF-8 sequence(s)\n", static_cast<unsigned long long>(s.invalid_utf8));
  return 0;
}

// Anonymous resident memory (heap, not the page cache behind memory-mapped shards), in MB.
double anon_rss_mb() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("RssAnon:", 0) == 0) return std::stod(line.substr(8)) / 1024.0;
  return 0;
}

// Describes a dataset; with count, reads both splits once (text: tokenizing); with batches, times
// the loader over that many batches and prints the first ids of the first few.
int run_info(DataConfig cfg, const std::string& format, const std::string& delimiter, bool count,
             int64_t batches) {
  cfg.format = parse_data_format(format);
  cfg.delimiter = parse_doc_delimiter(delimiter);
  const ResolvedSources resolved = resolve_sources(cfg.sources, cfg.format);
  if (resolved.tokens) {
    for (const auto& dir : resolved.token_dirs) {
      const TokenIndex index = read_token_index(dir);
      std::printf("%s: %zu shard(s), %llu documents, %llu tokens, vocab %u, eos %d\n", dir.c_str(),
                  index.shards.size(), static_cast<unsigned long long>(index.num_docs()),
                  static_cast<unsigned long long>(index.num_tokens()), index.vocab_size, index.eos_id);
    }
  } else {
    uint64_t bytes = 0;
    for (const auto& f : resolved.files) bytes += f.size_bytes;
    std::printf("%zu file(s), %.1f MB\n", resolved.files.size(), bytes / 1e6);
  }
  const TextEncoder encoder = resolved.tokens ? TextEncoder{} : make_text_encoder(cfg.tokenizer);
  for (const Split split : {Split::Train, Split::Validation}) {
    if (!count || (split == Split::Validation && cfg.val_fraction <= 0)) break;
    DataConfig c = cfg;
    c.split = split;
    c.shuffle = false;
    auto source = open_document_source(c, encoder);
    uint64_t docs = 0, tokens = 0;
    std::span<const int32_t> ids;
    bool ends = true;
    while (source->next(ids, ends)) {
      tokens += ids.size() + (ends ? 1 : 0);
      docs += ends ? 1 : 0;
    }
    std::printf("%s: %llu documents, %llu tokens with EOS, %llu windows of %lld+1 tokens\n",
                split == Split::Train ? "train" : "validation", static_cast<unsigned long long>(docs),
                static_cast<unsigned long long>(tokens),
                static_cast<unsigned long long>(tokens / static_cast<uint64_t>(cfg.seq_len + 1)),
                static_cast<long long>(cfg.seq_len));
  }
  if (batches > 0) {
    const auto t0 = std::chrono::steady_clock::now();
    DataLoader loader(cfg, encoder);
    Batch batch;
    int64_t done = 0;
    for (; done < batches && loader.next_batch(batch); ++done) {
      if (done >= 3) continue;
      std::printf("batch %llu (epoch %llu):", static_cast<unsigned long long>(batch.step),
                  static_cast<unsigned long long>(batch.epoch));
      for (size_t t = 0; t < batch.input_ids.size() && t < 16; ++t) std::printf(" %d", batch.input_ids[t]);
      std::printf("%s\n", batch.input_ids.size() > 16 ? " ..." : "");
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%lld batch(es) of %lld x %lld in %.3f s: %.3g tokens/s on rank %d of %d, epoch %llu\n",
                static_cast<long long>(done), static_cast<long long>(cfg.batch_size),
                static_cast<long long>(cfg.seq_len), s, done * cfg.batch_size * cfg.seq_len / s, cfg.dp_rank,
                cfg.dp_world, static_cast<unsigned long long>(loader.epoch()));
    std::printf("anonymous resident memory: %.1f MB\n", anon_rss_mb());
  }
  return 0;
}

int cmd_data(int argc, char** argv) {
  CLI::App app{"Datasets: pre-tokenize corpora into token shards; describe a dataset", "titan data"};
  app.require_subcommand(1);

  PrepareOptions prep;
  std::string prep_tokenizer, prep_format = "auto", prep_delimiter = "file";
  int prep_eos = -1;
  auto* prepare =
      app.add_subcommand("prepare", "Tokenize text / JSON Lines files into a token dataset directory");
  prepare->add_option("--tokenizer", prep_tokenizer, "tokenizer.json (or its directory), or builtin:bytes")
      ->required();
  prepare->add_option("--input", prep.inputs, "input files or directories (repeatable)")->required();
  prepare->add_option("--output", prep.output, "dataset directory to create")->required();
  prepare->add_option("--format", prep_format, "auto | text | jsonl")->capture_default_str();
  prepare->add_option("--delimiter", prep_delimiter, "text documents: file | percent | blank")
      ->capture_default_str();
  prepare->add_option("--text-field", prep.text_field, "JSON Lines field holding the text")
      ->capture_default_str();
  prepare->add_option("--eos-id", prep_eos, "end-of-text id (default: the tokenizer's)");
  prepare->add_option("--shard-tokens", prep.shard_tokens, "tokens per shard")->capture_default_str();
  prep.threads = 0;
  prepare->add_option("--threads", prep.threads, "tokenizer threads (0: all cores)")->capture_default_str();
  prepare->add_flag("--overwrite", prep.overwrite, "replace an existing output directory");

  DataConfig info_cfg;
  std::string info_format = "auto", info_delimiter = "file";
  int64_t info_batches = 0;
  bool info_no_count = false;
  info_cfg.shuffle = false;
  auto* info = app.add_subcommand("info", "Count documents, tokens and windows of a dataset and its splits");
  info->add_option("sources", info_cfg.sources, "files, directories or token datasets")->required();
  info->add_option("--tokenizer", info_cfg.tokenizer, "for text sources: tokenizer.json or builtin:bytes");
  info->add_option("--format", info_format, "auto | text | jsonl | tokens")->capture_default_str();
  info->add_option("--delimiter", info_delimiter, "file | percent | blank")->capture_default_str();
  info->add_option("--text-field", info_cfg.text_field)->capture_default_str();
  info->add_option("--seq-len", info_cfg.seq_len)->capture_default_str();
  info->add_option("--batch-size", info_cfg.batch_size)->capture_default_str();
  info->add_option("--val-fraction", info_cfg.val_fraction)->capture_default_str();
  info->add_option("--seed", info_cfg.seed)->capture_default_str();
  info->add_option("--dp-rank", info_cfg.dp_rank)->capture_default_str();
  info->add_option("--dp-world", info_cfg.dp_world)->capture_default_str();
  info->add_option("--shuffle", info_cfg.shuffle)->capture_default_str();
  info->add_flag("--no-count", info_no_count, "skip reading the whole dataset to count it");
  info->add_option("--batches", info_batches,
                   "time the loader over this many batches (ids of the first 3 shown)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return titan::cli::exit_on_parse_error(app, e);
  }
  if (*prepare) return run_prepare(prep_tokenizer, prep, prep_format, prep_delimiter, prep_eos);
  return run_info(info_cfg, info_format, info_delimiter, !info_no_count, info_batches);
}

}  // namespace

TITAN_COMMAND("data", "datasets: prepare token shards, inspect a dataset", cmd_data);
