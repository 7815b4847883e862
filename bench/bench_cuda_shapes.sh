#!/usr/bin/env bash
# The issue's larger shapes on one GPU (scripts/device-check.sh runs it after bench_cuda_train.sh): GPT-2 1.5B
# (48 x 1600), bf16, micro batch 8 x 1024, ds then PyTorch eager with the same shapes (DS_BENCH_SHAPES_PYTORCH=0:
# ds alone); TinyLlama 1.1B's shape (GQA, SwiGLU, RoPE), bf16, micro batch 8 x 1024, ds alone. Median tokens/s, step time and MFU by nanoGPT's
# formula against PEAK_TFLOPS (default 989), and ds's GPU memory line beside its plan.
#   bench/bench_cuda_shapes.sh DS_BINARY [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
ds=$1
steps=${2:-12}
peak=${PEAK_TFLOPS:-989}
out=$(mktemp -d)
echo "command: bench/bench_cuda_shapes.sh $ds $steps (PEAK_TFLOPS=$peak)"
run_ds() {  # name, params, layers, width, overrides...
  local name=$1 params=$2 layers=$3 width=$4
  shift 4
  "$ds" train examples/gpu-gpt2.json --device cuda "train.steps=$steps" "train.output_dir=$out/$name" \
    steps_per_print=4 data.seq_len=1024 "$@" 2>&1 | grep -E "training on|GPU memory|error|done:" || true
  python3 bench/metrics_median.py "ds $name" "$out/$name/metrics.jsonl" "$params" "$layers" "$width" 1024 "$peak" || true
  rm -rf "${out:?}/$name"
}
echo "== ds, GPT-2 1.5B, 8 x 1024"
run_ds gpt2-xl 1557611200 48 1600 model.preset=gpt2-xl train_micro_batch_size_per_gpu=8
if [ "${DS_BENCH_SHAPES_PYTORCH:-1}" = 1 ]; then
  echo "== pytorch eager, GPT-2 1.5B, 8 x 1024"
  python3 bench/pytorch_gpt2_cuda.py 48 1600 25 50257 8 1024 "$steps" "$peak" || echo "pytorch eager failed"
fi
echo "== ds, TinyLlama 1.1B, 8 x 1024"
run_ds tinyllama 1100048384 22 2048 model.preset=tinyllama-1.1b train_micro_batch_size_per_gpu=8
rm -rf "$out"
