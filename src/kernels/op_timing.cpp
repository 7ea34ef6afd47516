#include "kernels/op_timing.h"

#include <chrono>
#include <type_traits>

#include "core/error.h"

namespace titan {

const char* op_class_name(OpClass c) {
  switch (c) {
    case OpClass::kGemm:
      return "gemm";
    case OpClass::kAttentionForward:
      return "attention_forward";
    case OpClass::kAttentionBackward:
      return "attention_backward";
    case OpClass::kPointwise:
      return "pointwise";
    case OpClass::kHead:
      return "head";
    case OpClass::kCount:
      break;
  }
  return "?";
}

namespace {

OpTiming*& current_timing() {
  static OpTiming* t = nullptr;
  return t;
}

double host_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

OpTiming::OpTiming(DeviceType device) : dev_(device_interface(device)) {}

OpTiming::~OpTiming() {
  collect();
  if (current_timing() == this) current_timing() = nullptr;
}

OpTiming* OpTiming::current() {
  return current_timing();
}

void OpTiming::make_current() {
  current_timing() = this;
}

void OpTiming::begin(OpClass c) {
  TITAN_CHECK(!open_, "op timing: an op began inside another (a timed op calling a timed op)");
  open_ = true;
  ++calls_[static_cast<int>(c)];
  if (dev_.mark) {
    spans_.push_back({c, dev_.mark(), nullptr, 0});
  } else {
    spans_.push_back({c, nullptr, nullptr, 0});
    begun_ms_ = host_ms();
  }
}

void OpTiming::end() {
  open_ = false;
  Span& s = spans_.back();
  if (dev_.mark)
    s.to = dev_.mark();
  else
    s.host_ms = host_ms() - begun_ms_;
}

std::array<double, static_cast<int>(OpClass::kCount)> OpTiming::collect() {
  std::array<double, static_cast<int>(OpClass::kCount)> ms{};
  for (Span& s : spans_) {
    ms[static_cast<int>(s.cls)] += s.from ? dev_.elapsed_ms(s.from, s.to) : s.host_ms;
    if (s.from) dev_.release_mark(s.from), dev_.release_mark(s.to);
  }
  spans_.clear();
  return ms;
}

namespace {

// Timed<K, Member, Slot>::call runs `target`'s Member between two marks of the current timing, as `cls`.
template <class K, auto Member, int Slot, class Fn>
struct Timed;
template <class K, auto Member, int Slot, class R, class... A>
struct Timed<K, Member, Slot, R (*)(A...)> {
  static inline K target{};
  static inline OpClass cls = OpClass::kPointwise;
  static R call(A... a) {
    OpTiming* t = OpTiming::current();
    if (!t) return (target.*Member)(a...);
    struct Scope {
      OpTiming* t;
      ~Scope() { t->end(); }
    } scope{t};
    t->begin(cls);
    return (target.*Member)(a...);
  }
};

// The timed function of K::m for a copy of `k`, reporting as `c`.
template <int Slot, class K, auto Member>
auto timed_fn(const K& k, OpClass c) {
  using T = Timed<K, Member, Slot, std::remove_cvref_t<decltype(k.*Member)>>;
  T::target = k;
  T::cls = c;
  return k.*Member ? &T::call : nullptr;  // (a table's optional function stays null)
}
#define TITAN_TIMED(slot, K, m, c) timed_fn<slot, K, &K::m>(*k, OpClass::c)

template <class K>
const K* store(const K& table, int slot) {
  static K tables[2];
  tables[slot] = table;
  return &tables[slot];
}

}  // namespace

const MatmulKernels* timed(const MatmulKernels* k) {
  return store(MatmulKernels{TITAN_TIMED(0, MatmulKernels, forward, kGemm),
                             TITAN_TIMED(0, MatmulKernels, backward, kGemm)},
               0);
}
const MatmulBf16Kernels* timed(const MatmulBf16Kernels* k) {
  return store(MatmulBf16Kernels{TITAN_TIMED(0, MatmulBf16Kernels, forward, kGemm),
                                 TITAN_TIMED(0, MatmulBf16Kernels, backward, kGemm),
                                 TITAN_TIMED(0, MatmulBf16Kernels, forward_bf16_input, kGemm),
                                 TITAN_TIMED(0, MatmulBf16Kernels, backward_bf16_input, kGemm),
                                 TITAN_TIMED(0, MatmulBf16Kernels, forward_bf16_output, kGemm),
                                 TITAN_TIMED(0, MatmulBf16Kernels, forward_bf16_io, kGemm),
                                 TITAN_TIMED(0, MatmulBf16Kernels, backward_bf16_io, kGemm)},
               0);
}
const RmsNormKernels* timed(const RmsNormKernels* k) {
  return store(RmsNormKernels{TITAN_TIMED(0, RmsNormKernels, forward, kPointwise),
                              TITAN_TIMED(0, RmsNormKernels, backward, kPointwise),
                              TITAN_TIMED(0, RmsNormKernels, forward_bf16_output, kPointwise),
                              TITAN_TIMED(0, RmsNormKernels, forward_bf16_input, kPointwise),
                              TITAN_TIMED(0, RmsNormKernels, backward_bf16_input, kPointwise),
                              TITAN_TIMED(0, RmsNormKernels, forward_bf16_io, kPointwise)},
               0);
}
const RopeKernels* timed(const RopeKernels* k) {
  return store(RopeKernels{TITAN_TIMED(0, RopeKernels, forward, kPointwise),
                           TITAN_TIMED(0, RopeKernels, backward, kPointwise)},
               0);
}
const RopeQKKernels* timed(const RopeQKKernels* k) {
  return store(RopeQKKernels{TITAN_TIMED(0, RopeQKKernels, forward, kPointwise),
                             TITAN_TIMED(0, RopeQKKernels, backward, kPointwise)},
               0);
}
const QKNormRopeKernels* timed(const QKNormRopeKernels* k) {
  return store(QKNormRopeKernels{TITAN_TIMED(0, QKNormRopeKernels, forward, kPointwise),
                                 TITAN_TIMED(0, QKNormRopeKernels, backward, kPointwise)},
               0);
}
const AttentionKernels* timed(const AttentionKernels* k) {
  return store(
      AttentionKernels{TITAN_TIMED(0, AttentionKernels, forward, kAttentionForward),
                       TITAN_TIMED(0, AttentionKernels, backward, kAttentionBackward), k->saved_floats},
      0);
}
const AttentionBf16Kernels* timed(const AttentionBf16Kernels* k) {
  return store(AttentionBf16Kernels{TITAN_TIMED(0, AttentionBf16Kernels, forward, kAttentionForward),
                                    TITAN_TIMED(0, AttentionBf16Kernels, backward, kAttentionBackward)},
               0);
}
const SwigluKernels* timed(const SwigluKernels* k) {
  return store(SwigluKernels{TITAN_TIMED(0, SwigluKernels, forward, kPointwise),
                             TITAN_TIMED(0, SwigluKernels, backward, kPointwise),
                             TITAN_TIMED(0, SwigluKernels, forward_bf16, kPointwise),
                             TITAN_TIMED(0, SwigluKernels, backward_bf16, kPointwise),
                             TITAN_TIMED(0, SwigluKernels, backward_bf16_output, kPointwise)},
               0);
}
const EmbeddingKernels* timed(const EmbeddingKernels* k) {
  return store(EmbeddingKernels{TITAN_TIMED(0, EmbeddingKernels, forward, kHead),
                                TITAN_TIMED(0, EmbeddingKernels, backward, kHead)},
               0);
}
const CrossEntropyKernels* timed(const CrossEntropyKernels* k) {
  return store(CrossEntropyKernels{TITAN_TIMED(0, CrossEntropyKernels, forward_backward, kHead),
                                   TITAN_TIMED(0, CrossEntropyKernels, forward_backward_device, kHead)},
               0);
}
const ElementwiseKernels* timed(const ElementwiseKernels* k) {
  return store(ElementwiseKernels{TITAN_TIMED(0, ElementwiseKernels, add, kPointwise),
                                  TITAN_TIMED(0, ElementwiseKernels, round_bf16, kPointwise),
                                  TITAN_TIMED(0, ElementwiseKernels, to_bf16, kPointwise),
                                  TITAN_TIMED(0, ElementwiseKernels, from_bf16, kPointwise),
                                  TITAN_TIMED(0, ElementwiseKernels, fill, kPointwise),
                                  TITAN_TIMED(0, ElementwiseKernels, scale, kPointwise),
                                  TITAN_TIMED(0, ElementwiseKernels, add_to_bf16, kPointwise)},
               0);
}
const MoeExpertsKernels* timed(const MoeExpertsKernels* k, int slot) {
  TITAN_CHECK(slot == 0 || slot == 1, "timed: moe_experts slot ", slot);
  if (slot == 0)
    return store(MoeExpertsKernels{TITAN_TIMED(0, MoeExpertsKernels, forward, kGemm),
                                   TITAN_TIMED(0, MoeExpertsKernels, backward, kGemm)},
                 0);
  return store(MoeExpertsKernels{TITAN_TIMED(1, MoeExpertsKernels, forward, kGemm),
                                 TITAN_TIMED(1, MoeExpertsKernels, backward, kGemm)},
               1);
}
const MoeRouterKernels* timed(const MoeRouterKernels* k) {
  return store(MoeRouterKernels{TITAN_TIMED(0, MoeRouterKernels, softmax, kPointwise),
                                TITAN_TIMED(0, MoeRouterKernels, select_topk, kPointwise),
                                TITAN_TIMED(0, MoeRouterKernels, count_tokens, kPointwise),
                                TITAN_TIMED(0, MoeRouterKernels, aux_stats, kPointwise),
                                TITAN_TIMED(0, MoeRouterKernels, backward, kPointwise),
                                TITAN_TIMED(0, MoeRouterKernels, update_bias, kPointwise),
                                TITAN_TIMED(0, MoeRouterKernels, aux_loss, kPointwise)},
               0);
}

}  // namespace titan
