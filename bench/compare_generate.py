"""Greedy generation speed: titan's KV-cache generator (bench_generate) vs HF transformers generate, same
model directory, same prompt, same thread count, one run each after the other on this machine.

The model: a randomly initialised Qwen3 of the 0.6B shape cut to --layers layers (H 1024, 16/8 heads,
head_dim 128, I 3072, vocab 151936, tied), saved once under --dir. Prompt: --prompt random ids.
Reports medians over --repeats: prefill seconds and decode tokens/s (tokens after the first / time after
the first), and the ratio titan / HF. Greedy ids are compared too (a random model's top-2 margins can be
tiny, so a late divergence is float noise, not a bug; the fixture tests prove greedy equality).

  python bench/compare_generate.py [--layers 4 --prompt 128 --new 64 --repeats 3 --threads 2 --dtype f32]
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def make_model(d, layers):
    if os.path.exists(os.path.join(d, "model.safetensors")):
        return
    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True,
                      rms_norm_eps=1e-6)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(d)


def hf_run(d, prompt, new, repeats, dtype):
    model = Qwen3ForCausalLM.from_pretrained(d, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
                                             attn_implementation="sdpa").eval()
    x = torch.tensor([prompt])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(x))
    res = []
    with torch.no_grad():
        model.generate(x, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
            t1 = time.perf_counter()
            out = model.generate(x, max_new_tokens=new, min_new_tokens=new, **kw)
            t2 = time.perf_counter()
            prefill = t1 - t0
            res.append(dict(prefill_s=prefill, decode_tok_s=(new - 1) / ((t2 - t1) - prefill),
                            ids=out[0, len(prompt):].tolist()))
    return res


def titan_run(d, prompt, new, repeats, dtype, threads):
    exe = os.path.join(ROOT, "build", "bench_generate")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([exe, "--model", d, "--prompt-ids", ",".join(map(str, prompt)), "--new", str(new),
                          "--repeats", str(repeats + 1), "--dtype", dtype], env=env, check=True,
                         capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")][1:]  # first: warm-up


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--dir", default="/tmp/titan_bench_generate")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    d = f"{a.dir}_{a.layers}l"
    make_model(d, a.layers)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 151936, (a.prompt,), generator=g).tolist()
    t = titan_run(d, prompt, a.new, a.repeats, a.dtype, a.threads)
    h = hf_run(d, prompt, a.new, a.repeats, a.dtype)
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    same = next((i for i, (x, y) in enumerate(zip(t[0]["ids"], h[0]["ids"])) if x != y), len(t[0]["ids"]))
    print(f"model: 0.6B shape, {a.layers} layers, {a.dtype}; prompt {a.prompt}, new {a.new}, threads {a.threads}, "
          f"median of {a.repeats}")
    print(f"{'':8} {'prefill s':>10} {'decode tok/s':>13}")
    print(f"{'titan':8} {med(t, 'prefill_s'):10.4f} {med(t, 'decode_tok_s'):13.2f}")
    print(f"{'HF':8} {med(h, 'prefill_s'):10.4f} {med(h, 'decode_tok_s'):13.2f}")
    print(f"ratio titan/HF: prefill speed {med(h, 'prefill_s') / med(t, 'prefill_s'):.2f}x, "
          f"decode speed {med(t, 'decode_tok_s') / med(h, 'decode_tok_s'):.2f}x; "
          f"greedy ids identical for the first {same} of {a.new}")


if __name__ == "__main__":
    main()
