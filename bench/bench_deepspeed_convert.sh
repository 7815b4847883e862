#!/usr/bin/env bash
# Memory of reading a DeepSpeed checkpoint: a TinyLlama-shaped model (1.1B parameters) at ZeRO-2 on
# WORLD ranks in bf16 (tests/tools/write_deepspeed_checkpoint.py --big: DeepSpeed's layout, 6.6 GB on disk),
# consolidated by `ds convert-ckpt` into one fp32 and one bf16 .safetensors file, each under /usr/bin/time -v.
# Prints the peak resident memory beside the largest tensor (fp32), one rank's partition and the whole fp32
# model: the issue's bound is 1.2 x (largest tensor + one partition); DeepSpeed's zero_to_fp32.py documents
# needing about twice the model. Needs about 11 GB free under TMPDIR (the checkpoint and one export).
#   bash bench/bench_deepspeed_convert.sh [WORLD]     (default 2; 1 puts a 4.4 GB file through ZIP64)
set -euo pipefail
cd "$(dirname "$0")/.."
world="${1:-2}"
[ -x build/ds ] || { echo "bench_deepspeed_convert: build ds first (cmake --build build)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "== writing the checkpoint (1.1B parameters, ZeRO-2, $world rank(s), bf16) into $work"
python3 tests/tools/write_deepspeed_checkpoint.py "$work/ck" --big --world "$world"
du -sh "$work/ck"
peak_kib() { sed -n 's/.*Maximum resident set size (kbytes): \([0-9]*\).*/\1/p' "$1"; }
wall() { sed -n 's/.*Elapsed (wall clock) time (h:mm:ss or m:ss): \(.*\)/\1/p' "$1"; }
/usr/bin/time -v build/ds convert-ckpt --info "$work/ck" >/dev/null 2>"$work/info.time"
largest=$((32000 * 2048 * 4)); model=$((1100048384 * 4)); partition=$((model / world))
printf "\n%-34s %14s %10s %22s %14s\n" "command" "peak RSS MiB" "wall" "/ (largest+partition)" "/ largest"
printf "%-34s %14d %10s %22s %14s\n" "convert-ckpt --info (pickles only)" $(( $(peak_kib "$work/info.time") / 1024 )) "$(wall "$work/info.time")" "-" "-"
for dtype in fp32 bf16; do
  /usr/bin/time -v build/ds convert-ckpt "$work/ck" "$work/out.safetensors" --dtype $dtype >/dev/null 2>"$work/$dtype.time"
  rm -f "$work/out.safetensors"
  peak=$(( $(peak_kib "$work/$dtype.time") * 1024 ))
  printf "%-34s %14d %10s %22.3f %14.3f\n" "convert-ckpt -> $dtype .safetensors" $((peak >> 20)) "$(wall "$work/$dtype.time")" \
    "$(echo "$peak / ($largest + $partition)" | bc -l)" "$(echo "$peak / $largest" | bc -l)"
done
printf "\nlargest tensor (fp32) %d MiB; one rank's fp32 partition %d MiB; the fp32 model %d MiB (zero_to_fp32.py: about twice that)\n" \
  $((largest >> 20)) $((partition >> 20)) $((model >> 20))
