#include "models/qwen3/model.h"

#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "core/error.h"
#include "io/hf_checkpoint.h"
#include "kernels/registry.h"

namespace titan {

namespace {
template <class K>
const K* pick(DeviceType dev, const KernelChoice& choice, std::map<std::string, std::string>& names) {
  auto it = choice.find(K::kOp);
  std::string impl = it == choice.end() ? "" : it->second;
  if (impl.empty()) impl = KernelRegistry::global().default_impl(K::kOp, dev);
  names[K::kOp] = impl;
  return &get_kernel<K>(dev, impl);
}
// Rounds to the nearest bfloat16 value, kept in f32 storage.
void round_bf16(float* x, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}
}  // namespace

void Qwen3Model::set_bf16_compute(bool on) {
  bf16_ = on;
  if (on)
    for (auto& t : flat_params_) round_bf16(t.f32(), t.numel());
}

Qwen3Model::Qwen3Model(const Qwen3Config& config, const KernelChoice& kernels) : config_(config) {
  config_.validate("model config");
  for (auto& [op, _] : kernels) {
    auto ops = KernelRegistry::global().ops();
    TITAN_CHECK(std::find(ops.begin(), ops.end(), op) != ops.end(), "[kernels]: unknown op '", op, "'");
  }
  const DeviceType dev = DeviceType::CPU;
  matmul_ = pick<MatmulKernels>(dev, kernels, kernel_names_);
  rmsnorm_ = pick<RmsNormKernels>(dev, kernels, kernel_names_);
  rope_ = pick<RopeKernels>(dev, kernels, kernel_names_);
  attention_ = pick<AttentionKernels>(dev, kernels, kernel_names_);
  swiglu_ = pick<SwigluKernels>(dev, kernels, kernel_names_);
  embedding_ = pick<EmbeddingKernels>(dev, kernels, kernel_names_);
  cross_entropy_ = pick<CrossEntropyKernels>(dev, kernels, kernel_names_);

  const auto& c = config_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim, L = c.num_hidden_layers;
  std::vector<std::vector<std::pair<std::string, Shape>>> groups;
  groups.push_back({{"model.embed_tokens.weight", {c.vocab_size, H}}});
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    groups.push_back({{p + "input_layernorm.weight", {H}},
                      {p + "self_attn.q_proj.weight", {c.q_dim(), H}},
                      {p + "self_attn.k_proj.weight", {c.kv_dim(), H}},
                      {p + "self_attn.v_proj.weight", {c.kv_dim(), H}},
                      {p + "self_attn.q_norm.weight", {hd}},
                      {p + "self_attn.k_norm.weight", {hd}},
                      {p + "self_attn.o_proj.weight", {H, c.q_dim()}},
                      {p + "post_attention_layernorm.weight", {H}},
                      {p + "mlp.gate_proj.weight", {I, H}},
                      {p + "mlp.up_proj.weight", {I, H}},
                      {p + "mlp.down_proj.weight", {H, I}}});
  }
  groups.push_back({{"model.norm.weight", {H}}});
  if (!c.tie_word_embeddings) groups.back().push_back({"lm_head.weight", {c.vocab_size, H}});

  for (size_t g = 0; g < groups.size(); ++g) {
    int64_t total = 0;
    for (auto& [_, s] : groups[g]) total += shape_numel(s);
    flat_params_.push_back(Tensor::zeros({total}));
    flat_grads_.push_back(Tensor::zeros({total}));
    int64_t off = 0;
    for (auto& [name, s] : groups[g]) {
      Param p;
      p.name = name;
      p.group = static_cast<int>(g);
      p.offset = off;
      p.shape = s;
      p.value = flat_params_[g].view_at(off, s);
      p.grad = flat_grads_[g].view_at(off, s);
      params_.push_back(std::move(p));
      off += shape_numel(s);
    }
  }
  init_weights(0);
}

Param& Qwen3Model::param(const std::string& name) {
  for (auto& p : params_)
    if (p.name == name) return p;
  fail("model has no parameter '", name, "'");
}

int64_t Qwen3Model::num_params() const {
  int64_t n = 0;
  for (auto& t : flat_params_) n += t.numel();
  return n;
}

