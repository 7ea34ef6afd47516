// LoRA adapters: layout, forward/backward hooks (called inside Qwen3Model's layers), frozen bf16 base.
// PEFT file I/O and merging are in lora_io.cpp.
#include "models/qwen3/lora.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "core/dtype.h"
#include "core/error.h"
#include "io/hf_checkpoint.h"
#include "kernels/registry.h"
#include "models/qwen3/model_interfaces.h"

namespace titan {

const char* lora_proj_name(LoraProj p) {
  static const char* names[kLoraProjs] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                          "gate_proj", "up_proj", "down_proj"};
  return names[static_cast<int>(p)];
}

void LoraConfig::validate(const std::string& where) const {
  TITAN_CHECK(rank > 0, where, ": rank must be > 0, got ", rank);
  TITAN_CHECK(alpha > 0, where, ": alpha must be > 0, got ", alpha);
  TITAN_CHECK(dropout >= 0 && dropout < 1, where, ": dropout must be in [0, 1), got ", dropout);
  TITAN_CHECK(!target_modules.empty(), where, ": target_modules is empty");
  for (auto& t : target_modules) {
    bool known = t == "all-linear";
    for (int p = 0; p < kLoraProjs; ++p) known |= t == lora_proj_name(static_cast<LoraProj>(p));
    TITAN_CHECK(known, where, ": target_modules has '", t,
                "'; supported: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, all-linear");
  }
}

namespace {
bool targets(const LoraConfig& c, LoraProj p) {
  for (auto& t : c.target_modules)
    if (t == "all-linear" || t == lora_proj_name(p)) return true;
  return false;
}

// PEFT's saved key of one adapter tensor (the adapter name "default" is not part of the file's keys).
std::string peft_key(int64_t layer, LoraProj p, const char* ab) {
  const int pi = static_cast<int>(p);
  const std::string block = pi <= static_cast<int>(LoraProj::O) ? "self_attn." : "mlp.";
  return "base_model.model.model.layers." + std::to_string(layer) + "." + block + lora_proj_name(p) + "." +
         ab + ".weight";
}

// Deterministic uniform in [0,1) from a counter (splitmix64): dropout masks that a recompute redraws.
}  // namespace

namespace {
struct Adapted {
  int64_t layer;
  LoraProj proj;
  int64_t in, out;
};
// Every adapted projection (layer, projection, in, out features), in layer then projection order.
std::vector<Adapted> adapted_projections(const Qwen3Config& c, const LoraConfig& cfg) {
  std::vector<Adapted> out;
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    for (int pi = 0; pi < kLoraProjs; ++pi) {
      const LoraProj p = static_cast<LoraProj>(pi);
      if (!targets(cfg, p)) continue;
      // Sparse layers: the routed experts are not nn.Linear modules in HF (fused); no adapter there.
      if (pi >= static_cast<int>(LoraProj::Gate) && c.is_moe_layer(l)) continue;
      const bool attn_out = p == LoraProj::O, down = p == LoraProj::Down;
      const int64_t in = attn_out ? c.q_dim() : down ? I : H;
      const int64_t o = p == LoraProj::Q                           ? c.q_dim()
                        : p == LoraProj::K || p == LoraProj::V     ? c.kv_dim()
                        : p == LoraProj::Gate || p == LoraProj::Up ? I
                                                                   : H;
      out.push_back({l, p, in, o});
    }
  return out;
}
}  // namespace

int64_t lora_num_params(const Qwen3Config& model, const LoraConfig& lora) {
  int64_t n = 0;
  for (auto& a : adapted_projections(model, lora)) n += lora.rank * (a.in + a.out);
  return n;
}

LoraAdapters::LoraAdapters(const Qwen3Config& model, const LoraConfig& lora, Device device)
    : model_(model),
      cfg_(lora),
      device_(device),
      gemm_(&get_kernel<GemmKernels>(device.type)),
      dropout_(&get_kernel<DropoutKernels>(device.type)) {
  cfg_.validate("[lora]");
  const int64_t r = cfg_.rank;
  slot_of_.assign(model_.num_hidden_layers * kLoraProjs, -1);
  int64_t total = 0;
  for (auto& a : adapted_projections(model_, cfg_)) {
    Slot s{a.layer, a.proj, a.in, a.out, total, total + r * a.in, {}};
    total += r * a.in + a.out * r;
    slot_of_[a.layer * kLoraProjs + static_cast<int>(a.proj)] = static_cast<int>(slots_.size());
    slots_.push_back(std::move(s));
  }
  TITAN_CHECK(!slots_.empty(), "[lora]: target_modules match no projection of this model");
  flat_params_ = {Tensor::zeros({total}, DType::F32, device_)};
  flat_grads_ = {Tensor::zeros({total}, DType::F32, device_)};
  for (auto& s : slots_) {
    for (int ab = 0; ab < 2; ++ab) {
      Param p;
      p.name = peft_key(s.layer, s.proj, ab == 0 ? "lora_A" : "lora_B");
      p.group = 0;
      p.offset = ab == 0 ? s.a_off : s.b_off;
      p.shape = ab == 0 ? Shape{r, s.in} : Shape{s.out, r};
      p.value = flat_params_[0].view_at(p.offset, p.shape);
      p.grad = flat_grads_[0].view_at(p.offset, p.shape);
      params_.push_back(std::move(p));
    }
  }
  init(cfg_.seed);
}

