// Qwen3Model forward and backward: dense decoder layers, sparse (MoE) layers, loss and the MoE aux loss.
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "distributed/expert_parallel.h"
#include "kernels/registry.h"
#include "models/qwen3/lora.h"
#include "models/qwen3/model.h"

namespace titan {

ForwardResult Qwen3Model::forward(const int32_t* ids, const int32_t* labels, int64_t B, int64_t T,
                                  const ForwardOptions& opts) {
  const auto& c = config_;
  // V: the vocabulary rows held here (a slice under vocab parallel).
  const int64_t N = B * T, H = c.hidden_size, V = c.vocab_size;
  TITAN_CHECK(B > 0 && T > 0, "forward: empty batch (B=", B, ", T=", T, ")");
  TITAN_CHECK(opts.stage >= 0 && opts.stage < num_stages(), "forward: stage ", opts.stage,
              " of a model holding ", num_stages());
  cur_stage_ = opts.stage;
  const StageRange range = stages_[opts.stage];
  const bool embed = stage_has_embedding(opts.stage), head = stage_has_head(opts.stage);
  TITAN_CHECK(embed || opts.stage_input, "forward: stage ", opts.stage, " (layers ", range.first, "..",
              range.end - 1, ") needs the previous stage's hidden states");
  if (embed) check_ids(ids, B, T);
  TITAN_CHECK(!opts.loss_on_device || total_moe_layers_ == 0 || num_stages() == 1,
              "forward: loss_on_device with a MoE model takes all its layers in one stage (the aux-loss "
              "statistics of pipeline stages are combined on the host)");
  TITAN_CHECK(!(opts.keep_logits && vocab_parallel()),
              "forward: keep_logits under vocab parallel (each rank ",
              "holds a slice of the vocabulary's logits)");
  TITAN_CHECK(!cp_ || opts.labels_shifted,
              "forward: context parallel needs the targets already shifted (labels_shifted): a rank's rows "
              "are two chunks of the sequence");
  TITAN_CHECK(!cp_ || T % 2 == 0, "forward: context parallel takes a rank's two chunks of equal length, got ",
              T, " rows per sequence");
  plan_activations(B, T);
  build_rope_tables(cp_ ? T * cp_->size() : T);  // (context parallel: the whole sequence's positions)
  set_packing(opts.position_ids, opts.inputs_staged ? opts.staged_slot : -1);
  if (lora_) lora_->begin_forward(opts.compute_grad, opts.inputs_staged ? opts.staged_slot : -1);
  // bf16 GEMMs: the weights converted once here (they may have changed since the last forward); streamed
  // groups are converted when gathered.
  if (bf16_ && matmul_ == &matmul_bf16_ && !streamer_)
    for (int g = c.tie_word_embeddings ? 0 : 1; g < num_groups(); ++g) make_bf16_image(g);
  if (embed && !opts.inputs_staged) upload_ids(ids, N, ids_);
  if (embed && opts.inputs_staged) copy_staged(ids_, staged_ids_, opts.staged_slot, N);
  ep_fixed_ = ep_ && opts.inputs_staged;
  TITAN_CHECK(!ep_fixed_ || kernel_names_["moe_experts"].ends_with("device_routed"),
              "forward: inputs_staged under expert parallel takes the device-routed experts "
              "(kernels.moe_experts = 'device_routed'), not '",
              kernel_names_["moe_experts"], "'");
  ForwardResult r;
  if (total_moe_layers_ > 0) aux_stats_.zero_();
  // The stage's input: the embedding (vocab parallel: each token's row from the rank holding it, summed over
  // the group), or the previous stage's hidden states (this rank's rows under sequence parallel).
  auto stage_input = [&] {
    if (!embed) {
      dev_->copy(stage_in(range), opts.stage_input, local_rows() * H * sizeof(float));
      return;
    }
    acquire_params(0);
    float* emb = sp_ ? sp_full_.f32() : stage_in(range);
    embedding_->forward(emb, ids_.data<int32_t>(), flat_params_[0].f32(), N, H);
    sum_row_parallel(emb, stage_in(range));
    release_params(0);
  };
  if (!head) {  // a stage before the last: its layers into stage_output()
    stage_input();
    run_layers(range, opts);
    if (total_moe_layers_ > 0) {
      aux_stats_.copy_to_host(aux_host_.data());
      // (experts over the tensor-parallel group: each rank routed its own rows; the group's statistics)
      if (moe_local_) tp_->sum_host(aux_host_.data(), static_cast<int64_t>(aux_host_.size()));
      if (cp_) cp_->sum_host(aux_host_.data(), static_cast<int64_t>(aux_host_.size()));  // (whole sequences)
      if (opts.aux_stats_in)
        for (size_t i = 0; i < aux_host_.size(); ++i) aux_host_[i] += opts.aux_stats_in[i];
    }
    grad_ready_ = opts.compute_grad;
    return r;
  }
  const int64_t num_valid = prepare_targets(labels, B, T, opts);
  if (opts.inputs_staged)
    copy_staged(targets_, staged_targets_, opts.staged_slot, N);
  else
    targets_.copy_from_host(host_targets_.data());
  const int32_t* tgt = targets_.data<int32_t>();

  stage_input();
  auto bf16 = [this](float* x, int64_t n) { round_bf16_if(x, n); };
  run_layers(range, opts);
  const int group_head = static_cast<int>(c.num_hidden_layers) + 1;
  acquire_params(group_head);
  if (c.tie_word_embeddings) acquire_params(0);
  const float* norm_w = flat_params_[group_head].f32();
  const float* lm_head = c.tie_word_embeddings ? flat_params_[0].f32() : norm_w + H;
  // The head's gradient is taken here (below); its gradient buffers (when streamed) stay acquired until
  // backward() finishes them.
  float* dlm_head = nullptr;
  if (opts.compute_grad) {
    acquire_grads(group_head);
    if (c.tie_word_embeddings) acquire_grads(0);
    if (!frozen_) dlm_head = c.tie_word_embeddings ? flat_grads_[0].f32() : flat_grads_[group_head].f32() + H;
  }
  norm_for_gemm(lnf_.f32(), rstdf_.f32(), final_resid_.f32(), norm_w);
  bf16(lnf_.f32(), N * H);
  if (opts.keep_logits) {
    if (!logits_copy_.defined() || logits_copy_.numel() != N * V)
      logits_copy_ = Tensor::empty({B, T, V}, DType::F32, device_);
    logits_copy_ = logits_copy_.view({B, T, V});
  }
  r.num_valid = num_valid;
  const float scale = loss_grad_scale(opts, num_valid);
  // lm_head + cross-entropy chunk by chunk over rows: logits_ holds one chunk (head_rows_ x V). With
  // compute_grad the chunk's gradient is taken at once: dlm_head += dlogits^T lnf and d(lnf) = dlogits
  // lm_head (into dln_, read by backward()), so the full (N,V) logits never exist.
  float* dlnf = dln_.f32();
  if (opts.compute_grad) zero(dlnf, N * H);
  // Nothing has been written into the head's gradient since zero_grad(): the first chunk's lm_head
  // gradient overwrites it (its zeros are not read back), the rest add to it.
  bool accumulate_dlm_head = !(head_grad_zeroed_ && !streamer_);
  r.loss_sum = 0;
  double* loss_dev = nullptr;  // the loss summed on the device (loss_on_device; loss parallel always)
  if (opts.loss_on_device)
    loss_dev = ensure(loss_sum_, opts.staged_slot + 1, DType::F64).data<double>() + opts.staged_slot;
  else if (vocab_parallel())
    loss_dev = ensure(vp_loss_sum_, 1, DType::F64).data<double>();
  if (loss_dev) dev_->zero(loss_dev, sizeof(double));
  // The device forms read the gradient scale from device memory: a staged micro-batch's, else this one's.
  const float* scale_dev = nullptr;
  if (opts.inputs_staged) {
    TITAN_CHECK(staged_scale_.defined() && staged_scale_.numel() > opts.staged_slot,
                "forward: inputs_staged, but stage_inputs() staged no micro-batch ", opts.staged_slot);
    scale_dev = staged_scale_.f32() + opts.staged_slot;
  } else if (loss_dev) {
    ensure(eager_scale_, 1).view_at(0, {1}).copy_from_host(&scale);
    scale_dev = eager_scale_.f32();
  }
  for (int64_t r0 = 0; r0 < N; r0 += head_rows_) {
    const int64_t rows = std::min(head_rows_, N - r0);
    float* lg = logits_.f32();
    const float* x = lnf_.f32() + r0 * H;
    matmul_->forward(lg, x, lm_head, rows, H, V);
    bf16(lg, rows * V);
    if (opts.keep_logits) dev_->copy(logits_copy_.f32() + r0 * V, lg, rows * V * sizeof(float));
    if (vocab_parallel())
      vocab_parallel_cross_entropy(lg, r0, rows, scale_dev, opts.compute_grad, loss_dev);
    else if (loss_dev)
      cross_entropy_->forward_backward_device(loss_dev, lg, tgt + r0, rows, V, scale_dev, opts.compute_grad);
    else
      r.loss_sum += cross_entropy_->forward_backward(lg, tgt + r0, rows, V, scale, opts.compute_grad);
    if (opts.compute_grad) {
      matmul_->backward(dlnf + r0 * H, dlm_head, lg, x, lm_head, rows, H, V, accumulate_dlm_head);
      accumulate_dlm_head = true;
      head_grad_zeroed_ = false;
    }
  }
  // Vocab-parallel lm_head: the ranks' partial d(lnf), summed (this rank's rows under sequence parallel,
  // moved to the front of dln_ for backward()).
  if (opts.compute_grad) {
    float* d = sum_column_parallel_grad(dlnf);
    if (d != dlnf) dev_->copy(dlnf, d, local_rows() * H * sizeof(float));
  }
  release_params(group_head);
  if (c.tie_word_embeddings) release_params(0);
  if (opts.loss_on_device)
    r.loss_sum = std::nan("");  // (device_loss_sum() reads it)
  else if (loss_dev)
    dev_->copy_to_host(&r.loss_sum, loss_dev, sizeof(double));
  r.ce_loss = num_valid > 0 ? r.loss_sum / (double)num_valid : std::nan("");
  r.loss = r.ce_loss;
  aux_scale_ = 0.0f;
  aux_on_device_ = false;
  if (total_moe_layers_ > 0) {
    // HF load_balancing_loss_func over the concatenated router outputs of all sparse layers (R rows).
    const int64_t E = c.num_experts;
    // (context parallel: the rows of the whole sequences, every rank's statistics)
    const double R = (double)N * (cp_ ? cp_->size() : 1) * (double)total_moe_layers_;
    aux_scale_ = opts.aux_loss_scale >= 0 ? opts.aux_loss_scale
                 : c.output_router_logits ? (float)c.router_aux_loss_coef
                                          : 0.0f;
    if (opts.loss_on_device) {
      // The aux loss (one per staged slot, device_aux_loss()) and its scaled gradient stay on the device;
      // the statistics of the group's row slices / sequence chunks summed by all-reduces on the device.
      double* stats = aux_stats_.data<double>();
      const int64_t n_stats = static_cast<int64_t>(aux_host_.size());
      if (moe_local_) tp_->sum_device(stats, n_stats);
      if (cp_) cp_->sum_device(stats, n_stats);
      double* aux = ensure(aux_loss_dev_, opts.staged_slot + 1, DType::F64).data<double>() + opts.staged_slot;
      router_->aux_loss(aux, aux_scaled_.f32(), stats, E, R);
      elementwise_->scale(aux_scaled_.f32(), aux_scale_, E);  // (aux_scale_ * dprob, as backward() takes it)
      aux_on_device_ = true;
      r.aux_loss = std::nan("");
    } else {
      aux_stats_.copy_to_host(aux_host_.data());
      // Sparse layers on this rank's rows (experts over the tensor-parallel group): the group's statistics.
      if (moe_local_) tp_->sum_host(aux_host_.data(), static_cast<int64_t>(aux_host_.size()));
      if (cp_) cp_->sum_host(aux_host_.data(), static_cast<int64_t>(aux_host_.size()));
      if (opts.aux_stats_in)  // pipeline parallel: the earlier stages' sparse layers
        for (size_t i = 0; i < aux_host_.size(); ++i) aux_host_[i] += opts.aux_stats_in[i];
      r.aux_loss = aux_loss_ = moe_aux_loss(aux_host_.data(), E, R, aux_dprob_.data());
      if (c.output_router_logits) r.loss += c.router_aux_loss_coef * r.aux_loss;
    }
  }
  grad_ready_ = opts.compute_grad;
  return r;
}

// The decoder layers of one stage, from layer_acts_[range.first].resid_in to final_resid_ (through the
// layers' inputs, bf16 ones under resid16_).
void Qwen3Model::run_layers(const StageRange& range, const ForwardOptions& opts) {
  for (int64_t l = range.first; l < range.end; ++l) {
    LayerActs* next = l + 1 < range.end ? &layer_acts_[l + 1] : nullptr;
    float* out = next ? next->resid_in : final_resid_.f32();
    uint16_t* out16 = next ? next->resid_in16 : nullptr;
    acquire_params(static_cast<int>(l) + 1);
    forward_layer(l, out, out16, opts.compute_grad, true);
    release_params(static_cast<int>(l) + 1);
  }
}

// The layer GEMMs on the step's buffers: each of the input and the output is the f32 one where that is
// non-null, else the bf16 one (bf16 activations: matmul_bf16's bf16-input/-output GEMMs, the same values).
void Qwen3Model::linear_forward(float* out, uint16_t* out16, const float* inp, const uint16_t* inp16,
                                const float* w, int64_t N, int64_t C, int64_t OC) {
  if (out && inp) return matmul_->forward(out, inp, w, N, C, OC);
  if (out) return matmul16_.forward_bf16_input(out, inp16, w, N, C, OC);
  if (inp) return matmul16_.forward_bf16_output(out16, inp, w, N, C, OC);
  matmul16_.forward_bf16_io(out16, inp16, w, N, C, OC);
}

void Qwen3Model::linear_backward(float* dinp, float* dw, const float* dout, const float* inp,
                                 const uint16_t* inp16, const float* w, int64_t N, int64_t C, int64_t OC,
                                 bool accumulate_dw) {
  if (inp || !inp16) return matmul_->backward(dinp, dw, dout, inp, w, N, C, OC, accumulate_dw);
  matmul16_.backward_bf16_input(dinp, dw, dout, inp16, w, N, C, OC, accumulate_dw);
}

// ln1 of layer l: its rows of RMSNorm(resid_in) into ln1, or ln1_16 (bf16 activations), and rstd1.
void Qwen3Model::input_norm(int64_t l) {
  LayerActs& a = layer_acts_[l];
  const LayerView w = layer_view(l);
  const float eps = static_cast<float>(config_.rms_norm_eps);
  if (a.resid_in16)  // (the bf16 residual stream goes with bf16 norm outputs)
    rmsnorm_->forward_bf16_io(a.ln1_16, a.rstd1, a.resid_in16, w.input_norm, local_rows(),
                              config_.hidden_size, eps);
  else if (a.ln1_16)
    rmsnorm_->forward_bf16_output(a.ln1_16, a.rstd1, a.resid_in, w.input_norm, local_rows(),
                                  config_.hidden_size, eps);
  else
    rmsnorm_->forward(a.ln1, a.rstd1, a.resid_in, w.input_norm, local_rows(), config_.hidden_size, eps);
}

void Qwen3Model::forward_layer(int64_t l, float* out, uint16_t* out16, bool count_tokens,
                               bool accumulate_stats) {
  const auto& c = config_;
  const int64_t B = B_, T = T_, N = B * T, Nl = local_rows(), H = c.hidden_size, I = c.intermediate_size,
                hd = c.head_dim, nH = c.num_attention_heads, nKV = c.num_key_value_heads;
  auto bf16 = [this](float* x, int64_t n) { round_bf16_if(x, n); };
  LayerActs& a = layer_acts_[l];
  LayerView w = layer_view(l);
  // Under sequence parallel resid_in, resid_mid and out hold this rank's Nl rows; the GEMMs see all N.
  float* partial = sp_ ? sp_full_.f32() : nullptr;  // a row-parallel GEMM's (N,H) output before the sum
  input_norm(l);
  // (bf16 activations: ln1 is ln1_16, v is written as v16 only; linear_forward takes whichever is there)
  const float* ln1 = a.ln1 ? gathered_ln(a.ln1) : nullptr;
  linear_forward(a.q_raw, a.q_raw16, ln1, a.ln1_16, w.wq, N, H, c.q_dim());
  linear_forward(a.k_raw, a.k_raw16, ln1, a.ln1_16, w.wk, N, H, c.kv_dim());
  linear_forward(a.v, a.v16, ln1, a.ln1_16, w.wv, N, H, c.kv_dim());
  if (lora_) {
    lora_->forward(l, LoraProj::Q, ln1, N, a.q_raw, c.q_dim());
    lora_->forward(l, LoraProj::K, ln1, N, a.k_raw, c.kv_dim());
    lora_->forward(l, LoraProj::V, ln1, N, a.v, c.kv_dim());
  }
  if (a.ln1) bf16(a.ln1, Nl * H);
  if (a.q_raw) bf16(a.q_raw, N * c.q_dim()), bf16(a.k_raw, N * c.kv_dim());
  qk_norm_rope(l);
  if (attn16_) {  // (v rounded by its bf16 copy, att exact from att16)
    attention_bf16_forward(l);
  } else {
    bf16(a.v, N * c.kv_dim());
    if (cp_)
      ring_attention_forward(l);
    else
      attention_->forward(a.att, a.attn_saved, a.qr, a.kr, a.v, B, T, nH, nKV, hd, doc_start());
    bf16(a.att, N * c.q_dim());
  }
  // resid_mid = resid_in + att @ wo^T (row-parallel o_proj: the ranks' partial outputs summed); the bf16
  // residual stream: o_proj's f32 output into resid_y_, the sum rounded into resid_mid16.
  float* o = sp_ ? partial : resid16_ ? resid_y_.f32() : a.resid_mid;
  linear_forward(o, nullptr, a.att, a.att16, w.wo, N, c.q_dim(), H);  // (att16 under o16_)
  if (lora_) lora_->forward(l, LoraProj::O, a.att, N, o, H);
  sum_row_parallel(o, a.resid_mid);
  if (!resid16_) {
    elementwise_->add(a.resid_mid, a.resid_in, Nl * H);
    bf16(a.resid_mid, Nl * H);
  } else if (a.resid_in16) {
    elementwise_->add_to_bf16(a.resid_mid16, o, a.resid_in16, Nl * H);
  } else {  // (a stage's first layer: an f32 input)
    elementwise_->add(o, a.resid_in, Nl * H);
    elementwise_->to_bf16(a.resid_mid16, o, Nl * H);
  }
  norm_for_mlp(l);
  float* mlp_out = sp_ ? partial : resid16_ ? resid_y_.f32() : out;
  if (w.router && moe_local_) {
    // Experts split over the tensor-parallel group: each rank routes its own rows (expert parallel).
    bf16(a.ln2, Nl * H);
    moe_forward_layer(l, out, count_tokens, accumulate_stats);
  } else if (w.router) {
    // Sparse layers run (replicated) on all N rows; under sequence parallel this rank keeps its own.
    bf16(a.ln2, N * H);
    moe_forward_layer(l, mlp_out, count_tokens, accumulate_stats);
    if (sp_) dev_->copy(out, mlp_out + tp_->rank() * Nl * H, Nl * H * sizeof(float));
  } else {
    // (bf16 activations: ln2, gate/up and act as bf16, the values the rounding below gives the f32 ones)
    const float* ln2 = a.ln2 ? gathered_ln(a.ln2) : nullptr;
    linear_forward(a.gu, a.gu16, ln2, a.ln2_16, w.wgu, N, H, 2 * I);
    if (lora_) {  // gate rows [0,I), up rows [I,2I) of the fused output
      lora_->forward(l, LoraProj::Gate, ln2, N, a.gu, 2 * I);
      lora_->forward(l, LoraProj::Up, ln2, N, a.gu + I, 2 * I);
    }
    if (a.ln2) bf16(a.ln2, Nl * H);
    if (mlp16_) {
      swiglu_->forward_bf16(a.act16, a.gu16, N, I);
    } else {
      bf16(a.gu, N * 2 * I);
      swiglu_->forward(a.act, a.gu, N, I);
      bf16(a.act, N * I);
    }
    linear_forward(mlp_out, nullptr, a.act, a.act16, w.wdown, N, I, H);
    if (lora_) lora_->forward(l, LoraProj::Down, a.act, N, mlp_out, H);
    sum_row_parallel(mlp_out, out);  // row-parallel down_proj
  }
  if (!resid16_) {
    elementwise_->add(out, a.resid_mid, Nl * H);
    bf16(out, Nl * H);
  } else if (out16) {
    elementwise_->add_to_bf16(out16, mlp_out, a.resid_mid16, Nl * H);
  } else {  // (a stage's last layer: an f32 output)
    elementwise_->from_bf16(out, a.resid_mid16, Nl * H);
    elementwise_->add(out, mlp_out, Nl * H);
    bf16(out, Nl * H);
  }
}

// q_norm / k_norm per head (before RoPE) from q_raw / k_raw; qr/kr hold the normed values, then rotate in
// place.
void Qwen3Model::qk_norm_rope(int64_t l) {
  const auto& c = config_;
  const int64_t N = B_ * T_, hd = c.head_dim, nH = c.num_attention_heads, nKV = c.num_key_value_heads;
  const auto [cos, sin, T] = rope_tables();
  const float eps = static_cast<float>(c.rms_norm_eps);
  LayerActs& a = layer_acts_[l];
  LayerView w = layer_view(l);
  if (qk_fused_) {  // bf16 in, bf16 out: no f32 q/k
    qk_norm_rope_->forward(a.q16, a.k16, a.q_rstd, a.k_rstd, a.q_raw16, a.k_raw16, w.q_norm, w.k_norm, cos,
                           sin, N, T, nH, nKV, hd, eps);
    return;
  }
  if (a.q_raw16) {  // bf16 activations
    rmsnorm_->forward_bf16_input(a.qr, a.q_rstd, a.q_raw16, w.q_norm, N * nH, hd, eps);
    rmsnorm_->forward_bf16_input(a.kr, a.k_rstd, a.k_raw16, w.k_norm, N * nKV, hd, eps);
  } else {
    rmsnorm_->forward(a.qr, a.q_rstd, a.q_raw, w.q_norm, N * nH, hd, eps);
    rmsnorm_->forward(a.kr, a.k_rstd, a.k_raw, w.k_norm, N * nKV, hd, eps);
  }
  if (rope_qk_) {
    rope_qk_->forward(a.qr, a.kr, cos, sin, N, T, nH, nKV, hd);
  } else {
    rope_->forward(a.qr, a.qr, cos, sin, N, T, nH, hd);
    rope_->forward(a.kr, a.kr, cos, sin, N, T, nKV, hd);
  }
  if (attn16_) {  // the bf16 copies attention_bf16 reads (rounded as round_bf16 would)
    elementwise_->to_bf16(a.q16, a.qr, N * c.q_dim());
    elementwise_->to_bf16(a.k16, a.kr, N * c.kv_dim());
    return;
  }
  round_bf16_if(a.qr, N * c.q_dim());
  round_bf16_if(a.kr, N * c.kv_dim());
}

// bf16 attention of layer l (attention_bf16): v's bf16 copy, then the op on the bf16 q, k, v into att16 and
// the row logsumexp, and att (f32, exact) for the o_proj GEMM unless that reads att16 itself (o16_).
void Qwen3Model::attention_bf16_forward(int64_t l) {
  const auto& c = config_;
  const int64_t N = B_ * T_;
  LayerActs& a = layer_acts_[l];
  for (const uint16_t* p : {a.q16, a.k16, a.v16, a.att16})  // (cuDNN reads its tensors 16 bytes at a time)
    TITAN_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "bf16 attention: a buffer off 16-byte alignment");
  if (a.v) elementwise_->to_bf16(a.v16, a.v, N * c.kv_dim());  // (else the v GEMM wrote v16: o16_)
  const AttentionBf16Shape s{
      B_,         T_,       c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.q_dim(), c.kv_dim(),
      c.kv_dim(), c.q_dim()};
  attention_bf16_->forward(a.att16, a.attn_saved, a.q16, a.k16, a.v16, s, doc_start());
  if (!o16_) elementwise_->from_bf16(a.att, a.att16, N * c.q_dim());
}

