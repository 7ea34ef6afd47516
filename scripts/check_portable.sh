#!/usr/bin/env bash
# Builds titan portably (-DTITAN_NATIVE=OFF) and runs the kernel, golden-model and generation tests on an
# emulated AVX2-only CPU (qemu-user, -cpu EPYC-Rome: AVX2 + FMA, no AVX-512; QEMU implements no AVX-512, so
# any AVX-512 instruction that escaped the runtime dispatch is SIGILL). Proves that a build made on one
# x86-64 machine runs on another, whatever this machine's own CPU.
#   scripts/check_portable.sh [build-dir]   (default: build-portable; qemu-user from scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${1:-build-portable}"
CPU_MODEL=EPYC-Rome
command -v qemu-x86_64 > /dev/null || { echo "error: qemu-x86_64 not found (apt-get install qemu-user)" >&2; exit 1; }
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTITAN_NATIVE=OFF -DTITAN_CUDA=OFF > /dev/null
cmake --build "$BUILD_DIR" -j"$(nproc)" --target titan test_kernels test_model test_generate
run() {  # QEMU warns about CPUID bits its TCG lacks; those lines are noise here
  OMP_NUM_THREADS=1 qemu-x86_64 -cpu "$CPU_MODEL" "$@" 2> >(grep -v '^qemu-x86_64: warning: TCG' >&2)
}
run "$BUILD_DIR/titan" env | grep -E '^CPU ISA|^  (matmul_bf16|swiglu) '
run "$BUILD_DIR/titan" env | grep -q '^CPU ISA: avx2 detected' || { echo "error: the emulated CPU is not detected as avx2" >&2; exit 1; }
for t in test_kernels test_model test_generate; do
  echo "== $t on an emulated $CPU_MODEL (AVX2, no AVX-512)"
  run "$BUILD_DIR/$t" --gtest_brief=1
done
echo "portable build: every test passed on an AVX2-only CPU"