void LoraAdapters::init(uint64_t seed) {
  // PEFT: kaiming_uniform_(A, a=sqrt(5)): bound = gain * sqrt(3 / fan_in), gain = sqrt(2 / (1 + 5)),
  // i.e. U(-1/sqrt(in), 1/sqrt(in)); B = 0 so the adapted model starts equal to the base.
  std::mt19937_64 rng(seed);
  std::vector<float> w(static_cast<size_t>(flat_params_[0].numel()));  // drawn on the host, then copied
  for (auto& s : slots_) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(s.in));
    for (int64_t i = 0; i < cfg_.rank * s.in; ++i)
      w[s.a_off + i] = static_cast<float>(((rng() >> 11) * 0x1.0p-53 * 2.0 - 1.0) * bound);
    std::fill(w.begin() + s.b_off, w.begin() + s.b_off + s.out * cfg_.rank, 0.0f);
  }
  flat_params_[0].copy_from_host(w.data());
}

// The pass enters the key by an addition (the rows' and slices' offsets too), so that a pass number held in
// device memory (a staged forward) can be added by the dropout kernel itself.
uint64_t LoraAdapters::mask_key(int slot) const {
  const uint64_t pass = staged_pass_ ? 0 : pass_ << 40;
  return ((cfg_.seed * 0x100000001b3ull) ^ (static_cast<uint64_t>(slot) << 52)) + pass;
}

void LoraAdapters::begin_forward(bool training, int64_t staged_slot) {
  training_ = training || pinned_;
  staged_pass_ = nullptr;
  if (staged_slot >= 0) {
    TITAN_CHECK(staged_passes_.defined() && staged_slot < staged_passes_.numel(),
                "LoRA: a staged forward of micro-batch ", staged_slot, " that stage_pass() did not stage");
    staged_pass_ = reinterpret_cast<const uint64_t*>(staged_passes_.data<int64_t>()) + staged_slot;
  } else if (!pinned_) {
    ++pass_;
  }
}

void LoraAdapters::stage_pass(int64_t slot, int64_t slots) {
  TITAN_CHECK(slot >= 0 && slot < slots, "LoRA stage_pass: slot ", slot, " of ", slots);
  if (!staged_passes_.defined() || staged_passes_.numel() < slots)
    staged_passes_ = Tensor::zeros({slots}, DType::I64, device_);
  const int64_t bits = static_cast<int64_t>(++pass_ << 40);
  staged_passes_.view_at(slot, {1}).copy_from_host(&bits);
}

namespace {
// A device buffer of at least n floats (reallocated only to grow).
float* scratch(Tensor& t, int64_t n, Device device) {
  if (!t.defined() || t.numel() < n) t = Tensor::empty({std::max<int64_t>(n, 1)}, DType::F32, device);
  return t.f32();
}
}  // namespace

const float* LoraAdapters::dropped(const Slot& s, const float* x, int64_t N) {
  if (!training_ || cfg_.dropout <= 0) return x;
  const int64_t n = N * s.in;
  float* d = scratch(xdrop_, n, device_);
  apply_dropout(s, slot(s.layer, s.proj), d, x, N, false);
  return d;
}

