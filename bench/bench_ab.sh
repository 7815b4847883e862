#!/usr/bin/env bash
# Two ds binaries on the same profile, interleaved (A, B, A, B, ...), for a before/after figure taken
# in one run: tokens/s, one block's forward and backward, MFU against the matmul rate each run measures
# itself, peak RSS and its ratio to the plan. Medians over the rounds.
#
# usage: bench/bench_ab.sh OLD_DS NEW_DS ROUNDS CONFIG [KEY=VALUE ...]
#   e.g. bench/bench_ab.sh /tmp/old/ds build/ds 2 examples/profile-gpt2.json data.seq_len=1024 model.max_position_embeddings=1024
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 4 ] || { sed -n 2,8p "$0" >&2; exit 2; }
old="$1" new="$2" rounds="$3"
shift 3

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

# One profile: "tokens/s fwd_ms bwd_ms MFU% peak_GiB rss/plan" (block 0: layers[0] of the Modules table).
profile() {
  local out
  out=$("$1" profile "${@:2}" --steps 3 --warmup 1 2>&1)
  local tok mfu peak ratio fwd bwd
  tok=$(sed -n 's/^  tokens\/s *\([0-9,]*\).*/\1/p' <<< "$out" | tr -d ,)
  mfu=$(sed -n 's/^  MFU *\([0-9.]*\)%.*/\1/p' <<< "$out")
  peak=$(sed -n 's/^  peak resident *\([0-9.]*\) \([GM]\)iB.*/\1 \2/p' <<< "$out" | awk '{print $2 == "M" ? $1 / 1024 : $1}')
  ratio=$(sed -n 's/.* \([0-9.]*\)x the plan.s.*/\1/p' <<< "$out")
  read -r fwd bwd < <(grep -E '^  (transformer\.h|model\.layers)\.0 ' <<< "$out" | awk '{print $(NF-3), $(NF-2)}')
  echo "$tok $fwd $bwd $mfu $peak $ratio"
}

echo "bench_ab: A = $("$old" --version | head -1), B = $("$new" --version | head -1); rounds=$rounds"
echo "command: $0 $old $new $rounds $*"
declare -a A B
for ((r = 0; r < rounds; r++)); do
  A+=("$(profile "$old" "$@")")
  B+=("$(profile "$new" "$@")")
  echo "round $((r + 1)): A ${A[-1]} | B ${B[-1]}"
done
printf "%-3s %9s %12s %12s %6s %10s %9s\n" "" "tok/s" "block0 fwd" "block0 bwd" MFU "peak RSS" "RSS/plan"
for side in A B; do
  declare -n runs=$side
  cols=()
  for c in 1 2 3 4 5 6; do cols+=("$(printf "%s\n" "${runs[@]}" | awk -v c=$c '{print $c}' | median)"); done
  printf "%-3s %9.0f %9.2f ms %9.2f ms %5.1f%% %6.2f GiB %8.2fx\n" "$side" "${cols[@]}"
done
