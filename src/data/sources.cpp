#include "data/sources.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>

#include "core/error.h"
#include "data/shuffle.h"
#include "data/token_shard.h"

namespace titan::data {

namespace fs = std::filesystem;

namespace {

FileFormat file_format(const fs::path& p, DataFormat format) {
  if (format == DataFormat::Jsonl || format == DataFormat::Chat) return FileFormat::Jsonl;
  if (format == DataFormat::Text) return FileFormat::Text;
  const std::string ext = p.extension().string();
  return ext == ".jsonl" || ext == ".ndjson" ? FileFormat::Jsonl : FileFormat::Text;
}

void check_readable(const std::string& path) {
  std::error_code ec;
  const auto st = fs::status(path, ec);
  if (ec || !fs::exists(st)) fail("data source '", path, "': no such file or directory");
  if (fs::is_regular_file(st)) {
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) fail("data source '", path, "': cannot open: ", std::strerror(errno));
    std::fclose(f);
  }
}

// Process-wide, so that train and validation loaders over the same files report a problem once.
bool first_report(const std::string& key) {
  static std::mutex mutex;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lock(mutex);
  return seen.insert(key).second;
}

}  // namespace

ResolvedSources resolve_sources(const std::vector<std::string>& sources, DataFormat format) {
  TITAN_CHECK(!sources.empty(), "no data sources given");
  ResolvedSources out;
  bool any_text = false;
  for (const std::string& source : sources) {
    check_readable(source);
    const bool tokens =
        format == DataFormat::Tokens || (format == DataFormat::Auto && is_token_dataset(source));
    if (tokens) {
      TITAN_CHECK(is_token_dataset(source), "data source '", source,
                  "': not a token dataset (expected a directory with ", kTokenIndexFile, ")");
      out.token_dirs.push_back(token_dataset_dir(source));
      continue;
    }
    any_text = true;
    const fs::path root = fs::path(source).lexically_normal();
    if (!fs::is_directory(root)) {
      TITAN_CHECK(fs::is_regular_file(root), "data source '", source, "': not a regular file or directory");
      out.files.push_back({root.string(), file_format(root, format), fs::file_size(root)});
      continue;
    }
    std::vector<fs::path> found;
    std::error_code ec;
    fs::recursive_directory_iterator it(root, fs::directory_options::none, ec), end;
    if (ec) fail("data source '", source, "': cannot list directory: ", ec.message());
    for (; it != end; it.increment(ec)) {
      if (ec) fail("data source '", source, "': cannot list directory: ", ec.message());
      const std::string name = it->path().filename().string();
      if (!name.empty() && name[0] == '.') {
        if (it->is_directory()) it.disable_recursion_pending();
        continue;
      }
      if (it->is_regular_file()) found.push_back(it->path());
    }
    std::sort(found.begin(), found.end());
    for (const auto& p : found) {
      check_readable(p.string());
      out.files.push_back({p.string(), file_format(p, format), fs::file_size(p)});
    }
  }
  TITAN_CHECK(!(any_text && !out.token_dirs.empty()),
              "data sources mix token datasets with text files; prepare the text with `titan data prepare`");
  out.tokens = !out.token_dirs.empty();
  TITAN_CHECK(out.tokens || !out.files.empty(), "data sources hold no files: ", sources.front(),
              sources.size() > 1 ? " ..." : "");
  return out;
}

bool SplitFilter::contains(uint64_t document_hash) const {
  const bool held_out =
      val_fraction > 0 && hash_to_unit(hash_combine(split_seed, document_hash)) < val_fraction;
  return held_out == (split == Split::Validation);
}

