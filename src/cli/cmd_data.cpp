// titan data prepare | info | show: pre-tokenize corpora into token shards, describe a dataset, print its
// first rows as the trainer sees them.
#include <unistd.h>

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
#include "tokenizer/tokenizer.h"

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

struct ShowOptions {
  std::string format = "auto", delimiter = "file", color = "auto";
  int64_t rows = 3;
  int64_t limit = 0;  // rows counted (0: the whole first epoch)
  bool ids = false;
};

// `titan data show`: the first rows exactly as the trainer's loader builds them, the trained tokens
// marked, then counts over the data (the first epoch, or --limit rows).
int run_show(DataConfig cfg, const ShowOptions& o) {
  cfg.format = parse_data_format(o.format);
  cfg.delimiter = parse_doc_delimiter(o.delimiter);
  TITAN_CHECK(o.color == "auto" || o.color == "always" || o.color == "never",
              "--color must be auto, always or never, got '", o.color, "'");
  TITAN_CHECK(!cfg.tokenizer.empty() && cfg.tokenizer != kByteEncoderName,
              "titan data show needs --tokenizer (a tokenizer.json or its directory) to print the text");
  cfg.batch_size = 1;
  cfg.dp_rank = 0;
  cfg.dp_world = 1;
  cfg.max_epochs = 1;
  const bool chat = cfg.format == DataFormat::Chat;
  const bool color = o.color == "always" || (o.color == "auto" && isatty(STDOUT_FILENO));
  // Trained text: green on a terminal, [[...]] otherwise.
  const std::string open = color ? "\033[32m" : "[[", close = color ? "\033[0m" : "]]";
  cfg.on_warning = [](const std::string& w) { std::fprintf(stderr, "warning: %s\n", w.c_str()); };
  const titan::Tokenizer tok = titan::Tokenizer::load(cfg.tokenizer);
  DataLoader loader(cfg);
  Batch batch;
  const int64_t L = cfg.seq_len;
  int64_t row = 0;
  while ((o.limit <= 0 || row < o.limit) && loader.next_batch(batch)) {
    ++row;
    if (row > o.rows) continue;
    // Token t (t >= 1) is trained when the label of position t - 1 (its prediction) is not -100.
    int64_t real = L, trained = 0;
    if (chat) {
      while (real > 1 && batch.labels[real - 1] == -100 && batch.input_ids[real - 1] == loader.eos_id())
        --real;
    }
    for (int64_t t = 0; t < L; ++t) trained += batch.labels[t] != -100;
    std::printf("--- row %lld: %lld tokens%s, %lld trained%s\n", (long long)row, (long long)real,
                real < L ? titan::str_cat(" + ", L - real, " padding").c_str() : "", (long long)trained,
                chat ? "" : " (every next token)");
    std::string text;
    std::vector<int32_t> run;
    bool run_trained = false;
    auto flush = [&] {
      if (run.empty()) return;
      const std::string s = tok.decode(run);
      text += run_trained && chat ? open + s + close : s;
      run.clear();
    };
    for (int64_t t = 0; t < real; ++t) {
      const bool tr = t >= 1 && batch.labels[t - 1] != -100;
      if (tr != run_trained) flush();
      run_trained = tr;
      run.push_back(batch.input_ids[t]);
    }
    flush();
    std::printf("%s\n", text.c_str());
    if (o.ids) {
      std::printf("ids:");
      for (int64_t t = 0; t < real; ++t) {
        const bool tr = chat && t >= 1 && batch.labels[t - 1] != -100;
        std::printf(tr ? " [%d]" : " %d", batch.input_ids[t]);
      }
      std::printf("\n");
    }
  }
  const LoaderStats s = loader.stats();
  const double positions = static_cast<double>(s.rows) * static_cast<double>(L);
  std::printf(
      "--- %s%s: %llu %s, %llu row(s) of %lld, %llu tokens, %llu trained (%.1f%% of the rows' positions)",
      o.limit > 0 && row >= o.limit ? "first " : "",
      o.limit > 0 && row >= o.limit ? titan::str_cat(row, " rows").c_str() : "whole epoch",
      (unsigned long long)s.documents, chat ? "conversations" : "documents", (unsigned long long)s.rows,
      (long long)L, (unsigned long long)s.tokens, (unsigned long long)s.trained,
      positions > 0 ? 100.0 * s.trained / positions : 0.0);
  if (chat)
    std::printf(", %llu truncated, %llu skipped, padding %.1f%%", (unsigned long long)s.truncated,
                (unsigned long long)s.skipped, positions > 0 ? 100.0 * s.padding / positions : 0.0);
  std::printf("\n");
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

  DataConfig show_cfg;
  show_cfg.shuffle = false;
  show_cfg.val_fraction = 0;
  ShowOptions show_opts;
  auto* show = app.add_subcommand(
      "show", "The first rows as the trainer sees them (trained tokens marked), and counts of the data");
  show->add_option("sources", show_cfg.sources, "files or directories (text, JSON Lines or chat)")
      ->required();
  show->add_option("--tokenizer", show_cfg.tokenizer, "tokenizer.json or its directory")->required();
  show->add_option("--chat-template", show_cfg.chat_template,
                   "chat: tokenizer_config.json with the template (default: beside the tokenizer)");
  show->add_option("--format", show_opts.format, "auto | text | jsonl | chat")->capture_default_str();
  show->add_option("--delimiter", show_opts.delimiter, "text: file | percent | blank")->capture_default_str();
  show->add_option("--text-field", show_cfg.text_field)->capture_default_str();
  show->add_option("--seq-len", show_cfg.seq_len, "training.seq_len")->capture_default_str();
  show->add_flag("--packing", show_cfg.packing, "chat: pack whole conversations per row (training.packing)");
  show->add_option("--rows", show_opts.rows, "rows to print")->capture_default_str();
  show->add_option("--limit", show_opts.limit, "count only this many rows (default: the whole epoch)");
  show->add_flag("--ids", show_opts.ids, "also print each row's token ids (trained ones in brackets)");
  show->add_option("--color", show_opts.color, "auto | always | never: trained text in green, else [[...]]")
      ->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return titan::cli::exit_on_parse_error(app, e);
  }
  if (*prepare) return run_prepare(prep_tokenizer, prep, prep_format, prep_delimiter, prep_eos);
  if (*show) return run_show(show_cfg, show_opts);
  return run_info(info_cfg, info_format, info_delimiter, !info_no_count, info_batches);
}

}  // namespace

TITAN_COMMAND("data", "datasets: prepare token shards, inspect a dataset, show rows as trained", cmd_data);
