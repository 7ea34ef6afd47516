// The CUDA emulator's runtime (see cuda_sim.h): kernel launches as fibers on the host, and the CUDA
// runtime functions the CUDA device calls. One emulated GPU (TITAN_CUDA_SIM_GPUS for more); its stream is
// synchronous (each call has finished when it returns); device memory is host memory, tracked so that
// copies, memsets and kernel pointer arguments outside device allocations are errors.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/context/fiber.hpp>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda_sim.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define TITAN_SIM_ASAN 1
#endif

namespace titan::cuda_sim {
namespace {

constexpr size_t kStackBytes = 256 << 10;
constexpr size_t kDefaultSmem = 48 << 10;    // dynamic shared memory without an opt-in
constexpr size_t kMaxSmemOptin = 227 << 10;  // sm_90 (H100, H200)
constexpr unsigned kFullMask = 0xffffffffu;

std::string where_str(const std::source_location& w) {
  std::string f = w.file_name();
  const size_t slash = f.find_last_of('/');
  if (slash != std::string::npos) f = f.substr(slash + 1);
  return str_cat(f, ":", w.line());
}

// ---- device memory -------------------------------------------------------------------------------------
struct Memory {
  std::mutex mu;
  std::map<uintptr_t, size_t> blocks;  // base -> bytes
  size_t in_use = 0;
  // The live allocation holding [p, p + n) (a zero-size range may sit at an allocation's end).
  bool contains(const void* p, size_t n) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    auto it = blocks.upper_bound(a);
    if (it == blocks.begin()) return false;
    --it;
    return a >= it->first && a + n <= it->first + it->second;
  }
};
Memory& memory() {
  static Memory m;
  return m;
}

bool is_device(const void* p, size_t n) {
  auto& m = memory();
  std::lock_guard<std::mutex> g(m.mu);
  return m.contains(p, n);
}

// The runtime's error state: the sticky last error and the detail of the latest failure, which
// cudaGetErrorString reports (titan's CUDA checks print it).
thread_local cudaError_t last_error = cudaSuccess;
thread_local std::string last_detail;
cudaError_t failed(cudaError_t e, std::string detail) {
  last_error = e;
  last_detail = "CUDA emulator: " + detail;
  return e;
}

// ---- fibers --------------------------------------------------------------------------------------------
// Each emulated thread is a Boost.Context fiber on a stack of the launch's pool; a barrier or a warp
// operation switches back to the block's scheduler (run_block), which releases a barrier once every
// thread of the group has arrived.
namespace ctx = boost::context;

enum class Wait { kRunning, kBlock, kWarp, kDone };

struct Fiber {
  ctx::fiber self;        // the thread, suspended (empty once it has finished)
  ctx::fiber caller;      // the scheduler, while the thread runs
  char* stack = nullptr;  // kStackBytes, the lowest page a guard
  bool started = false;
  uint3 tid{};
  Wait wait = Wait::kRunning;
  std::source_location where;
  Exchange kind = Exchange::kSyncWarp;
  unsigned mask = 0;
  int arg = 0, width = 32;
  uint64_t in = 0, out = 0;
};

// The pool owns the stacks: a fiber neither allocates nor frees one.
struct PoolStack {
  ctx::stack_context allocate() { fail("CUDA emulator: a fiber stack comes from the pool"); }
  void deallocate(ctx::stack_context&) noexcept {}
};

struct Launch {
  std::vector<Fiber> fibers;  // a pool; the first `threads` are this block's threads
  int threads = 0;
  Fiber* current = nullptr;
  uint3 block_idx{};
  dim3 block_dim, grid_dim;
  std::vector<std::max_align_t> smem;  // the dynamic shared memory, refilled with 0xff for each block
  size_t smem_bytes = 0;
  const std::function<void()>* body = nullptr;
  std::string error;  // set by a fiber that misused an intrinsic; the scheduler throws it
  std::string site;   // the launch site, for errors
#ifdef TITAN_SIM_ASAN
  void* fake_stack = nullptr;
  const void* main_bottom = nullptr;
  size_t main_size = 0;
#endif
};
std::mutex launch_mutex;  // one kernel at a time, as on the device's one stream
Launch* active = nullptr;

Launch& state() {
  TITAN_CHECK(active != nullptr, "CUDA emulator: device code called outside a kernel launch");
  return *active;
}

void switch_to_scheduler(Launch& L, Fiber& f) {
#ifdef TITAN_SIM_ASAN
  __sanitizer_start_switch_fiber(&L.fake_stack, L.main_bottom, L.main_size);
  try {
    f.caller = std::move(f.caller).resume();
  } catch (const ctx::detail::forced_unwind&) {  // abandon(): the thread unwinds on its own stack
    __sanitizer_finish_switch_fiber(L.fake_stack, &L.main_bottom, &L.main_size);
    throw;
  }
  __sanitizer_finish_switch_fiber(L.fake_stack, &L.main_bottom, &L.main_size);
#else
  f.caller = std::move(f.caller).resume();
#endif
}

// A thread's whole life: the kernel body, then back to the scheduler for good.
ctx::fiber thread_main(Fiber& f, ctx::fiber&& caller) {
  f.caller = std::move(caller);
  Launch& L = *active;
#ifdef TITAN_SIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &L.main_bottom, &L.main_size);
#endif
  try {
    (*L.body)();
  } catch (const std::exception& e) {  // not ctx::detail::forced_unwind: that one unwinds an abandoned thread
    L.error = e.what();
  }
#ifdef TITAN_SIM_ASAN
  catch (const ctx::detail::forced_unwind&) {
    __sanitizer_start_switch_fiber(nullptr, L.main_bottom, L.main_size);
    throw;
  }
#endif
  f.wait = Wait::kDone;
#ifdef TITAN_SIM_ASAN
  __sanitizer_start_switch_fiber(nullptr, L.main_bottom, L.main_size);
#endif
  return std::move(f.caller);
}

void start(Fiber& f) {
  const size_t usable = kStackBytes - getpagesize();
  ctx::stack_context sctx;
  sctx.sp = f.stack + kStackBytes;
  sctx.size = usable;
  f.self = ctx::fiber(std::allocator_arg, ctx::preallocated(sctx.sp, usable, sctx), PoolStack{},
                      [&f](ctx::fiber&& caller) { return thread_main(f, std::move(caller)); });
}

void resume(Launch& L, Fiber& f) {
  if (!f.started) {
    start(f);
    f.started = true;
  }
  L.current = &f;
  f.wait = Wait::kRunning;
#ifdef TITAN_SIM_ASAN
  __sanitizer_start_switch_fiber(&L.fake_stack, f.stack + getpagesize(), kStackBytes - getpagesize());
#endif
  f.self = std::move(f.self).resume();
#ifdef TITAN_SIM_ASAN
  __sanitizer_finish_switch_fiber(L.fake_stack, nullptr, nullptr);
#endif
  L.current = nullptr;
}

// Unwinds the threads of a block that did not finish (the block failed): their destructors run on their
// own stacks before the stacks are reused.
void abandon(Launch& L) {
  for (int i = 0; i < L.threads; ++i) {
    Fiber& f = L.fibers[i];
    if (!f.self) continue;
    L.current = &f;
#ifdef TITAN_SIM_ASAN
    __sanitizer_start_switch_fiber(&L.fake_stack, f.stack + getpagesize(), kStackBytes - getpagesize());
#endif
    f.self = ctx::fiber{};
#ifdef TITAN_SIM_ASAN
    __sanitizer_finish_switch_fiber(L.fake_stack, nullptr, nullptr);
#endif
    L.current = nullptr;
  }
}

void ensure_fibers(Launch& L, int n) {
  if (static_cast<int>(L.fibers.size()) >= n) return;
  L.fibers.reserve(n);  // fibers hold their own address (start): no reallocation once a block runs
  while (static_cast<int>(L.fibers.size()) < n) {
    void* s = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TITAN_CHECK(s != MAP_FAILED, "CUDA emulator: cannot map a fiber stack");
    mprotect(s, getpagesize(), PROT_NONE);  // a kernel that overflows its stack faults here
    L.fibers.emplace_back().stack = static_cast<char*>(s);
  }
}

std::string describe_waits(const Launch& L) {
  std::map<std::string, int> counts;
  for (int i = 0; i < L.threads; ++i) {
    const Fiber& f = L.fibers[i];
    if (f.wait == Wait::kDone) continue;
    const char* what = f.wait == Wait::kBlock          ? "__syncthreads"
                       : f.kind == Exchange::kSyncWarp ? "__syncwarp"
                                                       : "a shuffle";
    ++counts[str_cat(what, " at ", where_str(f.where))];
  }
  std::string s;
  for (auto& [k, n] : counts) s += str_cat(s.empty() ? "" : "; ", n, " thread(s) wait at ", k);
  return s;
}

int lane_source(const Fiber& f, int lane) {
  const int w = f.width, seg = lane / w * w;
  switch (f.kind) {
    case Exchange::kIdx:
      return seg + ((f.arg % w) + w) % w;
    case Exchange::kXor: {
      const int src = lane ^ f.arg;
      return src >= seg + w ? lane : src;
    }
    case Exchange::kDown:
      return lane + f.arg >= seg + w ? lane : lane + f.arg;
    case Exchange::kUp:
      return lane - f.arg < seg ? lane : lane - f.arg;
    case Exchange::kSyncWarp:
      break;
  }
  return lane;
}

// Releases every warp group whose lanes have all arrived; true if one was released.
bool release_warps(Launch& L) {
  bool released = false;
  const int n = L.threads;
  for (int w0 = 0; w0 < n; w0 += 32) {
    for (int lane = 0; lane < 32 && w0 + lane < n; ++lane) {
      Fiber& f = L.fibers[w0 + lane];
      if (f.wait != Wait::kWarp) continue;
      const unsigned m = f.mask;
      auto at = [&] {  // built only for an error
        return str_cat(f.kind == Exchange::kSyncWarp ? "__syncwarp" : "shuffle", " at ", where_str(f.where),
                       " of block (", L.block_idx.x, ",", L.block_idx.y, ",", L.block_idx.z,
                       "), launched at ", L.site);
      };
      if (!(m >> lane & 1u))
        fail("CUDA emulator: lane ", lane, " of warp ", w0 / 32, " is not in its own mask 0x", std::hex, m,
             std::dec, " in ", at());
      bool ready = true;
      for (int l = 0; l < 32; ++l) {
        if (!(m >> l & 1u)) continue;
        if (w0 + l >= n)
          fail("CUDA emulator: mask 0x", std::hex, m, std::dec, " names lane ", l, " of warp ", w0 / 32,
               ", which a block of ", n, " threads does not have, in ", at());
        const Fiber& g = L.fibers[w0 + l];
        if (g.wait == Wait::kDone)
          fail("CUDA emulator: lane ", l, " of warp ", w0 / 32, " exited while lanes of mask 0x", std::hex, m,
               std::dec, " wait in ", at());
        if (g.wait != Wait::kWarp) {
          ready = false;
          continue;
        }
        if (g.mask != m || (g.kind == Exchange::kSyncWarp) != (f.kind == Exchange::kSyncWarp))
          fail("CUDA emulator: lanes ", lane, " and ", l, " of warp ", w0 / 32,
               " meet at different warp operations (", where_str(f.where), " mask 0x", std::hex, m, ", ",
               where_str(g.where), " mask 0x", g.mask, std::dec, ") in block launched at ", L.site);
        if (f.kind != Exchange::kSyncWarp &&
            (g.kind != f.kind || g.where.line() != f.where.line() || g.width != f.width))
          fail("CUDA emulator: lanes ", lane, " and ", l, " of warp ", w0 / 32,
               " are in different shuffles (", where_str(f.where), " and ", where_str(g.where), ")");
      }
      if (!ready) continue;
      for (int l = 0; l < 32; ++l) {
        if (!(m >> l & 1u)) continue;
        Fiber& g = L.fibers[w0 + l];
        if (g.kind != Exchange::kSyncWarp) {
          const int src = lane_source(g, l);
          if (!(m >> src & 1u))
            fail("CUDA emulator: lane ", l, " reads lane ", src, ", outside mask 0x", std::hex, m, std::dec,
                 ", in ", at());
          g.out = L.fibers[w0 + src].in;
        }
      }
      for (int l = 0; l < 32; ++l)
        if (m >> l & 1u) L.fibers[w0 + l].wait = Wait::kRunning;
      released = true;
    }
  }
  return released;
}

bool release_block(Launch& L) {
  const Fiber* first = nullptr;
  for (int i = 0; i < L.threads; ++i) {
    const Fiber& f = L.fibers[i];
    if (f.wait == Wait::kDone) continue;
    if (f.wait != Wait::kBlock) return false;
    if (!first) {
      first = &f;
    } else if (f.where.line() != first->where.line() ||
               std::strcmp(f.where.file_name(), first->where.file_name()) != 0) {
      fail("CUDA emulator: threads of block (", L.block_idx.x, ",", L.block_idx.y, ",", L.block_idx.z,
           ") wait at different __syncthreads (", where_str(first->where), " and ", where_str(f.where),
           "), launched at ", L.site);
    }
  }
  if (!first) return false;
  for (int i = 0; i < L.threads; ++i)
    if (L.fibers[i].wait == Wait::kBlock) L.fibers[i].wait = Wait::kRunning;
  return true;
}

void run_block(Launch& L) {
  const int n = L.threads;
  if (L.smem_bytes)
    std::memset(L.smem.data(), 0xff, L.smem_bytes);  // an earlier block's data is not this one's
  for (int i = 0; i < n; ++i) {
    Fiber& f = L.fibers[i];
    f.tid = {static_cast<unsigned>(i % L.block_dim.x),
             static_cast<unsigned>(i / L.block_dim.x % L.block_dim.y),
             static_cast<unsigned>(i / (L.block_dim.x * L.block_dim.y))};
    f.wait = Wait::kRunning;
    f.started = false;  // made on its first resume: a failed block leaves no never-run fibers to unwind
  }
  struct Abandon {  // on a failure, the block's unfinished threads
    Launch& L;
    ~Abandon() { abandon(L); }
  } abandon_on_exit{L};
  // Between two barriers the threads run one after another, in reverse order or forward, alternating
  // from one barrier interval to the next and starting differently in neighbouring blocks: a read that
  // a missing barrier leaves unordered with a write sees the stale value in one of the two orders.
  const unsigned block_linear = L.block_idx.x + L.grid_dim.x * (L.block_idx.y + L.grid_dim.y * L.block_idx.z);
  for (unsigned pass = block_linear % 2;; ++pass) {
    const bool reverse = pass % 2 == 0;
    for (int k = 0; k < n; ++k) {
      Fiber& f = L.fibers[reverse ? n - 1 - k : k];
      if (f.wait != Wait::kRunning) continue;
      resume(L, f);
      if (!L.error.empty()) fail(L.error);
    }
    if (std::all_of(L.fibers.begin(), L.fibers.begin() + n,
                    [](const Fiber& f) { return f.wait == Wait::kDone; }))
      return;
    if (release_warps(L) || release_block(L)) continue;
    fail("CUDA emulator: deadlock in block (", L.block_idx.x, ",", L.block_idx.y, ",", L.block_idx.z,
         ") of the kernel launched at ", L.site, ": ", describe_waits(L));
  }
}

std::map<const void*, int>& smem_optin() {
  static std::map<const void*, int> m;
  return m;
}

}  // namespace

