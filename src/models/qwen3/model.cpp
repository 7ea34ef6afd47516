#include "models/qwen3/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "core/error.h"
#include "distributed/expert_parallel.h"
#include "io/hf_checkpoint.h"
#include "kernels/op_timing.h"
#include "kernels/registry.h"
#include "models/qwen3/lora.h"

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
// The bf16 engine of a mixed-precision op (matmul_bf16, moe_experts_bf16): a configured one, else the
// default unless that is only the reference loops (then mixed precision keeps emulating bf16 with the f32
// kernels: null).
template <class K>
const K* pick_bf16_engine(DeviceType dev, const KernelChoice& choice, std::string& name) {
  std::map<std::string, std::string> names;
  const K* k = pick<K>(dev, choice, names);
  if (!choice.count(K::kOp) && names[K::kOp] == "reference") return nullptr;
  name = names[K::kOp];
  return k;
}
}  // namespace

Tensor& Qwen3Model::ensure(Tensor& t, int64_t n, DType dtype) const {
  n = std::max<int64_t>(n, 1);
  if (!t.defined() || t.numel() < n || t.dtype() != dtype) {
    t = Tensor::empty({n}, dtype, device_);
    ++buffers_epoch_;
  }
  return t;
}

void Qwen3Model::time_ops() {
  TITAN_CHECK(!ops_timed_, "time_ops: this model's ops are timed already");
  ops_timed_ = true;
  const bool bf16_mm = matmul_ == &matmul_bf16_, bf16_moe = moe_ == &moe_bf16_;
  matmul_f32_ = timed(matmul_f32_);
  if (matmul16_.forward) use_matmul16(*timed(&matmul16_));
  matmul_ = bf16_mm ? &matmul_bf16_ : matmul_f32_;
  if (moe_f32_) {
    moe_f32_ = timed(moe_f32_, 0);
    if (moe_bf16_.forward) moe_bf16_ = *timed(&moe_bf16_, 1);
    moe_ = bf16_moe ? &moe_bf16_ : moe_f32_;
  }
  rmsnorm_ = timed(rmsnorm_);
  rope_ = timed(rope_);
  if (rope_qk_) rope_qk_ = timed(rope_qk_);
  if (qk_norm_rope_) qk_norm_rope_ = timed(qk_norm_rope_);
  attention_ = timed(attention_);
  if (attention_bf16_) attention_bf16_ = timed(attention_bf16_);
  swiglu_ = timed(swiglu_);
  embedding_ = timed(embedding_);
  cross_entropy_ = timed(cross_entropy_);
  elementwise_ = timed(elementwise_);
  if (router_) router_ = timed(router_);
}

void Qwen3Model::set_bf16_compute(bool on) {
  // (the activations are re-planned at the next forward when the mode changes: the attention's buffers
  // depend on it; a trainer refreshing the bf16 weights every step keeps its buffers)
  if (on != bf16_) B_ = T_ = 0;
  bf16_ = on;
  // Mixed precision: the GEMMs run on bf16 operands with f32 accumulation (op matmul_bf16, e.g. oneDNN on
  // the CPU's bf16 dot-product instructions); the operands are bf16-rounded already, so the math is the same.
  matmul_ = on && matmul_bf16_.forward ? &matmul_bf16_ : matmul_f32_;
  if (!on)
    for (int g = 0; g < static_cast<int>(bf16_image_base_.size()); ++g) drop_bf16_image(g);
  kernel_names_["matmul"] = on && matmul_bf16_.forward ? "bf16:" + matmul_bf16_name_ : matmul_f32_name_;
  // Attention on bf16 q, k, v and output (op attention_bf16, cuDNN's fused attention on a GPU): the values
  // are the bf16-rounded ones the f32 kernel would see, and its output is rounded as the f32 one was.
  kernel_names_["attention"] = on && attention_bf16_ ? "bf16:" + attention_bf16_name_ : attention_f32_name_;
  // q/k norm + RoPE between bf16 tensors (op qk_norm_rope) where the activations are bf16 (wants_act16)
  if (on && qk_norm_rope_)
    kernel_names_["qk_norm_rope"] = qk_norm_rope_name_;
  else
    kernel_names_.erase("qk_norm_rope");
  if (moe_f32_) {  // the routed experts likewise (op moe_experts_bf16)
    moe_ = on && moe_bf16_.forward ? &moe_bf16_ : moe_f32_;
    kernel_names_["moe_experts"] = on && moe_bf16_.forward ? "bf16:" + moe_bf16_name_ : moe_f32_name_;
  }
  if (on)
    for (auto& t : flat_params_)
      if (t.defined()) elementwise_->round_bf16(t.f32(), t.numel());
}