Qwen3Model::LayerView Qwen3Model::layer_view(float* base) const {
  const auto& c = config_;
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  LayerView v;
  float* p = base;
  v.input_norm = p, p += H;
  v.wq = p, p += c.q_dim() * H;
  v.wk = p, p += c.kv_dim() * H;
  v.wv = p, p += c.kv_dim() * H;
  v.q_norm = p, p += c.head_dim;
  v.k_norm = p, p += c.head_dim;
  v.wo = p, p += H * c.q_dim();
  v.post_norm = p, p += H;
  v.wgu = p, p += 2 * I * H;
  v.wdown = p;
  return v;
}

void Qwen3Model::init_weights(uint64_t seed) {
  std::mt19937_64 rng(seed);
  const double std = config_.initializer_range;
  for (auto& p : params_) {
    float* w = p.value.f32();
    const int64_t n = p.value.numel();
    if (p.shape.size() == 1) {
      for (int64_t i = 0; i < n; ++i) w[i] = 1.0f;
      continue;
    }
    // Box-Muller on 53-bit uniforms: identical on every platform for a given seed.
    for (int64_t i = 0; i < n; i += 2) {
      double u1 = ((rng() >> 11) + 1.0) * 0x1.0p-53, u2 = (rng() >> 11) * 0x1.0p-53;
      double r = std::sqrt(-2.0 * std::log(u1));
      w[i] = static_cast<float>(std * r * std::cos(2 * M_PI * u2));
      if (i + 1 < n) w[i + 1] = static_cast<float>(std * r * std::sin(2 * M_PI * u2));
    }
  }
}

void Qwen3Model::load_hf(const std::string& dir) {
  HFCheckpointReader ckpt(dir);
  std::set<std::string> expected;
  for (auto& p : params_) expected.insert(p.name);
  std::vector<std::string> missing, unexpected;
  for (auto& name : expected)
    if (!ckpt.contains(name)) missing.push_back(name);
  for (auto& key : ckpt.keys()) {
    if (expected.count(key)) continue;
    // A tied checkpoint may or may not carry lm_head.weight; the rotary buffer is not a parameter.
    if (config_.tie_word_embeddings && key == "lm_head.weight") continue;
    if (key.size() >= 19 && key.ends_with("rotary_emb.inv_freq")) continue;
    unexpected.push_back(key);
  }
  auto join = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size() && i < 20; ++i) s += (i ? ", " : "") + v[i];
    if (v.size() > 20) s += str_cat(", ... (", v.size(), " in all)");
    return s;
  };
  TITAN_CHECK(missing.empty() && unexpected.empty(), dir, ": checkpoint does not match the model config",
              missing.empty() ? "" : "; missing keys: " + join(missing),
              unexpected.empty() ? "" : "; unexpected keys: " + join(unexpected));
  for (auto& p : params_) ckpt.read_into(p.name, p.value);
}

NamedTensors Qwen3Model::state_dict() const {
  NamedTensors out;
  for (auto& p : params_) out.emplace_back(p.name, p.value);
  return out;
}

void Qwen3Model::save_hf(const std::string& dir, DType dtype, int64_t max_shard_bytes) const {
  save_hf_checkpoint(dir, config_.to_hf_json(), state_dict(), dtype, max_shard_bytes);
}

void Qwen3Model::zero_grad() {
  for (auto& g : flat_grads_) g.zero_();
}

int64_t Qwen3Model::activation_bytes() const {
  int64_t n = 0;
  for (auto& t : acts_) n += t.nbytes();
  return n;
}

void Qwen3Model::build_rope_tables(int64_t T) {
  if (rope_T_ == T) return;
  // HF: inv_freq = 1 / base^(arange(0, hd, 2)/hd) in fp32; freqs = pos * inv_freq; cos/sin in fp32.
  const int64_t half = config_.head_dim / 2;
  rope_cos_ = Tensor::empty({T, half});
  rope_sin_ = Tensor::empty({T, half});
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(config_.head_dim);
    const float inv_freq = 1.0f / static_cast<float>(std::pow(config_.rope_theta, (double)exponent));
    for (int64_t t = 0; t < T; ++t) {
      const float f = static_cast<float>(t) * inv_freq;
      rope_cos_.f32()[t * half + i] = static_cast<float>(std::cos((double)f));
      rope_sin_.f32()[t * half + i] = static_cast<float>(std::sin((double)f));
    }
  }
  rope_T_ = T;
}

