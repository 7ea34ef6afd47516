#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>

#include "core/error.h"
#include "io/json_file.h"
#include "io/safetensors.h"

namespace titan::ckpt {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "titan-checkpoint";
constexpr int kVersion = 1;
constexpr const char* kMarker = "COMPLETE";
constexpr const char* kMetadata = "metadata.json";

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// TITAN_FAULT_INJECT=checkpoint:<point>[@step]: die here as kill -9 would (tests of interrupted saves).
void fault_point(const char* point, int64_t step) {
  const char* env = std::getenv("TITAN_FAULT_INJECT");
  if (!env) return;
  const std::string want = env, here = std::string("checkpoint:") + point;
  if (want == here || want == here + "@" + std::to_string(step)) {
    std::fflush(stdout);
    std::raise(SIGKILL);
  }
}

std::string step_name(int64_t step) {
  return "step-" + std::to_string(step);
}

// Key of a slice inside its shard file: a rank may hold several slices of one tensor (expert parallel).
std::string entry_key(const std::string& name, int64_t offset) {
  return name + "@" + std::to_string(offset);
}

// Small text file written atomically (temporary name, fsync, rename).
void write_text_file(const fs::path& path, const std::string& text) {
  const std::string tmp = path.string() + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary);
    TITAN_CHECK(f.good(), tmp, ": cannot open for writing");
    f << text;
    f.flush();
    TITAN_CHECK(f.good(), tmp, ": write failed");
  }
  atomic_rename(tmp, path.string());
}

std::string read_text_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  TITAN_CHECK(f.good(), path.string(), ": cannot open");
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::string hex64(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string text_checksum(const std::string& s) {
  return hex64(XXH3_64bits(s.data(), s.size()));
}

// Prints "checkpoint: <what> x / y GiB" at most every 2 s, starting 2 s in (long saves and loads only).
class Progress {
 public:
  Progress(bool on, std::string what, int64_t total) : on_(on), what_(std::move(what)), total_(total) {}
  void add(int64_t bytes) {
    done_ += bytes;
    if (!on_) return;
    const double t = now_s();
    if (t - start_ >= 2.0 && t - last_ >= 2.0) {
      last_ = t;
      std::printf("checkpoint: %s %.2f / %.2f GiB (%.0f%%)\n", what_.c_str(), done_ / 1073741824.0,
                  total_ / 1073741824.0, total_ > 0 ? 100.0 * done_ / total_ : 100.0);
      std::fflush(stdout);
    }
  }
  int64_t done() const { return done_; }

 private:
  bool on_;
  std::string what_;
  int64_t total_, done_ = 0;
  double start_ = now_s(), last_ = 0;
};

// Variable-length strings from every rank to every rank.
std::vector<std::string> all_gather_strings(dist::ProcessGroup& pg, const std::string& mine) {
  const int W = pg.size();
  int64_t len = static_cast<int64_t>(mine.size());
  std::vector<int64_t> lens(W);
  pg.all_gather(&len, lens.data(), std::vector<int64_t>(W, 1), dist::CommType::I64);
  int64_t total = 0;
  for (int64_t l : lens) total += l;
  std::string all(static_cast<size_t>(total), '\0');
  pg.all_gather(mine.data(), all.data(), lens, dist::CommType::U8);
  std::vector<std::string> out;
  int64_t pos = 0;
  for (int64_t l : lens) {
    out.push_back(all.substr(static_cast<size_t>(pos), static_cast<size_t>(l)));
    pos += l;
  }
  return out;
}

// Renames the finished temporary directory to `final_dir` (an existing one is moved aside to
// .<name>.old first and deleted after), then makes the rename durable.
// The outermost directory that create_directories(dir) would make (empty when dir exists): what a failed
// write removes again, so it leaves no directory of its own behind.
fs::path first_missing_ancestor(const fs::path& dir) {
  fs::path missing;
  for (fs::path p = fs::absolute(dir); !p.empty() && !fs::exists(p); p = p.parent_path()) {
    missing = p;
    if (p == p.parent_path()) break;
  }
  return missing;
}

void move_into_place(const fs::path& tmp_dir, const fs::path& final_dir) {
  const fs::path parent = final_dir.has_parent_path() ? final_dir.parent_path() : fs::path(".");
  const fs::path old_dir = parent / ("." + final_dir.filename().string() + ".old");
  if (fs::exists(final_dir)) {
    fs::remove_all(old_dir);
    fs::rename(final_dir, old_dir);
  }
  fs::rename(tmp_dir, final_dir);
  fsync_directory(parent.string());
  fs::remove_all(old_dir);
}

}  // namespace

