#include "train/roofline.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "core/error.h"
#include "distributed/tensor_parallel.h"

namespace titan {

const GpuSpec& gpu_spec(const std::string& name) {
  // Published per-GPU figures (dense, no sparsity): H100 SXM5 and H200 SXM (Hopper: the same compute,
  // HBM3 3.35 TB/s against HBM3e 4.8 TB/s), HGX B200 at 1000 W. NVLink 4 is 900 GB/s and NVLink 5 1.8 TB/s
  // both directions together: half of it each way.
  static const GpuSpec kGpus[] = {
      {"h100", 989.4, 66.9, 3.35, 450, 80},
      {"h200", 989.4, 66.9, 4.8, 450, 141},
      {"b200", 2250, 80, 8.0, 900, 180},
  };
  for (const GpuSpec& g : kGpus)
    if (g.name == name) return g;
  fail("--gpu: unknown GPU '", name, "' (known: h100, h200, b200)");
}

namespace {

std::string fmt(const char* f, double a, double b = 0, double c = 0) {
  char buf[96];
  std::snprintf(buf, sizeof buf, f, a, b, c);
  return buf;
}

}  // namespace

GpuStepPrediction predict_gpu_step(const Qwen3Config& c, const RunPlan& plan, CheckpointPolicy ac,
                                   const GpuSpec& gpu, bool bf16, const RooflineRates& r) {
  GpuStepPrediction p;
  p.gpu = gpu;
  p.bf16 = bf16;
  const int64_t tp = plan.tensor_parallel;
  const Qwen3Config lc = dist::tensor_parallel_config(c, tp);  // this rank's slice of each layer
  const double L = (double)c.num_hidden_layers, H = (double)c.hidden_size, T = (double)plan.seq_len;
  // Tokens this rank's layers see per step (every tensor-parallel rank sees all of its group's tokens).
  const double tokens = (double)plan.local_batch * plan.seq_len * plan.grad_accum;
  const double act = bf16 ? 2 : 4;  // bytes per activation element
  // Layers recomputed in backward (full checkpointing of every `every`-th layer).
  const double recomputed = ac.every > 0 ? std::floor(L / ac.every) : 0;

  // GEMMs: 2 FLOPs per weight and token forward, 4 backward, on this rank's slice; a checkpointed layer's
  // forward GEMMs run twice. The lm_head is one GEMM forward and two backward like the rest.
  double layer_gemm = 0;  // weights a token meets in all layers (this rank's slice)
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    layer_gemm +=
        H * lc.qkv_dim() + lc.q_dim() * H +
        (c.is_moe_layer(l) ? H * c.num_experts + c.num_experts_per_tok * 3.0 * H * c.moe_intermediate_size
                           : 3.0 * H * lc.intermediate_size);
  const double head_gemm = (double)lc.vocab_size * H;
  const double gemm_flops =
      tokens * (6.0 * (layer_gemm + head_gemm) + 2.0 * layer_gemm * (recomputed / std::max(L, 1.0)));
  const double gemm_rate = (bf16 ? gpu.bf16_tflops : gpu.f32_tflops) * r.gemm * 1e12;
  p.ops.push_back({"GEMMs (q/k/v, o, MLP / experts, router, lm_head)", gemm_flops, 0, gemm_flops / gemm_rate,
                   fmt("%.0f TFLOPS (%.0f%% of %.0f)", gemm_rate / 1e12, r.gemm * 100,
                       bf16 ? gpu.bf16_tflops : gpu.f32_tflops)});

  // Attention, causal: the lower triangle's FLOPs. Forward Q K^T and P V: 4 * hd FLOPs per (query, key)
  // pair, T/2 keys per query on average; backward 2.5x forward (S recomputed, dV, dP, dQ, dK).
  const double pairs = tokens * (T + 1) / 2.0 * lc.num_attention_heads * L;
  const double attn_fwd = 4.0 * c.head_dim * pairs * (1 + recomputed / std::max(L, 1.0));
  const double attn_bwd = 2.5 * 4.0 * c.head_dim * pairs;
  if (bf16) {
    const double fr = gpu.bf16_tflops * r.attention_fwd * 1e12, br = gpu.bf16_tflops * r.attention_bwd * 1e12;
    p.ops.push_back({"attention forward (cuDNN SDPA)", attn_fwd, 0, attn_fwd / fr,
                     fmt("%.0f TFLOPS (%.0f%% of peak)", fr / 1e12, r.attention_fwd * 100)});
    p.ops.push_back({"attention backward (cuDNN SDPA)", attn_bwd, 0, attn_bwd / br,
                     fmt("%.0f TFLOPS (%.0f%% of peak)", br / 1e12, r.attention_bwd * 100)});
  } else {
    const double rate = gpu.f32_tflops * r.f32_attention * 1e12;
    p.ops.push_back({"attention forward + backward (f32 tiles)", attn_fwd + attn_bwd, 0,
                     (attn_fwd + attn_bwd) / rate,
                     fmt("%.1f TFLOPS (%.0f%% of the f32 peak)", rate / 1e12, r.f32_attention * 100)});
  }

  // Memory-bound ops per layer and token, in elements read + written (forward; backward):
  // RMSNorm x2 (2H; 3H), q/k RMSNorm + RoPE (bf16: one op, qk_norm_rope, 2(q+kv); 3(q+kv); f32: two,
  // 4(q+kv); 5(q+kv)), SwiGLU (3I; 5I) or the routed experts' permutation, SwiGLU and combine (k(2H + 3Im +
  // 2H); k(2H + 5Im + 2H)), residual adds (2 x 3H; 2 x 3H). Sequence parallel: the norms and adds on N/tp
  // rows.
  const double sp = plan.sequence_parallel ? 1.0 / tp : 1.0;
  const double qk = (double)lc.q_dim() + lc.kv_dim();
  const double qk_fwd = bf16 ? 2 * qk : 4 * qk, qk_bwd = bf16 ? 3 * qk : 5 * qk;
  double fwd_elems = 0, bwd_elems = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    double f = 2 * 2 * H * sp + qk_fwd + 2 * 3 * H * sp;
    double b = 2 * 3 * H * sp + qk_bwd + 2 * 3 * H * sp;
    if (c.is_moe_layer(l)) {
      const double k = (double)c.num_experts_per_tok, Im = (double)c.moe_intermediate_size;
      f += k * (4 * H + 3 * Im), b += k * (4 * H + 5 * Im);
    } else {
      f += 3.0 * lc.intermediate_size, b += 5.0 * lc.intermediate_size;
    }
    const bool again = ac.every > 0 && (l + 1) % ac.every == 0;
    const bool pointwise_again = ac.recompute_ops && !again;  // norms, q/k norm + RoPE, SwiGLU recomputed
    fwd_elems +=
        f * (again ? 2 : 1) +
        (pointwise_again ? 2 * 2 * H * sp + qk_fwd + (c.is_moe_layer(l) ? 0 : 3.0 * lc.intermediate_size)
                         : 0);
    bwd_elems += b;
  }
  // Embedding (gather H; scatter-add H), the final norm (2H; 3H), the head's logits: written by the GEMM,
  // read by the cross-entropy, its gradient written and read by the backward GEMMs (4 V per token).
  const double head_elems = 2 * H + 5 * H * sp + 4.0 * lc.vocab_size;
  const double hbm = gpu.hbm_tbps * 1e12 * r.hbm;
  const double pointwise_bytes = tokens * (fwd_elems + bwd_elems) * act;
  p.ops.push_back({"norms, RoPE, SwiGLU, residual adds", 0, pointwise_bytes, pointwise_bytes / hbm,
                   fmt("%.2f TB/s (%.0f%% of HBM)", hbm / 1e12, r.hbm * 100)});
  const double head_bytes = tokens * head_elems * act;
  p.ops.push_back({"embedding, final norm, cross-entropy", 0, head_bytes, head_bytes / hbm,
                   fmt("%.2f TB/s (%.0f%% of HBM)", hbm / 1e12, r.hbm * 100)});

