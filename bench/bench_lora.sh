#!/usr/bin/env bash
# LoRA against full fine-tuning of one model at the same batch and precision, interleaved rounds (ds profile:
# nothing written): the step time, the peak memory ds measures for training against its plan's, and the
# memory LoRA saves, measured, against what the two plans say it saves.
#
# usage: bench/bench_lora.sh [rounds] [model preset] [seq] [lora r]   (needs build/ds)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-2}"
preset="${2:-tinyllama-1.1b}"
seq="${3:-256}"
r="${4:-16}"
lora="model.lora={\"r\": $r, \"alpha\": $((2 * r)), \"target_modules\": [\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\", \"gate_proj\", \"up_proj\", \"down_proj\"]}"
common=(examples/quickstart.json model.preset="$preset" bf16.enabled=true train_micro_batch_size_per_gpu=1 data.seq_len="$seq"
        train.threads=2 --steps 3 --warmup 1 --json)

# step seconds, training bytes measured, the plan's bytes
measure() {
  build/ds profile "${common[@]}" "$@" 2>/dev/null | python3 -c '
import json, sys
j = json.load(sys.stdin)
print(j["summary"]["step_latency_s"], j["memory"]["training_bytes"], j["memory"]["plan"]["total"])'
}

echo "# bench/bench_lora.sh $rounds $preset $seq $r   ($(date -u +%F), $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg))"
printf '%-6s %-5s %9s %12s %12s %7s\n' round run step_s train_GiB plan_GiB ratio
for i in $(seq 1 "$rounds"); do
  read -r fs fm fp < <(measure)
  read -r ls lm lp < <(measure "$lora")
  for row in "full $fs $fm $fp" "lora $ls $lm $lp"; do
    set -- $row
    printf '%-6s %-5s %9.3f %12.3f %12.3f %7.2f\n' "$i" "$1" "$2" "$(echo "$3 / 2^30" | bc -l)" "$(echo "$4 / 2^30" | bc -l)" "$(echo "$3 / $4" | bc -l)"
  done
  printf '%-6s %-5s %9.2fx %11.3f %12.3f   (measured saving / planned saving: %.3f)\n' "$i" "l/f" "$(echo "$ls / $fs" | bc -l)" \
    "$(echo "($fm - $lm) / 2^30" | bc -l)" "$(echo "($fp - $lp) / 2^30" | bc -l)" "$(echo "($fm - $lm) / ($fp - $lp)" | bc -l)"
done
