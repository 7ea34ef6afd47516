// Checks of every collective and of DDP / FSDP / HSDP / clipping / sharded AdamW / expert exchange.
// Reference values are computed locally on every rank (a tiny Qwen3 model on the global batch stands in
// for the 1-rank run), so one run checks the whole distributed path.
#include "distributed/selftest.h"

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <ostream>
#include <sstream>
#include <thread>
#include <vector>

#include "core/error.h"
#include "distributed/data_parallel.h"
#include "distributed/data_parallel_plan.h"
#include "distributed/expert_parallel.h"
#include "distributed/runtime.h"
#include "distributed/tensor_parallel.h"
#include "models/qwen3/model.h"
#include "optim/optimizer.h"

namespace titan::dist {

namespace {

struct Checker {
  ProcessGroup& world;
  std::ostream& log;
  bool verbose;
  int failed = 0, passed = 0;

  // Records one check; `err` is the maximum error against the reference.
  void expect(const std::string& name, double err, double tol) {
    const bool ok = std::isfinite(err) && err <= tol;
    if (ok)
      ++passed;
    else
      ++failed;
    if (!ok || verbose) {
      // One write per line: ranks share the terminal/pipe, and small writes do not interleave.
      std::ostringstream line;
      line << rank_prefix() << (ok ? "ok   " : "FAIL ") << name << ": error " << err << " (tolerance " << tol
           << ")\n";
      log << line.str() << std::flush;
    }
  }
};

template <class T>
double max_abs_diff(const T* a, const std::vector<double>& ref) {
  double e = 0;
  for (size_t i = 0; i < ref.size(); ++i) e = std::max(e, std::abs(double(a[i]) - ref[i]));
  return e;
}

// ||a - b|| / ||b|| over n floats.
double rel_err(const float* a, const float* b, int64_t n) {
  double d = 0, r = 0;
  for (int64_t i = 0; i < n; ++i) {
    d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    r += double(b[i]) * b[i];
  }
  return r > 0 ? std::sqrt(d / r) : std::sqrt(d);
}

void check_collectives(Checker& c) {
  ProcessGroup& w = c.world;
  const int N = w.size(), me = w.rank();
  // all_reduce on f32 and f64 with every op.
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
    const int n = 1000;
    std::vector<float> f(n);
    std::vector<double> d(n), ref(n);
    for (int i = 0; i < n; ++i) {
      f[i] = float(me + 1) + 0.5f * i;
      d[i] = f[i];
      double sum = 0, mx = -1e300, mn = 1e300;
      for (int r = 0; r < N; ++r) {
        const double v = double(r + 1) + 0.5 * i;
        sum += v;
        mx = std::max(mx, v);
        mn = std::min(mn, v);
      }
      ref[i] = op == ReduceOp::Sum ? sum : op == ReduceOp::Avg ? sum / N : op == ReduceOp::Max ? mx : mn;
    }
    w.all_reduce(f.data(), n, op);
    w.all_reduce(d.data(), n, op);
    c.expect(std::string("all_reduce f32 ") + reduce_op_name(op), max_abs_diff(f.data(), ref), 1e-3);
    c.expect(std::string("all_reduce f64 ") + reduce_op_name(op), max_abs_diff(d.data(), ref), 1e-9);
  }
  // reduce_scatter with uneven counts (rank r receives r+2 elements).
  {
    std::vector<int64_t> counts(N);
    int64_t total = 0;
    for (int r = 0; r < N; ++r) total += counts[r] = r + 2;
    std::vector<float> send(total), recv(counts[me]);
    for (int64_t j = 0; j < total; ++j) send[j] = float(me * 1000 + j);
    w.reduce_scatter(send.data(), recv.data(), counts, CommType::F32, ReduceOp::Sum);
    int64_t displ = 0;
    for (int r = 0; r < me; ++r) displ += counts[r];
    std::vector<double> ref(counts[me]);
    for (int64_t k = 0; k < counts[me]; ++k)
      for (int r = 0; r < N; ++r) ref[k] += r * 1000 + displ + k;
    c.expect("reduce_scatter (uneven)", max_abs_diff(recv.data(), ref), 1e-3);
  }
  // all_gather with uneven counts, out of place and in place.
  {
    std::vector<int64_t> counts(N);
    int64_t total = 0;
    for (int r = 0; r < N; ++r) total += counts[r] = r + 1;
    std::vector<float> send(counts[me]), recv(total, -1.0f);
    for (int k = 0; k < counts[me]; ++k) send[k] = float(me * 100 + k);
    std::vector<double> ref;
    for (int r = 0; r < N; ++r)
      for (int k = 0; k < counts[r]; ++k) ref.push_back(r * 100 + k);
    w.all_gather(send.data(), recv.data(), counts, CommType::F32);
    c.expect("all_gather (uneven)", max_abs_diff(recv.data(), ref), 0);
    std::vector<float> inplace(total, -1.0f);
    const int64_t displ = me * (me + 1) / 2;
    for (int k = 0; k < counts[me]; ++k) inplace[displ + k] = send[k];
    w.all_gather(inplace.data() + displ, inplace.data(), counts, CommType::F32);
    c.expect("all_gather (in place)", max_abs_diff(inplace.data(), ref), 0);
  }
  // broadcast from the last rank, f64 and bf16 (moved as raw 16-bit words).
  {
    std::vector<double> d(17);
    std::vector<uint16_t> h(9);
    for (int i = 0; i < 17; ++i) d[i] = me == N - 1 ? 3.25 * i : -1;
    for (int i = 0; i < 9; ++i) h[i] = me == N - 1 ? uint16_t(1000 + i) : 0;
    w.broadcast(d.data(), 17, CommType::F64, N - 1);
    w.broadcast(h.data(), 9, CommType::BF16, N - 1);
    std::vector<double> ref(17), href(9);
    for (int i = 0; i < 17; ++i) ref[i] = 3.25 * i;
    for (int i = 0; i < 9; ++i) href[i] = 1000 + i;
    c.expect("broadcast f64", max_abs_diff(d.data(), ref), 0);
    c.expect("broadcast bf16", max_abs_diff(h.data(), href), 0);
  }
  // all_to_all: block r of rank s arrives as block s on rank r.
  {
    const int k = 3;
    std::vector<int32_t> send(N * k), recv(N * k);
    std::vector<double> ref(N * k);
    for (int r = 0; r < N; ++r)
      for (int j = 0; j < k; ++j) {
        send[r * k + j] = me * 100 + r * 10 + j;
        ref[r * k + j] = r * 100 + me * 10 + j;
      }
    w.all_to_all(send.data(), recv.data(), k, CommType::I32);
    c.expect("all_to_all i32", max_abs_diff(recv.data(), ref), 0);
  }
  // all_to_all_v: rank s sends (s + r) % 3 elements to rank r (zero-length blocks included).
  {
    std::vector<int64_t> sc(N), rc(N);
    std::vector<float> send;
    std::vector<double> ref;
    for (int r = 0; r < N; ++r) {
      sc[r] = (me + r) % 3;
      rc[r] = (r + me) % 3;
      for (int j = 0; j < sc[r]; ++j) send.push_back(float(me * 1000 + r * 100 + j));
      for (int j = 0; j < rc[r]; ++j) ref.push_back(r * 1000 + me * 100 + j);
    }
    std::vector<float> recv(ref.size() + 1);
    w.all_to_all_v(send.data(), sc, recv.data(), rc, CommType::F32);
    c.expect("all_to_all_v f32", max_abs_diff(recv.data(), ref), 0);
  }
  w.barrier();
  c.expect("barrier", 0, 0);
}

void check_ddp_buckets(Checker& c) {
  ProcessGroup& w = c.world;
  const int N = w.size(), me = w.rank();
  // Small and large buffers with a 4 KiB bucket: coalesced buckets and in-place chunks.
  std::vector<int64_t> sizes = {7, 3000, 3, 50, 10000, 1};
  std::vector<Tensor> grads;
  for (size_t t = 0; t < sizes.size(); ++t) {
    grads.push_back(Tensor::empty({sizes[t]}));
    for (int64_t i = 0; i < sizes[t]; ++i) grads[t].f32()[i] = float((me + 1) * (i % 97 + t));
  }
  DdpReducer ddp(w, grads, 4096);
  ddp.all_reduce_mean();
  double err = 0;
  for (size_t t = 0; t < sizes.size(); ++t)
    for (int64_t i = 0; i < sizes[t]; ++i)
      err = std::max(err, std::abs(grads[t].f32()[i] - (N + 1) / 2.0 * double(i % 97 + t)));
  c.expect("ddp bucketed all-reduce = mean (" + std::to_string(ddp.num_buckets()) + " buckets)", err, 1e-3);
}

// A tiny Qwen3 so the data-parallel checks run real forward/backward passes in milliseconds.
Qwen3Config tiny_config() {
  Qwen3Config cfg;
  cfg.vocab_size = 96;
  cfg.hidden_size = 32;
  cfg.intermediate_size = 48;
  cfg.num_hidden_layers = 2;
  cfg.num_attention_heads = 4;
  cfg.num_key_value_heads = 2;
  cfg.head_dim = 8;
  cfg.tie_word_embeddings = false;
  cfg.max_position_embeddings = 64;
  cfg.bos_token_id = cfg.eos_token_id = 0;
  return cfg;
}

// n pseudo-random token ids and labels in [0, vocab) from `seed` (the same on every rank).
void random_tokens(int64_t n, int64_t vocab, uint64_t seed, std::vector<int32_t>& ids,
                   std::vector<int32_t>& labels) {
  ids.resize(n);
  labels.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    ids[i] = int32_t((seed >> 33) % vocab);
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    labels[i] = int32_t((seed >> 33) % vocab);
  }
}

