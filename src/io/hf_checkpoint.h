// Hugging Face model directories: config.json plus model.safetensors, or sharded
// model-0000i-of-0000n.safetensors with model.safetensors.index.json.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace titan {

class HFCheckpointReader {
 public:
  explicit HFCheckpointReader(const std::string& dir);  // opens every shard, validates headers
  const std::string& dir() const { return dir_; }
  std::vector<std::string> keys() const;
  bool contains(const std::string& key) const { return where_.count(key) > 0; }
  const SafetensorsFile& file_of(const std::string& key) const;
  // Copies tensor `key` into `dst` (shape must match; converts dtype). Errors name file and tensor.
  void read_into(const std::string& key, Tensor& dst) const;

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // key -> index into files_
};

// Writes config.json and the tensors (converted to `dtype`) as model.safetensors, or as
// model-0000i-of-0000n.safetensors + model.safetensors.index.json when the total exceeds
// max_shard_bytes. Files appear only once completely written (temporary names, then rename).
void save_hf_checkpoint(const std::string& dir, const nlohmann::ordered_json& config,
                        const NamedTensors& tensors, DType dtype, int64_t max_shard_bytes = int64_t(5) << 30);

}  // namespace titan
