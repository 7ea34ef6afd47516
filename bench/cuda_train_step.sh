#!/usr/bin/env bash
# The CUDA training-step comparison on a GPU machine that has the NVIDIA driver, CUDA 13 libraries, torch and
# transformers but not titan's build dependencies: bench_train_step comes from a bundle made here by
# scripts/gpu_bundle.sh (with the shared libraries it loads). Runs bench/compare_cuda_train_step.py (titan bf16
# vs PyTorch eager vs torch.compile, Qwen3-0.6B and 1.7B by default) and writes the table and the JSON to $OUT.
#   bash bench/cuda_train_step.sh BUNDLE.tar.xz [compare_cuda_train_step.py options]
# Environment: OUT (default gpu_out), TOTAL_TIMEOUT (seconds for the whole comparison, default 480).
set -uo pipefail
BUNDLE=${1:?bundle}
shift
OUT=${OUT:-gpu_out}
mkdir -p "$OUT" /tmp/tb
nvidia-smi -L 2>&1 | tee "$OUT/train_step_gpu.txt"
tar xJf "$BUNDLE" -C /tmp/tb || exit 1
[ -x /tmp/tb/bench_train_step ] || { echo "the bundle holds no bench_train_step" | tee -a "$OUT/train_step_gpu.txt"; exit 1; }
# cuBLASLt and NCCL come from the machine's CUDA (scripts/gpu_libs.sh).
source "$(dirname "$0")/../scripts/gpu_libs.sh"
echo "cuBLASLt: $LT; NCCL: $NCCL" | tee -a "$OUT/train_step_gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  2>&1 | tee -a "$OUT/train_step_gpu.txt"
PYTHONUNBUFFERED=1 timeout "${TOTAL_TIMEOUT:-480}" python3 bench/compare_cuda_train_step.py \
  --titan "env LD_LIBRARY_PATH=$TITAN_LD /tmp/tb/bench_train_step" --json "$OUT/cuda_train_step.json" "$@" 2>&1 |
  tee "$OUT/cuda_train_step.txt"
