#include "data/prepare.h"

#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "core/error.h"
#include "data/sources.h"
#include "data/text_reader.h"
#include "data/token_shard.h"

namespace titan::data {

namespace fs = std::filesystem;

namespace {

// Removes the temporary directory unless the dataset was committed.
struct TempDirGuard {
  fs::path path;
  bool committed = false;
  ~TempDirGuard() {
    if (committed) return;
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

class DatasetWriter {
 public:
  DatasetWriter(fs::path dir, uint32_t vocab_size, int32_t eos_id, uint64_t shard_tokens)
      : dir_(std::move(dir)), vocab_size_(vocab_size), eos_id_(eos_id), shard_tokens_(shard_tokens) {}

  void add_tokens(std::span<const int32_t> ids) {
    if (!writer_) open_shard();
    writer_->add_tokens(ids);
  }
  void end_document() {
    if (!writer_) open_shard();
    writer_->end_document();
    if (writer_->num_tokens() >= shard_tokens_) close_shard();
  }
  TokenIndex finish() {
    close_shard();
    TokenIndex index;
    index.vocab_size = vocab_size_;
    index.eos_id = eos_id_;
    index.shards = shards_;
    return index;
  }

 private:
  void open_shard() {
    char name[32];
    std::snprintf(name, sizeof name, "shard_%05zu.bin", shards_.size());
    current_name_ = name;
    writer_ = std::make_unique<ShardWriter>((dir_ / name).string(), vocab_size_, eos_id_);
  }
  void close_shard() {
    if (!writer_) return;
    writer_->finish();
    shards_.push_back({current_name_, writer_->num_tokens(), writer_->num_docs()});
    writer_.reset();
  }
  fs::path dir_;
  uint32_t vocab_size_;
  int32_t eos_id_;
  uint64_t shard_tokens_;
  std::unique_ptr<ShardWriter> writer_;
  std::string current_name_;
  std::vector<ShardInfo> shards_;
};

}  // namespace

PrepareStats prepare_token_dataset(const PrepareOptions& options, const TextEncoder& encoder) {
  const auto t0 = std::chrono::steady_clock::now();
  TITAN_CHECK(!options.output.empty(), "data prepare: no output directory given");
  TITAN_CHECK(options.format != DataFormat::Tokens, "data prepare: inputs must be text or jsonl, not tokens");
  TITAN_CHECK(options.format != DataFormat::Chat,
              "data prepare: chat data keeps per-token labels that token shards cannot hold; train on the "
              "JSON Lines directly (training.dataset_format = \"chat\")");
  TITAN_CHECK(options.shard_tokens > 0, "data prepare: shard_tokens must be > 0");
  TITAN_CHECK(static_cast<bool>(encoder.encode) && encoder.vocab_size > 0, "data prepare: no tokenizer");
  const int32_t eos_id = options.eos_id.value_or(encoder.eos_id);
  TITAN_CHECK(eos_id >= 0 && eos_id < encoder.vocab_size, "data prepare: tokenizer '", encoder.name,
              "' has no end-of-text token; pass --eos-id");

  const ResolvedSources sources = resolve_sources(options.inputs, options.format);
  TITAN_CHECK(!sources.tokens, "data prepare: input ", sources.token_dirs.front(),
              " is already a token dataset");

  const fs::path output = fs::path(options.output).lexically_normal();
  std::error_code ec;
  if (fs::exists(output, ec) && !options.overwrite)
    fail("data prepare: output ", output.string(), " already exists (pass --overwrite to replace it)");
  const fs::path parent = output.has_parent_path() ? output.parent_path() : fs::path(".");
  fs::create_directories(parent, ec);
  TempDirGuard temp{parent / str_cat(".", output.filename().string(), ".tmp-", ::getpid())};
  fs::remove_all(temp.path, ec);
  if (!fs::create_directory(temp.path, ec))
    fail("data prepare: cannot create ", temp.path.string(), ": ", ec.message());

  TextReaderOptions reader_options;
  reader_options.delimiter = options.delimiter;
  reader_options.text_field = options.text_field;
  reader_options.buffer_bytes = options.read_buffer_bytes;
  reader_options.max_piece_bytes = options.max_piece_bytes;

  PrepareStats stats;
  DatasetWriter writer(temp.path, static_cast<uint32_t>(encoder.vocab_size), eos_id, options.shard_tokens);
  // Pieces are tokenized in batches (in parallel when threads > 1) and written in input order.
  constexpr size_t kBatchBytes = 8 << 20, kBatchPieces = 4096;
  std::vector<TextPiece> pieces;
  std::vector<std::vector<int32_t>> ids;
  const int threads = options.threads > 0 ? options.threads : omp_get_max_threads();
  const auto flush = [&] {
    ids.resize(pieces.size());
    const int n = static_cast<int>(pieces.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && n > 1)
    for (int i = 0; i < n; ++i) encoder.encode(pieces[i].text, ids[i]);
    for (int i = 0; i < n; ++i) {
      writer.add_tokens(ids[i]);
      stats.tokens += ids[i].size();
      if (pieces[i].ends_document) {
        writer.end_document();
        ++stats.docs;
      }
    }
    pieces.clear();
  };

  constexpr size_t kMaxListedFiles = 10000;
  nlohmann::json files = nlohmann::json::array();
  for (const SourceFile& f : sources.files) {
    ++stats.files;
    stats.bytes += f.size_bytes;
    if (f.size_bytes == 0) {
      warn(options.on_warning, f.path + ": empty file, skipped");
      ++stats.empty_files;
      continue;
    }
    TextFileReader reader(f.path, f.format, reader_options);
    size_t batch_bytes = 0;
    uint64_t docs_before = stats.docs, pieces_in_file = 0;
    TextPiece piece;
    while (reader.next(piece)) {
      ++pieces_in_file;
      batch_bytes += piece.text.size();
      pieces.push_back(std::move(piece));
      if (batch_bytes >= kBatchBytes || pieces.size() >= kBatchPieces) {
        flush();
        batch_bytes = 0;
      }
    }
    flush();
    if (reader.invalid_utf8_replaced()) {
      warn(options.on_warning, str_cat(f.path, ": replaced ", reader.invalid_utf8_replaced(),
                                       " invalid UTF-8 sequence(s) with U+FFFD"));
      stats.invalid_utf8 += reader.invalid_utf8_replaced();
    }
    if (pieces_in_file == 0)
      warn(options.on_warning, f.path + ": no documents (only whitespace or delimiters), skipped");
    // Per-file counts help to audit a corpus; past a few thousand files they only bloat the index.
    if (files.size() < kMaxListedFiles)
      files.push_back({{"path", f.path}, {"docs", stats.docs - docs_before}});
  }
  TITAN_CHECK(stats.docs > 0, "data prepare: the inputs hold no documents (", options.inputs.front(),
              options.inputs.size() > 1 ? " ..." : "", ")");

  TokenIndex index = writer.finish();
  stats.shards = index.shards.size();
  index.metadata = {{"tokenizer", encoder.name},
                    {"format", to_string(options.format)},
                    {"delimiter", to_string(options.delimiter)},
                    {"text_field", options.text_field},
                    {"invalid_utf8_replaced", stats.invalid_utf8},
                    {"num_files", stats.files},
                    {"inputs", files}};
  write_token_index(temp.path.string(), index);

  // Commit: move any previous dataset aside, rename the new one into place, then drop the old.
  fs::path old;
  if (fs::exists(output, ec)) {
    old = parent / str_cat(".", output.filename().string(), ".old-", ::getpid());
    fs::remove_all(old, ec);
    fs::rename(output, old, ec);
    if (ec) fail("data prepare: cannot move the existing ", output.string(), " aside: ", ec.message());
  }
  fs::rename(temp.path, output, ec);
  if (ec) {
    const std::string why = ec.message();
    if (!old.empty()) fs::rename(old, output, ec);
    fail("data prepare: cannot rename ", temp.path.string(), " to ", output.string(), ": ", why);
  }
  temp.committed = true;
  if (!old.empty()) fs::remove_all(old, ec);
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

}  // namespace titan::data