bool is_device_range(const void* p, size_t n) {
  return is_device(p, n);
}

const uint3& thread_index() {
  Launch& L = state();
  TITAN_CHECK(L.current, "CUDA emulator: threadIdx read outside a kernel thread");
  return L.current->tid;
}
const uint3& block_index() {
  return state().block_idx;
}
const dim3& block_dim() {
  return state().block_dim;
}
const dim3& grid_dim() {
  return state().grid_dim;
}
void* dynamic_shared() {
  return state().smem.data();
}

void sync_threads(const std::source_location& where) {
  Launch& L = state();
  Fiber& f = *L.current;
  f.wait = Wait::kBlock;
  f.where = where;
  switch_to_scheduler(L, f);
}

uint64_t warp_exchange(Exchange kind, unsigned mask, uint64_t bits, int arg, int width,
                       const std::source_location& where) {
  Launch& L = state();
  Fiber& f = *L.current;
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0) {
    L.error =
        str_cat("CUDA emulator: shuffle width ", width, " (a power of two up to 32) at ", where_str(where));
    f.wait = Wait::kDone;
    switch_to_scheduler(L, f);
  }
  f.wait = Wait::kWarp;
  f.kind = kind;
  f.mask = mask;
  f.in = bits;
  f.arg = arg;
  f.width = width;
  f.where = where;
  switch_to_scheduler(L, f);
  return f.out;
}

