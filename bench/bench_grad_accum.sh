#!/usr/bin/env bash
# The cost of summing bf16 gradients in fp32 (data_types.grad_accum_dtype fp32): the same bf16 run with and
# without it, interleaved (bf16, fp32, bf16, fp32, ...), tokens/s of each run's steps after the second, and the
# medians over the rounds with their ratio. What it adds per micro-batch is one pass over the gradients (a bf16
# read, an fp32 read and write, a bf16 zeroing: 12 bytes a parameter), so the cost falls as the micro-batch grows.
#
# usage: bench/bench_grad_accum.sh ROUNDS [KEY=VALUE ...]   (overrides for both runs)
#   e.g. bench/bench_grad_accum.sh 3 train_micro_batch_size_per_gpu=8
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n 2,9p "$0" >&2; exit 2; }
rounds="$1"
shift
out_dir="$(mktemp -d)"
trap 'rm -rf "$out_dir"' EXIT
# GPT-2's vocabulary and blocks cut to 4 x 256 (15.9M parameters), 8 micro-batches of 4 x 128 tokens a step.
common=(model.preset=gpt2 model.num_layers=4 model.hidden_size=256 model.num_heads=4 data.seq_len=128
        train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=8 train.steps=6 steps_per_print=1 train.eval_every=0
        data.val_fraction=0 "$@")
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
run() {  # tokens/s averaged over steps 3-6
  build/ds train examples/quickstart.json "${common[@]}" "$@" train.output_dir="$out_dir/run" --overwrite 2>&1 |
    grep -E '^step +[3-6]/' | sed -E 's/.*\| ([0-9,]+) tok\/s.*/\1/' | tr -d , | awk '{s += $1; n++} END {printf "%.0f\n", s / n}'
}
echo "command: bench/bench_grad_accum.sh $rounds $*"
bf16=() fp32=()
for ((r = 1; r <= rounds; r++)); do
  a=$(run) b=$(run data_types.grad_accum_dtype=fp32)
  bf16+=("$a") fp32+=("$b")
  echo "round $r: bf16 sums $a tok/s, fp32 sums $b tok/s"
done
ma=$(printf '%s\n' "${bf16[@]}" | median) mb=$(printf '%s\n' "${fp32[@]}" | median)
echo "median: bf16 sums $ma tok/s, fp32 sums $mb tok/s, ratio $(awk -v a="$ma" -v b="$mb" 'BEGIN {printf "%.3f", b / a}')"
