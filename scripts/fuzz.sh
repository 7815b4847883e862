#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ into build-sanitize/ (clang, AddressSanitizer + UBSan) and runs
# each for SECONDS (default 60) from its checked-in seeds (fuzz/corpus/<target>/, plus the DeepSpeed
# configs of ../shared/data when present). Any crash, leak or sanitizer report fails the script and
# leaves the input that caused it as build-sanitize/crash-<target>-*. New inputs found are kept in
# build-sanitize/corpus/.
#   bash scripts/fuzz.sh              # 60 s per target
#   bash scripts/fuzz.sh 3600         # a long run
#   bash scripts/fuzz.sh --build-only # configure and build (the fuzz targets and ds_tests), run nothing
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
dir=build-sanitize
if [ ! -f $dir/build.ninja ]; then
  echo "== configuring $dir (clang, ASan + UBSan, libFuzzer)"
  cmake -S . -B $dir -G Ninja -DDS_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++
fi
echo "== building the sanitizer build (ds_tests and the fuzz targets)"
cmake --build $dir -j "${DS_JOBS:-2}"
[ "$seconds" = --build-only ] && exit 0
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
for target in fuzz_config fuzz_tokenizer fuzz_token_file fuzz_checkpoint fuzz_safetensors fuzz_peft_config fuzz_torch_pickle \
    fuzz_jsonl fuzz_hf_tokenizer fuzz_sentencepiece_model; do
  mkdir -p "$dir/corpus/$target"
  seeds=("fuzz/corpus/$target")
  [ "$target" = fuzz_config ] && seeds+=(templates examples)
  [ "$target" = fuzz_config ] && [ -d ../shared/data/deepspeed-configs ] && seeds+=(../shared/data/deepspeed-configs)
  echo "== fuzzing $target for ${seconds}s"
  log="$dir/$target.log"
  if ! "$dir/$target" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
      -artifact_prefix="$dir/crash-$target-" "$dir/corpus/$target" "${seeds[@]}" >"$log" 2>&1; then
    tail -60 "$log"
    echo "fuzz: $target FAILED: the input is $dir/crash-$target-*" >&2
    exit 1
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  echo "fuzz: $target: $runs executions, no crash or sanitizer report"
done
