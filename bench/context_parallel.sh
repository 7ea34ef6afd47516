#!/bin/bash
# Context parallel on the CPU: titan train on 1 rank (all cores) against CP C (C ranks, cores / C threads
# each), Qwen3-0.6B's width cut to 2 layers (small vocabulary, one sequence per step), at long sequences.
# Per layout: the peak memory of a rank (the allocator's, as the training log prints it) and tokens/s of
# the whole job, median over interleaved rounds (steps after the first two).
#
#   bench/context_parallel.sh [build dir] [C] [rounds] [seq_len ...]
set -euo pipefail
BUILD=${1:-build}
C=${2:-2}
ROUNDS=${3:-3}
shift $(($# < 3 ? $# : 3))
SEQS=("$@")
[ ${#SEQS[@]} -eq 0 ] && SEQS=(4096 8192)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for i in $(seq 4000); do printf 'the quick brown fox %d jumps over the lazy dog.\n%%\n' "$i"; done > "$TMP/corpus.txt"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MPI="mpirun --oversubscribe --bind-to none"
[ "$(id -u)" = 0 ] && MPI="$MPI --allow-run-as-root"
CORES=$(nproc)
run() {  # seq_len, ranks -> "memory_gib tps" of the last step
  local seq=$1 np=$2 threads=$((CORES / $2 > 0 ? CORES / $2 : 1)) cmd
  cmd=("$BUILD/titan" train --model.flavor=0.6B --model.num_hidden_layers=2 --model.vocab_size=1024
    --model.tokenizer_path="$ROOT/tests/golden/tokenizer/small" --training.dataset="$TMP/corpus.txt"
    --training.seq_len="$seq" --training.local_batch_size=1 --training.global_batch_size=1 --training.steps=4
    --training.sample_tokens=0 --training.val_fraction=0 --validation.enable=false
    --checkpoint.last_save_in_hf=false --metrics.peak_tflops=1 --job.dump_folder="$TMP/run")
  [ "$np" -gt 1 ] && cmd=($MPI -np "$np" -x OMP_NUM_THREADS="$threads" "${cmd[@]}" --parallelism.context_parallel_degree="$np")
  OMP_NUM_THREADS=$threads "${cmd[@]}" 2>&1 | awk '/^step: +4 /{for(i=1;i<=NF;i++){if($i=="memory:")m=$(i+1);if($i=="tps:")t=$(i+1)}} END{sub(/GiB.*/,"",m);print m, t}'
}
median() { sort -g | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }
echo "| seq_len | layout | peak memory per rank (GiB) | tokens/s (median of $ROUNDS) |"
echo "|---|---|---|---|"
for seq in "${SEQS[@]}"; do
  declare -A mem tps
  for r in $(seq "$ROUNDS"); do
    for np in 1 "$C"; do
      read -r m t < <(run "$seq" "$np")
      mem[$np]=$m
      tps[$np]="${tps[$np]:-} $t"
    done
  done
  for np in 1 "$C"; do
    label=$([ "$np" = 1 ] && echo "1 rank" || echo "CP $np")
    echo "| $seq | $label | ${mem[$np]} | $(tr ' ' '\n' <<<"${tps[$np]}" | grep . | median) |"
  done
  unset mem tps
done
