#include "device/device.h"

#include "core/error.h"

namespace titan {

namespace {
DeviceInterface*& slot(DeviceType t) {
  static DeviceInterface* table[kNumDeviceTypes] = {};
  return table[static_cast<int>(t)];
}
}  // namespace

const char* device_type_name(DeviceType t) {
  switch (t) {
    case DeviceType::CPU:
      return "cpu";
    case DeviceType::CUDA:
      return "cuda";
    case DeviceType::GUARD:
      return "guard";
  }
  return "?";
}

std::string Device::str() const {
  return type == DeviceType::CPU ? "cpu" : str_cat(device_type_name(type), ":", index);
}

void AllocatorStats::on_alloc(size_t n) {
  int64_t now = current.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
  num_allocs.fetch_add(1);
  int64_t p = peak.load();
  while (now > p && !peak.compare_exchange_weak(p, now)) {
  }
}

void AllocatorStats::on_free(size_t n) {
  current.fetch_sub(static_cast<int64_t>(n));
}

Device parse_device(std::string_view name, std::string_view what) {
  if (name == "cpu") return Device::cpu();
  if (name == "cuda") return Device{DeviceType::CUDA, 0};
  if (name == "guard") return Device{DeviceType::GUARD, 0};
  if (name.starts_with("cuda:") && name.size() > 5 && name.size() < 9) {
    int index = 0;
    for (char ch : name.substr(5)) {
      TITAN_CHECK(ch >= '0' && ch <= '9', what, " = '", name, "': expected cpu, cuda, cuda:N or guard");
      index = index * 10 + (ch - '0');
    }
    return Device{DeviceType::CUDA, index};
  }
  fail(what, " = '", name, "': expected cpu, cuda, cuda:N or guard");
}

void register_device(DeviceType type, DeviceInterface* iface) {
  TITAN_CHECK(iface->version == DeviceInterface::kVersion, "device '", iface->name,
              "' was built for device interface v", iface->version, ", core is v", DeviceInterface::kVersion);
  slot(type) = iface;
}

bool device_available(DeviceType type) {
  return slot(type) != nullptr;
}

DeviceInterface& device_interface(DeviceType type) {
  DeviceInterface* d = slot(type);
  TITAN_CHECK(d != nullptr, "device '", device_type_name(type), "' is not available in this build");
  return *d;
}

}  // namespace titan