void check_data_parallel_model(Checker& c) {
  ProcessGroup& w = c.world;
  const int N = w.size(), me = w.rank();
  const Qwen3Config cfg = tiny_config();
  const int64_t B = 2, T = 8;
  // The global batch: B rows per rank; rank r's rows are rows [r*B, (r+1)*B).
  std::vector<int32_t> ids, labels;
  random_tokens(N * B * T, cfg.vocab_size, 12345, ids, labels);
  const int32_t* my_ids = ids.data() + me * B * T;
  const int32_t* my_labels = labels.data() + me * B * T;

  // The 1-rank reference: the whole global batch on one model (HF mean over all targets).
  Qwen3Model ref(cfg);
  ref.init_weights(7);
  ref.zero_grad();
  ref.forward(ids.data(), labels.data(), N * B, T);
  ref.backward();
  const double ref_norm = std::sqrt(grad_sq_norm(ref.flat_grads()));

  // DDP: local batch, averaged gradients (equal targets per rank, so the mean of means is the mean).
  // Every rank starts from rank 0's parameters (other ranks initialise with a different seed).
  {
    Qwen3Model m(cfg);
    m.init_weights(me == 0 ? 7 : 100 + me);
    c.expect("replicas differ before the broadcast", N > 1 && replicas_in_sync(w, m.flat_params()) ? 1 : 0,
             0);
    broadcast_tensors(w, m.flat_params(), 0);
    c.expect("replicas in sync after broadcast_tensors", replicas_in_sync(w, m.flat_params()) ? 0 : 1, 0);
    m.zero_grad();
    m.forward(my_ids, my_labels, B, T);
    m.backward();
    DdpReducer ddp(w, m.flat_grads(), 16 << 10);
    ddp.all_reduce_mean();
    double err = 0;
    for (size_t g = 0; g < ref.flat_grads().size(); ++g)
      err = std::max(
          err, rel_err(m.flat_grads()[g].f32(), ref.flat_grads()[g].f32(), ref.flat_grads()[g].numel()));
    c.expect("ddp model gradients = 1-rank gradients", err, 2e-5);
    c.expect("ddp replicas in sync after all-reduce", replicas_in_sync(w, m.flat_grads()) ? 0 : 1, 0);
    const double norm = global_grad_norm(m.flat_grads(), nullptr);
    c.expect("ddp global grad norm = 1-rank norm", std::abs(norm - ref_norm) / ref_norm, 1e-5);
  }

  // FSDP: gather -> forward/backward -> reduce-scatter; clipping over shards; sharded AdamW.
  {
    Qwen3Model m(cfg);
    m.init_weights(7);
    FsdpShards fsdp(w, m.flat_params(), m.flat_grads());
    for (auto& p : m.flat_params()) p.zero_();  // the gather alone must restore the parameters
    fsdp.gather_all_params();
    double perr = 0;
    for (size_t g = 0; g < ref.flat_params().size(); ++g)
      perr = std::max(
          perr, rel_err(m.flat_params()[g].f32(), ref.flat_params()[g].f32(), ref.flat_params()[g].numel()));
    c.expect("fsdp all-gather restores parameters", perr, 0);
    m.zero_grad();
    m.forward(my_ids, my_labels, B, T);
    m.backward();
    fsdp.reduce_scatter_all_grads();
    double gerr = 0;
    for (int g = 0; g < fsdp.num_groups(); ++g) {
      const int64_t v = fsdp.shard_valid(g);
      gerr = std::max(
          gerr, rel_err(fsdp.shard_grads()[g].f32(), ref.flat_grads()[g].f32() + fsdp.shard_offset(g), v));
      for (int64_t i = v; i < fsdp.shard_numel(g); ++i)  // padding stays zero
        gerr = std::max(gerr, double(std::abs(fsdp.shard_grads()[g].f32()[i])));
    }
    c.expect("fsdp reduce-scattered gradients = 1-rank gradient shards", gerr, 2e-5);

    // Clip to half the norm on both sides, then two AdamW steps: sharded and unsharded must agree.
    const double max_norm = 0.5 * ref_norm;
    const double norm = clip_grad_norm(fsdp.shard_grads(), max_norm, &fsdp.shard_group());
    c.expect("fsdp global grad norm (shard sums) = 1-rank norm", std::abs(norm - ref_norm) / ref_norm, 1e-5);
    titan::clip_grad_norm(ref.flat_grads(), max_norm);
    AdamWConfig acfg;
    acfg.lr = 1e-2f;
    AdamW sharded(fsdp.shard_params(), fsdp.shard_grads(), acfg);
    AdamW full(ref.flat_params(), ref.flat_grads(), acfg);
    for (int step = 0; step < 2; ++step) {
      sharded.step(acfg.lr);
      full.step(acfg.lr);
    }
    fsdp.gather_all_params();
    double aerr = 0;
    for (size_t g = 0; g < ref.flat_params().size(); ++g)
      aerr = std::max(
          aerr, rel_err(m.flat_params()[g].f32(), ref.flat_params()[g].f32(), ref.flat_params()[g].numel()));
    c.expect("sharded AdamW = unsharded AdamW", aerr, 1e-5);
  }
}