// Its backward: d(att) as bf16 (as autocast's bf16 output has a bf16 gradient), the op's bf16 dq, dk, dv,
// written as f32 into dqr, dkr, dv (overwritten).
void Qwen3Model::attention_bf16_backward(int64_t l, float* dqr, float* dkr, float* dv, const float* datt) {
  const auto& c = config_;
  const int64_t N = B_ * T_, qd = c.q_dim(), kvd = c.kv_dim();
  LayerActs& a = layer_acts_[l];
  uint16_t *datt16 = attn16_grad(0), *dq16 = attn16_grad(1), *dk16 = attn16_grad(2), *dv16 = attn16_grad(3);
  elementwise_->to_bf16(datt16, datt, N * qd);
  const AttentionBf16Shape s{B_,  T_, c.num_attention_heads, c.num_key_value_heads, c.head_dim, qd, kvd,
                             kvd, qd};
  attention_bf16_->backward(dq16, dk16, dv16, datt16, a.q16, a.k16, a.v16, a.att16, a.attn_saved, s,
                            doc_start());
  if (dqr) elementwise_->from_bf16(dqr, dq16, N * qd);
  if (dkr) elementwise_->from_bf16(dkr, dk16, N * kvd);
  if (dv) elementwise_->from_bf16(dv, dv16, N * kvd);
}

