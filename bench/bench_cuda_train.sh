#!/usr/bin/env bash
# ds train on one GPU beside PyTorch on the same card, in one call (scripts/device-check.sh runs it):
# GPT-2 124M, bf16, micro batch 16 x 1024 (examples/gpu-gpt2.json), then PyTorch eager with the same
# shapes (bench/pytorch_gpt2_cuda.py), then ds again, so a drifting card shows. Prints each run's
# tokens/s and memory; MFU by nanoGPT's formula against PEAK_TFLOPS (default 989, the H100/H200 dense
# bf16 figure). Then LoRA against full fine-tuning of a 1.1B Llama on the same GPU (step time, GPU memory;
# DS_BENCH_LORA=0 leaves it out), and torch.compile with DS_BENCH_COMPILE=1.
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
    grep -E "training on|step +[0-9]+|done:|GPU memory|peak resident|a step took" || true
  python3 bench/metrics_median.py "ds round $1" "$out/run$1/metrics.jsonl" 124439808 12 768 1024 "$peak" || true
  rm -rf "$out/run$1"
}
echo "== ds, round 1"
run_ds 1
echo "== pytorch eager"
python3 bench/pytorch_gpt2_cuda.py 12 768 12 50257 16 1024 "$steps" "$peak" || echo "pytorch eager failed"
echo "== ds, round 2"
run_ds 2
# LoRA against full fine-tuning on the GPU (#40): TinyLlama 1.1B's shape, bf16, micro batch 4 x 512, LoRA r 16 on
# every projection; median step time of the steps after the first two (metrics.jsonl) and the GPU memory line.
lora_model=${DS_LORA_PRESET:-tinyllama-1.1b}
lora='model.lora={"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}'
run_lora() {  # name, extra overrides...
  local name=$1
  shift
  "$ds" train examples/gpu-gpt2.json --device cuda "model.preset=$lora_model" train_micro_batch_size_per_gpu=4 data.seq_len=512 \
    train.steps=12 "train.output_dir=$out/$name" "$@" 2>&1 | grep -E "GPU memory|a step took|error" || true
  python3 bench/metrics_median.py "$name" "$out/$name/metrics.jsonl" || true
  rm -rf "${out:?}/$name"
}
if [ "${DS_BENCH_LORA:-1}" = 1 ]; then
  echo "== LoRA against full fine-tuning ($lora_model, bf16, 4 x 512)"
  run_lora full
  run_lora lora "$lora"
fi
if [ "${DS_BENCH_COMPILE:-0}" = 1 ]; then
  echo "== pytorch compiled"
  python3 bench/pytorch_gpt2_cuda.py 12 768 12 50257 16 1024 "$steps" "$peak" compile || echo "pytorch compiled failed"
fi
rm -rf "$out"
