#!/usr/bin/env bash
# Everything a short GPU lease should run, in one call from the repository root: the CUDA tests and
# compute-sanitizer (scripts/gpu_check.sh, without the op benchmark: about 3 minutes), then the training-step
# comparison with PyTorch (bench/cuda_train_step.sh, TOTAL_TIMEOUT seconds, default 300). Logs go to $OUT.
# Fits one 540 s call.
#   bash scripts/gpu_session.sh BUNDLE.tar.xz [compare_cuda_train_step.py options]
set -uo pipefail
BUNDLE=${1:?bundle}
shift
OUT=${OUT:-gpu_out}
export OUT
mkdir -p "$OUT"
GPU_CHECK_BENCH=0 bash scripts/gpu_check.sh "$BUNDLE" 2>&1 | tee "$OUT/check.log"
check=${PIPESTATUS[0]}
TOTAL_TIMEOUT=${TOTAL_TIMEOUT:-300} bash bench/cuda_train_step.sh "$BUNDLE" "$@" 2>&1 | tee "$OUT/bench.log"
echo "gpu_check exit status: $check"
exit "$check"
