#!/usr/bin/env python3
"""PyTorch side of the checkpoint I/O benchmark: the same bytes as bench_checkpoint_io (a flavor's f32
parameters and both AdamW moments) saved with torch.save and safetensors, then loaded back.

  python3 bench/checkpoint_io.py [--flavor 0.6B] [--dir DIR] [--rounds 3]

Saves are followed by os.fsync (as titan's are); "cold" loads first drop the file from the page cache
(posix_fadvise DONTNEED), "warm" loads read it from there. Prints GB/s per round and the medians.
"""
import argparse
import os
import shutil
import statistics
import time

import torch
from safetensors.torch import load_file, save_file

# Parameter counts of the flavors (titan's Qwen3Config::flavor; tied embeddings for <= 4B).
PARAMS = {"debug": 3_410_432, "0.6B": 596_049_920}


def fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="0.6B", choices=sorted(PARAMS))
    ap.add_argument("--dir", default="/tmp/titan-bench-checkpoint-torch")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n = PARAMS[args.flavor]
    torch.manual_seed(0)
    p = torch.randn(n) * 0.02
    state = {"model": p, "exp_avg": p.clone(), "exp_avg_sq": p.clone()}
    # A trainer also holds its gradients: the same memory as bench_checkpoint_io's process.
    grads = torch.ones(n)
    nbytes = 3 * n * 4
    os.makedirs(args.dir, exist_ok=True)
    results = {}
    for name, save, load, file in (
        ("torch.save", lambda s, f: torch.save(s, f), lambda f: torch.load(f), "state.pt"),
        ("safetensors", lambda s, f: save_file(s, f), lambda f: load_file(f), "state.safetensors"),
    ):
        path = os.path.join(args.dir, file)
        rows = []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            save(state, path)
            fsync_file(path)
            t_save = time.perf_counter() - t0
            drop_cache(path)
            t0 = time.perf_counter()
            loaded = load(path)
            _ = sum(float(v[:: 1 << 20].sum()) for v in loaded.values())  # touch (safetensors mmaps lazily)
            for v in loaded.values():
                v.add_(0)  # read every page
            t_cold = time.perf_counter() - t0
            del loaded
            t0 = time.perf_counter()
            loaded = load(path)
            for v in loaded.values():
                v.add_(0)
            t_warm = time.perf_counter() - t0
            del loaded
            rows.append((nbytes / t_save / 1e9, nbytes / t_cold / 1e9, nbytes / t_warm / 1e9))
            print(f"{name} round {r + 1}: {nbytes / 2**30:.2f} GiB  save {rows[-1][0]:.2f} GB/s  "
                  f"load cold {rows[-1][1]:.2f} GB/s  warm {rows[-1][2]:.2f} GB/s", flush=True)
            os.remove(path)
        results[name] = [statistics.median(c) for c in zip(*rows)]
    for name, (s, c, w) in results.items():
        print(f"median {name}: save {s:.2f} GB/s, load cold {c:.2f} GB/s, load warm {w:.2f} GB/s")
    shutil.rmtree(args.dir, ignore_errors=True)
    del grads


if __name__ == "__main__":
    main()
