#!/usr/bin/env bash
# The plan against the live heap, apart from the allocator's slack and the libraries' own mappings that
# the resident figure also holds. Runs `ds train` under gdb with bench/heap_live.c preloaded: the counter
# restarts as the run report is set up, right after ds takes its memory baseline (before training allocates
# anything), and is read when the run finishes, beside ds's own closing line and the process's anonymous
# memory. Tensors of 64 KiB and more come from ds's block pool (engine/runtime/device/block_pool.hpp), not malloc:
# its own books give their most live bytes and the pool's high-water mark (what of it can be resident). It breaks on the RunReport constructor, not on ds::resident_bytes: stopping in that function's
# PLT stub raised the run's measured peak by 290 MiB (a gdb effect; bench/RESULTS.md).
#   bash bench/bench_heap.sh CONFIG [OVERRIDES...]
#   e.g. bash bench/bench_heap.sh examples/quickstart.json bf16.enabled=false
set -euo pipefail
cd "$(dirname "$0")/.."
command -v gdb >/dev/null || { echo "bench_heap: needs gdb (apt-get install gdb)" >&2; exit 2; }
[ $# -ge 1 ] || { sed -n '2,9p' "$0" >&2; exit 2; }
mkdir -p build
cc -O2 -shared -fPIC -o build/heap_live.so bench/heap_live.c
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/gdb" <<GDB
set pagination off
set breakpoint pending on
set environment LD_PRELOAD=$PWD/build/heap_live.so
break ds::RunReport::RunReport
commands
  silent
  call (void)heap_live_restart()
  set \$base = (long)heap_live_now()
  disable 1
  continue
end
break ds::RunReport::finish
commands
  silent
  printf "heap_live %ld %ld\n", \$base, (long)heap_live_most() - \$base
  set \$pool = 'ds::(anonymous namespace)::g_pool'->stats()
  printf "pool %ld %ld\n", (long)\$pool.peak_live_bytes, (long)\$pool.high_water_bytes
  info proc status
  continue
end
run
GDB
echo "# bash bench/bench_heap.sh $*   ($(date -u +%F), git $(git rev-parse --short HEAD))"
gdb -q -batch -x "$work/gdb" --args build/ds train "$@" train.output_dir="$work/run" >"$work/out" 2>&1 || true
line=$(grep -m1 '^heap_live ' "$work/out") || { tail -20 "$work/out" >&2; exit 1; }
read -r _ base most <<< "$line"
read -r _ pool_most pool_high <<< "$(grep -m1 '^pool ' "$work/out")"
plan=$(python3 -c "import json; print(json.load(open('$work/run/plan.json'))['memory']['device_per_rank']['total'])")
grep -m1 'peak resident memory' "$work/out" | sed 's/ (the plan leaves.*//'
grep -m1 '^RssAnon:' "$work/out" | awk '{ printf "anonymous resident at the end: %.2f MiB\n", $2 / 1024 }'
awk -v b="$base" -v m="$most" -v p="$plan" -v pm="$pool_most" -v ph="$pool_high" 'BEGIN {
  M = 1048576
  printf "live heap (malloc): %.2f MiB before training, at most %.2f MiB more during it\n", b / M, m / M
  printf "block pool: at most %.2f MiB live, high-water mark %.2f MiB (%.2fx)\n", pm / M, ph / M, (pm > 0 ? ph / pm : 0)
  printf "live, malloc + pool: at most %.2f MiB = %.2fx the plan'"'"'s %.2f MiB (each part at its own most: an upper bound)\n", (m + pm) / M, (m + pm) / p, p / M }'