// The pointwise outputs of layer l that the op-selective policy does not keep, recomputed as forward_layer
// made them (same kernels, same inputs, the same bf16 rounding): ln1, qr/kr, ln2 and a dense layer's act.
// The norms' rstd are kept and rewritten with the same values.
void Qwen3Model::recompute_layer_ops(int64_t l) {
  const auto& c = config_;
  const int64_t N = B_ * T_, H = c.hidden_size, I = c.intermediate_size;
  LayerActs& a = layer_acts_[l];
  LayerView w = layer_view(l);
  const int64_t Nl = local_rows();
  input_norm(l);
  if (a.ln1) round_bf16_if(a.ln1, Nl * H);
  qk_norm_rope(l);
  norm_for_mlp(l);
  if (a.ln2) round_bf16_if(a.ln2, (sp_ && (!w.router || moe_local_) ? Nl : N) * H);
  if (!w.router && mlp16_) {
    swiglu_->forward_bf16(a.act16, a.gu16, N, I);
  } else if (!w.router) {
    swiglu_->forward(a.act, a.gu, N, I);
    round_bf16_if(a.act, N * I);
  }
}

void Qwen3Model::backward(const float* d_output, const float* aux_dprob, float aux_scale) {
  TITAN_CHECK(grad_ready_, "backward() needs a forward() with compute_grad");
  grad_ready_ = false;
  const StageRange range = stages_[cur_stage_];
  const bool embed = stage_has_embedding(cur_stage_), head = stage_has_head(cur_stage_);
  TITAN_CHECK(head || d_output, "backward: stage ", cur_stage_, " (layers ", range.first, "..", range.end - 1,
              ") needs the gradient of its output");
  if (!head && total_moe_layers_ > 0) {  // the head stage's aux-loss gradient
    aux_scale_ = aux_scale;
    if (aux_dprob) std::copy_n(aux_dprob, aux_dprob_.size(), aux_dprob_.begin());
  }
  const auto& c = config_;
  const int64_t B = B_, T = T_, N = B * T, Nl = local_rows(), H = c.hidden_size, I = c.intermediate_size,
                hd = c.head_dim, nH = c.num_attention_heads, nKV = c.num_key_value_heads, V = c.vocab_size;
  const int group_head = static_cast<int>(c.num_hidden_layers) + 1;
  // Streamed parameters: the head's parameters; its gradient buffers (and with tied embeddings the
  // embedding's, kept until the embedding backward at the end) were acquired by forward().
  const float* norm_w = nullptr;
  float* dnorm_w = nullptr;
  if (head) {
    acquire_params(group_head);
    acquire_grads(group_head);
    if (c.tie_word_embeddings) acquire_grads(0);
    norm_w = flat_params_[group_head].f32();
    // Frozen base (LoRA): no base gradients; null weight-gradient pointers make the kernels skip them.
    dnorm_w = flat_grads_[group_head].defined() ? flat_grads_[group_head].f32() : nullptr;
  }
  const auto [cos, sin, rope_period] = rope_tables();

  // The first backward after zero_grad() writes each layer's weight gradients (nothing to add to).
  const bool acc_dw = !(layer_grads_zeroed_[cur_stage_] && !streamer_);
  layer_grads_zeroed_[cur_stage_] = false;
  // Head: forward() already accumulated the lm_head gradient and left d(final norm output) in dln_ (this
  // rank's rows under sequence parallel, as dresid and the residual stream's saved tensors).
  float* dresid = dresid_.f32();
  float* dln = dln_.f32();
  if (head) {
    zero(dresid, Nl * H);
    rmsnorm_->backward(dresid, dnorm_w, dln, final_resid_.f32(), norm_w, rstdf_.f32(), Nl, H);
    release_params(group_head);
    finish_grads(group_head);
  } else {
    dev_->copy(dresid, d_output, Nl * H * sizeof(float));
  }

  for (int64_t l = range.end - 1; l >= range.first; --l) {
    // Checkpointing: recompute the layer's activations from its saved input (dln_ is free scratch
    // for the unused output here; it is cleared before every use below).
    acquire_params(static_cast<int>(l) + 1);
    acquire_grads(static_cast<int>(l) + 1);
    if (layer_checkpointed(l))
      forward_layer(l, dln, nullptr, false, false);
    else if (layer_recomputes_ops(l))
      recompute_layer_ops(l);
    LayerActs& a = layer_acts_[l];
    LayerView w = layer_view(l);
    LayerView g{};
    if (flat_grads_[l + 1].defined()) g = layer_view(l, flat_grads_[l + 1].f32());
    const float* dln_rows = dln;  // d(ln2), then d(ln1): this rank's rows
    if (w.router && moe_local_) {
      moe_backward_layer(l, dresid, aux_scale_, acc_dw);  // this rank's rows, into dln
    } else if (w.router) {
      moe_backward_layer(l, full_rows(dresid), aux_scale_, acc_dw);  // MoE branch, into dln (all N rows)
      if (sp_) dln_rows = dln + tp_->rank() * Nl * H;
    } else {
      const float* dout = full_rows(dresid);
      // MLP branch: out = resid_mid + down(swiglu(gu(ln2)))
      float* dact = dact_.f32();
      zero(dact, N * I);
      linear_backward(dact, g.wdown, dout, a.act, a.act16, w.wdown, N, I, H, acc_dw);
      if (lora_) lora_->backward(l, LoraProj::Down, a.act, dout, H, dact, N);
      zero(dln, N * H);
      if (dgu16_) {  // d(gate/up) as bf16, read as it is by the gate/up GEMM (ln2 is bf16 too)
        uint16_t* dgu = dgu_.data<uint16_t>();
        swiglu_->backward_bf16_output(dgu, dact, a.gu16, N, I);
        matmul16_.backward_bf16_io(dln, g.wgu, dgu, a.ln2_16, w.wgu, N, H, 2 * I, acc_dw);
      } else {
        float* dgu = dgu_.f32();
        zero(dgu, N * 2 * I);
        if (mlp16_)
          swiglu_->backward_bf16(dgu, dact, a.gu16, N, I);
        else
          swiglu_->backward(dgu, dact, a.gu, N, I);
        const float* ln2 = a.ln2 ? gathered_ln(a.ln2) : nullptr;
        linear_backward(dln, g.wgu, dgu, ln2, a.ln2_16, w.wgu, N, H, 2 * I, acc_dw);
        if (lora_) {
          lora_->backward(l, LoraProj::Gate, ln2, dgu, 2 * I, dln, N);
          lora_->backward(l, LoraProj::Up, ln2, dgu + I, 2 * I, dln, N);
        }
      }
      dln_rows = sum_column_parallel_grad(dln);  // column-parallel gate/up: the ranks' partial d(ln2)
    }
    residual_norm_backward(dresid, g.post_norm, dln_rows, a.resid_mid, a.resid_mid16, w.post_norm, a.rstd2);
    // Attention branch: resid_mid = resid_in + o(attn(rope(norm(q,k)), v))
    float* datt = datt_.f32();
    zero(datt, N * c.q_dim());
    const float* dout = full_rows(dresid);
    linear_backward(datt, g.wo, dout, a.att, a.att16, w.wo, N, c.q_dim(), H, acc_dw);
    if (lora_) lora_->backward(l, LoraProj::O, a.att, dout, H, datt, N);
    auto f32_or_null = [](Tensor& t) { return t.defined() ? t.f32() : nullptr; };
    float *dqr = f32_or_null(dqr_), *dkr = f32_or_null(dkr_), *dv = f32_or_null(dv_), *dq = f32_or_null(dq_),
          *dk = f32_or_null(dk_);
    if (qk_fused_) {  // dq, dk stay bf16 for qk_norm_rope's backward; dv too where the GEMMs read bf16
      attention_bf16_backward(l, nullptr, nullptr, qkv16_grads_ ? nullptr : dv, datt);
    } else if (attn16_) {
      attention_bf16_backward(l, dqr, dkr, dv, datt);  // (writes them)
    } else {
      zero(dqr, N * c.q_dim());
      zero(dkr, N * c.kv_dim());
      zero(dv, N * c.kv_dim());
      if (cp_)
        ring_attention_backward(l, dqr, dkr, dv, datt);
      else
        attention_->backward(dqr, dkr, dv, datt, a.qr, a.kr, a.v, a.att, a.attn_saved, B, T, nH, nKV, hd,
                             doc_start());
    }
    if (qk_fused_) {  // d(q/k projection) as bf16 (widened where the GEMMs read an f32 ln1: sequence
                      // parallel)
      qk_norm_rope_->backward(attn16_grad(4), attn16_grad(5), g.q_norm, g.k_norm, attn16_grad(1),
                              attn16_grad(2), a.q_raw16, a.k_raw16, w.q_norm, w.k_norm, a.q_rstd, a.k_rstd,
                              cos, sin, N, rope_period, nH, nKV, hd);
      if (!qkv16_grads_) {
        elementwise_->from_bf16(dqr, attn16_grad(4), N * c.q_dim());
        elementwise_->from_bf16(dkr, attn16_grad(5), N * c.kv_dim());
      }
    } else {
      // RoPE backward into dq/dk (as scratch), then q_norm/k_norm backward into dqr/dkr (reused).
      zero(dq, N * c.q_dim());
      zero(dk, N * c.kv_dim());
      if (rope_qk_) {
        rope_qk_->backward(dq, dk, dqr, dkr, cos, sin, N, rope_period, nH, nKV, hd);
      } else {
        rope_->backward(dq, dqr, cos, sin, N, rope_period, nH, hd);
        rope_->backward(dk, dkr, cos, sin, N, rope_period, nKV, hd);
      }
      zero(dqr, N * c.q_dim());
      zero(dkr, N * c.kv_dim());
      if (a.q_raw16) {
        rmsnorm_->backward_bf16_input(dqr, g.q_norm, dq, a.q_raw16, w.q_norm, a.q_rstd, N * nH, hd);
        rmsnorm_->backward_bf16_input(dkr, g.k_norm, dk, a.k_raw16, w.k_norm, a.k_rstd, N * nKV, hd);
      } else {
        rmsnorm_->backward(dqr, g.q_norm, dq, a.q_raw, w.q_norm, a.q_rstd, N * nH, hd);
        rmsnorm_->backward(dkr, g.k_norm, dk, a.k_raw, w.k_norm, a.k_rstd, N * nKV, hd);
      }
    }
    zero(dln, N * H);
    const float* ln1 = a.ln1 ? gathered_ln(a.ln1) : nullptr;
    if (qkv16_grads_) {  // bf16 d(q/k/v) and bf16 ln1: the GEMMs read both as they are
      matmul16_.backward_bf16_io(dln, g.wq, attn16_grad(4), a.ln1_16, w.wq, N, H, c.q_dim(), acc_dw);
      matmul16_.backward_bf16_io(dln, g.wk, attn16_grad(5), a.ln1_16, w.wk, N, H, c.kv_dim(), acc_dw);
      matmul16_.backward_bf16_io(dln, g.wv, attn16_grad(3), a.ln1_16, w.wv, N, H, c.kv_dim(), acc_dw);
    } else {
      linear_backward(dln, g.wq, dqr, ln1, a.ln1_16, w.wq, N, H, c.q_dim(), acc_dw);
      linear_backward(dln, g.wk, dkr, ln1, a.ln1_16, w.wk, N, H, c.kv_dim(), acc_dw);
      linear_backward(dln, g.wv, dv, ln1, a.ln1_16, w.wv, N, H, c.kv_dim(), acc_dw);
    }
    if (lora_) {
      lora_->backward(l, LoraProj::Q, ln1, dqr, c.q_dim(), dln, N);
      lora_->backward(l, LoraProj::K, ln1, dkr, c.kv_dim(), dln, N);
      lora_->backward(l, LoraProj::V, ln1, dv, c.kv_dim(), dln, N);
    }
    dln_rows = sum_column_parallel_grad(dln);  // column-parallel q/k/v: the ranks' partial d(ln1)
    residual_norm_backward(dresid, g.input_norm, dln_rows, a.resid_in, a.resid_in16, w.input_norm, a.rstd1);
    finish_grads(static_cast<int>(l) + 1);
    release_params(static_cast<int>(l) + 1);
  }
  if (head && c.tie_word_embeddings && !embed) finish_grads(0);  // the last stage's embedding copy
  if (!embed) return;  // d(input) stays in dresid_ (stage_input_grad())
  acquire_grads(0);    // (idempotent: a tied head here took it in forward())
  if (!frozen_) embedding_->backward(flat_grads_[0].f32(), full_rows(dresid), ids_.data<int32_t>(), N, H, V);
  finish_grads(0);
}

