#!/usr/bin/env bash
# Tensor parallelism on the CPU: the same run (global batch, steps) on one rank, on 2 data-parallel ranks and
# on a tensor group of 2, interleaved ROUNDS times. Per run: the median step time and tokens/s of its
# metrics.jsonl (the first step left out), each rank's peak resident memory and its held states against the
# plan (train.log), and the bytes each rank sent per step against the plan's. On 2 cores a group of 2 ranks
# shares them with nothing else; the figure to read is memory per rank and the cost of the all-reduces.
# Usage: bench/bench_tensor_parallel.sh [ROUNDS] [STEPS]     (needs build/ds)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-2}" steps="${2:-12}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# A GPT-2 of 6 layers x 384 wide, fp32: large enough that its matrices, not the launches, take the step.
base="train examples/quickstart.json bf16.enabled=false model.num_layers=6 model.hidden_size=384 model.num_heads=6 \
train_batch_size=16 data.seq_len=128 train.eval_every=0 train.steps=$steps steps_per_print=1000"
echo "== $(nproc) cores; $(uptime | sed 's/.*load/load/'); OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
declare -A how=(
  [one]="train_micro_batch_size_per_gpu=16"
  [data2]="train_micro_batch_size_per_gpu=8 --nproc-per-node 2"
  [tensor2]="train_micro_batch_size_per_gpu=16 tensor_parallel.autotp_size=2 --nproc-per-node 2"
)
for round in $(seq "$rounds"); do
  for name in one data2 tensor2; do
    dir="$work/$name-$round"
    cmd="build/ds $base ${how[$name]} train.output_dir=$dir"
    $cmd > "$work/out" 2>&1 || { cat "$work/out"; exit 1; }
    median=$(python3 bench/metrics_median.py "$name" "$dir/metrics.jsonl")
    held=$(grep -o "held per rank (plan): .*" "$dir/train.log" | head -1)
    peak=$(grep -o "peak resident memory [0-9.]* [KMG]iB" "$dir/train.log" | head -1)
    sent=$( (grep -o "[a-z, -]*: [0-9.]* calls, [0-9.]* [KMG]*i*B ([0-9]* calls, [^)]*)" "$dir/train.log" || true) | sed 's/^ *//' | paste -sd';' -)
    echo "round $round, $name: $median | $peak (rank 0) | $held | ${sent:-nothing sent}"
    echo "    ($cmd)"
  done
done
