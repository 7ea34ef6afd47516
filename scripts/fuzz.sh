#!/usr/bin/env bash
# libFuzzer runs of titan's parsers under AddressSanitizer + UndefinedBehaviorSanitizer (fuzz/README.md).
#
#   scripts/fuzz.sh [--smoke] [--parallel N] [SECONDS] [TARGET...]
#
# Builds build-fuzz/ with clang (-DTITAN_FUZZ=ON) and runs each target (default: every fuzz/fuzz_*.cpp)
# for SECONDS (default 600), N at a time (default 1). A target's corpus grows in
# build-fuzz/fuzz-corpus/<target>/, seeded from fuzz/corpus/<target>/; a finding (crash, sanitizer
# report, uncaught exception, timeout, out-of-memory) is saved as build-fuzz/fuzz-findings/<target>-*
# and fails the run. One summary line per target: executions, coverage (edges), features, corpus size.
# --smoke: build, then `ctest -L fuzz` in that build (5 seconds per target).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build-fuzz
SMOKE=0
PARALLEL=1
SECONDS_PER_TARGET=600
TARGETS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --parallel) PARALLEL="$2"; shift ;;
    [0-9]*) SECONDS_PER_TARGET="$1" ;;
    *) TARGETS+=("$1") ;;
  esac
  shift
done
if ! command -v clang++ >/dev/null; then
  echo "error: scripts/fuzz.sh needs clang++ (apt-get install clang libclang-rt-dev libomp-dev)" >&2
  exit 1
fi
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DTITAN_FUZZ=ON -DTITAN_BUILD_TESTS=OFF -DTITAN_CUDA=OFF >/dev/null
cmake --build "$BUILD" --target fuzz_targets -j"$(nproc)"
if [ "$SMOKE" = 1 ]; then
  exec ctest --test-dir "$BUILD" -L fuzz --output-on-failure -j"$(nproc)"
fi
if [ ${#TARGETS[@]} -eq 0 ]; then
  for f in fuzz/fuzz_*.cpp; do t=$(basename "$f" .cpp); TARGETS+=("${t#fuzz_}"); done
fi
mkdir -p "$BUILD/fuzz-findings" "$BUILD/fuzz-logs"
run_one() {
  local t="$1" secs="$2" build="$3"
  mkdir -p "$build/fuzz-corpus/$t"
  if "$build/fuzz_$t" -max_total_time="$secs" -rss_limit_mb=4096 -timeout=60 -print_final_stats=1 \
      -artifact_prefix="$build/fuzz-findings/$t-" "$build/fuzz-corpus/$t" "fuzz/corpus/$t" \
      >"$build/fuzz-logs/$t.log" 2>&1; then
    status=ok
  else
    status="FINDING (see $build/fuzz-logs/$t.log)"
  fi
  local done_line execs
  done_line=$(grep -E '^#[0-9]+[[:space:]]+(DONE|pulse|NEW|REDUCE|INITED)' "$build/fuzz-logs/$t.log" | tail -1 || true)
  execs=$(grep -E '^stat::number_of_executed_units' "$build/fuzz-logs/$t.log" | awk '{print $2}' || true)
  printf '%-16s %s  executions %s  %s\n' "$t" "$status" "${execs:-?}" \
    "$(echo "$done_line" | grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+/[0-9a-zA-Z]+' || true)"
  [ "$status" = ok ]
}
export -f run_one
printf '%s\n' "${TARGETS[@]}" | xargs -P "$PARALLEL" -I{} bash -c "run_one {} $SECONDS_PER_TARGET $BUILD"
