#!/usr/bin/env python3
"""Side-by-side training-step benchmark: titan (bench_train_step) vs PyTorch eager (HF Qwen3ForCausalLM
+ torch.optim.AdamW), same shape, same thread count, interleaved round by round on the same machine.

Each round runs titan then PyTorch as fresh processes (1 warm-up step + --steps measured steps each);
the report gives the median step time over all measured steps of each implementation and the ratio.

  python3 bench/compare_train_step.py --threads 2 --rounds 3 --steps 2
  python3 bench/compare_train_step.py --hidden 256 --layers 4 --heads 8 --kv-heads 4 --head-dim 32 \
      --intermediate 768 --vocab 2048 --seq 256          # the debug flavor
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(cmd, env):
    out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    steps, summary = [], None
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if rec.get("summary"):
            summary = rec
        else:
            steps.append(rec["seconds"])
    return steps, summary


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="measured steps per round and implementation")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    shape = {"hidden": 1024, "layers": 4, "heads": 16, "kv-heads": 8, "head-dim": 128, "intermediate": 3072,
             "vocab": 151936, "seq": 512, "batch": 1}
    for k, v in shape.items():
        ap.add_argument("--" + k, type=int, default=v)
    args = ap.parse_args()
    shape_args = []
    for k in shape:
        shape_args += ["--" + k, str(getattr(args, k.replace("-", "_")))]

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    titan_cmd = [os.path.join(args.build, "bench_train_step"), *shape_args, "--steps", str(args.steps),
                 "--warmup", "1"]
    torch_cmd = [sys.executable, os.path.join(HERE, "pytorch_train_step.py"), *shape_args, "--steps",
                 str(args.steps), "--warmup", "1", "--threads", str(args.threads), "--max-norm", "1.0"]
    times = {"titan": [], "pytorch": []}
    peak = {}
    for r in range(args.rounds):
        for name, cmd in (("titan", titan_cmd), ("pytorch", torch_cmd)):
            steps, summary = run(cmd, env)
            times[name] += steps
            if summary:
                peak[name] = summary
            print(f"round {r}: {name:8s} " + " ".join(f"{s:.3f}s" for s in steps), file=sys.stderr, flush=True)
    tokens = args.seq * args.batch
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "shape": shape_args, "threads": args.threads, "rounds": args.rounds,
        "titan_median_s": med["titan"], "pytorch_median_s": med["pytorch"],
        "titan_tokens_per_s": tokens / med["titan"], "pytorch_tokens_per_s": tokens / med["pytorch"],
        "speedup": med["pytorch"] / med["titan"], "titan_steps": times["titan"], "pytorch_steps": times["pytorch"],
    }
    print(json.dumps(result))
    print(f"\n| impl | median step (s) | tokens/s |\n|---|---|---|\n"
          f"| titan | {med['titan']:.3f} | {tokens / med['titan']:.1f} |\n"
          f"| PyTorch eager | {med['pytorch']:.3f} | {tokens / med['pytorch']:.1f} |\n"
          f"\nspeedup titan / PyTorch: {med['pytorch'] / med['titan']:.2f}x "
          f"({len(times['titan'])} + {len(times['pytorch'])} measured steps, {args.threads} threads)")


if __name__ == "__main__":
    main()