namespace {
std::atomic<uint64_t> host_launches{0}, kernels_run{0}, graph_launches{0};

void run_launch(const void* kernel, const Grid& grid, dim3 block, size_t dynamic_smem,
                const std::vector<PointerArg>& pointers, const std::function<void()>& body, bool check_only);

}  // namespace

Counters counters() {
  return {host_launches.load(), kernels_run.load(), graph_launches.load()};
}

void launch(const void* kernel, const Grid& grid, dim3 block, size_t dynamic_smem, cudaStream_t stream,
            const std::vector<PointerArg>& pointers, std::function<void()> body) {
  if (record_if_capturing(stream, [kernel, grid, block, dynamic_smem, pointers, body] {
        run_launch(kernel, grid, block, dynamic_smem, pointers, body, false);
      })) {
    run_launch(kernel, grid, block, dynamic_smem, pointers, body, true);  // errors at the launch site now
    return;
  }
  ++host_launches;
  run_launch(kernel, grid, block, dynamic_smem, pointers, body, false);
}

namespace {

void run_launch(const void* kernel, const Grid& grid, dim3 block, size_t dynamic_smem,
                const std::vector<PointerArg>& pointers, const std::function<void()>& body, bool check_only) {
  const std::string site = where_str(grid.where);
  const dim3 g = grid.dim;
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (grid.requested_x < 1 || grid.requested_x > 0x7fffffff || g.y < 1 || g.y > 65535 || g.z < 1 ||
      g.z > 65535)
    fail("CUDA emulator: invalid grid (", grid.requested_x, ",", g.y, ",", g.z, ") launched at ", site,
         " (x in 1..2^31-1, y and z in 1..65535)");
  if (threads < 1 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64)
    fail("CUDA emulator: invalid block (", block.x, ",", block.y, ",", block.z, ") launched at ", site,
         " (at most 1024 threads, z at most 64)");
  if (dynamic_smem > kDefaultSmem) {
    std::lock_guard<std::mutex> lock(launch_mutex);
    auto it = smem_optin().find(kernel);
    const size_t allowed = it == smem_optin().end() ? kDefaultSmem : static_cast<size_t>(it->second);
    if (dynamic_smem > allowed)
      fail("CUDA emulator: kernel launched at ", site, " asks for ", dynamic_smem,
           " bytes of dynamic shared memory; ", allowed,
           " are allowed (more than 48 KiB needs cudaFuncSetAttribute(MaxDynamicSharedMemorySize), up to ",
           kMaxSmemOptin, ")");
  }
  for (const PointerArg& a : pointers)
    if (a.p && !is_device(a.p, 0))
      fail("CUDA emulator: argument ", a.index + 1, " of the kernel launched at ", site, " (", a.p,
           ") is not device memory");
  if (check_only) return;
  ++kernels_run;

  std::lock_guard<std::mutex> lock(launch_mutex);
  static Launch L;
  L.body = &body;
  L.site = site;
  L.error.clear();
  L.block_dim = block;
  L.grid_dim = g;
  L.threads = static_cast<int>(threads);
  L.smem.assign((dynamic_smem + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t), {});
  L.smem_bytes = dynamic_smem;
  ensure_fibers(L, L.threads);
  struct Active {
    explicit Active(Launch* l) { active = l; }
    ~Active() { active = nullptr; }
  } scope(&L);
  for (int64_t bz = g.z - 1; bz >= 0; --bz)
    for (int64_t by = g.y - 1; by >= 0; --by)
      for (int64_t bx = g.x - 1; bx >= 0; --bx) {
        L.block_idx = {static_cast<unsigned>(bx), static_cast<unsigned>(by), static_cast<unsigned>(bz)};
        run_block(L);
      }
}

}  // namespace
}  // namespace titan::cuda_sim

