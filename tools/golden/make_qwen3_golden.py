#!/usr/bin/env python3
"""Generate golden fixtures for the dense Qwen3 path of titan.cpp.

Each case is a tiny, randomly initialised HF ``Qwen3ForCausalLM`` (fp32, eager
attention) saved with ``save_pretrained`` next to the reference outputs that
the C++ implementation must reproduce:

  tests/golden/qwen3/<case>/
    config.json, model.safetensors      the model (HF layout)
    input.json                          {"input_ids": [[...]], "labels": [[...]]}
    meta.json                           optimizer settings, shapes, versions
    expected.safetensors                reference tensors (all float32):
      logits                [B,T,V]  initial model
      loss                  []       initial model, HF ForCausalLMLoss
      grad.<hf name>        one per model.named_parameters() after backward
      losses                [steps]  loss before each AdamW step
      param.<hf name>       one per model.named_parameters() after all steps
    expected_f64.safetensors            the same AdamW steps run by HF in float64
      param.<hf name>       float64; the truth the float32 parameters are measured against

Usage:
  python tools/golden/make_qwen3_golden.py [--out tests/golden/qwen3] [--case NAME ...]
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np
import safetensors
import safetensors.torch
import torch
import transformers
from float64_truth import Float64Mode, adamw_steps
from transformers import Qwen3Config, Qwen3ForCausalLM

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEFAULT_OUT = os.path.join(REPO_ROOT, "tests", "golden", "qwen3")

STEPS = 5
BETAS = (0.9, 0.999)
EPS = 1e-8

# Properties covered (see README.md for the table):
#   tied / untied lm_head, GQA ratio 1 / 2 / 4, head_dim != hidden/heads,
#   rope_theta 1e6 / 1e4, rms_norm_eps 1e-6 / 1e-5, clipping on / off,
#   v5 config.json (rope_parameters) and legacy v4 config.json (rope_theta),
#   tied checkpoint with and without an explicit lm_head.weight, sharded copy.
CASES = [
    dict(
        name="tied_gqa2",
        seed=1234,
        vocab_size=256, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
        batch=2, seq=16, lr=1e-2, weight_decay=0.1, max_norm=2.5,
        config_style="v5", tied_lm_head_in_file=False, sharded_copy=False,
    ),
    dict(
        name="untied_mha_legacy_cfg",
        seed=2345,
        vocab_size=256, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8,
        tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-5,
        batch=2, seq=8, lr=1e-2, weight_decay=0.1, max_norm=1e3,
        config_style="v4", tied_lm_head_in_file=False, sharded_copy=False,
    ),
    dict(
        name="untied_gqa4",
        seed=3456,
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=8,
        tie_word_embeddings=False, rope_theta=1e4, rms_norm_eps=1e-6,
        batch=2, seq=8, lr=1e-2, weight_decay=0.1, max_norm=1.0,
        config_style="v5", tied_lm_head_in_file=False, sharded_copy=True,
    ),
    dict(
        name="tied_mha_hd24_lmhead",
        seed=4567,
        vocab_size=300, hidden_size=40, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=24,
        tie_word_embeddings=True, rope_theta=1e4, rms_norm_eps=1e-5,
        batch=2, seq=12, lr=1e-2, weight_decay=0.1, max_norm=0.5,
        config_style="v5", tied_lm_head_in_file=True, sharded_copy=False,
    ),
]

INIT_RANGE = 0.1   # larger than the released 0.02 so logits/grads are not flat
NORM_PERTURB = 0.1  # RMSNorm weights = 1 + NORM_PERTURB * randn


def build_config(c):
    cfg = Qwen3Config(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        hidden_act="silu",
        max_position_embeddings=4096,
        initializer_range=INIT_RANGE,
        rms_norm_eps=c["rms_norm_eps"],
        tie_word_embeddings=c["tie_word_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": float(c["rope_theta"])},
        attention_bias=False,
        use_sliding_window=False,
        attention_dropout=0.0,
    )
    cfg._attn_implementation = "eager"
    return cfg


def make_model(c):
    torch.manual_seed(c["seed"])
    model = Qwen3ForCausalLM(build_config(c))
    model.to(torch.float32)
    # Perturb every RMSNorm weight so that norm gradients are exercised.
    gen = torch.Generator().manual_seed(c["seed"] + 17)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + NORM_PERTURB * torch.randn(p.shape, generator=gen))
    assert model.config._attn_implementation == "eager"
    return model


def make_inputs(c):
    gen = torch.Generator().manual_seed(c["seed"] + 99)
    B, T, V = c["batch"], c["seq"], c["vocab_size"]
    ids = torch.randint(0, V, (B, T), generator=gen)
    labels = ids.clone()
    # Ignored positions: the last position of row 0, two in the middle of row
    # 1, and position 1 of row 0. Position 0 of a row is never a target (the
    # loss shifts labels left by one), so it is left unmasked on purpose.
    labels[0, T - 1] = -100
    labels[0, 1] = -100
    labels[1, T // 2] = -100
    labels[1, T // 2 + 1] = -100
    return ids, labels


def write_legacy_config(case_dir, c):
    """Rewrite config.json in the v4 style (top-level rope_theta, torch_dtype)."""
    path = os.path.join(case_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    rp = cfg.pop("rope_parameters")
    assert rp["rope_type"] == "default"
    cfg["rope_theta"] = rp["rope_theta"]
    cfg["rope_scaling"] = None
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    cfg.pop("layer_types", None)
    cfg["transformers_version"] = "4.51.0"
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def write_single_file_with_lm_head(case_dir, model):
    """Write model.safetensors for a tied model *including* lm_head.weight
    (a copy of the embedding), as some released tied checkpoints do."""
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    safetensors.torch.save_file(sd, os.path.join(case_dir, "model.safetensors"),
                                metadata={"format": "pt"})


def save_model(case_dir, c, model):
    os.makedirs(case_dir, exist_ok=True)
    for fn in os.listdir(case_dir):
        os.remove(os.path.join(case_dir, fn))
    model.save_pretrained(case_dir, safe_serialization=True)
    if c["config_style"] == "v4":
        write_legacy_config(case_dir, c)
    if c["tied_lm_head_in_file"]:
        write_single_file_with_lm_head(case_dir, model)


def compute_expected(c, init_state, ids, labels):
    """Returns (expected dict, grad norms before clipping per step)."""
    out = {}

    # Initial forward/backward.
    model = make_model(c)
    model.load_state_dict(init_state)
    model.train()
    res = model(input_ids=ids, labels=labels)
    res.loss.backward()
    out["logits"] = res.logits.detach().float().contiguous()
    out["loss"] = res.loss.detach().float().reshape(())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        out["grad." + name] = p.grad.detach().float().contiguous()

    # Fresh training run from the same initial weights.
    model = make_model(c)
    model.load_state_dict(init_state)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], betas=BETAS, eps=EPS,
                            weight_decay=c["weight_decay"])
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        losses.append(loss.item())
        loss.backward()
        n = torch.nn.utils.clip_grad_norm_(model.parameters(), c["max_norm"])
        norms.append(float(n))
        opt.step()
    out["losses"] = torch.tensor(losses, dtype=torch.float32)
    for name, p in model.named_parameters():
        out["param." + name] = p.detach().float().contiguous()
    return out, norms


def float64_params(c, init_state, ids, labels):
    """The same STEPS AdamW steps with clipping, HF model and optimizer in float64.

    Adam divides by sqrt(v): where a gradient element cancels to round-off, its update takes its
    sign from that round-off, so two correct float32 runs differ per tensor by more than 1e-4.
    This run is the truth both are measured against. HF's own float32 upcasts (RMSNorm, rotary,
    softmax, loss) are made float64 too (tools/golden/float64_truth.py)."""
    with Float64Mode():
        model = make_model(c)
        model.to(torch.float64)
        model.load_state_dict({k: v.double() for k, v in init_state.items()})
        assert model.model.rotary_emb.inv_freq.dtype == torch.float64
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], betas=BETAS, eps=EPS,
                                weight_decay=c["weight_decay"])
        for _ in range(STEPS):
            opt.zero_grad()
            loss = model(input_ids=ids, labels=labels).loss
            assert loss.dtype == torch.float64
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), c["max_norm"])
            opt.step()
    return {"param." + n: p.detach().contiguous() for n, p in model.named_parameters()}


def float32_distances(expected, expected64):
    """Per tensor: relative L2 distance of HF's float32 parameters to the float64 ones."""
    out = {}
    for k, t64 in expected64.items():
        d = (expected[k].double() - t64).norm()
        r = t64.norm()
        out[k] = float(d / r) if r > 0 else float(d)
    return out


