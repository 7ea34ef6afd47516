#!/usr/bin/env python3
"""Generate golden fixtures for the Qwen3-MoE path of titan.cpp.

Each case is a tiny, randomly initialised HF ``Qwen3MoeForCausalLM`` (fp32,
eager attention, eager experts loop) saved next to the reference outputs:

  tests/golden/qwen3_moe/<case>/
    config.json, model.safetensors      the model (HF layout; per-expert keys,
                                        or the fused v5 keys for *_fused_v5)
    input.json                          {"input_ids": [[...]], "labels": [[...]]}
    meta.json                           optimizer settings, shapes, versions
    expected.safetensors                reference tensors (all float32):
      logits                [B,T,V]  initial model
      loss                  []       CE + router_aux_loss_coef * aux_loss (HF)
      aux_loss              []       HF load_balancing_loss_func
      grad.<hf name>        one per parameter, per-expert names (as on disk)
      losses                [steps]  loss before each AdamW step
      param.<hf name>       one per parameter after all steps

Parameter names are the on-disk (per-expert) names: the fused v5 runtime
tensors ``mlp.experts.gate_up_proj`` [E,2I,H] (gate rows first, then up) and
``mlp.experts.down_proj`` [E,H,I] are split per expert.

transformers 5.24: ``Qwen3MoeTopKRouter.forward`` returns the raw router
logits (softmax is applied to a copy for the routing weights), and
``load_balancing_loss_func`` applies one softmax to them. The older v5 bug
(the router returning probabilities, hence softmax(softmax(x)) in the aux
loss) is not present; the script asserts this numerically.

Usage:
  python tools/golden/make_qwen3_moe_golden.py [--out tests/golden/qwen3_moe] [--case NAME ...]
"""

import argparse
import json
import os
import sys

import numpy as np
import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers
from float64_truth import Float64Mode, adamw_steps
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEFAULT_OUT = os.path.join(REPO_ROOT, "tests", "golden", "qwen3_moe")

STEPS = 5
BETAS = (0.9, 0.999)
EPS = 1e-8
INIT_RANGE = 0.1
NORM_PERTURB = 0.1
MIN_TOPK_GAP = 5e-5  # routing must not depend on float round-off (k-th vs (k+1)-th probability)

BASE = dict(
    vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], router_aux_loss_coef=0.05, tie_word_embeddings=False,
    rope_theta=1e6, rms_norm_eps=1e-6, batch=2, seq=16, lr=1e-2, weight_decay=0.1,
    max_norm=1.0, fused_layout=False,
)

CASES = [
    dict(BASE, name="e8k2_norm", seed=5101),
    dict(BASE, name="e8k2_nonorm_tied", seed=5202, norm_topk_prob=False, tie_word_embeddings=True,
         router_aux_loss_coef=0.001, max_norm=1e3),
    dict(BASE, name="mlp_only_layer", seed=5303, num_hidden_layers=3, mlp_only_layers=[1],
         rope_theta=1e4, max_norm=0.5),
    dict(BASE, name="sparse_step2", seed=5404, num_hidden_layers=4, decoder_sparse_step=2,
         norm_topk_prob=False, num_experts_per_tok=3, seq=12),
    dict(BASE, name="e8k2_fused_v5", seed=5505, fused_layout=True),
]


def build_config(c):
    cfg = Qwen3MoeConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], moe_intermediate_size=c["moe_intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"], hidden_act="silu",
        max_position_embeddings=4096, initializer_range=INIT_RANGE, rms_norm_eps=c["rms_norm_eps"],
        tie_word_embeddings=c["tie_word_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": float(c["rope_theta"])},
        attention_bias=False, use_sliding_window=False, attention_dropout=0.0,
        num_experts=c["num_experts"], num_experts_per_tok=c["num_experts_per_tok"],
        norm_topk_prob=c["norm_topk_prob"], decoder_sparse_step=c["decoder_sparse_step"],
        mlp_only_layers=list(c["mlp_only_layers"]), output_router_logits=True,
        router_aux_loss_coef=c["router_aux_loss_coef"],
    )
    cfg._attn_implementation = "eager"
    return cfg


