#!/usr/bin/env bash
# Training throughput of ds against a PyTorch eager loop of the same model, batch and precision,
# run side by side (interleaved rounds, medians) on this machine. Debian's python3-torch has the
# same kernels as the LibTorch ds links. Prints tokens/s and the ratio ds / PyTorch.
#
# usage: bench/bench_train.sh [rounds] [steps per round]    (needs build/ds and python3-torch)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-2}"
steps="${2:-4}"
threads=2
py=/usr/bin/python3
"$py" -c "import torch" 2>/dev/null || { echo "bench_train: needs Debian's python3-torch (apt-get install python3-torch)" >&2; exit 1; }

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

# ds tokens/s: the median over the timed steps of metrics.jsonl (the first step warms up).
ds_rate() {  # layers width heads vocab batch seq precision
  local dir=/tmp/ds_bench_train bf16=false
  [ "$7" = bf16 ] && bf16=true
  build/ds train examples/quickstart.json "~model.preset" model.arch=gpt2 model.num_layers="$1" model.hidden_size="$2" \
    model.num_heads="$3" model.vocab_size="$4" model.max_position_embeddings=1024 train_micro_batch_size_per_gpu="$5" \
    data.seq_len="$6" bf16.enabled="$bf16" train.steps=$((steps + 1)) train.eval_every=0 train.threads=$threads \
    train.output_dir="$dir" >/dev/null 2>&1
  tail -n "$steps" "$dir/metrics.jsonl" | sed 's/.*"tokens_per_s": \([0-9.]*\).*/\1/' | median
}

echo "bench_train: $(build/ds --version | head -1); rounds=$rounds steps=$steps threads=$threads; command: $0 $*"
printf "%-22s %-5s %12s %12s %8s\n" model prec "ds tok/s" "torch tok/s" ratio
for model in "12 768 12 50257 gpt2-124M" "6 384 6 50257 gpt2-6L-384"; do
  set -- $model
  for prec in fp32 bf16; do
    ds_all=(); pt_all=()
    for ((r = 0; r < rounds; r++)); do
      ds_all+=("$(ds_rate "$1" "$2" "$3" "$4" 4 128 "$prec")")
      pt_all+=("$("$py" bench/pytorch_gpt2.py "$1" "$2" "$3" "$4" 4 128 "$prec" "$steps" "$threads")")
    done
    d=$(printf "%s\n" "${ds_all[@]}" | median)
    t=$(printf "%s\n" "${pt_all[@]}" | median)
    printf "%-22s %-5s %12.1f %12.1f %7.2fx\n" "$5" "$prec" "$d" "$t" "$(echo "$d / $t" | bc -l)"
  done
done
