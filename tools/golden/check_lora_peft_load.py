#!/usr/bin/env python3
"""Check that PEFT loads an adapter written by titan and computes titan's logits.

Builds a tiny random HF Qwen3 with transformers (or uses --base), trains LoRA adapters on it with
`titan train` ([lora], f32 base), loads the final checkpoint directory with
peft.PeftModel.from_pretrained, and compares PEFT's logits with `titan forward --lora` on the same ids;
then merges with PEFT (merge_and_unload) and with `titan convert --merge-lora` and compares the weights.

  python tools/golden/check_lora_peft_load.py --titan build/titan
"""

import argparse
import json
import os
import subprocess
import tempfile

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--titan", default=os.path.join(REPO, "build", "titan"))
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="titan-peft-")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    base = Qwen3ForCausalLM(cfg).float()
    base.save_pretrained(os.path.join(tmp, "base"))
    with open(os.path.join(tmp, "corpus.txt"), "w") as f:
        for i in range(200):
            f.write(f"the quick brown fox {i} jumps over the lazy dog.\n%\n")
    run = [a.titan, "train", "--job.dump_folder=" + os.path.join(tmp, "run"),
           "--training.dataset=" + os.path.join(tmp, "corpus.txt"),
           "--model.hf_assets_path=" + os.path.join(tmp, "base"),
           "--model.tokenizer_path=" + os.path.join(REPO, "tests/golden/tokenizer/small"),
           "--checkpoint.initial_load_path=" + os.path.join(tmp, "base"),
           "--training.seq_len=32", "--training.local_batch_size=2", "--training.steps=5",
           "--training.sample_tokens=0", "--optimizer.lr=3e-2", "--metrics.peak_tflops=1",
           "--lora.enable=true", "--lora.rank=4", "--lora.alpha=8", "--lora.base_dtype=float32"]
    subprocess.run(run, check=True, stdout=subprocess.DEVNULL)
    adapter = os.path.join(tmp, "run", "checkpoint", "step-5")
    ids = torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(1))
    with open(os.path.join(tmp, "in.json"), "w") as f:
        json.dump({"input_ids": ids.tolist()}, f)
    subprocess.run([a.titan, "forward", "--model", os.path.join(tmp, "base"), "--input", os.path.join(tmp, "in.json"),
                    "--output", os.path.join(tmp, "out.safetensors"), "--lora", adapter], check=True,
                   stdout=subprocess.DEVNULL)
    titan_logits = load_file(os.path.join(tmp, "out.safetensors"))["logits"]

    pm = PeftModel.from_pretrained(Qwen3ForCausalLM.from_pretrained(os.path.join(tmp, "base")), adapter)
    pm.eval()
    with torch.no_grad():
        peft_logits = pm(input_ids=ids).logits
        with pm.disable_adapter():
            base_logits = pm(input_ids=ids).logits
    moved = float((peft_logits - base_logits).norm() / base_logits.norm())
    print(f"the trained adapter moves the logits by {moved:.2e} (relative)")
    assert moved > 1e-4, moved
    rel = float((titan_logits - peft_logits).norm() / peft_logits.norm())
    print(f"PEFT loaded {adapter}: logits relative difference to titan forward --lora = {rel:.2e}")
    assert rel <= 1e-5, rel

    merged = pm.merge_and_unload().state_dict()
    subprocess.run([a.titan, "convert", "--input", os.path.join(tmp, "base"), "--output", os.path.join(tmp, "merged"),
                    "--merge-lora", adapter], check=True, stdout=subprocess.DEVNULL)
    ours = load_file(os.path.join(tmp, "merged", "model.safetensors"))
    worst = max(float((ours[k] - merged[k]).norm() / merged[k].norm()) for k in ours)
    print(f"titan convert --merge-lora vs PEFT merge_and_unload: worst tensor relative difference {worst:.2e}")
    assert worst <= 1e-6, worst
    print("ok")


if __name__ == "__main__":
    main()
