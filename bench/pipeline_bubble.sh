#!/bin/bash
# The pipeline bubble measured on the CPU against the schedule's formula: titan train on P pipeline ranks
# (one OpenMP thread each, one rank per core), Qwen3-0.6B's width cut to 4 layers (small vocabulary so
# the stages balance), for several micro-batch counts and schedules. titan prints each pipeline rank's idle
# share of the step (steps after the first) beside (p - 1) / (m + p - 1).
#
#   bench/pipeline_bubble.sh [build dir] [P]
set -euo pipefail
BUILD=${1:-build}
P=${2:-2}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for i in $(seq 400); do printf 'the quick brown fox %d jumps over the lazy dog.\n%%\n' "$i"; done > "$TMP/corpus.txt"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MPI="mpirun --oversubscribe --bind-to none"
[ "$(id -u)" = 0 ] && MPI="$MPI --allow-run-as-root"
for schedule in GPipe 1F1B; do
  for m in 2 4 8; do
    out=$(OMP_NUM_THREADS=1 $MPI -np "$P" "$BUILD/titan" train --model.flavor=0.6B --model.num_hidden_layers=4 \
      --model.vocab_size=1024 --model.tokenizer_path="$ROOT/tests/golden/tokenizer/small" \
      --training.dataset="$TMP/corpus.txt" --training.seq_len=128 --training.local_batch_size="$m" \
      --training.global_batch_size="$m" --training.steps=4 --training.sample_tokens=0 \
      --training.val_fraction=0 --validation.enable=false --checkpoint.last_save_in_hf=false \
      --metrics.peak_tflops=1 --parallelism.pipeline_parallel_degree="$P" \
      --parallelism.pipeline_parallel_schedule="$schedule" --job.dump_folder="$TMP/run" 2>&1)
    line=$(grep "pipeline: idle" <<<"$out" || { echo "$out" >&2; exit 1; })
    echo "$schedule m=$m: ${line#pipeline: }"
  done
done
