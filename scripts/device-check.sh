#!/usr/bin/env bash
# The GPU checks in one call, for a machine with an NVIDIA GPU, CUDA LibTorch (python3 -c 'import torch')
# and no network: unpacks .device-deps/ (scripts/fetch-device-deps.sh fills it on a Debian 12 machine),
# configures ds against that LibTorch, builds the targets the GPU checks need, runs every test labelled
# gpu (kernels/cuda against the CPU's kernels, the NCCL group on one rank, the CUDA device, ds train on the
# GPU against the CPU), the quickstart on the GPU and the GPU benchmarks (bench_cuda_optimizers;
# bench/bench_cuda_train.sh beside PyTorch), and writes each step's log to LOGS (default: $OUT, else
# ./device-logs). Exit status: the first step that failed, 0 when all passed.
#   scripts/device-check.sh [LOGS]
set -uo pipefail
cd "$(dirname "$0")/.."
logs="${1:-${OUT:-device-logs}}"
mkdir -p "$logs"
jobs="$(nproc)"
status=0
step() {  # name, command...: runs it with its output in LOGS/name.log; the first failure is the exit status
  local name=$1
  shift
  local t0=$SECONDS
  if "$@" >"$logs/$name.log" 2>&1; then
    echo "== $name: ok ($((SECONDS - t0)) s)"
  else
    local rc=$?
    echo "== $name: FAILED (exit $rc, $((SECONDS - t0)) s): tail of $logs/$name.log"
    tail -n 30 "$logs/$name.log"
    [ "$status" -eq 0 ] && status=$rc
  fi
}

step machine bash -c 'nvidia-smi; nvcc --version || /usr/local/cuda/bin/nvcc --version; nproc; free -g; python3 -c "import torch; print(torch.__version__, torch.version.cuda)"'

pfx=/tmp/ds-device-prefix
rm -rf "$pfx" && mkdir -p "$pfx"
if ! ls .device-deps/*.deb >/dev/null 2>&1; then
  echo "== no .device-deps/*.deb: run scripts/fetch-device-deps.sh on a Debian 12 machine and bring .device-deps along"
  exit 2
fi
for f in .device-deps/*.deb; do dpkg -x "$f" "$pfx"; done
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
build=/tmp/ds-device-build
step configure cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDS_BUILD_TESTS=ON \
  -DCMAKE_PREFIX_PATH="$pfx/usr;$torch_prefix" -DCMAKE_CXX_FLAGS="-isystem $pfx/usr/include" \
  -DHDF5_C_LIBRARIES="$L/hdf5/serial/libhdf5.so" -DVALIJSON_INCLUDE_DIR="$pfx/usr/include" \
  -DCMAKE_SHARED_LINKER_FLAGS="-L$L" -DCMAKE_EXE_LINKER_FLAGS="-L$L" "${nccl_flag[@]}" "${cudart_flag[@]}" \
  -DCMAKE_CUDA_HOST_COMPILER="$(command -v g++ || command -v c++)"
# DS_DEVICE_TARGETS: what to build (default: the GPU tests and ds itself).
read -r -a targets <<<"${DS_DEVICE_TARGETS:-ds_cuda_tests ds_nccl_tests ds_cuda_device_tests bench_cuda_optimizers ds}"
export DS_BUILD_DIR=$build
step build cmake --build "$build" -j "$jobs" --target "${targets[@]}"
if [ -x "$build/ds" ]; then
  step ds-info bash -c "'$build/ds' --version && '$build/ds' env"  # one log: at most 8 files come back from a device call
fi
step gpu-tests ctest --test-dir "$build" -L gpu --output-on-failure --timeout 300
if [ -x "$build/ds" ]; then
  # The README's first command on the GPU (auto picks it), then the GPU benchmark beside PyTorch.
  step quickstart-gpu "$build/ds" train examples/quickstart.json train.steps=100 "train.output_dir=$logs/qs-run"
  rm -rf "$logs/qs-run"
  step bench-cuda-train bench/bench_cuda_train.sh "$build/ds" "${DS_BENCH_STEPS:-30}"
  cat "$logs/bench-cuda-train.log"
fi
if [ -x "$build/bench_cuda_optimizers" ]; then
  step bench-cuda-optimizers "$build/bench_cuda_optimizers"
  cat "$logs/bench-cuda-optimizers.log"
fi
# DS_DEVICE_EXTRA: one more command to run in this environment (a diagnosis on a lent machine).
if [ -n "${DS_DEVICE_EXTRA:-}" ]; then
  step extra bash -c "$DS_DEVICE_EXTRA"
  tail -n 80 "$logs/extra.log"
fi
# A device call brings back only a few files: the logs go back as one archive there.
if [ -n "${OUT:-}" ] && [ "$logs" = "$OUT" ]; then
  (cd "$logs" && tar czf device-logs.tgz ./*.log && rm -f ./*.log)
  echo "== logs in $logs/device-logs.tgz"
else
  echo "== logs in $logs"
fi
exit "$status"
