#!/usr/bin/env bash
# Packs the CUDA test, the test binaries with GPU cases (model, moe, train, lora, generate), the titan binary and the
# CUDA benches of a build with the non-system shared libraries
# they load (OpenBLAS, oneDNN, Open MPI, ...; not glibc, libstdc++ or CUDA's own: cuBLASLt and NCCL come
# from the GPU machine) for scripts/gpu_check.sh.
#   bash scripts/gpu_bundle.sh build out.tar.xz
set -euo pipefail
BUILD=$(realpath "${1:?build dir}")
DEST=$(realpath -m "${2:?output .tar.xz}")
STAGE=$(mktemp -d)
mkdir -p "$STAGE/lib"
for b in titan test_cuda test_model test_moe test_train test_lora test_generate bench_cuda_ops bench_train_step; do
  [ -x "$BUILD/$b" ] && cp "$BUILD/$b" "$STAGE/"
done
ldd "$STAGE"/titan "$STAGE"/test_* | awk '/=> \//{print $3}' | sort -u |
  grep -Ev '/(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|ld-linux[^/]*|libcuda|libcublas[A-Za-z]*|libcudart|libnccl)\.so' |
  while read -r lib; do cp -L "$lib" "$STAGE/lib/"; done
echo "$BUILD" > "$STAGE/built_at"
# The tests read fixtures under the source tree they were built from (TITAN_SOURCE_DIR).
grep -m1 '^CMAKE_HOME_DIRECTORY' "$BUILD/CMakeCache.txt" | cut -d= -f2 > "$STAGE/source_at"
tar cJf "$DEST" -C "$STAGE" .
rm -rf "$STAGE"
ls -la "$DEST"