// ---- the CUDA runtime functions the CUDA device calls --------------------------------------------------
using titan::cuda_sim::failed;
using titan::cuda_sim::is_device;
using titan::cuda_sim::memory;

namespace {

constexpr size_t kGpuBytes = 80ull << 30;
int current_device = 0;
// TITAN_CUDA_SIM_GPUS (default 1): how many GPUs the emulator shows, e.g. 2 for a job of two ranks that
// pick GPUs by local rank, as on a node with two GPUs. They share the process's memory.
int sim_device_count() {
  static const int n = [] {
    const char* v = std::getenv("TITAN_CUDA_SIM_GPUS");
    if (!v || !*v) return 1;
    char* end = nullptr;
    const long k = std::strtol(v, &end, 10);
    TITAN_CHECK(*end == '\0' && k >= 1 && k <= 64, "TITAN_CUDA_SIM_GPUS = '", v, "': expected 1 to 64 GPUs");
    return static_cast<int>(k);
  }();
  return n;
}

cudaError_t sim_malloc(void** p, size_t n) {
  if (!p) return failed(cudaErrorInvalidValue, "cudaMalloc with a null result pointer");
  // Exactly n bytes (256-aligned as cudaMalloc's), so that under AddressSanitizer a kernel reading or
  // writing past an allocation's end is reported.
  const size_t bytes = std::max<size_t>(n, 1);
  void* q = nullptr;
  if (posix_memalign(&q, 256, bytes) != 0)
    return failed(cudaErrorMemoryAllocation, titan::str_cat("out of host memory for ", n, " bytes"));
  std::memset(q, 0xff, bytes);  // NaN everywhere: reads of memory nobody wrote show
  auto& m = memory();
  std::lock_guard<std::mutex> g(m.mu);
  m.blocks[reinterpret_cast<uintptr_t>(q)] = n;
  m.in_use += bytes;
  *p = q;
  return cudaSuccess;
}

cudaError_t sim_free(void* p) {
  if (!p) return cudaSuccess;
  auto& m = memory();
  std::lock_guard<std::mutex> g(m.mu);
  auto it = m.blocks.find(reinterpret_cast<uintptr_t>(p));
  if (it == m.blocks.end())
    return failed(cudaErrorInvalidValue,
                  titan::str_cat("cudaFree of ", p, ", which is not a device allocation"));
  const size_t bytes = std::max<size_t>(it->second, 1);
  std::memset(p, 0xff, bytes);
  m.in_use -= bytes;
  m.blocks.erase(it);
  std::free(p);
  return cudaSuccess;
}

const char* kind_name(cudaMemcpyKind k) {
  switch (k) {
    case cudaMemcpyHostToDevice:
      return "host to device";
    case cudaMemcpyDeviceToHost:
      return "device to host";
    case cudaMemcpyDeviceToDevice:
      return "device to device";
    case cudaMemcpyHostToHost:
      return "host to host";
    default:
      return "default";
  }
}

}  // namespace

