#!/usr/bin/env python3
"""Side by side: one LoRA training step of titan (bench_lora_step) and of PEFT + transformers
(bench/peft_lora_step.py) on the same machine, run one after the other with the same shape and threads.
Prints both summaries and the titan/PEFT ratios (tokens/s, peak RSS).

  python bench/compare_lora.py --flavor 4B --seq 1024 --rank 16 --steps 1 --warmup 1 --threads 2 \
      [--peft-layers 18] [--peft-base f32|bf16] [--titan-base bf16|f32]
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def summary(cmd, env):
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    for l in lines:
        print("  " + l, flush=True)
    if p.returncode != 0:
        print(p.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="4B")
    ap.add_argument("--layers", type=int, default=0, help="titan layers (0: the flavor's)")
    ap.add_argument("--peft-layers", type=int, default=0, help="PEFT layers (0: same as titan)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--titan-base", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--peft-base", choices=["bf16", "f32"], default="f32")
    ap.add_argument("--skip-peft", action="store_true")
    a = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    common = ["--flavor", a.flavor, "--seq", str(a.seq), "--rank", str(a.rank), "--steps", str(a.steps),
              "--warmup", str(a.warmup)]
    t = summary([os.path.join(REPO, "build", "bench_lora_step")] + common +
                ["--layers", str(a.layers), "--ac", "1", "--bf16-base", "1" if a.titan_base == "bf16" else "0"], env)
    if a.skip_peft:
        return
    p = summary([sys.executable, os.path.join(HERE, "peft_lora_step.py")] + common +
                ["--layers", str(a.peft_layers or a.layers), "--ac", "--base-dtype", a.peft_base,
                 "--threads", str(a.threads)], env)
    if t and p:
        same = t["layers"] == p["layers"]
        print(json.dumps({"titan_tokens_per_s": t["median_tokens_per_s"], "peft_tokens_per_s": p["median_tokens_per_s"],
                          "speed_ratio_titan_over_peft": round(t["median_tokens_per_s"] / p["median_tokens_per_s"], 3)
                          if same else None,
                          "titan_peak_rss_gib": t["peak_rss_gib"], "peft_peak_rss_gib": p["peak_rss_gib"],
                          "same_shape": same}))


if __name__ == "__main__":
    main()