std::string file_checksum(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  TITAN_CHECK(fd >= 0, path, ": cannot open (", std::strerror(errno), ")");
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    fail(path, ": cannot stat (", std::strerror(errno), ")");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  uint64_t h = XXH3_64bits(nullptr, 0);
  if (size > 0) {
    void* map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      ::close(fd);
      fail(path, ": mmap failed (", std::strerror(errno), ")");
    }
    madvise(map, size, MADV_SEQUENTIAL);
    h = XXH3_64bits(map, size);
    munmap(map, size);
  }
  ::close(fd);
  return hex64(h);
}

// ---- save ----

std::string save(dist::ProcessGroup& pg, const SaveRequest& req) {
  const double t0 = now_s();
  const int rank = pg.rank(), W = pg.size();
  const fs::path folder(req.folder);
  const fs::path final_dir = folder / step_name(req.step);
  const fs::path tmp_dir = folder / ("." + step_name(req.step) + ".tmp");
  const bool log = req.log && rank == 0;
  const fs::path made = first_missing_ancestor(folder);
  if (rank == 0) {
    fs::create_directories(folder);
    fs::remove_all(tmp_dir);
    fs::create_directory(tmp_dir);
  }
  pg.barrier();
  // One process: a save that fails with an error (a write failing part-way) removes its temporary (and the
  // directories it made). With several ranks a failing rank aborts the job; the next save clears it.
  struct Cleanup {
    bool armed;
    const fs::path& tmp;
    const fs::path& made;
    ~Cleanup() {
      if (!armed || std::uncaught_exceptions() == 0) return;
      std::error_code ec;
      fs::remove_all(tmp, ec);
      if (!made.empty()) fs::remove_all(made, ec);
    }
  } cleanup{W == 1, tmp_dir, made};

  // Writers are the ranks with slices; file k belongs to the k-th writer.
  const int64_t writes = req.slices.empty() ? 0 : 1;
  std::vector<int64_t> writer_flags(W);
  pg.all_gather(&writes, writer_flags.data(), std::vector<int64_t>(W, 1), dist::CommType::I64);
  int64_t index = 0, writers = 0;
  for (int r = 0; r < W; ++r) {
    if (r < rank) index += writer_flags[r];
    writers += writer_flags[r];
  }
  TITAN_CHECK(writers > 0, "checkpoint ", final_dir.string(), ": no rank has state to write");

  nlohmann::json entry;  // this rank's file record
  if (writes) {
    char name[64];
    std::snprintf(name, sizeof name, "shard-%05lld-of-%05lld.safetensors", static_cast<long long>(index),
                  static_cast<long long>(writers));
    NamedTensors tensors;
    int64_t total = 0;
    nlohmann::json slices = nlohmann::json::array();
    for (auto& s : req.slices) {
      TITAN_CHECK(s.data.dtype() == DType::F32, "checkpoint: slice '", s.name, "' is not f32");
      TITAN_CHECK(s.offset >= 0 && s.offset + s.data.numel() <= s.numel, "checkpoint: slice '", s.name, "' [",
                  s.offset, ", ", s.offset + s.data.numel(), ") is outside its tensor of ", s.numel,
                  " elements");
      // Device state is written from a host copy.
      tensors.emplace_back(entry_key(s.name, s.offset), s.data.view({s.data.numel()}).to(Device::cpu()));
      slices.push_back(
          {{"name", s.name}, {"numel", s.numel}, {"offset", s.offset}, {"count", s.data.numel()}});
      total += static_cast<int64_t>(s.data.nbytes());
    }
    Progress progress(log, "saving " + step_name(req.step) + " (rank 0's shard)", total);
    bool half_reported = false;
    const std::string path = (tmp_dir / name).string();
    uint64_t checksum = 0;
    SafetensorsWriteOptions options;
    options.checksum = &checksum;
    options.on_bytes = [&](uint64_t n) {
      progress.add(static_cast<int64_t>(n));
      if (!half_reported && progress.done() * 2 >= total) {
        half_reported = true;
        fault_point("mid-shard", req.step);
      }
    };
    save_safetensors(path, tensors, {{"format", std::string(kFormat) + "-shard"}}, options);
    entry = {{"file", name},
             {"bytes", static_cast<int64_t>(fs::file_size(path))},
             {"xxh3", hex64(checksum)},
             {"slices", slices}};
  }
  const std::vector<std::string> records = all_gather_strings(pg, writes ? entry.dump() : std::string());
  fault_point("after-shards", req.step);

  std::string result = final_dir.string();
  if (rank == 0) {
    nlohmann::json meta = req.meta.is_object() ? req.meta : nlohmann::json::object();
    meta["format"] = kFormat;
    meta["version"] = kVersion;
    meta["step"] = req.step;
    meta["world_size"] = W;
    nlohmann::json files = nlohmann::json::array(), tensors = nlohmann::json::object();
    int64_t bytes = 0;
    for (auto& rec : records) {
      if (rec.empty()) continue;
      nlohmann::json f = nlohmann::json::parse(rec);
      for (auto& s : f["slices"]) {
        const std::string n = s["name"];
        TITAN_CHECK(!tensors.contains(n) || tensors[n] == s["numel"], "checkpoint: tensor '", n,
                    "' has different sizes on different ranks");
        tensors[n] = s["numel"];
        s.erase("numel");
      }
      bytes += f["bytes"].get<int64_t>();
      files.push_back(f);
    }
    meta["tensors"] = tensors;
    meta["files"] = files;
    const std::string text = meta.dump(1);
    write_text_file(tmp_dir / kMetadata, text);
    if (req.extra_files) req.extra_files(tmp_dir.string());
    fault_point("after-metadata", req.step);
    write_text_file(tmp_dir / kMarker,
                    nlohmann::json{{"step", req.step}, {"metadata_xxh3", text_checksum(text)}}.dump() + "\n");
    fsync_directory(tmp_dir.string());
    fault_point("before-rename", req.step);
    // Replaces an older directory of the same step (e.g. from a run that was restarted from scratch).
    move_into_place(tmp_dir, final_dir);
    fault_point("after-rename", req.step);
    const double dt = now_s() - t0;
    if (log) {
      std::printf("checkpoint: saved %s (%zu file(s), %.3f GiB) in %.2f s (%.2f GB/s)\n", final_dir.c_str(),
                  files.size(), bytes / 1073741824.0, dt, dt > 0 ? bytes / dt / 1e9 : 0.0);
      std::fflush(stdout);
    }
  }
  pg.barrier();
  return result;
}

