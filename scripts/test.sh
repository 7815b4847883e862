#!/usr/bin/env bash
# From a fresh Debian 12 machine: install what ds needs, build it with its tests, and run them (ctest).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== installing packages (scripts/install-deps.sh)"
bash scripts/install-deps.sh
bash scripts/build.sh
echo "== running the tests (ctest)"
ctest --test-dir build --output-on-failure -j "${DS_JOBS:-2}"