// DataParallelPlan in every layout the world allows: one clipped AdamW step from rank 0's parameters
// must give the parameters of the same step on one rank over the global batch.
void check_plans(Checker& c) {
  ProcessGroup& w = c.world;
  const int N = w.size(), me = w.rank();
  const Qwen3Config cfg = tiny_config();
  const int64_t B = 2, T = 8;
  std::vector<int32_t> ids(N * B * T), labels(N * B * T);
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = int32_t((i * 7919 + 13) % cfg.vocab_size);
    labels[i] = int32_t((i * 104729 + 5) % cfg.vocab_size);
  }
  AdamWConfig acfg;
  acfg.lr = 1e-2f;
  Qwen3Model ref(cfg);
  ref.init_weights(7);
  ref.zero_grad();
  ref.forward(ids.data(), labels.data(), N * B, T);
  ref.backward();
  const double max_norm = 0.5 * std::sqrt(grad_sq_norm(ref.flat_grads()));
  titan::clip_grad_norm(ref.flat_grads(), max_norm);
  AdamW ref_opt(ref.flat_params(), ref.flat_grads(), acfg);
  ref_opt.step(acfg.lr);

  std::vector<std::pair<int, int>> layouts = {{N, 1}};
  if (N > 1) layouts.push_back({1, N});
  if (N % 2 == 0 && N >= 4) layouts.push_back({2, N / 2});
  for (auto [R, S] : layouts) {
    Qwen3Model m(cfg);
    m.init_weights(me == 0 ? 7 : 100 + me);
    DataParallelPlan dp(w, R, S, m.flat_params(), m.flat_grads(), 8 << 10);
    dp.broadcast_from(0);
    m.zero_grad();
    m.forward(ids.data() + me * B * T, labels.data() + me * B * T, B, T);
    m.backward();
    dp.reduce_grads();
    dp.clip_grad_norm(max_norm);
    AdamW opt(dp.optimizer_params(), dp.optimizer_grads(), acfg);
    opt.step(acfg.lr);
    dp.after_optimizer_step();
    double err = 0;
    for (size_t g = 0; g < ref.flat_params().size(); ++g)
      err = std::max(
          err, rel_err(m.flat_params()[g].f32(), ref.flat_params()[g].f32(), ref.flat_params()[g].numel()));
    c.expect("plan " + dp.describe() + ": clipped AdamW step = 1-rank step", err, 1e-5);
  }
}