  // Optimizer, once per step over this rank's shard: the gradient norm reads the gradients (4 B), AdamW
  // reads parameter, gradient and both moments and writes three (28 B), the bf16 weight copy reads 4 and
  // writes 2, the gradients are zeroed (4 B).
  const double shard_params = (double)plan.shard_params;
  const double opt_bytes = shard_params * (4 + 28 + (bf16 ? 6 : 0) + 4);
  p.ops.push_back({"grad norm, AdamW, zero grads" + std::string(bf16 ? ", bf16 weights" : ""), 0, opt_bytes,
                   opt_bytes / hbm, fmt("%.2f TB/s (%.0f%% of HBM)", hbm / 1e12, r.hbm * 100)});

  // Communication (NCCL over NVLink, ring algorithms: (n-1)/n of the buffer each way per all-gather or
  // reduce-scatter, twice that per all-reduce).
  const double link = gpu.link_gbps * 1e9 * r.link;
  const double rank_params = shard_params * plan.dp_shard;  // this rank's tensor-parallel slice
  if (plan.dp_shard > 1 || plan.dp_replicate > 1) {
    const double s = (double)plan.dp_shard, rep = (double)plan.dp_replicate;
    // FSDP per micro-batch: parameters gathered for forward and again for backward (bf16 under mixed
    // precision), gradients reduce-scattered in f32; HSDP/DDP: the gradients all-reduced over the
    // replicas once per step.
    const double fsdp = s > 1 ? plan.grad_accum * rank_params * (s - 1) / s * (2 * act + 4) : 0;
    const double ddp = rep > 1 ? 2.0 * shard_params * 4 * (rep - 1) / rep : 0;
    const double bytes = fsdp + ddp;
    // Overlapped with compute (prefetch), except the first layer's gather and the last one's reduce.
    const double exposed = bytes / std::max(L, 1.0) / link;
    p.ops.push_back(
        {"data-parallel collectives (exposed)", 0, bytes, exposed,
         fmt("%.0f GB/s (%.0f%% of NVLink), %.3f s if serial", link / 1e9, r.link * 100, bytes / link)});
  }
  if (tp > 1) {
    const double bytes = plan.tp_comm_bytes * act / 4.0;  // the plan counts f32 activations
    p.ops.push_back({"tensor-parallel collectives", 0, bytes, bytes / link,
                     fmt("%.0f GB/s (%.0f%% of NVLink)", link / 1e9, r.link * 100)});
  }

