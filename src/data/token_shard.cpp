#include "data/token_shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"

namespace titan::data {

static_assert(std::endian::native == std::endian::little, "token shards are little-endian");

namespace {

struct ShardHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  uint32_t vocab_size;
  int32_t eos_id;
  uint64_t num_tokens;
  uint64_t num_docs;
  uint64_t reserved[3];
};
static_assert(sizeof(ShardHeader) == kShardHeaderBytes);

uint64_t offsets_position(uint64_t num_tokens) {
  return (kShardHeaderBytes + 4 * num_tokens + 7) / 8 * 8;
}

uint64_t expected_file_bytes(uint64_t num_tokens, uint64_t num_docs) {
  return offsets_position(num_tokens) + 8 * (num_docs + 1);
}

std::string printable(const char* bytes, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(bytes[i]);
    if (c >= 0x20 && c < 0x7f)
      s += static_cast<char>(c);
    else
      s += str_cat("\\x", "0123456789abcdef"[c >> 4], "0123456789abcdef"[c & 15]);
  }
  return s;
}

}  // namespace

TokenShard::TokenShard(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, ": cannot open token shard: ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, ": not a regular file");
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < kShardHeaderBytes) {
    ::close(fd);
    fail(path, ": truncated token shard: header needs ", kShardHeaderBytes, " bytes, file has ", file_bytes);
  }
  map_bytes_ = file_bytes;
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);  // the mapping keeps the file alive
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    fail(path, ": cannot mmap token shard: ", std::strerror(errno));
  }
  ShardHeader h;
  std::memcpy(&h, map_, sizeof h);
  TITAN_CHECK(std::memcmp(h.magic, kShardMagic, 8) == 0, path, ": not a token shard: field 'magic' is \"",
              printable(h.magic, 8), "\", expected \"TITANTOK\"");
  TITAN_CHECK(h.version == kShardVersion, path, ": unsupported token shard: field 'version' is ", h.version,
              ", this build reads version ", kShardVersion);
  TITAN_CHECK(h.header_bytes == kShardHeaderBytes, path, ": bad token shard: field 'header_bytes' is ",
              h.header_bytes, ", expected ", kShardHeaderBytes);
  TITAN_CHECK(h.vocab_size > 0, path, ": bad token shard: field 'vocab_size' is 0");
  TITAN_CHECK(h.eos_id >= -1 && h.eos_id < static_cast<int64_t>(h.vocab_size), path,
              ": bad token shard: field 'eos_id' is ", h.eos_id, ", outside the vocabulary of ",
              h.vocab_size);
  // Bound the counts before multiplying so a corrupt header cannot overflow the size check.
  TITAN_CHECK(h.num_tokens <= file_bytes / 4 && h.num_docs <= file_bytes / 8, path,
              ": truncated token shard: fields 'num_tokens' = ", h.num_tokens,
              " and 'num_docs' = ", h.num_docs, " do not fit in a ", file_bytes, "-byte file");
  const uint64_t expected = expected_file_bytes(h.num_tokens, h.num_docs);
  TITAN_CHECK(file_bytes == expected, path, file_bytes < expected ? ": truncated" : ": oversized",
              " token shard: fields 'num_tokens' = ", h.num_tokens, " and 'num_docs' = ", h.num_docs,
              " need ", expected, " bytes, file has ", file_bytes);
  vocab_size_ = h.vocab_size;
  eos_id_ = h.eos_id;
  num_tokens_ = h.num_tokens;
  num_docs_ = h.num_docs;
  const char* base = static_cast<const char*>(map_);
  tokens_ = reinterpret_cast<const uint32_t*>(base + kShardHeaderBytes);
  doc_offsets_ = reinterpret_cast<const uint64_t*>(base + offsets_position(num_tokens_));
  // Offsets are checked when a document is read (O(1) each), not here: a pass over the whole table
  // would make opening a corpus of a billion documents read gigabytes.
  TITAN_CHECK(doc_offsets_[0] == 0 && doc_offsets_[num_docs_] == num_tokens_, path,
              ": bad token shard: field 'doc_offsets' must run from 0 to num_tokens = ", num_tokens_);
}

TokenShard::~TokenShard() {
  if (map_) ::munmap(map_, map_bytes_);
}

std::span<const uint32_t> TokenShard::document(uint64_t i) const {
  TITAN_CHECK(i < num_docs_, path_, ": document ", i, " out of range (", num_docs_, " documents)");
  TITAN_CHECK(doc_offsets_[i] <= doc_offsets_[i + 1] && doc_offsets_[i + 1] <= num_tokens_, path_,
              ": bad token shard: field 'doc_offsets' is not increasing at document ", i);
  return {tokens_ + doc_offsets_[i], static_cast<size_t>(doc_offsets_[i + 1] - doc_offsets_[i])};
}