// HSDP on a 2-D mesh, with the owned (ZeRO-3 memory) mode of FsdpShards.
void check_hsdp(Checker& c) {
  ProcessGroup& w = c.world;
  const int N = w.size(), me = w.rank();
  const int shard_size = N % 2 == 0 && N >= 4 ? N / 2 : (N % 2 == 0 ? 1 : N);
  HsdpMesh mesh = make_hsdp_mesh(w, shard_size);
  c.expect("hsdp mesh sizes",
           std::abs(mesh.shard->size() - shard_size) + std::abs(mesh.replicate->size() - N / shard_size), 0);
  const std::vector<int64_t> numels = {10, 37, 4};
  FsdpShards fsdp(*mesh.shard, numels, mesh.replicate.get());
  // Parameters: full values v_g[i] = g + i/100 loaded into shards, then gathered into owned buffers.
  std::vector<Tensor> full;
  for (size_t g = 0; g < numels.size(); ++g) {
    full.push_back(Tensor::empty({numels[g]}));
    for (int64_t i = 0; i < numels[g]; ++i) full[g].f32()[i] = float(g) + i / 100.0f;
  }
  fsdp.load_shards(full);
  double perr = 0;
  for (int g = 0; g < fsdp.num_groups(); ++g) {
    fsdp.gather_params(g);
    perr = std::max(perr, rel_err(fsdp.full_params(g).f32(), full[g].f32(), numels[g]));
    fsdp.release_params(g);
  }
  c.expect("hsdp gather (owned buffers)", perr, 0);
  // Gradients: rank r contributes (r+1) * (i+1); the mean over all N ranks is (N+1)/2 * (i+1).
  double gerr = 0, sq = 0;
  for (int g = 0; g < fsdp.num_groups(); ++g) {
    Tensor fg = fsdp.full_grads(g);
    for (int64_t i = 0; i < numels[g]; ++i) {
      fg.f32()[i] = float((me + 1) * (i + 1));
      sq += std::pow((N + 1) / 2.0 * (i + 1), 2);
    }
    fsdp.reduce_scatter_grads(g);
    for (int64_t i = 0; i < fsdp.shard_valid(g); ++i)
      gerr = std::max(
          gerr, std::abs(fsdp.shard_grads()[g].f32()[i] - (N + 1) / 2.0 * (fsdp.shard_offset(g) + i + 1)));
  }
  c.expect("hsdp reduce-scatter + replica average = global mean", gerr, 1e-4);
  const double norm = global_grad_norm(fsdp.shard_grads(), mesh.shard.get());
  c.expect("hsdp grad norm (shard group only)", std::abs(norm - std::sqrt(sq)) / std::sqrt(sq), 1e-6);
}

