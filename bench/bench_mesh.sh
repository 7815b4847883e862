#!/usr/bin/env bash
# Tensor or pipeline parallelism on the CPU: the same run (global batch, steps) on one rank, on 2 data-parallel
# ranks and on a tensor group or pipeline of 2, interleaved ROUNDS times. Per run: the median step time and
# tokens/s of its metrics.jsonl (the first two steps left out); per rank (a pipeline's stages differ) its peak
# resident memory, the part of it that is training's against the plan's figure for that rank, and its held
# states (train.log for rank 0, logs/rank_N.log for the others); the bytes rank 0 sent per step against the
# plan's. On 2 cores a group of 2 ranks shares them with nothing else: the figures to read are memory per rank
# and what the collectives, sends and the pipeline's bubble cost.
# Usage: bench/bench_mesh.sh tensor|pipeline [ROUNDS] [STEPS]     (needs build/ds)
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:?usage: bench/bench_mesh.sh tensor|pipeline [ROUNDS] [STEPS]}" rounds="${2:-2}" steps="${3:-12}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# A GPT-2 of 6 layers x 384 wide, fp32: large enough that its matrices, not the launches, take the step.
base="train examples/quickstart.json bf16.enabled=false model.num_layers=6 model.hidden_size=384 model.num_heads=6 \
train_batch_size=16 data.seq_len=128 train.eval_every=0 train.steps=$steps steps_per_print=1000"
declare -A how
case "$kind" in
  tensor)
    names="one data2 tensor2"
    how=([one]="train_micro_batch_size_per_gpu=16"
         [data2]="train_micro_batch_size_per_gpu=8 --nproc-per-node 2"
         [tensor2]="train_micro_batch_size_per_gpu=16 tensor_parallel.autotp_size=2 --nproc-per-node 2") ;;
  pipeline)
    # The same 16 samples a step in micro-batches of 4 (a pipeline's bubble (p-1)/(m+p-1) = 1/5) and of 2 (1/9).
    names="one data2 pipeline2 pipeline2-m8"
    how=([one]="train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=4"
         [data2]="train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=2 --nproc-per-node 2"
         [pipeline2]="train_micro_batch_size_per_gpu=4 gradient_accumulation_steps=4 pipeline.stages=2 --nproc-per-node 2"
         [pipeline2-m8]="train_micro_batch_size_per_gpu=2 gradient_accumulation_steps=8 pipeline.stages=2 --nproc-per-node 2") ;;
  *) echo "bench_mesh.sh: KIND is tensor or pipeline, not '$kind'" >&2; exit 2 ;;
esac
echo "== $kind; $(nproc) cores; $(uptime | sed 's/.*load/load/'); OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
for round in $(seq "$rounds"); do
  for name in $names; do
    dir="$work/$name-$round"
    cmd="build/ds $base ${how[$name]} train.output_dir=$dir"
    $cmd > "$work/out" 2>&1 || { cat "$work/out"; exit 1; }
    median=$(python3 bench/metrics_median.py "$name" "$dir/metrics.jsonl")
    sent=$( (grep -o "[a-z, ()-]*: [0-9.]* calls, [0-9.]* [KMG]*i*B ([0-9]* calls, [^)]*)" "$dir/train.log" || true) \
      | sed 's/^ *//' | paste -sd';' -)
    echo "round $round, $name: $median | rank 0 sent per step (plan): ${sent:-nothing}"
    for log in "$dir/train.log" "$dir"/logs/rank_*.log; do
      [[ -f "$log" ]] || continue
      rank=$(basename "$log" .log | sed 's/^train$/rank_0/')
      where=$(grep -o "this rank, of stage [0-9]* ([^)]*)" "$log" | head -1 || true)
      held=$(grep -o "held per rank (plan): .*" "$log" | head -1 | sed 's/held per rank (plan): //')
      peak=$(grep -o "peak resident memory [0-9.]* [KMG]iB" "$log" | head -1 | sed 's/resident memory //')
      training=$(grep -o "[0-9.]* [KMG]iB for training, [0-9.]*x the plan's [0-9.]* [KMG]iB" "$log" | head -1)
      echo "    $rank${where:+ (${where#this rank, of })}: $peak; $training; held $held"
    done
    echo "    ($cmd)"
  done
done