void publish_directory(const std::string& final_path, const std::function<void(const std::string&)>& write) {
  const fs::path final_dir(final_path);
  const fs::path parent = final_dir.has_parent_path() ? final_dir.parent_path() : fs::path(".");
  const fs::path tmp_dir = parent / ("." + final_dir.filename().string() + ".tmp");
  const fs::path made = first_missing_ancestor(parent);
  fs::create_directories(parent);
  fs::remove_all(tmp_dir);
  fs::create_directory(tmp_dir);
  try {
    write(tmp_dir.string());
    fsync_directory(tmp_dir.string());
    move_into_place(tmp_dir, final_dir);
  } catch (...) {  // a failed write (disk full) leaves nothing behind: no temporary, no new parent
    std::error_code ec;
    fs::remove_all(tmp_dir, ec);
    if (!made.empty()) fs::remove_all(made, ec);
    throw;
  }
}

// ---- discovery ----

bool is_complete(const std::string& dir) {
  try {
    const fs::path d(dir);
    if (!fs::exists(d / kMarker) || !fs::exists(d / kMetadata)) return false;
    const nlohmann::json marker = nlohmann::json::parse(read_text_file(d / kMarker));
    return marker.at("metadata_xxh3").get<std::string>() == text_checksum(read_text_file(d / kMetadata));
  } catch (const std::exception&) {
    return false;
  }
}

