"""Tokenizer benchmark: titan vs HF `tokenizers` on the same >= 20 MB mixed-language corpus, one run.

  python bench/tokenizer/run_bench.py --titan build/titan [--tokenizer ../shared/assets/qwen3-tokenizer]

Builds the corpus (seeded; not committed) from fortunes (English prose), Python stdlib sources (code)
and synthetic multilingual text (CJK, Cyrillic, Arabic, Devanagari, Greek, Hangul, accented Latin,
digits, emoji), split into 1-8 KB documents, written as JSONL. Then measures, median of --runs:
  titan: load time, encode MB/s single-threaded and with all OpenMP threads (`titan tokenizer bench`)
  HF:    load time, `encode` per document (single thread) and `encode_batch` (all threads)
and checks that both produce identical ids.
"""
import argparse
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import sysconfig
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "golden"))
from tokenizer_strings import PROSE, CODE, EMOJI  # noqa: E402

SCRIPTS = {
    "zh": [chr(c) for c in range(0x4E00, 0x4E00 + 3000)],
    "ja": [chr(c) for c in range(0x3041, 0x3097)] + [chr(c) for c in range(0x30A1, 0x30FB)],
    "ru": list("абвгдеёжзийклмнопрстуфхцчшщъыьэюя"),
    "ar": [chr(c) for c in range(0x0621, 0x064B)],
    "hi": [chr(c) for c in range(0x0905, 0x0939)] + ["ा", "ि", "ी", "ु", "े", "ो", "्"],
    "el": list("αβγδεζηθικλμνξοπρστυφχψωάέήίόύώ"),
    "ko": [chr(c) for c in range(0xAC00, 0xAC00 + 2000)],
    "la": list("abcdefghijklmnopqrstuvwxyzéèêëàâäôöüùçñßøå"),
}


def synthetic(rng, n_bytes):
    out, size = [], 0
    while size < n_bytes:
        lang = rng.choice(list(SCRIPTS))
        alphabet = SCRIPTS[lang]
        words = []
        for _ in range(rng.randint(5, 40)):
            k = rng.randint(1, 4) if lang in ("zh", "ja", "ko") else rng.randint(2, 10)
            w = "".join(rng.choice(alphabet) for _ in range(k))
            if lang in ("la", "ru", "el") and rng.random() < 0.1:
                w = w.capitalize()
            words.append(w)
            r = rng.random()
            if r < 0.05:
                words.append(str(rng.randint(0, 10 ** rng.randint(1, 7))))
            elif r < 0.07:
                words.append(rng.choice(EMOJI))
        sep = "" if lang in ("zh", "ja") else " "
        s = sep.join(words) + rng.choice([".", "。", "!", "?", ",", "؟", "।"]) + rng.choice([" ", "\n", "\n\n"])
        if rng.random() < 0.1:
            s += rng.choice(PROSE) + " "
        out.append(s)
        size += len(s.encode())
    return "".join(out)


def make_corpus(path, target_mb, seed=7):
    rng = random.Random(seed)
    parts = []
    for f in sorted(glob.glob("/usr/share/games/fortunes/*")):
        if f.endswith(".dat") or os.path.isdir(f):
            continue
        try:
            parts.append(open(f, encoding="utf-8", errors="replace").read())
        except OSError:
            pass
    english = "".join(parts) or " ".join(PROSE) * 2000
    code_files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    code, size = [], 0
    for f in code_files:
        t = open(f, encoding="utf-8", errors="replace").read()
        code.append(t)
        size += len(t)
        if size > target_mb * 0.35e6:
            break
    code = "".join(code) or "\n".join(CODE) * 5000
    multi = synthetic(rng, int(target_mb * 0.45e6))
    docs = []
    for text in (english, code, multi):
        i = 0
        while i < len(text):
            n = rng.randint(1000, 8000)
            docs.append(text[i:i + n])
            i += n
    rng.shuffle(docs)
    total = 0
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
            total += len(d.encode())
    while total < target_mb * 1e6:  # top up with more synthetic text
        with open(path, "a", encoding="utf-8") as f:
            d = synthetic(rng, 4000)
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
            total += len(d.encode())
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--titan", default=os.path.join(ROOT, "build", "titan"))
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "..", "shared", "assets", "qwen3-tokenizer"))
    ap.add_argument("--corpus", default="/tmp/titan_tokenizer_corpus.jsonl")
    ap.add_argument("--mb", type=float, default=21)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    if not os.path.exists(args.corpus):
        make_corpus(args.corpus, args.mb)
    docs = [json.loads(l) for l in open(args.corpus, encoding="utf-8")]
    nbytes = sum(len(d.encode()) for d in docs)
    print(f"corpus: {len(docs)} documents, {nbytes / 1e6:.1f} MB ({args.corpus})")

    out = subprocess.run([args.titan, "tokenizer", "bench", "--tokenizer", args.tokenizer, "--input", args.corpus,
                          "--runs", str(args.runs)], check=True, capture_output=True, text=True).stdout
    ours = json.loads(out.strip().splitlines()[-1])

    from tokenizers import Tokenizer
    path = args.tokenizer
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    load, single, batch = [], [], []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        tok = Tokenizer.from_file(path)
        load.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ids_single = [tok.encode(d, add_special_tokens=False).ids for d in docs]
        single.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        encs = tok.encode_batch(docs, add_special_tokens=False)
        batch.append(time.perf_counter() - t0)
    hf_tokens = sum(len(e.ids) for e in encs)
    assert hf_tokens == ours["tokens"], f"token counts differ: HF {hf_tokens}, titan {ours['tokens']}"
    # Spot-check identical ids through the CLI on a sample of documents.
    sample = docs[:: max(1, len(docs) // 200)]
    enc = subprocess.run([args.titan, "tokenizer", "encode", "--tokenizer", args.tokenizer], check=True,
                         input="".join(json.dumps(d) + "\n" for d in sample), capture_output=True, text=True).stdout
    got = [json.loads(l) for l in enc.splitlines()]
    want = [ids_single[docs.index(d)] for d in sample]
    assert got == want, "titan and HF ids differ"

    hf = {"load_s": statistics.median(load), "single_mb_s": nbytes / 1e6 / statistics.median(single),
          "batch_mb_s": nbytes / 1e6 / statistics.median(batch)}
    print(f"threads: titan OpenMP {ours['threads']}, HF encode_batch (rayon) {os.cpu_count()} cores")
    print(f"{'':24}{'titan':>10}{'HF':>10}{'ratio':>8}")
    print(f"{'load (s)':24}{ours['load_s']:10.3f}{hf['load_s']:10.3f}{hf['load_s'] / ours['load_s']:7.1f}x")
    print(f"{'encode 1 thread (MB/s)':24}{ours['single_mb_s']:10.2f}{hf['single_mb_s']:10.2f}"
          f"{ours['single_mb_s'] / hf['single_mb_s']:7.1f}x")
    print(f"{'encode all (MB/s)':24}{ours['parallel_mb_s']:10.2f}{hf['batch_mb_s']:10.2f}"
          f"{ours['parallel_mb_s'] / hf['batch_mb_s']:7.1f}x")
    print(f"tokens: {ours['tokens']} (identical to HF), medians of {args.runs} runs")


if __name__ == "__main__":
    main()