Qwen3Model::~Qwen3Model() {
  for (int g = 0; g < static_cast<int>(bf16_image_.size()); ++g) drop_bf16_image(g);
}

void Qwen3Model::make_bf16_image(int g) {
  // The images serve the CPU's bf16 GEMMs, which look weights up by host address.
  if (device_.type != DeviceType::CPU) return;
  if (bf16_image_.size() < group_numel_.size()) {
    bf16_image_.resize(group_numel_.size());
    bf16_image_base_.resize(group_numel_.size(), nullptr);
  }
  const Tensor& t = flat_params_[g];
  if (!t.defined() || !held_[g]) return;
  if (bf16_image_base_[g] && bf16_image_base_[g] != t.f32()) drop_bf16_image(g);
  if (const uint16_t* held = streamer_ ? streamer_->bf16_params(g) : nullptr) {  // bf16 already
    bf16_image_base_[g] = t.f32();
    register_bf16_image(t.f32(), t.numel(), held);
    return;
  }
  auto& image = bf16_image_[g];
  image.resize(static_cast<size_t>(t.numel()));
  const float* src = t.f32();
  uint16_t* dst = image.data();
  const int64_t n = t.numel();
  elementwise_->to_bf16(dst, src, n);
  bf16_image_base_[g] = src;
  register_bf16_image(src, n, dst);
}

void Qwen3Model::drop_bf16_image(int g) {
  if (g >= static_cast<int>(bf16_image_base_.size()) || !bf16_image_base_[g]) return;
  unregister_bf16_image(bf16_image_base_[g]);
  bf16_image_base_[g] = nullptr;
  // A streamed frozen base (LoRA) keeps no image between uses: it would duplicate the base's bf16 storage.
  if (streamer_ && frozen_) std::vector<uint16_t>().swap(bf16_image_[g]);
}