namespace {

// Text and JSON Lines files, streamed. Shuffling permutes the file order per epoch; documents of
// a file keep their order (a streamed file has no random access to its documents).
class TextSource final : public DocumentSource {
 public:
  TextSource(const DataConfig& cfg, std::vector<SourceFile> files, TextEncoder encoder)
      : cfg_(cfg),
        files_(std::move(files)),
        encoder_(std::move(encoder)),
        options_(text_reader_options(cfg)) {
    split_ = {cfg.val_fraction, cfg.split_seed, cfg.split};
    chat_ = cfg.format == DataFormat::Chat;
    TITAN_CHECK(!chat_ || static_cast<bool>(encoder_.encode_chat),
                "chat data needs a chat encoder (the tokenizer and its chat template)");
    eos_id_ = cfg.eos_id.value_or(encoder_.eos_id);
    TITAN_CHECK(eos_id_ >= 0 && eos_id_ < encoder_.vocab_size, "tokenizer '", encoder_.name,
                "' has no end-of-text token to separate documents; set the data eos_id");
    for (const auto& f : files_) file_hashes_.push_back(hash_string(f.path));
    start_epoch(0);
  }

  void start_epoch(uint64_t epoch) override {
    epoch_ = epoch;
    order_.resize(files_.size());
    for (size_t i = 0; i < order_.size(); ++i) order_[i] = i;
    if (cfg_.shuffle) seeded_shuffle(order_, hash_combine(cfg_.seed, epoch));
    file_pos_ = 0;
    reader_.reset();
    pending_ = {};
  }

  nlohmann::json tell() const override {
    const TextPosition p = reader_ ? reader_->tell() : pending_;
    return {{"file", file_pos_},
            {"offset", p.offset},
            {"ordinal", p.ordinal},
            {"line", p.line},
            {"line_start", p.at_line_start},
            {"in_document", p.in_document}};
  }

  void seek(uint64_t epoch, const nlohmann::json& pos) override {
    start_epoch(epoch);
    file_pos_ = pos.at("file").get<size_t>();
    TITAN_CHECK(file_pos_ <= files_.size(), "loader state: file position ", file_pos_, " out of range");
    pending_ = {pos.at("offset").get<uint64_t>(), pos.at("ordinal").get<uint64_t>(),
                pos.at("line").get<uint64_t>(), pos.at("line_start").get<bool>(),
                pos.at("in_document").get<bool>()};
  }

  bool next(std::span<const int32_t>& ids, bool& ends_document) override {
    TextPiece piece;
    for (;;) {
      if (!reader_) {
        if (file_pos_ >= files_.size()) return false;
        const SourceFile& f = files_[order_[file_pos_]];
        reader_ = std::make_unique<TextFileReader>(f.path, f.format, options_);
        if (reader_->size_bytes() == 0) {
          if (first_report("empty:" + f.path)) warn(cfg_.on_warning, f.path + ": empty file, skipped");
          close_file();
          continue;
        }
        reader_->seek(pending_);
        pieces_in_file_ = 0;
      }
      if (!reader_->next(piece)) {
        report_file();
        close_file();
        continue;
      }
      ++pieces_in_file_;
      if (!split_.contains(hash_combine(file_hashes_[order_[file_pos_]], piece.ordinal))) continue;
      if (chat_) {
        const std::string where = str_cat(reader_->path(), ":", piece.line);
        encoder_.encode_chat(piece.text, where, ids_, labels_);
        if (!trainable()) {
          ++skipped_;
          if (first_report("untrainable:" + reader_->path()))
            warn(cfg_.on_warning, str_cat(where, ": no assistant token within the first seq_len + 1 = ",
                                          cfg_.seq_len + 1, " tokens; conversation skipped (further ones in ",
                                          "this file are skipped silently)"));
          continue;
        }
        ids = ids_;
        ends_document = true;
        return true;
      }
      encoder_.encode(piece.text, ids_);
      ids = ids_;
      ends_document = piece.ends_document;
      return true;
    }
  }

  std::span<const int32_t> labels() const override {
    return chat_ ? std::span<const int32_t>(labels_) : std::span<const int32_t>();
  }
  uint64_t skipped() const override { return skipped_; }
  int32_t vocab_size() const override { return encoder_.vocab_size; }
  int32_t eos_id() const override { return eos_id_; }