def is_moe_layer(c, i):
    return (i not in c["mlp_only_layers"] and c["num_experts"] > 0
            and (i + 1) % c["decoder_sparse_step"] == 0)


def make_model(c, seed):
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(build_config(c))
    model.to(torch.float32)
    gen = torch.Generator().manual_seed(seed + 17)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + NORM_PERTURB * torch.randn(p.shape, generator=gen))
    for i, layer in enumerate(model.model.layers):
        assert (type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock") == is_moe_layer(c, i), i
    return model


def make_inputs(c, seed):
    gen = torch.Generator().manual_seed(seed + 99)
    B, T, V = c["batch"], c["seq"], c["vocab_size"]
    ids = torch.randint(0, V, (B, T), generator=gen)
    labels = ids.clone()
    labels[0, T - 1] = -100
    labels[0, 1] = -100
    labels[1, T // 2] = -100
    labels[1, T // 2 + 1] = -100
    return ids, labels


def per_expert(name, t):
    """HF runtime parameter -> list of (on-disk name, tensor)."""
    if name.endswith("mlp.experts.gate_up_proj"):
        pre = name[: -len("gate_up_proj")]
        I = t.shape[1] // 2
        out = []
        for e in range(t.shape[0]):
            out.append((f"{pre}{e}.gate_proj.weight", t[e, :I]))
            out.append((f"{pre}{e}.up_proj.weight", t[e, I:]))
        return out
    if name.endswith("mlp.experts.down_proj"):
        pre = name[: -len("down_proj")]
        return [(f"{pre}{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
    return [(name, t)]


def min_topk_gap(router_logits, k):
    gap = float("inf")
    for lg in router_logits:
        p = torch.softmax(lg.detach().double(), dim=-1)
        top = torch.topk(p, k + 1, dim=-1).values
        gap = min(gap, (top[:, k - 1] - top[:, k]).min().item())
    return gap


def compute_expected(c, init_state, ids, labels):
    out, gaps = {}, []
    model = make_model(c, c["seed"])
    model.load_state_dict(init_state)
    model.train()
    res = model(input_ids=ids, labels=labels)
    gaps.append(min_topk_gap(res.router_logits, c["num_experts_per_tok"]))
    res.loss.backward()
    out["logits"] = res.logits.detach().float().contiguous()
    out["loss"] = res.loss.detach().float().reshape(())
    out["aux_loss"] = res.aux_loss.detach().float().reshape(())
    ce = F.cross_entropy(res.logits.detach().view(-1, c["vocab_size"]),
                         F.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1))
    # One softmax in the aux loss (no double-softmax router bug in this transformers version).
    aux1 = aux_loss_ref([lg.detach().double() for lg in res.router_logits], c, softmax_twice=False).item()
    aux2 = aux_loss_ref([lg.detach().double() for lg in res.router_logits], c, softmax_twice=True).item()
    assert abs(aux1 - res.aux_loss.item()) < 1e-5 * abs(aux1), (aux1, res.aux_loss.item())
    assert abs(aux2 - aux1) > 1e-3 * abs(aux1), "cannot tell one softmax from two on this case"
    assert abs(ce.item() + c["router_aux_loss_coef"] * res.aux_loss.item() - res.loss.item()) < 1e-5
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        for n, g in per_expert(name, p.grad.detach()):
            out["grad." + n] = g.float().contiguous()

    model = make_model(c, c["seed"])
    model.load_state_dict(init_state)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], betas=BETAS, eps=EPS,
                            weight_decay=c["weight_decay"])
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        r = model(input_ids=ids, labels=labels)
        gaps.append(min_topk_gap(r.router_logits, c["num_experts_per_tok"]))
        losses.append(r.loss.item())
        r.loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), c["max_norm"])))
        opt.step()
    out["losses"] = torch.tensor(losses, dtype=torch.float32)
    for name, p in model.named_parameters():
        for n, v in per_expert(name, p.detach()):
            out["param." + n] = v.float().contiguous()
    return out, norms, gaps


