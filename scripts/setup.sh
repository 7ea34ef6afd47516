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

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$BUILD_DIR" -j"$(nproc)"
