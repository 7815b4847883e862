#!/usr/bin/env bash
# From a fresh Debian 12 machine: install what ds needs, build it, and run the main job on a bundled
# config (no download): the execution plan of GPT-2 under ZeRO-2 with bf16.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
echo
echo "+ build/ds plan templates/zero2.json --world-size 4"
build/ds plan templates/zero2.json --world-size 4
