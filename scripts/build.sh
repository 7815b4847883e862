#!/usr/bin/env bash
# Configures and builds ds into build/ (Ninja, 2 jobs: the project's machines have 2 cores).
# Incremental: a second run rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="${DS_JOBS:-2}"
if [ ! -f build/build.ninja ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="${DS_BUILD_TYPE:-RelWithDebInfo}"
fi
cmake --build build -j "$jobs"
