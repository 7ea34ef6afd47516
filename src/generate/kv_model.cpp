// KV-cache inference forward of Qwen3 (see kv_model.h). The layer math and the bf16 rounding points are
// those of Qwen3Model::forward_layer (model_step.cpp), applied to n new rows at positions [p, p + n).
#include "generate/kv_model.h"

#include <sys/mman.h>

#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/registry.h"
#include "models/qwen3/lora.h"

namespace titan {

namespace {
std::string name_of(const std::map<std::string, std::string>& names, const std::string& op) {
  auto it = names.find(op);
  return it == names.end() ? "" : it->second;
}
}  // namespace

KVCacheModel::KVCacheModel(Qwen3Model& model, int64_t max_seq, const KernelChoice& kernels)
    : model_(model), cfg_(model.config()), max_seq_(max_seq), bf16_(model.bf16_compute()) {
  const auto& c = cfg_;
  TITAN_CHECK(max_seq > 0, "KV cache: capacity must be > 0, got ", max_seq);
  const DeviceType dev = model.device().type;
  const auto* held = dynamic_cast<const FrozenBf16Base*>(model.param_streamer());
  TITAN_CHECK(!model.param_streamer() || (held && bf16_ && dev == DeviceType::CPU),
              "KV cache: the model's parameters are streamed (FSDP); gather them first");
  TITAN_CHECK(!model.lora(), "KV cache: LoRA adapters must be merged into the weights first");
  TITAN_CHECK(model.expert_parallel_degree() == 1, "KV cache: expert-parallel models are not supported");
  const auto names = model.kernel_names();
  matmul_ = &model.matmul_kernels();
  rmsnorm_ = &get_kernel<RmsNormKernels>(dev, name_of(names, "rmsnorm"));
  if (names.count("rope_qk")) rope_qk_ = &get_kernel<RopeQKKernels>(dev, names.at("rope_qk"));
  rope_ = &get_kernel<RopeKernels>(dev, rope_qk_ ? "" : name_of(names, "rope"));
  swiglu_ = &get_kernel<SwigluKernels>(dev, name_of(names, "swiglu"));
  embedding_ = &get_kernel<EmbeddingKernels>(dev, name_of(names, "embedding"));
  elementwise_ = &get_kernel<ElementwiseKernels>(dev);
  if (c.is_moe()) router_ = &get_kernel<MoeRouterKernels>(dev);
  if (c.is_moe()) {
    const std::string m = name_of(names, "moe_experts");
    if (m.rfind("bf16:", 0) == 0)
      moe_ = &get_kernel<MoeExpertsBf16Kernels>(dev, m.substr(5));
    else
      moe_ = &get_kernel<MoeExpertsKernels>(dev, m);
  }
  auto it = kernels.find("attention_kv");
  attention_name_ =
      it != kernels.end() ? it->second : KernelRegistry::global().default_impl("attention_kv", dev);
  attention_ = &get_kernel<AttentionKVKernels>(dev, attention_name_);

  // Weights, read in place. The fused GEMMs below rely on the model's layout (q|k|v, gate|up rows
  // contiguous; experts' blocks contiguous), checked here.
  if (held)
    for (int g = 0; g < model.num_groups(); ++g) {
      ReservedRange r{nullptr, static_cast<size_t>(model.group_numel(g)) * sizeof(float)};
      r.p = mmap(nullptr, r.bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      TITAN_CHECK(r.p != MAP_FAILED, "KV cache: cannot reserve ", r.bytes, " bytes of address space");
      keys_.push_back(r);
      register_bf16_image(static_cast<const float*>(r.p), model.group_numel(g),
                          held->group(g).data<uint16_t>());
    }
  auto w = [&](const std::string& name) -> const float* {  // a GEMM operand (or its key)
    const Param& p = model.param(name);
    return held ? static_cast<const float*>(keys_[p.group].p) + p.offset : p.value.f32();
  };
  auto f32w = [&](const std::string& name) -> const float* {  // read as f32 by a kernel
    if (!held) return model.param(name).value.f32();
    const Param& p = model.param(name);
    const uint16_t* src = held->group(p.group).data<uint16_t>() + p.offset;
    auto& v = norms_.emplace_back(static_cast<size_t>(shape_numel(p.shape)));
    for (size_t i = 0; i < v.size(); ++i) v[i] = bf16_to_f32(src[i]);
    return v.data();
  };
  const int64_t H = c.hidden_size, Im = c.moe_intermediate_size;
  embed_ = w("model.embed_tokens.weight");
  if (held) embed_bf16_ = held->group(0).data<uint16_t>() + model.param("model.embed_tokens.weight").offset;
  final_norm_ = f32w("model.norm.weight");
  lm_head_ = c.tie_word_embeddings ? embed_ : w("lm_head.weight");
  int moe_row = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    Layer L;
    L.input_norm = f32w(p + "input_layernorm.weight");
    L.wq = w(p + "self_attn.q_proj.weight");
    L.wk = w(p + "self_attn.k_proj.weight");
    L.wv = w(p + "self_attn.v_proj.weight");
    L.q_norm = f32w(p + "self_attn.q_norm.weight");
    L.k_norm = f32w(p + "self_attn.k_norm.weight");
    L.wo = w(p + "self_attn.o_proj.weight");
    L.post_norm = f32w(p + "post_attention_layernorm.weight");
    if (c.is_moe_layer(l)) {
      L.router = w(p + "mlp.gate.weight");
      L.wgu = w(p + "mlp.experts.0.gate_proj.weight");
      L.wdown = w(p + "mlp.experts.0.down_proj.weight");
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string pe = p + "mlp.experts." + std::to_string(e) + ".";
        TITAN_CHECK(w(pe + "gate_proj.weight") == L.wgu + e * 2 * Im * H &&
                        w(pe + "up_proj.weight") == L.wgu + (e * 2 + 1) * Im * H &&
                        w(pe + "down_proj.weight") == L.wdown + e * H * Im,
                    "KV cache: unexpected expert weight layout in layer ", l);
      }
      if (c.load_balance_coeff > 0) L.expert_bias = model.expert_bias().f32() + moe_row * c.num_experts;
      ++moe_row;
    } else {
      L.wgu = w(p + "mlp.gate_proj.weight");
      L.wdown = w(p + "mlp.down_proj.weight");
      TITAN_CHECK(w(p + "mlp.up_proj.weight") == L.wgu + c.intermediate_size * H,
                  "KV cache: unexpected MLP weight layout in layer ", l);
    }
    layers_.push_back(L);
  }