void Qwen3Model::plan_activations(int64_t B, int64_t T) {
  if (B == B_ && T == T_) return;
  const auto& c = config_;
  const int64_t N = B * T, H = c.hidden_size, I = c.intermediate_size, nH = c.num_attention_heads,
                nKV = c.num_key_value_heads, L = c.num_hidden_layers;
  acts_.clear();
  layer_acts_.assign(L, {});
  // One allocation per layer, carved into named pointers.
  const int64_t per_layer = N * H * 4 + N * 2 + N * c.q_dim() * 3 + N * c.kv_dim() * 3 + N * (nH + nKV) +
                            B * nH * T * T + N * 2 * I + N * I;
  for (int64_t l = 0; l < L; ++l) {
    acts_.push_back(Tensor::empty({per_layer}));
    float* p = acts_.back().f32();
    auto take = [&p](int64_t n) {
      float* r = p;
      p += n;
      return r;
    };
    LayerActs& a = layer_acts_[l];
    a.resid_in = take(N * H);
    a.ln1 = take(N * H);
    a.rstd1 = take(N);
    a.q_raw = take(N * c.q_dim());
    a.k_raw = take(N * c.kv_dim());
    a.v = take(N * c.kv_dim());
    a.q_rstd = take(N * nH);
    a.k_rstd = take(N * nKV);
    a.qr = take(N * c.q_dim());
    a.kr = take(N * c.kv_dim());
    a.probs = take(B * nH * T * T);
    a.att = take(N * c.q_dim());
    a.resid_mid = take(N * H);
    a.ln2 = take(N * H);
    a.rstd2 = take(N);
    a.gu = take(N * 2 * I);
    a.act = take(N * I);
  }
  auto alloc = [this](Shape s, DType dt = DType::F32) {
    acts_.push_back(Tensor::empty(std::move(s), dt));
    return acts_.back();
  };
  ids_ = alloc({N}, DType::I32);
  targets_ = alloc({N}, DType::I32);
  final_resid_ = alloc({N, H});
  lnf_ = alloc({N, H});
  rstdf_ = alloc({N});
  logits_ = alloc({N, c.vocab_size});
  dresid_ = alloc({N, H});
  dln_ = alloc({N, H});
  dq_ = alloc({N, c.q_dim()});
  dk_ = alloc({N, c.kv_dim()});
  dv_ = alloc({N, c.kv_dim()});
  dqr_ = alloc({N, c.q_dim()});
  dkr_ = alloc({N, c.kv_dim()});
  datt_ = alloc({N, c.q_dim()});
  dgu_ = alloc({N, 2 * I});
  dact_ = alloc({N, I});
  B_ = B;
  T_ = T;
}

