#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/json_file.h"

namespace titan {

namespace {

size_t stored_dtype_size(const std::string& dtype) {
  static const std::map<std::string, size_t> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4}, {"I16", 2},
      {"I8", 1},  {"U8", 1},  {"U16", 2}, {"U32", 4},  {"U64", 8}, {"BOOL", 1}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY);
  TITAN_CHECK(fd_ >= 0, path, ": cannot open (", std::strerror(errno), ")");
  struct stat st {};
  if (fstat(fd_, &st) != 0) {
    ::close(fd_);
    fail(path, ": cannot stat (", std::strerror(errno), ")");
  }
  size_ = static_cast<size_t>(st.st_size);
  try {
    TITAN_CHECK(size_ >= 8, path, ": truncated safetensors file (", size_, " bytes, need at least 8)");
    map_ = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0);
    TITAN_CHECK(map_ != MAP_FAILED, path, ": mmap failed (", std::strerror(errno), ")");
    const uint8_t* base = static_cast<const uint8_t*>(map_);
    uint64_t header_len = 0;
    std::memcpy(&header_len, base, 8);  // little-endian host assumed (x86-64, aarch64)
    TITAN_CHECK(header_len <= size_ - 8, path, ": header length ", header_len,
                " runs past the end of the file (", size_, " bytes)");
    data_ = base + 8 + header_len;
    const size_t data_size = size_ - 8 - header_len;

    const nlohmann::json header =
        parse_json(std::string_view(reinterpret_cast<const char*>(base + 8), header_len), path + ": header");
    TITAN_CHECK(header.is_object(), path, ": header is not a JSON object");

    std::vector<std::pair<size_t, size_t>> ranges;
    for (auto& [name, info] : header.items()) {
      if (name == "__metadata__") {
        TITAN_CHECK(info.is_object(), path, ": __metadata__ is not an object");
        for (auto& [k, v] : info.items()) metadata_[k] = v.is_string() ? v.get<std::string>() : v.dump();
        continue;
      }
      TITAN_CHECK(info.is_object() && info.contains("dtype") && info.contains("shape") &&
                      info.contains("data_offsets"),
                  path, ": tensor '", name, "' needs dtype, shape and data_offsets");
      SafetensorsEntry e;
      TITAN_CHECK(info["dtype"].is_string(), path, ": tensor '", name, "': dtype is not a string");
      e.dtype = info["dtype"].get<std::string>();
      size_t esize = stored_dtype_size(e.dtype);
      TITAN_CHECK(esize > 0, path, ": tensor '", name, "': unknown dtype '", e.dtype, "'");
      TITAN_CHECK(info["shape"].is_array(), path, ": tensor '", name, "': shape is not an array");
      for (auto& d : info["shape"]) {
        TITAN_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0, path, ": tensor '", name, "': bad shape ",
                    info["shape"].dump());
        e.shape.push_back(d.get<int64_t>());
      }
      auto& off = info["data_offsets"];
      TITAN_CHECK(
          off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
          path, ": tensor '", name, "': data_offsets must be two non-negative integers");
      e.begin = off[0].get<size_t>();
      e.end = off[1].get<size_t>();
      TITAN_CHECK(e.begin <= e.end && e.end <= data_size, path, ": tensor '", name, "': data_offsets [",
                  e.begin, ", ", e.end, ") out of range (data section is ", data_size, " bytes)");
      TITAN_CHECK(e.end - e.begin == static_cast<size_t>(shape_numel(e.shape)) * esize, path, ": tensor '",
                  name, "': ", e.end - e.begin, " bytes do not match shape ", shape_str(e.shape), " of ",
                  e.dtype);
      ranges.emplace_back(e.begin, e.end);
      entries_[name] = std::move(e);
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; i < ranges.size(); ++i)
      if (ranges[i].first < ranges[i - 1].second) {
        std::string a, b;
        for (auto& [n, e] : entries_) {
          if (e.begin == ranges[i - 1].first && e.end == ranges[i - 1].second && a.empty())
            a = n;
          else if (e.begin == ranges[i].first && e.end == ranges[i].second)
            b = n;
        }
        fail(path, ": tensors '", a, "' and '", b, "' overlap in the data section");
      }
  } catch (...) {
    if (map_ && map_ != MAP_FAILED) munmap(map_, size_);
    ::close(fd_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ && map_ != MAP_FAILED) munmap(map_, size_);
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  TITAN_CHECK(it != entries_.end(), path_, ": no tensor '", name, "'");
  return it->second;
}

Tensor SafetensorsFile::load(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  DType dt;
  if (e.dtype == "F32" || e.dtype == "F16")
    dt = DType::F32;
  else if (e.dtype == "BF16")
    dt = DType::BF16;
  else if (e.dtype == "I32")
    dt = DType::I32;
  else
    fail(path_, ": tensor '", name, "': dtype ", e.dtype, " cannot be loaded");
  Tensor t = Tensor::empty(e.shape, dt);
  read_into(name, t);
  return t;
}

