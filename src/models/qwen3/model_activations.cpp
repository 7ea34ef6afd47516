// Qwen3Model's activation plan and positions: the buffers each layer keeps under each activation
// checkpointing policy (none, every N-th layer, selective by op), the lm_head chunking, and the RoPE tables
// (position tables, or per-token tables and the attention's doc_start for packed rows).
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "models/qwen3/model.h"

namespace titan {

int64_t Qwen3Model::activation_bytes() const {
  int64_t n = 0;
  for (auto& t : acts_) n += t.nbytes();
  return n;
}

void Qwen3Model::build_rope_tables(int64_t T) {
  if (rope_T_ == T) return;
  make_rope_tables(config_, T, device_, rope_cos_, rope_sin_);
  rope_T_ = T;
}

// Packed rows, and every row under context parallel: per-token RoPE tables and the attention's document
// starts. Under context parallel a row's position is its place in the whole sequence (the rank's two
// chunks), position_ids (if any) that of the whole sequence, and doc_start_ holds positions in it. A
// micro-batch staged by stage_inputs() (staged_slot >= 0) has its tables on the device already: copied there.
void Qwen3Model::set_packing(const int32_t* position_ids, int64_t staged_slot) {
  packed_ = position_ids != nullptr || cp_;
  cp_docs_ = cp_ && position_ids;
  if (!packed_) return;
  const int64_t N = B_ * T_, half = config_.head_dim / 2;
  // (context parallel without packing: the same positions every forward of this shape)
  if (!position_ids && cp_tables_ready_) return;
  cp_tables_ready_ = !position_ids;
  if (!doc_start_.defined() || doc_start_.numel() != N) {
    doc_start_ = Tensor::empty({N}, DType::I32, device_);
    token_cos_ = Tensor::empty({N, half}, DType::F32, device_);
    token_sin_ = Tensor::empty({N, half}, DType::F32, device_);
    ++buffers_epoch_;
  }
  if (position_ids && staged_slot >= 0) {
    copy_staged(doc_start_, staged_doc_start_, staged_slot, N);
    copy_staged(token_cos_, staged_cos_, staged_slot, N * half);
    copy_staged(token_sin_, staged_sin_, staged_slot, N * half);
    return;
  }
  std::vector<int32_t> start;
  std::vector<float> tcos, tsin;
  packing_tables(position_ids, start, tcos, tsin);
  doc_start_.copy_from_host(start.data());
  token_cos_.copy_from_host(tcos.data());
  token_sin_.copy_from_host(tsin.data());
}

// set_packing's tables of the (B_, T_) rows, on the host: each token's document start (N) and its RoPE rows
// (N, hd/2; row n is the position table's row of the token's position: bit-equal to the unpacked values).
// position_ids are checked here.
void Qwen3Model::packing_tables(const int32_t* position_ids, std::vector<int32_t>& start,
                                std::vector<float>& tcos, std::vector<float>& tsin) const {
  const int64_t B = B_, T = T_, N = B * T, half = config_.head_dim / 2;
  std::vector<int32_t> pos(N);
  start.assign(N, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = b * T + t;
      const int64_t g = cp_ ? context_parallel_position(cp_->rank(), cp_->size(), T, t) : t;
      if (!position_ids) {
        pos[n] = static_cast<int32_t>(g);
        continue;
      }
      const int32_t p = position_ids[n];
      if (cp_) {
        // (a chunk's first row may continue a document of the chunk before it)
        const bool chunk_start = t % (T / 2) == 0;
        TITAN_CHECK(p >= 0 && p <= g && (chunk_start || p == 0 || p == position_ids[n - 1] + 1),
                    "position_ids[", b, "][", t, "] = ", p, " (position ", g,
                    " of the sequence under context parallel): a packed row's positions count 0, 1, 2, ... "
                    "from each document's first token");
      } else {
        TITAN_CHECK(p == 0 || (t > 0 && p == position_ids[n - 1] + 1), "position_ids[", b, "][", t, "] = ", p,
                    ": a packed row's positions count 0, 1, 2, ... from each document's first token",
                    t == 0 ? " (a row starts with 0)" : "");
      }
      pos[n] = p;
      start[n] = static_cast<int32_t>(g - p);
    }
  std::vector<float> cos(rope_T_ * half), sin(rope_T_ * half);
  tcos.resize(N * half);
  tsin.resize(N * half);
  rope_cos_.copy_to_host(cos.data());
  rope_sin_.copy_to_host(sin.data());
  for (int64_t n = 0; n < N; ++n) {
    std::copy_n(cos.data() + pos[n] * half, half, tcos.data() + n * half);
    std::copy_n(sin.data() + pos[n] * half, half, tsin.data() + n * half);
  }
}

Qwen3Model::RopeTables Qwen3Model::rope_tables() const {
  if (packed_) return {token_cos_.f32(), token_sin_.f32(), B_ * T_};
  return {rope_cos_.f32(), rope_sin_.f32(), T_};
}

void make_rope_tables(const Qwen3Config& c, int64_t T, Device device, Tensor& cos_out, Tensor& sin_out) {
  // HF: inv_freq = 1 / base^(arange(0, hd, 2)/hd) in fp32; freqs = pos * inv_freq; cos/sin in fp32.
  const int64_t half = c.head_dim / 2;
  std::vector<float> cos(T * half), sin(T * half);
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(c.head_dim);
    const float inv_freq = 1.0f / static_cast<float>(std::pow(c.rope_theta, (double)exponent));
    for (int64_t t = 0; t < T; ++t) {
      const float f = static_cast<float>(t) * inv_freq;
      cos[t * half + i] = static_cast<float>(std::cos((double)f));
      sin[t * half + i] = static_cast<float>(std::sin((double)f));
    }
  }
  cos_out = Tensor::empty({T, half}, DType::F32, device);
  sin_out = Tensor::empty({T, half}, DType::F32, device);
  cos_out.copy_from_host(cos.data());
  sin_out.copy_from_host(sin.data());
}

