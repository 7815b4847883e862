#!/usr/bin/env bash
# Training throughput of ds against a PyTorch eager loop of the same model, batch and precision,
# run side by side (interleaved rounds, medians) on this machine; each round's own ratio too, with the
# median and range of those (the figure that holds on a machine whose speed drifts over minutes). Debian's python3-torch has the
# same kernels as the LibTorch ds links. Prints tokens/s and the ratio ds / PyTorch.
#
# usage: bench/bench_train.sh [rounds] [steps per round] [sequence length] [model name pattern]
#        (needs build/ds and python3-torch; the pattern, an extended regex, picks rows: 'gpt2-6L|llama')
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-2}"
steps="${2:-4}"
seq="${3:-128}"
only="${4:-.}"
threads=2
py=/usr/bin/python3
"$py" -c "import torch" 2>/dev/null || { echo "bench_train: needs Debian's python3-torch (apt-get install python3-torch)" >&2; exit 1; }

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

# The same runs under glibc settings that keep freed memory in the heap, as ds does itself:
# separates what ds gains by its allocator policy from what it gains by its own kernels.
kept_heap="MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483647 MALLOC_TOP_PAD_=268435456"
# And with ds's whole environment: the allocator policy plus the short waits of idle OpenMP and OpenBLAS
# threads that ds train starts with (cli/main.cpp): what is left is ds's own kernels and engine.
ds_env="$kept_heap GOMP_SPINCOUNT=1000 OPENBLAS_THREAD_TIMEOUT=4"

ds_args() {  # "model overrides" precision: the config ds trains on (and plans, for the matmul shapes)
  local bf16=false
  [ "$2" = bf16 ] && bf16=true
  echo examples/quickstart.json "~model.preset" $1 model.max_position_embeddings=1024 train_micro_batch_size_per_gpu=4 \
    data.seq_len=$seq bf16.enabled="$bf16" train.steps=$((steps + 1)) train.eval_every=0 train.threads=$threads
}

# ds: median tokens/s over the timed steps of metrics.jsonl (the first step warms up), then the
# model TFLOP/s per token from plan.json and the peak-RSS line ds prints at the end.
ds_run() {  # "model overrides" precision
  local dir=/tmp/ds_bench_train
  rm -rf "$dir"  # ds never trains over an earlier run's directory
  build/ds train $(ds_args "$1" "$2") train.output_dir="$dir" 2>"$dir.log" >/dev/null
  local rate flops ratio
  rate=$(tail -n "$steps" "$dir/metrics.jsonl" | sed 's/.*"tokens_per_s": \([0-9.]*\).*/\1/' | median)
  flops=$("$py" -c "import json; j = json.load(open('$dir/plan.json')); print(j['train_flops_per_step'] / j['tokens_per_step'])")
  ratio=$(sed -n 's/.* \([0-9.]*\)x the plan.s.*/\1/p' "$dir.log")
  rm -rf "$dir"
  echo "$rate $flops $ratio"
}

# Each model: its name, ds's overrides, and the PyTorch script with its shape arguments (batch 4 x seq
# tokens, precision, steps and threads are appended).
gpt2() { echo "model.arch=gpt2 model.num_layers=$1 model.hidden_size=$2 model.num_heads=$3 model.vocab_size=$4"; }
llama() {
  echo "model.arch=llama model.num_layers=$1 model.hidden_size=$2 model.num_heads=$3 model.num_kv_heads=$4" \
    "model.intermediate_size=$5 model.vocab_size=$6 model.tie_word_embeddings=false model.rope_theta=10000"
}
models=(
  "gpt2-124M|$(gpt2 12 768 12 50257)|bench/pytorch_gpt2.py 12 768 12 50257"
  "gpt2-6L-384|$(gpt2 6 384 6 50257)|bench/pytorch_gpt2.py 6 384 6 50257"
  "llama-12L-768-gqa|$(llama 12 768 12 4 2048 32000)|bench/pytorch_llama.py 12 768 12 4 2048 32000"
)

