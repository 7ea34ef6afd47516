#!/usr/bin/env python3
"""titan vs PyTorch eager vs torch.compile: one Qwen3 training step (forward + backward + global-norm clip +
AdamW), fp32, same thread count, for three shapes:

  debug      the debug flavor: hidden 256, 4 layers, 8/4 heads of 32, intermediate 768, vocab 2048 (tied),
             batch 8 x seq 256
  0.6B-w4    the 0.6B width cut to 4 layers: hidden 1024, 16/8 heads of 128, intermediate 3072,
             vocab 151936 (tied), batch 1 x seq 512
  debug_moe  the debug MoE flavor: the debug shape, untied, every layer sparse with 8 experts of 256, top-2,
             batch 8 x seq 256

Each implementation is one long-lived process per shape (bench_train_step --serve / pytorch_train_step.py
--serve). Processes start one after the other and run their warm-up (torch.compile compiles there), then
the driver asks each for one step in turn, round by round (the order rotates every round), so all see the
same machine conditions; only one process computes at a time. Reported per implementation: median step
time and tokens/s over --steps steps, the peak resident set of its process (VmHWM), and MFU: useful FLOPs
per token (GEMMs, causal attention on the lower triangle, x3 for forward + backward) x tokens/s divided by
the f32 GEMM peak of the engines titan uses (OpenBLAS cblas_sgemm, oneDNN sgemm: the best rate), measured
by bench_gemm_peak on the same thread count before and after the run (the larger). With --impls
titan_bf16 it also runs titan's mixed precision (bf16 GEMM operands, f32 accumulation and master weights)
and compares its tokens/s and losses with titan's f32 run; its MFU is against the bf16 engine's peak.

  python3 bench/compare_pytorch.py --threads 2 --steps 5 --impls titan,titan_bf16,eager,compile
  python3 bench/compare_pytorch.py --shapes 0.6B-w4 --impls titan,eager --steps 5
  python3 bench/compare_pytorch.py --isa avx2 ...   # an AVX-512 machine measured as an AVX2-only CPU
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SHAPES = {
    "debug": dict(hidden=256, layers=4, heads=8, kv_heads=4, head_dim=32, intermediate=768, vocab=2048,
                  tied=1, experts=0, top_k=0, moe_intermediate=0, seq=256, batch=8),
    "0.6B-w4": dict(hidden=1024, layers=4, heads=16, kv_heads=8, head_dim=128, intermediate=3072,
                    vocab=151936, tied=1, experts=0, top_k=0, moe_intermediate=0, seq=512, batch=1),
    "debug_moe": dict(hidden=256, layers=4, heads=8, kv_heads=4, head_dim=32, intermediate=768, vocab=2048,
                      tied=0, experts=8, top_k=2, moe_intermediate=256, seq=256, batch=8),
}


ISA_CAPS = {
    "avx2": dict(TITAN_CPU_ISA="avx2", ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2",
                 MKL_ENABLE_INSTRUCTIONS="AVX2", OPENBLAS_CORETYPE="Haswell"),
    "avx512": dict(TITAN_CPU_ISA="avx512", ONEDNN_MAX_CPU_ISA="AVX512_CORE", ATEN_CPU_CAPABILITY="avx512",
                   MKL_ENABLE_INSTRUCTIONS="AVX512", OPENBLAS_CORETYPE="SkylakeX"),
}


def worker_env(name, env, isa, moe):
    """torch.compile under ATEN_CPU_CAPABILITY=avx2 crashes (SIGSEGV) in Qwen3-MoE's compiled step (torch 2.15):
    for the MoE shape under --isa avx2 it keeps inductor's own choice of vector width (AVX-512 on an AVX-512
    machine) and only its MKL/oneDNN GEMMs are capped, which can only favour it. The dense shapes run
    inductor's AVX2 code, as on an AVX2-only CPU."""
    if isa == "avx2" and name == "compile" and moe:
        return {k: v for k, v in env.items() if k != "ATEN_CPU_CAPABILITY"}
    return env


