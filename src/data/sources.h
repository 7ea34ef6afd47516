// Document sources: the ordered stream of documents (as token ids) of one epoch of one split.
// The loader packs them into windows; `titan data prepare` writes them to shards.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "data/config.h"
#include "data/encoder.h"
#include "data/text_reader.h"

namespace titan::data {

struct SourceFile {
  std::string path;
  FileFormat format;
  uint64_t size_bytes = 0;
};

// The files behind a config's sources: text / JSON Lines files, or token dataset directories.
struct ResolvedSources {
  bool tokens = false;
  std::vector<SourceFile> files;        // text and JSON Lines
  std::vector<std::string> token_dirs;  // token datasets
};

// Expands directories (recursively, sorted, hidden entries skipped) and detects formats. Throws
// titan::Error for a missing or unreadable source, or for token datasets mixed with text.
ResolvedSources resolve_sources(const std::vector<std::string>& sources, DataFormat format);

// Which documents belong to a split: a document is held out for validation when the hash of its
// name (file and position, or index in a token dataset) falls below val_fraction. Deterministic,
// independent of the shuffle seed, and the two sides are disjoint by construction.
struct SplitFilter {
  double val_fraction = 0.0;
  uint64_t split_seed = 0;
  Split split = Split::Train;
  bool contains(uint64_t document_hash) const;
};

class DocumentSource {
 public:
  virtual ~DocumentSource() = default;
  // Restarts at the first document of `epoch` (each epoch has its own order when shuffling).
  virtual void start_epoch(uint64_t epoch) = 0;
  // Position of the next document within the current epoch, for seek().
  virtual nlohmann::json tell() const = 0;
  virtual void seek(uint64_t epoch, const nlohmann::json& position) = 0;
  // The next document (or piece of one) of this epoch and split: its ids (valid until the next
  // call) and whether the document ends with it. False at the end of the epoch.
  virtual bool next(std::span<const int32_t>& ids, bool& ends_document) = 0;
  // Chat data: the labels of the document next() returned (ids on assistant tokens, -100
  // elsewhere, not shifted; valid until the next call). Empty for other data.
  virtual std::span<const int32_t> labels() const { return {}; }
  // Records skipped so far (chat: conversations without an assistant token within seq_len + 1 tokens).
  virtual uint64_t skipped() const { return 0; }
  virtual int32_t vocab_size() const = 0;
  virtual int32_t eos_id() const = 0;
  // Identifies the data and options, so a saved loader state is not applied to other data.
  virtual nlohmann::json fingerprint() const = 0;
};

// Opens the sources of `cfg`. `encoder` is used for text and JSON Lines (ignored for tokens); chat
// data needs its encode_chat. A chat record whose assistant tokens all lie beyond the first
// seq_len + 1 tokens carries no loss in its row and is skipped (with a warning).
std::unique_ptr<DocumentSource> open_document_source(const DataConfig& cfg, const TextEncoder& encoder);

}  // namespace titan::data