def float64_params(c, init_state, ids, labels):
    """The same STEPS AdamW steps with clipping by HF in float64 (eager per-expert loop: grouped_mm
    has no float64; HF's float32 upcasts made float64 by Float64Mode). The float32 parameters, HF's
    and titan's, are measured against this run (see tools/golden/make_qwen3_golden.py)."""
    with Float64Mode():
        model = make_model(c, c["seed"])
        model.set_experts_implementation("eager")
        model.to(torch.float64)
        model.load_state_dict({k: v.double() for k, v in init_state.items()})
        assert model.model.rotary_emb.inv_freq.dtype == torch.float64
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], betas=BETAS, eps=EPS,
                                weight_decay=c["weight_decay"])
        for _ in range(STEPS):
            opt.zero_grad()
            r = model(input_ids=ids, labels=labels)
            assert r.loss.dtype == torch.float64
            r.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), c["max_norm"])
            opt.step()
    out = {}
    for name, p in model.named_parameters():
        for n, v in per_expert(name, p.detach()):
            out["param." + n] = v.contiguous()
    return out


# ---------------------------------------------------------------------------
# Independent float64 re-implementation (plain torch ops, per-expert weights).
# ---------------------------------------------------------------------------

def aux_loss_ref(router_logits, c, softmax_twice=False):
    E, k = c["num_experts"], c["num_experts_per_tok"]
    cat = torch.cat(router_logits, dim=0)
    p = torch.softmax(cat, dim=-1)
    if softmax_twice:
        p = torch.softmax(p, dim=-1)
    sel = torch.topk(p, k, dim=-1).indices
    frac = F.one_hot(sel, E).double().sum(dim=(0, 1)) / cat.shape[0]
    return (frac * p.mean(dim=0)).sum() * E


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, theta, hd):
    T = x.shape[2]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).double() / hd))
    f = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    emb = torch.cat([f, f], dim=-1)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * emb.cos() + torch.cat([-x2, x1], dim=-1) * emb.sin()


def reference_loss(c, P, ids, labels):
    B, T = ids.shape
    H, nH, nKV, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    E, k = c["num_experts"], c["num_experts_per_tok"]
    eps, theta = c["rms_norm_eps"], float(c["rope_theta"])
    x = P["model.embed_tokens.weight"][ids]
    causal = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    router_logits = []
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        h = _rms(x, P[pre + "input_layernorm.weight"], eps)
        q = (h @ P[pre + "self_attn.q_proj.weight"].T).view(B, T, nH, hd)
        kk = (h @ P[pre + "self_attn.k_proj.weight"].T).view(B, T, nKV, hd)
        v = (h @ P[pre + "self_attn.v_proj.weight"].T).view(B, T, nKV, hd)
        q = _rope(_rms(q, P[pre + "self_attn.q_norm.weight"], eps).transpose(1, 2), theta, hd)
        kk = _rope(_rms(kk, P[pre + "self_attn.k_norm.weight"], eps).transpose(1, 2), theta, hd)
        v = v.transpose(1, 2)
        rep = nH // nKV
        kk, v = kk.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = torch.softmax((q @ kk.transpose(-1, -2)) * hd ** -0.5 + causal, dim=-1)
        x = x + (a @ v).transpose(1, 2).reshape(B, T, nH * hd) @ P[pre + "self_attn.o_proj.weight"].T
        h = _rms(x, P[pre + "post_attention_layernorm.weight"], eps).reshape(B * T, H)
        if is_moe_layer(c, i):
            lg = h @ P[pre + "mlp.gate.weight"].T
            router_logits.append(lg)
            p = torch.softmax(lg, dim=-1)
            w, sel = torch.topk(p, k, dim=-1)
            if c["norm_topk_prob"]:
                w = w / w.sum(-1, keepdim=True)
            y = torch.zeros_like(h)
            for n in range(B * T):
                for s in range(k):
                    e = int(sel[n, s])
                    ep = f"{pre}mlp.experts.{e}."
                    g = P[ep + "gate_proj.weight"] @ h[n]
                    u = P[ep + "up_proj.weight"] @ h[n]
                    y[n] = y[n] + w[n, s] * (P[ep + "down_proj.weight"] @ (F.silu(g) * u))
        else:
            g = h @ P[pre + "mlp.gate_proj.weight"].T
            u = h @ P[pre + "mlp.up_proj.weight"].T
            y = (F.silu(g) * u) @ P[pre + "mlp.down_proj.weight"].T
        x = x + y.view(B, T, H)
    x = _rms(x, P["model.norm.weight"], eps)
    head = P["model.embed_tokens.weight"] if c["tie_word_embeddings"] else P["lm_head.weight"]
    logits = x @ head.T
    tgt = torch.cat([labels[:, 1:], torch.full((B, 1), -100, dtype=labels.dtype)], dim=1)
    valid = tgt != -100
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ce = ((lse - picked) * valid).sum() / valid.sum()
    aux = aux_loss_ref(router_logits, c)
    return logits, ce + c["router_aux_loss_coef"] * aux, aux


