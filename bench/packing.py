#!/usr/bin/env python3
"""Packed vs padded chat SFT: step time, padding fraction and real (non-padding) tokens per second.

Writes a chat dataset whose conversation lengths (rendered with the Qwen3 template) follow a long-tailed
log-normal law (median --median tokens, sigma --sigma, capped at --seq-len), then trains the same model on
it twice with `titan train`: one conversation per row (padded) and `training.packing = true`. Padding and
conversations per row come from `titan data show` over the whole epoch; step times are the median of the
steps after the first.

  python3 bench/packing.py [--seq-len 2048 --batch 2 --steps 6 --conversations 400 --flavor debug]
"""
import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one "
         "had by word but not what all were we when your can said there use an each which she do how their "
         "if will up other about out many then them these so some her would make like him into time has look "
         "two more write go see number no way could people my than first water been call who oil its now find "
         "long down day did get come made may part model train token data loss step layer weight value").split()


def conversation(rng, tokens):
    """A user turn and an assistant reply of about `tokens` tokens in all (about one token per word)."""
    user = max(4, int(tokens * rng.uniform(0.1, 0.3)))
    reply = max(4, tokens - user - 12)  # the template's markers take about 12 tokens
    say = lambda n: " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."
    return {"messages": [{"role": "user", "content": say(user)}, {"role": "assistant", "content": say(reply)}]}


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "..", "shared", "assets", "qwen3-tokenizer"))
    ap.add_argument("--titan", default=os.path.join(ROOT, "build", "titan"))
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--conversations", type=int, default=400)
    ap.add_argument("--median", type=float, default=300)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--flavor", default="debug")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="titan-packing-")
    data = os.path.join(work, "chats.jsonl")
    targets = [min(args.seq_len, max(24, int(rng.lognormvariate(math.log(args.median), args.sigma))))
               for _ in range(args.conversations)]
    with open(data, "w") as f:
        for t in targets:
            f.write(json.dumps(conversation(rng, t)) + "\n")
    # The lengths as rendered (transformers' apply_chat_template), for the record.
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        with open(data) as f:
            texts = [tok.apply_chat_template(json.loads(l)["messages"], tokenize=False) for l in f]
        lengths = sorted(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
        q = lambda p: lengths[min(len(lengths) - 1, int(p * len(lengths)))]
        print(f"conversation tokens: median {q(0.5)}, p90 {q(0.9)}, p99 {q(0.99)}, max {lengths[-1]} "
              f"(log-normal median {args.median:g}, sigma {args.sigma:g}, capped at seq_len {args.seq_len})")
    except ImportError:
        print("(transformers not installed: rendered lengths not measured)")

    results = {}
    for mode in ("padded", "packed"):
        packing = mode == "packed"
        show = run([args.titan, "data", "show", data, "--tokenizer", args.tokenizer, "--format", "chat",
                    "--seq-len", str(args.seq_len), "--rows", "0"] + (["--packing"] if packing else []))
        m = re.search(r"(\d+) conversations, (\d+) row\(s\) of \d+, (\d+) tokens, (\d+) trained .*"
                      r"padding ([\d.]+)%", show)
        if not m:
            sys.exit("cannot read `titan data show`:\n" + show)
        convs, rows, tokens, trained, padding = (int(m[1]), int(m[2]), int(m[3]), int(m[4]), float(m[5]))
        dump = os.path.join(work, mode)
        run([args.titan, "train", f"--model.flavor={args.flavor}", "--model.vocab_size=151936",
             f"--model.tokenizer_path={args.tokenizer}", f"--training.dataset={data}",
             "--training.dataset_format=chat", f"--training.packing={'true' if packing else 'false'}",
             f"--training.seq_len={args.seq_len}", f"--training.local_batch_size={args.batch}",
             f"--training.steps={args.steps}", "--training.val_fraction=0", "--validation.enable=false",
             "--training.sample_tokens=0", "--lr_scheduler.warmup_steps=1", "--job.print_config=false",
             "--checkpoint.enable=false", f"--job.dump_folder={dump}"])
        with open(os.path.join(dump, "metrics.jsonl")) as f:
            steps = [json.loads(l) for l in f]
        step_s = statistics.median(s["time_s"] for s in steps[1:])
        positions = args.batch * args.seq_len
        results[mode] = dict(step_s=step_s, padding=padding / 100, conv_per_row=convs / rows,
                             real_tps=positions * (1 - padding / 100) / step_s,
                             trained_tps=positions * trained / (rows * args.seq_len) / step_s,
                             conv_per_s=args.batch * convs / rows / step_s,
                             loss=[round(s["loss"], 4) for s in steps])
    print(f"titan {args.flavor}, seq_len {args.seq_len}, local batch {args.batch}, {os.cpu_count()} CPUs")
    print("| mode | step (s) | padding | conversations / row | real tokens/s | trained tokens/s | conversations/s |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['step_s']:.3f} | {100 * r['padding']:.1f}% | {r['conv_per_row']:.2f} | "
              f"{r['real_tps']:.0f} | {r['trained_tps']:.0f} | {r['conv_per_s']:.2f} |")
    p, u = results["packed"], results["padded"]
    print(f"packed / padded: real tokens/s {p['real_tps'] / u['real_tps']:.2f}x, "
          f"conversations/s {p['conv_per_s'] / u['conv_per_s']:.2f}x")


if __name__ == "__main__":
    main()
