#!/usr/bin/env bash
# The sanitizer build (build-sanitize/, clang, AddressSanitizer + UBSan, no LibTorch): runs the unit
# tests that need no LibTorch (ds_tests), then fuzzes each libFuzzer target of fuzz/ for SECONDS
# (default 45; scripts/fuzz.sh). Any sanitizer report, crash or failed test fails the script.
#   bash scripts/sanitize.sh        # what CI runs
#   bash scripts/sanitize.sh 3600   # with an hour of fuzzing per target
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-45}"
bash scripts/fuzz.sh --build-only
echo "== running ds_tests under ASan + UBSan"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  build-sanitize/tests/ds_tests --gtest_brief=1
bash scripts/fuzz.sh "$seconds"
