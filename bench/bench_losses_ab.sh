#!/usr/bin/env bash
# Two ds binaries on the same runs, per-step losses (and bytes moved) compared exactly: the check that a
# refactor changed no number (the device seam was held to it). Each run writes under a scratch folder;
# a line per run says whether every step's loss and offload_bytes are bit-identical.
#
# usage: bench/bench_losses_ab.sh OLD_DS NEW_DS [SCRATCH=/tmp/ds-losses-ab]
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n 2,6p "$0" >&2; exit 2; }
old="$1" new="$2" dir="${3:-/tmp/ds-losses-ab}"
rm -rf "$dir" && mkdir -p "$dir/nvme"
q=examples/quickstart.json
echo "bench_losses_ab: A = $("$old" --version | head -1), B = $("$new" --version | head -1)"
echo "command: $0 $*"
same=0 differ=0
run() {  # name, arguments...
  local name=$1
  shift
  for v in A B; do
    local bin=$old
    [ "$v" = B ] && bin=$new
    "$bin" train "$@" train.output_dir="$dir/${v}_$name" >"$dir/${v}_$name.log" 2>&1 || echo "$name: $v failed (exit $?): $dir/${v}_$name.log"
  done
  if python3 - "$dir/A_$name/metrics.jsonl" "$dir/B_$name/metrics.jsonl" "$name" <<'PY'; then same=$((same + 1)); else differ=$((differ + 1)); fi
import json, sys
def read(path):
    rows = [json.loads(line) for line in open(path)]
    return [r["loss"] for r in rows], [r.get("offload_bytes") for r in rows]
(la, ba), (lb, bb) = read(sys.argv[1]), read(sys.argv[2])
ok = la == lb and ba == bb
print(f"{sys.argv[3]:18s} steps {len(la)}/{len(lb)}  losses {'identical' if la == lb else 'DIFFER'}  "
      f"bytes moved {'identical' if ba == bb else 'DIFFER'}  last loss {la[-1]!r} {lb[-1]!r}")
sys.exit(0 if ok else 1)
PY
}
run bf16 $q train.steps=30 train.eval_every=0
run fp32 $q bf16.enabled=false train.steps=20 train.eval_every=0
run zero3_2ranks $q --nproc-per-node 2 zero_optimization.stage=3 train.steps=12 train.eval_every=0
run lamb_zero2 $q --nproc-per-node 2 zero_optimization.stage=2 optimizer.type=Lamb train.steps=12 train.eval_every=0
run nvme_bf16 $q zero_optimization.stage=2 zero_optimization.offload_optimizer.device=nvme \
  zero_optimization.offload_optimizer.nvme_path="$dir/nvme" zero_optimization.sub_group_size=200000 train.steps=12 train.eval_every=0
run cpu_offload_z3 $q --nproc-per-node 2 zero_optimization.stage=3 zero_optimization.offload_optimizer.device=cpu train.steps=12 train.eval_every=0
run partial_fp16 $q bf16.enabled=false fp16.enabled=true zero_optimization.stage=3 zero_optimization.offload_optimizer.device=cpu \
  zero_optimization.offload_optimizer.ratio=0.5 train.steps=12 train.eval_every=0
run partial_nvme_fp32 $q bf16.enabled=false zero_optimization.stage=3 zero_optimization.offload_optimizer.device=nvme \
  zero_optimization.offload_optimizer.nvme_path="$dir/nvme" zero_optimization.offload_optimizer.ratio=0.5 zero_optimization.sub_group_size=200000 \
  train.steps=12 train.eval_every=0
run param_cpu_z3 $q zero_optimization.stage=3 zero_optimization.offload_param.device=cpu zero_optimization.offload_optimizer.device=cpu \
  train.steps=12 train.eval_every=0
run infinity examples/offload-infinity.json zero_optimization.offload_param.nvme_path="$dir/nvme" \
  zero_optimization.offload_optimizer.nvme_path="$dir/nvme" train.steps=12 train.eval_every=0
echo "bench_losses_ab: $same runs identical, $differ differ"
[ "$differ" -eq 0 ]