Qwen3Model::Qwen3Model(const Qwen3Config& config, const KernelChoice& kernels,
                       dist::ProcessGroup* expert_group, bool allocate, Device device,
                       std::vector<StageRange> stages)
    : config_(config), stages_(std::move(stages)), device_(device), dev_(&device_interface(device.type)) {
  config_.validate("model config");
  const int64_t num_layers = config_.num_hidden_layers;
  if (stages_.empty()) stages_.push_back({0, num_layers, true, true});
  for (size_t s = 0; s < stages_.size(); ++s) {
    const StageRange& r = stages_[s];
    TITAN_CHECK(
        r.first <= r.end && r.end <= num_layers && (s == 0 ? r.first >= 0 : r.first >= stages_[s - 1].end),
        "pipeline stages: layers [", r.first, ", ", r.end, ") are not an ascending, disjoint range of the ",
        num_layers, " layers");
    TITAN_CHECK(!r.embedding || (s == 0 && r.first == 0), "pipeline stages: the embedding goes with layer 0");
    TITAN_CHECK(!r.head || (s + 1 == stages_.size() && r.end == num_layers),
                "pipeline stages: the head goes with the last layer");
  }
  layer_grads_zeroed_.assign(stages_.size(), false);
  held_.assign(num_layers + 2, false);
  held_[0] = stage_has_embedding(0) || (stage_has_head(num_stages() - 1) && config_.tie_word_embeddings);
  held_[num_layers + 1] = stage_has_head(num_stages() - 1);
  for (const StageRange& r : stages_)
    for (int64_t l = r.first; l < r.end; ++l) held_[l + 1] = true;
  for (int64_t l = 0; l < num_layers; ++l) total_moe_layers_ += config_.is_moe_layer(l);
  local_experts_ = config_.num_experts;
  if (expert_group && expert_group->size() > 1) {
    ep_ = expert_group;
    ep_size_ = expert_group->size();
    ep_rank_ = expert_group->rank();
    TITAN_CHECK(config_.is_moe(), "parallelism.expert_parallel_degree = ", ep_size_,
                ": the model is dense (num_experts = 0); expert parallel needs a MoE model");
    TITAN_CHECK(config_.num_experts % ep_size_ == 0, "parallelism.expert_parallel_degree = ", ep_size_,
                " does not divide num_experts = ", config_.num_experts);
    local_experts_ = config_.num_experts / ep_size_;
    first_expert_ = ep_rank_ * local_experts_;
  }
  for (auto& [op, _] : kernels) {
    auto ops = KernelRegistry::global().ops();
    TITAN_CHECK(std::find(ops.begin(), ops.end(), op) != ops.end(), "[kernels]: unknown op '", op, "'");
  }
  const DeviceType dev = device.type;
  matmul_ = matmul_f32_ = pick<MatmulKernels>(dev, kernels, kernel_names_);
  matmul_f32_name_ = kernel_names_["matmul"];
  if (const MatmulBf16Kernels* mm = pick_bf16_engine<MatmulBf16Kernels>(dev, kernels, matmul_bf16_name_))
    use_matmul16(*mm);
  rmsnorm_ = pick<RmsNormKernels>(dev, kernels, kernel_names_);
  // The model rotates q and k with one "rope_qk" call. A choice for "rope" names either a rope_qk
  // implementation ("fused", "reference") or a plain per-tensor rope implementation ("fast"), applied to q
  // and then to k; an explicit "rope_qk" choice wins.
  {
    auto& reg = KernelRegistry::global();
    auto has = [&](const char* op, const std::string& impl) {
      auto v = reg.impls(op, dev);
      return std::find(v.begin(), v.end(), impl) != v.end();
    };
    std::string rope_choice = kernels.count("rope") ? kernels.at("rope") : "";
    KernelChoice rope_only;
    if (!rope_choice.empty() && has(RopeKernels::kOp, rope_choice)) rope_only["rope"] = rope_choice;
    rope_ = pick<RopeKernels>(dev, rope_only, kernel_names_);
    KernelChoice qk;
    if (kernels.count("rope_qk")) {
      qk["rope_qk"] = kernels.at("rope_qk");
    } else if (!rope_choice.empty()) {
      TITAN_CHECK(has(RopeQKKernels::kOp, rope_choice) || has(RopeKernels::kOp, rope_choice),
                  "[kernels]: rope has no implementation '", rope_choice, "'");
      if (has(RopeQKKernels::kOp, rope_choice)) qk["rope_qk"] = rope_choice;
    }
    if (rope_choice.empty() || !qk.empty()) {
      rope_qk_ = pick<RopeQKKernels>(dev, qk, kernel_names_);
      kernel_names_["rope"] = kernel_names_["rope_qk"];
    } else {
      kernel_names_.erase("rope_qk");
    }
  }
  // q/k norm + RoPE in one op between bf16 tensors (bf16 activations), unless [kernels] names rmsnorm or
  // rope without naming qk_norm_rope: those then run as named.
  if (!KernelRegistry::global().impls(QKNormRopeKernels::kOp, dev).empty() &&
      (kernels.count("qk_norm_rope") ||
       (!kernels.count("rmsnorm") && !kernels.count("rope") && !kernels.count("rope_qk")))) {
    std::map<std::string, std::string> names;  // listed under bf16 compute
    qk_norm_rope_ = pick<QKNormRopeKernels>(dev, kernels, names);
    qk_norm_rope_name_ = names[QKNormRopeKernels::kOp];
  }
  attention_ = pick<AttentionKernels>(dev, kernels, kernel_names_);
  if (!KernelRegistry::global().impls(AttentionBf16Kernels::kOp, dev).empty()) {
    std::map<std::string, std::string> names;  // listed under bf16 compute
    attention_bf16_ = pick<AttentionBf16Kernels>(dev, kernels, names);
    attention_bf16_name_ = names[AttentionBf16Kernels::kOp];
  }
  attention_f32_name_ = kernel_names_["attention"];
  swiglu_ = pick<SwigluKernels>(dev, kernels, kernel_names_);
  embedding_ = pick<EmbeddingKernels>(dev, kernels, kernel_names_);
  cross_entropy_ = pick<CrossEntropyKernels>(dev, kernels, kernel_names_);
  if (!KernelRegistry::global().impls(VocabParallelCrossEntropyKernels::kOp, dev).empty()) {
    std::map<std::string, std::string> glue;
    cross_entropy_vp_ = pick<VocabParallelCrossEntropyKernels>(dev, kernels, glue);
  }
  if (!KernelRegistry::global().impls(AttentionRingKernels::kOp, dev).empty()) {
    std::map<std::string, std::string> names;  // listed once context parallel is on
    ring_ = pick<AttentionRingKernels>(dev, kernels, names);
    ring_name_ = names[AttentionRingKernels::kOp];
  }
  {
    std::map<std::string, std::string> glue;  // not listed among the model's kernels
    elementwise_ = pick<ElementwiseKernels>(dev, kernels, glue);
    if (config_.is_moe()) router_ = pick<MoeRouterKernels>(dev, kernels, glue);
    if (ep_) ep_kernels_ = pick<ExpertParallelKernels>(dev, kernels, glue);
  }
  if (config_.is_moe()) {
    moe_ = moe_f32_ = pick<MoeExpertsKernels>(dev, kernels, kernel_names_);
    moe_f32_name_ = kernel_names_["moe_experts"];
    if (const MoeExpertsBf16Kernels* mm =
            pick_bf16_engine<MoeExpertsBf16Kernels>(dev, kernels, moe_bf16_name_))
      moe_bf16_ = *mm;
  }

  const auto& c = config_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim, L = c.num_hidden_layers;
  const int64_t E = c.num_experts, Im = c.moe_intermediate_size;
  // (name, shape, random draws of skipped non-local experts before it) per group.
  struct Entry {
    std::string name;
    Shape shape;
    int64_t skip = 0;
  };
  std::vector<std::vector<Entry>> groups;
  int64_t pending_skip = 0;  // init draws of non-local expert weights not yet attributed
  auto add = [&](std::string name, Shape s) {
    groups.back().push_back({std::move(name), std::move(s), pending_skip});
    pending_skip = 0;
  };
  // Non-local experts are not allocated, but init_weights draws their random numbers anyway so that each
  // rank's slice equals the same experts of a model holding all of them.
  auto skip = [&](const Shape& s) { pending_skip += 2 * ((shape_numel(s) + 1) / 2); };
  auto local = [&](int64_t e) { return e >= first_expert_ && e < first_expert_ + local_experts_; };
  groups.emplace_back();
  add("model.embed_tokens.weight", {c.vocab_size, H});
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    groups.emplace_back();
    add(p + "input_layernorm.weight", {H});
    add(p + "self_attn.q_proj.weight", {c.q_dim(), H});
    add(p + "self_attn.k_proj.weight", {c.kv_dim(), H});
    add(p + "self_attn.v_proj.weight", {c.kv_dim(), H});
    add(p + "self_attn.q_norm.weight", {hd});
    add(p + "self_attn.k_norm.weight", {hd});
    add(p + "self_attn.o_proj.weight", {H, c.q_dim()});
    add(p + "post_attention_layernorm.weight", {H});
    if (c.is_moe_layer(l)) {
      // Flat order: router, then per expert gate|up rows (= v5 gate_up_proj [E,2I,H]), then every down_proj.
      add(p + "mlp.gate.weight", {E, H});
      for (int64_t e = 0; e < E; ++e) {
        const std::string ep = p + "mlp.experts." + std::to_string(e) + ".";
        for (auto proj : {"gate_proj.weight", "up_proj.weight"}) {
          if (local(e))
            add(ep + proj, {Im, H});
          else
            skip({Im, H});
        }
      }
      for (int64_t e = 0; e < E; ++e) {
        if (local(e))
          add(p + "mlp.experts." + std::to_string(e) + ".down_proj.weight", {H, Im});
        else
          skip({H, Im});
      }
      if (held_[l + 1]) {
        moe_row_.push_back(static_cast<int>(moe_layers_.size()));
        moe_layers_.push_back(l);
      } else {
        moe_row_.push_back(-1);
      }
    } else {
      add(p + "mlp.gate_proj.weight", {I, H});
      add(p + "mlp.up_proj.weight", {I, H});
      add(p + "mlp.down_proj.weight", {H, I});
      moe_row_.push_back(-1);
    }
  }
  if (total_moe_layers_ > 0) {  // (a stage without sparse layers still passes the aux statistics on)
    expert_bias_ = Tensor::zeros({(int64_t)moe_layers_.size(), E}, DType::F32, device_);
    expert_counts_ = Tensor::zeros({(int64_t)moe_layers_.size(), E}, DType::F32, device_);
    aux_stats_ = Tensor::zeros({2, E}, DType::F64, device_);
    aux_host_.assign(2 * E, 0.0);
    aux_dprob_.assign(E, 0.0f);
    aux_scaled_ = Tensor::zeros({E}, DType::F32, device_);
    if (ep_) ep_layers_.resize(moe_layers_.size());
  }
  groups.emplace_back();
  add("model.norm.weight", {H});
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, H});

  if (allocate) {
    // Parameters and their gradients (f32), before any is allocated: a config asking for more than the
    // device holds is one error, not an allocation failure part-way.
    double numel = 0;
    for (size_t g = 0; g < groups.size(); ++g)
      for (auto& e : groups[g])
        if (held_[g]) numel += (double)shape_numel(e.shape);
    const double need = numel * 8, have = device_memory_bytes();
    TITAN_CHECK(have <= 0 || need <= have, "model config: ", (int64_t)numel, " parameters (hidden_size ",
                c.hidden_size, ", num_hidden_layers ", c.num_hidden_layers, ", intermediate_size ",
                c.intermediate_size, ", vocab_size ", c.vocab_size, ") need ", need / double(1 << 30),
                " GiB for weights and gradients; this machine has ", have / double(1 << 30), " GiB");
  }
  int64_t carried_skip = 0;  // init draws of parameters of layers not held here, before the next held one
  for (size_t g = 0; g < groups.size(); ++g) {
    int64_t total = 0;
    for (auto& e : groups[g]) {
      if (!held_[g]) {
        carried_skip += e.skip + (e.shape.size() > 1 ? 2 * ((shape_numel(e.shape) + 1) / 2) : 0);
        continue;
      }
      e.skip += carried_skip;
      carried_skip = 0;
      Param p;
      p.name = e.name;
      p.group = static_cast<int>(g);
      p.offset = total;
      p.shape = e.shape;
      params_.push_back(std::move(p));
      init_skip_.push_back(e.skip);
      total += shape_numel(e.shape);
    }
    group_numel_.push_back(total);
    flat_params_.push_back(allocate ? Tensor::zeros({total}, DType::F32, device_) : Tensor());
    flat_grads_.push_back(allocate ? Tensor::zeros({total}, DType::F32, device_) : Tensor());
  }
  if (!allocate) return;
  make_param_views();
  init_weights(0);
}