def reference_check(c, expected, expected64, ids, labels):
    names = sorted(k[len("param."):] for k in expected if k.startswith("param."))
    init = {n: expected["init." + n] for n in names}
    P = {n: init[n].double().clone().requires_grad_(True) for n in names}
    logits, loss, aux = reference_loss(c, P, ids, labels)
    loss.backward()
    errs = {"logits": ((logits - expected["logits"].double()).norm() / expected["logits"].norm()).item(),
            "loss": abs(loss.item() - expected["loss"].item()),
            "aux": abs(aux.item() - expected["aux_loss"].item())}
    grad = {n: P[n].grad if P[n].grad is not None else torch.zeros_like(P[n]) for n in names}  # unused expert
    gd = sum(((grad[n] - expected["grad." + n].double()) ** 2).sum() for n in names)
    gn = sum((expected["grad." + n].double() ** 2).sum() for n in names)
    errs["grad"] = float((gd / gn).sqrt())
    # The AdamW steps in float64 against HF's float64 run.
    P, _ = adamw_steps(lambda P: reference_loss(c, P, ids, labels)[1], init, STEPS, c["lr"],
                       c["weight_decay"], c["max_norm"], BETAS, EPS)
    errs["param_f64"] = max((P[n] - expected64["param." + n]).abs().max().item() for n in names)
    tol = {"logits": 1e-5, "loss": 1e-5, "aux": 1e-5, "grad": 1e-5, "param_f64": 1e-10}
    print(f"[{c['name']}] independent float64 check: " + " ".join(f"{k}={e:.2e}" for k, e in errs.items()))
    bad = {k: e for k, e in errs.items() if not e <= tol[k]}
    if bad:
        raise RuntimeError(f"{c['name']}: independent check failed: {bad}")


def verify_reload(case_dir, model, ids):
    m2, info = Qwen3MoeForCausalLM.from_pretrained(case_dir, output_loading_info=True,
                                                   attn_implementation="eager", dtype=torch.float32)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(key):
            raise RuntimeError(f"{case_dir}: {key} = {info[key]}")
    m2.eval()
    model.eval()
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, m2(input_ids=ids).logits
    if not torch.equal(a, b):
        raise RuntimeError(f"{case_dir}: reloaded logits differ, max {(a - b).abs().max()}")
    model.train()