// Expert parallel: a toy permutation. Row i of rank s goes to rank (s + i) % N, which multiplies it by
// (its rank + 1); combine brings it back. Backward: the gradient of each row is dy * (dest + 1).
void check_expert_exchange(Checker& c) {
  ProcessGroup& w = c.world;
  const int N = w.size(), me = w.rank();
  const int64_t rows = 5 + me, D = 3;
  std::vector<int> dest(rows);
  for (int64_t i = 0; i < rows; ++i) dest[i] = int((me + i * (i + 1) / 2) % N);
  auto [order, counts] = group_rows_by_destination(dest, N);
  std::vector<float> packed(rows * D), dy(rows * D);
  for (int64_t p = 0; p < rows; ++p)
    for (int64_t k = 0; k < D; ++k) {
      packed[p * D + k] = float(me * 100 + order[p] + 0.25 * k);
      dy[p * D + k] = float(1 + order[p] + k);
    }
  AllToAllExchange ex(w, counts, D);
  std::vector<float> recv(ex.total_recv() * D), back(rows * D);
  ex.dispatch(packed.data(), recv.data());
  for (float& v : recv) v *= float(me + 1);  // the "expert"
  ex.combine(recv.data(), back.data());
  double ferr = 0, berr = 0;
  for (int64_t p = 0; p < rows; ++p)
    for (int64_t k = 0; k < D; ++k)
      ferr = std::max(ferr, double(std::abs(back[p * D + k] - packed[p * D + k] * (dest[order[p]] + 1))));
  c.expect("expert exchange forward (dispatch, expert, combine)", ferr, 1e-3);
  // Backward of y = combine(f(dispatch(x))): dx = combine(f'(dispatch(dy))).
  std::vector<float> g_recv(ex.total_recv() * D), dx(rows * D);
  ex.dispatch(dy.data(), g_recv.data());
  for (float& v : g_recv) v *= float(me + 1);
  ex.combine(g_recv.data(), dx.data());
  for (int64_t p = 0; p < rows; ++p)
    for (int64_t k = 0; k < D; ++k)
      berr = std::max(berr, double(std::abs(dx[p * D + k] - dy[p * D + k] * (dest[order[p]] + 1))));
  c.expect("expert exchange backward", berr, 1e-4);
}

