#!/usr/bin/env bash
# The GPU checks, sized to a short lease: for a machine with an NVIDIA GPU, CUDA LibTorch (python3 -c
# 'import torch') and no network. Unpacks .device-deps/ (scripts/fetch-device-deps.sh fills it on a Debian 12
# machine), configures ds against that LibTorch in build-device/ (kept between calls on a warm machine) and
# runs the stages asked for, in order:
#   build    ds first, then the GPU test binaries (ninja -k 0: one failing target stops nothing else)
#   bench    the quickstart on the GPU; ds profile of GPT-2 124M there (phases and blocks on the GPU's clock, MFU,
#            the GPU's memory beside the plan's); ds beside PyTorch eager (bench/bench_cuda_train.sh, no final
#            checkpoint; DS_BENCH_COMPILE=1 adds torch.compile); GPT-2 1.5B and TinyLlama's shape
#            (bench/bench_cuda_shapes.sh); offload from the GPU against the plan's time model
#            (bench/bench_offload_model.sh); the CUDA optimizer kernels (bench_cuda_optimizers); TinyLlama's
#            attention with k and v repeated against enable_gqa (bench/probe_sdpa_gqa.py)
#   profile  each kernel's time over about two steps of GPT-2 124M, then of TinyLlama's shape, then of LoRA on it
#            (Nsight Compute, one metric, clocks as found): ncu.csv, ncu-llama.csv and ncu-lora.csv, summed by
#            scripts/ncu_summary.py
#   offload  bench's offload steps alone: GPT-2 124M at ZeRO 2 and 3, a ds profile of its host's offload work (and a
#            trace), GPT-2 1.5B at ZeRO 2 with 4 micro steps a step
#            (run before bench, bench leaves them out; about 2-4 minutes)
#   tests    every test labelled gpu or link (kernels against the CPU's, the NCCL group, ds train on the GPU)
#   size     (not in the default stages) ZeRO-Offload's size case: Llama-3-8B's shape fully fine-tuned on one GPU
#            with the optimizer on the host (ZeRO 2; about 105 GiB of host memory), 4 steps: peak device and
#            host memory against the plan, the loss, the step's phases (in bench.log)
#   sanitize (not in the default stages) compute-sanitizer's memcheck over the CUDA kernel tests and over a
#            3-step ds train of the quickstart on the GPU in bf16 and in fp16 (in tests.log)
# Every step runs under a time limit and is skipped, saying so, when the budget (DS_DEVICE_BUDGET_S, default
# 540 s from the start) has less left than the step's estimate. Logs go to LOGS (default $OUT, else
# ./device-logs), at most 8 files so a device call brings all of them back.
#   scripts/device-check.sh [--dry-run] [--stages build,bench,offload,profile,tests,size,sanitize] [LOGS]   (in the order given)
# --dry-run runs here, without a GPU: every file, package, script and build target the stages use is
# checked to be there, so no device minute is spent on a missing one.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
stages=build,bench,profile,tests
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) dry=1 ;;
    --stages) stages=$2; shift ;;
    --stages=*) stages=${1#--stages=} ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) break ;;
  esac
  shift
done
logs="${1:-${OUT:-device-logs}}"
mkdir -p "$logs"
budget=${DS_DEVICE_BUDGET_S:-540}
steps=${DS_BENCH_STEPS:-30}
build=$PWD/build-device
status=0
say() { echo "$*" | tee -a "$logs/summary.log"; }
# step LOG ESTIMATE_S LIMIT_S NAME COMMAND...: appends the command's output to LOGS/LOG.log; skipped when
# fewer than ESTIMATE_S seconds of the budget are left; stopped after LIMIT_S (or what is left).
step() {
  local log=$1 estimate=$2 limit=$3 name=$4
  shift 4
  local left=$((budget - SECONDS))
  if [ "$left" -lt "$estimate" ]; then
    say "== $name: skipped ($left s of the budget left, it needs about $estimate)"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name ($(date -u +%T))" >>"$logs/$log.log"
  local t0=$SECONDS rc=0
  timeout --kill-after=10 "$limit" "$@" >>"$logs/$log.log" 2>&1 || rc=$?
  if [ "$rc" -eq 0 ]; then
    say "== $name: ok ($((SECONDS - t0)) s)"
  else
    say "== $name: FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ", stopped at $limit s"), $((SECONDS - t0)) s): tail of $log.log"
    tail -n 25 "$logs/$log.log"
    [ "$status" -eq 0 ] && status=$rc
  fi
}
need() {  # a file the stages read
  if [ ! -e "$1" ]; then say "== missing: $1"; status=2; fi
}

need .device-deps
ls .device-deps/*.deb >/dev/null 2>&1 || { say "== no .device-deps/*.deb: run scripts/fetch-device-deps.sh on a Debian 12 machine and carry .device-deps"; exit 2; }
for f in examples/gpu-gpt2.json examples/quickstart.json examples/gpu-offload-speculative.json bench/bench_cuda_train.sh bench/bench_cuda_shapes.sh bench/bench_offload_model.sh \
  bench/host_memory_rate.c bench/pytorch_gpt2_cuda.py bench/metrics_median.py bench/probe_sdpa_gqa.py scripts/ncu_summary.py; do
  need "$f"
done
targets_ds=(ds)
# The sanitize stage's overrides of the quickstart (bf16 there already) for each precision.
memcheck_precision() { [ "$1" = fp16 ] && echo "bf16.enabled=false fp16.enabled=true" || echo "bf16.enabled=true"; }
targets_tests=(ds_cuda_tests ds_nccl_tests ds_cuda_device_tests ds_link_tests bench_cuda_optimizers)

if [ "$dry" = 1 ]; then
  # Here: the scripts parse, the Python compiles, the packages unpack, the targets exist in a configured tree.
  bash -n bench/bench_cuda_train.sh && bash -n bench/bench_cuda_shapes.sh && bash -n bench/bench_offload_model.sh || status=3
  python3 -m py_compile bench/pytorch_gpt2_cuda.py bench/metrics_median.py bench/probe_sdpa_gqa.py scripts/ncu_summary.py || status=3
  for f in .device-deps/*.deb; do dpkg-deb --info "$f" >/dev/null || { say "== broken package $f"; status=3; }; done
  probe=${DS_BUILD_DIR:-build}
  if [ -f "$probe/build.ninja" ]; then
    for t in "${targets_ds[@]}" "${targets_tests[@]}"; do
      ninja -C "$probe" -t query "$t" >/dev/null 2>&1 || { say "== target $t is not in $probe (configured without the CUDA toolkit?)"; status=3; }
    done
  else
    say "== no configured tree at $probe: targets not checked"
  fi
  if [ -x "$probe/ds" ]; then
    for shape in "" "model.preset=gpt2-xl train_micro_batch_size_per_gpu=8" "model.preset=tinyllama-1.1b train_micro_batch_size_per_gpu=8"; do
      # shellcheck disable=SC2086
      "$probe/ds" plan examples/gpu-gpt2.json $shape >/dev/null 2>&1 || { say "== ds plan examples/gpu-gpt2.json $shape failed"; status=3; }
    done
    # The size stage's plan: it must fit an H200 and the machine's 128 GiB of host memory.
    "$probe/ds" plan examples/gpu-gpt2.json --device cuda --gpu h200 --host-memory 128GiB model.preset=llama-3-8b data.seq_len=2048 \
      train_micro_batch_size_per_gpu=8 zero_optimization.stage=2 zero_optimization.offload_optimizer.device=cpu \
      model.activation_checkpointing=true --json 2>/dev/null | python3 -c 'import json,sys; f=json.load(sys.stdin)["fit"]; sys.exit(0 if f["device"]=="fits" and f["host"]=="fits" else 1)' \
      || { say "== the size stage's plan does not fit an H200 with 128 GiB of host memory"; status=3; }
    # The offload benchmark's plans (ZeRO 2 and 3, the optimizer on the host; GPT-2 1.5B at ZeRO 2) as the GPU machine makes them.
    for case in "gpt2 2 1" "gpt2 3 1" "gpt2-xl 2 4"; do
      set -- $case
      "$probe/ds" plan examples/gpu-gpt2.json model.preset=$1 train_micro_batch_size_per_gpu=8 zero_optimization.stage=$2 gradient_accumulation_steps=$3 \
        zero_optimization.offload_optimizer.device=cpu --device cuda --gpu h200 --host-memory 128GiB --host-memory-bw 20GB/s --json 2>/dev/null |
        python3 -c 'import json,sys; f=json.load(sys.stdin)["fit"]; sys.exit(0 if f["device"]=="fits" and f["host"]=="fits" else 1)' ||
        { say "== ds plan of the GPU offload benchmark ($1, ZeRO $2) failed or does not fit an H200 with 128 GiB of host memory"; status=3; }
    done
    "$probe/ds" plan examples/gpu-gpt2.json model.preset=tinyllama-1.1b train_micro_batch_size_per_gpu=4 data.seq_len=512 \
      'model.lora={"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}' \
      >/dev/null 2>&1 || { say "== ds plan of the LoRA profile's run failed"; status=3; }
    # The sanitize stage's training runs: their plans on a GPU.
    for precision in bf16 fp16; do
      # shellcheck disable=SC2046
      "$probe/ds" plan examples/quickstart.json --device cuda $(memcheck_precision "$precision") train.steps=3 >/dev/null 2>&1 ||
        { say "== ds plan of the sanitize stage's $precision run failed"; status=3; }
    done
    # The bench stage's ds profile: its arguments parse and its plan is runnable but for this build's missing CUDA.
    "$probe/ds" plan examples/gpu-gpt2.json --device cuda >/dev/null 2>&1 || { say "== ds plan of the GPU profile's run failed"; status=3; }
    "$probe/ds" profile examples/gpu-gpt2.json --device cpu --warmup 1 --steps 1 --module-depth 2 train.steps=2 data.seq_len=64 \
      train_micro_batch_size_per_gpu=2 bf16.enabled=false >/dev/null 2>&1 || { say "== ds profile of examples/gpu-gpt2.json failed on the CPU"; status=3; }
    # The benchmark's and the profile's readers, on a short CPU run's metrics and a two-kernel profile.
    scratch=$(mktemp -d)
    "$probe/ds" train examples/quickstart.json train.steps=4 "train.output_dir=$scratch/run" >/dev/null 2>&1 &&
      python3 bench/metrics_median.py "dry run" "$scratch/run/metrics.jsonl" 124439808 12 768 1024 989 >/dev/null ||
      { say "== ds train or bench/metrics_median.py failed on a CPU run"; status=3; }
    printf '%s\n' '"ID","Kernel Name","gpu__time_duration.sum"' '"","","nsecond"' '"0","gemm_a","1,000"' '"1","ds::adam_kernel","500"' >"$scratch/ncu.csv"
    python3 scripts/ncu_summary.py "$scratch/ncu.csv" >/dev/null || { say "== scripts/ncu_summary.py failed on a sample"; status=3; }
    rm -rf "$scratch"
  fi
  say "== dry run: $([ "$status" -eq 0 ] && echo ok || echo "FAILED ($status)") (stages $stages, budget $budget s)"
  exit "$status"
fi

step build 20 30 machine bash -c 'nvidia-smi; nvcc --version || /usr/local/cuda/bin/nvcc --version; nproc; free -g; python3 -c "import torch; print(torch.__version__, torch.version.cuda)"; which ncu compute-sanitizer'

pfx=/tmp/ds-device-prefix
if [ ! -d "$pfx/usr/include/nlohmann" ]; then
  rm -rf "$pfx" && mkdir -p "$pfx"
  for f in .device-deps/*.deb; do dpkg -x "$f" "$pfx"; done
fi
L="$pfx/usr/lib/x86_64-linux-gnu"
export LD_LIBRARY_PATH="$L:$L/hdf5/serial:${LD_LIBRARY_PATH:-}"
export PATH="/usr/local/cuda/bin:$PATH"
# DS_TORCH_PREFIX: where LibTorch's CMake package is (default: the python3 torch's).
torch_prefix="${DS_TORCH_PREFIX:-$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')}"
# NCCL: the system's headers; the library from PyTorch's wheels (nvidia-nccl-*) when the system has none.
nccl_lib="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)"
nccl_flag=()
if [ -n "$nccl_lib" ] && ls "$nccl_lib"/libnccl.so* >/dev/null 2>&1; then
  nccl_flag=("-DNCCL_LIBRARY=$(ls "$nccl_lib"/libnccl.so* | head -n 1)")
  export LD_LIBRARY_PATH="$nccl_lib:$LD_LIBRARY_PATH"
fi
# The CUDA runtime: PyTorch's own (its wheels'), not the toolkit's, so the process holds one runtime, the
# one LibTorch and its cuBLAS were built with.
cudart_flag=()
nv_root="$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)"
cudart_lib="$( [ -n "$nv_root" ] && find "$nv_root" -name 'libcudart.so.*' 2>/dev/null | sort | head -n 1)"
if [ -n "$cudart_lib" ]; then
  cudart_flag=("-DDS_CUDART_LIBRARY=$cudart_lib")
  export LD_LIBRARY_PATH="$(dirname "$cudart_lib"):$LD_LIBRARY_PATH"
fi
export DS_BUILD_DIR=$build
jobs="$(nproc)"

stage_build() {
  step build 40 120 configure cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDS_BUILD_TESTS=ON \
    -DCMAKE_PREFIX_PATH="$pfx/usr;$torch_prefix" -DCMAKE_CXX_FLAGS="-isystem $pfx/usr/include" \
    -DHDF5_C_LIBRARIES="$L/hdf5/serial/libhdf5.so" -DVALIJSON_INCLUDE_DIR="$pfx/usr/include" \
    -DCMAKE_SHARED_LINKER_FLAGS="-L$L" -DCMAKE_EXE_LINKER_FLAGS="-L$L" "${nccl_flag[@]}" "${cudart_flag[@]}" \
    -DCMAKE_CUDA_HOST_COMPILER="$(command -v g++ || command -v c++)"
  step build 60 360 build-ds cmake --build "$build" -j "$jobs" --target "${targets_ds[@]}" -- -k 0
  [ -x "$build/ds" ] && step build 5 30 ds-env bash -c "'$build/ds' --version && '$build/ds' env"
}

stage_bench() {
  [ -x "$build/ds" ] || return 0
  step bench 30 90 quickstart-gpu "$build/ds" train examples/quickstart.json train.steps=100 "train.output_dir=/tmp/ds-qs-run"
  rm -rf /tmp/ds-qs-run
  # Where a GPT-2 124M bf16 step at 16 x 1024 goes, by phase and block (each block's attention and MLP apart).
  step bench 30 90 ds-profile-gpt2 "$build/ds" profile examples/gpu-gpt2.json --device cuda --warmup 2 --steps 3 --module-depth 2
  step bench 90 240 bench-cuda-train bench/bench_cuda_train.sh "$build/ds" "$steps"
  step bench 60 150 bench-cuda-shapes bench/bench_cuda_shapes.sh "$build/ds" "${DS_BENCH_SHAPE_STEPS:-12}"
  # #54: TinyLlama's attention with k and v repeated (ds today) against enable_gqa, and the kernels each runs.
  step bench 20 60 probe-sdpa-gqa python3 bench/probe_sdpa_gqa.py
  [ "$offload_done" = 1 ] || stage_offload
}

# ZeRO-Offload from the GPU: measured host step and PCIe copies against the plan's time model, and the slowdown
# (also part of bench; a stage of its own so a short lease can run it before the rest of bench).
offload_done=0
stage_offload() {
  [ -x "$build/ds" ] || return 0
  offload_done=1
  # (with the speculative step's pair at ZeRO 2: #55's step during the last backward, measured)
  step bench 80 200 offload-model env DS_DEVICE=cuda DS="$build/ds" DS_OFFLOAD_SPECULATIVE=1 bench/bench_offload_model.sh gpt2 8 1 /tmp/ds-offload-model
  # The host's offload work row by row beside the plan's rows at the host memory's rate just measured (the report in
  # bench.log; its spans beside the blocks in a trace left in /tmp: the logs hold at most 8 files): GPT-2 124M with the
  # speculative step. Session 66 measured such an offloaded step at 1.4x the plan's prediction: which row is off.
  local rate=20GB/s
  [ -x /tmp/ds-offload-model/host_memory_rate ] &&
    rate=$(python3 -c "print(f'{$(/tmp/ds-offload-model/host_memory_rate "$(nproc)") / 1e9:.2f}GB/s')")
  step bench 40 120 offload-profile "$build/ds" profile examples/gpu-offload-speculative.json --device cuda model.preset=gpt2 \
    model.activation_checkpointing=false --steps 3 --warmup 2 --host-memory-bw "$rate" --trace /tmp/ds-offload-trace.json
  # #55's speed case: GPT-2 1.5B at 4 micro steps of 8 x 1024 a step, where the GPU's step is long enough beside the
  # host's for the 0.5x target (the plan: 0.53x at the H200 host's 82 GB/s, 0.28x at one micro step).
  step bench 90 200 offload-model-xl env DS_DEVICE=cuda DS="$build/ds" DS_OFFLOAD_STAGES=2 DS_OFFLOAD_GAS=4 \
    bench/bench_offload_model.sh gpt2-xl 5 1 /tmp/ds-offload-model
}

stage_profile() {
  [ -x "$build/ds" ] || return 0
  # Kernels 2000..4499 of an 8-step run: past the first step's allocations, about two whole steps.
  if command -v ncu >/dev/null; then
    step profile 60 150 ncu-gpt2 ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
      --launch-skip "${DS_NCU_SKIP:-2000}" --launch-count "${DS_NCU_COUNT:-2500}" --log-file "$logs/ncu.csv" \
      "$build/ds" train examples/gpu-gpt2.json --device cuda train.steps=8 train.output_dir=/tmp/ds-ncu-run steps_per_print=1
    rm -rf /tmp/ds-ncu-run
    [ -s "$logs/ncu.csv" ] && step profile 5 30 ncu-summary python3 scripts/ncu_summary.py "$logs/ncu.csv"
    # TinyLlama's shape (RMSNorm, SwiGLU, rotary, GQA), micro batch 8 x 1024: about two steps after the first.
    step profile 60 150 ncu-llama ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
      --launch-skip "${DS_NCU_LLAMA_SKIP:-2500}" --launch-count "${DS_NCU_LLAMA_COUNT:-4000}" --log-file "$logs/ncu-llama.csv" \
      "$build/ds" train examples/gpu-gpt2.json --device cuda model.preset=tinyllama-1.1b train_micro_batch_size_per_gpu=8 \
      train.steps=6 train.output_dir=/tmp/ds-ncu-run steps_per_print=1
    rm -rf /tmp/ds-ncu-run
    [ -s "$logs/ncu-llama.csv" ] && step profile 5 30 ncu-llama-summary python3 scripts/ncu_summary.py "$logs/ncu-llama.csv"
    # LoRA r 16 on the same shape at 4 x 512, the benchmark's case (slower per step than full fine-tuning so far).
    step profile 60 150 ncu-lora ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
      --launch-skip "${DS_NCU_LORA_SKIP:-3000}" --launch-count "${DS_NCU_LORA_COUNT:-5000}" --log-file "$logs/ncu-lora.csv" \
      "$build/ds" train examples/gpu-gpt2.json --device cuda model.preset=tinyllama-1.1b train_micro_batch_size_per_gpu=4 \
      data.seq_len=512 'model.lora={"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}' \
      train.steps=6 train.output_dir=/tmp/ds-ncu-run steps_per_print=1
    rm -rf /tmp/ds-ncu-run
    [ -s "$logs/ncu-lora.csv" ] && step profile 5 30 ncu-lora-summary python3 scripts/ncu_summary.py "$logs/ncu-lora.csv"
  else
    say "== profile: ncu not on the PATH: skipped"
  fi
}

stage_size() {
  [ -x "$build/ds" ] || return 0
  step bench 200 420 offload-8b "$build/ds" train examples/gpu-gpt2.json --device cuda model.preset=llama-3-8b data.seq_len=2048 \
    train_micro_batch_size_per_gpu=8 zero_optimization.stage=2 zero_optimization.offload_optimizer.device=cpu \
    model.activation_checkpointing=true train.steps=4 steps_per_print=1 train.output_dir=/tmp/ds-size-run
  rm -rf /tmp/ds-size-run
}

# Out-of-bounds and misaligned accesses, and reads of memory never written, in ds's kernels and their launches
# (cuBLAS's, LibTorch's too in the training runs). Slow (each kernel instrumented): the smallest runs.
stage_sanitize() {
  if ! command -v compute-sanitizer >/dev/null; then
    say "== sanitize: compute-sanitizer is not on the PATH: skipped"
    return 0
  fi
  local memcheck=(compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 20)
  [ -x "$build/tests/ds_cuda_tests" ] && step tests 60 180 memcheck-kernels "${memcheck[@]}" "$build/tests/ds_cuda_tests"
  [ -x "$build/ds" ] || return 0
  for precision in bf16 fp16; do
    # shellcheck disable=SC2046
    step tests 60 150 "memcheck-train-$precision" "${memcheck[@]}" "$build/ds" train examples/quickstart.json --device cuda \
      $(memcheck_precision "$precision") train.steps=3 steps_per_print=1 train.output_dir=/tmp/ds-memcheck-run
    rm -rf /tmp/ds-memcheck-run
  done
}

stage_tests() {
  step build 40 240 build-tests cmake --build "$build" -j "$jobs" --target "${targets_tests[@]}" -- -k 0
  step tests 60 300 gpu-tests ctest --test-dir "$build" -L 'gpu|link' --output-on-failure --timeout 200
  [ -x "$build/bench_cuda_optimizers" ] && step bench 20 60 bench-cuda-optimizers "$build/bench_cuda_optimizers"
}

# The stages in the order asked for (--stages tests,bench runs the tests first).
for stage in ${stages//,/ }; do
  case $stage in
    build|bench|offload|profile|tests|size|sanitize) "stage_$stage" ;;
    *) say "== unknown stage $stage (build, bench, offload, profile, tests, size, sanitize)"; status=2 ;;
  esac
done

# DS_DEVICE_EXTRA: one more command to run in this environment (a diagnosis on a lent machine).
if [ -n "${DS_DEVICE_EXTRA:-}" ]; then
  step bench 10 "$budget" extra bash -c "$DS_DEVICE_EXTRA"
  tail -n 60 "$logs/bench.log"
fi
say "== device check: $([ "$status" -eq 0 ] && echo ok || echo "FAILED ($status)") after $SECONDS s; logs in $logs"
exit "$status"
