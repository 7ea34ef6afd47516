#!/usr/bin/env bash
# Installs every Debian package the build and the tests need, then configures and builds titan.cpp.
# Usage: scripts/setup.sh [build-dir] [cmake options]   (default: build; e.g. build-portable -DTITAN_NATIVE=OFF
# for a build that runs on any x86-64 CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${1:-build}"
shift || true

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libopenblas-dev libopenblas0-openmp libomp-dev libdnnl-dev
  nlohmann-json3-dev libtomlplusplus-dev libcli11-dev
  libpcre2-dev libutf8proc-dev libxxhash-dev
  openmpi-bin libopenmpi-dev
  libgtest-dev libgmock-dev
  libboost-context-dev
  fortunes fortunes-min
  clang-format clang libclang-rt-dev
  qemu-user
)
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends "${PACKAGES[@]}"

# Use the OpenMP build of OpenBLAS so BLAS shares the OpenMP thread pool with our kernels
# (no oversubscription between a pthread BLAS pool and OpenMP regions).
if [ -e /usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3 ]; then
  $SUDO update-alternatives --set libblas.so.3-x86_64-linux-gnu \
    /usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3 || true
  $SUDO update-alternatives --set liblapack.so.3-x86_64-linux-gnu \
    /usr/lib/x86_64-linux-gnu/openblas-openmp/liblapack.so.3 || true
fi

# cuDNN's fused attention (src/device/cuda/sdpa_cudnn.cu) is written against cudnn-frontend, a header-only
# C++ library whose headers ship in the pinned PyPI wheel; they go into the build's _deps/, where CMake
# looks. The headers do not depend on the wheel's platform or Python tags, so those are fixed and the local
# Python does not matter. Without them (no network, no pip) the build goes on and attention runs the
# device's own kernels.
CUDNN_FRONTEND_VERSION=1.32.0
fetch_cudnn_frontend() {
  local dest="$BUILD_DIR/_deps/cudnn-frontend"
  # (the stamp: a change of the pinned version fetches again)
  [ -f "$dest/include/cudnn_frontend.h" ] && [ "$(cat "$dest/version" 2>/dev/null)" = "$CUDNN_FRONTEND_VERSION" ] &&
    return 0
  local tmp
  tmp=$(mktemp -d)
  if python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 --dest "$tmp" "nvidia-cudnn-frontend==$CUDNN_FRONTEND_VERSION" &&
    python3 -m zipfile -e "$tmp"/nvidia_cudnn_frontend-*.whl "$tmp/unpacked" &&
    [ -f "$tmp/unpacked/include/cudnn_frontend.h" ]; then
    mkdir -p "$dest"
    rm -rf "$dest/include"
    mv "$tmp/unpacked/include" "$dest/include"
    echo "$CUDNN_FRONTEND_VERSION" >"$dest/version"
    echo "cudnn-frontend $CUDNN_FRONTEND_VERSION headers in $dest/include"
  else
    echo "warning: could not fetch nvidia-cudnn-frontend==$CUDNN_FRONTEND_VERSION; building without cuDNN" \
      "fused attention (own attention kernels)" >&2
  fi
  rm -rf "$tmp"
}
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  fetch_cudnn_frontend
fi

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$BUILD_DIR" -j"$(nproc)"