void Qwen3Model::set_head_chunk_rows(int64_t rows) {
  TITAN_CHECK(rows >= 0, "head chunk rows must be >= 0 (0 = automatic), got ", rows);
  if (rows != head_chunk_rows_) B_ = T_ = 0;  // re-plan the activations at the next forward
  head_chunk_rows_ = rows;
}

void Qwen3Model::set_activation_checkpoint_every(int64_t every) {
  TITAN_CHECK(every >= 0, "activation checkpointing: every must be >= 0, got ", every);
  if (every != ac_every_) B_ = T_ = 0;  // re-plan the activations at the next forward
  ac_every_ = every;
}

void Qwen3Model::set_activation_recompute_ops(bool on) {
  if (on != ac_ops_) B_ = T_ = 0;  // re-plan the activations at the next forward
  ac_ops_ = on;
}

void Qwen3Model::plan_activations(int64_t B, int64_t T) {
  if (B == B_ && T == T_) return;
  ++buffers_epoch_;
  cp_tables_ready_ = false;
  attn16_ = wants_attn16();
  const bool act16 = wants_act16();
  o16_ = attn16_ && act16;
  mlp16_ = act16;
  qk_fused_ = o16_ && qk_norm_rope_;
  ln16_ = act16 && !sp_;
  dgu16_ = ln16_ && swiglu_->backward_bf16_output && matmul16_.backward_bf16_io;
  qkv16_grads_ = qk_fused_ && ln16_ && matmul16_.backward_bf16_io;
  resid16_ = ln16_ && rmsnorm_->forward_bf16_io && elementwise_->add_to_bf16;
  const auto& c = config_;
  const int64_t N = B * T, H = c.hidden_size, I = c.intermediate_size, nH = c.num_attention_heads,
                nKV = c.num_key_value_heads, L = c.num_hidden_layers;
  const int64_t E = c.num_experts, k = c.num_experts_per_tok, Im = c.moe_intermediate_size;
  // Sequence parallel: the residual stream (layer inputs, resid_mid, the norms' rstd, the final norm's
  // input and its gradient) holds this rank's Nl rows.
  TITAN_CHECK(!sp_ || N % tp_->size() == 0, "sequence parallel: batch ", B, " x seq_len ", T, " = ", N,
              " tokens do not split evenly over the ", tp_->size(), " tensor-parallel ranks");
  const int64_t Nl = sp_ ? N / tp_->size() : N;
  {
    // What the buffers below will take, in double (a sequence of 2^31 tokens overflows nothing here), before
    // any is allocated: more than this machine holds is one error naming the batch and the sequence.
    const double n = double(B) * double(T), saved = c.num_attention_heads * n * (double(T) + 1);
    // (bf16 attention: q/k/v f32 become scratch, their bf16 copies and the output's are kept, q/k/v
    // and output as bf16 take half a float each)
    // (bf16 norm outputs: ln1 and ln2 half a float each; bf16 q/k before their norms likewise; the bf16
    // residual stream: resid_in and resid_mid too)
    const double norms = (resid16_ ? 2.0
                          : ln16_  ? 3.0
                                   : 4.0) *
                         H,
                 raw = (mlp16_ ? 0.5 : 1.0) * (c.q_dim() + c.kv_dim());
    const double attn_d =
        attn16_ ? n * (norms + 2 + raw + (o16_ ? 1.0 : 2.0) * c.q_dim() + c.kv_dim() + nH + nKV + nH)
                : n * (norms + 2 + raw + 2.0 * c.q_dim() + 2.0 * c.kv_dim() + nH + nKV) + saved;
    const double mlp_d = E > 0 ? n * (E + k + 3.0 * k * Im) : n * (mlp16_ ? 1.5 : 3.0) * I;
    // Op-selective layers keep ln1, ln2, qr, kr (and a dense layer's act) in one shared block instead.
    const double pointwise = n * ((ln16_ ? 1.0 : 2.0) * H + (attn16_ ? 0 : c.q_dim() + c.kv_dim())),
                 act = n * I * (mlp16_ ? 0.5 : 1.0);
    int64_t checkpointed = 0, op_layers = 0, op_dense = 0, held = 0, stage_inputs = 0;
    for (const StageRange& r : stages_) stage_inputs += r.first < r.end;
    for (int64_t l = 0; l < L; ++l) {
      if (!held_[l + 1]) continue;
      ++held;
      checkpointed += layer_checkpointed(l);
      op_layers += layer_recomputes_ops(l);
      op_dense += layer_recomputes_ops(l) && !c.is_moe_layer(l);
    }
    const double recomputed =
        op_layers * pointwise + op_dense * act - (op_layers > 0 ? pointwise + (op_dense > 0 ? act : 0) : 0);
    const double bytes =
        4 * (checkpointed * n * H * (resid16_ ? 0.5 : 1.0) + (held - checkpointed) * (attn_d + mlp_d) -
             recomputed + (checkpointed > 0 ? attn_d + mlp_d : 0) +
             (resid16_ ? 0.5 * stage_inputs * n * H : 0) +  // (a stage's first layer's input is f32)
             n * ((resid16_ ? 7.0 : 6.0) * H + 4.0 * c.q_dim() + 4.0 * c.kv_dim() + (dgu16_ ? 2.0 : 3.0) * I +
                  2) +
             (attn16_ ? n * (c.q_dim() + c.kv_dim() + (o16_ ? 0 : c.kv_dim()) +
                             (qk_fused_ ? -0.5 : 1.0) * (c.q_dim() + c.kv_dim()) -
                             (qkv16_grads_ ? c.q_dim() + 2.0 * c.kv_dim() : 0))
                      : 0) +
             std::min(n * c.vocab_size, double(kHeadChunkBytes) / 4));
    const double have = device_memory_bytes();
    TITAN_CHECK(have <= 0 || bytes <= have, "activations for batch ", B, " x seq_len ", T, " need ",
                bytes / double(1 << 30), " GiB; this machine has ", have / double(1 << 30), " GiB");
  }
  acts_.clear();
  layer_acts_.assign(L, {});
  if (attn16_) {
    // qr | kr | v in f32 for the layer being run (converted to its bf16 copies; qr and kr only where
    // qk_norm_rope does not write q16/k16 itself, v only where its GEMM does not write v16 itself), and the
    // backward's datt | dq | dk | dv in bf16.
    const int64_t scratch = (qk_fused_ ? 0 : N * (c.q_dim() + c.kv_dim())) + (o16_ ? 0 : N * c.kv_dim());
    attn_scratch_ = scratch > 0 ? Tensor::empty({scratch}, DType::F32, device_) : Tensor();
    attn16_grads_ =
        Tensor::empty({attn16_grad_offset(qk_fused_ ? 5 : 3, N) + N * c.kv_dim()}, DType::BF16, device_);
  } else {
    attn_scratch_ = attn16_grads_ = Tensor();
  }
  bool any_dense = false;
  // One float allocation per layer (plus one int32 for MoE routing), carved into named pointers.
  // ln1 and ln2 are saved as this rank's rows too (re-gathered for the backward's GEMMs), except ln2 of a
  // sparse layer run replicated on the gathered rows.
  auto ln2_rows = [&](int64_t l) { return sp_ && (!c.is_moe_layer(l) || moe_local_) ? Nl : N; };
  // n bf16 values in halves of floats, 16-byte aligned (as cuDNN wants its tensors): up to 3 floats of
  // padding before them.
  auto bf16_floats = [](int64_t n) { return (n + 1) / 2 + 3; };
  // resid_in, ln1, resid_mid, ln2; under ln16_ ln1 bf16 and ln2 bf16 (a sparse layer's ln2 stays f32: the
  // block is sized for it where the model has sparse layers), under resid16_ resid_in and resid_mid bf16 too
  // (a stage's first layer's f32 input has a buffer of its own).
  const int64_t input = resid16_ ? bf16_floats(Nl * H) : Nl * H;  // (the layer input's share of the block)
  const int64_t norms = ln16_ ? input + (resid16_ ? bf16_floats(Nl * H) : Nl * H) + bf16_floats(N * H) +
                                    (E > 0 ? N * H : bf16_floats(N * H))
                              : N * H + Nl * H * 3;
  std::vector<bool> stage_first(L, false);
  for (const StageRange& r : stages_)
    if (r.first < r.end) stage_first[r.first] = true;
  // q_raw, k_raw: f32, or bf16 (bf16 activations: qk16).
  const bool qk16 = mlp16_;
  const int64_t raw =
      qk16 ? bf16_floats(N * c.q_dim()) + bf16_floats(N * c.kv_dim()) : N * (c.q_dim() + c.kv_dim());
  // The rest of the attention's tensors: under bf16 attention att (f32; none under o16_) and q16 | k16 |
  // v16 | att16 (bf16, each 16-byte aligned), else att, qr, kr, v (f32); the norms' rstd, the q/k norms'
  // rstd, the saved logsumexp (or probabilities).
  const int64_t attn = attn16_ ? norms + Nl * 2 + raw + N * c.q_dim() * (o16_ ? 1 : 2) + N * c.kv_dim() +
                                     4 * 4 + N * (nH + nKV) + attn_saved_floats(B, T, nH)
                               : norms + Nl * 2 + raw + N * c.q_dim() * 2 + N * c.kv_dim() * 2 +
                                     N * (nH + nKV) + attn_saved_floats(B, T, nH);
  // A dense layer's gate/up and act: f32, or bf16.
  const int64_t dense_mlp = mlp16_ ? bf16_floats(N * 2 * I) + bf16_floats(N * I) : N * 3 * I,
                dense_act = mlp16_ ? bf16_floats(N * I) : N * I;
  // Checkpointing: a checkpointed layer keeps only its input; the rest is one block shared by those layers
  // (a layer's activations are recomputed into it during backward).
  float* shared = nullptr;
  int32_t* shared_int = nullptr;
  bool any_checkpointed = false;
  for (int64_t l = 0; l < L; ++l) any_checkpointed |= held_[l + 1] && layer_checkpointed(l);
  if (any_checkpointed) {
    int64_t mlp_max = 0;
    for (int64_t l = 0; l < L; ++l)
      if (held_[l + 1])
        mlp_max =
            std::max(mlp_max, c.is_moe_layer(l) ? N * E + N * k + N * k * 2 * Im + N * k * Im : dense_mlp);
    acts_.push_back(Tensor::empty({attn + mlp_max}, DType::F32, device_));
    shared = acts_.back().f32();
    if (!moe_layers_.empty()) {
      acts_.push_back(Tensor::empty({N * k * 3 + E + 1}, DType::I32, device_));
      shared_int = acts_.back().data<int32_t>();
    }
  }
  // Op-selective layers: their pointwise outputs (ln1, qr, kr, ln2, a dense layer's act) live in one block
  // shared by those layers, recomputed before each layer's backward.
  auto pointwise_floats = [&](int64_t l) {
    const int64_t lns = !ln16_ ? (Nl + ln2_rows(l)) * H
                               : bf16_floats(N * H) + (c.is_moe_layer(l) ? N * H : bf16_floats(N * H));
    return lns + (attn16_ ? 0 : N * (c.q_dim() + c.kv_dim())) + (c.is_moe_layer(l) ? 0 : dense_act);
  };
  float* ops_shared = nullptr;
  int64_t ops_max = 0;
  for (int64_t l = 0; l < L; ++l)
    if (held_[l + 1] && layer_recomputes_ops(l)) ops_max = std::max(ops_max, pointwise_floats(l));
  if (ops_max > 0) {
    acts_.push_back(Tensor::empty({ops_max}, DType::F32, device_));
    ops_shared = acts_.back().f32();
  }
  for (int64_t l = 0; l < L; ++l) {
    if (!held_[l + 1]) continue;
    const bool moe = c.is_moe_layer(l), ck = layer_checkpointed(l), rec = layer_recomputes_ops(l);
    any_dense |= !moe;
    const int64_t mlp = moe ? N * E + N * k + N * k * 2 * Im + N * k * Im : dense_mlp;
    // The layer's input: bf16 under resid16_ except a stage's first layer's (f32); a buffer of its own for
    // a checkpointed layer (its only saved tensor) and for that f32 input, else in the layer's block.
    const bool in16 = resid16_ && !stage_first[l], own_input = ck || (resid16_ && !in16);
    float* p = shared;
    if (!ck) {
      acts_.push_back(Tensor::empty({attn + mlp - (rec ? pointwise_floats(l) : 0) - (own_input ? input : 0)},
                                    DType::F32, device_));
      p = acts_.back().f32();
    }
    auto take = [&p](int64_t n) {
      float* r = p;
      p += n;
      return r;
    };
    // n bf16 values at the next 16-byte boundary of `at` (each block starts at one).
    auto take_bf16_at = [](float*& at, int64_t n) {
      at = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(at) + 15) & ~uintptr_t(15));
      auto* r = reinterpret_cast<uint16_t*>(at);
      at += (n + 1) / 2;
      return r;
    };
    auto take_bf16 = [&](int64_t n) { return take_bf16_at(p, n); };
    float* po = ops_shared;
    auto take_pointwise = [&](int64_t n) {
      if (!rec) return take(n);
      float* r = po;
      po += n;
      return r;
    };
    auto take_pointwise_bf16 = [&](int64_t n) { return rec ? take_bf16_at(po, n) : take_bf16(n); };
    LayerActs& a = layer_acts_[l];
    a.resid_in = nullptr, a.resid_in16 = nullptr;
    if (own_input) {
      acts_.push_back(Tensor::empty({Nl * H}, in16 ? DType::BF16 : DType::F32, device_));
      if (in16)
        a.resid_in16 = acts_.back().data<uint16_t>();
      else
        a.resid_in = acts_.back().f32();
    } else if (in16) {
      a.resid_in16 = take_bf16(Nl * H);
    } else {
      a.resid_in = take(Nl * H);
    }
    a.ln1 = nullptr, a.ln1_16 = nullptr;
    if (ln16_)
      a.ln1_16 = take_pointwise_bf16(Nl * H);
    else
      a.ln1 = take_pointwise(Nl * H);
    a.rstd1 = take(Nl);
    a.q_raw = a.k_raw = nullptr, a.q_raw16 = a.k_raw16 = nullptr;
    if (qk16) {
      a.q_raw16 = take_bf16(N * c.q_dim());
      a.k_raw16 = take_bf16(N * c.kv_dim());
    } else {
      a.q_raw = take(N * c.q_dim());
      a.k_raw = take(N * c.kv_dim());
    }
    a.q_rstd = take(N * nH);
    a.k_rstd = take(N * nKV);
    a.q16 = a.k16 = a.v16 = a.att16 = nullptr;
    if (attn16_) {
      float* scratch = attn_scratch_.defined() ? attn_scratch_.f32() : nullptr;
      a.qr = qk_fused_ ? nullptr : scratch;
      a.kr = qk_fused_ ? nullptr : a.qr + N * c.q_dim();
      a.v = o16_ ? nullptr : qk_fused_ ? scratch : a.kr + N * c.kv_dim();
      a.q16 = take_bf16(N * c.q_dim());
      a.k16 = take_bf16(N * c.kv_dim());
      a.v16 = take_bf16(N * c.kv_dim());
      a.att16 = take_bf16(N * c.q_dim());
    } else {
      a.v = take(N * c.kv_dim());
      a.qr = take_pointwise(N * c.q_dim());
      a.kr = take_pointwise(N * c.kv_dim());
    }
    a.attn_saved = take(attn_saved_floats(B, T, nH));
    a.att = o16_ ? nullptr : take(N * c.q_dim());
    a.resid_mid = nullptr, a.resid_mid16 = nullptr;
    if (resid16_)
      a.resid_mid16 = take_bf16(Nl * H);
    else
      a.resid_mid = take(Nl * H);
    a.ln2 = nullptr, a.ln2_16 = nullptr;
    if (ln16_ && !moe)
      a.ln2_16 = take_pointwise_bf16(N * H);
    else
      a.ln2 = take_pointwise(ln2_rows(l) * H);
    a.rstd2 = take(Nl);
    a.gu = a.act = nullptr;
    a.gu16 = a.act16 = nullptr;
    a.router_probs = a.topk_w = nullptr;
    a.topk_idx = nullptr;
    if (moe) {
      a.router_probs = take(N * E);
      a.topk_w = take(N * k);
      a.moe.gu = take(N * k * 2 * Im);
      a.moe.act = take(N * k * Im);
      int32_t* ip = shared_int;
      if (!ck) {
        acts_.push_back(Tensor::empty({N * k * 3 + E + 1}, DType::I32, device_));
        ip = acts_.back().data<int32_t>();
      }
      a.topk_idx = ip;
      a.moe.order = ip + N * k;
      a.moe.row_of = ip + 2 * N * k;
      a.moe.offsets = ip + 3 * N * k;
    } else if (mlp16_) {
      a.gu16 = take_bf16(N * 2 * I);
      a.act16 = take_pointwise_bf16(N * I);
    } else {
      a.gu = take(N * 2 * I);
      a.act = take_pointwise(N * I);
    }
  }
  auto alloc = [this](Shape s, DType dt = DType::F32) {
    acts_.push_back(Tensor::empty(std::move(s), dt, device_));
    return acts_.back();
  };
  ids_ = alloc({N}, DType::I32);
  targets_ = alloc({N}, DType::I32);
  host_targets_.resize(N);
  final_resid_ = alloc({Nl, H});
  resid_y_ = resid16_ ? alloc({N, H}) : Tensor();
  lnf_ = alloc({N, H});
  rstdf_ = alloc({Nl});
  if (cp_) {
    // Ring scratch: the keys and values in flight (this block's and the next), their gradients, a block's
    // partial output and logsumexp; every rank's rows' positions.
    cp_kv_ = alloc({2, 2 * N * c.kv_dim()});
    cp_dkv_ = alloc({2, 2 * N * c.kv_dim()});
    cp_part_ = alloc({N * c.q_dim() + B * nH * T});
    const int S = cp_->size();
    std::vector<int32_t> pos(S * T);
    for (int r = 0; r < S; ++r)
      for (int64_t t = 0; t < T; ++t)
        pos[r * T + t] = static_cast<int32_t>(context_parallel_position(r, S, T, t));
    cp_pos_ = alloc({S, T}, DType::I32);
    cp_pos_.copy_from_host(pos.data());
  }
  if (sp_) {
    sp_local_ = alloc({Nl, H});
    sp_full_ = alloc({N, H});
    ln_full_ = alloc({N, H});
  }
  // lm_head + cross-entropy run over row chunks (forward): only one (head_rows_, V) logits chunk exists.
  // Automatic: the fewest chunks of at most kHeadChunkBytes of logits, rows balanced between them. Every
  // chunk re-reads the whole lm_head (forward, d input) and re-writes its gradient, so fewer, larger chunks
  // are faster (bench/BENCHMARKS.md); the budget bounds the memory at long sequences and large vocabularies.
  if (head_chunk_rows_ > 0) {
    head_rows_ = std::min(head_chunk_rows_, N);
  } else {
    const int64_t chunks =
        std::max<int64_t>(1, (N * 4 * c.vocab_size + kHeadChunkBytes - 1) / kHeadChunkBytes);
    head_rows_ = (N + chunks - 1) / chunks;
  }
  if (held_[L + 1]) logits_ = alloc({head_rows_, c.vocab_size});  // (pipeline: only with the head)
  dresid_ = alloc({Nl, H});
  dln_ = alloc({N, H});
  if (!qk_fused_) {  // (RoPE's backward output; qk_norm_rope's backward needs none)
    dq_ = alloc({N, c.q_dim()});
    dk_ = alloc({N, c.kv_dim()});
  } else {
    dq_ = dk_ = Tensor();
  }
  if (!qkv16_grads_) {  // (f32 d(q/k/v) for the GEMMs; bf16 ones in attn16_grads_ otherwise)
    dv_ = alloc({N, c.kv_dim()});
    dqr_ = alloc({N, c.q_dim()});
    dkr_ = alloc({N, c.kv_dim()});
  } else {
    dv_ = dqr_ = dkr_ = Tensor();
  }
  datt_ = alloc({N, c.q_dim()});
  if (any_dense) {
    dgu_ = alloc({N, 2 * I}, dgu16_ ? DType::BF16 : DType::F32);
    dact_ = alloc({N, I});
  }
  if (!moe_layers_.empty()) {
    // Scratch shared by all sparse layers (forward and backward).
    moe_scratch_ = alloc({moe_experts_scratch_floats(N, k, H, Im)});
    dtopk_w_ = alloc({N, k});
    dlogits_router_ = alloc({N, E});
    for (int64_t l : moe_layers_) layer_acts_[l].moe.scratch = moe_scratch_.f32();
  }
  B_ = B;
  T_ = T;
}

}  // namespace titan
