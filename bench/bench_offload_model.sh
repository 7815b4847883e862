#!/usr/bin/env bash
# The plan's offload time model against a measured run on this machine: the host's memory rate measured first
# (bench/host_memory_rate.c: a copy with as many threads as ds uses), given to `ds plan --host-memory-bw`, and its
# predicted "optimizer step on the host" and copies between places set beside the optimizer and offload phases
# `ds train` measures (metrics.jsonl, median of the steps after the first two). Interleaved: each round measures
# the rate again, then runs the model.
# DS_DEVICE=cuda: the same on one GPU (GPT-2 124M, micro batch 8 x 1024, examples/gpu-gpt2.json), the copies
# crossing PCIe at the GPU model's --host-link, with overlap_comm (each block's gradients leave beside the next
# block's backward); each round also runs the step without offload and prints the measured slowdown beside the plan's
# predicted one, and at ZeRO 2 the offloaded step without overlap_comm beside the plan's (what the overlap wins).
#
# DS_OFFLOAD_STAGES: the ZeRO stages run (default "2 3"); DS_OFFLOAD_GAS: micro steps a step (default 1: a larger
# global batch gives the host's step, whose time does not grow with it, more of the GPU's to hide behind).
# DS_OFFLOAD_SPECULATIVE=1 (cuda, ZeRO 2): each round also runs the offloaded step with nothing that could undo it
# (gradient_clipping 0, bf16 without check_grad_overflow), without and with offload_optimizer.speculative_step, back
# to back, and prints the measured ratio beside the plan's (and that the two runs' losses are equal).
#
# usage: [DS_DEVICE=cpu|cuda] bench/bench_offload_model.sh [PRESET=gpt2] [STEPS=8] [ROUNDS=2] [SCRATCH=/tmp/ds-offload-model]
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-gpt2} steps=${2:-8} rounds=${3:-2} dir=${4:-/tmp/ds-offload-model}
ds=${DS:-build/ds}
rm -rf "$dir" && mkdir -p "$dir"
cc -O2 -pthread -o "$dir/host_memory_rate" bench/host_memory_rate.c
threads=$(nproc)
device=${DS_DEVICE:-cpu}
if [ "$device" = cuda ]; then
  base=(examples/gpu-gpt2.json model.preset="$preset" train_micro_batch_size_per_gpu=8)
else
  base=(examples/quickstart.json model.preset="$preset" data.seq_len=128 train_micro_batch_size_per_gpu=2)
fi
echo "bench_offload_model: $($ds --version | head -1); $preset on the $device, optimizer offloaded to the host, $steps steps, $threads threads"
echo "command: DS_DEVICE=$device DS_OFFLOAD_STAGES=\"${DS_OFFLOAD_STAGES:-2 3}\" DS_OFFLOAD_GAS=${DS_OFFLOAD_GAS:-1} DS_OFFLOAD_SPECULATIVE=${DS_OFFLOAD_SPECULATIVE:-0} $0 $*  (load before: $(cut -d' ' -f1-3 /proc/loadavg))"
for stage in ${DS_OFFLOAD_STAGES:-2 3}; do
  for round in $(seq "$rounds"); do
    rate=$("$dir/host_memory_rate" "$threads")
    gbs=$(python3 -c "print(f'{$rate / 1e9:.2f}GB/s')")
    common=("${base[@]}" zero_optimization.stage="$stage" train.steps="$steps" train.eval_every=0 train.threads="$threads" wall_clock_breakdown=true gradient_accumulation_steps="${DS_OFFLOAD_GAS:-1}")
    args=("${common[@]}" zero_optimization.offload_optimizer.device=cpu)
    [ "$device" = cuda ] && args+=(zero_optimization.overlap_comm=true)
    "$ds" plan "${args[@]}" --device "$device" --host-memory-bw "$gbs" --json > "$dir/plan.json"
    out="$dir/run_${stage}_$round"
    "$ds" train "${args[@]}" --device "$device" train.output_dir="$out" > "$out.log" 2>&1
    kept="$dir/kept_${stage}_$round"
    if [ "$device" = cuda ]; then
      "$ds" plan "${common[@]}" --device "$device" --json > "$dir/plan_kept.json"
      "$ds" train "${common[@]}" --device "$device" train.output_dir="$kept" > "$kept.log" 2>&1
      if [ "$stage" = 2 ]; then
        serial="$dir/serial_${stage}_$round"
        "$ds" plan "${args[@]}" zero_optimization.overlap_comm=false --device "$device" --host-memory-bw "$gbs" --json > "$dir/plan_serial.json"
        "$ds" train "${args[@]}" zero_optimization.overlap_comm=false --device "$device" train.output_dir="$serial" > "$serial.log" 2>&1
      fi
      if [ "$stage" = 2 ] && [ "${DS_OFFLOAD_SPECULATIVE:-0}" = 1 ]; then
        undoable=("${args[@]}" gradient_clipping=0 bf16.check_grad_overflow=false)
        for s in false true; do
          "$ds" plan "${undoable[@]}" zero_optimization.offload_optimizer.speculative_step=$s --device "$device" --host-memory-bw "$gbs" --json \
            > "$dir/plan_speculative_$s.json"
          "$ds" train "${undoable[@]}" zero_optimization.offload_optimizer.speculative_step=$s --device "$device" \
            train.output_dir="$dir/speculative_${s}_$round" > "$dir/speculative_${s}_$round.log" 2>&1
        done
        python3 - "$dir" "$round" <<'PY'
