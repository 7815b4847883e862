#!/usr/bin/env bash
# Start-up time of the commands CI scripts call in loops: wall seconds of each, RUNS times (default 20),
# median and max printed. None of them loads LibTorch (only `ds train` does, from libds_train.so).
#   bash bench/bench_startup.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-20}"
ds=build/ds
echo "# bash bench/bench_startup.sh $runs   ($(date -u +%F), $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg))"
for cmd in "--version" "plan templates/zero3.json" "estimate-memory --model 7b --gpus 8"; do
  times=()
  for _ in $(seq "$runs"); do
    start=$(date +%s%N)
    $ds $cmd >/dev/null 2>&1
    times+=($(( ($(date +%s%N) - start) / 1000 )))
  done
  sorted=($(printf '%s\n' "${times[@]}" | sort -n))
  median=${sorted[$(( runs / 2 ))]}
  max=${sorted[$(( runs - 1 ))]}
  awk -v c="ds $cmd" -v m="$median" -v x="$max" 'BEGIN { printf "%-42s median %6.1f ms   max %6.1f ms\n", c, m / 1000, x / 1000 }' 
done
echo "libraries mapped by ds: $(ldd $ds | grep -c '=>') ($(ldd $ds | grep -c torch) of LibTorch)"
