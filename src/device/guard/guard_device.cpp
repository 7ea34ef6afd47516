// The guard device: host memory handed out at addresses the host cannot dereference (the real address
// plus 2^52: non-canonical on x86-64, outside the 48-bit address space on AArch64), running the CPU's
// default kernels on the real addresses. Every op, copy and collective takes the offset off before it
// touches memory; anything else that reads or writes a guard tensor's memory faults at once. Training or
// running a model on it checks that the model, optimizer, checkpoints and trainer reach device memory only
// through ops and device copies (what an accelerator needs), with results equal to the CPU's.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "device/device.h"
#include "device/guard/guard.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace titan::guard {

namespace {

class GuardAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    size_t rounded = (nbytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
    if (!p) throw std::bad_alloc();
    stats.on_alloc(nbytes);
    return hide(p);
  }
  void deallocate(void* ptr, size_t nbytes) override {
    std::free(reveal(ptr));
    stats.on_free(nbytes);
  }
};

// A host address where guard memory belongs (or the reverse) is a bug of the caller: said at once.
void* device_side(const void* p, const char* what) {
  TITAN_CHECK(is_hidden(p), "guard device: ", what, " got a host address where device memory belongs");
  return reveal(p);
}
const void* host_side(const void* p, const char* what) {
  TITAN_CHECK(!is_hidden(p), "guard device: ", what, " got device memory where a host address belongs");
  return p;
}

void copy_to_host(void* dst, const void* src, size_t n) {
  std::memcpy(const_cast<void*>(host_side(dst, "copy_to_host")), device_side(src, "copy_to_host"), n);
}
void copy_from_host(void* dst, const void* src, size_t n) {
  std::memcpy(device_side(dst, "copy_from_host"), host_side(src, "copy_from_host"), n);
}
void zero(void* dst, size_t n) {
  std::memset(device_side(dst, "zero"), 0, n);
}
void copy(void* dst, const void* src, size_t n) {
  std::memcpy(device_side(dst, "copy"), device_side(src, "copy"), n);
}
int one_thread_per_op() {
  return device_interface(DeviceType::CPU).num_threads();
}
int one_device() {
  return 1;
}
void set_current(int index) {
  TITAN_CHECK(index == 0, "guard:", index, " requested; the guard device has index 0 only");
}

struct GuardDeviceRegistration {
  GuardAllocator allocator;
  DeviceInterface iface;
  GuardDeviceRegistration() {
    iface.name = "guard";
    iface.allocator = &allocator;
    iface.copy_to_host = copy_to_host;
    iface.copy_from_host = copy_from_host;
    iface.zero = zero;
    iface.copy = copy;
    iface.num_threads = one_thread_per_op;
    iface.device_count = one_device;
    iface.set_current = set_current;
    register_device(DeviceType::GUARD, &iface);
  }
};
GuardDeviceRegistration guard_device_registration;

// ---- ops: the CPU's default implementation of each, on revealed addresses --------------------------------
template <class T>
T reveal_arg(T x, const char*) {
  return x;
}
template <class T>
T* reveal_arg(T* p, const char* op) {
  return p ? static_cast<T*>(device_side(p, op)) : nullptr;
}
MoeExpertsBuffers reveal_arg(const MoeExpertsBuffers& b, const char* op) {
  return {reveal_arg(b.gu, op),     reveal_arg(b.act, op),     reveal_arg(b.order, op),
          reveal_arg(b.row_of, op), reveal_arg(b.offsets, op), reveal_arg(b.scratch, op)};
}

// Thunk<K, &K::member>::call: the member of K's CPU default implementation, arguments revealed. The CPU
// table is looked up at the first call (every table has registered by then).
template <class K, auto Member, class Fn>
struct Thunk;
template <class K, auto Member, class R, class... A>
struct Thunk<K, Member, R (*)(A...)> {
  static R call(A... a) {
    static const K& cpu = get_kernel<K>(DeviceType::CPU);
    return (cpu.*Member)(reveal_arg(a, K::kOp)...);
  }
};
#define TITAN_GUARD(K, m) &Thunk<K, &K::m, decltype(K::m)>::call

