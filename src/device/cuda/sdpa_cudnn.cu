// cuDNN's fused attention behind sdpa_cudnn.h. One cache of graphs keyed by (shape, direction), one
// workspace for all of them, and the one-line report of a shape cuDNN cannot run are shared by both
// engines of this file:
//   - cuDNN (nvcc build with cudnn-frontend's headers, TITAN_CUDNN): a cudnn-frontend SDPA graph per key,
//     built once with heuristics mode A and executed on cuda_stream() through the process's cuDNN handle;
//   - the stand-in (no cuDNN in the build, or the CUDA emulator, which cannot run it): the "graph" holds no
//     cuDNN object and executing it runs the device's own kernels (sdpa_own_forward/backward).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include "core/error.h"
#include "device/cuda/cuda_common.cuh"
#include "device/cuda/sdpa_cudnn.h"

#if defined(TITAN_CUDNN) && !defined(TITAN_CUDA_SIM)
#define TITAN_SDPA_CUDNN 1
#include <cudnn.h>
// (after <cstring>: cudnn-frontend calls std::strlen but includes <cstring> only through its JSON library,
// which CUDNN_FRONTEND_SKIP_JSON_LIB leaves out)
#include <cudnn_frontend.h>
#endif

namespace titan::cuda {
namespace {

enum class Direction { kForward, kBackward };

const char* direction_name(Direction d) {
  return d == Direction::kForward ? "forward" : "backward";
}

std::string describe(const SdpaShape& s) {
  return str_cat("B=", s.B, " T=", s.T, " nH=", s.nH, " nKV=", s.nKV, " hd=", s.hd, " ldq=", s.ldq,
                 " ldk=", s.ldk, " ldv=", s.ldv, " ldo=", s.ldo);
}

// The contract of sdpa_cudnn.h; a violation is the caller's bug, not a shape to fall back on.
void check_shape(const SdpaShape& s) {
  TITAN_CHECK(s.B >= 0 && s.T >= 0 && s.nH > 0 && s.nKV > 0 && s.hd > 0 && s.nH % s.nKV == 0,
              "sdpa: bad shape ", describe(s), " (nH must be a multiple of nKV)");
  TITAN_CHECK(s.ldq >= s.nH * s.hd && s.ldk >= s.nKV * s.hd && s.ldv >= s.nKV * s.hd && s.ldo >= s.nH * s.hd,
              "sdpa: row strides shorter than the rows in ", describe(s));
}

// Multi-line messages (cuDNN lists every plan it tried) become one log line.
std::string one_line(std::string m) {
  for (char& c : m)
    if (c == '\n' || c == '\r') c = ' ';
  return m;
}

void warn_fallback(const std::string& why) {
  std::fprintf(stderr, "titan: warning: cuDNN fused attention: %s; running own attention kernels\n",
               one_line(why).c_str());
}

struct ForwardArgs {
  uint16_t* o;
  float* stats;
  const uint16_t *q, *k, *v;
};
struct BackwardArgs {
  uint16_t *dq, *dk, *dv;
  const uint16_t *dout, *q, *k, *v, *o;
  const float* stats;
};

#ifdef TITAN_SDPA_CUDNN
// ---- cuDNN engine -------------------------------------------------------------------------------------
namespace fe = cudnn_frontend;

// Tensor uids of the variant pack (shared by both graphs; a uid names one buffer per call).
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDout, kDq, kDk, kDv };

struct EngineGraph {
  std::shared_ptr<fe::graph::Graph> graph;
};

struct Engine {
  cudnnHandle_t handle = nullptr;

  // Why fused attention cannot run in this process, or "" when it can (creates the handle).
  std::string init() {
    const size_t version = cudnnGetVersion();
    if (version < 90000) return str_cat("cuDNN ", version, " is older than 9.0");
    // The stream first: it initializes the runtime on the device the handle then belongs to.
    cuda_stream();
    int dev = 0, major = 0, minor = 0;
    TITAN_CUDA_CHECK(cudaGetDevice(&dev));
    TITAN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    TITAN_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    if (major < 8) return str_cat("compute capability ", major, ".", minor, " is below 8.0");
    const cudnnStatus_t st = cudnnCreate(&handle);
    if (st != CUDNN_STATUS_SUCCESS) return str_cat("cudnnCreate failed: ", cudnnGetErrorString(st));
    return "";
  }
};

// Graph-wide types: bf16 tensors, f32 softmax and accumulation.
std::shared_ptr<fe::graph::Graph> new_graph() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

// (B, heads, T, hd) over rows of `ld` elements: element (b, t, h, d) at (b*T + t)*ld + h*hd + d.
fe::graph::Tensor_attributes& rows(fe::graph::Tensor_attributes& t, const SdpaShape& s, int64_t heads,
                                   int64_t ld) {
  return t.set_dim({s.B, heads, s.T, s.hd}).set_stride({s.T * ld, s.hd, ld, 1});
}

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph& g, const char* name, Uid uid,
                                                    const SdpaShape& s, int64_t heads, int64_t ld) {
  fe::graph::Tensor_attributes t;
  t.set_name(name).set_uid(uid);
  return g.tensor(rows(t, s, heads, ld));
}

