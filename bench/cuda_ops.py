"""The ops of bench_cuda_ops in PyTorch on the same GPU and shapes, and the side-by-side table.

    python3 bench/cuda_ops.py --titan build/bench_cuda_ops [--reps 20]

PyTorch f32 matmul runs with TF32 off (as titan's); bf16 matmul on bf16 tensors (titan's op converts its
f32 inputs to bf16 inside the timed call); attention is F.scaled_dot_product_attention(is_causal=True,
enable_gqa=True) in f32, and in bf16 on views of one fused QKV tensor (titan: attention_bf16, cuDNN's
fused attention reading the fused rows through strides).
"""
import argparse
import json
import shlex
import subprocess

import torch
import torch.nn.functional as F


def median_ms(reps, f):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def torch_rows(reps):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda"
    out = {}
    N, C, OC = 8192, 4096, 4096
    x, w = torch.randn(N, C, device=dev), torch.randn(OC, C, device=dev)
    out["matmul_f32"] = median_ms(reps, lambda: x @ w.t())
    xb, wb = x.bfloat16(), w.bfloat16()
    out["matmul_bf16"] = median_ms(reps, lambda: xb @ wb.t())
    xr, wr = xb.clone().requires_grad_(), wb.clone().requires_grad_()
    g = torch.randn(N, OC, device=dev, dtype=torch.bfloat16)

    def mm_fb():
        (xr @ wr.t()).backward(g)

    out["matmul_bf16_fwd_bwd"] = median_ms(reps, mm_fb)
    del x, w, xb, wb, xr, wr, g
    B, T, nH, nKV, hd = 4, 2048, 16, 8, 128
    q = torch.randn(B, nH, T, hd, device=dev, requires_grad=True)
    k = torch.randn(B, nKV, T, hd, device=dev, requires_grad=True)
    v = torch.randn(B, nKV, T, hd, device=dev, requires_grad=True)
    do = torch.randn(B, nH, T, hd, device=dev)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with torch.no_grad():
        out["attention_fwd_f32"] = median_ms(reps, sdpa)
    out["attention_fwd_bwd_f32"] = median_ms(reps, lambda: sdpa().backward(do))
    out["attention_fwd_bwd_f32_flash"] = out["attention_fwd_bwd_f32"]
    del q, k, v, do
    # bf16, q/k/v as views of one fused QKV projection output (B, T, (nH + 2 nKV) hd), as titan reads them
    qkv = torch.randn(B, T, (nH + 2 * nKV) * hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
    do16 = torch.randn(B, nH, T, hd, device=dev, dtype=torch.bfloat16)

    def sdpa16():
        q, k, v = qkv.view(B, T, nH + 2 * nKV, hd).transpose(1, 2).split([nH, nKV, nKV], dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with torch.no_grad():
        out["attention_fwd_bf16"] = median_ms(reps, sdpa16)
    out["attention_fwd_bwd_bf16"] = median_ms(reps, lambda: sdpa16().backward(do16))
    xn, wn = torch.randn(8192, 1024, device=dev), torch.randn(1024, device=dev)
    out["rmsnorm_fwd"] = median_ms(reps, lambda: F.rms_norm(xn, (1024,), wn, 1e-6))
    logits = torch.randn(1024, 151936, device=dev, requires_grad=True)
    t = (torch.arange(1024, device=dev) * 131) % 151936

    def ce():
        F.cross_entropy(logits, t).backward()

    out["cross_entropy_fwd_bwd"] = median_ms(reps, ce)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--titan", default="build/bench_cuda_ops", help="command line of bench_cuda_ops")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    res = subprocess.run(shlex.split(a.titan) + [str(a.reps)], check=True, capture_output=True, text=True)
    titan = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    ref = torch_rows(a.reps)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| op | shape | titan (ms) | titan TFLOP/s | PyTorch (ms) | PyTorch/titan |")
    print("|---|---|---|---|---|---|")
    for r in titan:
        pt = ref.get(r["op"])
        ratio = f"{pt / r['ms']:.2f}x" if pt else "-"
        tf = f"{r['tflops']:.1f}" if r["tflops"] > 0 else "-"
        print(f"| {r['op']} | {r['shape']} | {r['ms']:.3f} | {tf} | {pt:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