// Expert parallel on a tiny MoE (every layer sparse, aux loss on): for every degree e > 1 that divides the
// world and the experts, (1) each rank's expert slice initialises to the same experts of a full model,
// (2) forward/backward on the rank's own tokens gives the full model's loss and non-expert gradients and,
// for the local experts, the sum of the full model's expert gradients over the group's tokens, (3) the
// gathered state dict is the full one, (4) after the plan's reduction the gradients and the global norm
// equal those of plain DDP over full models.
void check_expert_parallel_model(Checker& c) {
  ProcessGroup& w = c.world;
  const int N = w.size(), me = w.rank();
  Qwen3Config cfg = tiny_config();
  cfg.num_experts = 12;
  cfg.num_experts_per_tok = 3;
  cfg.moe_intermediate_size = 16;
  cfg.norm_topk_prob = true;
  cfg.output_router_logits = true;
  const int64_t B = 2, T = 8;
  std::vector<int32_t> ids, labels;
  random_tokens(N * B * T, cfg.vocab_size, 777, ids, labels);
  const int32_t* my_ids = ids.data() + me * B * T;
  const int32_t* my_labels = labels.data() + me * B * T;
  // Each rank's loss is the mean over its own tokens (+ aux); DDP averages the gradients over the world.
  ForwardOptions fo;
  Qwen3Model local_ref(cfg);  // this rank's tokens, all experts
  local_ref.init_weights(7);
  local_ref.zero_grad();
  const ForwardResult want = local_ref.forward(my_ids, my_labels, B, T, fo);
  local_ref.backward();
  std::vector<Tensor> ddp_ref;  // what plain DDP of full models gives
  for (auto& g : local_ref.flat_grads()) {
    ddp_ref.push_back(g.clone());
    w.all_reduce(ddp_ref.back().f32(), ddp_ref.back().numel(), CommType::F32, ReduceOp::Avg);
  }
  for (int e = 2; e <= N; ++e) {
    if (N % e || cfg.num_experts % e) continue;
    const std::string tag = "expert parallel " + std::to_string(e) + ": ";
    std::shared_ptr<ProcessGroup> group = make_expert_group(w, e);
    Qwen3Model m(cfg, {}, group.get());
    m.init_weights(7);
    double init_err = 0;
    for (auto& p : m.params())
      init_err += rel_err(p.value.f32(), local_ref.param(p.name).value.f32(), p.value.numel());
    c.expect(tag + "expert slice initialises as the full model", init_err, 0);
    m.zero_grad();
    const ForwardResult got = m.forward(my_ids, my_labels, B, T, fo);
    m.backward();
    c.expect(tag + "loss", std::abs(got.loss - want.loss) / want.loss, 1e-6);
    c.expect(tag + "aux loss", std::abs(got.aux_loss - want.aux_loss) / want.aux_loss, 1e-6);
    // Full-model gradients summed over the expert group: the reference for the local experts.
    std::vector<Tensor> group_sum;
    for (auto& g : local_ref.flat_grads()) {
      group_sum.push_back(g.clone());
      group->all_reduce(group_sum.back().f32(), group_sum.back().numel(), CommType::F32, ReduceOp::Sum);
    }
    double dense_err = 0, expert_err = 0;
    for (auto& p : m.params()) {
      const Param& r = local_ref.param(p.name);
      if (p.name.find(".mlp.experts.") == std::string::npos)
        dense_err = std::max(dense_err, rel_err(p.grad.f32(), r.grad.f32(), p.grad.numel()));
      else
        expert_err =
            std::max(expert_err, rel_err(p.grad.f32(), group_sum[r.group].f32() + r.offset, p.grad.numel()));
    }
    c.expect(tag + "non-expert gradients (own tokens)", dense_err, 1e-5);
    c.expect(tag + "expert gradients (the group's tokens)", expert_err, 1e-5);
    {
      // Activation checkpointing recomputes the layer, exchanges included: the same gradients.
      Qwen3Model ac(cfg, {}, group.get());
      ac.init_weights(7);
      ac.set_activation_checkpointing(true);
      ac.zero_grad();
      ac.forward(my_ids, my_labels, B, T, fo);
      ac.backward();
      double err = 0;
      for (size_t g = 0; g < m.flat_grads().size(); ++g)
        err = std::max(err,
                       rel_err(ac.flat_grads()[g].f32(), m.flat_grads()[g].f32(), m.flat_grads()[g].numel()));
      c.expect(tag + "activation checkpointing gives the same gradients", err, 0);
    }
    {
      // Every token routed to experts of group rank 0 (an expert bias steers the selection): the other
      // ranks receive no rows; loss and gradients still equal the full model's.
      Qwen3Config biased = cfg;
      biased.load_balance_coeff = 1e-3;
      Qwen3Model full(biased), ep(biased, {}, group.get());
      full.init_weights(7);
      ep.init_weights(7);
      for (Qwen3Model* x : {&full, &ep}) {
        float* b = x->expert_bias().f32();
        for (int64_t i = 0; i < x->expert_bias().numel(); ++i) b[i] = i % cfg.num_experts < 3 ? 10.0f : 0.0f;
        x->zero_grad();
      }
      const double lf = full.forward(my_ids, my_labels, B, T, fo).loss;
      const double le = ep.forward(my_ids, my_labels, B, T, fo).loss;
      full.backward();
      ep.backward();
      double err = std::abs(le - lf) / lf;
      for (auto& p : ep.params())
        if (p.name.find(".mlp.experts.") == std::string::npos)
          err = std::max(err, rel_err(p.grad.f32(), full.param(p.name).grad.f32(), p.grad.numel()));
      c.expect(tag + "all tokens to one rank's experts", err, 1e-5);
    }
    // Gathered state dict == the full model's (rank 0 of each group).
    NamedTensors all = m.gathered_state_dict();
    if (group->rank() == 0) {
      NamedTensors full = local_ref.state_dict();
      double err = all.size() == full.size() ? 0 : 1;
      for (size_t i = 0; i < full.size() && err == 0; ++i)
        err += all[i].first == full[i].first
                   ? rel_err(all[i].second.f32(), full[i].second.f32(), full[i].second.numel())
                   : 1;
      c.expect(tag + "gathered state dict", err, 0);
    }
    // DDP + expert parallel reduction and clipping: the global-batch gradients and norm.
    DataParallelPlan dp(w, N, 1, m.flat_params(), m.flat_grads(), int64_t(25) << 20, /*stream_params=*/false,
                        ExpertParallelLayout{group, m.expert_offsets()});
    dp.reduce_grads();
    const double ref_norm = std::sqrt(grad_sq_norm(ddp_ref));
    const double norm = dp.clip_grad_norm(0.0);
    c.expect(tag + "global grad norm", std::abs(norm - ref_norm) / ref_norm, 1e-5);
    double grad_err = 0;
    for (auto& p : m.params())
      grad_err = std::max(
          grad_err,
          rel_err(p.grad.f32(), ddp_ref[p.group].f32() + local_ref.param(p.name).offset, p.grad.numel()));
    c.expect(tag + "reduced gradients = DDP gradients", grad_err, 1e-5);
  }
}