  nlohmann::json fingerprint() const override {
    if (chat_)
      return {{"kind", "chat"},
              {"files", files_.size()},
              {"paths_hash", paths_hash()},
              {"bytes", bytes()},
              {"tokenizer", encoder_.name},
              {"chat_template", encoder_.chat_template},
              {"vocab_size", encoder_.vocab_size}};
    uint64_t paths = 0, bytes = 0;
    for (const auto& f : files_) {
      paths = hash_combine(paths, hash_string(f.path));
      bytes += f.size_bytes;
    }
    return {{"kind", "text"},
            {"files", files_.size()},
            {"paths_hash", paths},
            {"bytes", bytes},
            {"delimiter", to_string(cfg_.delimiter)},
            {"text_field", cfg_.text_field},
            {"tokenizer", encoder_.name},
            {"vocab_size", encoder_.vocab_size}};
  }

 private:
  void report_file() {
    const std::string& path = reader_->path();
    if (reader_->invalid_utf8_replaced() && first_report("utf8:" + path))
      warn(cfg_.on_warning, str_cat(path, ": replaced ", reader_->invalid_utf8_replaced(),
                                    " invalid UTF-8 sequence(s) with U+FFFD"));
    if (pieces_in_file_ == 0 && pending_.offset == 0 && first_report("nodocs:" + path))
      warn(cfg_.on_warning, path + ": no documents (only whitespace or delimiters), skipped");
  }
  // A chat row holds the first seq_len + 1 tokens; label 0 is never a target (no token before it).
  bool trainable() const {
    const size_t n = std::min<size_t>(labels_.size(), static_cast<size_t>(cfg_.seq_len) + 1);
    for (size_t t = 1; t < n; ++t)
      if (labels_[t] != -100) return true;
    return false;
  }
  uint64_t paths_hash() const {
    uint64_t h = 0;
    for (const auto& f : files_) h = hash_combine(h, hash_string(f.path));
    return h;
  }
  uint64_t bytes() const {
    uint64_t b = 0;
    for (const auto& f : files_) b += f.size_bytes;
    return b;
  }
  void close_file() {
    reader_.reset();
    ++file_pos_;
    pending_ = {};
  }

  DataConfig cfg_;
  std::vector<SourceFile> files_;
  std::vector<uint64_t> file_hashes_;
  TextEncoder encoder_;
  TextReaderOptions options_;
  SplitFilter split_;
  int32_t eos_id_ = -1;
  uint64_t epoch_ = 0;
  std::vector<size_t> order_;
  size_t file_pos_ = 0;
  std::unique_ptr<TextFileReader> reader_;
  TextPosition pending_;  // where to start reading the file at file_pos_ when it is opened
  uint64_t pieces_in_file_ = 0;
  uint64_t skipped_ = 0;
  std::vector<int32_t> ids_, labels_;
  bool chat_ = false;
};

// Token datasets, memory-mapped. Shuffling visits every document in a fresh pseudo-random order
// per epoch, computed pointwise (no order array, whatever the number of documents).
class TokenSource final : public DocumentSource {
 public:
  TokenSource(const DataConfig& cfg, const std::vector<std::string>& dirs) : cfg_(cfg) {
    split_ = {cfg.val_fraction, cfg.split_seed, cfg.split};
    bool first = true;
    for (const auto& dir : dirs) {
      const TokenIndex index = read_token_index(dir);
      const std::string index_path = (fs::path(dir) / kTokenIndexFile).string();
      if (first) {
        vocab_size_ = index.vocab_size;
        eos_id_ = index.eos_id;
        first = false;
      }
      TITAN_CHECK(index.vocab_size == vocab_size_ && index.eos_id == eos_id_, index_path,
                  ": field 'vocab_size'/'eos_id' (", index.vocab_size, "/", index.eos_id, ") differs from ",
                  dirs.front(), " (", vocab_size_, "/", eos_id_, ")");
      for (const auto& info : index.shards) {
        auto shard = std::make_unique<TokenShard>((fs::path(dir) / info.file).string());
        const auto& p = shard->path();
        TITAN_CHECK(shard->num_tokens() == info.num_tokens, p, ": field 'num_tokens' is ",
                    shard->num_tokens(), ", ", index_path, " says ", info.num_tokens);
        TITAN_CHECK(shard->num_docs() == info.num_docs, p, ": field 'num_docs' is ", shard->num_docs(), ", ",
                    index_path, " says ", info.num_docs);
        TITAN_CHECK(shard->vocab_size() == vocab_size_ && shard->eos_id() == eos_id_, p,
                    ": field 'vocab_size'/'eos_id' (", shard->vocab_size(), "/", shard->eos_id(),
                    ") differs from ", index_path, " (", vocab_size_, "/", eos_id_, ")");
        doc_start_.push_back(total_docs_);
        total_docs_ += shard->num_docs();
        total_tokens_ += shard->num_tokens();
        shards_.push_back(std::move(shard));
      }
    }
    TITAN_CHECK(vocab_size_ <= static_cast<uint32_t>(INT32_MAX), dirs.front(),
                ": field 'vocab_size' too large");
    if (cfg.eos_id) eos_id_ = *cfg.eos_id;
    TITAN_CHECK(eos_id_ >= 0 && eos_id_ < static_cast<int64_t>(vocab_size_), dirs.front(),
                ": no end-of-text id to separate documents (field 'eos_id' is -1); set the data eos_id");
    start_epoch(0);
  }