import json, statistics, sys
d, r = sys.argv[1], sys.argv[2]
rows = {s: [json.loads(l) for l in open(f"{d}/speculative_{s}_{r}/metrics.jsonl") if l.strip()] for s in ("false", "true")}
plans = {s: json.load(open(f"{d}/plan_speculative_{s}.json"))["step_time"].get("step_s") or float("nan") for s in ("false", "true")}
step = {s: statistics.median(x["step_s"] for x in rows[s][2:]) for s in rows}
same = [x["loss"] for x in rows["false"]] == [x["loss"] for x in rows["true"]]
tiles = statistics.median(x.get("speculated_tiles", 0) for x in rows["true"])
print(f"  speculative step (no clipping, no overflow check): {step['true'] * 1e3:.1f} ms against {step['false'] * 1e3:.1f} ms without "
      f"({step['true'] / step['false']:.2f}x; the plan: {plans['true'] * 1e3:.1f} vs {plans['false'] * 1e3:.1f} ms, "
      f"{plans['true'] / plans['false']:.2f}x); {tiles:.0f} tiles speculated a step; losses {'equal' if same else 'DIFFERENT'}")
PY
      fi
    fi
    python3 - "$dir/plan.json" "$out/metrics.jsonl" "$stage" "$gbs" "$dir/plan_kept.json" "$kept/metrics.jsonl" "$device" \
      "$dir/plan_serial.json" "${serial:-none}/metrics.jsonl" <<'PY'
import json, os, statistics, sys
plan = json.load(open(sys.argv[1]))["step_time"]
steps = [json.loads(l) for l in open(sys.argv[2]) if l.strip()][2:]
host = sum(r["seconds"] for r in plan["offload"] if r["what"] == "optimizer step on the host")
copies = sum(r["seconds"] for r in plan["offload"] if r["what"] != "optimizer step on the host" and r["resource"] != "nvme")
measured_opt = statistics.median(s["optimizer_s"] for s in steps)
measured_copy = statistics.median(s["offload_s"] for s in steps)
print(f"ZeRO {sys.argv[3]}, host {sys.argv[4]}: optimizer step on the host predicted {host * 1e3:7.1f} ms, measured {measured_opt * 1e3:7.1f} ms "
      f"({measured_opt / host:.2f}x); copies between places predicted {copies * 1e3:6.1f} ms, measured {measured_copy * 1e3:6.1f} ms "
      f"({measured_copy / copies if copies else 0:.2f}x)")
def phases(rows):  # median seconds of each phase over the steps (wall_clock_breakdown), and of the deferred host step
    out = {k: statistics.median(r["phases"][k] for r in rows) for k in rows[0].get("phases", {})}
    if "deferred_step_s" in rows[0]:
        out["deferred step"] = statistics.median(r["deferred_step_s"] for r in rows)
    return "  ".join(f"{k} {v * 1e3:.1f}" for k, v in out.items() if v > 0)
print(f"  measured phases, offloaded (ms): {phases(steps)}")
print("  the plan's transfers (ms, hidden): " + "; ".join(f"{r['what']} {r['seconds'] * 1e3:.1f} ({(r.get('hidden_s') or 0) * 1e3:.1f})"
                                                     for r in plan["offload"]) + f"; compute {(plan.get('compute_s') or 0) * 1e3:.1f}")
if sys.argv[7] == "cuda" and os.path.exists(sys.argv[6]):
    kept_plan = json.load(open(sys.argv[5]))["step_time"]
    kept = [json.loads(l) for l in open(sys.argv[6]) if l.strip()][2:]
    step_off = statistics.median(s["step_s"] for s in steps)
    step_kept = statistics.median(s["step_s"] for s in kept)
    def predicted(p):
        return p.get("step_s") or float("nan")
    print(f"  measured phases, on the GPU (ms): {phases(kept)}")
    print(f"  step: offloaded {step_off * 1e3:.1f} ms, on the GPU {step_kept * 1e3:.1f} ms: {step_kept / step_off:.2f}x the speed "
          f"(the plan: {predicted(kept_plan) / predicted(plan):.2f}x, {predicted(plan) * 1e3:.1f} vs {predicted(kept_plan) * 1e3:.1f} ms; "
          f"bound {plan.get('bound')})")
    if sys.argv[3] == "2" and os.path.exists(sys.argv[9]):
        serial_plan = json.load(open(sys.argv[8]))["step_time"]
        serial_rows = [json.loads(l) for l in open(sys.argv[9]) if l.strip()][2:]
        serial = statistics.median(s["step_s"] for s in serial_rows)
        print(f"  measured phases, offloaded without overlap_comm (ms): {phases(serial_rows)}")
        print(f"  without overlap_comm: offloaded {serial * 1e3:.1f} ms ({serial / step_off:.2f}x the overlapped step; "
              f"the plan: {predicted(serial_plan) * 1e3:.1f} ms, {predicted(serial_plan) / predicted(plan):.2f}x)")
PY
  done
done