// Tensor parallel on the tiny model (and a tiny MoE, experts replicated) for every degree t > 1 that
// divides the world and the heads, without and with sequence parallel: groups of t consecutive ranks share a
// batch; against a full model on
// that batch, (1) the slices reassemble the full parameters, (2) the loss, (3) every local gradient is the
// slice of the full gradient (after the replicated q/k-norm sums), (4) the global norm, (5) activation
// checkpointing (full and op) changes no bit, (6) five clipped AdamW steps follow the full model's losses.
void check_tensor_parallel_model(Checker& c) {
  ProcessGroup& w = c.world;
  const int N = w.size(), me = w.rank();
  Qwen3Config moe = tiny_config();
  moe.num_experts = 4;
  moe.num_experts_per_tok = 2;
  moe.moe_intermediate_size = 16;
  moe.norm_topk_prob = true;
  const int64_t B = 2, T = 8;
  for (const auto& [kind, cfg] : {std::pair<std::string, Qwen3Config>{"", tiny_config()}, {" moe", moe}})
    for (int t = 2; t <= N; ++t)
      for (bool sp : {false, true}) {
        if (N % t || cfg.num_key_value_heads % t || (sp && (B * T) % t)) continue;
        const std::string tag =
            "tensor parallel " + std::to_string(t) + kind + (sp ? " sequence parallel" : "") + ": ";
        std::shared_ptr<ProcessGroup> group = w.split(me / t, me % t);
        TensorParallel tp(group, sp);
        std::vector<int32_t> ids, labels;  // the group's batch
        random_tokens(B * T, cfg.vocab_size, 4242 + uint64_t(me / t), ids, labels);
        Qwen3Model full(cfg);
        full.init_weights(11);
        Qwen3Model local(tensor_parallel_config(cfg, t));
        tp.scatter(full, local);
        local.set_tensor_parallel(&tp, sp);
        double err = 0;
        for (auto& [name, value] : tp.gather(local))
          err = std::max(err, rel_err(value.f32(), full.param(name).value.f32(), value.numel()));
        c.expect(tag + "slices reassemble the full model", err, 0);
        {
          Qwen3Model drawn(tensor_parallel_config(cfg, t));
          tp.init_weights(drawn, cfg, 11);  // the slices drawn without the full model
          double d = 0;
          for (size_t g = 0; g < drawn.flat_params().size(); ++g)
            d = std::max(d, rel_err(drawn.flat_params()[g].f32(), local.flat_params()[g].f32(),
                                    local.flat_params()[g].numel()));
          c.expect(tag + "init of the slices alone = slices of the full init", d, 0);
        }
        full.zero_grad();
        const ForwardResult want = full.forward(ids.data(), labels.data(), B, T);
        full.backward();
        auto step = [&](Qwen3Model& m) {
          m.zero_grad();
          const double loss = m.forward(ids.data(), labels.data(), B, T).loss;
          m.backward();
          if (&m != &full) tp.reduce_replicated_grads(m);  // (the full model holds every head and row)
          return loss;
        };
        const double got = step(local);
        c.expect(tag + "loss", std::abs(got - want.loss) / want.loss, 1e-6);
        err = 0;
        for (auto& p : local.params()) {
          Tensor full_grad = Tensor::empty(full.param(p.name).shape);
          full.param(p.name).grad.copy_to_host(full_grad.f32());
          const Tensor s = tp.slice(p.name, full_grad);
          err = std::max(err, rel_err(p.grad.f32(), s.f32(), p.grad.numel()));
        }
        c.expect(tag + "gradients = slices of the full gradients", err, 1e-5);
        const double norm = grad_sq_norm(full.flat_grads());
        c.expect(tag + "global grad norm", std::abs(tp.grad_sq_norm(local) - norm) / norm, 1e-6);
        for (bool ops : {false, true}) {
          Qwen3Model ac(tensor_parallel_config(cfg, t));
          tp.scatter(full, ac);
          ac.set_tensor_parallel(&tp, sp);
          ac.set_activation_checkpointing(!ops);
          ac.set_activation_recompute_ops(ops);
          step(ac);
          double d = 0;
          for (size_t g = 0; g < ac.flat_grads().size(); ++g)
            d = std::max(d, rel_err(ac.flat_grads()[g].f32(), local.flat_grads()[g].f32(),
                                    local.flat_grads()[g].numel()));
          c.expect(tag + (ops ? "selective op checkpointing" : "activation checkpointing") +
                       " gives the same gradients",
                   d, 0);
        }
        // Training: clipped AdamW on both, the same losses step after step.
        const AdamWConfig oc{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};
        AdamW opt_full(full.flat_params(), full.flat_grads(), oc),
            opt_local(local.flat_params(), local.flat_grads(), oc);
        double worst = 0;
        for (int s = 0; s < 5; ++s) {
          const double lf = step(full), ll = step(local);
          worst = std::max(worst, std::abs(ll - lf) / lf);
          const double nf = std::sqrt(grad_sq_norm(full.flat_grads())),
                       nl = std::sqrt(tp.grad_sq_norm(local));
          opt_full.step(1e-2f, float(std::min(1.0, 1.0 / (nf + 1e-6))));
          opt_local.step(1e-2f, float(std::min(1.0, 1.0 / (nl + 1e-6))));
        }
        c.expect(tag + "5 clipped AdamW steps: losses", worst, 1e-5);
      }
}