echo "bench_train: $(build/ds --version | head -1); rounds=$rounds steps=$steps threads=$threads batch 4 x $seq tokens; command: $0 $*"
peak_fp32=$("$py" bench/matmul_peak.py fp32 $threads)
peak_bf16=$("$py" bench/matmul_peak.py bf16 $threads)
echo "matmul peak at 512x768x3072 (this run): fp32 $peak_fp32 TFLOP/s, bf16 $peak_bf16 TFLOP/s"
printf "%-18s %-5s %9s %9s %9s %9s %8s %8s %8s %6s %7s %6s %9s\n" model prec "ds tok/s" "torch" "torch-kh" "torch-env" \
  "vs torch" "vs t-kh" "vs t-env" MFU "shapes" "MFU@s" "RSS/plan"
for entry in "${models[@]}"; do
  IFS='|' read -r name overrides script <<< "$entry"
  [[ "$name" =~ $only ]] || continue
  for prec in fp32 bf16; do
    ds_all=(); pt_all=(); kh_all=(); env_all=(); ratio_all=(); flops=0; rss=0
    for ((r = 0; r < rounds; r++)); do
      read -r rate flops rss < <(ds_run "$overrides" "$prec")
      ds_all+=("$rate")
      pt_all+=("$("$py" $script 4 "$seq" "$prec" "$steps" "$threads")")
      kh_all+=("$(env $kept_heap "$py" $script 4 "$seq" "$prec" "$steps" "$threads")")
      env_all+=("$(env $ds_env "$py" $script 4 "$seq" "$prec" "$steps" "$threads")")
      # This round's ratio against its own neighbours: a machine whose speed drifts over minutes moves
      # both sides of a round together, so the ratios hold where the rates do not.
      ratio_all+=("$(echo "$rate / ${env_all[-1]}" | bc -l)")
    done
    d=$(printf "%s\n" "${ds_all[@]}" | median)
    t=$(printf "%s\n" "${pt_all[@]}" | median)
    k=$(printf "%s\n" "${kh_all[@]}" | median)
    e=$(printf "%s\n" "${env_all[@]}" | median)
    peak=$peak_fp32; [ "$prec" = bf16 ] && peak=$peak_bf16
    # The matmul rate at this model's own weight shapes, timed after the rounds (the plan lists them).
    build/ds plan $(ds_args "$overrides" "$prec") --json > /tmp/ds_bench_plan.json 2>/dev/null
    shapes=$("$py" bench/matmul_peak.py "$prec" $threads /tmp/ds_bench_plan.json $((4 * seq)))
    printf "%-18s %-5s %9.1f %9.1f %9.1f %9.1f %7.2fx %7.2fx %7.2fx %5.0f%% %7.3f %5.0f%% %8sx\n" "$name" "$prec" "$d" "$t" "$k" "$e" \
      "$(echo "$d / $t" | bc -l)" "$(echo "$d / $k" | bc -l)" "$(echo "$d / $e" | bc -l)" "$(echo "100 * $d * $flops / ($peak * 10^12)" | bc -l)" "$shapes" \
      "$(echo "100 * $d * $flops / ($shapes * 10^12)" | bc -l)" "$rss"
    sorted=$(printf "%s\n" "${ratio_all[@]}" | sort -g)
    printf "%-18s %-5s ds / torch-env per round: median %.2fx, range %.2f-%.2fx over %d rounds\n" "" "" \
      "$(echo "$sorted" | median)" "$(echo "$sorted" | head -1)" "$(echo "$sorted" | tail -1)" "$rounds"
  done
done
echo "torch = PyTorch eager as installed; torch-kh = the same with glibc keeping freed memory (ds's policy);"
echo "torch-env = with ds's whole environment: that and short idle waits (GOMP_SPINCOUNT=1000 OPENBLAS_THREAD_TIMEOUT=4);"
echo "MFU = model FLOPs/s (plan's 6N+attention per token) / the matmul peak above; shapes = the matmul rate"
echo "(TFLOP/s) at the model's own weight shapes and B*T rows (bench/matmul_peak.py; fp32: the faster of PyTorch's"
echo "mm and oneDNN's sgemm), MFU@s = against it;"
echo "RSS/plan = ds's peak RSS above its code-and-libraries baseline / the plan's predicted memory."