def gen_case(c, out_root):
    name = c["name"]
    case_dir = os.path.join(out_root, name)
    # Re-seed until routing has a clear margin on every forward (initial + every step).
    for attempt in range(20):
        seed = c["seed"] + 1000 * attempt
        cc = dict(c, seed=seed)
        model = make_model(cc, seed)
        init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ids, labels = make_inputs(cc, seed)
        expected, norms, gaps = compute_expected(cc, init_state, ids, labels)
        if min(gaps) > MIN_TOPK_GAP:
            break
        print(f"[{name}] seed {seed}: top-k gap {min(gaps):.2e} too small, re-seeding")
    else:
        raise RuntimeError(f"{name}: no seed with a clear routing margin")
    c = cc
    os.makedirs(case_dir, exist_ok=True)
    for fn in os.listdir(case_dir):
        os.remove(os.path.join(case_dir, fn))
    model.save_pretrained(case_dir, safe_serialization=True, save_original_format=not c["fused_layout"])
    keys = safetensors.safe_open(os.path.join(case_dir, "model.safetensors"), "pt").keys()
    fused_keys = [k for k in keys if k.endswith("experts.gate_up_proj")]
    assert bool(fused_keys) == c["fused_layout"], keys
    verify_reload(case_dir, model, ids)

    for k, v in expected.items():
        if v.dtype != torch.float32 or not torch.isfinite(v).all():
            raise RuntimeError(f"{name}: {k} not finite float32")
    for n, t in init_state.items():
        for pn, pt in per_expert(n, t):
            expected["init." + pn] = pt
    if c["tie_word_embeddings"]:
        expected.pop("init.lm_head.weight", None)
    expected64 = float64_params(c, init_state, ids, labels)
    assert sorted(expected64) == sorted(k for k in expected if k.startswith("param."))
    reference_check(c, expected, expected64, ids, labels)
    expected = {k: v.contiguous() for k, v in expected.items() if not k.startswith("init.")}
    dist32 = {k: float((expected[k].double() - t).norm() / t.norm()) for k, t in expected64.items()}

    safetensors.torch.save_file(expected, os.path.join(case_dir, "expected.safetensors"),
                                metadata={"format": "pt"})
    safetensors.torch.save_file(expected64, os.path.join(case_dir, "expected_f64.safetensors"),
                                metadata={"format": "pt"})
    with open(os.path.join(case_dir, "input.json"), "w") as f:
        json.dump({"input_ids": ids.tolist(), "labels": labels.tolist()}, f)
        f.write("\n")
    moe_layers = [i for i in range(c["num_hidden_layers"]) if is_moe_layer(c, i)]
    meta = {
        "case": name, "lr": c["lr"], "weight_decay": c["weight_decay"], "max_norm": c["max_norm"],
        "steps": STEPS, "betas": list(BETAS), "eps": EPS,
        "optimizer": "torch.optim.AdamW defaults (single-tensor path on CPU), weight decay on every parameter",
        "clip": "torch.nn.utils.clip_grad_norm_",
        "loss": "HF ForCausalLMLoss (mean over non-ignored shifted targets) + router_aux_loss_coef * aux_loss",
        "aux_loss": "HF load_balancing_loss_func over all MoE layers' router logits, no attention mask",
        "router": "transformers 5.24 Qwen3MoeTopKRouter: raw logits returned, one softmax in the aux loss",
        "experts_implementation": "eager (per-expert loop, index_add_)",
        "layout": "fused v5 (mlp.experts.gate_up_proj / down_proj)" if c["fused_layout"] else
                  "per-expert (mlp.experts.E.{gate,up,down}_proj.weight)",
        "moe_layers": moe_layers, "num_experts": c["num_experts"], "top_k": c["num_experts_per_tok"],
        "norm_topk_prob": c["norm_topk_prob"], "router_aux_loss_coef": c["router_aux_loss_coef"],
        "batch": c["batch"], "seq": c["seq"], "seed": c["seed"], "initializer_range": INIT_RANGE,
        "norm_weight_init": f"1 + {NORM_PERTURB} * randn",
        "min_topk_probability_gap": min(gaps), "grad_norms_before_clip": norms,
        "initial_loss": float(expected["loss"]), "initial_aux_loss": float(expected["aux_loss"]),
        "float64_run": "expected_f64.safetensors: the same steps by HF (eager experts) + torch.optim.AdamW in float64",
        "max_float32_param_distance_to_float64": max(dist32.values()),
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "safetensors_version": safetensors.__version__, "numpy_version": np.__version__,
        "attn_implementation": "eager", "dtype": "float32",
    }
    with open(os.path.join(case_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    print(f"[{name}] seed={c['seed']} loss={float(expected['loss']):.6f} aux={float(expected['aux_loss']):.6f} "
          f"min gap={min(gaps):.2e} moe layers={moe_layers} norms={[round(x, 3) for x in norms]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
