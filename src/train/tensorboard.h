// TensorBoard event files (`metrics.enable_tensorboard`, torchtitan's key): the scalars of each step in the
// format TensorBoard reads -- a TFRecord stream (length, masked CRC32C of the length, the record, masked
// CRC32C of the record) of `Event` protocol buffers: first the file version, then one Event per step holding
// a Summary of simple_value scalars. The protocol-buffer fields used (tensorflow/core/util/event.proto,
// summary.proto): Event.wall_time = 1 (double), step = 2 (int64), file_version = 3 (string), summary = 5;
// Summary.value = 1 (repeated); Summary.Value.tag = 1 (string), simple_value = 2 (float).
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace titan::tb {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), continuing from `crc` (0 to start).
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
// The masked form TFRecord stores: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t n);
// One TFRecord: uint64 length, masked CRC of those 8 bytes, the payload, masked CRC of the payload.
std::string tfrecord(std::string_view payload);

// An Event protocol buffer holding scalars (tag, value) at `step`.
std::string scalar_event(double wall_time, int64_t step,
                         const std::vector<std::pair<std::string, float>>& scalars);
// The first Event of a file: its version ("brain.Event:2").
std::string version_event(double wall_time);

class EventWriter {
 public:
  // Creates `dir` and events.out.tfevents.<seconds>.<host>.<pid>.0 in it; errors name the path.
  explicit EventWriter(const std::string& dir);
  ~EventWriter();
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;

  void add_scalars(int64_t step, const std::vector<std::pair<std::string, float>>& scalars);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  FILE* f_ = nullptr;
};

}  // namespace titan::tb
