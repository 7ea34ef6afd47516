#!/usr/bin/env python3
"""MoE layer forward+backward: titan (moe_experts = grouped | reference) vs the PyTorch HF
Qwen3MoeSparseMoeBlock at the same shape (fp32, CPU, same thread count).

  python bench/moe_layer.py --bench build/bench_moe_layer [--tokens 2048 --reference-tokens 64 ...]

The reference kernel (per-token loops, double accumulators) is the test oracle and very slow; it runs on
--reference-tokens tokens and is reported per token. Prints JSON lines and a markdown table.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def run_titan(bench, args, impl, tokens):
    cmd = [bench, "--hidden", str(args.hidden), "--moe-intermediate", str(args.moe_intermediate),
           "--experts", str(args.experts), "--top-k", str(args.top_k), "--tokens", str(tokens),
           "--iters", str(args.iters), "--warmup", "1", "--impl", impl]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def run_torch(args, tokens, experts_impl):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.moe_intermediate,
                         num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True)
    cfg._experts_implementation = experts_impl
    block = Qwen3MoeSparseMoeBlock(cfg).float()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(1, tokens, args.hidden, requires_grad=True)
    dout = torch.randn(1, tokens, args.hidden)
    fwd, bwd = [], []
    for it in range(args.torch_iters + 1):
        block.zero_grad(set_to_none=False)
        x.grad = None
        t0 = time.perf_counter()
        y = block(x)
        t1 = time.perf_counter()
        y.backward(dout)
        t2 = time.perf_counter()
        if it > 0:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    f, b = statistics.median(fwd), statistics.median(bwd)
    flops = 6.0 * tokens * (args.top_k * 3.0 * args.hidden * args.moe_intermediate + args.experts * args.hidden)
    return {"impl": f"pytorch-hf-{experts_impl}", "tokens": tokens, "threads": args.threads, "forward_s": f,
            "backward_s": b, "total_s": f + b, "tokens_per_s": tokens / (f + b), "gflops": flops / (f + b) / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", default="build/bench_moe_layer")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--moe-intermediate", type=int, default=768)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reference-tokens", type=int, default=32)
    ap.add_argument("--iters", type=int, default=3)
    # HF's eager experts loop indexes the stacked expert Parameters per expert; on CPU each index backward
    # materialises a full-size zero gradient, so one backward takes minutes at this shape.
    ap.add_argument("--torch-iters", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    # batched_mm is left out by default: it gathers a weight copy per routed token (N*k*3*H*I floats).
    ap.add_argument("--torch-impls", default="eager,grouped_mm")
    args = ap.parse_args()

    rows = []

    def add(new):
        for r in new:
            rows.append(r)
            print(json.dumps(r), flush=True)

    add(run_titan(args.bench, args, "grouped", args.tokens))
    add(run_titan(args.bench, args, "reference", args.reference_tokens))
    for impl in args.torch_impls.split(","):
        try:
            r = run_torch(args, args.tokens, None if impl == "eager" else impl)
            if impl == "eager":
                r["impl"] = "pytorch-hf-eager"
            add([r])
        except Exception as e:  # an experts implementation may not exist for CPU in this version
            print(f"# pytorch {impl}: not available ({type(e).__name__}: {e})", file=sys.stderr)
    base = next((r for r in rows if r["impl"].startswith("pytorch")), rows[0])
    print(f"\nshape: tokens={args.tokens} hidden={args.hidden} moe_intermediate={args.moe_intermediate} "
          f"experts={args.experts} top_k={args.top_k} threads={args.threads} fp32; torch {torch.__version__}\n")
    print(f"| implementation | tokens | forward (s) | backward (s) | fwd+bwd (s) | tokens/s | GFLOP/s | vs {base['impl']} |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['impl']} | {r['tokens']} | {r['forward_s']:.4f} | {r['backward_s']:.4f} | {r['total_s']:.4f} | "
              f"{r['tokens_per_s']:.0f} | {r['gflops']:.1f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