// One key space per (seed, pass, slot): the recompute under activation checkpointing draws the same mask.
// A row-parallel slot under tensor parallel holds columns [rank in, (rank + 1) in) of an (N, size in) input:
// its masks are those columns of the full input's.
void LoraAdapters::apply_dropout(const Slot& s, int si, float* out, const float* x, int64_t N,
                                 bool backward) {
  const float p = static_cast<float>(cfg_.dropout);
  const bool sliced = tp_size_ > 1 && (s.proj == LoraProj::O || s.proj == LoraProj::Down);
  const uint64_t stride = static_cast<uint64_t>((sliced ? tp_size_ : 1) * s.in);
  const uint64_t key = mask_key(si) + (sliced ? static_cast<uint64_t>(tp_rank_ * s.in) : 0);
  auto rows = [&](int64_t n0, int64_t count, int64_t batch_row) {  // rows [n0, n0 + count) of this call
    const uint64_t k = key + static_cast<uint64_t>(batch_row) * stride;
    if (backward)
      dropout_->backward_add(out + n0 * s.in, x + n0 * s.in, count, s.in, k, stride, p, staged_pass_);
    else
      dropout_->forward(out + n0 * s.in, x + n0 * s.in, count, s.in, k, stride, p, staged_pass_);
  };
  if (cp_size_ == 1) return rows(0, N, row0_);
  // Context parallel: runs of rows inside one chunk are consecutive rows of one rank's batch.
  const int64_t Tl = cp_local_len_, c = Tl / 2;
  for (int64_t n = 0; n < N;) {
    const int64_t m = row0_ + n, b = m / Tl, t = m % Tl, count = std::min(N - n, c - t % c);
    rows(n, count, b * cp_seq_len_ + context_parallel_position(cp_rank_, cp_size_, Tl, t));
    n += count;
  }
}

void LoraAdapters::forward(int64_t layer, LoraProj p, const float* x, int64_t N, float* y, int64_t ldy) {
  const int si = slot(layer, p);
  if (si < 0) return;
  Slot& s = slots_[si];
  const int64_t r = cfg_.rank;
  const float* A = flat_params_[0].f32() + s.a_off;  // (r,in)
  const float* B = flat_params_[0].f32() + s.b_off;  // (out,r)
  const float* xd = dropped(s, x, N);
  float* u = scratch(s.u, N * r, device_);
  s.u_rows = N;
  // u (N,r) = xd (N,in) A^T;  y (N,out) += scale * u B^T
  gemm_->gemm(false, true, N, r, s.in, 1.0f, xd, s.in, A, s.in, 0.0f, u, r);
  gemm_->gemm(false, true, N, s.out, r, cfg_.scale(), u, r, B, r, 1.0f, y, ldy);
}

void LoraAdapters::backward(int64_t layer, LoraProj p, const float* x, const float* dy, int64_t ldy,
                            float* dx, int64_t N) {
  const int si = slot(layer, p);
  if (si < 0) return;
  Slot& s = slots_[si];
  TITAN_CHECK(s.u_rows == N, "LoRA backward without its forward");
  const int64_t r = cfg_.rank;
  const float sc = cfg_.scale();
  const float* A = flat_params_[0].f32() + s.a_off;
  const float* B = flat_params_[0].f32() + s.b_off;
  float* dA = flat_grads_[0].f32() + s.a_off;
  float* dB = flat_grads_[0].f32() + s.b_off;
  float* du = scratch(du_, N * r, device_);
  const float* u = s.u.f32();
  // dB (out,r) += scale dy^T u;  du (N,r) = scale dy B
  gemm_->gemm(true, false, s.out, r, N, sc, dy, ldy, u, r, 1.0f, dB, r);
  gemm_->gemm(false, false, N, r, s.out, sc, dy, ldy, B, r, 0.0f, du, r);
  // dA (r,in) += du^T xd
  const float* xd = dropped(s, x, N);
  gemm_->gemm(true, false, r, s.in, N, 1.0f, du, r, xd, s.in, 1.0f, dA, s.in);
  if (xd == x) {  // dx (N,in) += du A
    gemm_->gemm(false, false, N, s.in, r, 1.0f, du, r, A, s.in, 1.0f, dx, s.in);
    return;
  }
  // Dropout: dx += mask / (1-p) * (du A), the mask redrawn from its key.
  const int64_t n = N * s.in;
  float* g = scratch(dxg_, n, device_);
  gemm_->gemm(false, false, N, s.in, r, 1.0f, du, r, A, s.in, 0.0f, g, s.in);
  apply_dropout(s, si, dx, g, N, true);
}

// ---- frozen bf16 base ----

