#!/usr/bin/env python3
"""Time one LoRA training step of PEFT + transformers (the side-by-side for bench_lora_step).

A step: zero_grad, forward with labels (HF causal-LM loss), backward, clip_grad_norm_(1.0), AdamW on the
adapter parameters (base frozen). The base model is randomly initialised from a Qwen3 flavor shape (no
downloads), LoRA on all linear projections (q,k,v,o,gate,up,down), activation checkpointing optional
(gradient_checkpointing_enable with use_reentrant=False, PEFT's recommended setting).

--base-dtype f32 (PEFT's usual CPU setup) or bf16 (base weights in bf16; adapters and compute follow the
base dtype for the LoRA matmuls under PEFT's autocast rules).

stdout: one JSON line per step, then a summary with the peak resident set (VmHWM) of this process.

  python bench/peft_lora_step.py --flavor 4B --layers 36 --seq 1024 --rank 16 --steps 3 --warmup 1 --ac
"""

import argparse
import json
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

FLAVORS = {  # hidden, intermediate, layers, heads, kv heads (head_dim 128, vocab 151936, tied)
    "0.6B": (1024, 3072, 28, 16, 8),
    "1.7B": (2048, 6144, 28, 16, 8),
    "4B": (2560, 9728, 36, 32, 8),
}


def vm(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="4B", choices=sorted(FLAVORS))
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ac", action="store_true")
    ap.add_argument("--base-dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    H, I, L, nH, nKV = FLAVORS[a.flavor]
    cfg = Qwen3Config(vocab_size=151936, hidden_size=H, intermediate_size=I, num_hidden_layers=a.layers or L,
                      num_attention_heads=nH, num_key_value_heads=nKV, head_dim=128, tie_word_embeddings=True,
                      max_position_embeddings=40960)
    dtype = torch.bfloat16 if a.base_dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    model.config.use_cache = False
    if a.ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    pm = get_peft_model(model, LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"]))
    pm.train()
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))
    rss_load = vm("VmRSS:")
    times = []
    for s in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        if s >= a.warmup:
            times.append(dt)
        print(json.dumps({"step": s, "loss": loss.item(), "time_s": round(dt, 3),
                          "tokens_per_s": round(a.batch * a.seq / dt, 1), "warmup": s < a.warmup}), flush=True)
    med = statistics.median(times) if times else 0
    print(json.dumps({"summary": True, "framework": "peft", "peft_base": a.base_dtype, "layers": cfg.num_hidden_layers,
                      "hidden": H, "lora_params": sum(p.numel() for p in params), "rank": a.rank, "seq": a.seq,
                      "batch": a.batch, "ac": a.ac, "threads": torch.get_num_threads(),
                      "median_step_s": round(med, 3), "median_tokens_per_s": round(a.batch * a.seq / med, 1) if med else 0,
                      "rss_after_load_gib": round(rss_load / 2**30, 3), "peak_rss_gib": round(vm("VmHWM:") / 2**30, 3)}))


if __name__ == "__main__":
    main()