// The memory of the model's device (host memory for the cpu); 0 when the device does not say.
double Qwen3Model::device_memory_bytes() const {
  return dev_->memory_bytes ? (double)dev_->memory_bytes() : 0.0;
}

bool Qwen3Model::frozen_scratch_grads(int g) const {
  return g >= 1 && g <= config_.num_hidden_layers && config_.is_moe_layer(g - 1);
}

void Qwen3Model::set_lora(LoraAdapters* lora) {
  lora_ = lora;
  // Re-plan the activations at the next forward (an adapter's projections read and write f32 activations).
  B_ = T_ = 0;
  if (!lora || frozen_) return;
  frozen_ = true;
  // Base gradients are never computed from now on: drop their buffers (sparse layers keep a scratch one).
  for (int g = 0; g < num_groups(); ++g)
    if (!frozen_scratch_grads(g)) flat_grads_[g] = Tensor();
  for (auto& p : params_) p.grad = Tensor();
}

void Qwen3Model::make_param_views() {
  for (auto& p : params_) {
    p.value = flat_params_[p.group].view_at(p.offset, p.shape);
    p.grad = flat_grads_[p.group].defined() ? flat_grads_[p.group].view_at(p.offset, p.shape) : Tensor();
  }
}

void Qwen3Model::set_param_streamer(ParamStreamer* streamer) {
  if (streamer == streamer_) return;
  if (streamer) {
    TITAN_CHECK(!streamer_, "set_param_streamer: the parameters are already streamed");
    streamer_ = streamer;
    for (int g = 0; g < static_cast<int>(bf16_image_base_.size()); ++g) drop_bf16_image(g);
    for (auto& p : params_) p.value = p.grad = Tensor();
    for (auto& t : flat_params_) t = Tensor();
    for (auto& t : flat_grads_) t = Tensor();
    return;
  }
  ParamStreamer* from = streamer_;
  streamer_ = nullptr;
  for (int g = 0; g < num_groups(); ++g) {
    drop_bf16_image(g);
    flat_params_[g] = from->gather_params(g).clone();
    from->release_params(g);
    round_bf16_if(flat_params_[g].f32(), flat_params_[g].numel());
    flat_grads_[g] = frozen_ && !frozen_scratch_grads(g)
                         ? Tensor()
                         : Tensor::zeros({group_numel_[g]}, DType::F32, device_);
  }
  make_param_views();
}

