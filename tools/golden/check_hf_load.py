#!/usr/bin/env python3
"""Check that a checkpoint directory loads cleanly as an HF model (Qwen3ForCausalLM or Qwen3MoeForCausalLM, from config.json).

  python tools/golden/check_hf_load.py DIR [--dtype f32|bf16]
         [--compare EXPECTED.safetensors --input input.json] [--atol A --rtol R]

Loads DIR with ``AutoModelForCausalLM.from_pretrained(DIR, output_loading_info=True)``
and prints missing / unexpected / mismatched keys; exits 1 if any list is
non-empty. Then runs a forward pass (eager attention) and prints the logits
shape. With --compare, the forward runs on input.json's input_ids and the
logits are compared against the ``logits`` tensor of EXPECTED (for example an
expected.safetensors fixture or a file written by ``titan forward``); if
input.json has labels and EXPECTED has ``loss``, the loss is compared too.
Exit status: 0 ok, 1 loading problem, 2 comparison mismatch.
"""

import argparse
import json
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

DTYPES = {"f32": torch.float32, "fp32": torch.float32, "float32": torch.float32,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    ap.add_argument("--compare", metavar="EXPECTED.safetensors")
    ap.add_argument("--input", metavar="input.json")
    ap.add_argument("--atol", type=float, default=None,
                    help="default 1e-4 for f32, 5e-2 for bf16")
    ap.add_argument("--rtol", type=float, default=None,
                    help="default 1e-4 for f32, 5e-2 for bf16")
    args = ap.parse_args()
    if args.compare and not args.input:
        ap.error("--compare needs --input")

    dtype = DTYPES[args.dtype]
    model, info = AutoModelForCausalLM.from_pretrained(
        args.dir, output_loading_info=True, dtype=dtype, attn_implementation="eager",
        ignore_mismatched_sizes=True)  # report size mismatches instead of raising
    model.eval()

    bad = False
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        v = info.get(k)
        if v is None:
            continue
        v = sorted(v, key=str) if not isinstance(v, list) else v
        print(f"{k}: {v}")
        if v:
            bad = True

    cfg = model.config
    nparams = sum(p.numel() for p in model.parameters())
    print(f"config: layers={cfg.num_hidden_layers} hidden={cfg.hidden_size} heads={cfg.num_attention_heads} "
          f"kv_heads={cfg.num_key_value_heads} head_dim={cfg.head_dim} vocab={cfg.vocab_size} "
          f"tie={cfg.tie_word_embeddings} rope={cfg.rope_parameters} eps={cfg.rms_norm_eps} "
          f"params={nparams} dtype={next(model.parameters()).dtype}")

    labels = None
    if args.input:
        with open(args.input) as f:
            inp = json.load(f)
        ids = torch.tensor(inp["input_ids"], dtype=torch.long)
        if "labels" in inp:
            labels = torch.tensor(inp["labels"], dtype=torch.long)
    else:
        ids = torch.arange(8, dtype=torch.long).remainder(cfg.vocab_size).unsqueeze(0)

    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    logits = out.logits.float()
    print(f"logits shape: {list(logits.shape)}  finite: {bool(torch.isfinite(logits).all())}")
    if out.loss is not None:
        print(f"loss: {out.loss.item():.6f}")
    if bad:
        print("FAIL: checkpoint does not load cleanly")
        return 1
    if not torch.isfinite(logits).all():
        print("FAIL: non-finite logits")
        return 1

    if args.compare:
        is_bf16 = dtype == torch.bfloat16
        atol = args.atol if args.atol is not None else (5e-2 if is_bf16 else 1e-4)
        rtol = args.rtol if args.rtol is not None else (5e-2 if is_bf16 else 1e-4)
        exp = load_file(args.compare)
        ok = True
        if "logits" not in exp:
            print(f"FAIL: {args.compare} has no 'logits' tensor (keys: {sorted(exp)[:8]}...)")
            return 2
        ref = exp["logits"].float()
        if list(ref.shape) != list(logits.shape):
            print(f"FAIL: logits shape {list(logits.shape)} vs expected {list(ref.shape)}")
            return 2
        diff = (logits - ref).abs()
        close = torch.allclose(logits, ref, atol=atol, rtol=rtol)
        print(f"logits: max abs diff {diff.max().item():.3e}  mean {diff.mean().item():.3e}  "
              f"allclose(atol={atol}, rtol={rtol}) = {close}")
        ok &= close
        if out.loss is not None and "loss" in exp:
            d = abs(out.loss.item() - exp["loss"].float().item())
            lclose = d <= atol + rtol * abs(exp["loss"].float().item())
            print(f"loss: {out.loss.item():.6f} vs expected {exp['loss'].item():.6f}  diff {d:.3e}  ok={lclose}")
            ok &= lclose
        if not ok:
            print("FAIL: mismatch")
            return 2
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
