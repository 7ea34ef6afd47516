"""Makes the tokenizer fixtures in tests/golden/tokenizer/ with HF `tokenizers` (pip install tokenizers).

  python tools/golden/make_tokenizer_golden.py --titan build/titan

1. qwen3_cases.jsonl: 5,000+ strings (tokenizer_strings.py, seeded) with the ids and decode of the
   real Qwen3 tokenizer (../shared/assets/qwen3-tokenizer beside the repo; not committed).
2. small/tokenizer.json: trained by `titan tokenizer train` on small/train.txt; small/cases.jsonl
   holds HF's ids for strings encoded with it.
3. variants/<name>.json + variants/<name>.jsonl: the small tokenizer with other components
   (GPT-2 ByteLevel regex, prefix space, Llama-3 style template and ignore_merges, normalizers,
   added-token flags) and HF's ids, so a fresh clone exercises each code path.
Each JSONL line: {"text": s, "ids": [...], "ids_special": [...] (only when it differs),
"decoded": s' (only when it differs from text), "decoded_skip": s'' (only when it differs from decoded)}.
"""
import argparse
import copy
import json
import os
import subprocess
import sys

from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tokenizer_strings import make_strings  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "golden", "tokenizer")


def cases(tok, strings):
    lines = []
    for s in strings:
        ids = tok.encode(s, add_special_tokens=False).ids
        rec = {"text": s, "ids": ids}
        ids_special = tok.encode(s, add_special_tokens=True).ids
        if ids_special != ids:
            rec["ids_special"] = ids_special
        d = tok.decode(ids, skip_special_tokens=False)
        if d != s:
            rec["decoded"] = d
        ds = tok.decode(ids, skip_special_tokens=True)
        if ds != d:
            rec["decoded_skip"] = ds
        lines.append(json.dumps(rec, ensure_ascii=False))
    return "\n".join(lines) + "\n"


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    print("wrote", os.path.relpath(path, ROOT), len(text.encode()), "bytes")


def variants(base):
    """Small-tokenizer variants, each exercising components the Qwen pipeline does not."""
    v = {}
    gpt2 = copy.deepcopy(base)
    gpt2["normalizer"] = None
    gpt2["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    gpt2["post_processor"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    gpt2["model"]["merges"] = [" ".join(m) for m in gpt2["model"]["merges"]]  # the older "a b" merge form
    v["gpt2"] = gpt2

    prefix = copy.deepcopy(gpt2)
    prefix["model"]["merges"] = base["model"]["merges"]
    prefix["pre_tokenizer"]["add_prefix_space"] = True
    prefix["post_processor"] = {"type": "RobertaProcessing", "sep": ["<|endoftext|>", base["added_tokens"][0]["id"]],
                                "cls": ["<|endoftext|>", base["added_tokens"][0]["id"]], "trim_offsets": True,
                                "add_prefix_space": True}
    v["prefix_space_roberta"] = prefix

    llama = copy.deepcopy(base)
    llama["normalizer"] = None
    llama["model"]["ignore_merges"] = True
    bos = base["added_tokens"][0]
    llama["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": bos["content"], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {bos["content"]: {"id": bos["content"], "ids": [bos["id"]], "tokens": [bos["content"]]}}}]}
    llama["model"]["merges"] = [m.split(" ") if isinstance(m, str) else m for m in llama["model"]["merges"]]
    v["llama3_style"] = llama

    norm = copy.deepcopy(base)
    norm["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"},
                                                              {"type": "Replace", "pattern": {"String": "``"},
                                                               "content": "\""}]}
    norm["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithNext", "invert": False},
        {"type": "Digits", "individual_digits": False},
        {"type": "Split", "pattern": {"Regex": "[.,!?]"}, "behavior": "Removed", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    v["normalizers_splits"] = norm

    splits = copy.deepcopy(base)
    splits["normalizer"] = {"type": "NFD"}
    splits["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "MergedWithPrevious", "invert": False},
        {"type": "Split", "pattern": {"Regex": "\\p{P}"}, "behavior": "Contiguous", "invert": False},
        {"type": "Split", "pattern": {"Regex": "[a-z]+"}, "behavior": "Isolated", "invert": True},
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    v["splits_nfd"] = splits

    added = copy.deepcopy(base)
    n = max(t["id"] for t in added["added_tokens"]) + 1
    extra = [("<mask>", dict(lstrip=True, rstrip=False, single_word=False, normalized=False, special=True)),
             ("[SEP]", dict(lstrip=False, rstrip=True, single_word=False, normalized=False, special=True)),
             ("cat", dict(lstrip=False, rstrip=False, single_word=True, normalized=True, special=False)),
             ("Ünï", dict(lstrip=False, rstrip=False, single_word=False, normalized=True, special=False)),
             ("dog", dict(lstrip=True, rstrip=True, single_word=True, normalized=False, special=False)),
             ("<tag>", dict(lstrip=False, rstrip=False, single_word=False, normalized=False, special=False)),
             ("<tag>x", dict(lstrip=False, rstrip=False, single_word=False, normalized=False, special=True))]
    for i, (content, flags) in enumerate(extra):
        added["added_tokens"].append(dict(id=n + i, content=content, **flags))
    added["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]}
    v["added_flags"] = added
    return v


def variant_strings(seed):
    extra = ["a <mask> b", "a   <mask>b", "x[SEP]   y", "[SEP]\n\nz", "cat", "a cat!", "concat", "cats", "cat_x",
             "_cat", "CAT", "Cat cat", "ÜNÏ", "ünï", "Ünï", "dog", "  dog  ", "hotdog", "dog.", "<tag>", "<tag>x",
             "<tag>xy", "<mask><mask>", "  <mask>  <mask>  ", "``quoted''", "The END, 1234 and 5.6!", "İI", "ΣΑΣ"]
    return extra + make_strings(300, seed, with_special=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qwen", default=os.path.join(ROOT, "..", "shared", "assets", "qwen3-tokenizer", "tokenizer.json"))
    ap.add_argument("--titan", default=os.path.join(ROOT, "build", "titan"))
    ap.add_argument("--count", type=int, default=5200)
    ap.add_argument("--skip-qwen", action="store_true")
    ap.add_argument("--skip-small", action="store_true")
    args = ap.parse_args()

    if not args.skip_qwen:
        tok = Tokenizer.from_file(args.qwen)
        write(os.path.join(OUT, "qwen3_cases.jsonl"), cases(tok, make_strings(args.count, seed=1234)))

    if not args.skip_small:
        small = os.path.join(OUT, "small")
        subprocess.run([args.titan, "tokenizer", "train", "--input", os.path.join(small, "train.txt"),
                        "--vocab-size", "600", "--special-tokens", "<|endoftext|>", "<|im_start|>", "<|im_end|>",
                        "--output", os.path.join(small, "tokenizer.json")], check=True)
        tok = Tokenizer.from_file(os.path.join(small, "tokenizer.json"))
        write(os.path.join(small, "cases.jsonl"), cases(tok, make_strings(800, seed=99)))
        with open(os.path.join(small, "tokenizer.json"), encoding="utf-8") as f:
            base = json.load(f)
        for name, spec in variants(base).items():
            text = json.dumps(spec, ensure_ascii=False)
            write(os.path.join(OUT, "variants", name + ".json"), text)
            tok = Tokenizer.from_str(text)
            write(os.path.join(OUT, "variants", name + ".jsonl"), cases(tok, variant_strings(len(name))))


if __name__ == "__main__":
    main()