const MatmulKernels kMatmul{TITAN_GUARD(MatmulKernels, forward), TITAN_GUARD(MatmulKernels, backward)};
const MatmulBf16Kernels kMatmulBf16{TITAN_GUARD(MatmulBf16Kernels, forward),
                                    TITAN_GUARD(MatmulBf16Kernels, backward),
                                    TITAN_GUARD(MatmulBf16Kernels, forward_bf16_input),
                                    TITAN_GUARD(MatmulBf16Kernels, backward_bf16_input),
                                    TITAN_GUARD(MatmulBf16Kernels, forward_bf16_output),
                                    TITAN_GUARD(MatmulBf16Kernels, forward_bf16_io),
                                    TITAN_GUARD(MatmulBf16Kernels, backward_bf16_io)};
const RmsNormKernels kRmsNorm{TITAN_GUARD(RmsNormKernels, forward),
                              TITAN_GUARD(RmsNormKernels, backward),
                              TITAN_GUARD(RmsNormKernels, forward_bf16_output),
                              TITAN_GUARD(RmsNormKernels, forward_bf16_input),
                              TITAN_GUARD(RmsNormKernels, backward_bf16_input),
                              TITAN_GUARD(RmsNormKernels, forward_bf16_io)};
const RopeKernels kRope{TITAN_GUARD(RopeKernels, forward), TITAN_GUARD(RopeKernels, backward)};
const RopeQKKernels kRopeQK{TITAN_GUARD(RopeQKKernels, forward), TITAN_GUARD(RopeQKKernels, backward)};
const QKNormRopeKernels kQKNormRope{TITAN_GUARD(QKNormRopeKernels, forward),
                                    TITAN_GUARD(QKNormRopeKernels, backward)};
const AttentionKernels kAttention{TITAN_GUARD(AttentionKernels, forward),
                                  TITAN_GUARD(AttentionKernels, backward),
                                  TITAN_GUARD(AttentionKernels, saved_floats)};
const AttentionBf16Kernels kAttentionBf16{TITAN_GUARD(AttentionBf16Kernels, forward),
                                          TITAN_GUARD(AttentionBf16Kernels, backward)};
const AttentionKVKernels kAttentionKV{TITAN_GUARD(AttentionKVKernels, forward)};
const SwigluKernels kSwiglu{TITAN_GUARD(SwigluKernels, forward), TITAN_GUARD(SwigluKernels, backward),
                            TITAN_GUARD(SwigluKernels, forward_bf16),
                            TITAN_GUARD(SwigluKernels, backward_bf16),
                            TITAN_GUARD(SwigluKernels, backward_bf16_output)};
const EmbeddingKernels kEmbedding{TITAN_GUARD(EmbeddingKernels, forward),
                                  TITAN_GUARD(EmbeddingKernels, backward)};
const CrossEntropyKernels kCrossEntropy{TITAN_GUARD(CrossEntropyKernels, forward_backward),
                                        TITAN_GUARD(CrossEntropyKernels, forward_backward_device)};
const VocabParallelCrossEntropyKernels kVocabParallelCrossEntropy{
    TITAN_GUARD(VocabParallelCrossEntropyKernels, shard_stats),
    TITAN_GUARD(VocabParallelCrossEntropyKernels, shard_grad),
    TITAN_GUARD(VocabParallelCrossEntropyKernels, row_max),
    TITAN_GUARD(VocabParallelCrossEntropyKernels, rescale),
    TITAN_GUARD(VocabParallelCrossEntropyKernels, loss)};
const AdamWKernels kAdamW{TITAN_GUARD(AdamWKernels, step), TITAN_GUARD(AdamWKernels, step_device)};
const SumSquaresKernels kSumSquares{
    TITAN_GUARD(SumSquaresKernels, sum_squares), TITAN_GUARD(SumSquaresKernels, sum_squares_device),
    TITAN_GUARD(SumSquaresKernels, total_device), TITAN_GUARD(SumSquaresKernels, count_nonfinite)};
const MoeExpertsKernels kMoe{TITAN_GUARD(MoeExpertsKernels, forward),
                             TITAN_GUARD(MoeExpertsKernels, backward)};
const MoeExpertsBf16Kernels kMoeBf16{
    {TITAN_GUARD(MoeExpertsBf16Kernels, forward), TITAN_GUARD(MoeExpertsBf16Kernels, backward)}};
