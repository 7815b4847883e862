#!/usr/bin/env bash
# From a fresh Debian 12 machine: install what ds needs, build it, and run the main job on an embedded
# default (no download): a tiny GPT-2 learns a synthetic language; the loss falls from ln(256) = 5.55
# towards the language's entropy floor of 1.11 nats in about five seconds of training on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== installing packages (scripts/install-deps.sh)"
bash scripts/install-deps.sh
bash scripts/build.sh ds  # only the binary: the tests are built by scripts/test.sh
echo
# ds never trains a fresh run over an earlier one: a second quickstart goes to runs/quickstart-2, ...
out=runs/quickstart
n=1
while [ -s "$out/metrics.jsonl" ] || [ -d "$out/checkpoints" ]; do n=$((n + 1)); out="runs/quickstart-$n"; done
if [ "$out" = runs/quickstart ]; then
  echo "+ build/ds train examples/quickstart.json"
  build/ds train examples/quickstart.json
else
  echo "+ build/ds train examples/quickstart.json train.output_dir=$out   (runs/quickstart holds an earlier run)"
  build/ds train examples/quickstart.json "train.output_dir=$out"
fi