ForwardResult Qwen3Model::forward(const int32_t* ids, const int32_t* labels, int64_t B, int64_t T,
                                  const ForwardOptions& opts) {
  const auto& c = config_;
  const int64_t N = B * T, H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim,
                nH = c.num_attention_heads, nKV = c.num_key_value_heads, V = c.vocab_size;
  TITAN_CHECK(B > 0 && T > 0, "forward: empty batch (B=", B, ", T=", T, ")");
  for (int64_t n = 0; n < N; ++n)
    TITAN_CHECK(ids[n] >= 0 && ids[n] < V, "input_ids[", n / T, "][", n % T, "] = ", ids[n],
                " is outside the vocabulary [0, ", V, ")");
  plan_activations(B, T);
  build_rope_tables(T);
  std::memcpy(ids_.raw(), ids, N * sizeof(int32_t));
  // HF ForCausalLMLoss: labels padded with -100 on the right and shifted left by one.
  int32_t* tgt = targets_.data<int32_t>();
  int64_t num_valid = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      int32_t y = t + 1 < T ? labels[b * T + t + 1] : -100;
      TITAN_CHECK(y == -100 || (y >= 0 && y < V), "labels[", b, "][", t + 1, "] = ", y,
                  " is neither -100 nor inside the vocabulary");
      tgt[b * T + t] = y < 0 ? -1 : y;
      num_valid += y >= 0;
    }

  const float* wte = flat_params_[0].f32();
  const float* cos = rope_cos_.f32();
  const float* sin = rope_sin_.f32();
  embedding_->forward(layer_acts_[0].resid_in, ids, wte, N, H);
  auto bf16 = [this](float* x, int64_t n) {
    if (bf16_) round_bf16(x, n);
  };
  const float eps = static_cast<float>(c.rms_norm_eps);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LayerActs& a = layer_acts_[l];
    LayerView w = layer_view(flat_params_[l + 1].f32());
    rmsnorm_->forward(a.ln1, a.rstd1, a.resid_in, w.input_norm, N, H, eps);
    matmul_->forward(a.q_raw, a.ln1, w.wq, N, H, c.q_dim());
    matmul_->forward(a.k_raw, a.ln1, w.wk, N, H, c.kv_dim());
    matmul_->forward(a.v, a.ln1, w.wv, N, H, c.kv_dim());
    bf16(a.ln1, N * H), bf16(a.q_raw, N * c.q_dim()), bf16(a.k_raw, N * c.kv_dim()), bf16(a.v, N * c.kv_dim());
    // q_norm / k_norm per head (before RoPE); qr/kr hold the normed values, then rotate in place.
    rmsnorm_->forward(a.qr, a.q_rstd, a.q_raw, w.q_norm, N * nH, hd, eps);
    rmsnorm_->forward(a.kr, a.k_rstd, a.k_raw, w.k_norm, N * nKV, hd, eps);
    rope_->forward(a.qr, a.qr, cos, sin, N, T, nH, hd);
    rope_->forward(a.kr, a.kr, cos, sin, N, T, nKV, hd);
    bf16(a.qr, N * c.q_dim()), bf16(a.kr, N * c.kv_dim());
    attention_->forward(a.att, a.probs, a.qr, a.kr, a.v, B, T, nH, nKV, hd);
    bf16(a.att, N * c.q_dim());
    // resid_mid = resid_in + att @ wo^T
    matmul_->forward(a.resid_mid, a.att, w.wo, N, c.q_dim(), H);
    float* rm = a.resid_mid;
    const float* ri = a.resid_in;
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < N * H; ++i) rm[i] += ri[i];
    bf16(rm, N * H);
    rmsnorm_->forward(a.ln2, a.rstd2, a.resid_mid, w.post_norm, N, H, eps);
    matmul_->forward(a.gu, a.ln2, w.wgu, N, H, 2 * I);
    bf16(a.ln2, N * H), bf16(a.gu, N * 2 * I);
    swiglu_->forward(a.act, a.gu, N, I);
    bf16(a.act, N * I);
    float* out = l + 1 < c.num_hidden_layers ? layer_acts_[l + 1].resid_in : final_resid_.f32();
    matmul_->forward(out, a.act, w.wdown, N, I, H);
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < N * H; ++i) out[i] += rm[i];
    bf16(out, N * H);
  }
  const int group_head = static_cast<int>(c.num_hidden_layers) + 1;
  const float* norm_w = flat_params_[group_head].f32();
  const float* lm_head = c.tie_word_embeddings ? wte : norm_w + H;
  rmsnorm_->forward(lnf_.f32(), rstdf_.f32(), final_resid_.f32(), norm_w, N, H, eps);
  bf16(lnf_.f32(), N * H);
  matmul_->forward(logits_.f32(), lnf_.f32(), lm_head, N, H, V);
  bf16(logits_.f32(), N * V);
  if (opts.keep_logits) {
    if (!logits_copy_.defined() || logits_copy_.numel() != N * V) logits_copy_ = Tensor::empty({B, T, V});
    logits_copy_ = logits_copy_.view({B, T, V});
    std::memcpy(logits_copy_.raw(), logits_.raw(), N * V * sizeof(float));
  }
  ForwardResult r;
  r.num_valid = num_valid;
  const float scale = opts.grad_scale > 0 ? opts.grad_scale : num_valid > 0 ? 1.0f / (float)num_valid : 0.0f;
  r.loss_sum = cross_entropy_->forward_backward(logits_.f32(), tgt, N, V, scale, opts.compute_grad);
  r.loss = num_valid > 0 ? r.loss_sum / (double)num_valid : std::nan("");
  grad_ready_ = opts.compute_grad;
  return r;
}

