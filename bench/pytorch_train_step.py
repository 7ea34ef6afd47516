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

--serve: after the warm-up print {"ready": true}, then run one measured step per "step" line read from stdin
and print the summary at "quit" (bench/compare_pytorch.py interleaves frameworks step by step).
--experts E --top-k K --moe-intermediate I: Qwen3MoeForCausalLM (every layer sparse, norm_topk_prob).

Examples:
  python bench/pytorch_train_step.py --threads 16 --steps 10 --warmup 2
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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--steps", type=int, default=10, help="measured steps")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rope-theta", type=float, default=1e6)
    ap.add_argument("--untied", action="store_true", help="separate lm_head (default: tied)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa",
                    help="HF attention implementation (default sdpa)")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32",
                    help="parameter/activation dtype (default f32)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    ap.add_argument("--compile", action="store_true", help="wrap the model in torch.compile")
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
    return ap.parse_args(argv)


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
    if args.tied is not None:
        args.untied = args.tied == 0
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    device = torch.device(args.device)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]

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
    model = model_cls(cfg).to(device=device, dtype=dtype)
    model.train()
    attn_used = model.config._attn_implementation
    nparams = sum(p.numel() for p in model.parameters())

    impl_kw = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[args.optim_impl]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=args.weight_decay, **impl_kw)
    fwd = torch.compile(model) if args.compile else model

    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    labels = ids.clone()
    tokens = args.batch * args.seq

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = fwd(input_ids=ids, labels=labels).loss
        loss.backward()
        if args.max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        opt.step()
        return loss

    print(f"pytorch train step: torch {torch.__version__} transformers {transformers.__version__} "
          f"threads={torch.get_num_threads()} device={device} dtype={args.dtype} attn={attn_used} "
          f"compile={args.compile} optim={args.optim_impl} params={nparams} tokens/step={tokens}", file=sys.stderr)

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
              "loss": float(loss.item())})

    med = statistics.median(times) if times else float("nan")
    emit({
        "impl": "pytorch",
        "summary": True,
        "steps": len(times),
        "median_seconds": med,
        "median_tokens_per_s": tokens / med if times else float("nan"),
        "min_seconds": min(times) if times else float("nan"),
        "tokens_per_step": tokens,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "dtype": args.dtype,
        "attn": attn_used,
        "compile": args.compile,
        "optim_impl": args.optim_impl,
        "params": nparams,
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