void Qwen3Model::acquire_params(int g) {
  if (!streamer_) return;
  flat_params_[g] = streamer_->gather_params(g);
  round_bf16_if(flat_params_[g].f32(), flat_params_[g].numel());
  // An untied embedding is no GEMM operand.
  if (bf16_ && matmul_ == &matmul_bf16_ && (g != 0 || config_.tie_word_embeddings)) make_bf16_image(g);
}

void Qwen3Model::release_params(int g) {
  if (!streamer_) return;
  drop_bf16_image(g);
  flat_params_[g] = Tensor();
  streamer_->release_params(g);
}

// Idempotent: the head's buffers are acquired by forward() (which takes the lm_head gradient) and again
// by backward().
void Qwen3Model::acquire_grads(int g) {
  if (frozen_) {  // only sparse layers need a buffer (scratch for the expert kernels)
    if (streamer_ && frozen_scratch_grads(g) && !flat_grads_[g].defined())
      flat_grads_[g] = Tensor::zeros({group_numel_[g]}, DType::F32, device_);
    return;
  }
  if (streamer_ && !flat_grads_[g].defined()) flat_grads_[g] = streamer_->grad_buffer(g);
}

void Qwen3Model::finish_grads(int g) {
  if (!streamer_) return;
  if (frozen_) {
    flat_grads_[g] = Tensor();
    return;
  }
  flat_grads_[g] = Tensor();
  streamer_->reduce_grads(g);
}