void Qwen3Model::residual_norm_backward(float* dresid, float* dw, const float* dln, const float* x,
                                        const uint16_t* x16, const float* w, const float* rstd) {
  if (x)
    rmsnorm_->backward(dresid, dw, dln, x, w, rstd, local_rows(), config_.hidden_size);
  else
    rmsnorm_->backward_bf16_input(dresid, dw, dln, x16, w, rstd, local_rows(), config_.hidden_size);
}

// Sparse MLP of layer l: router (HF Qwen3MoeTopKRouter) + routed experts; out = experts(ln2) (the caller
// adds the residual). Accumulates the aux-loss statistics and, when balancing, the expert token counts.
void Qwen3Model::moe_forward_layer(int64_t l, float* out, bool count_tokens, bool accumulate_stats) {
  const auto& c = config_;
  const int64_t N = moe_rows(), H = c.hidden_size, E = c.num_experts, k = c.num_experts_per_tok,
                Im = c.moe_intermediate_size;
  LayerActs& a = layer_acts_[l];
  LayerView w = layer_view(l);
  const int m = moe_row_[l];
  // Router logits in f32 (the model dtype here), softmax in f32.
  matmul_->forward(a.router_probs, a.ln2, w.router, N, H, E);
  round_bf16_if(a.router_probs, N * E);
  router_->softmax(a.router_probs, N, E);
  const bool balancing = c.load_balance_coeff > 0;
  const float* bias = balancing ? expert_bias_.f32() + m * E : nullptr;
  router_->select_topk(a.topk_idx, a.topk_w, a.router_probs, bias, N, E, k, c.norm_topk_prob);
  round_bf16_if(a.topk_w, N * k);
  if (balancing && count_tokens) router_->count_tokens(expert_counts_.f32() + m * E, a.topk_idx, N * k, E);
  // Aux loss statistics: HF re-selects the top-k of the unbiased probabilities (differs from the routing
  // only when an expert bias is set). The rows of dlogits_router_ are free here and serve as scratch.
  if (accumulate_stats) {  // (when recomputing, the statistics of this layer were taken in the forward)
    const int32_t* idx = a.topk_idx;
    if (bias) {
      int32_t* unbiased = reinterpret_cast<int32_t*>(moe_scratch_.f32());  // before the experts use it
      router_->select_topk(unbiased, dlogits_router_.f32(), a.router_probs, nullptr, N, E, k, false);
      idx = unbiased;
    }
    double* stats = aux_stats_.data<double>();
    router_->aux_stats(stats, stats + E, idx, a.router_probs, N, E, k);
  }
  if (ep_)
    moe_experts_ep_forward(l, out);
  else
    moe_->forward(out, a.moe, a.ln2, a.topk_idx, a.topk_w, w.wgu, w.wdown, N, k, E, H, Im);
}

