#!/usr/bin/env bash
# Packed rows against one sample a row (data.packing, #51): the example's 1,200 conversations on a
# Qwen2-shaped model wide enough for the products to matter, as time per epoch. Both settings spend 1,024
# positions a step (16 rows x 64, 4 rows x 256 packed); one packed at 64 as well. Run interleaved, `rounds`
# times; each round's median step time (metrics_median.py) x the steps an epoch takes (the rows the run's
# log counts / the rows a step holds).
# Usage: bench/bench_packing.sh [ROUNDS] [STEPS]   (from the repository root, ds built in build/)
set -euo pipefail
rounds="${1:-2}" steps="${2:-20}"
ds="${DS_BIN:-build/ds}"
out="$(mktemp -d)"
model="model.hidden_size=512 model.intermediate_size=1408 model.num_layers=4 model.num_heads=8 model.num_kv_heads=2"
echo "== $ds train examples/sft.json $model train.steps=$steps train.eval_every=0 {settings}   ($(uptime | sed 's/.*load/load/'))"
for r in $(seq "$rounds"); do
  for setting in "unpacked-64 data.seq_len=64 train_micro_batch_size_per_gpu=16" \
                 "packed-256 data.seq_len=256 train_micro_batch_size_per_gpu=4 data.packing=true" \
                 "packed-64 data.seq_len=64 train_micro_batch_size_per_gpu=16 data.packing=true"; do
    name="${setting%% *}" args="${setting#* }"
    dir="$out/$name-$r"
    # shellcheck disable=SC2086
    "$ds" train examples/sft.json $model $args train.steps="$steps" train.eval_every=0 train.output_dir="$dir" 2> "$dir.log" > /dev/null
    rows=$(grep -o 'into [0-9,]* rows' "$dir.log" | tr -dc '0-9' || true)
    [ -n "$rows" ] || rows=1140  # one sample a row: the training samples
    batch=$(echo "$args" | grep -o 'micro_batch_size_per_gpu=[0-9]*' | cut -d= -f2)
    padding=$(grep -o '[0-9.]*% of the training rows' "$dir.log" | cut -d% -f1)
    line=$(python3 bench/metrics_median.py "$name" "$dir/metrics.jsonl")
    step_ms=$(echo "$line" | sed -E 's/.*step ([0-9.]+) ms.*/\1/')
    python3 -c "import sys; rows, batch, ms = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]); \
print(f'round $r $name: {rows} rows, ${padding}% padding, step {ms:.1f} ms, epoch {rows / batch * ms / 1e3:.2f} s')" "$rows" "$batch" "$step_ms"
  done
done
rm -rf "$out"