  for (const OpClassTime& o : p.ops) p.gpu_seconds += o.seconds;
  // Kernel launches per micro-batch in eager mode: ~14 per layer forward (norms, GEMMs, q/k norm, RoPE,
  // attention, adds, SwiGLU), ~24 backward, a checkpointed layer's forward again; the head ~10 per chunk;
  // the optimizer ~8 per step (multi-tensor over flat buffers).
  const double per_micro = L * (14 + 24) + recomputed * 14 + 10;
  p.launches = per_micro * plan.grad_accum + 8;
  p.host_seconds = p.launches * r.launch_us * 1e-6;
  p.step_seconds = std::max(p.gpu_seconds, p.host_seconds);
  p.tokens_per_s = tokens / tp / p.step_seconds;  // tokens per GPU
  p.mfu = plan.flops_per_token * p.tokens_per_s / (gpu.bf16_tflops * 1e12);
  // The run plan's memory (its activations as the model allocates them: under bf16 compute the tensors the
  // step keeps in bf16 are counted so there, the rest f32) and, under bf16, the bf16 weight copy.
  p.memory_bytes = (double)(plan.param_bytes + plan.grad_bytes + plan.optimizer_bytes) +
                   (bf16 ? 2.0 * shard_params : 0.0) + (double)plan.activation_bytes;
  return p;
}

std::string GpuStepPrediction::describe() const {
  std::ostringstream os;
  os << "roofline on one " << gpu.name << " (" << gpu.bf16_tflops << " TFLOPS bf16 dense, " << gpu.f32_tflops
     << " f32, " << gpu.hbm_tbps << " TB/s HBM, " << gpu.link_gbps << " GB/s NVLink each way, "
     << gpu.memory_gib << " GB), " << (bf16 ? "bf16 mixed precision" : "f32") << ", per rank and step:\n";
  char line[256];
  std::snprintf(line, sizeof line, "  %-52s %10s %10s %9s %6s  %s\n", "op class", "GFLOP", "GB", "ms",
                "share", "rate");
  os << line;
  for (const OpClassTime& o : ops) {
    std::snprintf(line, sizeof line, "  %-52s %10.1f %10.2f %9.2f %5.1f%%  %s\n", o.name.c_str(),
                  o.flops / 1e9, o.bytes / 1e9, o.seconds * 1e3, 100 * o.seconds / gpu_seconds,
                  o.rate.c_str());
    os << line;
  }
  std::snprintf(
      line, sizeof line, "  GPU time %.2f ms; host launch time %.2f ms (%.0f launches x %.0f us: %s)\n",
      gpu_seconds * 1e3, host_seconds * 1e3, launches, launches > 0 ? host_seconds / launches * 1e6 : 0.0,
      host_seconds > gpu_seconds ? "launch-bound; compile mode's CUDA graphs remove it" : "GPU-bound");
  os << line;
  std::snprintf(line, sizeof line, "predicted step %.2f ms, %.0f tokens/s per GPU, MFU %.1f%% of %.0f TFLOPS",
                step_seconds * 1e3, tokens_per_s, 100 * mfu, gpu.bf16_tflops);
  os << line;
  std::snprintf(line, sizeof line, "; memory per rank %.1f GiB of %.0f GB (%s)",
                memory_bytes / double(1 << 30), gpu.memory_gib,
                memory_bytes <= gpu.memory_gib * 1e9 ? "fits" : "does not fit");
  os << line;
  return os.str();
}

}  // namespace titan