[[noreturn]] void inject_failure(const std::string& mode) {
  if (mode == "throw") fail("injected failure (--fail-mode throw)");
  if (mode == "exit") {
    std::fprintf(stderr, "%sinjected failure: exiting with status 3 (--fail-mode exit)\n",
                 rank_prefix().c_str());
    std::fflush(nullptr);
    std::_Exit(3);
  }
  if (mode == "kill") {
    std::fflush(nullptr);
    std::raise(SIGKILL);
  }
  if (mode == "hang") {
    std::fprintf(stderr, "%sinjected failure: hanging (--fail-mode hang)\n", rank_prefix().c_str());
    std::fflush(nullptr);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  fail("unknown --fail-mode '", mode, "' (throw, exit, kill, hang)");
}

}  // namespace

int run_selftest(ProcessGroup& world, const SelftestOptions& options, std::ostream& log) {
  Checker c{world, log, options.verbose};
  world.barrier();
  if (options.fail_rank == world.rank()) inject_failure(options.fail_mode);
  check_collectives(c);
  check_ddp_buckets(c);
  check_data_parallel_model(c);
  check_hsdp(c);
  check_plans(c);
  check_expert_exchange(c);
  check_expert_parallel_model(c);
  check_tensor_parallel_model(c);
  log.flush();
  int64_t counts[2] = {c.failed, c.passed};
  world.all_reduce(counts, 2, ReduceOp::Sum);
  return int(counts[0]);
}

void run_collective_bench(ProcessGroup& world, int64_t bytes, int iters, std::ostream& out) {
  const int N = world.size();
  const int64_t n = std::max<int64_t>(N, bytes / 4 / N * N);
  Tensor buf = Tensor::zeros({n}), shard = Tensor::zeros({n / N});
  const std::vector<int64_t> counts = equal_counts(N, n / N);
  const double saved = watchdog_timeout();
  for (double timeout : {saved > 0 ? saved : 600.0, 0.0}) {
    set_watchdog_timeout(timeout);
    struct Case {
      const char* name;
      double bus_factor;  // bytes each rank moves per byte of buffer (nccl-tests "busbw")
      std::function<void()> fn;
    } cases[] = {
        {"all_reduce", 2.0 * (N - 1) / N, [&] { world.all_reduce(buf.f32(), n, ReduceOp::Avg); }},
        {"reduce_scatter", double(N - 1) / N,
         [&] { world.reduce_scatter(buf.f32(), shard.f32(), counts, CommType::F32, ReduceOp::Avg); }},
        {"all_gather", double(N - 1) / N,
         [&] { world.all_gather(shard.f32(), buf.f32(), counts, CommType::F32); }},
    };
    for (auto& c : cases) {
      c.fn();  // warm-up
      world.barrier();
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) c.fn();
      double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters;
      sec = world.all_reduce(sec, ReduceOp::Max);
      if (world.rank() == 0) {
        char line[256];
        std::snprintf(
            line, sizeof line, "bench %-14s %8.1f MB  %2d ranks  watchdog %-3s  %9.3f ms  busbw %7.2f GB/s\n",
            c.name, n * 4 / 1e6, N, timeout > 0 ? "on" : "off", sec * 1e3, n * 4 * c.bus_factor / sec / 1e9);
        out << line;
      }
    }
  }
  set_watchdog_timeout(saved);
  out.flush();
}

}  // namespace titan::dist
