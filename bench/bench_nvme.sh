#!/usr/bin/env bash
# NVMe optimizer offload: peak RSS and step time with the optimizer's states in RAM, swapped to files
# without pipelining and with it, beside the plan's prediction; the swapper's I/O rate beside the disk's
# own sequential O_DIRECT rate (dd), measured before and after the runs in the same invocation.
#   RSS drop   : peak RSS in RAM - peak RSS swapped, against the plan's (host + device bytes in RAM -
#                the same swapped), which is the fp32 master + moments minus the swap buffers.
#   I/O rate   : states read + written per step / seconds the step spent submitting and waiting on them
#                (unpipelined: the swapper's own rate; pipelined: what is left after overlapping the update).
#                io share = that time / step time. optim s = the whole optimizer phase, its I/O included.
#
# usage: bench/bench_nvme.sh [preset] [steps] [nvme_path]   (needs build/ds; defaults: gpt2 4 /tmp)
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-gpt2}"
steps="${2:-4}"
nvme="${3:-/tmp}"
py=/usr/bin/python3
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
gib() { echo "$1 / 2^30" | bc -l; }

disk_rate() {  # sequential O_DIRECT write then read of 1 GiB, MB/s each
  local f="$nvme/ds_bench_dd.$$"
  local w r
  w=$(dd if=/dev/zero of="$f" bs=1M count=1024 oflag=direct conv=fsync 2>&1 | sed -n 's/.*copied, \([0-9.]*\) s.*/\1/p')
  r=$(dd if="$f" of=/dev/null bs=1M iflag=direct 2>&1 | sed -n 's/.*copied, \([0-9.]*\) s.*/\1/p')
  rm -f "$f"
  printf "dd O_DIRECT 1 GiB on %s: write %.0f MB/s, read %.0f MB/s\n" "$nvme" "$(echo "1073.741824 / $w" | bc -l)" \
    "$(echo "1073.741824 / $r" | bc -l)"
}

echo "bench_nvme: $(build/ds --version | head -1); command: $0 $*"
echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB; nvme_path $nvme on $(df --output=source "$nvme" | tail -1)"
echo "model $preset, bf16, AdamW, ZeRO stage 1 on one rank, micro batch 1 x 128 tokens, $steps steps (first dropped)"
disk_rate
printf "%-22s %9s %9s %9s %9s %12s %12s %9s\n" placement "step s" "optim s" "io wait s" "io share" "peak RSS GiB" "plan GiB" "io MB/s"
declare -A rss plan
run() {
  local name=$1; shift
  local dir=/tmp/ds_bench_nvme_$name
  rm -rf "$dir"
  /usr/bin/time -v build/ds train examples/quickstart.json "model.preset=$preset" data.seq_len=128 train_micro_batch_size_per_gpu=1 \
    zero_optimization.stage=1 train.steps=$((steps + 1)) train.eval_every=0 train.save_every=0 train.output_dir="$dir" "$@" \
    >/dev/null 2>"$dir.log" || { tail -5 "$dir.log"; exit 1; }
  local tail_n=$steps
  step_s=$(tail -n "$tail_n" "$dir/metrics.jsonl" | sed 's/.*"step_s": \([0-9.]*\).*/\1/' | median)
  opt_s=$(tail -n "$tail_n" "$dir/metrics.jsonl" | sed 's/.*"optimizer_s": \([0-9.]*\).*/\1/' | median)
  io_s=$(tail -n "$tail_n" "$dir/metrics.jsonl" | sed 's/.*"offload_s": \([0-9.e-]*\).*/\1/' | median)
  peak=$(sed -n 's/.*Maximum resident set size (kbytes): \([0-9]*\).*/\1/p' "$dir.log")
  read -r planned state_io < <("$py" -c "
import json; p = json.load(open('$dir/plan.json')); m = p['memory']
held = lambda c: sum(v for k, v in c.items() if k != 'total')
print(held(m['device_per_rank']) + held(m['host_per_rank']),
      sum(t['bytes_per_step'] for t in p['zero_execution']['transfers'] if 'states' in t['what']))")
  rss[$name]=$((peak * 1024)); plan[$name]=$planned
  rm -rf "$dir"  # its checkpoint is as large as the states (13 GB at 1.1B)
  rate="-"
  [ "$state_io" != "0" ] && rate=$(printf "%.0f" "$(echo "$state_io / $io_s / 10^6" | bc -l)")
  printf "%-22s %9.3f %9.3f %9.3f %8.1f%% %12.2f %12.2f %9s\n" "$name" "$step_s" "$opt_s" "$io_s" \
    "$(echo "100 * $io_s / $step_s" | bc -l)" "$(gib $((peak * 1024)))" "$(gib "$planned")" "$rate"
}
nv="zero_optimization.offload_optimizer.device=nvme zero_optimization.offload_optimizer.nvme_path=$nvme zero_optimization.sub_group_size=20000000"
run ram
run nvme $nv
piped="zero_optimization.offload_optimizer.buffer_count=12 zero_optimization.offload_optimizer.pipeline_read=true
  zero_optimization.offload_optimizer.pipeline_write=true"
run nvme-pipelined $nv $piped
run nvme-pipelined-qd64 $nv $piped aio.queue_depth=64
disk_rate
for n in nvme nvme-pipelined nvme-pipelined-qd64; do
  printf "RSS drop %-16s measured %.2f GiB, plan %.2f GiB (ratio %.3f)\n" "$n" "$(gib $((rss[ram] - rss[$n])))" \
    "$(gib "$(echo "${plan[ram]} - ${plan[$n]}" | bc -l)")" "$(echo "(${rss[ram]} - ${rss[$n]}) / (${plan[ram]} - ${plan[$n]})" | bc -l)"
done
