#include "train/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace titan::tb {

namespace {

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[i] = c;
    }
    return t;
  }();
  return table;
}

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

template <class T>
void put_fixed(std::string& out, T v) {  // little-endian, as protocol buffers and TFRecord store them
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

// Field `field` of wire type 2 (length-delimited).
void put_bytes(std::string& out, int field, std::string_view bytes) {
  put_varint(out, (uint64_t(field) << 3) | 2);
  put_varint(out, bytes.size());
  out.append(bytes);
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto& t = crc_table();
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = t[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t crc = crc32c(data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord(std::string_view payload) {
  std::string out;
  const uint64_t len = payload.size();
  put_fixed(out, len);
  put_fixed(out, masked_crc32c(out.data(), 8));
  out.append(payload);
  put_fixed(out, masked_crc32c(payload.data(), payload.size()));
  return out;
}

std::string scalar_event(double wall_time, int64_t step,
                         const std::vector<std::pair<std::string, float>>& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes(v, 1, tag);
    put_varint(v, (2u << 3) | 5);  // simple_value: fixed32
    put_fixed(v, value);
    put_bytes(summary, 1, v);
  }
  std::string event;
  put_varint(event, (1u << 3) | 1);  // wall_time: fixed64
  put_fixed(event, wall_time);
  put_varint(event, 2u << 3);  // step: varint
  put_varint(event, static_cast<uint64_t>(step));
  put_bytes(event, 5, summary);
  return event;
}

std::string version_event(double wall_time) {
  std::string event;
  put_varint(event, (1u << 3) | 1);
  put_fixed(event, wall_time);
  put_bytes(event, 3, "brain.Event:2");
  return event;
}

EventWriter::EventWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TITAN_CHECK(!ec, dir, ": cannot create the TensorBoard folder (", ec.message(), ")");
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  const double t = now_seconds();
  path_ = (std::filesystem::path(dir) / ("events.out.tfevents." + std::to_string(static_cast<int64_t>(t)) +
                                         "." + host + "." + std::to_string(getpid()) + ".0"))
              .string();
  f_ = std::fopen(path_.c_str(), "wb");
  TITAN_CHECK(f_, path_, ": cannot open for writing (", std::strerror(errno), ")");
  const std::string rec = tfrecord(version_event(t));
  TITAN_CHECK(std::fwrite(rec.data(), 1, rec.size(), f_) == rec.size() && std::fflush(f_) == 0, path_,
              ": write failed (", std::strerror(errno), ")");
}

EventWriter::~EventWriter() {
  if (f_) std::fclose(f_);
}

void EventWriter::add_scalars(int64_t step, const std::vector<std::pair<std::string, float>>& scalars) {
  const std::string rec = tfrecord(scalar_event(now_seconds(), step, scalars));
  // Flushed per step so that TensorBoard follows a running job.
  TITAN_CHECK(std::fwrite(rec.data(), 1, rec.size(), f_) == rec.size() && std::fflush(f_) == 0, path_,
              ": write failed (", std::strerror(errno), ")");
}

}  // namespace titan::tb