FrozenBf16Base::FrozenBf16Base(Qwen3Model& model, const std::string& hf_dir, uint64_t seed,
                               const Slicer* slicer)
    : model_(model) {
  const auto& params = model.params();
  std::unique_ptr<HFCheckpointReader> ckpt;
  if (!hf_dir.empty()) {
    ckpt = std::make_unique<HFCheckpointReader>(hf_dir);
    for (auto& p : params)
      TITAN_CHECK(ckpt->contains(p.name), hf_dir, ": checkpoint has no tensor '", p.name,
                  "' (a bf16 frozen base reads per-expert MoE checkpoints only; set [lora] bf16_base = false"
                  " for fused-expert files)");
  }
  // Under tensor parallel: the full model's shapes (the draws and the checkpoint's tensors are full).
  std::unique_ptr<Qwen3Model> layout;
  if (slicer)
    layout = std::make_unique<Qwen3Model>(slicer->full, KernelChoice{}, nullptr, /*allocate=*/false);
  groups_.resize(model.num_groups());
  const double std = model.config().initializer_range;
  for (int g = 0; g < model.num_groups(); ++g) {
    if (ckpt && !slicer && model.device().type == DeviceType::CPU) {  // straight into the bf16 group
      groups_[g] = Tensor::empty({model.group_numel(g)}, DType::BF16);
      for (auto& p : params) {
        if (p.group != g) continue;
        Tensor view = groups_[g].view_at(p.offset, p.shape);
        if (ckpt->file_of(p.name).entries().at(p.name).dtype == "F16") {  // no direct f16 -> bf16
          Tensor f32 = Tensor::empty(p.shape);
          ckpt->read_into(p.name, f32);
          view.copy_from(f32);
        } else {
          ckpt->read_into(p.name, view);
        }
      }
      continue;
    }
    Tensor tmp = Tensor::empty({model.group_numel(g)});
    std::mt19937_64 rng(seed * 1000003 + g);
    for (auto& p : params) {
      if (p.group != g) continue;
      Tensor view = tmp.view_at(p.offset, p.shape);
      Tensor full = slicer ? Tensor::empty(layout->param(p.name).shape) : view;
      if (ckpt) {
        ckpt->read_into(p.name, full);
      } else {
        float* w = full.f32();
        const int64_t n = full.numel();
        if (full.ndim() == 1) {
          std::fill(w, w + n, 1.0f);
        } else {
          std::normal_distribution<float> normal(0.0f, static_cast<float>(std));
          for (int64_t i = 0; i < n; ++i) w[i] = normal(rng);
        }
      }
      if (slicer) view.copy_from(slicer->slice(p.name, full));
    }
    groups_[g] = Tensor::empty({tmp.numel()}, DType::BF16, model.device());
    groups_[g].copy_from(tmp);  // converted to bf16 on the model's device
  }
  model.set_param_streamer(this);
}

FrozenBf16Base::FrozenBf16Base(Qwen3Model& model, Qwen3Model& source) : model_(model) {
  TITAN_CHECK(source.num_groups() == model.num_groups() && !source.param_streamer(),
              "bf16 weights: the source model must have the model's layout and hold its parameters");
  groups_.resize(model.num_groups());
  for (int g = 0; g < model.num_groups(); ++g) {
    const Tensor& src = source.flat_params()[g];
    TITAN_CHECK(src.numel() == model.group_numel(g), "bf16 weights: group ", g, " has ", src.numel(),
                " parameters in the source, ", model.group_numel(g), " in the model");
    groups_[g] = Tensor::empty({src.numel()}, DType::BF16, model.device());
    groups_[g].copy_from(src);
  }
  model.set_param_streamer(this);
}

// The model keeps pointing at this streamer; it must not run (or be un-streamed) after this dies.
FrozenBf16Base::~FrozenBf16Base() = default;

Tensor FrozenBf16Base::gather_params(int group) {
  const Tensor& src = groups_[group];
  const int64_t n = src.numel();
  if (live_.size() < groups_.size()) live_.resize(groups_.size());
  TITAN_CHECK(!live_[group].t.defined(), "frozen bf16 base: group ", group, " gathered twice");
  // A free buffer that still holds this group, else one of the same size, else a new one.
  auto pick = [&]() -> Buffer {
    for (int pass = 0; pass < 2; ++pass)
      for (size_t i = 0; i < free_.size(); ++i)
        if (free_[i].t.numel() == n && (pass == 1 || free_[i].group == group)) {
          Buffer b = free_[i];
          free_.erase(free_.begin() + static_cast<long>(i));
          return b;
        }
    return Buffer{Tensor::empty({n}, DType::F32, model_.device()), -1};
  };
  Buffer b = pick();
  if (b.group != group) {
    b.t.copy_from(src);  // bf16 -> f32 on the device
    b.group = group;
  }
  live_[group] = b;
  return b.t;
}

void FrozenBf16Base::release_params(int group) {
  if (group >= static_cast<int>(live_.size()) || !live_[group].t.defined()) return;
  free_.push_back(live_[group]);
  live_[group] = Buffer{};
}

Tensor FrozenBf16Base::grad_buffer(int group) {
  fail("frozen bf16 base: group ", group, " has no gradient (the model must be frozen with set_lora first)");
}

const uint16_t* FrozenBf16Base::bf16_params(int group) const {
  const Tensor& t = groups_[group];
  return t.device().type == DeviceType::CPU ? t.data<uint16_t>() : nullptr;
}

int64_t FrozenBf16Base::bytes() const {
  int64_t n = 0;
  for (auto& g : groups_) n += g.nbytes();
  return n;
}

}  // namespace titan