def flops_per_token(s):
    """Useful training FLOPs per token: 3 x forward (forward GEMM + two backward GEMMs)."""
    H, hd, nH, nKV, T = s["hidden"], s["head_dim"], s["heads"], s["kv_heads"], s["seq"]
    q, kv = nH * hd, nKV * hd
    attn_proj = 2 * H * (q + 2 * kv) + 2 * q * H
    attn_core = 2 * 2 * hd * nH * (T + 1) / 2  # QK^T and PV over the causal lower triangle, averaged
    if s["experts"] > 0:
        mlp = 2 * H * s["experts"] + s["top_k"] * 6 * H * s["moe_intermediate"]
    else:
        mlp = 6 * H * s["intermediate"]
    fwd = s["layers"] * (attn_proj + attn_core + mlp) + 2 * H * s["vocab"]
    return 3 * fwd


def shape_args(s):
    keys = ["hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "tied", "seq",
            "batch"]
    if s["experts"] > 0:
        keys += ["experts", "top_k", "moe_intermediate"]
    out = []
    for k in keys:
        out += ["--" + k.replace("_", "-"), str(s[k])]
    return out


class Worker:
    def __init__(self, name, cmd, env):
        self.name, self.cmd = name, cmd
        self.times, self.losses, self.summary, self.error = [], [], None, None
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)

    def read_json(self):
        while True:
            line = self.proc.stdout.readline()
            if not line:
                err = self.proc.stderr.read()[-2000:]
                raise RuntimeError(f"{self.name} exited: {err}")
            if line.startswith("{"):
                return json.loads(line)

    def wait_ready(self):
        try:
            t0 = time.perf_counter()
            while not self.read_json().get("ready"):
                pass
            return time.perf_counter() - t0
        except RuntimeError as e:
            self.error = str(e)
            return None

    def step(self):
        if self.error:
            return None
        try:
            self.proc.stdin.write("step\n")
            self.proc.stdin.flush()
            rec = self.read_json()
            self.times.append(rec["seconds"])
            self.losses.append(rec.get("loss", float("nan")))
            return rec["seconds"]
        except (RuntimeError, BrokenPipeError) as e:
            self.error = str(e)
            return None

    def finish(self):
        if not self.error:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.summary = self.read_json()
            except (RuntimeError, BrokenPipeError) as e:
                self.error = str(e)
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait()


