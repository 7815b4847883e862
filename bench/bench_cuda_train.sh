#!/usr/bin/env bash
# ds train on one GPU beside PyTorch on the same card, in one call (scripts/device-check.sh runs it):
# GPT-2 124M, bf16, micro batch 16 x 1024 (examples/gpu-gpt2.json), then PyTorch eager with the same
# shapes (bench/pytorch_gpt2_cuda.py), then ds again, so a drifting card shows. Prints each run's
# tokens/s and memory; MFU by nanoGPT's formula against PEAK_TFLOPS (default 989, the H100/H200 dense
# bf16 figure).
#   bench/bench_cuda_train.sh DS_BINARY [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
ds=$1
steps=${2:-30}
peak=${PEAK_TFLOPS:-989}
out=$(mktemp -d)
echo "command: bench/bench_cuda_train.sh $ds $steps (PEAK_TFLOPS=$peak)"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
run_ds() {
  "$ds" train examples/gpu-gpt2.json --device cuda "train.steps=$steps" "train.output_dir=$out/run$1" steps_per_print=10 2>&1 |
    grep -E "training on|step +[0-9]+|done:|GPU memory|peak resident" || true
  rm -rf "$out/run$1"
}
echo "== ds, round 1"
run_ds 1
echo "== pytorch eager"
python3 bench/pytorch_gpt2_cuda.py 12 768 12 50257 16 1024 "$steps" "$peak" || echo "pytorch eager failed"
echo "== ds, round 2"
run_ds 2
if [ "${DS_BENCH_COMPILE:-0}" = 1 ]; then
  echo "== pytorch compiled"
  python3 bench/pytorch_gpt2_cuda.py 12 768 12 50257 16 1024 "$steps" "$peak" compile || echo "pytorch compiled failed"
fi
rm -rf "$out"
