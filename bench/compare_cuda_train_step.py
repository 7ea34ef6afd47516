#!/usr/bin/env python3
"""titan vs PyTorch eager vs torch.compile: one Qwen3 training step on one GPU, bf16 mixed precision.

A step is: zero_grad, forward with labels (HF causal-LM loss), backward, global-norm clip (max_norm 1),
AdamW. Both sides train in bf16 mixed precision with f32 master weights, f32 gradients and f32 AdamW state:

  titan    bench_train_step --device cuda --bf16 1 (bf16 GEMM operands, f32 accumulation; its adamw and
           sum_squares ops on the GPU); `titan_f32` drops --bf16; `titan_graph` adds --graph 1: compile
           mode, the step captured into a CUDA graph once and launched per step (its "host_seconds", the
           host's time to stage and launch a step, is reported beside eager's step time)
  eager    bench/pytorch_train_step.py --device cuda --dtype bf16: HF Qwen3ForCausalLM under
           torch.autocast(bfloat16), SDPA attention, torch.optim.AdamW(fused=True) (--torch-optim)
  compile  the same with torch.compile of the model (compiled during its warm-up steps)

Each implementation runs as its own process, one after the other (never two on the GPU at once): --warmup
unmeasured steps (--compile-warmup for torch.compile), then --steps measured steps, each bracketed by a
device synchronization. Reported per implementation: the median step time, tokens/s, MFU and the peak GPU
memory its allocator handed out (titan: its CUDA allocator's peak; PyTorch: torch.cuda.max_memory_allocated).
MFU = flops_per_token * tokens/s / (--peak-tflops * 1e12), flops_per_token = titan's
Qwen3Config::training_flops_per_token(seq) (6 x GEMM weights incl. the lm_head + 12 x layers x heads x
head_dim x seq; both programs print it and the driver checks they agree). 989.4 TFLOP/s is the H100/H200 SXM
dense bf16 peak; an 8192^3 bf16 GEMM in PyTorch reaches about 790 on this workplace's H200.

  # on the GPU machine (titan built with CUDA; see bench/cuda_train_step.sh for the bundled form)
  python3 bench/compare_cuda_train_step.py --titan build/bench_train_step --presets 0.6B,1.7B
  # check the driver without a GPU: tiny shape on the CPU, or canned outputs (no processes at all)
  python3 bench/compare_cuda_train_step.py --device cpu --presets tiny --steps 2 --warmup 1
  python3 bench/compare_cuda_train_step.py --dry-run

Runtime on an H200 (estimate, not measured): per preset about 20-40 s for titan and eager each and
60-120 s for torch.compile (compilation of the 28-layer model); --impls, --steps and --timeout bound it,
and --compile-scope blocks compiles one decoder layer's graph instead of the whole model's (on a CPU: 13 s
instead of 72 s for 28 layers).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Released shapes (titan's Qwen3Config::flavor; Qwen/Qwen3-*/config.json) and a tiny one for CPU checks.
PRESETS = {
    "0.6B": dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936,
                 tied=1),
    "1.7B": dict(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144, vocab=151936,
                 tied=1),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512, tied=1),
}
IMPLS = ("titan", "titan_graph", "titan_f32", "eager", "compile")
TARGET_MFU_1_7B = 0.45  # the targets: >= 45% MFU bf16 at 1.7B, >= 1.2x torch.compile tokens/s
TARGET_VS_COMPILE = 1.2


def shape_args(shape, seq, batch):
    out = []
    for k, v in shape.items():
        out += ["--" + k.replace("_", "-"), str(v)]
    return out + ["--seq", str(seq), "--batch", str(batch)]


def commands(args, preset):
    """impl -> argv for one preset."""
    shape = PRESETS[preset]
    sa = shape_args(shape, args.seq, args.batch)
    common = ["--device", args.device, "--peak-tflops", str(args.peak_tflops), "--steps", str(args.steps)]
    # titan's own flavor where it has one (rope theta, eps: the released values); explicit shape on top.
    titan_flavor = ["--preset", preset] if preset in ("0.6B", "1.7B") else ["--flavor", "debug"]
    titan = shlex.split(args.titan) + titan_flavor + sa + common + ["--warmup", str(args.warmup)]
    torch_cmd = ([sys.executable, os.path.join(HERE, "pytorch_train_step.py"), "--preset", preset]
                 if preset in ("0.6B", "1.7B") else [sys.executable, os.path.join(HERE, "pytorch_train_step.py")])
    torch_cmd = torch_cmd + sa + common + ["--dtype", "bf16", "--max-norm", "1.0", "--optim-impl", args.torch_optim]
    if args.device == "cpu":
        torch_cmd += ["--threads", str(args.threads)]
    return {
        "titan": titan + ["--bf16", "1"],
        "titan_graph": titan + ["--bf16", "1", "--graph", "1"],
        "titan_f32": titan + ["--bf16", "0"],
        "eager": torch_cmd + ["--warmup", str(args.warmup)],
        "compile": torch_cmd + ["--warmup", str(args.compile_warmup), "--compile", "--compile-scope",
                                args.compile_scope],
    }


def parse_output(text):
    """JSON lines of bench_train_step / pytorch_train_step.py -> (step records, summary or None)."""
    steps, summary = [], None
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if rec.get("summary"):
            summary = rec
        elif "seconds" in rec:
            steps.append(rec)
    return steps, summary


def run_impl(name, cmd, args, env):
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        steps, _ = parse_output(out)
        return {"error": f"timed out after {args.timeout}s ({len(steps)} steps done)",
                "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    sys.stderr.write(res.stderr[-1500:])
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or [""])[-1]
        return {"error": f"exit {res.returncode}: {last[-300:]}", "wall_s": wall}
    steps, summary = parse_output(res.stdout)
    return summarize(steps, summary, wall)


def summarize(steps, summary, wall):
    if not steps or not summary:
        return {"error": "no measured steps", "wall_s": wall}
    secs = [s["seconds"] for s in steps]
    med = statistics.median(secs)
    tokens = summary["tokens_per_step"]
    peak = summary.get("peak_alloc_bytes", 0)
    fpt = summary["flops_per_token"]
    ptf = summary.get("peak_tflops", 0)
    return {
        "median_s": med, "steps_s": secs, "tokens_per_s": tokens / med, "tokens_per_step": tokens,
        "mfu": fpt * tokens / med / (ptf * 1e12) if ptf > 0 else float("nan"),
        "flops_per_token": fpt, "peak_mem_bytes": peak, "losses": [s.get("loss") for s in steps],
        "host_s": statistics.median([s["host_seconds"] for s in steps]) if "host_seconds" in steps[0] else None,
        "wall_s": wall, "gpu": summary.get("gpu", ""), "kernels": summary.get("kernels", ""),
        "versions": {k: summary[k] for k in ("torch_version", "transformers_version") if k in summary},
    }


def fake_rows(preset, impls):
    """Canned outputs (--dry-run) that exercise parsing, medians and the table; not measurements."""
    s = PRESETS[preset]
    fpt = 6.0 * (s["vocab"] * s["hidden"] + s["layers"] * 12 * s["hidden"] ** 2) + 12.0 * s["layers"] * 2048 * 2048
    rows = {}
    for i, name in enumerate(impls):
        secs = [0.1 * (i + 1) + 0.001 * k for k in range(3)]
        lines = [json.dumps({"impl": name, "step": k, "seconds": t, "loss": 12.0}) for k, t in enumerate(secs)]
        lines.append(json.dumps({"impl": name, "summary": True, "tokens_per_step": 2048, "flops_per_token": fpt,
                                 "peak_tflops": 989.4, "peak_alloc_bytes": (i + 1) * 2**30, "gpu": "dry run"}))
        rows[name] = summarize(*parse_output("\n".join(lines)), wall=0.0)
    return rows


def table(results):
    lines = ["| preset | impl | median step (ms) | tokens/s | MFU | peak GPU mem (GiB) | tokens/s vs torch.compile "
             "| host ms to launch |",
             "|---|---|---|---|---|---|---|---|"]
    for preset, rows in results.items():
        ref = rows.get("compile", {}).get("tokens_per_s")
        for name, r in rows.items():
            if "error" in r:
                err = " ".join(r["error"].split()).replace("|", "/")[:160]
                lines.append(f"| {preset} | {name} | failed: {err} | | | | | |")
                continue
            ratio = f"{r['tokens_per_s'] / ref:.2f}x" if ref else "-"
            host = f"{1e3 * r['host_s']:.2f}" if r.get("host_s") is not None else "-"
            lines.append(f"| {preset} | {name} | {1e3 * r['median_s']:.1f} | {r['tokens_per_s']:.0f} | "
                         f"{100 * r['mfu']:.1f}% | {r['peak_mem_bytes'] / 2**30:.2f} | {ratio} | {host} |")
    return "\n".join(lines)


def checks(results):
    out = []
    for preset, rows in results.items():
        fpts = {n: r["flops_per_token"] for n, r in rows.items() if "flops_per_token" in r}
        if fpts and max(fpts.values()) > min(fpts.values()) * (1 + 1e-9):
            out.append((f"{preset}: FLOPs/token agree between implementations {fpts}", 0, False))
        t = rows.get("titan", {})
        if "tokens_per_s" not in t:
            continue
        if "tokens_per_s" in rows.get("compile", {}):
            sp = t["tokens_per_s"] / rows["compile"]["tokens_per_s"]
            out.append((f"{preset}: titan / torch.compile tokens/s >= {TARGET_VS_COMPILE}", sp, sp >= TARGET_VS_COMPILE))
        if preset == "1.7B":
            out.append((f"1.7B: titan bf16 MFU >= {TARGET_MFU_1_7B:.0%}", t["mfu"], t["mfu"] >= TARGET_MFU_1_7B))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--titan", default=os.path.join(ROOT, "build", "bench_train_step"),
                    help="command line of bench_train_step (may start with env VAR=... )")
    ap.add_argument("--presets", default="0.6B,1.7B", help="comma list of " + ", ".join(PRESETS))
    ap.add_argument("--impls", default="titan,titan_graph,eager,compile", help="comma list of " + ", ".join(IMPLS))
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (for checking the driver)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4, help="measured steps per implementation (median)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps first (titan, eager)")
    ap.add_argument("--compile-warmup", type=int, default=2, help="unmeasured steps first for torch.compile")
    ap.add_argument("--compile-scope", choices=["model", "blocks"], default="model",
                    help="torch.compile(model) (default), or each decoder layer (shorter compilation)")
    ap.add_argument("--peak-tflops", type=float, default=989.4, help="MFU denominator (dense bf16 peak)")
    ap.add_argument("--torch-optim", choices=["default", "foreach", "fused"], default="fused",
                    help="torch.optim.AdamW implementation (default fused)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS / torch threads")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per implementation run")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--dry-run", action="store_true", help="canned outputs, no processes (checks the table code)")
    args = ap.parse_args(argv)
    presets = [p for p in args.presets.split(",") if p]
    impls = [i for i in args.impls.split(",") if i]
    for p in presets:
        if p not in PRESETS:
            ap.error(f"unknown preset {p!r} (valid: {', '.join(PRESETS)})")
    for i in impls:
        if i not in IMPLS:
            ap.error(f"unknown impl {i!r} (valid: {', '.join(IMPLS)})")

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    results = {}
    t_start = time.perf_counter()
    for preset in presets:
        if args.dry_run:
            results[preset] = fake_rows(preset, impls)
            continue
        cmds = commands(args, preset)
        results[preset] = {}
        for name in impls:
            r = run_impl(name, cmds[name], args, env)
            results[preset][name] = r
            what = (f"median {1e3 * r['median_s']:.1f} ms, {r['tokens_per_s']:.0f} tokens/s"
                    if "error" not in r else f"FAILED {r['error']}")
            print(f"[{preset}] {name}: {what} (wall {r['wall_s']:.0f}s)", file=sys.stderr, flush=True)

    rows = [r for pr in results.values() for r in pr.values() if "error" not in r]
    gpu = next((r["gpu"] for r in rows if r.get("gpu")), "")
    versions = next((r["versions"] for r in rows if r.get("versions")), {})
    print(f"\n{gpu or args.device}; " + ", ".join(f"{k} {v}" for k, v in versions.items()) +
          f"; seq {args.seq} x batch {args.batch}; median of {args.steps} steps after {args.warmup} warm-up "
          f"({args.compile_warmup} for torch.compile, scope {args.compile_scope}); MFU against {args.peak_tflops} TFLOP/s; "
          f"total wall {time.perf_counter() - t_start:.0f}s" + ("  [DRY RUN: canned numbers]" if args.dry_run else ""))
    print()
    print(table(results))
    ck = checks(results)
    if ck:
        print()
    for what, val, ok in ck:
        print(f"- [{'x' if ok else ' '}] {what}: {val:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results,
                       "checks": [{"target": w, "value": v, "met": ok} for w, v, ok in ck]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
