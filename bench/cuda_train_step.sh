#!/usr/bin/env bash
# The CUDA training-step comparison on a GPU machine that has the NVIDIA driver, CUDA 13 libraries, torch and
# transformers but not titan's build dependencies: bench_train_step comes from a bundle made here by
# scripts/gpu_bundle.sh (with the shared libraries it loads). Runs bench/compare_cuda_train_step.py (titan bf16
# vs PyTorch eager vs torch.compile, Qwen3-0.6B and 1.7B by default) and writes the table and the JSON to $OUT.
#   bash bench/cuda_train_step.sh BUNDLE.tar.xz [compare_cuda_train_step.py options]
# Environment: OUT (default gpu_out), TOTAL_TIMEOUT (seconds for the whole comparison, default 480). The
# roofline plan of each compared shape (titan plan --gpu) goes to $OUT/roofline.txt, with the measured time
# per op class of the same step (bench_train_step --op-times 1).
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
status=${PIPESTATUS[0]}
# Beside the measured table: titan's roofline prediction of each compared shape on this GPU (titan plan
# --gpu, bf16 mixed precision), so that a run confirms or corrects it op class by op class.
presets=0.6B,1.7B seq=2048 batch=1
while [ $# -gt 0 ]; do
  case "$1" in
    --presets=*) presets=${1#*=} ;; --presets) presets=${2:-$presets}; shift ;;
    --seq=*) seq=${1#*=} ;; --seq) seq=${2:-$seq}; shift ;;
    --batch=*) batch=${1#*=} ;; --batch) batch=${2:-$batch}; shift ;;
  esac
  shift
done
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z' 'a-z' |
  grep -oE 'h100|h200|b200' | head -1)
if [ -n "$gpu" ] && [ -x /tmp/tb/titan ]; then
  for p in ${presets//,/ }; do
    env LD_LIBRARY_PATH="$TITAN_LD" /tmp/tb/titan plan --gpu "$gpu" --model.flavor="$p" \
      --training.seq_len="$seq" --training.local_batch_size="$batch" --training.mixed_precision_param=bfloat16
    # ... and the measured device time of each op class of the same step (CUDA events around every op).
    echo "measured op classes of $p (ms per step: gemm, attention forward/backward, pointwise, embedding + loss):"
    env LD_LIBRARY_PATH="$TITAN_LD" timeout 60 /tmp/tb/bench_train_step --device cuda --preset "$p" \
      --seq "$seq" --batch "$batch" --bf16 1 --steps 3 --op-times 1 | grep '"summary"'
  done 2>&1 | tee "$OUT/roofline.txt"
else
  echo "no roofline plan: GPU '${gpu:-unknown}' is not one of h100, h200, b200" | tee "$OUT/roofline.txt"
fi
exit "$status"