  void start_epoch(uint64_t epoch) override {
    epoch_ = epoch;
    position_ = 0;
    permutation_ = FeistelPermutation(total_docs_, hash_combine(cfg_.seed, epoch));
  }

  nlohmann::json tell() const override { return {{"doc", position_}}; }

  void seek(uint64_t epoch, const nlohmann::json& pos) override {
    start_epoch(epoch);
    position_ = pos.at("doc").get<uint64_t>();
    TITAN_CHECK(position_ <= total_docs_, "loader state: document position ", position_, " out of range");
  }

  bool next(std::span<const int32_t>& ids, bool& ends_document) override {
    while (position_ < total_docs_) {
      const uint64_t doc = cfg_.shuffle ? permutation_(position_) : position_;
      ++position_;
      if (!split_.contains(hash_combine(0x746f6b656e73ull, doc))) continue;
      const size_t s = static_cast<size_t>(std::upper_bound(doc_start_.begin(), doc_start_.end(), doc) -
                                           doc_start_.begin() - 1);
      const auto tokens = shards_[s]->document(doc - doc_start_[s]);
      // vocab_size <= INT32_MAX and the loader range-checks every id it hands out; int32 and
      // uint32 may alias.
      ids = {reinterpret_cast<const int32_t*>(tokens.data()), tokens.size()};
      ends_document = true;
      return true;
    }
    return false;
  }

  int32_t vocab_size() const override { return static_cast<int32_t>(vocab_size_); }
  int32_t eos_id() const override { return eos_id_; }

  nlohmann::json fingerprint() const override {
    return {{"kind", "tokens"},
            {"shards", shards_.size()},
            {"docs", total_docs_},
            {"tokens", total_tokens_},
            {"vocab_size", vocab_size_}};
  }

 private:
  DataConfig cfg_;
  SplitFilter split_;
  std::vector<std::unique_ptr<TokenShard>> shards_;
  std::vector<uint64_t> doc_start_;  // global index of each shard's first document
  uint64_t total_docs_ = 0, total_tokens_ = 0;
  uint32_t vocab_size_ = 0;
  int32_t eos_id_ = -1;
  uint64_t epoch_ = 0, position_ = 0;
  FeistelPermutation permutation_{0, 0};
};

}  // namespace

std::unique_ptr<DocumentSource> open_document_source(const DataConfig& cfg, const TextEncoder& encoder) {
  ResolvedSources resolved = resolve_sources(cfg.sources, cfg.format);
  if (resolved.tokens) return std::make_unique<TokenSource>(cfg, resolved.token_dirs);
  TITAN_CHECK(static_cast<bool>(encoder.encode), "text data sources need a tokenizer");
  return std::make_unique<TextSource>(cfg, std::move(resolved.files), encoder);
}

}  // namespace titan::data
