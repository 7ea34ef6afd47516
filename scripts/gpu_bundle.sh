#!/usr/bin/env bash
# Packs the CUDA test, the test binaries with GPU cases (model, moe, train, lora, generate), the titan binary and the
# CUDA benches of a build with the non-system shared libraries
# they load (OpenBLAS, oneDNN, Open MPI, ...; not glibc, libstdc++ or CUDA's own: cuBLASLt, NCCL, cuDNN and
# NVRTC come from the GPU machine, scripts/gpu_libs.sh) for scripts/gpu_check.sh.
#   scripts/setup.sh build-portable -DTITAN_NATIVE=OFF && bash scripts/gpu_bundle.sh build-portable out.tar.xz
set -euo pipefail
BUILD=$(realpath "${1:?build dir}")
DEST=$(realpath -m "${2:?output .tar.xz}")
# The GPU machine's CPU is not this one: the bundle is a portable build (kernels chosen by cpuid at run time).
if ! grep -q '^TITAN_NATIVE:BOOL=OFF' "$BUILD/CMakeCache.txt"; then
  echo "error: $BUILD is a -march=native build; bundle a portable one: scripts/setup.sh build-portable -DTITAN_NATIVE=OFF" >&2
  exit 1
fi
STAGE=$(mktemp -d)
mkdir -p "$STAGE/lib"
for b in titan test_cuda test_model test_moe test_train test_lora test_generate bench_cuda_ops bench_train_step; do
  [ -x "$BUILD/$b" ] && cp "$BUILD/$b" "$STAGE/"
done
ldd "$STAGE"/titan "$STAGE"/test_* | awk '/=> \//{print $3}' | sort -u |
  grep -Ev '/(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|ld-linux[^/]*|libcuda|libcublas[A-Za-z]*|libcudart|libnccl|libcudnn[A-Za-z_]*|libnvrtc)\.so' |
  while read -r lib; do cp -L "$lib" "$STAGE/lib/"; done
echo "$BUILD" > "$STAGE/built_at"
# The tests read fixtures under the source tree they were built from (TITAN_SOURCE_DIR).
grep -m1 '^CMAKE_HOME_DIRECTORY' "$BUILD/CMakeCache.txt" | cut -d= -f2 > "$STAGE/source_at"
tar cJf "$DEST" -C "$STAGE" .
rm -rf "$STAGE"
ls -la "$DEST"
