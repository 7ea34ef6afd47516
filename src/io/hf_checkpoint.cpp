#include "io/hf_checkpoint.h"

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "io/json_file.h"

namespace titan {

namespace fs = std::filesystem;

HFCheckpointReader::HFCheckpointReader(const std::string& dir) : dir_(dir) {
  TITAN_CHECK(fs::is_directory(dir), dir, ": not a directory");
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single = fs::path(dir) / "model.safetensors";
  if (fs::exists(index)) {
    const nlohmann::json j = read_json_file(index.string());
    TITAN_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), index.string(),
                ": missing field 'weight_map'");
    std::map<std::string, size_t> file_index;
    for (auto& [key, file] : j["weight_map"].items()) {
      TITAN_CHECK(file.is_string(), index.string(), ": weight_map['", key, "'] is not a file name");
      std::string name = file.get<std::string>();
      auto it = file_index.find(name);
      if (it == file_index.end()) {
        const fs::path shard = fs::path(dir) / name;
        TITAN_CHECK(fs::exists(shard), index.string(), ": shard '", name, "' (holding '", key,
                    "') is missing");
        files_.push_back(std::make_unique<SafetensorsFile>(shard.string()));
        it = file_index.emplace(name, files_.size() - 1).first;
      }
      TITAN_CHECK(files_[it->second]->contains(key), files_[it->second]->path(), ": tensor '", key,
                  "' listed in model.safetensors.index.json is not in this shard");
      where_[key] = it->second;
    }
  } else if (fs::exists(single)) {
    files_.push_back(std::make_unique<SafetensorsFile>(single.string()));
    for (auto& [key, _] : files_[0]->entries()) where_[key] = 0;
  } else {
    fail(dir, ": no model.safetensors or model.safetensors.index.json");
  }
}

std::vector<std::string> HFCheckpointReader::keys() const {
  std::vector<std::string> out;
  for (auto& [k, _] : where_) out.push_back(k);
  return out;
}

const SafetensorsFile& HFCheckpointReader::file_of(const std::string& key) const {
  auto it = where_.find(key);
  TITAN_CHECK(it != where_.end(), dir_, ": checkpoint has no tensor '", key, "'");
  return *files_[it->second];
}

void HFCheckpointReader::read_into(const std::string& key, Tensor& dst) const {
  file_of(key).read_into(key, dst);
}

namespace {
void write_text_atomic(const fs::path& path, const std::string& text) {
  const std::string tmp = path.string() + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary);
    TITAN_CHECK(f, tmp, ": cannot open for writing");
    f << text;
    f.flush();
    TITAN_CHECK(f, tmp, ": write failed");
  }
  atomic_rename(tmp, path.string());
}

std::string shard_name(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}
}  // namespace

void save_hf_checkpoint(const std::string& dir, const nlohmann::ordered_json& config,
                        const NamedTensors& tensors, DType dtype, int64_t max_shard_bytes) {
  fs::create_directories(dir);
  // Convert and group into shards (greedy, in order, like huggingface_hub's splitter).
  std::vector<NamedTensors> shards(1);
  int64_t shard_bytes = 0, total = 0;
  for (auto& [name, t] : tensors) {
    Tensor out = t.dtype() == dtype ? t : t.to(dtype);
    const int64_t n = static_cast<int64_t>(out.nbytes());
    if (!shards.back().empty() && shard_bytes + n > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().emplace_back(name, out);
    shard_bytes += n;
    total += n;
  }
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  const fs::path root(dir);
  if (shards.size() == 1) {
    save_safetensors((root / "model.safetensors").string(), shards[0], meta);
    fs::remove(root / "model.safetensors.index.json");
  } else {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total}};
    nlohmann::json weight_map = nlohmann::json::object();
    for (size_t i = 0; i < shards.size(); ++i) {
      save_safetensors((root / shard_name(i, shards.size())).string(), shards[i], meta);
      for (auto& [name, _] : shards[i]) weight_map[name] = shard_name(i, shards.size());
    }
    index["weight_map"] = weight_map;  // nlohmann::json sorts keys, as HF's writer does
    write_text_atomic(root / "model.safetensors.index.json", index.dump(2) + "\n");
    fs::remove(root / "model.safetensors");
  }
  nlohmann::ordered_json cfg = config;
  cfg["torch_dtype"] = dtype == DType::BF16 ? "bfloat16" : "float32";
  write_text_atomic(root / "config.json", cfg.dump(2) + "\n");
}

}  // namespace titan