def gemm_peak(build, env):
    out = subprocess.run([os.path.join(build, "bench_gemm_peak")], env=env, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    recs = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    return recs[-1], recs[:-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=5, help="measured steps per implementation (median)")
    ap.add_argument("--shapes", default="debug,0.6B-w4,debug_moe")
    ap.add_argument("--impls", default="titan,eager,compile",
                    help="titan, titan_bf16 (mixed precision), eager, compile")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--titan-kernel", action="append", default=[], help="op=impl passed to bench_train_step")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--isa", default="", choices=["", "avx2", "avx512"],
                    help="cap every implementation at this instruction set (an AVX-512 machine measured as an "
                         "AVX2-only one): titan's TITAN_CPU_ISA, oneDNN's ONEDNN_MAX_CPU_ISA, PyTorch's "
                         "ATEN_CPU_CAPABILITY and MKL_ENABLE_INSTRUCTIONS, OPENBLAS_CORETYPE")
    ap.add_argument("--peak-gflops", type=float, default=0,
                    help="f32 GEMM peak (GFLOP/s) to use for MFU (default: measured before and after the run, the larger)")
    args = ap.parse_args()

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if args.isa:
        env.update(ISA_CAPS[args.isa])
        print(f"instruction set capped at {args.isa}: {ISA_CAPS[args.isa]}", file=sys.stderr)
    peak, gemm_rows = gemm_peak(args.build, env)
    peak_flops = peak["peak_gflops"] * 1e9
    print(f"f32 GEMM peak, best engine ({args.threads} threads, OPENBLAS_CORETYPE={peak['openblas_coretype'] or 'auto'}): "
          f"{peak['peak_gflops']:.1f} GFLOP/s  [{peak['config']}]", file=sys.stderr)
    for r in gemm_rows:
        engine = f"{r.get('engine', 'cblas')} {r.get('dtype', 'f32')}"
        print(f"  {engine:12s} {r['shape']:12s} {r['gflops']:7.1f} GFLOP/s", file=sys.stderr)

    results = {"threads": args.threads, "steps": args.steps, "gemm_peak_gflops": peak["peak_gflops"],
               "gemm": gemm_rows, "blas": peak["config"], "coretype": peak["openblas_coretype"], "shapes": {}}
    for shape_name in [x for x in args.shapes.split(",") if x]:
        s = SHAPES[shape_name]
        sa = shape_args(s)
        tokens = s["seq"] * s["batch"]
        cmds = {
            "titan": [os.path.join(args.build, "bench_train_step"), "--flavor",
                      "debug_moe" if s["experts"] else ("debug" if s["hidden"] == 256 else "0.6B"), *sa,
                      "--warmup", "1", "--serve", "1"] + sum((["--kernel", k] for k in args.titan_kernel), []),
            # mixed precision: bf16 GEMM operands (matmul_bf16 engine), f32 accumulation and master weights
            "titan_bf16": None,
            "eager": [sys.executable, os.path.join(HERE, "pytorch_train_step.py"), *sa, "--warmup", "1",
                      "--threads", str(args.threads), "--max-norm", "1.0", "--serve"],
            "compile": [sys.executable, os.path.join(HERE, "pytorch_train_step.py"), *sa, "--warmup", "2",
                        "--threads", str(args.threads), "--max-norm", "1.0", "--serve", "--compile"],
        }
        cmds["titan_bf16"] = cmds["titan"] + ["--bf16", "1"]
        impls = args.impls.split(",")
        workers = []
        for name in impls:
            w = Worker(name, cmds[name], worker_env(name, env, args.isa, bool(s["experts"])))
            dt = w.wait_ready()
            print(f"[{shape_name}] {name}: " + (f"warm-up {dt:.1f}s" if dt is not None else f"FAILED {w.error}"),
                  file=sys.stderr, flush=True)
            workers.append(w)
        for r in range(args.steps):
            order = workers[r % len(workers):] + workers[:r % len(workers)]
            line = []
            for w in order:
                t = w.step()
                line.append(f"{w.name} {t:.3f}s" if t is not None else f"{w.name} failed")
            print(f"[{shape_name}] round {r}: " + ", ".join(line), file=sys.stderr, flush=True)
        for w in workers:
            w.finish()
        fpt = flops_per_token(s)
        rows = {}
        for w in workers:
            if w.error or not w.times:
                rows[w.name] = {"error": (w.error or "no steps")[-500:]}
                continue
            med = statistics.median(w.times)
            rows[w.name] = {"median_s": med, "tokens_per_s": tokens / med, "steps_s": w.times, "losses": w.losses,
                            "peak_rss_bytes": (w.summary or {}).get("peak_rss_bytes", 0),
                            "mfu": fpt * tokens / med / peak_flops,
                            "kernels": (w.summary or {}).get("kernels", "")}
        results["shapes"][shape_name] = {"shape": s, "tokens_per_step": tokens, "flops_per_token": fpt,
                                         "impls": rows}

    # The peak again after the run (the machine may be shared): MFU uses the larger, or --peak-gflops.
    peak2, _ = gemm_peak(args.build, env)
    results["gemm_peak_after_gflops"] = peak2["peak_gflops"]
    best = args.peak_gflops or max(peak["peak_gflops"], peak2["peak_gflops"])
    print(f"f32 GEMM peak after the run: {peak2['peak_gflops']:.1f} GFLOP/s; MFU against {best:.1f}", file=sys.stderr)
    # Mixed precision is measured against the bf16 engine's peak (same rule: the larger of the two).
    best_bf16 = max(peak.get("bf16_peak_gflops", 0), peak2.get("bf16_peak_gflops", 0)) or best
    for sr in results["shapes"].values():
        for name, row in sr["impls"].items():
            if "mfu" in row:
                row["mfu_peak_gflops"] = best_bf16 if name == "titan_bf16" else best
                row["mfu"] = row["mfu"] * peak_flops / (row["mfu_peak_gflops"] * 1e9)
    peak["peak_gflops"] = best
    results["mfu_peak_gflops"] = best
    results["mfu_peak_bf16_gflops"] = best_bf16

    # Report
    print(f"\nthreads {args.threads}, {args.steps} measured steps each (median), f32 GEMM peak "
          f"{peak['peak_gflops']:.1f} GFLOP/s ({peak['config']}, OPENBLAS_CORETYPE="
          f"{peak['openblas_coretype'] or 'auto'}); titan_bf16's MFU against the bf16 GEMM peak "
          f"{best_bf16:.1f} GFLOP/s\n")
    print("| shape | impl | median step (s) | tokens/s | titan speedup | peak RSS (GiB) | RSS titan/impl | MFU |")
    print("|---|---|---|---|---|---|---|---|")
    checks = []
    for shape_name, sr in results["shapes"].items():
        rows = sr["impls"]
        t = rows.get("titan", {})
        for name, row in rows.items():
            if "error" in row:
                print(f"| {shape_name} | {name} | failed: {row['error'][:80]} | | | | | |")
                continue
            sp = t["tokens_per_s"] / row["tokens_per_s"] if "tokens_per_s" in t else float("nan")
            rr = (t["peak_rss_bytes"] / row["peak_rss_bytes"]
                  if "peak_rss_bytes" in t and row["peak_rss_bytes"] else float("nan"))
            print(f"| {shape_name} | {name} | {row['median_s']:.3f} | {row['tokens_per_s']:.1f} | {sp:.2f}x | "
                  f"{row['peak_rss_bytes'] / 2**30:.2f} | {rr:.2f} | {100 * row['mfu']:.1f}% |")
        if "tokens_per_s" in t:
            for name, target in (("eager", 1.5), ("compile", 1.2)):
                if "tokens_per_s" in rows.get(name, {}):
                    sp = t["tokens_per_s"] / rows[name]["tokens_per_s"]
                    checks.append((f"{shape_name}: titan / PyTorch {name} tokens/s >= {target}", sp, sp >= target))
            pt = [r["peak_rss_bytes"] for n, r in rows.items() if not n.startswith("titan") and r.get("peak_rss_bytes")]
            if pt:
                rr = t["peak_rss_bytes"] / min(pt)
                checks.append((f"{shape_name}: titan peak RSS / PyTorch (smallest) <= 0.8", rr, rr <= 0.8))
            b = rows.get("titan_bf16", {})
            if "tokens_per_s" in b:
                sp = b["tokens_per_s"] / t["tokens_per_s"]
                checks.append((f"{shape_name}: titan bf16 / titan fp32 tokens/s >= 1.6", sp, sp >= 1.6))
                d = max(abs(x - y) / abs(y) for x, y in zip(b["losses"], t["losses"]))
                checks.append((f"{shape_name}: titan bf16 loss vs fp32 (max rel over the steps) <= 2e-2", d, d <= 2e-2))
            if shape_name == "0.6B-w4":
                checks.append(("0.6B-w4: titan MFU >= 0.70 of the measured f32 GEMM peak", t["mfu"], t["mfu"] >= 0.70))
    print()
    for what, val, ok in checks:
        print(f"- [{'x' if ok else ' '}] {what}: {val:.3g}")
    results["checks"] = [{"target": w, "value": v, "met": ok} for w, v, ok in checks]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
