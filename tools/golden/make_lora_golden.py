#!/usr/bin/env python3
"""Generate golden fixtures for titan.cpp's LoRA (HF PEFT semantics).

Each case is a tiny random HF Qwen3 / Qwen3-MoE (fp32, eager attention) with a PEFT LoRA adapter whose
B matrices are random (PEFT initialises B = 0, which would make every gradient of A zero), saved with
PeftModel.save_pretrained, next to the references:

  tests/golden/lora/<case>/
    config.json, model.safetensors      the frozen base (HF layout)
    adapter/adapter_config.json,
    adapter/adapter_model.safetensors   the PEFT adapter (keys base_model.model.model.layers.N....lora_A.weight)
    input.json                          {"input_ids": [[...]], "labels": [[...]]}
    meta.json                           LoRA and optimizer settings, versions
    expected.safetensors                float32:
      logits [B,T,V], loss []           PeftModel (train mode, dropout 0) on the batch
      grad.<peft key>                   gradient of every adapter tensor (base frozen: requires_grad False)
      losses [steps], param.<peft key>  AdamW (clip_grad_norm_) on the adapter tensors only
      merged.<hf name>                  merge_and_unload() of the initial adapter: every adapted base weight
    expected_f64.safetensors            param.<peft key> of the same steps run in float64 (float64_truth.py)

Usage: python tools/golden/make_lora_golden.py [--out tests/golden/lora] [--case NAME ...]
"""

import argparse
import json
import os
import shutil

import peft
import safetensors
import safetensors.torch
import torch
import transformers
from float64_truth import Float64Mode
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict

import make_qwen3_golden as dense
import make_qwen3_moe_golden as moe

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEFAULT_OUT = os.path.join(REPO_ROOT, "tests", "golden", "lora")
STEPS = 5
BETAS = (0.9, 0.999)
EPS = 1e-8
B_STD = 0.2  # random lora_B so that the gradients of lora_A are not zero
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

CASES = [
    dict(kind="dense", name="dense_all_linear", seed=7101, r=4, alpha=8, targets=ALL,
         model=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                    rope_theta=1e4, rms_norm_eps=1e-6),
         batch=2, seq=8, lr=1e-2, weight_decay=0.1, max_norm=1.0),
    dict(kind="dense", name="dense_tied_qv", seed=7202, r=2, alpha=16, targets=["q_proj", "v_proj", "down_proj"],
         model=dict(vocab_size=96, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                    rope_theta=1e6, rms_norm_eps=1e-5),
         batch=2, seq=10, lr=2e-2, weight_decay=0.0, max_norm=1e3),
    # PEFT (with transformers v5) moves MLP targets of a MoE model onto the fused experts
    # (target_parameters); titan adapts attention only there, so the MoE case targets attention.
    dict(kind="moe", name="moe_attention", seed=7303, r=4, alpha=4, targets=["q_proj", "k_proj", "v_proj", "o_proj"],
         model=dict(moe.BASE, vocab_size=96, num_hidden_layers=2, num_experts=4, seq=8),
         batch=2, seq=8, lr=1e-2, weight_decay=0.1, max_norm=1.0),
]


def model_case(c, seed):
    m = dict(c["model"], seed=seed, batch=c["batch"], seq=c["seq"])
    return m


def make_base(c, seed):
    m = model_case(c, seed)
    if c["kind"] == "dense":
        return dense.make_model(m)
    return moe.make_model(m, seed)


def make_inputs(c, seed):
    m = model_case(c, seed)
    return dense.make_inputs(m) if c["kind"] == "dense" else moe.make_inputs(m, seed)


def lora_config(c):
    return LoraConfig(r=c["r"], lora_alpha=c["alpha"], lora_dropout=0.0, target_modules=list(c["targets"]),
                      task_type="CAUSAL_LM")


def saved_name(n):
    return n.replace(".default", "")


def trainable(pm):
    return [(saved_name(n), p) for n, p in pm.named_parameters() if p.requires_grad]


def min_topk_gap(res, k):
    gaps = [1.0]
    for rl in getattr(res, "router_logits", None) or ():
        p = torch.softmax(rl.detach().double(), dim=-1).sort(dim=-1, descending=True).values
        gaps.append(float((p[:, k - 1] - p[:, k]).min()))
    return min(gaps)


def load_peft(c, seed, base_state, adapter_dir, dtype=torch.float32, adapter_state=None):
    base = make_base(c, seed)
    if dtype == torch.float64 and c["kind"] == "moe":
        base.set_experts_implementation("eager")  # grouped_mm has no float64
    base.to(dtype)
    base.load_state_dict({k: v.to(dtype) for k, v in base_state.items()})
    if adapter_state is None:
        pm = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    else:  # inside Float64Mode (safetensors' loader cannot run there): the tensors read beforehand
        pm = get_peft_model(base, lora_config(c))
        res = set_peft_model_state_dict(pm, {k: v.to(dtype) for k, v in adapter_state.items()})
        assert not res.unexpected_keys, res.unexpected_keys
        assert not [k for k in res.missing_keys if "lora_" in k], res.missing_keys
    pm.to(dtype)
    for n, p in pm.named_parameters():
        assert p.dtype == dtype, n
        assert p.requires_grad == ("lora_" in n), n
    pm.train()
    return pm