// Streams: each a distinct handle holding its Deferred work; an event the count of its stream's work when
// it was recorded.
namespace {
struct SimStream {
  std::deque<titan::cuda_sim::Deferred> held;
  uint64_t issued = 0, done = 0;  // work items ever held / completed
  void finish_until(uint64_t n) {
    while (done < n) {
      held.front().wait();
      held.pop_front();
      ++done;
    }
  }
  bool test_until(uint64_t n) {
    while (done < n) {
      if (!held.front().test()) return false;
      held.pop_front();
      ++done;
    }
    return true;
  }
};
struct SimEvent {
  SimStream* stream = nullptr;
  uint64_t at = 0;
  bool in_capture = false;  // last recorded inside a stream capture (a node of its graph)
  // When it was recorded: the emulator runs a launch before returning, so the work queued before the event
  // is done by then (held sends aside), and the host clock between two records stands for device time.
  std::chrono::steady_clock::time_point when;
};
SimStream& default_stream() {
  static SimStream s;
  return s;
}
SimStream& sim_stream(cudaStream_t s) {
  return s ? *reinterpret_cast<SimStream*>(s) : default_stream();
}
}  // namespace

void titan::cuda_sim::defer_on_stream(cudaStream_t stream, Deferred work) {
  SimStream& s = sim_stream(stream);
  s.held.push_back(std::move(work));
  ++s.issued;
}