const ElementwiseKernels kElementwise{
    TITAN_GUARD(ElementwiseKernels, add),        TITAN_GUARD(ElementwiseKernels, round_bf16),
    TITAN_GUARD(ElementwiseKernels, to_bf16),    TITAN_GUARD(ElementwiseKernels, from_bf16),
    TITAN_GUARD(ElementwiseKernels, fill),       TITAN_GUARD(ElementwiseKernels, scale),
    TITAN_GUARD(ElementwiseKernels, add_to_bf16)};
const MoeRouterKernels kMoeRouter{
    TITAN_GUARD(MoeRouterKernels, softmax),      TITAN_GUARD(MoeRouterKernels, select_topk),
    TITAN_GUARD(MoeRouterKernels, count_tokens), TITAN_GUARD(MoeRouterKernels, aux_stats),
    TITAN_GUARD(MoeRouterKernels, backward),     TITAN_GUARD(MoeRouterKernels, update_bias),
    TITAN_GUARD(MoeRouterKernels, aux_loss)};
const ExpertParallelKernels kExpertParallel{
    TITAN_GUARD(ExpertParallelKernels, pack),         TITAN_GUARD(ExpertParallelKernels, unpack),
    TITAN_GUARD(ExpertParallelKernels, gather_rows),  TITAN_GUARD(ExpertParallelKernels, pack_grads),
    TITAN_GUARD(ExpertParallelKernels, combine),      TITAN_GUARD(ExpertParallelKernels, route_fixed),
    TITAN_GUARD(ExpertParallelKernels, unpack_padded)};

const GemmKernels kGemm{TITAN_GUARD(GemmKernels, gemm)};
const DropoutKernels kDropout{TITAN_GUARD(DropoutKernels, forward),
                              TITAN_GUARD(DropoutKernels, backward_add)};

}  // namespace

TITAN_REGISTER_KERNEL(GemmKernels, GUARD, "cpu", kGemm, 10);
TITAN_REGISTER_KERNEL(DropoutKernels, GUARD, "cpu", kDropout, 10);
TITAN_REGISTER_KERNEL(MatmulKernels, GUARD, "cpu", kMatmul, 10);
TITAN_REGISTER_KERNEL(MatmulBf16Kernels, GUARD, "cpu", kMatmulBf16, 10);
TITAN_REGISTER_KERNEL(RmsNormKernels, GUARD, "cpu", kRmsNorm, 10);
TITAN_REGISTER_KERNEL(RopeKernels, GUARD, "cpu", kRope, 10);
TITAN_REGISTER_KERNEL(RopeQKKernels, GUARD, "cpu", kRopeQK, 10);
TITAN_REGISTER_KERNEL(QKNormRopeKernels, GUARD, "cpu", kQKNormRope, 10);
TITAN_REGISTER_KERNEL(AttentionKernels, GUARD, "cpu", kAttention, 10);
TITAN_REGISTER_KERNEL(AttentionBf16Kernels, GUARD, "cpu", kAttentionBf16, 10);
TITAN_REGISTER_KERNEL(AttentionKVKernels, GUARD, "cpu", kAttentionKV, 10);
TITAN_REGISTER_KERNEL(SwigluKernels, GUARD, "cpu", kSwiglu, 10);
TITAN_REGISTER_KERNEL(EmbeddingKernels, GUARD, "cpu", kEmbedding, 10);
TITAN_REGISTER_KERNEL(CrossEntropyKernels, GUARD, "cpu", kCrossEntropy, 10);
TITAN_REGISTER_KERNEL(VocabParallelCrossEntropyKernels, GUARD, "cpu", kVocabParallelCrossEntropy, 10);
TITAN_REGISTER_KERNEL(AdamWKernels, GUARD, "cpu", kAdamW, 10);
TITAN_REGISTER_KERNEL(SumSquaresKernels, GUARD, "cpu", kSumSquares, 10);
TITAN_REGISTER_KERNEL(MoeExpertsKernels, GUARD, "cpu", kMoe, 10);
TITAN_REGISTER_KERNEL(MoeExpertsBf16Kernels, GUARD, "cpu", kMoeBf16, 10);
TITAN_REGISTER_KERNEL(ElementwiseKernels, GUARD, "cpu", kElementwise, 10);
TITAN_REGISTER_KERNEL(MoeRouterKernels, GUARD, "cpu", kMoeRouter, 10);
TITAN_REGISTER_KERNEL(ExpertParallelKernels, GUARD, "cpu", kExpertParallel, 10);

}  // namespace titan::guard
