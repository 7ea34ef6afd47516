#!/usr/bin/env bash
# Builds bench/blas_engines.c once per CBLAS library installed from Debian (OpenBLAS OpenMP build, OpenBLAS
# pthread build, BLIS OpenMP build) and runs each on the same threads, one after the other.
# Usage: bench/blas_engines.sh [threads] [reps]        (BLIS: apt-get install libblis-openmp-dev)
set -euo pipefail
cd "$(dirname "$0")"
THREADS="${1:-$(nproc)}"
REPS="${2:-3}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
LIB=/usr/lib/x86_64-linux-gnu
# name | include dir | library directory (rpath, so the soname resolves to this build) | library file
ENGINES=(
  "openblas-openmp|$LIB/../../include/x86_64-linux-gnu|$LIB/openblas-openmp|libopenblas.so.0"
  "openblas-pthread|$LIB/../../include/x86_64-linux-gnu|$LIB/openblas-pthread|libopenblas.so.0"
  "blis-openmp|/usr/include/x86_64-linux-gnu/blis-openmp|$LIB/blis-openmp|libblis.so.4"
)
for e in "${ENGINES[@]}"; do
  IFS='|' read -r name inc dir file <<<"$e"
  if [ ! -e "$dir/$file" ]; then
    echo "$name: $dir/$file not installed, skipped" >&2
    continue
  fi
  gcc -O2 -fopenmp -DBLAS_NAME="\"$name\"" -I"$inc" blas_engines.c -o "$OUT/$name" \
    -L"$dir" -l:"$file" -Wl,-rpath,"$dir" -ldl
  # Each library reads its own thread-count variable; all get the same count.
  OMP_NUM_THREADS="$THREADS" OPENBLAS_NUM_THREADS="$THREADS" BLIS_NUM_THREADS="$THREADS" \
    "$OUT/$name" --reps "$REPS"
done