// ---- stream capture ----------------------------------------------------------------------------------
namespace {
struct GraphData {
  std::vector<std::function<void()>> nodes;  // in issue order
  std::vector<void*> owned;                  // cudaMallocAsync'd inside the capture: fixed addresses
  std::vector<void*> live;                   // of those, not freed inside the capture yet
  ~GraphData() {
    for (void* p : owned) sim_free(p);
  }
};
using GraphRef = std::shared_ptr<GraphData>;  // a cudaGraph_t or cudaGraphExec_t points at one
struct Capture {
  cudaStream_t stream = nullptr;
  GraphRef graph;       // null: no capture
  std::string offence;  // the first call the capture could not take (it is invalidated)
};
Capture& capture() {
  static Capture c;
  return c;
}
bool capturing(cudaStream_t s) {
  return capture().graph && capture().stream == s;
}
// A call that a capture in global mode rejects: invalidates the capture and fails naming the call.
cudaError_t rejected_in_capture(const std::string& call, const char* why) {
  const std::string what = titan::str_cat(call, " while a stream is capturing (", why, ")");
  if (capture().offence.empty()) capture().offence = what;
  return failed(cudaErrorStreamCaptureUnsupported, what);
}
constexpr const char* kHostSync =
    "the host would wait for, or read, work that has not run: it runs when the graph is launched";
}  // namespace

bool titan::cuda_sim::record_if_capturing(cudaStream_t stream, std::function<void()> work) {
  if (!capturing(stream)) return false;
  capture().graph->nodes.push_back(std::move(work));
  return true;
}
bool titan::cuda_sim::record_if_capture_active(std::function<void()> work) {
  return capture().graph && record_if_capturing(capture().stream, std::move(work));
}