namespace {

// Complete checkpoints in `folder` as (step, dir), oldest first.
std::vector<std::pair<int64_t, fs::path>> complete_checkpoints(const std::string& folder, bool log) {
  std::vector<std::pair<int64_t, fs::path>> out;
  if (!fs::is_directory(folder)) return out;
  static const std::regex name_re("step-([0-9]+)");
  for (auto& e : fs::directory_iterator(folder)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || !std::regex_match(name, m, name_re)) continue;
    if (!is_complete(e.path().string())) {
      // An HF export without training state is not a checkpoint either, but not worth a word.
      if (log && fs::exists(e.path() / kMetadata))
        std::printf("checkpoint: skipping %s (no valid %s marker: the save did not finish)\n",
                    e.path().c_str(), kMarker);
      continue;
    }
    int64_t step = 0;  // a step number past 64 bits is no checkpoint of ours
    const std::string digits = m[1].str();
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
    if (ec != std::errc() || end != digits.data() + digits.size()) {
      if (log) std::printf("checkpoint: skipping %s (step number out of range)\n", e.path().c_str());
      continue;
    }
    out.emplace_back(step, e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

std::string latest(const std::string& folder, bool log) {
  auto all = complete_checkpoints(folder, log);
  return all.empty() ? std::string() : all.back().second.string();
}

void prune(const std::string& folder, int64_t keep) {
  if (!fs::is_directory(folder)) return;
  for (auto& e : fs::directory_iterator(folder)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && name.rfind(".step-", 0) == 0) fs::remove_all(e.path());
  }
  if (keep <= 0) return;
  auto all = complete_checkpoints(folder, false);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) fs::remove_all(all[i].second);
}

// ---- read ----

Reader::Reader(const std::string& dir) : dir_(dir) {
  const fs::path d(dir);
  TITAN_CHECK(fs::is_directory(d), "checkpoint ", dir, ": no such directory");
  TITAN_CHECK(fs::exists(d / kMetadata), "checkpoint ", dir, ": ", kMetadata,
              " is missing (not a titan training checkpoint)");
  TITAN_CHECK(fs::exists(d / kMarker), "checkpoint ", dir, ": no ", kMarker,
              " marker (the save did not finish)");
  const std::string text = read_text_file(d / kMetadata);
  try {
    const nlohmann::json marker = parse_json(read_text_file(d / kMarker), (d / kMarker).string());
    TITAN_CHECK(marker.at("metadata_xxh3").get<std::string>() == text_checksum(text),
                (d / kMetadata).string(), ": checksum does not match the ", kMarker,
                " marker (file corrupted or modified)");
    meta_ = parse_json(text, (d / kMetadata).string());
    TITAN_CHECK(meta_.at("format") == kFormat, (d / kMetadata).string(), ": field 'format' is ",
                meta_.at("format").dump(), ", expected \"", kFormat, "\"");
    TITAN_CHECK(meta_.at("version").get<int>() == kVersion, (d / kMetadata).string(), ": field 'version' is ",
                meta_.at("version").dump(), ", this build reads version ", kVersion);
    (void)meta_.at("step").get<int64_t>();
    TITAN_CHECK(meta_.at("tensors").is_object() && meta_.at("files").is_array(), (d / kMetadata).string(),
                ": fields 'tensors' / 'files' are malformed");
    // Every field the reader uses later, with its type, so that reading never meets a surprise.
    const std::string where = (d / kMetadata).string();
    auto need = [&](const nlohmann::json& o, const char* key, bool integer, const std::string& at) {
      TITAN_CHECK(o.is_object() && o.contains(key), where, ": field '", at, ".", key, "' is missing");
      const auto& v = o[key];
      TITAN_CHECK(integer ? v.is_number_integer() && v.get<int64_t>() >= 0 : v.is_string(), where,
                  ": field '", at, ".", key, "' must be ", integer ? "a non-negative integer" : "a string",
                  ", got ", v.dump());
    };
    for (auto& [name, numel] : meta_["tensors"].items())
      TITAN_CHECK(numel.is_number_integer() && numel.get<int64_t>() >= 0, where, ": field 'tensors.", name,
                  "' must be a non-negative integer, got ", numel.dump());
    const auto& files = meta_["files"];
    for (size_t f = 0; f < files.size(); ++f) {
      const std::string at = str_cat("files[", f, "]");
      need(files[f], "file", false, at);
      need(files[f], "bytes", true, at);
      need(files[f], "xxh3", false, at);
      TITAN_CHECK(files[f].contains("slices") && files[f]["slices"].is_array(), where, ": field '", at,
                  ".slices' must be a list");
      const auto& slices = files[f]["slices"];
      for (size_t i = 0; i < slices.size(); ++i) {
        const std::string sat = str_cat(at, ".slices[", i, "]");
        need(slices[i], "name", false, sat);
        need(slices[i], "offset", true, sat);
        need(slices[i], "count", true, sat);
      }
    }
  } catch (const nlohmann::json::exception& e) {
    fail("checkpoint ", dir, ": malformed ", kMetadata, " or ", kMarker, " (", e.what(), ")");
  }
}

int64_t Reader::tensor_numel(const std::string& name) const {
  TITAN_CHECK(has_tensor(name), "checkpoint ", dir_, ": has no tensor '", name, "'");
  return meta_.at("tensors").at(name).get<int64_t>();
}

void Reader::read(std::vector<Slice>& wanted, bool log) const {
  const double t0 = now_s();
  const fs::path d(dir_);
  struct Piece {
    size_t want;       // index into wanted
    size_t file;       // index into meta files
    std::string key;   // the slice's entry in that file
    int64_t src_elem;  // element offset inside the file's tensor
    int64_t dst_elem;  // element offset inside the wanted slice
    int64_t count;
  };
  const nlohmann::json& files = meta_.at("files");
  std::vector<Piece> pieces;
  std::map<size_t, bool> needed_files;
  int64_t total_bytes = 0;
  for (size_t w = 0; w < wanted.size(); ++w) {
    const Slice& s = wanted[w];
    const int64_t numel = tensor_numel(s.name);
    TITAN_CHECK(numel == s.numel, "checkpoint ", dir_, ": tensor '", s.name, "' has ", numel,
                " elements, this run expects ", s.numel, " (a checkpoint of another model config?)");
    const int64_t lo = s.offset, hi = s.offset + s.data.numel();
    TITAN_CHECK(lo >= 0 && hi <= numel, "checkpoint: requested [", lo, ", ", hi, ") of '", s.name, "' (",
                numel, " elements)");
    std::vector<std::pair<int64_t, int64_t>> covered;
    for (size_t f = 0; f < files.size(); ++f) {
      for (auto& fs_slice : files[f].at("slices")) {
        if (fs_slice.at("name") != s.name) continue;
        const int64_t off = fs_slice.at("offset"), cnt = fs_slice.at("count");
        const int64_t a = std::max(lo, off), b = std::min(hi, off + cnt);
        if (a >= b) continue;
        pieces.push_back(Piece{w, f, entry_key(s.name, off), a - off, a - lo, b - a});
        covered.emplace_back(a, b);
        needed_files[f] = true;
      }
    }
    std::sort(covered.begin(), covered.end());
    int64_t reached = lo;
    for (auto& [a, b] : covered) {
      TITAN_CHECK(a <= reached, "checkpoint ", dir_, ": elements [", reached, ", ", a, ") of '", s.name,
                  "' are in no shard file");
      reached = std::max(reached, b);
    }
    TITAN_CHECK(reached >= hi, "checkpoint ", dir_, ": elements [", reached, ", ", hi, ") of '", s.name,
                "' are in no shard file");
    total_bytes += s.data.numel() * 4;
  }

  // Verify every needed file before copying anything.
  std::map<size_t, std::unique_ptr<SafetensorsFile>> open;
  for (auto& [f, _] : needed_files) {
    const nlohmann::json& rec = files[f];
    const std::string path = (d / rec.at("file").get<std::string>()).string();
    TITAN_CHECK(fs::exists(path), "checkpoint ", dir_, ": shard file ", rec.at("file").get<std::string>(),
                " is missing");
    const int64_t size = static_cast<int64_t>(fs::file_size(path));
    TITAN_CHECK(size == rec.at("bytes").get<int64_t>(), path, ": ", size, " bytes, metadata.json records ",
                rec.at("bytes").get<int64_t>(), " (truncated or replaced)");
    TITAN_CHECK(file_checksum(path) == rec.at("xxh3").get<std::string>(), path,
                ": checksum mismatch (file corrupted)");
    auto file = std::make_unique<SafetensorsFile>(path);
    for (auto& sl : rec.at("slices")) {
      const std::string n = entry_key(sl.at("name"), sl.at("offset"));
      TITAN_CHECK(file->contains(n), path, ": tensor '", n, "' listed in metadata.json is missing");
      const auto& e = file->entry(n);
      TITAN_CHECK(
          e.dtype == "F32" && e.end - e.begin == static_cast<size_t>(sl.at("count").get<int64_t>()) * 4, path,
          ": tensor '", n, "' is not ", sl.at("count").get<int64_t>(), " f32 elements");
    }
    open[f] = std::move(file);
  }

  Progress progress(log, "loading " + d.filename().string(), total_bytes);
  for (auto& p : pieces) {
    const SafetensorsFile& file = *open.at(p.file);
    const auto& e = file.entry(p.key);
    wanted[p.want].data.view_at(p.dst_elem, {p.count}).copy_from_host(file.bytes(e) + p.src_elem * 4);
    progress.add(p.count * 4);
  }
  const double dt = now_s() - t0;
  if (log) {
    std::printf("checkpoint: loaded %s (%.3f GiB on this rank) in %.2f s (%.2f GB/s)\n", dir_.c_str(),
                total_bytes / 1073741824.0, dt, dt > 0 ? total_bytes / dt / 1e9 : 0.0);
    std::fflush(stdout);
  }
}

}  // namespace titan::ckpt