// Backward of the sparse MLP of layer l: dresid (N,H) is d(layer output); writes d(ln2) into dln_.
void Qwen3Model::moe_backward_layer(int64_t l, const float* dresid, float aux_scale, bool acc_dw) {
  const auto& c = config_;
  const int64_t N = moe_rows(), H = c.hidden_size, E = c.num_experts, k = c.num_experts_per_tok,
                Im = c.moe_intermediate_size;
  LayerActs& a = layer_acts_[l];
  LayerView w = layer_view(l);
  LayerView g = layer_view(l, flat_grads_[l + 1].f32());  // frozen base: a scratch buffer
  if (frozen_) g.router = nullptr;
  float* dln = dln_.f32();
  float* dtw = dtopk_w_.f32();
  zero(dln, N * H);
  zero(dtw, N * k);
  if (ep_)
    moe_experts_ep_backward(l, dresid, dln, dtw);
  else
    moe_->backward(dln, dtw, g.wgu, g.wdown, a.moe, dresid, a.ln2, a.topk_idx, a.topk_w, w.wgu, w.wdown, N, k,
                   E, H, Im);
  const float* dbias = nullptr;
  if (aux_scale != 0.0f && aux_on_device_) {
    dbias = aux_scaled_.f32();  // (the forward scaled it on the device)
  } else if (aux_scale != 0.0f) {
    std::vector<float> scaled(E);
    for (int64_t e = 0; e < E; ++e) scaled[e] = aux_scale * aux_dprob_[e];
    aux_scaled_.copy_from_host(scaled.data());
    dbias = aux_scaled_.f32();
  }
  float* dlogits = dlogits_router_.f32();
  router_->backward(dlogits, a.router_probs, a.topk_idx, dtw, dbias, N, E, k, c.norm_topk_prob);
  matmul_->backward(dln, g.router, dlogits, a.ln2, w.router, N, H, E, acc_dw);
}