extern "C" {

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode) {
  if (!stream)
    return failed(cudaErrorStreamCaptureUnsupported, "cudaStreamBeginCapture of the legacy default stream");
  if (capture().graph)
    return failed(cudaErrorIllegalState,
                  "cudaStreamBeginCapture while a stream is capturing (the emulator "
                  "captures one stream at a time)");
  capture() = {stream, std::make_shared<GraphData>(), ""};
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  if (!capturing(stream))
    return failed(cudaErrorIllegalState, "cudaStreamEndCapture on a stream that is not capturing");
  Capture c = std::move(capture());
  capture() = {};
  *graph = nullptr;
  if (c.offence.empty() && !c.graph->live.empty()) {
    size_t bytes = 0;
    for (void* p : c.graph->live) bytes += memory().blocks[reinterpret_cast<uintptr_t>(p)];
    c.offence = titan::str_cat(c.graph->live.size(), " cudaMallocAsync (", bytes,
                               " bytes) not freed inside the capture (memory a graph allocates lives only "
                               "while it runs: allocate what outlives it before capturing)");
  }
  if (!c.offence.empty())
    return failed(cudaErrorStreamCaptureInvalidated, "the stream capture was invalidated by " + c.offence);
  *graph = reinterpret_cast<cudaGraph_t>(new GraphRef(std::move(c.graph)));
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  *status = !capturing(stream)          ? cudaStreamCaptureStatusNone
            : capture().offence.empty() ? cudaStreamCaptureStatusActive
                                        : cudaStreamCaptureStatusInvalidated;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  if (!graph) return failed(cudaErrorInvalidValue, "cudaGraphInstantiate of a null graph");
  *exec = reinterpret_cast<cudaGraphExec_t>(new GraphRef(*reinterpret_cast<GraphRef*>(graph)));
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (!exec) return failed(cudaErrorInvalidValue, "cudaGraphLaunch of a null graph");
  GraphRef g = *reinterpret_cast<GraphRef*>(exec);
  auto run = [g] {
    ++titan::cuda_sim::graph_launches;
    for (auto& node : g->nodes) node();
  };
  if (titan::cuda_sim::record_if_capturing(stream, run)) return cudaSuccess;
  if (capture().graph && !stream)
    return rejected_in_capture("cudaGraphLaunch on the legacy stream", kHostSync);
  run();
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete reinterpret_cast<GraphRef*>(exec);
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete reinterpret_cast<GraphRef*>(graph);
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = sim_device_count();
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= sim_device_count())
    return failed(cudaErrorInvalidDevice, titan::str_cat("cudaSetDevice(", device, "): ", sim_device_count(),
                                                         " emulated GPU(s) (TITAN_CUDA_SIM_GPUS)"));
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device < 0 || device >= sim_device_count())
    return failed(cudaErrorInvalidDevice, "cudaGetDeviceProperties");
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "CUDA emulator (CPU)");
  prop->totalGlobalMem = kGpuBytes;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 1;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->sharedMemPerBlock = 48 << 10;
  prop->sharedMemPerBlockOptin = 227 << 10;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) {
  const cudaError_t e = titan::cuda_sim::last_error;
  titan::cuda_sim::last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) {
  return titan::cuda_sim::last_error;
}
const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorStreamCaptureUnsupported:
      return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
      return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorIllegalState:
      return "cudaErrorIllegalState";
    default:
      return "cudaError";
  }
}
const char* cudaGetErrorString(cudaError_t e) {
  if (e != cudaSuccess && !titan::cuda_sim::last_detail.empty()) return titan::cuda_sim::last_detail.c_str();
  return cudaGetErrorName(e);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  *stream = reinterpret_cast<cudaStream_t>(new SimStream);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (!stream) return cudaSuccess;
  delete reinterpret_cast<SimStream*>(stream);  // (held work is dropped: CUDA frees it once done)
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (capture().graph && (capturing(stream) || !stream))
    return rejected_in_capture("cudaStreamSynchronize", kHostSync);
  SimStream& s = sim_stream(stream);
  s.finish_until(s.issued);
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  *event = reinterpret_cast<cudaEvent_t>(new SimEvent);
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete reinterpret_cast<SimEvent*>(event);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  SimEvent* e = reinterpret_cast<SimEvent*>(event);
  e->in_capture = capturing(stream);
  if (titan::cuda_sim::record_if_capturing(stream, [e, stream] {
        e->stream = &sim_stream(stream);
        e->at = e->stream->issued;
        e->when = std::chrono::steady_clock::now();
      }))
    return cudaSuccess;
  e->stream = &sim_stream(stream);
  e->at = e->stream->issued;
  e->when = std::chrono::steady_clock::now();
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  const SimEvent *a = reinterpret_cast<SimEvent*>(start), *b = reinterpret_cast<SimEvent*>(end);
  if (!a->stream || !b->stream) return cudaErrorInvalidResourceHandle;  // (never recorded)
  *ms = std::chrono::duration<float, std::milli>(b->when - a->when).count();
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  SimEvent* e = reinterpret_cast<SimEvent*>(event);
  if (capture().graph && e->in_capture) return rejected_in_capture("cudaEventSynchronize", kHostSync);
  if (e->stream) e->stream->finish_until(e->at);
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  SimEvent* e = reinterpret_cast<SimEvent*>(event);
  if (capture().graph && e->in_capture) return rejected_in_capture("cudaEventQuery", kHostSync);
  return !e->stream || e->stream->test_until(e->at) ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t event, unsigned int) {
  return cudaEventSynchronize(event);
}
cudaError_t cudaDeviceSynchronize(void) {
  if (capture().graph) return rejected_in_capture("cudaDeviceSynchronize", kHostSync);
  return cudaSuccess;
}
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int) {
  static int token;
  *pool = reinterpret_cast<cudaMemPool_t>(&token);
  return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr, void*) {
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  auto& m = memory();
  std::lock_guard<std::mutex> g(m.mu);
  *total = kGpuBytes;
  *free_bytes = kGpuBytes - std::min(m.in_use, kGpuBytes);
  return cudaSuccess;
}