void SafetensorsFile::read_into(const std::string& name, Tensor& dst) const {
  const SafetensorsEntry& e = entry(name);
  TITAN_CHECK(e.shape == dst.shape(), path_, ": tensor '", name, "' has shape ", shape_str(e.shape),
              ", expected ", shape_str(dst.shape()));
  const uint8_t* src = bytes(e);
  const int64_t n = dst.numel();
  if (e.dtype == dtype_safetensors(dst.dtype())) {
    std::memcpy(dst.raw(), src, dst.nbytes());
  } else if (dst.dtype() == DType::F32 && e.dtype == "BF16") {
    float* d = dst.data<float>();
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
  } else if (dst.dtype() == DType::F32 && e.dtype == "F16") {
    float* d = dst.data<float>();
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) d[i] = f16_to_f32(s[i]);
  } else if (dst.dtype() == DType::BF16 && e.dtype == "F32") {
    uint16_t* d = dst.data<uint16_t>();
    const float* s = reinterpret_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(s[i]);
  } else {
    fail(path_, ": tensor '", name, "': cannot convert ", e.dtype, " to ", dtype_name(dst.dtype()));
  }
  // The tensor's file pages leave this process's memory (they stay in the page cache): loading a model
  // does not hold the whole file mapped besides the weights. Pages shared with a neighbour fault back in.
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t lo = reinterpret_cast<uintptr_t>(src) & ~(page - 1);
  const uintptr_t hi = reinterpret_cast<uintptr_t>(src) + (e.end - e.begin);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

void atomic_rename(const std::string& tmp_path, const std::string& path) {
  int fd = ::open(tmp_path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  if (std::rename(tmp_path.c_str(), path.c_str()) != 0) {
    int err = errno;
    std::remove(tmp_path.c_str());
    fail(path, ": cannot rename temporary file into place (", std::strerror(err), ")");
  }
}

void fsync_directory(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  TITAN_CHECK(fd >= 0, dir, ": cannot open directory to sync (", std::strerror(errno), ")");
  const int rc = ::fsync(fd);
  ::close(fd);
  TITAN_CHECK(rc == 0, dir, ": fsync failed (", std::strerror(errno), ")");
}

namespace {

// Streams a file out: large writes, the kernel's write-back started after every chunk and waited for
// one chunk later, then the written pages dropped from the page cache. Under memory pressure (a trainer
// holding its model) plain buffered writes are throttled to a fraction of the disk's rate; this keeps
// the dirty set to two chunks and runs at the device's speed. The XXH3-64 of every byte is computed
// on the way.
class StreamWriter {
 public:
  static constexpr size_t kChunk = size_t(16) << 20;

  explicit StreamWriter(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    TITAN_CHECK(fd_ >= 0, path, ": cannot open for writing (", std::strerror(errno), ")");
    state_ = XXH3_createState();
    XXH3_64bits_reset(state_);
  }
  ~StreamWriter() {
    if (fd_ >= 0) ::close(fd_);
    XXH3_freeState(state_);
  }
  // Appends n bytes; false (errno set) on failure.
  bool write(const void* data, size_t n) {
    XXH3_64bits_update(state_, data, n);
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        return false;
      }
      p += w;
      n -= static_cast<size_t>(w);
      offset_ += static_cast<uint64_t>(w);
    }
    if (offset_ - started_ >= kChunk) {
      // Start write-back of [started_, offset_); wait for the previous range and drop it.
      ::sync_file_range(fd_, static_cast<off_t>(started_), static_cast<off_t>(offset_ - started_),
                        SYNC_FILE_RANGE_WRITE);
      if (started_ > dropped_) {
        ::sync_file_range(fd_, static_cast<off_t>(dropped_), static_cast<off_t>(started_ - dropped_),
                          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
        ::posix_fadvise(fd_, static_cast<off_t>(dropped_), static_cast<off_t>(started_ - dropped_),
                        POSIX_FADV_DONTNEED);
        dropped_ = started_;
      }
      started_ = offset_;
    }
    return true;
  }
  // fsync and close; false (errno set) on failure.
  bool finish() {
    const bool ok = ::fsync(fd_) == 0;
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    errno = err;
    return ok;
  }
  uint64_t checksum() const { return XXH3_64bits_digest(state_); }

 private:
  std::string path_;
  int fd_ = -1;
  XXH3_state_t* state_ = nullptr;
  uint64_t offset_ = 0, started_ = 0, dropped_ = 0;
};

}  // namespace

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  save_safetensors(path, tensors, metadata, SafetensorsWriteOptions{});
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata,
                      const SafetensorsWriteOptions& options) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (auto& [name, t] : tensors) {
    TITAN_CHECK(!header.contains(name), path, ": duplicate tensor name '", name, "'");
    header[name] = {{"dtype", dtype_safetensors(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // align the data section to 8 bytes
  const uint64_t header_len = json.size();

  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  bool ok = false;
  {
    StreamWriter w(tmp);
    ok = w.write(&header_len, 8) && w.write(json.data(), json.size());
    for (auto& [name, t] : tensors) {
      const char* p = static_cast<const char*>(t.raw());
      for (size_t done = 0; ok && done < t.nbytes(); done += StreamWriter::kChunk) {
        const size_t n = std::min(StreamWriter::kChunk, t.nbytes() - done);
        ok = w.write(p + done, n);
        if (ok && options.on_bytes) options.on_bytes(n);
      }
    }
    ok = ok && w.finish();
    if (ok && options.checksum) *options.checksum = w.checksum();
  }
  if (!ok) {
    const int err = errno;
    std::remove(tmp.c_str());
    fail(path, ": write failed (", std::strerror(err), ")");
  }
  atomic_rename(tmp, path);
}

}  // namespace titan
