#!/usr/bin/env python3
"""Time one training step of an HF Qwen3ForCausalLM in PyTorch.

A step is: zero_grad, forward with labels (HF causal-LM loss), backward,
AdamW step. The model is randomly initialised from a config (no downloads).

Default shape (Qwen3-0.6B width, 4 layers):
  hidden 1024, layers 4, heads 16, kv heads 8, head_dim 128,
  intermediate 3072, vocab 151936, tied embeddings, seq 512, batch 1.

stdout carries JSON lines only:
  {"impl":"pytorch","step":i,"seconds":s,"tokens_per_s":t,"loss":l}   per measured step
  {"impl":"pytorch","summary":true,"median_seconds":...,"median_tokens_per_s":..., ...}
Diagnostics go to stderr. The summary carries the process's peak resident set (VmHWM) in bytes.

GPU (--device cuda): seq defaults to 2048; every measured step is bracketed by torch.cuda.synchronize();
the summary adds the peak GPU memory (torch.cuda.max_memory_allocated / max_memory_reserved since the
model was built). The model is built directly on the device.

--dtype:
  f32        f32 parameters and compute (TF32 off: torch's default for matmul).
  bf16       mixed precision as torch users train: torch.autocast(bfloat16) around the forward and the loss,
             f32 master parameters, f32 gradients, f32 AdamW state. GEMMs take bf16 operands with f32
             accumulation, the same split as titan's training.mixed_precision_param = "bfloat16"
             (bench_train_step --bf16 1). The backward runs outside the autocast region (autograd replays
             the forward's casts).
  bf16-pure  model.to(bfloat16): bf16 parameters, gradients and AdamW state (no f32 master weights).

MFU = flops_per_token * tokens/s / (--peak-tflops * 1e12), flops_per_token as titan's
Qwen3Config::training_flops_per_token(seq) (torchtitan's convention): 6 x (every GEMM weight a token uses:
q/k/v/o, gate/up/down or router + top-k experts, and the lm_head even when tied; no embedding lookup, no
norms) + 12 x layers x heads x head_dim x seq (attention scores and values). --peak-tflops defaults to
989.4 on a GPU (H100/H200 SXM dense bf16) and 0 (no MFU) on the CPU.

--preset 0.6B | 1.7B: the released Qwen3 shapes (28 layers, vocab 151936, tied; hidden 1024 / 2048,
intermediate 3072 / 6144, 16 query heads, 8 kv heads, head_dim 128); explicit shape options override.

--serve: after the warm-up print {"ready": true}, then run one measured step per "step" line read from stdin
and print the summary at "quit" (bench/compare_pytorch.py interleaves frameworks step by step).
--experts E --top-k K --moe-intermediate I: Qwen3MoeForCausalLM (every layer sparse, norm_topk_prob).

Examples:
  python bench/pytorch_train_step.py --threads 16 --steps 10 --warmup 2
  python bench/pytorch_train_step.py --device cuda --preset 1.7B --dtype bf16 --optim-impl fused \
      --max-norm 1.0 --compile --steps 5 --warmup 2
  python bench/pytorch_train_step.py --hidden 64 --layers 2 --heads 4 --kv-heads 2 \
      --head-dim 16 --intermediate 128 --vocab 512 --seq 32 --steps 3 --warmup 1
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch


# Default shape: the Qwen3-0.6B width cut to 4 layers. Presets: the released shapes (config.json of
# Qwen/Qwen3-0.6B and Qwen/Qwen3-1.7B; titan's Qwen3Config::flavor).
DEFAULT_SHAPE = dict(hidden=1024, layers=4, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936,
                     tied=1)
PRESETS = {
    "0.6B": dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936,
                 tied=1),
    "1.7B": dict(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144, vocab=151936,
                 tied=1),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--steps", type=int, default=10, help="measured steps")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="released Qwen3 shape (explicit shape options override)")
    for k, v in DEFAULT_SHAPE.items():
        if k == "tied":
            continue  # --tied below
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"default {v}")
    ap.add_argument("--rope-theta", type=float, default=1e6)
    ap.add_argument("--untied", action="store_true", help="separate lm_head (default: tied)")
    ap.add_argument("--seq", type=int, default=None, help="default 512 on the CPU, 2048 on a GPU")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa",
                    help="HF attention implementation (default sdpa)")
    ap.add_argument("--dtype", choices=["f32", "bf16", "bf16-pure"], default="f32",
                    help="f32 | bf16 (autocast, f32 master weights) | bf16-pure (model.to(bfloat16))")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="peak for MFU in TFLOP/s (default 989.4 on a GPU, none on the CPU)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    ap.add_argument("--compile", action="store_true", help="wrap the model in torch.compile")
    ap.add_argument("--compile-scope", choices=["model", "blocks"], default="model",
                    help="model: torch.compile(model), one graph of the whole forward incl. the loss; blocks: "
                         "each decoder layer compiled in place (torchtitan's way; the layers share one "
                         "compiled graph, so compilation is ~layers times shorter; embedding, head and loss "
                         "stay eager)")
    ap.add_argument("--optim-impl", choices=["default", "foreach", "fused"], default="default",
                    help="AdamW implementation (default: torch's choice; single-tensor on CPU)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--max-norm", type=float, default=0.0,
                    help="clip_grad_norm_ before the step if > 0 (default off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", type=int, default=0, help="> 0: Qwen3MoeForCausalLM with this many experts")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-intermediate", type=int, default=256)
    ap.add_argument("--experts-impl", default="grouped_mm",
                    help="HF experts implementation for MoE (grouped_mm | eager | batched_mm)")
    ap.add_argument("--serve", action="store_true", help="one measured step per 'step' line on stdin")
    # accepted for symmetry with bench_train_step (titan options without a PyTorch meaning)
    ap.add_argument("--tied", type=int, default=None, help="1 tied (default), 0 untied")
    args = ap.parse_args(argv)
    shape = dict(DEFAULT_SHAPE, **(PRESETS[args.preset] if args.preset else {}))
    for k, v in shape.items():
        if k == "tied":
            if args.tied is None:
                args.tied = v
        elif getattr(args, k) is None:
            setattr(args, k, v)
    if args.seq is None:
        args.seq = 512 if args.device == "cpu" else 2048
    if args.peak_tflops is None:
        args.peak_tflops = 0.0 if args.device == "cpu" else 989.4
    return args


def flops_per_token(a):
    """Training FLOPs per token, titan's Qwen3Config::training_flops_per_token (torchtitan's convention)."""
    H, q_dim = a.hidden, a.heads * a.head_dim
    qkv_dim = q_dim + 2 * a.kv_heads * a.head_dim
    per_layer = H * qkv_dim + q_dim * H
    if a.experts > 0:
        per_layer += H * a.experts + a.top_k * 3.0 * H * a.moe_intermediate
    else:
        per_layer += 3.0 * H * a.intermediate
    gemm_params = a.vocab * H + a.layers * per_layer  # lm_head counted also when tied to the embedding
    return 6.0 * gemm_params + 12.0 * a.layers * a.heads * a.head_dim * a.seq


def peak_rss_bytes():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv=None):
    args = parse_args(argv)
    args.untied = args.untied or args.tied == 0
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    # bf16 (autocast) keeps f32 parameters; bf16-pure casts the model.
    param_dtype = torch.bfloat16 if args.dtype == "bf16-pure" else torch.float32
    autocast = args.dtype == "bf16"

    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(4096, args.seq),
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        tie_word_embeddings=not args.untied,
        use_cache=False,
    )
    if args.experts > 0:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        cfg = Qwen3MoeConfig(**common, num_experts=args.experts, num_experts_per_tok=args.top_k,
                             moe_intermediate_size=args.moe_intermediate, norm_topk_prob=True,
                             decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
        cfg._experts_implementation = args.experts_impl
        model_cls = Qwen3MoeForCausalLM
    else:
        cfg = Qwen3Config(**common)
        model_cls = Qwen3ForCausalLM
    cfg._attn_implementation = args.attn
    with device:  # built and initialised on the device (HF init on a GPU takes seconds, on the CPU minutes)
        model = model_cls(cfg)
    model = model.to(device=device, dtype=param_dtype)
    model.train()
    attn_used = model.config._attn_implementation
    nparams = sum(p.numel() for p in model.parameters())
    fpt = flops_per_token(args)

    def mfu(tps):
        return fpt * tps / (args.peak_tflops * 1e12) if args.peak_tflops > 0 else 0.0

    impl_kw = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[args.optim_impl]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=args.weight_decay, **impl_kw)
    fwd = model
    if args.compile and args.compile_scope == "model":
        fwd = torch.compile(model)
    elif args.compile:
        for layer in model.model.layers:
            layer.compile()

    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    labels = ids.clone()
    tokens = args.batch * args.seq

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = fwd(input_ids=ids, labels=labels).loss
        loss.backward()
        if args.max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        opt.step()
        return loss

    print(f"pytorch train step: torch {torch.__version__} transformers {transformers.__version__} "
          f"threads={torch.get_num_threads()} device={device} dtype={args.dtype} attn={attn_used} "
          f"compile={args.compile and args.compile_scope} optim={args.optim_impl} params={nparams} tokens/step={tokens}", file=sys.stderr)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for i in range(args.warmup):
        loss = step()
        sync()
        print(f"warmup {i}: {time.perf_counter() - t0:.3f}s loss={loss.item():.4f}", file=sys.stderr)
        t0 = time.perf_counter()

    times, tps = [], []
    if args.serve:
        emit({"ready": True})
    i = -1
    while True:
        i += 1
        if args.serve:
            if sys.stdin.readline().strip() != "step":
                break
        elif i >= args.steps:
            break
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        dt = time.perf_counter() - t0
        times.append(dt)
        tps.append(tokens / dt)
        emit({"impl": "pytorch", "step": i, "seconds": dt, "tokens_per_s": tokens / dt,
              "mfu": mfu(tokens / dt), "loss": float(loss.item())})

    med = statistics.median(times) if times else float("nan")
    emit({
        "impl": "pytorch",
        "summary": True,
        "steps": len(times),
        "median_seconds": med,
        "median_tokens_per_s": tokens / med if times else float("nan"),
        "flops_per_token": fpt,
        "peak_tflops": args.peak_tflops,
        "median_mfu": mfu(tokens / med) if times else float("nan"),
        "peak_alloc_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "",
        "min_seconds": min(times) if times else float("nan"),
        "tokens_per_step": tokens,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "dtype": args.dtype,
        "attn": attn_used,
        "compile": args.compile,
        "compile_scope": args.compile_scope if args.compile else None,
        "optim_impl": args.optim_impl,
        "params": nparams,
        "preset": args.preset,
        "shape": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                  "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                  "intermediate": args.intermediate, "vocab": args.vocab,
                  "seq": args.seq, "batch": args.batch, "tied": not args.untied},
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "experts": args.experts,
        "peak_rss_bytes": peak_rss_bytes(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
