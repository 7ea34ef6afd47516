#include "kernels/registry.h"

namespace titan {

KernelRegistry& KernelRegistry::global() {
  static KernelRegistry registry;
  return registry;
}

void KernelRegistry::add(std::string_view op, DeviceType device, std::string_view impl, const void* table,
                         int priority) {
  auto& impls = table_[std::string(op)][static_cast<int>(device)];
  TITAN_CHECK(!impls.count(std::string(impl)), "kernel '", op, "' implementation '", impl,
              "' registered twice on ", device_type_name(device));
  impls[std::string(impl)] = KernelEntry{table, priority};
}

const void* KernelRegistry::find(std::string_view op, DeviceType device, std::string_view impl) const {
  auto o = table_.find(op);
  if (o == table_.end()) return nullptr;
  auto d = o->second.find(static_cast<int>(device));
  if (d == o->second.end()) return nullptr;
  auto i = d->second.find(std::string(impl));
  return i == d->second.end() ? nullptr : i->second.table;
}

std::string KernelRegistry::default_impl(std::string_view op, DeviceType device) const {
  auto o = table_.find(op);
  TITAN_CHECK(o != table_.end(), "unknown kernel op '", op, "'");
  auto d = o->second.find(static_cast<int>(device));
  TITAN_CHECK(d != o->second.end() && !d->second.empty(), "kernel op '", op, "' has no implementation on ",
              device_type_name(device));
  const std::string* best = nullptr;
  int best_priority = 0;
  for (auto& [name, e] : d->second)
    if (!best || e.priority > best_priority) best = &name, best_priority = e.priority;
  return *best;
}

std::vector<std::string> KernelRegistry::ops() const {
  std::vector<std::string> out;
  for (auto& [name, _] : table_) out.push_back(name);
  return out;
}

std::vector<std::string> KernelRegistry::impls(std::string_view op, DeviceType device) const {
  std::vector<std::string> out;
  auto o = table_.find(op);
  if (o == table_.end()) return out;
  auto d = o->second.find(static_cast<int>(device));
  if (d == o->second.end()) return out;
  for (auto& [name, _] : d->second) out.push_back(name);
  return out;
}

}  // namespace titan