// The expert kernel's buffers of one sparse layer's received rows (saved between forward and backward).
MoeExpertsBuffers Qwen3Model::ep_buffers(EpLayer& s) {
  return {s.gu.f32(),
          s.act.f32(),
          s.order.data<int32_t>(),
          s.row_of.data<int32_t>(),
          s.offsets.data<int32_t>(),
          ep_scratch_.f32()};
}

// Expert-parallel experts of sparse layer l (forward). Every (token, expert) slot becomes one row
// [x (H) | routing weight | local expert index] sent to the rank owning the expert; the owner runs the
// grouped kernel on its rows with k = 1 (so it applies the weights) and sends the weighted outputs back;
// out[n] = sum over s (in slot order, as the single-rank kernel) of the returned rows. The send order is
// worked out on the host (the exchange's row counts are host data anyway); rows move by device ops.
// With ep_fixed_ (compile mode) the exchange has a fixed capacity instead, S rows to every rank (the
// slots routed there in order, then padding rows naming no expert), laid out on the device: nothing waits
// for the routing, and the device-routed experts skip the padding. Each real row meets the same kernels in
// the same relative order as in the exact exchange, so both give the same bits.
void Qwen3Model::moe_experts_ep_forward(int64_t l, float* out) {
  const auto& c = config_;
  const int64_t N = moe_rows(), H = c.hidden_size, k = c.num_experts_per_tok, Im = c.moe_intermediate_size,
                El = local_experts_, S = N * k, row = H + 2;
  LayerActs& a = layer_acts_[l];
  LayerView w = layer_view(l);
  EpLayer& s = ep_layers_[moe_row_[l]];
  if (ep_fixed_) {
    const int64_t cap = ep_size_ * S;  // send rows: S per rank
    if (!s.exchange || !s.fixed || s.exchange->total_send() != cap) {
      s.exchange = std::make_unique<dist::AllToAllExchange>(*ep_, std::vector<int64_t>(ep_size_, S), row);
      s.fixed = true;
    }
    ep_kernels_->route_fixed(ensure(s.send_order, cap, DType::I64).data<int64_t>(),
                             ensure(s.pos_of_slot, S, DType::I64).data<int64_t>(), a.topk_idx, S, El,
                             ep_size_);
  } else {
    ep_idx_host_.resize(S);
    dev_->copy_to_host(ep_idx_host_.data(), a.topk_idx, S * sizeof(int32_t));
    std::vector<int> dest(S);
    for (int64_t i = 0; i < S; ++i) dest[i] = static_cast<int>(ep_idx_host_[i] / El);
    auto [order, counts] = dist::group_rows_by_destination(dest, ep_size_);
    std::vector<int64_t> pos(S);
    for (int64_t i = 0; i < S; ++i) pos[order[i]] = i;
    ensure(s.send_order, S, DType::I64).view_at(0, {S}).copy_from_host(order.data());
    ensure(s.pos_of_slot, S, DType::I64).view_at(0, {S}).copy_from_host(pos.data());
    s.exchange = std::make_unique<dist::AllToAllExchange>(*ep_, counts, row);
    s.fixed = false;
  }
  const int64_t sent = s.exchange->total_send(), R = s.exchange->total_recv();
  ep_kernels_->pack(ensure(ep_send_, sent * row).f32(), a.ln2, a.topk_w, a.topk_idx,
                    s.send_order.data<int64_t>(), sent, k, H, El);
  s.exchange->dispatch(ep_send_.f32(), ensure(ep_recv_, R * row).f32());
  ensure(s.x, R * H), ensure(s.w, R), ensure(s.idx, R, DType::I32);
  if (s.fixed) {
    ep_kernels_->unpack_padded(s.x.f32(), s.w.f32(), s.idx.data<int32_t>(), ep_recv_.f32(), R, H);
  } else {
    const int64_t bad =
        ep_kernels_->unpack(s.x.f32(), s.w.f32(), s.idx.data<int32_t>(), ep_recv_.f32(), R, H, El);
    TITAN_CHECK(bad == 0, "expert parallel: received ", bad, " rows for experts outside this rank's ", El);
  }
  ensure(s.gu, R * 2 * Im), ensure(s.act, R * Im);
  ensure(s.order, R, DType::I32), ensure(s.row_of, R, DType::I32);
  ensure(s.offsets, El + 1, DType::I32).view_at(0, {El + 1}).zero_();
  ensure(ep_scratch_, moe_experts_scratch_floats(R, 1, H, Im));
  ensure(ep_rows_, R * H);
  if (R > 0) {
    const MoeExpertsBuffers buf = ep_buffers(s);
    moe_->forward(ep_rows_.f32(), buf, s.x.f32(), s.idx.data<int32_t>(), s.w.f32(), w.wgu, w.wdown, R, 1, El,
                  H, Im);
  }
  dist::AllToAllExchange back(*s.exchange, H);
  back.combine(ep_rows_.f32(), ensure(ep_send_, sent * H).f32());
  ep_kernels_->combine(out, nullptr, ep_send_.f32(), s.pos_of_slot.data<int64_t>(), N, k, H, H, false);
}