constexpr const char* kNotStreamOrdered =
    "it synchronizes the device; inside a graph, memory comes from cudaMallocAsync on the capturing stream";
cudaError_t cudaMalloc(void** p, size_t n) {
  if (capture().graph)
    return rejected_in_capture(titan::str_cat("cudaMalloc of ", n, " bytes"), kNotStreamOrdered);
  return sim_malloc(p, n);
}
// Inside a capture: allocated now, at an address the graph keeps for every launch, freed with the graph
// (a graph's allocation node); its cudaFreeAsync in the capture is then the graph's to do.
cudaError_t cudaMallocAsync(void** p, size_t n, cudaStream_t stream) {
  if (capture().graph && !stream)
    return rejected_in_capture("cudaMallocAsync on the legacy stream", kNotStreamOrdered);
  const cudaError_t e = sim_malloc(p, n);
  if (e == cudaSuccess && capturing(stream)) {
    capture().graph->owned.push_back(*p);
    capture().graph->live.push_back(*p);
  }
  return e;
}
cudaError_t cudaFree(void* p) {
  if (capture().graph) return rejected_in_capture("cudaFree", kNotStreamOrdered);
  return sim_free(p);
}
cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
  if (capturing(stream)) {
    auto& live = capture().graph->live;
    if (auto it = std::find(live.begin(), live.end(), p); it != live.end()) {
      live.erase(it);
      return cudaSuccess;
    }
    return rejected_in_capture("cudaFreeAsync of memory allocated before the capture",
                               "a graph launched twice would free it twice");
  }
  if (capture().graph && !stream)
    return rejected_in_capture("cudaFreeAsync on the legacy stream", kNotStreamOrdered);
  return sim_free(p);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const bool dst_dev = is_device(dst, n), src_dev = is_device(src, n);
  const bool ok = kind == cudaMemcpyHostToDevice     ? dst_dev && !is_device(src, 0)
                  : kind == cudaMemcpyDeviceToHost   ? src_dev && !is_device(dst, 0)
                  : kind == cudaMemcpyDeviceToDevice ? dst_dev && src_dev
                                                     : true;
  if (!ok)
    return failed(cudaErrorInvalidValue,
                  titan::str_cat("cudaMemcpyAsync ", kind_name(kind), " of ", n, " bytes from ", src,
                                 src_dev ? " (device)" : " (not a device range)", " to ", dst,
                                 dst_dev ? " (device)" : " (not a device range)"));
  if (capturing(stream) && kind != cudaMemcpyDeviceToDevice)
    return rejected_in_capture(titan::str_cat("a copy (", kind_name(kind), ", ", n, " bytes) of host memory"),
                               "a copy of pageable host memory happens when it is issued, not when the graph "
                               "runs: stage inputs on the device before the graph, read results after it");
  if (titan::cuda_sim::record_if_capturing(stream, [dst, src, n] { std::memmove(dst, src, n); }))
    return cudaSuccess;
  if (capture().graph && !stream)
    return rejected_in_capture(titan::str_cat("a copy (", kind_name(kind), ") on the legacy stream"),
                               kHostSync);
  std::memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  if (capture().graph)
    return rejected_in_capture(titan::str_cat("cudaMemcpy (", kind_name(kind), ", ", n, " bytes)"),
                               kHostSync);
  return cudaMemcpyAsync(dst, src, n, kind, nullptr);
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (!is_device(p, n))
    return failed(cudaErrorInvalidValue,
                  titan::str_cat("cudaMemsetAsync of ", n, " bytes at ", p, ": not a device range"));
  if (titan::cuda_sim::record_if_capturing(stream, [p, value, n] { std::memset(p, value, n); }))
    return cudaSuccess;
  if (capture().graph && !stream) return rejected_in_capture("a memset on the legacy stream", kHostSync);
  std::memset(p, value, n);
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int value, size_t n) {
  if (capture().graph) return rejected_in_capture(titan::str_cat("cudaMemset (", n, " bytes)"), kHostSync);
  return cudaMemsetAsync(p, value, n, nullptr);
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  if (value < 0 || static_cast<size_t>(value) > titan::cuda_sim::kMaxSmemOptin)
    return failed(cudaErrorInvalidValue,
                  titan::str_cat("cudaFuncSetAttribute(MaxDynamicSharedMemorySize, ", value,
                                 "): the GPU allows up to ", titan::cuda_sim::kMaxSmemOptin));
  std::lock_guard<std::mutex> lock(titan::cuda_sim::launch_mutex);
  titan::cuda_sim::smem_optin()[func] = value;
  return cudaSuccess;
}

}  // extern "C"