void Qwen3Model::backward() {
  TITAN_CHECK(grad_ready_, "backward() needs a forward() with compute_grad");
  grad_ready_ = false;
  const auto& c = config_;
  const int64_t B = B_, T = T_, N = B * T, H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim,
                nH = c.num_attention_heads, nKV = c.num_key_value_heads, V = c.vocab_size;
  const int group_head = static_cast<int>(c.num_hidden_layers) + 1;
  float* wte = flat_params_[0].f32();
  float* dwte = flat_grads_[0].f32();
  const float* norm_w = flat_params_[group_head].f32();
  float* dnorm_w = flat_grads_[group_head].f32();
  const float* lm_head = c.tie_word_embeddings ? wte : norm_w + H;
  float* dlm_head = c.tie_word_embeddings ? dwte : dnorm_w + H;
  const float* cos = rope_cos_.f32();
  const float* sin = rope_sin_.f32();

  // Head: logits_ holds dlogits (written in place by the fused cross-entropy).
  float* dresid = dresid_.f32();
  float* dln = dln_.f32();
  std::memset(dln, 0, N * H * sizeof(float));
  matmul_->backward(dln, dlm_head, logits_.f32(), lnf_.f32(), lm_head, N, H, V);
  std::memset(dresid, 0, N * H * sizeof(float));
  rmsnorm_->backward(dresid, dnorm_w, dln, final_resid_.f32(), norm_w, rstdf_.f32(), N, H);

  for (int64_t l = c.num_hidden_layers - 1; l >= 0; --l) {
    LayerActs& a = layer_acts_[l];
    LayerView w = layer_view(flat_params_[l + 1].f32());
    LayerView g = layer_view(flat_grads_[l + 1].f32());
    // MLP branch: out = resid_mid + down(swiglu(gu(ln2)))
    float* dact = dact_.f32();
    float* dgu = dgu_.f32();
    std::memset(dact, 0, N * I * sizeof(float));
    matmul_->backward(dact, g.wdown, dresid, a.act, w.wdown, N, I, H);
    std::memset(dgu, 0, N * 2 * I * sizeof(float));
    swiglu_->backward(dgu, dact, a.gu, N, I);
    std::memset(dln, 0, N * H * sizeof(float));
    matmul_->backward(dln, g.wgu, dgu, a.ln2, w.wgu, N, H, 2 * I);
    rmsnorm_->backward(dresid, g.post_norm, dln, a.resid_mid, w.post_norm, a.rstd2, N, H);
    // Attention branch: resid_mid = resid_in + o(attn(rope(norm(q,k)), v))
    float* datt = datt_.f32();
    std::memset(datt, 0, N * c.q_dim() * sizeof(float));
    matmul_->backward(datt, g.wo, dresid, a.att, w.wo, N, c.q_dim(), H);
    float *dqr = dqr_.f32(), *dkr = dkr_.f32(), *dq = dq_.f32(), *dk = dk_.f32(), *dv = dv_.f32();
    std::memset(dqr, 0, N * c.q_dim() * sizeof(float));
    std::memset(dkr, 0, N * c.kv_dim() * sizeof(float));
    std::memset(dv, 0, N * c.kv_dim() * sizeof(float));
    attention_->backward(dqr, dkr, dv, datt, a.qr, a.kr, a.v, a.probs, B, T, nH, nKV, hd);
    // RoPE backward into dq/dk (as scratch), then q_norm/k_norm backward into dqr/dkr (reused).
    std::memset(dq, 0, N * c.q_dim() * sizeof(float));
    std::memset(dk, 0, N * c.kv_dim() * sizeof(float));
    rope_->backward(dq, dqr, cos, sin, N, T, nH, hd);
    rope_->backward(dk, dkr, cos, sin, N, T, nKV, hd);
    std::memset(dqr, 0, N * c.q_dim() * sizeof(float));
    std::memset(dkr, 0, N * c.kv_dim() * sizeof(float));
    rmsnorm_->backward(dqr, g.q_norm, dq, a.q_raw, w.q_norm, a.q_rstd, N * nH, hd);
    rmsnorm_->backward(dkr, g.k_norm, dk, a.k_raw, w.k_norm, a.k_rstd, N * nKV, hd);
    std::memset(dln, 0, N * H * sizeof(float));
    matmul_->backward(dln, g.wq, dqr, a.ln1, w.wq, N, H, c.q_dim());
    matmul_->backward(dln, g.wk, dkr, a.ln1, w.wk, N, H, c.kv_dim());
    matmul_->backward(dln, g.wv, dv, a.ln1, w.wv, N, H, c.kv_dim());
    rmsnorm_->backward(dresid, g.input_norm, dln, a.resid_in, w.input_norm, a.rstd1, N, H);
  }
  embedding_->backward(dwte, dresid, ids_.data<int32_t>(), N, H, V);
}

}  // namespace titan