// Backward of the above: d(out) rows go to the experts' ranks, the kernel's backward runs there (expert
// weight gradients accumulate locally), and [d x (H) | d weight] rows come back:
// dln[n] += sum_s dx rows, dtw[slot] += d weight.
void Qwen3Model::moe_experts_ep_backward(int64_t l, const float* dresid, float* dln, float* dtw) {
  const auto& c = config_;
  const int64_t N = moe_rows(), H = c.hidden_size, k = c.num_experts_per_tok, Im = c.moe_intermediate_size,
                El = local_experts_;
  LayerView w = layer_view(l);
  LayerView g = layer_view(l, flat_grads_[l + 1].f32());
  EpLayer& s = ep_layers_[moe_row_[l]];
  TITAN_CHECK(s.exchange, "expert parallel: backward without a forward");
  const int64_t R = s.exchange->total_recv(), sent = s.exchange->total_send();  // (sent = S unless fixed)
  ep_kernels_->gather_rows(ensure(ep_send_, sent * H).f32(), dresid, s.send_order.data<int64_t>(), sent, k,
                           H);
  dist::AllToAllExchange out_rows(*s.exchange, H);
  out_rows.dispatch(ep_send_.f32(), ensure(ep_rows_, R * H).f32());  // d(out) of every received row
  const int64_t row = H + 1;
  ensure(ep_recv_, R * row);
  if (R > 0) {
    // dx rows (R,H) and d weights (R), then packed as [dx | dw] rows.
    zero(ensure(ep_dx_, R * H).f32(), R * H);
    zero(ensure(ep_dw_, R).f32(), R);
    ensure(ep_scratch_, moe_experts_scratch_floats(R, 1, H, Im));
    const MoeExpertsBuffers buf = ep_buffers(s);
    moe_->backward(ep_dx_.f32(), ep_dw_.f32(), g.wgu, g.wdown, buf, ep_rows_.f32(), s.x.f32(),
                   s.idx.data<int32_t>(), s.w.f32(), w.wgu, w.wdown, R, 1, El, H, Im);
    ep_kernels_->pack_grads(ep_recv_.f32(), ep_dx_.f32(), ep_dw_.f32(), R, H);
  }
  dist::AllToAllExchange grads_back(*s.exchange, row);
  grads_back.combine(ep_recv_.f32(), ensure(ep_send_, sent * row).f32());
  ep_kernels_->combine(dln, dtw, ep_send_.f32(), s.pos_of_slot.data<int64_t>(), N, k, H, row, true);
}

