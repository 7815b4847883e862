#!/usr/bin/env bash
# ZeRO across local ranks: step time, bytes sent per step and model-state bytes per rank for every
# stage at 1, 2 and 4 ranks, the same global batch throughout (16 x 128 tokens), each beside the
# plan's prediction. On a 2-core machine the ranks share the cores (threads per rank = 2 / ranks),
# so step times show the cost of communication and sharding, not a speed-up. "comm s" is the time a
# rank was held up by collectives per step (a reduce running beside backward counts only its wait).
#
# usage: bench/bench_zero.sh [steps]              (needs build/ds)
#        bench/bench_zero.sh [steps] --pairs N    stage 0 and stage 3 on 2 ranks, interleaved N times:
#                                                  #17's "stage 3 within 15% of stage 0" as a ratio per pair
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-5}"
py=/usr/bin/python3
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

echo "bench_zero: $(build/ds --version | head -1); steps=$steps; command: $0 $*"
echo "model gpt2 6 layers x 384, vocab 50257 (29.9M parameters), fp32, AdamW; global batch 16 x 128 tokens"
printf "%-6s %-6s %-8s %9s %9s %9s %14s %14s %16s %16s\n" stage ranks overlap "step s" "tok/s" "comm s" "sent MiB/step" "(plan)" \
  "states MiB/rank" "(plan)"
# one configuration: stage, ranks, overlap_comm (default: DeepSpeed's, true at stage 3 only)
run() {
  local stage=$1 ranks=$2 overlap=${3:-}
  dir=/tmp/ds_bench_zero
  rm -rf "$dir"
  threads=$((2 / ranks)); [ "$threads" -lt 1 ] && threads=1
  launch=""; [ "$ranks" -gt 1 ] && launch="--nproc-per-node $ranks"
  extra=""; [ -n "$overlap" ] && extra="zero_optimization.overlap_comm=$overlap"
  build/ds train examples/quickstart.json "~model.preset" model.arch=gpt2 model.num_layers=6 model.hidden_size=384 \
    model.num_heads=6 model.vocab_size=50257 model.max_position_embeddings=1024 bf16.enabled=false \
    "~gradient_accumulation_steps" train_batch_size=16 train_micro_batch_size_per_gpu=4 data.seq_len=128 zero_optimization.stage=$stage \
    zero_optimization.stage3_param_persistence_threshold=auto train.steps=$((steps + 1)) train.eval_every=0 \
    train.save_every=0 train.threads=$threads train.output_dir="$dir" $launch $extra 2>"$dir.log" >/dev/null
  step_s=$(tail -n "$steps" "$dir/metrics.jsonl" | sed 's/.*"step_s": \([0-9.]*\).*/\1/' | median)
  comm_s=$(tail -n "$steps" "$dir/metrics.jsonl" | sed 's/.*"comm_s": \([0-9.]*\).*/\1/' | median)
  sent=$(tail -n "$steps" "$dir/metrics.jsonl" | sed 's/.*"comm_bytes": \([0-9.]*\).*/\1/' | median)
  read -r planned_sent planned_states overlap_used < <("$py" -c "
import json; p = json.load(open('$dir/plan.json')); m = p['memory']['device_per_rank']
print(sum(c['wire_bytes_per_rank_per_step'] for c in p['collectives']), m['params'] + m['grads'] + m['optimizer_states'],
      'on' if p['zero']['overlap_comm'] and p['zero']['stage'] >= 2 and $ranks > 1 else '-')")
  held=$("$py" -c "
import re, sys
line = [l for l in open('$dir/train.log') if 'held per rank' in l][0]
units = {'B': 1, 'KiB': 2**10, 'MiB': 2**20, 'GiB': 2**30}
vals = re.findall(r'(params|gradients|optimizer states) ([0-9.]+) (\w+)', line)
print(sum(float(v) * units[u] for _, v, u in vals))")
  printf "%-6s %-6s %-8s %9.3f %9.0f %9.3f %14.2f %14.2f %16.1f %16.1f\n" "$stage" "$ranks" "$overlap_used" "$step_s" \
    "$(echo "2048 / $step_s" | bc -l)" "$comm_s" "$(echo "$sent / 2^20" | bc -l)" "$(echo "$planned_sent / 2^20" | bc -l)" \
    "$(echo "$held / 2^20" | bc -l)" "$(echo "$planned_states / 2^20" | bc -l)"
}

if [ "${2:-}" = "--pairs" ]; then
  for i in $(seq "${3:-4}"); do
    run 0 2 | tee /tmp/ds_bench_zero_pair0
    run 3 2 | tee /tmp/ds_bench_zero_pair3
    awk -v i="$i" 'NR==FNR {s0=$4; next} {printf "pair %d: stage 3 / stage 0 = %.2fx\n", i, $4 / s0}' /tmp/ds_bench_zero_pair0 /tmp/ds_bench_zero_pair3
  done
  exit 0
fi

for ranks in 1 2 4; do
  for stage in 0 1 2 3; do
    [ "$ranks" = 1 ] && [ "$stage" != 0 ] && continue  # one rank: every stage is stage 0
    run "$stage" "$ranks"
  done
done
# overlap_comm flipped from its default at 2 ranks: the same run, reduces in flight during backward or not
run 2 2 true
run 3 2 false