bool Qwen3Model::hf_key_without_parameter(const Qwen3Config& config, const std::string& key) {
  // A tied checkpoint may or may not carry lm_head.weight; the rotary buffer is not a parameter.
  return (config.tie_word_embeddings && key == "lm_head.weight") || key.ends_with("rotary_emb.inv_freq");
}

void Qwen3Model::allocate_inference_params() {
  TITAN_CHECK(!streamer_, "allocate_inference_params: the parameters are streamed");
  for (int g = 0; g < num_groups(); ++g)
    if (!flat_params_[g].defined()) flat_params_[g] = Tensor::zeros({group_numel_[g]}, DType::F32, device_);
  make_param_views();
}

void Qwen3Model::own_param_streamer(std::unique_ptr<ParamStreamer> streamer) {
  TITAN_CHECK(streamer && streamer.get() == streamer_, "own_param_streamer: set the streamer first");
  owned_streamer_ = std::move(streamer);
}

Param& Qwen3Model::param(const std::string& name) {
  for (auto& p : params_)
    if (p.name == name) return p;
  fail("model has no parameter '", name, "'");
}

int64_t Qwen3Model::num_params() const {
  int64_t n = 0;
  for (int64_t g : group_numel_) n += g;
  return n;
}

Qwen3Model::LayerView Qwen3Model::layer_view(int64_t layer, float* base) const {
  const auto& c = config_;
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  LayerView v;
  v.router = nullptr;
  float* p = base;
  v.input_norm = p, p += H;
  v.wq = p, p += c.q_dim() * H;
  v.wk = p, p += c.kv_dim() * H;
  v.wv = p, p += c.kv_dim() * H;
  v.q_norm = p, p += c.head_dim;
  v.k_norm = p, p += c.head_dim;
  v.wo = p, p += H * c.q_dim();
  v.post_norm = p, p += H;
  if (c.is_moe_layer(layer)) {
    const int64_t E = c.num_experts, El = local_experts_, Im = c.moe_intermediate_size;
    v.router = p, p += E * H;
    v.wgu = p, p += El * 2 * Im * H;
    v.wdown = p;
    return v;
  }
  v.wgu = p, p += 2 * I * H;
  v.wdown = p;
  return v;
}

void Qwen3Model::init_weights(uint64_t seed) {
  TITAN_CHECK(!streamer_,
              "the parameters are streamed (FSDP); take them back with set_param_streamer(nullptr) first");
  std::mt19937_64 rng(seed);
  const double std = config_.initializer_range;
  for (size_t pi = 0; pi < params_.size(); ++pi) {
    auto& p = params_[pi];
    rng.discard(init_skip_[pi]);
    // Drawn in host memory, then copied to the device (the same copy on the CPU).
    std::vector<float> host(static_cast<size_t>(p.value.numel()));
    draw_init(rng, p.shape, std, host.data());
    p.value.copy_from_host(host.data());
  }
}

void Qwen3Model::draw_init(std::mt19937_64& rng, const Shape& shape, double std, float* w) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (shape.size() == 1) {
    std::fill_n(w, n, 1.0f);
    return;
  }
  // Box-Muller on 53-bit uniforms: identical on every platform for a given seed.
  for (int64_t i = 0; i < n; i += 2) {
    double u1 = ((rng() >> 11) + 1.0) * 0x1.0p-53, u2 = (rng() >> 11) * 0x1.0p-53;
    double r = std::sqrt(-2.0 * std::log(u1));
    w[i] = static_cast<float>(std * r * std::cos(2 * M_PI * u2));
    if (i + 1 < n) w[i + 1] = static_cast<float>(std * r * std::sin(2 * M_PI * u2));
  }
}

namespace {
// Keys of the transformers-v5 fused expert tensors of layer l.
std::string fused_gate_up_key(int64_t l) {
  return "model.layers." + std::to_string(l) + ".mlp.experts.gate_up_proj";
}
std::string fused_down_key(int64_t l) {
  return "model.layers." + std::to_string(l) + ".mlp.experts.down_proj";
}
}  // namespace

// (name, view) pairs to read or write: the Param list, with each MoE layer's per-expert tensors replaced by
// the two fused v5 tensors when fused(l). Under expert parallel the fused views cover the local experts
// [first, first + El) only.
template <class Fused>
static std::vector<std::pair<std::string, Tensor>> io_tensors(const Qwen3Config& c,
                                                              const std::vector<Param>& params,
                                                              const std::vector<Tensor>& flat, Fused fused,
                                                              int64_t first, int64_t El) {
  std::vector<std::pair<std::string, Tensor>> out;
  const std::string marker = ".mlp.experts.";
  for (auto& p : params) {
    const size_t pos = p.name.find(marker);
    if (pos == std::string::npos) {
      out.emplace_back(p.name, p.value);
      continue;
    }
    const int64_t l = p.group - 1;
    if (!fused(l)) {
      out.emplace_back(p.name, p.value);
      continue;
    }
    // Emit the fused pair once, at the first expert's gate_proj (the start of the [E,2I,H] block) and
    // down_proj.
    const int64_t Im = c.moe_intermediate_size, H = c.hidden_size;
    const std::string first_expert = ".experts." + std::to_string(first) + ".";
    if (p.name.ends_with(first_expert + "gate_proj.weight"))
      out.emplace_back(fused_gate_up_key(l), flat[p.group].view_at(p.offset, {El, 2 * Im, H}));
    else if (p.name.ends_with(first_expert + "down_proj.weight"))
      out.emplace_back(fused_down_key(l), flat[p.group].view_at(p.offset, {El, H, Im}));
  }
  return out;
}

