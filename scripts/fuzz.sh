#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ into build-fuzz/ (clang, AddressSanitizer + UBSan) and runs each
# for SECONDS (default 60) from its checked-in seeds (fuzz/corpus/<target>/, plus the DeepSpeed configs
# of ../shared/data when present). Any crash, leak or sanitizer report fails the script and leaves the
# input that caused it as build-fuzz/crash-<target>-*. New inputs found are kept in build-fuzz/corpus/.
#   bash scripts/fuzz.sh            # CI: 60 s per target
#   bash scripts/fuzz.sh 3600       # a long run
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
if [ ! -f build-fuzz/build.ninja ]; then
  echo "== configuring build-fuzz (clang, ASan + UBSan, libFuzzer)"
  cmake -S . -B build-fuzz -G Ninja -DDS_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++
fi
echo "== building the fuzz targets"
cmake --build build-fuzz -j "${DS_JOBS:-2}"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
for target in fuzz_config fuzz_tokenizer fuzz_token_file fuzz_checkpoint; do
  mkdir -p "build-fuzz/corpus/$target"
  seeds=("fuzz/corpus/$target")
  [ "$target" = fuzz_config ] && seeds+=(templates examples)
  [ "$target" = fuzz_config ] && [ -d ../shared/data/deepspeed-configs ] && seeds+=(../shared/data/deepspeed-configs)
  echo "== fuzzing $target for ${seconds}s"
  log="build-fuzz/$target.log"
  if ! "build-fuzz/$target" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
      -artifact_prefix="build-fuzz/crash-$target-" "build-fuzz/corpus/$target" "${seeds[@]}" >"$log" 2>&1; then
    tail -60 "$log"
    echo "fuzz: $target FAILED: the input is build-fuzz/crash-$target-*" >&2
    exit 1
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  echo "fuzz: $target: $runs executions, no crash or sanitizer report"
done