// The first backward after zero_grad() overwrites the GEMM weights' gradients (accumulate_dweight = false:
// the lm_head's first chunk, every dense layer's projections), so only the ranges that it accumulates into
// are zeroed: the norms, the untied embedding (sparse rows), sparse layers whole. At 0.6B that skips
// clearing the 0.6 GB tied embedding gradient every step.
void Qwen3Model::zero_accumulated_grads() {
  const auto& c = config_;
  const int64_t H = c.hidden_size;
  const int group_head = static_cast<int>(flat_grads_.size()) - 1;
  for (int g = 0; g <= group_head; ++g) {
    Tensor& t = flat_grads_[g];
    if (!t.defined() || !held_[g]) continue;
    float* base = t.f32();
    if (g == 0) {
      // (a tied embedding's gradient is first written by the lm_head's, when the head is here)
      if (!c.tie_word_embeddings || !held_[group_head]) t.zero_();
    } else if (g == group_head) {
      zero(base, H);  // model.norm; the untied lm_head's is overwritten
    } else if (c.is_moe_layer(g - 1)) {
      t.zero_();
    } else {
      const LayerView v = layer_view(g - 1, base);
      for (float* norm : {v.input_norm, v.post_norm}) zero(norm, H);
      for (float* norm : {v.q_norm, v.k_norm}) zero(norm, c.head_dim);
    }
  }
}

// The embedding's ids on the device (vocab parallel: the rows held here, local ids, -1 for the other ranks'
// tokens).
void Qwen3Model::check_ids(const int32_t* ids, int64_t B, int64_t T) const {
  const int64_t Vf = full_vocab_size();
  for (int64_t n = 0; n < B * T; ++n)
    TITAN_CHECK(ids[n] >= 0 && ids[n] < Vf, "input_ids[", n / T, "][", n % T, "] = ", ids[n],
                " is outside the vocabulary [0, ", Vf, ")");
}

// ids into dst (N, i32 on the device); vocab parallel: as indices into this rank's rows (-1: elsewhere).
void Qwen3Model::upload_ids(const int32_t* ids, int64_t N, Tensor dst) {
  if (vocab_parallel()) {
    const int64_t V = config_.vocab_size, v0 = vocab_start();  // (the rows held here)
    host_ids_.resize(N);
    for (int64_t n = 0; n < N; ++n) host_ids_[n] = ids[n] >= v0 && ids[n] < v0 + V ? ids[n] - v0 : -1;
    dst.copy_from_host(host_ids_.data());
  } else {
    dst.copy_from_host(ids);
  }
}

// HF ForCausalLMLoss: labels padded with -100 on the right and shifted left by one (unless already shifted),
// into host_targets_ (-1: ignored); returns the number of valid targets.
int64_t Qwen3Model::prepare_targets(const int32_t* labels, int64_t B, int64_t T, const ForwardOptions& opts) {
  const int64_t Vf = full_vocab_size();
  int32_t* tgt = host_targets_.data();
  int64_t num_valid = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t src = opts.labels_shifted ? t : t + 1;
      int32_t y = src < T ? labels[b * T + src] : -100;
      TITAN_CHECK(y == -100 || (y >= 0 && y < Vf), "labels[", b, "][", src, "] = ", y,
                  " is neither -100 nor inside the vocabulary");
      tgt[b * T + t] = y < 0 ? -1 : y;
      num_valid += y >= 0;
    }
  return num_valid;
}

void Qwen3Model::stage_inputs(const int32_t* ids, const int32_t* labels, int64_t B, int64_t T,
                              const ForwardOptions& opts, int64_t slot, int64_t slots) {
  TITAN_CHECK(slot >= 0 && slot < slots, "stage_inputs: slot ", slot, " of ", slots);
  const int64_t N = B * T;
  plan_activations(B, T);
  ensure(loss_sum_, slots, DType::F64);
  if (total_moe_layers_ > 0) ensure(aux_loss_dev_, slots, DType::F64);
  if (stage_has_embedding(opts.stage)) {
    check_ids(ids, B, T);
    upload_ids(ids, N, ensure(staged_ids_, slots * N, DType::I32).view_at(slot * N, {N}));
  }
  if (stage_has_head(opts.stage)) {
    const float scale = loss_grad_scale(opts, prepare_targets(labels, B, T, opts));
    ensure(staged_targets_, slots * N, DType::I32)
        .view_at(slot * N, {N})
        .copy_from_host(host_targets_.data());
    ensure(staged_scale_, slots).view_at(slot, {1}).copy_from_host(&scale);
  }
  if (opts.position_ids) {  // packed rows: set_packing's tables
    build_rope_tables(cp_ ? T * cp_->size() : T);
    const int64_t half = config_.head_dim / 2;
    std::vector<int32_t> start;
    std::vector<float> tcos, tsin;
    packing_tables(opts.position_ids, start, tcos, tsin);
    ensure(staged_doc_start_, slots * N, DType::I32).view_at(slot * N, {N}).copy_from_host(start.data());
    ensure(staged_cos_, slots * N * half).view_at(slot * N * half, {N * half}).copy_from_host(tcos.data());
    ensure(staged_sin_, slots * N * half).view_at(slot * N * half, {N * half}).copy_from_host(tsin.data());
  }
}

float Qwen3Model::loss_grad_scale(const ForwardOptions& opts, int64_t num_valid) {
  return opts.grad_scale > 0 ? opts.grad_scale : num_valid > 0 ? 1.0f / (float)num_valid : 0.0f;
}

// A staged micro-batch's n elements (slot of staged) into the forward's buffer: a copy on the device.
void Qwen3Model::copy_staged(Tensor& dst, const Tensor& staged, int64_t slot, int64_t n) {
  TITAN_CHECK(staged.defined() && staged.numel() >= (slot + 1) * n && dst.dtype() == staged.dtype(),
              "forward: inputs_staged, but stage_inputs() staged no micro-batch ", slot, " of this shape");
  const size_t width = dtype_size(staged.dtype());
  dev_->copy(dst.raw(), static_cast<const char*>(staged.raw()) + slot * n * width, n * width);
}

double Qwen3Model::device_loss_sum(int64_t slot) const {
  TITAN_CHECK(loss_sum_.defined() && slot >= 0 && slot < loss_sum_.numel(),
              "device_loss_sum: no forward with loss_on_device has written slot ", slot);
  double v = 0;
  loss_sum_.view_at(slot, {1}).copy_to_host(&v);
  return v;
}

void Qwen3Model::count_nonfinite_losses(double* out, int64_t slots) const {
  TITAN_CHECK(loss_sum_.defined() && slots <= loss_sum_.numel(),
              "count_nonfinite_losses: stage_inputs() staged fewer than ", slots, " micro-batches");
  const auto& k = get_kernel<SumSquaresKernels>(device_.type);
  k.count_nonfinite(out, loss_sum_.data<double>(), slots);
  if (total_moe_layers_ > 0) k.count_nonfinite(out, aux_loss_dev_.data<double>(), slots);
}

double Qwen3Model::device_aux_loss(int64_t slot) const {
  TITAN_CHECK(aux_loss_dev_.defined() && slot >= 0 && slot < aux_loss_dev_.numel(),
              "device_aux_loss: no MoE forward with loss_on_device has written slot ", slot);
  double v = 0;
  aux_loss_dev_.view_at(slot, {1}).copy_to_host(&v);
  return v;
}

}  // namespace titan