# ---------------------------------------------------------------------------
# Independent re-implementation of the math (plain torch ops, no HF modules).
# Used only to cross-check the HF outputs written above; it also documents
# exactly what the C++ side has to compute.
# ---------------------------------------------------------------------------

def _up(x):
    # float32 compute for fp32/bf16 inputs; the float64 cross-check stays float64
    return x if x.dtype == torch.float64 else x.float()


def _rms(x, w, eps):
    xf = _up(x)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rope(x, theta, hd):
    # x: [B, nh, T, hd]; NeoX half-split rotation
    T = x.shape[2]
    ft = torch.float64 if x.dtype == torch.float64 else torch.float32  # HF: float32 tables
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).to(ft) / hd))
    pos = torch.arange(T, dtype=ft)
    f = torch.outer(pos, inv)
    emb = torch.cat([f, f], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    return x * cos + rot * sin


def reference_loss(c, P, ids, labels):
    B, T = ids.shape
    H, nH, nKV, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    eps, theta = c["rms_norm_eps"], float(c["rope_theta"])
    x = P["model.embed_tokens.weight"][ids]
    causal = torch.full((T, T), float("-inf")).triu(1)
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        h = _rms(x, P[pre + "input_layernorm.weight"], eps)
        q = (h @ P[pre + "self_attn.q_proj.weight"].T).view(B, T, nH, hd)
        k = (h @ P[pre + "self_attn.k_proj.weight"].T).view(B, T, nKV, hd)
        v = (h @ P[pre + "self_attn.v_proj.weight"].T).view(B, T, nKV, hd)
        q = _rms(q, P[pre + "self_attn.q_norm.weight"], eps).transpose(1, 2)
        k = _rms(k, P[pre + "self_attn.k_norm.weight"], eps).transpose(1, 2)
        v = v.transpose(1, 2)
        q, k = _rope(q, theta, hd), _rope(k, theta, hd)
        rep = nH // nKV
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        a = (q @ k.transpose(-1, -2)) * hd ** -0.5 + causal
        a = torch.softmax(_up(a), dim=-1).to(q.dtype)
        o = (a @ v).transpose(1, 2).reshape(B, T, nH * hd)
        x = x + o @ P[pre + "self_attn.o_proj.weight"].T
        h = _rms(x, P[pre + "post_attention_layernorm.weight"], eps)
        g = h @ P[pre + "mlp.gate_proj.weight"].T
        u = h @ P[pre + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * u) @ P[pre + "mlp.down_proj.weight"].T
    x = _rms(x, P["model.norm.weight"], eps)
    head = P["model.embed_tokens.weight"] if c["tie_word_embeddings"] else P["lm_head.weight"]
    logits = x @ head.T
    tgt = torch.cat([labels[:, 1:], torch.full((B, 1), -100, dtype=labels.dtype)], dim=1)
    valid = tgt != -100
    lse = torch.logsumexp(_up(logits), dim=-1)
    picked = _up(logits).gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    loss = ((lse - picked) * valid).sum() / valid.sum()
    return logits, loss


def reference_check(c, init_state, ids, labels, expected, expected64):
    names = [n for n in init_state if not (c["tie_word_embeddings"] and n == "lm_head.weight")]
    P = {n: init_state[n].detach().clone().double().requires_grad_(True) for n in names}
    logits, loss = reference_loss(c, P, ids, labels)
    loss.backward()
    errs = {"logits": (logits - expected["logits"].double()).abs().max().item(),
            "loss": abs(loss.item() - expected["loss"].item())}
    errs["grad"] = max((P[n].grad - expected["grad." + n].double()).abs().max().item()
                       / (expected["grad." + n].abs().max().item() + 1e-12) for n in names)

    # The same AdamW steps with global-norm clipping, in float64.
    P, losses = adamw_steps(lambda P: reference_loss(c, P, ids, labels)[1],
                            {n: init_state[n] for n in names}, STEPS, c["lr"], c["weight_decay"],
                            c["max_norm"], BETAS, EPS)
    errs["losses"] = max(abs(a - b) for a, b in zip(losses, expected["losses"].tolist()))
    errs["param"] = max((P[n] - expected["param." + n].double()).abs().max().item() for n in names)
    errs["param_f64"] = max((P[n] - expected64["param." + n]).abs().max().item() for n in names)
    tol = {"logits": 1e-4, "loss": 1e-5, "grad": 1e-4, "losses": 1e-4, "param": 1e-4, "param_f64": 1e-10}
    bad = {k: e for k, e in errs.items() if not e <= tol[k]}
    print(f"[{c['name']}] independent float64 check: " +
          " ".join(f"{k}={e:.2e}" for k, e in errs.items()))
    if bad:
        raise RuntimeError(f"{c['name']}: independent check failed: {bad}")


def verify_reload(case_dir, model, ids, c):
    """The saved files must load cleanly in HF and reproduce the logits exactly."""
    m2, info = Qwen3ForCausalLM.from_pretrained(case_dir, output_loading_info=True,
                                                attn_implementation="eager",
                                                dtype=torch.float32)
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(k):
            raise RuntimeError(f"{case_dir}: {k} = {info[k]}")
    rp = m2.config.rope_parameters
    if float(rp["rope_theta"]) != float(c["rope_theta"]) or rp.get("rope_type", "default") != "default":
        raise RuntimeError(f"{case_dir}: rope parameters read back as {rp}")
    if float(m2.config.rms_norm_eps) != float(c["rms_norm_eps"]):
        raise RuntimeError(f"{case_dir}: rms_norm_eps read back as {m2.config.rms_norm_eps}")
    m2.eval()
    model.eval()
    with torch.no_grad():
        a = model(input_ids=ids).logits
        b = m2(input_ids=ids).logits
    if not torch.equal(a, b):
        raise RuntimeError(f"{case_dir}: reloaded logits differ, max {(a - b).abs().max()}")
    model.train()


def dir_size(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def gen_case(c, out_root):
    name = c["name"]
    case_dir = os.path.join(out_root, name)
    model = make_model(c)
    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ids, labels = make_inputs(c)

    save_model(case_dir, c, model)
    verify_reload(case_dir, model, ids, c)

    expected, norms = compute_expected(c, init_state, ids, labels)
    for k, v in expected.items():
        if v.dtype != torch.float32 or not torch.isfinite(v).all():
            raise RuntimeError(f"{name}: {k} not finite float32")
    # Tied models: no separate lm_head gradient/parameter.
    if c["tie_word_embeddings"]:
        assert "grad.lm_head.weight" not in expected
    else:
        assert "grad.lm_head.weight" in expected

    expected64 = float64_params(c, init_state, ids, labels)
    assert sorted(expected64) == sorted(k for k in expected if k.startswith("param."))
    reference_check(c, init_state, ids, labels, expected, expected64)
    dist32 = float32_distances(expected, expected64)

    safetensors.torch.save_file(expected, os.path.join(case_dir, "expected.safetensors"),
                                metadata={"format": "pt"})
    safetensors.torch.save_file(expected64, os.path.join(case_dir, "expected_f64.safetensors"),
                                metadata={"format": "pt"})
    with open(os.path.join(case_dir, "input.json"), "w") as f:
        json.dump({"input_ids": ids.tolist(), "labels": labels.tolist()}, f)
        f.write("\n")

    clip_steps = [i for i, n in enumerate(norms) if n > c["max_norm"]]
    n_rep = c["num_attention_heads"] // c["num_key_value_heads"]
    meta = {
        "case": name,
        "lr": c["lr"],
        "weight_decay": c["weight_decay"],
        "max_norm": c["max_norm"],
        "steps": STEPS,
        "betas": list(BETAS),
        "eps": EPS,
        "optimizer": "torch.optim.AdamW, defaults (foreach=None, fused=None: single-tensor path on CPU), one param group, weight decay on every parameter",
        "clip": "torch.nn.utils.clip_grad_norm_ (global L2 norm over all grads; coef = max_norm / (norm + 1e-6), clamped to 1)",
        "loss": "HF ForCausalLMLoss, mean over non-ignored shifted targets",
        "batch": c["batch"],
        "seq": c["seq"],
        "seed": c["seed"],
        "initializer_range": INIT_RANGE,
        "norm_weight_init": f"1 + {NORM_PERTURB} * randn",
        "tie_word_embeddings": c["tie_word_embeddings"],
        "gqa_ratio": n_rep,
        "head_dim_differs_from_hidden_over_heads":
            c["head_dim"] != c["hidden_size"] // c["num_attention_heads"],
        "rope_theta": c["rope_theta"],
        "rms_norm_eps": c["rms_norm_eps"],
        "config_style": c["config_style"],
        "lm_head_in_file": (not c["tie_word_embeddings"]) or c["tied_lm_head_in_file"],
        "grad_norms_before_clip": norms,
        "clip_triggered_steps": clip_steps,
        "initial_loss": float(expected["loss"]),
        "float64_run": "expected_f64.safetensors: the same steps by HF + torch.optim.AdamW in float64",
        "max_float32_param_distance_to_float64": max(dist32.values()),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "safetensors_version": safetensors.__version__,
        "numpy_version": np.__version__,
        "attn_implementation": "eager",
        "dtype": "float32",
    }
    with open(os.path.join(case_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")

    print(f"[{name}] loss={float(expected['loss']):.6f} losses={[round(x, 6) for x in expected['losses'].tolist()]}")
    print(f"[{name}] grad norms before clip={[round(x, 4) for x in norms]} max_norm={c['max_norm']} clip steps={clip_steps}")
    for fn in sorted(os.listdir(case_dir)):
        print(f"    {fn:40s} {os.path.getsize(os.path.join(case_dir, fn)):9d} B")
    print(f"    total {dir_size(case_dir)} B")

    if c["sharded_copy"]:
        sdir = os.path.join(out_root, name + "_sharded")
        if os.path.isdir(sdir):
            shutil.rmtree(sdir)
        os.makedirs(sdir)
        model.save_pretrained(sdir, safe_serialization=True, max_shard_size="50KB")
        if not os.path.exists(os.path.join(sdir, "model.safetensors.index.json")):
            raise RuntimeError("sharded save produced no index")
        verify_reload(sdir, model, ids, c)
        for fn in ("expected.safetensors", "expected_f64.safetensors", "input.json"):
            shutil.copy(os.path.join(case_dir, fn), os.path.join(sdir, fn))
        meta_s = dict(meta, case=name + "_sharded", sharded=True, same_as=name)
        with open(os.path.join(sdir, "meta.json"), "w") as f:
            json.dump(meta_s, f, indent=2)
            f.write("\n")
        print(f"[{name}_sharded]")
        for fn in sorted(os.listdir(sdir)):
            print(f"    {fn:40s} {os.path.getsize(os.path.join(sdir, fn)):9d} B")
        print(f"    total {dir_size(sdir)} B")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--case", action="append", help="only these case names")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__}  transformers {transformers.__version__}")
    os.makedirs(args.out, exist_ok=True)
    for c in CASES:
        if args.case and c["name"] not in args.case:
            continue
        gen_case(c, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