// The softmax statistics (row logsumexp), (B, nH, T, 1) f32 contiguous.
fe::graph::Tensor_attributes& stats_layout(fe::graph::Tensor_attributes& t, const SdpaShape& s) {
  return t.set_data_type(fe::DataType_t::FLOAT)
      .set_dim({s.B, s.nH, s.T, 1})
      .set_stride({s.nH * s.T, s.T, 1, 1});
}

// Causal with the diagonal at the top left (query t sees keys <= t), scale hd^-0.5: the same settings
// for both directions' attributes.
template <class Attributes>
Attributes& attention_options(Attributes& a, const SdpaShape& s) {
  return a.set_attn_scale(1.0f / std::sqrt(static_cast<float>(s.hd)))
      .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
      .set_diagonal_band_right_bound(0);
}

std::shared_ptr<fe::graph::Graph> forward_graph(const SdpaShape& s) {
  auto g = new_graph();
  auto q = input(*g, "q", kQ, s, s.nH, s.ldq);
  auto k = input(*g, "k", kK, s, s.nKV, s.ldk);
  auto v = input(*g, "v", kV, s, s.nKV, s.ldv);
  fe::graph::SDPA_attributes options;
  attention_options(options.set_name("sdpa_forward").set_generate_stats(true), s);
  auto [o, stats] = g->sdpa(q, k, v, options);
  rows(o->set_output(true).set_uid(kO), s, s.nH, s.ldo);
  stats_layout(stats->set_output(true).set_uid(kStats), s);
  return g;
}

std::shared_ptr<fe::graph::Graph> backward_graph(const SdpaShape& s) {
  auto g = new_graph();
  auto q = input(*g, "q", kQ, s, s.nH, s.ldq);
  auto k = input(*g, "k", kK, s, s.nKV, s.ldk);
  auto v = input(*g, "v", kV, s, s.nKV, s.ldv);
  auto o = input(*g, "o", kO, s, s.nH, s.ldo);
  auto dout = input(*g, "dout", kDout, s, s.nH, s.ldo);
  fe::graph::Tensor_attributes stats_in;
  stats_in.set_name("stats").set_uid(kStats);
  auto stats = g->tensor(stats_layout(stats_in, s));
  fe::graph::SDPA_backward_attributes options;
  // Deterministic: dQ without atomics, so a step's gradients repeat bit for bit (a resumed run equals the
  // uninterrupted one, replays equal eager steps).
  attention_options(options.set_name("sdpa_backward").set_deterministic_algorithm(true), s);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, options);
  rows(dq->set_output(true).set_uid(kDq), s, s.nH, s.ldq);
  rows(dk->set_output(true).set_uid(kDk), s, s.nKV, s.ldk);
  rows(dv->set_output(true).set_uid(kDv), s, s.nKV, s.ldv);
  return g;
}

// Builds the graph of (s, dir) into `out`; false with cuDNN's message in `error` when cuDNN cannot run it.
bool build_graph(Engine& engine, const SdpaShape& s, Direction dir, EngineGraph& out,
                 int64_t& workspace_bytes, std::string& error) {
  try {
    auto g = dir == Direction::kForward ? forward_graph(s) : backward_graph(s);
    const std::pair<const char*, std::function<fe::error_t()>> steps[] = {
        {"validate", [&] { return g->validate(); }},
        {"build_operation_graph", [&] { return g->build_operation_graph(engine.handle); }},
        {"create_execution_plans", [&] { return g->create_execution_plans({fe::HeurMode_t::A}); }},
        {"check_support", [&] { return g->check_support(); }},
        {"build_plans", [&] { return g->build_plans(); }},
        {"get_workspace_size", [&] { return g->get_workspace_size(workspace_bytes); }},
    };
    for (const auto& [what, step] : steps) {
      fe::error_t st = step();
      if (st.is_bad()) {
        error = str_cat(what, ": ", st.get_message());
        return false;
      }
    }
    out.graph = std::move(g);
    return true;
  } catch (const std::exception& e) {  // the frontend throws on some backend failures
    error = e.what();
    return false;
  }
}

void execute_graph(Engine& engine, const EngineGraph& g, std::unordered_map<int64_t, void*>& pack,
                   void* workspace, const SdpaShape& s, Direction dir) {
  const cudnnStatus_t st = cudnnSetStream(engine.handle, cuda_stream());
  TITAN_CHECK(st == CUDNN_STATUS_SUCCESS, "cudnnSetStream failed: ", cudnnGetErrorString(st));
  fe::error_t err = g.graph->execute(engine.handle, pack, workspace);
  TITAN_CHECK(err.is_good(), "cuDNN fused attention ", direction_name(dir), " failed for ", describe(s), ": ",
              one_line(err.get_message()));
}

// cuDNN reads the inputs through non-const pointers.
void* in(const void* p) {
  return const_cast<void*>(p);
}

