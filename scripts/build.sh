#!/usr/bin/env bash
# Configures and builds ds into build/ (Ninja, 2 jobs: the project's machines have 2 cores).
# `scripts/build.sh` builds everything (ds, the tests, the man page generator); `scripts/build.sh ds`
# builds only the binary. Incremental: a second run rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="${DS_JOBS:-2}"
if [ ! -f build/build.ninja ]; then
  echo "== configuring (cmake -S . -B build -G Ninja)"
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="${DS_BUILD_TYPE:-RelWithDebInfo}"
fi
targets=("$@")
echo "== building ${targets[*]:-everything} with $jobs jobs (ninja prints [done/total] per file)"
cmake --build build -j "$jobs" ${targets[@]:+--target "${targets[@]}"}
echo "== built: $(ls build/ds 2>/dev/null || true)"
