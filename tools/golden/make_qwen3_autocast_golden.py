#!/usr/bin/env python3
"""Reference for titan's bf16 mixed-precision step: HF transformers under CPU autocast.

Loads a golden fixture's HF model (tests/golden/qwen3/<case>/, made by make_qwen3_golden.py) with
float32 master weights and attn_implementation="sdpa" (HF's default), and runs one forward + backward
of the fixture batch with the forward inside ``torch.autocast("cpu", dtype=torch.bfloat16)``: the
Linear layers and SDPA compute in bf16, RMSNorm upcasts to float32 and multiplies by its float32
weight, the residual stream stays float32, the loss upcasts the bf16 logits (HF's causal LM loss with
the input's labels, as in the other golden scripts). The gradients land on the float32 parameters.

The same step is also run in float64 (HF's float32 upcasts made float64, float64_truth.py): the
exact result both bf16 steps are measured against. expected_f64.safetensors holds only the float64
parameters after the AdamW steps, so the float64 logits, loss and gradients of this one step are
written here next to the bf16 ones.

Writes <fixture>/autocast_bf16.safetensors, all float32 (the float64 values rounded to float32,
6e-8 relative, far below bf16's 4e-3):
  logits, loss, grad.<hf name>             HF's autocast bf16 step
  f64.logits, f64.loss, f64.grad.<hf name> the float64 step

Regenerate (byte-identical on the same versions and CPU; generated with torch 2.15.0, transformers
5.25.0, safetensors 0.8.0; another CPU may sum the bf16 GEMMs in another order and move the bf16 values
by round-off):
  python tools/golden/make_qwen3_autocast_golden.py            # tests/golden/qwen3/tied_gqa2
  python tools/golden/make_qwen3_autocast_golden.py --fixture DIR [--out FILE]
--fixture also takes a tests/golden/qwen3_moe fixture (expert gradients under their on-disk, per-expert
names, as make_qwen3_moe_golden.py writes them).
"""

import argparse
import json
import os
import sys

import safetensors.torch
import torch
import transformers
from float64_truth import Float64Mode
from make_qwen3_moe_golden import per_expert
from transformers import AutoConfig, AutoModelForCausalLM

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEFAULT_FIXTURE = os.path.join(REPO_ROOT, "tests", "golden", "qwen3", "tied_gqa2")
OUT_NAME = "autocast_bf16.safetensors"


def read_inputs(fixture):
    with open(os.path.join(fixture, "input.json")) as f:
        inp = json.load(f)
    return torch.tensor(inp["input_ids"]), torch.tensor(inp["labels"])


def load_float32(fixture, attn_implementation):
    model = AutoModelForCausalLM.from_pretrained(fixture, dtype=torch.float32,
                                                 attn_implementation=attn_implementation)
    model.train()  # dropout is 0 in every fixture; train() as in the golden training runs
    return model


def step_tensors(model, res):
    """logits, loss and grad.<on-disk name> (MoE expert tensors split per expert) as float32."""
    out = {"logits": res.logits.detach().float().contiguous(),
           "loss": res.loss.detach().float().reshape(())}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        for n, g in per_expert(name, p.grad.detach()):
            out["grad." + n] = g.float().contiguous()
    return out


def autocast_step(fixture, ids, labels):
    model = load_float32(fixture, "sdpa")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res = model(input_ids=ids, labels=labels)
    assert res.logits.dtype == torch.bfloat16, "the forward did not run under autocast"
    res.loss.backward()  # outside the autocast region, as torch recommends; grads are float32
    return step_tensors(model, res)


def float64_step(fixture, ids, labels):
    """The same step in float64. The model is built inside Float64Mode so that buffers computed at
    construction (the rotary inverse frequencies) are float64 from the start, then given the
    fixture's weights."""
    state = load_float32(fixture, "eager").state_dict()
    config = AutoConfig.from_pretrained(fixture)
    with Float64Mode():
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        if hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation("eager")  # grouped_mm has no float64
        model.to(torch.float64)
        model.load_state_dict({k: v.double() for k, v in state.items()})
        assert model.model.rotary_emb.inv_freq.dtype == torch.float64
        model.train()
        res = model(input_ids=ids, labels=labels)
        assert res.loss.dtype == torch.float64
        res.loss.backward()
    return step_tensors(model, res)


def rel_error(a, b):
    d, r = (a.double() - b.double()).norm(), b.double().norm()
    return float(d / r) if r > 0 else float(d)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", default=DEFAULT_FIXTURE, help="golden fixture directory")
    ap.add_argument("--out", help=f"output file (default: <fixture>/{OUT_NAME})")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__}  transformers {transformers.__version__}")
    ids, labels = read_inputs(args.fixture)
    bf16 = autocast_step(args.fixture, ids, labels)
    f64 = float64_step(args.fixture, ids, labels)
    assert sorted(bf16) == sorted(f64)

    out = dict(bf16)
    out.update({"f64." + k: v for k, v in f64.items()})
    for k, v in out.items():
        if v.dtype != torch.float32 or not torch.isfinite(v).all():
            raise RuntimeError(f"{k} not finite float32")
    path = args.out or os.path.join(args.fixture, OUT_NAME)
    # One metadata key: safetensors writes several in no fixed order, and the file is meant to be
    # byte-identical from run to run.
    safetensors.torch.save_file(out, path, metadata={"format": "pt"})

    print(f"{path}: {os.path.getsize(path)} B")
    print("relative L2 error of HF autocast bf16 to float64:")
    for k in bf16:
        print(f"  {k:55s} {rel_error(bf16[k], f64[k]):.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
