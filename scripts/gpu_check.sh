#!/usr/bin/env bash
# GPU check of the CUDA device on a machine that has the NVIDIA driver and CUDA 13 libraries but not
# titan's build dependencies: it runs binaries built elsewhere (scripts/gpu_bundle.sh packs them with the
# shared libraries they need) and writes its logs to $OUT (default ./gpu_out). Run it from the repository root
# (the tests read the fixtures there):
#   bash scripts/gpu_check.sh BUNDLE.tar.xz
set -uo pipefail
BUNDLE=${1:?bundle}
OUT=${OUT:-gpu_out}
mkdir -p "$OUT" /tmp/tb
nvidia-smi -L 2>&1 | tee "$OUT/gpu.txt"
tar xJf "$BUNDLE" -C /tmp/tb || exit 1
# cuBLASLt, NCCL, cuDNN and NVRTC come from the machine's CUDA.
source "$(dirname "$0")/gpu_libs.sh"
echo "cuBLASLt: $LT" | tee -a "$OUT/gpu.txt"
echo "NCCL: $NCCL" | tee -a "$OUT/gpu.txt"
echo "cuDNN: $CUDNN" | tee -a "$OUT/gpu.txt"
echo "NVRTC: $NVRTC" | tee -a "$OUT/gpu.txt"
# The tests call the titan binary by the path it was built at.
BUILT_AT=$(cat /tmp/tb/built_at)
mkdir -p "$(dirname "$BUILT_AT")" && ln -sfn /tmp/tb "$BUILT_AT"
# ... and the fixtures by the source path they were built from.
SOURCE_AT=$(cat /tmp/tb/source_at 2>/dev/null)
if [ -n "$SOURCE_AT" ] && [ ! -e "$SOURCE_AT/tests/golden" ]; then
  mkdir -p "$(dirname "$SOURCE_AT")" && ln -sfn "$PWD" "$SOURCE_AT"
fi
run() { env LD_LIBRARY_PATH="$TITAN_LD" OMP_NUM_THREADS=8 "$@"; }
run /tmp/tb/titan env 2>&1 | tee "$OUT/env.txt"
run timeout 100 /tmp/tb/test_cuda --gtest_color=no 2>&1 | tee "$OUT/test_cuda.txt"
rc=$?
# The GPU cases of the other rooms: golden fixtures through --device cuda, the 1-GPU vs CPU loss sequence.
for t in test_model test_moe test_train test_lora test_generate; do
  [ -x /tmp/tb/$t ] || continue
  run timeout 150 /tmp/tb/$t --gtest_color=no --gtest_filter='*Cuda*' 2>&1 | tee "$OUT/$t.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
# The op benchmark (GPU_CHECK_BENCH=0 skips it) and the sanitizers (GPU_CHECK_SANITIZE=0 skips them).
if [ "${GPU_CHECK_BENCH:-1}" = 1 ] && [ -x /tmp/tb/bench_cuda_ops ] && [ -f bench/cuda_ops.py ]; then
  PYTHONUNBUFFERED=1 timeout 150 python3 bench/cuda_ops.py --reps 20 \
    --titan "env LD_LIBRARY_PATH=$TITAN_LD /tmp/tb/bench_cuda_ops" 2>&1 | tee "$OUT/bench.txt"
fi
# Memory and shared-memory race checks where the machine's runtime supports them (not under gVisor).
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$SAN" ] && [ "${GPU_CHECK_SANITIZE:-1}" = 1 ]; then
  run timeout 90 "$SAN" --tool memcheck --error-exitcode 3 /tmp/tb/test_cuda --gtest_color=no \
    --gtest_filter=-Cuda.EnvListsGpus:Cuda.NcclGroupOfOneRank 2>&1 | tail -40 > "$OUT/memcheck.txt"
  run timeout 60 "$SAN" --tool racecheck --error-exitcode 3 /tmp/tb/test_cuda --gtest_color=no \
    --gtest_filter='Cuda.FlashAttention*:Cuda.AttentionKV*:Cuda.AttentionBf16*:Cuda.MoeRouter*:Cuda.QKNormRope*' 2>&1 | tail -40 > "$OUT/racecheck.txt"
fi
exit $rc
