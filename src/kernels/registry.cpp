#include "kernels/registry.h"

#include <algorithm>

namespace titan {

namespace {
// Only CPU implementations depend on the instruction set; other devices' variants are all kBaseline.
bool can_run(DeviceType device, CpuIsa isa) {
  return device != DeviceType::CPU || cpu_isa_supported(isa);
}

// The highest variant of `e` this device runs (variants are ascending), or nullptr.
const KernelVariant* best_variant(const KernelEntry* e, DeviceType device) {
  if (e)
    for (auto v = e->variants.rbegin(); v != e->variants.rend(); ++v)
      if (can_run(device, v->isa)) return &*v;
  return nullptr;
}
}  // namespace

KernelRegistry& KernelRegistry::global() {
  static KernelRegistry registry;
  return registry;
}

void KernelRegistry::add(std::string_view op, DeviceType device, std::string_view impl, const void* table,
                         int priority, CpuIsa isa) {
  auto& impls = table_[std::string(op)][static_cast<int>(device)];
  auto [it, inserted] = impls.try_emplace(std::string(impl), KernelEntry{{}, priority});
  KernelEntry& e = it->second;
  for (auto& v : e.variants)
    TITAN_CHECK(v.isa != isa, "kernel '", op, "' implementation '", impl, "' (", cpu_isa_name(isa),
                ") registered twice on ", device_type_name(device));
  TITAN_CHECK(inserted || e.priority == priority, "kernel '", op, "' implementation '", impl,
              "': variants registered with different priorities");
  e.variants.push_back(KernelVariant{table, isa});
  std::sort(e.variants.begin(), e.variants.end(),
            [](const KernelVariant& a, const KernelVariant& b) { return a.isa < b.isa; });
}

const KernelEntry* KernelRegistry::entry(std::string_view op, DeviceType device,
                                         std::string_view impl) const {
  auto o = table_.find(op);
  if (o == table_.end()) return nullptr;
  auto d = o->second.find(static_cast<int>(device));
  if (d == o->second.end()) return nullptr;
  auto i = d->second.find(impl);
  return i == d->second.end() ? nullptr : &i->second;
}

const void* KernelRegistry::find(std::string_view op, DeviceType device, std::string_view impl) const {
  const KernelVariant* v = best_variant(entry(op, device, impl), device);
  return v ? v->table : nullptr;
}

const void* KernelRegistry::find_variant(std::string_view op, DeviceType device, std::string_view impl,
                                         CpuIsa isa) const {
  const KernelEntry* e = entry(op, device, impl);
  if (!e) return nullptr;
  for (auto& v : e->variants)
    if (v.isa == isa) return v.table;
  return nullptr;
}

std::vector<CpuIsa> KernelRegistry::variants(std::string_view op, DeviceType device,
                                             std::string_view impl) const {
  std::vector<CpuIsa> out;
  if (const KernelEntry* e = entry(op, device, impl))
    for (auto& v : e->variants) out.push_back(v.isa);
  return out;
}

bool KernelRegistry::runnable(std::string_view op, DeviceType device, std::string_view impl) const {
  return find(op, device, impl) != nullptr;
}

CpuIsa KernelRegistry::running_isa(std::string_view op, DeviceType device, std::string_view impl) const {
  const KernelVariant* v = best_variant(entry(op, device, impl), device);
  return v ? v->isa : CpuIsa::kBaseline;
}

std::string KernelRegistry::why_not_runnable(std::string_view op, DeviceType device,
                                             std::string_view impl) const {
  const KernelEntry* e = entry(op, device, impl);
  if (!e || e->variants.empty() || runnable(op, device, impl)) return "";
  return str_cat("needs ", cpu_isa_missing(e->variants.front().isa));
}

std::string KernelRegistry::default_impl(std::string_view op, DeviceType device) const {
  auto o = table_.find(op);
  TITAN_CHECK(o != table_.end(), "unknown kernel op '", op, "'");
  auto d = o->second.find(static_cast<int>(device));
  TITAN_CHECK(d != o->second.end() && !d->second.empty(), "kernel op '", op, "' has no implementation on ",
              device_type_name(device));
  // Ranked by (no reason against it here, priority).
  const std::string* best = nullptr;
  std::pair<bool, int> best_rank;
  for (auto& [name, e] : d->second) {
    if (!runnable(op, device, name)) continue;
    const std::pair<bool, int> rank{why_not_default(op, device, name).empty(), e.priority};
    if (!best || rank > best_rank) best = &name, best_rank = rank;
  }
  TITAN_CHECK(best, "kernel op '", op, "' has no implementation that runs on this CPU");
  return *best;
}

namespace {
std::string condition_key(std::string_view op, DeviceType device, std::string_view impl) {
  return str_cat(op, "/", device_type_name(device), "/", impl);
}
}  // namespace

void KernelRegistry::set_default_condition(std::string_view op, DeviceType device, std::string_view impl,
                                           std::string (*why_not)()) {
  default_conditions_[condition_key(op, device, impl)] = why_not;
}

std::string KernelRegistry::why_not_default(std::string_view op, DeviceType device,
                                            std::string_view impl) const {
  auto it = default_conditions_.find(condition_key(op, device, impl));
  return it == default_conditions_.end() ? "" : it->second();
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