void execute(Engine& engine, const EngineGraph& g, const SdpaShape& s, const ForwardArgs& a,
             void* workspace) {
  std::unordered_map<int64_t, void*> pack = {
      {kQ, in(a.q)}, {kK, in(a.k)}, {kV, in(a.v)}, {kO, a.o}, {kStats, a.stats}};
  execute_graph(engine, g, pack, workspace, s, Direction::kForward);
}

void execute(Engine& engine, const EngineGraph& g, const SdpaShape& s, const BackwardArgs& a,
             void* workspace) {
  std::unordered_map<int64_t, void*> pack = {{kQ, in(a.q)}, {kK, in(a.k)},       {kV, in(a.v)},
                                             {kO, in(a.o)}, {kDout, in(a.dout)}, {kStats, in(a.stats)},
                                             {kDq, a.dq},   {kDk, a.dk},         {kDv, a.dv}};
  execute_graph(engine, g, pack, workspace, s, Direction::kBackward);
}

constexpr const char* kEngineName = "cudnn";
#else
// ---- stand-in engine: the own kernels behind the same cache ---------------------------------------------
struct EngineGraph {};

struct Engine {
  std::string init() { return ""; }
};

bool build_graph(Engine&, const SdpaShape&, Direction, EngineGraph&, int64_t& workspace_bytes, std::string&) {
  workspace_bytes = 0;
  return true;
}

void execute(Engine&, const EngineGraph&, const SdpaShape& s, const ForwardArgs& a, void*) {
  sdpa_own_forward(s, a.o, a.stats, a.q, a.k, a.v);
}

void execute(Engine&, const EngineGraph&, const SdpaShape& s, const BackwardArgs& a, void*) {
  sdpa_own_backward(s, a.dq, a.dk, a.dv, a.dout, a.q, a.k, a.v, a.o, a.stats);
}

constexpr const char* kEngineName = "stand-in";
#endif

// ---- the cache, shared by both engines --------------------------------------------------------------------
struct CachedGraph {
  EngineGraph graph;
  int64_t workspace_bytes = 0;
};

struct Cache {
  std::mutex mu;  // held through execution too: the handle and the workspace serve one call at a time
  Engine engine;
  std::optional<std::string> unusable;  // set on first use: why the engine cannot run here ("" if it can)
  // nullopt: cuDNN cannot run this shape (reported once, when its build failed).
  std::map<std::pair<SdpaShape, Direction>, std::optional<CachedGraph>> graphs;
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  int64_t built = 0;
};

Cache& cache() {
  static Cache* c = new Cache;  // never destroyed: calls may come from other static destructors
  return *c;
}

// One buffer serves every graph, so it grows to the largest graph's need (at build time, never per call).
void reserve_workspace(Cache& c, int64_t bytes) {
  if (bytes <= c.workspace_bytes) return;
  if (c.workspace) {
    // Work already enqueued on the stream may still be using the old buffer.
    TITAN_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
    TITAN_CUDA_CHECK(cudaFree(c.workspace));
    c.workspace = nullptr;
    c.workspace_bytes = 0;
  }
  TITAN_CUDA_CHECK(cudaMalloc(&c.workspace, static_cast<size_t>(bytes)));
  c.workspace_bytes = bytes;
}

// The graph of (s, dir), built on first use; nullptr when the engine cannot run it (reported once).
const CachedGraph* find_or_build(Cache& c, const SdpaShape& s, Direction dir) {
  if (!c.unusable) {
    c.unusable = c.engine.init();
    if (!c.unusable->empty()) warn_fallback(*c.unusable);
  }
  if (!c.unusable->empty()) return nullptr;
  const auto key = std::make_pair(s, dir);
  if (auto it = c.graphs.find(key); it != c.graphs.end()) return it->second ? &*it->second : nullptr;
  std::optional<CachedGraph> entry;
  CachedGraph g;
  std::string error;
  if (build_graph(c.engine, s, dir, g.graph, g.workspace_bytes, error)) {
    reserve_workspace(c, g.workspace_bytes);
    ++c.built;
    entry = std::move(g);
  } else {
    warn_fallback(str_cat(direction_name(dir), " of ", describe(s), " unsupported (", error, ")"));
  }
  auto& slot = c.graphs.emplace(key, std::move(entry)).first->second;
  return slot ? &*slot : nullptr;
}

template <class Args>
bool run(const SdpaShape& s, Direction dir, const Args& args) {
  check_shape(s);
  if (s.B == 0 || s.T == 0) return true;  // nothing to compute
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  const CachedGraph* g = find_or_build(c, s, dir);
  if (!g) return false;
  execute(c.engine, g->graph, s, args, c.workspace);
  return true;
}

}  // namespace

bool sdpa_forward(const SdpaShape& s, uint16_t* o, float* stats, const uint16_t* q, const uint16_t* k,
                  const uint16_t* v) {
  return run(s, Direction::kForward, ForwardArgs{o, stats, q, k, v});
}

bool sdpa_backward(const SdpaShape& s, uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout,
                   const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* o,
                   const float* stats) {
  return run(s, Direction::kBackward, BackwardArgs{dq, dk, dv, dout, q, k, v, o, stats});
}

const char* sdpa_engine() {
  return kEngineName;
}

int64_t sdpa_graphs_built() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.built;
}

}  // namespace titan::cuda
