// Pre-tokenized corpora on disk: a directory with index.json and shard files.
//
// Shard file (little-endian):
//   header (64 bytes): magic "TITANTOK", u32 version, u32 header bytes, u32 vocab size,
//                      i32 eos id (-1: none), u64 token count, u64 document count, 24 reserved bytes
//   u32 tokens[token count]                   documents back to back, without separators
//   zero padding to a multiple of 8 bytes
//   u64 doc_offsets[document count + 1]       document i is tokens[doc_offsets[i], doc_offsets[i+1])
// index.json lists the shards in order with their token and document counts; the loader appends
// EOS after each document, so a shard holds only what the tokenizer produced.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

namespace titan::data {

inline constexpr char kShardMagic[8] = {'T', 'I', 'T', 'A', 'N', 'T', 'O', 'K'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr uint32_t kShardHeaderBytes = 64;
inline constexpr int kTokenIndexVersion = 1;
inline constexpr const char* kTokenIndexFile = "index.json";

// A shard mapped read-only into memory: pages come from the page cache on demand, so a corpus of
// any size costs address space, not resident memory.
class TokenShard {
 public:
  // Throws titan::Error naming the file and the field on bad magic, version, sizes or offsets.
  explicit TokenShard(const std::string& path);
  ~TokenShard();
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const std::string& path() const { return path_; }
  uint32_t vocab_size() const { return vocab_size_; }
  int32_t eos_id() const { return eos_id_; }
  uint64_t num_tokens() const { return num_tokens_; }
  uint64_t num_docs() const { return num_docs_; }
  // Throws titan::Error naming the file when the offsets of document i are corrupt.
  std::span<const uint32_t> document(uint64_t i) const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  uint32_t vocab_size_ = 0;
  int32_t eos_id_ = -1;
  uint64_t num_tokens_ = 0, num_docs_ = 0;
  const uint32_t* tokens_ = nullptr;
  const uint64_t* doc_offsets_ = nullptr;
};

// Writes one shard incrementally; nothing but the tokens of the current document is buffered
// beyond a write buffer and the document offsets of this shard.
class ShardWriter {
 public:
  ShardWriter(std::string path, uint32_t vocab_size, int32_t eos_id);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Ids must lie in [0, vocab_size). A document may arrive in several add_tokens() calls.
  void add_tokens(std::span<const int32_t> tokens);
  void end_document();
  void add_document(std::span<const int32_t> tokens) {
    add_tokens(tokens);
    end_document();
  }
  uint64_t num_tokens() const { return num_tokens_; }
  uint64_t num_docs() const { return doc_offsets_.size() - 1; }
  // Writes the offsets and the final header, then closes the file.
  void finish();

 private:
  void write(const void* data, size_t bytes);
  void flush();
  std::string path_;
  int fd_ = -1;
  uint32_t vocab_size_;
  int32_t eos_id_;
  uint64_t num_tokens_ = 0;
  std::vector<uint64_t> doc_offsets_{0};
  std::vector<char> pending_;
};

struct ShardInfo {
  std::string file;  // relative to the index directory
  uint64_t num_tokens = 0;
  uint64_t num_docs = 0;
};

struct TokenIndex {
  uint32_t vocab_size = 0;
  int32_t eos_id = -1;
  std::vector<ShardInfo> shards;
  nlohmann::json metadata = nlohmann::json::object();  // tokenizer, inputs, options (informational)
  uint64_t num_tokens() const;
  uint64_t num_docs() const;
};

// `dir` is the dataset directory (or the path of its index.json). Throws titan::Error on a missing
// or malformed index.
TokenIndex read_token_index(const std::string& dir);
void write_token_index(const std::string& dir, const TokenIndex& index);
// True when `path` is a token dataset: a directory holding index.json, or an index.json itself.
bool is_token_dataset(const std::string& path);
// The directory of a token dataset given as a directory or as its index.json.
std::string token_dataset_dir(const std::string& path);

}  // namespace titan::data
