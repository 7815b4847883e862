#!/usr/bin/env bash
# From a fresh Debian 12 machine: install what ds needs; the sanitizer build (the unit tests under ASan
# + UBSan, then each fuzz target for 30 s: scripts/sanitize.sh; DS_SANITIZE=0 skips it); then build ds
# with its tests and run them all (ctest).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== installing packages (scripts/install-deps.sh)"
bash scripts/install-deps.sh
if [ "${DS_SANITIZE:-1}" != 0 ]; then
  echo "== the sanitizer build: unit tests under ASan + UBSan, then fuzzing (scripts/sanitize.sh)"
  bash scripts/sanitize.sh 30
fi
bash scripts/build.sh
echo "== running the tests (ctest)"
ctest --test-dir build --output-on-failure -j "${DS_JOBS:-2}"