  const int64_t hd = c.head_dim;
  const Device device = model.device();
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    k_cache_.push_back(Tensor::empty({max_seq, c.num_key_value_heads, hd}, DType::F32, device));
    v_cache_.push_back(Tensor::empty({max_seq, c.num_key_value_heads, hd}, DType::F32, device));
  }
  make_rope_tables(c, max_seq, device, rope_cos_, rope_sin_);  // the training model's tables
  // bf16: images of every parameter buffer for the CPU's bf16 GEMM engine (the model rounded the weights).
  if (bf16_ && device.type == DeviceType::CPU && !held) {
    for (auto& t : model.flat_params()) {
      if (!t.defined()) continue;
      std::vector<uint16_t> img(static_cast<size_t>(t.numel()));
      const float* src = t.f32();
      for (int64_t i = 0; i < t.numel(); ++i) img[i] = f32_to_bf16(src[i]);
      bf16_images_.push_back(std::move(img));
      bf16_bases_.push_back(src);
      register_bf16_image(src, t.numel(), bf16_images_.back().data());
    }
  }
}

KVCacheModel::~KVCacheModel() {
  for (const float* b : bf16_bases_) unregister_bf16_image(b);
  for (const ReservedRange& r : keys_) {
    unregister_bf16_image(static_cast<const float*>(r.p));
    munmap(r.p, r.bytes);
  }
}

void KVCacheModel::truncate(int64_t p) {
  TITAN_CHECK(p >= 0 && p <= pos_, "KV cache: cannot truncate to ", p, " (holds ", pos_, ")");
  pos_ = p;
}

std::string KVCacheModel::kernels_line() const {
  std::string s;
  for (auto& [op, impl] : model_.kernel_names())
    if (op != "attention" && op != "cross_entropy") s += op + "=" + impl + " ";
  return s + "attention_kv=" + attention_name_;
}