void Qwen3Model::load_hf(const std::string& dir, const TensorSlicer& slice) {
  TITAN_CHECK(!streamer_,
              "the parameters are streamed (FSDP); take them back with set_param_streamer(nullptr) first");
  HFCheckpointReader ckpt(dir);
  const auto targets = io_tensors(
      config_, params_, flat_params_, [&](int64_t l) { return ckpt.contains(fused_gate_up_key(l)); },
      first_expert_, local_experts_);
  // Expert parallel: the other ranks' experts are in the checkpoint but not here.
  auto other_rank_expert = [&](const std::string& key) {
    const size_t pos = key.find(".mlp.experts.");
    if (!ep_ || pos == std::string::npos) return false;
    const char* digits = key.c_str() + pos + 13;
    if (*digits < '0' || *digits > '9') return false;
    const int64_t e = std::strtoll(digits, nullptr, 10);
    return e < first_expert_ || e >= first_expert_ + local_experts_;
  };
  // Pipeline parallel: the other stages' tensors are in the checkpoint but not here (each is checked by
  // the stage holding it).
  const int64_t L = config_.num_hidden_layers;
  auto other_stage = [&](const std::string& key) {
    if (key == "model.embed_tokens.weight") return !held_[0];
    if (key == "model.norm.weight" || key == "lm_head.weight") return !held_[L + 1];
    if (!key.starts_with("model.layers.")) return false;
    const char* digits = key.c_str() + 13;
    if (*digits < '0' || *digits > '9') return false;
    const int64_t l = std::strtoll(digits, nullptr, 10);
    return l < L && !held_[l + 1];
  };
  std::set<std::string> expected;
  for (auto& [name, _] : targets) expected.insert(name);
  std::vector<std::string> missing, unexpected;
  for (auto& name : expected)
    if (!ckpt.contains(name)) missing.push_back(name);
  for (auto& key : ckpt.keys()) {
    if (expected.count(key)) continue;
    if (hf_key_without_parameter(config_, key)) continue;
    if (other_rank_expert(key) || other_stage(key)) continue;
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
  for (auto [name, view] : targets) {
    if (ep_ && (name.ends_with(".mlp.experts.gate_up_proj") || name.ends_with(".mlp.experts.down_proj"))) {
      // Fused [E, ...] tensor: read it whole, keep this rank's experts.
      Shape full = view.shape();
      full[0] = config_.num_experts;
      Tensor all = Tensor::empty(full);
      ckpt.read_into(name, all);
      const int64_t per = view.numel() / local_experts_;
      view.copy_from(all.view_at(first_expert_ * per, view.shape()));
      continue;
    }
    if (slice) {
      const SafetensorsEntry& e = ckpt.file_of(name).entries().at(name);
      Tensor full = Tensor::empty(e.shape);
      ckpt.read_into(name, full);
      const Tensor part = slice(name, full);
      TITAN_CHECK(part.shape() == view.shape(), dir, ": tensor ", name, " does not slice into this model's ",
                  "parameter (shape ", shape_str(e.shape), ")");
      view.copy_from(part);
    } else if (device_.type == DeviceType::CPU) {
      ckpt.read_into(name, view);
    } else {  // read in host memory, then copy
      Tensor host = Tensor::empty(view.shape());
      ckpt.read_into(name, host);
      view.copy_from(host);
    }
  }
}

NamedTensors Qwen3Model::state_dict(bool fused_experts) const {
  TITAN_CHECK(!streamer_,
              "the parameters are streamed (FSDP); take them back with set_param_streamer(nullptr) first");
  NamedTensors out;
  for (auto& [name, view] : io_tensors(
           config_, params_, flat_params_, [&](int64_t) { return fused_experts; }, first_expert_,
           local_experts_))
    out.emplace_back(name, view.to(Device::cpu()));
  return out;
}

std::vector<int64_t> Qwen3Model::expert_offsets() const {
  std::vector<int64_t> out = group_numel_;
  for (auto& p : params_)
    if (p.name.find(".mlp.experts.") != std::string::npos) out[p.group] = std::min(out[p.group], p.offset);
  return out;
}

NamedTensors Qwen3Model::gathered_state_dict() const {
  if (!ep_) return state_dict();
  const auto& c = config_;
  const int64_t E = c.num_experts, El = local_experts_, Im = c.moe_intermediate_size, H = c.hidden_size;
  const bool root = ep_rank_ == 0;
  NamedTensors out;
  for (size_t pi = 0; pi < params_.size(); ++pi) {
    const Param& p = params_[pi];
    if (p.name.find(".mlp.experts.") == std::string::npos) {
      if (root) out.emplace_back(p.name, p.value.to(Device::cpu()));
      continue;
    }
    // The layer's expert block starts at its first local gate_proj: gate|up (El,2I,H), then down (El,H,I).
    if (!p.name.ends_with(".experts." + std::to_string(first_expert_) + ".gate_proj.weight")) continue;
    const std::string prefix = p.name.substr(0, p.name.find(".mlp.experts.") + 13);
    const int64_t gu = El * 2 * Im * H, down = El * H * Im;
    Tensor all_gu = Tensor::empty({E, 2 * Im, H}, DType::F32, device_),
           all_down = Tensor::empty({E, H, Im}, DType::F32, device_);
    const float* base = flat_params_[p.group].f32() + p.offset;
    ep_->all_gather(base, all_gu.f32(), std::vector<int64_t>(ep_size_, gu), dist::CommType::F32);
    ep_->all_gather(base + gu, all_down.f32(), std::vector<int64_t>(ep_size_, down), dist::CommType::F32);
    if (!root) continue;
    all_gu = all_gu.to(Device::cpu()), all_down = all_down.to(Device::cpu());
    for (int64_t e = 0; e < E; ++e) {
      out.emplace_back(prefix + std::to_string(e) + ".gate_proj.weight",
                       all_gu.view_at(e * 2 * Im * H, {Im, H}));
      out.emplace_back(prefix + std::to_string(e) + ".up_proj.weight",
                       all_gu.view_at(e * 2 * Im * H + Im * H, {Im, H}));
    }
    for (int64_t e = 0; e < E; ++e)
      out.emplace_back(prefix + std::to_string(e) + ".down_proj.weight",
                       all_down.view_at(e * H * Im, {H, Im}));
  }
  return out;
}

void Qwen3Model::load_state_dict(const NamedTensors& tensors) {
  std::map<std::string, const Tensor*> by_name;
  for (auto& [name, t] : tensors) by_name[name] = &t;
  for (auto& p : params_) {
    auto it = by_name.find(p.name);
    TITAN_CHECK(it != by_name.end(), "load_state_dict: no tensor '", p.name, "'");
    TITAN_CHECK(it->second->shape() == p.shape, "load_state_dict: '", p.name, "' has shape ",
                shape_str(it->second->shape()), ", the model expects ", shape_str(p.shape));
    p.value.copy_from(*it->second);
  }
}

void Qwen3Model::save_hf(const std::string& dir, DType dtype, int64_t max_shard_bytes,
                         bool fused_experts) const {
  TITAN_CHECK(!ep_, "save_hf: this model holds ", local_experts_, " of ", config_.num_experts,
              " experts per layer (expert parallel); write gathered_state_dict() instead");
  save_hf_checkpoint(dir, config_.to_hf_json(), state_dict(fused_experts), dtype, max_shard_bytes);
}

NamedTensors Qwen3Model::buffers() const {
  NamedTensors out;
  const int64_t E = config_.num_experts;
  for (size_t m = 0; m < moe_layers_.size(); ++m)
    out.emplace_back("model.layers." + std::to_string(moe_layers_[m]) + ".mlp.expert_bias",
                     expert_bias_.view_at(m * E, {E}));
  return out;
}

void Qwen3Model::update_expert_bias() {
  if (moe_layers_.empty() || config_.load_balance_coeff <= 0) return;
  const int64_t E = config_.num_experts;
  for (size_t m = 0; m < moe_layers_.size(); ++m)
    router_->update_bias(expert_bias_.f32() + m * E, expert_counts_.f32() + m * E, E,
                         config_.load_balance_coeff);
}

void Qwen3Model::zero_grad() {
  if (lora_) lora_->zero_grad();
  if (streamer_) {
    streamer_->zero_grads();
    return;
  }
  if (frozen_) {
    for (auto& g : flat_grads_)
      if (g.defined()) g.zero_();
  } else {
    zero_accumulated_grads();
  }
  head_grad_zeroed_ = true;
  layer_grads_zeroed_.assign(stages_.size(), true);
}

}  // namespace titan
