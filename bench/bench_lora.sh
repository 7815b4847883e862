#!/usr/bin/env bash
# Two ways to fine-tune one model at the same batch and precision, interleaved rounds (ds profile: nothing
# written): the step time, rank 0's peak memory for training against its plan's, and the memory the second
# saves, measured, against what the two plans say it saves.
#   full   (default) full fine-tuning against LoRA, one rank
#   zero3  LoRA on two ranks: the frozen base whole on every rank (ZeRO stage 2) against partitioned and
#          gathered block by block (stage 3)
#
# usage: bench/bench_lora.sh [rounds] [model preset] [seq] [lora r] [full|zero3]   (needs build/ds)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-2}"
preset="${2:-tinyllama-1.1b}"
seq="${3:-256}"
r="${4:-16}"
compare="${5:-full}"
lora="model.lora={\"r\": $r, \"alpha\": $((2 * r)), \"target_modules\": [\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\", \"gate_proj\", \"up_proj\", \"down_proj\"]}"
common=(examples/quickstart.json model.preset="$preset" bf16.enabled=true train_micro_batch_size_per_gpu=1 data.seq_len="$seq"
        --steps 3 --warmup 1 --json)
case "$compare" in
  full) common+=(train.threads=2); a=(); b=("$lora"); names=(full lora) ;;
  zero3) common+=(train.threads=1 --nproc-per-node 2 "$lora"); a=(zero_optimization.stage=2); b=(zero_optimization.stage=3); names=(stage2 stage3) ;;
  *) echo "unknown comparison '$compare' (full or zero3)" >&2; exit 2 ;;
esac

# step seconds, training bytes measured, the plan's bytes
measure() {
  build/ds profile "${common[@]}" "$@" 2>/dev/null | python3 -c '
import json, sys
j = json.load(sys.stdin)
print(j["summary"]["step_latency_s"], j["memory"]["training_bytes"], j["memory"]["plan"]["total"])'
}

echo "# bench/bench_lora.sh $rounds $preset $seq $r $compare   ($(date -u +%F), $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg))"
printf '%-6s %-7s %9s %12s %12s %7s\n' round run step_s train_GiB plan_GiB ratio
for i in $(seq 1 "$rounds"); do
  read -r as am ap < <(measure "${a[@]}")
  read -r bs bm bp < <(measure "${b[@]}")
  for row in "${names[0]} $as $am $ap" "${names[1]} $bs $bm $bp"; do
    set -- $row
    printf '%-6s %-7s %9.3f %12.3f %12.3f %7.2f\n' "$i" "$1" "$2" "$(echo "$3 / 2^30" | bc -l)" "$(echo "$4 / 2^30" | bc -l)" "$(echo "$3 / $4" | bc -l)"
  done
  printf '%-6s %-7s %9.2fx %11.3f %12.3f   (measured saving / planned saving: %.3f)\n' "$i" "2nd/1st" "$(echo "$bs / $as" | bc -l)" \
    "$(echo "($am - $bm) / 2^30" | bc -l)" "$(echo "($ap - $bp) / 2^30" | bc -l)" "$(echo "($am - $bm) / ($ap - $bp)" | bc -l)"
done