void KVCacheModel::plan(int64_t n) {
  if (n <= planned_n_) return;
  const auto& c = cfg_;
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  const Device d = model_.device();
  auto f32 = [d](Shape s) { return Tensor::empty(std::move(s), DType::F32, d); };
  x_ = f32({n, H});
  ln_ = f32({n, H});
  h_ = f32({n, H});
  rstd_ = f32({n * std::max(c.num_attention_heads, int64_t(1))});
  q_ = f32({n, c.q_dim()});
  k_ = f32({n, c.kv_dim()});
  att_ = f32({n, c.q_dim()});
  gu_ = f32({n, 2 * I});
  act_ = f32({n, I});
  logits_ = f32({n, c.vocab_size});
  ids_ = Tensor::empty({n}, DType::I32, d);
  if (d.type != DeviceType::CPU) host_logits_.resize(n * c.vocab_size);
  if (c.is_moe()) {
    const int64_t E = c.num_experts, k = c.num_experts_per_tok, Im = c.moe_intermediate_size;
    probs_ = f32({n, E});
    topk_w_ = f32({n, k});
    topk_idx_ = Tensor::empty({n, k}, DType::I32, d);
    moe_out_ = f32({n, H});
    moe_f32_ = f32({n * k * 3 * Im + moe_experts_scratch_floats(n, k, H, Im)});
    moe_i32_ = Tensor::empty({2 * n * k + E + 1}, DType::I32, d);
    moe_buf_.gu = moe_f32_.f32();
    moe_buf_.act = moe_buf_.gu + n * k * 2 * Im;
    moe_buf_.scratch = moe_buf_.act + n * k * Im;
    moe_buf_.order = moe_i32_.data<int32_t>();
    moe_buf_.row_of = moe_buf_.order + n * k;
    moe_buf_.offsets = moe_buf_.row_of + n * k;
  }
  planned_n_ = n;
}

const float* KVCacheModel::forward(const int32_t* ids, int64_t n, bool all_logits) {
  const auto& c = cfg_;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  TITAN_CHECK(n > 0, "KV cache: forward of no tokens");
  TITAN_CHECK(pos_ + n <= max_seq_, "KV cache: ", pos_, " + ", n, " positions exceed the capacity ",
              max_seq_);
  for (int64_t i = 0; i < n; ++i)
    TITAN_CHECK(ids[i] >= 0 && ids[i] < V, "token id ", ids[i], " is outside the vocabulary [0, ", V, ")");
  plan(n);
  ids_.view_at(0, {n}).copy_from_host(ids);
  if (embed_bf16_) {  // rows of the bf16 embedding (host memory)
    float* x = x_.f32();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < H; ++j) x[i * H + j] = bf16_to_f32(embed_bf16_[ids[i] * H + j]);
  } else {
    embedding_->forward(x_.f32(), ids_.data<int32_t>(), embed_, n, H);
  }
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) layer_forward(l, n);
  // Final norm and lm_head over the rows wanted.
  const int64_t r0 = all_logits ? 0 : n - 1, rows = n - r0;
  const float eps = static_cast<float>(c.rms_norm_eps);
  rmsnorm_->forward(ln_.f32(), rstd_.f32(), x_.f32() + r0 * H, final_norm_, rows, H, eps);
  if (bf16_) elementwise_->round_bf16(ln_.f32(), rows * H);
  matmul_->forward(logits_.f32(), ln_.f32(), lm_head_, rows, H, V);
  if (bf16_) elementwise_->round_bf16(logits_.f32(), rows * V);
  pos_ += n;
  if (host_logits_.empty()) return logits_.f32();  // host memory already
  logits_.view_at(0, {rows * V}).copy_to_host(host_logits_.data());
  return host_logits_.data();
}

