#!/usr/bin/env bash
# Throughput on a shared machine: ds and PyTorch eager (under ds's allocator settings) on GPT-2 6x384
# in bf16 (or fp32), B=4, T=128, 2 threads, quiet and beside one competing CPU-bound process
# (`yes > /dev/null`), interleaved. ds runs with the short waits it sets itself for idle OpenMP and
# OpenBLAS threads and with the libraries' defaults (GOMP_SPINCOUNT=300000, OPENBLAS_THREAD_TIMEOUT=28),
# so the table shows what the settings are worth.
#
# usage: bench/bench_contention.sh [rounds] [bf16|fp32]    (needs build/ds and python3-torch)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-2}"
prec="${2:-bf16}"
bf16=false
[ "$prec" = bf16 ] && bf16=true
py=/usr/bin/python3
kept_heap="MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483647 MALLOC_TOP_PAD_=268435456"
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

ds_rate() {  # extra environment for ds
  local dir=/tmp/ds_bench_contention
  rm -rf "$dir"
  env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT -u OPENBLAS_THREAD_TIMEOUT $1 build/ds train examples/quickstart.json "~model.preset" model.arch=gpt2 \
    model.num_layers=6 model.hidden_size=384 model.num_heads=6 model.vocab_size=50257 model.max_position_embeddings=1024 \
    train_micro_batch_size_per_gpu=4 data.seq_len=128 bf16.enabled=$bf16 train.steps=7 train.eval_every=0 train.threads=2 \
    train.output_dir="$dir" >/dev/null 2>&1
  tail -n 6 "$dir/metrics.jsonl" | sed 's/.*"tokens_per_s": \([0-9.]*\).*/\1/' | median
  rm -rf "$dir"
}
torch_rate() { env $kept_heap "$py" bench/pytorch_gpt2.py 6 384 6 50257 4 128 "$prec" 6 2; }

echo "bench_contention: $(build/ds --version | head -1); rounds=$rounds $prec; command: $0 $*"
declare -A all
for ((r = 0; r < rounds; r++)); do
  for load in quiet busy; do
    hog=""
    if [ "$load" = busy ]; then yes > /dev/null & hog=$!; fi
    all[ds-$load]+="$(ds_rate X=1) "
    all[ds-longspin-$load]+="$(ds_rate "GOMP_SPINCOUNT=300000 OPENBLAS_THREAD_TIMEOUT=28") "
    all[torch-$load]+="$(torch_rate) "
    if [ -n "$hog" ]; then kill "$hog"; wait "$hog" 2>/dev/null || true; fi
  done
done
printf "%-34s %10s %10s %9s\n" "run (tokens/s, median)" quiet busy slowdown
for who in ds ds-longspin torch; do
  q=$(printf "%s\n" ${all[$who-quiet]} | median)
  b=$(printf "%s\n" ${all[$who-busy]} | median)
  label=$who
  [ "$who" = ds ] && label="ds (its short waits)"
  [ "$who" = ds-longspin ] && label="ds (the libraries' default waits)"
  [ "$who" = torch ] && label="PyTorch eager (torch-kh)"
  printf "%-38s %6.1f %10.1f %8.2fx\n" "$label" "$q" "$b" "$(echo "$q / $b" | bc -l)"
done
echo "busy = beside one \`yes > /dev/null\` on this $(nproc)-CPU machine: a fair share leaves a 2-thread run 2/3 of"
echo "the CPU (1.5x slower at best)."
