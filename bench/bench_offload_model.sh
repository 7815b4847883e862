#!/usr/bin/env bash
# The plan's offload time model against a measured run on this machine (the CPU device): the host's memory rate
# measured first (bench/host_memory_rate.c: a copy with as many threads as ds uses), given to `ds plan
# --host-memory-bw`, and its predicted "optimizer step on the host" and copies between places set beside the
# optimizer and offload phases `ds train` measures (metrics.jsonl, median of the steps after the first two).
# Interleaved: each round measures the rate again, then runs the model.
#
# usage: bench/bench_offload_model.sh [PRESET=gpt2] [STEPS=8] [ROUNDS=2] [SCRATCH=/tmp/ds-offload-model]
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-gpt2} steps=${2:-8} rounds=${3:-2} dir=${4:-/tmp/ds-offload-model}
ds=${DS:-build/ds}
rm -rf "$dir" && mkdir -p "$dir"
cc -O2 -pthread -o "$dir/host_memory_rate" bench/host_memory_rate.c
threads=$(nproc)
echo "bench_offload_model: $($ds --version | head -1); $preset, optimizer offloaded to the host, $steps steps, $threads threads"
echo "command: $0 $*  (load before: $(cut -d' ' -f1-3 /proc/loadavg))"
for stage in 2 3; do
  for round in $(seq "$rounds"); do
    rate=$("$dir/host_memory_rate" "$threads")
    gbs=$(python3 -c "print(f'{$rate / 1e9:.2f}GB/s')")
    args=(examples/quickstart.json model.preset="$preset" data.seq_len=128 train_micro_batch_size_per_gpu=2 zero_optimization.stage="$stage"
          zero_optimization.offload_optimizer.device=cpu train.steps="$steps" train.eval_every=0 train.threads="$threads")
    "$ds" plan "${args[@]}" --device cpu --host-memory-bw "$gbs" --json > "$dir/plan.json"
    out="$dir/run_${stage}_$round"
    "$ds" train "${args[@]}" train.output_dir="$out" > "$out.log" 2>&1
    python3 - "$dir/plan.json" "$out/metrics.jsonl" "$stage" "$gbs" <<'PY'
import json, statistics, sys
plan = json.load(open(sys.argv[1]))["step_time"]
steps = [json.loads(l) for l in open(sys.argv[2]) if l.strip()][2:]
host = sum(r["seconds"] for r in plan["offload"] if r["what"] == "optimizer step on the host")
copies = sum(r["seconds"] for r in plan["offload"] if r["what"] != "optimizer step on the host" and r["resource"] != "nvme")
measured_opt = statistics.median(s["optimizer_s"] for s in steps)
measured_copy = statistics.median(s["offload_s"] for s in steps)
print(f"ZeRO {sys.argv[3]}, host {sys.argv[4]}: optimizer step on the host predicted {host * 1e3:7.1f} ms, measured {measured_opt * 1e3:7.1f} ms "
      f"({measured_opt / host:.2f}x); copies between places predicted {copies * 1e3:6.1f} ms, measured {measured_copy * 1e3:6.1f} ms "
      f"({measured_copy / copies if copies else 0:.2f}x)")
PY
  done
done