// x_ (n,H) -> x_: decoder layer l over n new rows at positions [pos_, pos_ + n); their k/v join the cache.
void KVCacheModel::layer_forward(int64_t l, int64_t n) {
  const auto& c = cfg_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim, nH = c.num_attention_heads,
                nKV = c.num_key_value_heads, p = pos_;
  const float eps = static_cast<float>(c.rms_norm_eps);
  auto bf16 = [this](float* x, int64_t m) {
    if (bf16_) elementwise_->round_bf16(x, m);
  };
  const Layer& w = layers_[l];
  float *x = x_.f32(), *ln = ln_.f32(), *q = q_.f32(), *k = k_.f32(), *h = h_.f32();
  float* kc = k_cache_[l].f32() + p * nKV * hd;  // this call's rows of the caches
  float* vc = v_cache_[l].f32() + p * nKV * hd;
  rmsnorm_->forward(ln, rstd_.f32(), x, w.input_norm, n, H, eps);
  float* q_raw = att_.f32();  // free until the attention
  matmul_->forward(q_raw, ln, w.wq, n, H, c.q_dim());
  matmul_->forward(k, ln, w.wk, n, H, c.kv_dim());
  matmul_->forward(vc, ln, w.wv, n, H, c.kv_dim());
  bf16(ln, n * H), bf16(q_raw, n * c.q_dim()), bf16(k, n * c.kv_dim()), bf16(vc, n * c.kv_dim());
  // q_norm / k_norm per head, then RoPE at positions p.. (tables offset by p rows, T = n).
  rmsnorm_->forward(q, rstd_.f32(), q_raw, w.q_norm, n * nH, hd, eps);
  rmsnorm_->forward(kc, rstd_.f32(), k, w.k_norm, n * nKV, hd, eps);
  const int64_t half = hd / 2;
  const float* cos = rope_cos_.f32() + p * half;
  const float* sin = rope_sin_.f32() + p * half;
  if (rope_qk_) {
    rope_qk_->forward(q, kc, cos, sin, n, n, nH, nKV, hd);
  } else {
    rope_->forward(q, q, cos, sin, n, n, nH, hd);
    rope_->forward(kc, kc, cos, sin, n, n, nKV, hd);
  }
  bf16(q, n * c.q_dim()), bf16(kc, n * c.kv_dim());
  attention_->forward(att_.f32(), q, k_cache_[l].f32(), v_cache_[l].f32(), n, p, nH, nKV, hd);
  bf16(att_.f32(), n * c.q_dim());
  matmul_->forward(h, att_.f32(), w.wo, n, c.q_dim(), H);
  elementwise_->add(h, x, n * H);
  bf16(h, n * H);
  rmsnorm_->forward(ln, rstd_.f32(), h, w.post_norm, n, H, eps);
  if (w.router) {
    bf16(ln, n * H);
    moe_mlp(w, n, x);
  } else {
    matmul_->forward(gu_.f32(), ln, w.wgu, n, H, 2 * I);
    bf16(ln, n * H), bf16(gu_.f32(), n * 2 * I);
    swiglu_->forward(act_.f32(), gu_.f32(), n, I);
    bf16(act_.f32(), n * I);
    matmul_->forward(x, act_.f32(), w.wdown, n, I, H);
  }
  elementwise_->add(x, h, n * H);
  bf16(x, n * H);
}

// Routed experts of the normed rows ln_ (n,H) into out (n,H): HF router (f32 softmax, top-k, optional
// renormalisation), then the registry's moe_experts.
void KVCacheModel::moe_mlp(const Layer& w, int64_t n, float* out) {
  const auto& c = cfg_;
  const int64_t H = c.hidden_size, E = c.num_experts, k = c.num_experts_per_tok, Im = c.moe_intermediate_size;
  float* probs = probs_.f32();
  matmul_->forward(probs, ln_.f32(), w.router, n, H, E);
  if (bf16_) elementwise_->round_bf16(probs, n * E);
  router_->softmax(probs, n, E);
  int32_t* idx = topk_idx_.data<int32_t>();
  router_->select_topk(idx, topk_w_.f32(), probs, w.expert_bias, n, E, k, c.norm_topk_prob);
  if (bf16_) elementwise_->round_bf16(topk_w_.f32(), n * k);
  moe_->forward(out, moe_buf_, ln_.f32(), idx, topk_w_.f32(), w.wgu, w.wdown, n, k, E, H, Im);
}

}  // namespace titan
