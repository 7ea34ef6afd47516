// safetensors: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets},
// "__metadata__": {str: str}}, then the raw bytes. Files are read through mmap and validated up front
// (every error names the file and the tensor); writes are streamed into a temporary file (write-back
// started as it goes, so large files are written at the disk's speed even under memory pressure),
// fsynced and renamed, so a failed write never leaves a partial file.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace titan {

struct SafetensorsEntry {
  std::string dtype;  // as stored: "F32", "BF16", "F16", "I32", "I64", ...
  Shape shape;
  size_t begin = 0, end = 0;  // byte offsets relative to the data section
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);  // throws titan::Error naming the file
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return entries_.count(name) > 0; }
  const SafetensorsEntry& entry(const std::string& name) const;

  // A new tensor holding the stored values: F32/BF16/I32 as stored, F16 converted to F32.
  Tensor load(const std::string& name) const;
  // Copies into `dst` (same numel and shape; converts F32/BF16/F16 -> dst dtype).
  void read_into(const std::string& name, Tensor& dst) const;
  const uint8_t* bytes(const SafetensorsEntry& e) const { return data_ + e.begin; }

 private:
  std::string path_;
  int fd_ = -1;
  void* map_ = nullptr;
  size_t size_ = 0;
  const uint8_t* data_ = nullptr;
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Writes `tensors` (stored in their own dtype) to `path` atomically.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

struct SafetensorsWriteOptions {
  std::function<void(uint64_t)> on_bytes;  // called after every chunk of n data bytes (progress reports)
  uint64_t* checksum = nullptr;            // receives the XXH3-64 of the whole file
};
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata, const SafetensorsWriteOptions& options);

// fsync of a directory, so renames and new entries inside it are durable.
void fsync_directory(const std::string& dir);

// Writes `tmp_path` then fsyncs and renames it to `path`. Used by every writer of final outputs.
void atomic_rename(const std::string& tmp_path, const std::string& path);

}  // namespace titan
