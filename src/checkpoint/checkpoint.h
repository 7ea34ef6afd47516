// Training checkpoints: atomic, checksummed, sharded directories that any world size can read.
//
// A checkpoint is a set of named logical 1-D f32 tensors (a layer group's flat parameters, its AdamW
// moments, buffers) plus JSON metadata (step, model config, data-loader position, ...). Each writing
// rank saves the slices it owns — under FSDP every rank its shard, in parallel — into one safetensors
// file; rank 0 records which file holds which [offset, offset + count) of which tensor. A reader asks
// for any slices it wants, so loading on another world size reshards by construction.
//
//   <folder>/step-N/
//     shard-00000-of-00002.safetensors   tensors of writer 0 (1-D slices)
//     shard-00001-of-00002.safetensors
//     metadata.json                      {"format": "titan-checkpoint", "step": N, "files": [...], ...}
//     COMPLETE                           marker: step and the XXH3 of metadata.json
//     (config.json, model.safetensors... when the save also exports HF weights)
//
// Atomic: everything is written into <folder>/.step-N.tmp, fsynced, the marker last, then the directory
// is renamed to step-N. A checkpoint counts only when its directory has that name and a marker that
// matches its metadata; every file's XXH3-64 is verified before any state is copied out.
//
// Fault injection for tests: TITAN_FAULT_INJECT=checkpoint:<point>[@step] sends SIGKILL to the process
// at that point of a save (of that step only, with @step): mid-shard (half of the shard bytes written),
// after-shards, after-metadata, before-rename, after-rename.
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "distributed/process_group.h"

namespace titan::ckpt {

// Elements [offset, offset + data.numel()) of logical tensor `name` (numel elements in all).
struct Slice {
  std::string name;
  int64_t numel = 0;
  int64_t offset = 0;
  Tensor data;  // f32, contiguous
};

struct SaveRequest {
  std::string folder;  // checkpoints live in <folder>/step-N
  int64_t step = 0;
  nlohmann::json meta;        // rank 0's is written (plus "format", "version", "step", "tensors", "files")
  std::vector<Slice> slices;  // what this rank writes (empty on ranks whose state another rank writes)
  // Rank 0, before the marker: extra files written into the (temporary) checkpoint directory.
  std::function<void(const std::string& dir)> extra_files;
  bool log = true;  // rank 0 prints progress for long saves and the size / GB/s line
};

// Collective over pg. Returns the final directory <folder>/step-N.
std::string save(dist::ProcessGroup& pg, const SaveRequest& request);

// Writes a directory through `write(tmp_dir)` into <final_dir> atomically (temporary sibling,
// fsync, rename; an existing <final_dir> is replaced). For outputs that are not training checkpoints
// (an HF export). Not collective.
void publish_directory(const std::string& final_dir,
                       const std::function<void(const std::string& dir)>& write);

// The newest complete checkpoint in `folder` ("" when there is none). Incomplete or temporary
// directories are skipped (and named on stdout when `log`).
std::string latest(const std::string& folder, bool log = false);
// True when `dir` is a complete checkpoint (marker present and matching its metadata).
bool is_complete(const std::string& dir);
// Deletes all but the newest `keep` complete checkpoints, and stale temporary directories
// (keep <= 0: keep all).
void prune(const std::string& folder, int64_t keep);

class Reader {
 public:
  // Opens and validates the marker and metadata.json; errors name the directory and file.
  explicit Reader(const std::string& dir);
  const std::string& dir() const { return dir_; }
  const nlohmann::json& meta() const { return meta_; }
  int64_t step() const { return meta_.at("step").get<int64_t>(); }
  bool has_tensor(const std::string& name) const { return meta_.at("tensors").contains(name); }
  int64_t tensor_numel(const std::string& name) const;

  // Fills every wanted slice. Everything is checked first — the tensor exists with that numel, the
  // files covering the slices exist, have the recorded size and checksum, hold the recorded entries —
  // and nothing is copied unless all checks pass. `log`: progress and the GB/s line.
  void read(std::vector<Slice>& wanted, bool log = false) const;

 private:
  std::string dir_;
  nlohmann::json meta_;
};

// XXH3-64 of a file's bytes as 16 hex digits (read through mmap).
std::string file_checksum(const std::string& path);

}  // namespace titan::ckpt