def compute_expected(c, seed, base_state, adapter_dir, ids, labels):
    out, gaps = {}, []
    k = c["model"].get("num_experts_per_tok", 0)
    pm = load_peft(c, seed, base_state, adapter_dir)
    res = pm(input_ids=ids, labels=labels)
    res.loss.backward()
    if k:
        gaps.append(min_topk_gap(res, k))
    out["logits"] = res.logits.detach().float().contiguous()
    out["loss"] = res.loss.detach().float().reshape(())
    for n, p in trainable(pm):
        out["grad." + n] = p.grad.detach().float().contiguous()

    pm = load_peft(c, seed, base_state, adapter_dir)
    params = [p for _, p in trainable(pm)]
    opt = torch.optim.AdamW(params, lr=c["lr"], betas=BETAS, eps=EPS, weight_decay=c["weight_decay"])
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        res = pm(input_ids=ids, labels=labels)
        if k:
            gaps.append(min_topk_gap(res, k))
        losses.append(res.loss.item())
        res.loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, c["max_norm"])))
        opt.step()
    out["losses"] = torch.tensor(losses, dtype=torch.float32)
    for n, p in trainable(pm):
        out["param." + n] = p.detach().float().contiguous()

    pm = load_peft(c, seed, base_state, adapter_dir)
    merged = pm.merge_and_unload()
    adapted = {n.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
               for n in out if n.startswith("grad.") for n in [n[5:]] if ".lora_A." in n}
    for n, p in merged.named_parameters():
        if n in adapted:
            out["merged." + n] = p.detach().float().contiguous()
    assert len([k for k in out if k.startswith("merged.")]) == len(adapted)
    return out, norms, min(gaps) if gaps else 1.0


def float64_params(c, seed, base_state, adapter_dir, ids, labels):
    adapter_state = safetensors.torch.load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    with Float64Mode():
        pm = load_peft(c, seed, base_state, adapter_dir, torch.float64, adapter_state)
        for n, p in trainable(pm):
            assert torch.equal(p.detach(), adapter_state[n].double()), n
        params = [p for _, p in trainable(pm)]
        opt = torch.optim.AdamW(params, lr=c["lr"], betas=BETAS, eps=EPS, weight_decay=c["weight_decay"])
        for _ in range(STEPS):
            opt.zero_grad()
            loss = pm(input_ids=ids, labels=labels).loss
            assert loss.dtype == torch.float64
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, c["max_norm"])
            opt.step()
    return {"param." + n: p.detach().contiguous() for n, p in trainable(pm)}


def gen_case(c, out_root):
    case_dir = os.path.join(out_root, c["name"])
    adapter_dir = os.path.join(case_dir, "adapter")
    for attempt in range(20):
        seed = c["seed"] + 1000 * attempt
        if os.path.isdir(case_dir):
            shutil.rmtree(case_dir)
        os.makedirs(case_dir)
        base = make_base(c, seed)
        base_state = {k: v.detach().clone() for k, v in base.state_dict().items()}
        base.save_pretrained(case_dir, safe_serialization=True)
        torch.manual_seed(seed + 5)
        pm = get_peft_model(make_base(c, seed), lora_config(c))
        gen = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if ".lora_B." in n:
                    p.copy_(B_STD * torch.randn(p.shape, generator=gen))
        pm.save_pretrained(adapter_dir)
        ids, labels = make_inputs(c, seed)
        expected, norms, gap = compute_expected(c, seed, base_state, adapter_dir, ids, labels)
        if gap > moe.MIN_TOPK_GAP:
            break
        print(f"[{c['name']}] seed {seed}: top-k gap {gap:.2e} too small, re-seeding")
    else:
        raise RuntimeError(f"{c['name']}: no seed with a clear routing margin")
    for k, v in expected.items():
        assert v.dtype == torch.float32 and torch.isfinite(v).all(), k
    grads_a = [v for k, v in expected.items() if k.startswith("grad.") and ".lora_A." in k]
    assert all(float(g.abs().max()) > 0 for g in grads_a), "a lora_A gradient is zero"
    expected64 = float64_params(c, seed, base_state, adapter_dir, ids, labels)
    dist32 = {k: float((expected[k].double() - t).norm() / t.norm()) for k, t in expected64.items()}
    safetensors.torch.save_file(expected, os.path.join(case_dir, "expected.safetensors"), metadata={"format": "pt"})
    safetensors.torch.save_file(expected64, os.path.join(case_dir, "expected_f64.safetensors"),
                                metadata={"format": "pt"})
    with open(os.path.join(case_dir, "input.json"), "w") as f:
        json.dump({"input_ids": ids.tolist(), "labels": labels.tolist()}, f)
        f.write("\n")
    meta = {
        "case": c["name"], "kind": c["kind"], "seed": seed, "r": c["r"], "lora_alpha": c["alpha"],
        "target_modules": c["targets"], "lora_B_init": f"normal(0, {B_STD})",
        "lr": c["lr"], "weight_decay": c["weight_decay"], "max_norm": c["max_norm"], "steps": STEPS,
        "betas": list(BETAS), "eps": EPS, "grad_norms_before_clip": norms,
        "max_float32_param_distance_to_float64": max(dist32.values()),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "safetensors": safetensors.__version__},
    }
    with open(os.path.join(case_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    for fn in ("generation_config.json", "README.md"):
        for d in (case_dir, adapter_dir):
            if os.path.exists(os.path.join(d, fn)):
                os.remove(os.path.join(d, fn))
    print(f"[{c['name']}] ok: seed {seed}, {len(grads_a)} adapted modules, "
          f"float32 params within {max(dist32.values()):.2e} of float64")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--case", action="append")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    for c in CASES:
        if not a.case or c["name"] in a.case:
            gen_case(c, a.out)


if __name__ == "__main__":
    main()