ShardWriter::ShardWriter(std::string path, uint32_t vocab_size, int32_t eos_id)
    : path_(std::move(path)), vocab_size_(vocab_size), eos_id_(eos_id) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(path_, ": cannot create token shard: ", std::strerror(errno));
  pending_.reserve(1 << 20);
  const ShardHeader placeholder{};  // the real header is written by finish()
  write(&placeholder, sizeof placeholder);
}

ShardWriter::~ShardWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void ShardWriter::write(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  pending_.insert(pending_.end(), p, p + bytes);
  if (pending_.size() >= (1 << 20)) flush();
}

void ShardWriter::flush() {
  size_t done = 0;
  while (done < pending_.size()) {
    const ssize_t n = ::write(fd_, pending_.data() + done, pending_.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(path_, ": write error: ", std::strerror(errno));
    done += static_cast<size_t>(n);
  }
  pending_.clear();
}

void ShardWriter::add_tokens(std::span<const int32_t> tokens) {
  for (const int32_t id : tokens)
    TITAN_CHECK(id >= 0 && static_cast<uint32_t>(id) < vocab_size_, path_, ": token id ", id,
                " outside the vocabulary of ", vocab_size_);
  write(tokens.data(), tokens.size() * sizeof(int32_t));  // non-negative int32 has the uint32 bit pattern
  num_tokens_ += tokens.size();
}

void ShardWriter::end_document() {
  doc_offsets_.push_back(num_tokens_);
}

void ShardWriter::finish() {
  TITAN_CHECK(fd_ >= 0, path_, ": shard already finished");
  const uint64_t padding = offsets_position(num_tokens_) - (kShardHeaderBytes + 4 * num_tokens_);
  const char zeros[8] = {};
  write(zeros, padding);
  write(doc_offsets_.data(), doc_offsets_.size() * 8);
  flush();
  ShardHeader h{};
  std::memcpy(h.magic, kShardMagic, 8);
  h.version = kShardVersion;
  h.header_bytes = kShardHeaderBytes;
  h.vocab_size = vocab_size_;
  h.eos_id = eos_id_;
  h.num_tokens = num_tokens_;
  h.num_docs = num_docs();
  if (::pwrite(fd_, &h, sizeof h, 0) != static_cast<ssize_t>(sizeof h))
    fail(path_, ": write error: ", std::strerror(errno));
  if (::fsync(fd_) != 0) fail(path_, ": fsync failed: ", std::strerror(errno));
  if (::close(fd_) != 0) fail(path_, ": close failed: ", std::strerror(errno));
  fd_ = -1;
}

uint64_t TokenIndex::num_tokens() const {
  uint64_t n = 0;
  for (const auto& s : shards) n += s.num_tokens;
  return n;
}

uint64_t TokenIndex::num_docs() const {
  uint64_t n = 0;
  for (const auto& s : shards) n += s.num_docs;
  return n;
}

bool is_token_dataset(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) return fs::exists(fs::path(path) / kTokenIndexFile, ec);
  return fs::path(path).filename() == kTokenIndexFile;
}

std::string token_dataset_dir(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) return path;
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? "." : parent.string();
}

TokenIndex read_token_index(const std::string& dataset) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(token_dataset_dir(dataset)) / kTokenIndexFile).string();
  std::ifstream in(path);
  if (!in) fail(path, ": cannot open token index: ", std::strerror(errno));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": malformed token index: ", e.what());
  }
  TokenIndex index;
  try {
    TITAN_CHECK(j.value("format", "") == "titan-tokens", path, ": field 'format' is not \"titan-tokens\"");
    const int version = j.at("version").get<int>();
    TITAN_CHECK(version == kTokenIndexVersion, path, ": unsupported field 'version' = ", version,
                ", this build reads ", kTokenIndexVersion);
    index.vocab_size = j.at("vocab_size").get<uint32_t>();
    index.eos_id = j.at("eos_id").get<int32_t>();
    for (const auto& s : j.at("shards"))
      index.shards.push_back({s.at("file").get<std::string>(), s.at("num_tokens").get<uint64_t>(),
                              s.at("num_docs").get<uint64_t>()});
    if (j.contains("metadata")) index.metadata = j["metadata"];
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": malformed token index: ", e.what());
  }
  return index;
}

void write_token_index(const std::string& dir, const TokenIndex& index) {
  nlohmann::json shards = nlohmann::json::array();
  for (const auto& s : index.shards)
    shards.push_back({{"file", s.file}, {"num_tokens", s.num_tokens}, {"num_docs", s.num_docs}});
  const nlohmann::json j = {
      {"format", "titan-tokens"}, {"version", kTokenIndexVersion},    {"vocab_size", index.vocab_size},
      {"eos_id", index.eos_id},   {"num_tokens", index.num_tokens()}, {"num_docs", index.num_docs()},
      {"shards", shards},         {"metadata", index.metadata}};
  const std::string path = (std::filesystem::path(dir) / kTokenIndexFile).string();
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  out.close();
  if (!out) fail(path, ": cannot write token index");
}

}  // namespace titan::data
