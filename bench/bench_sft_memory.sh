#!/usr/bin/env bash
# Fine-tuning data in memory against indexed (data.tokens_in_memory): the peak resident memory of reading a
# chat jsonl of SIZE_MB (the example's conversations repeated, each with a filler paragraph so a sample is a few
# hundred tokens), and the time to read it, through `ds plan --show-sample`, which opens the samples as a run
# does. Both settings in one run, interleaved, ROUNDS times.
# Usage: bench/bench_sft_memory.sh [SIZE_MB] [ROUNDS]     (needs build/ds)
set -euo pipefail
cd "$(dirname "$0")/.."
size_mb="${1:-64}" rounds="${2:-2}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 - "$size_mb" "$work/chat.jsonl" <<'PY'
import json, sys
size, out = int(sys.argv[1]) << 20, sys.argv[2]
lines = [json.loads(l) for l in open("examples/data/sft/chat.jsonl")]
filler = "The quick brown fox jumps over the lazy dog, and then it rests a while in the shade of the old oak. " * 12
written = 0
with open(out, "w") as f:
    i = 0
    while written < size:
        m = lines[i % len(lines)]["messages"]
        m = [dict(x, content=x["content"] + " " + filler) if x["role"] == "user" else x for x in m]
        s = json.dumps({"messages": m}) + "\n"
        f.write(s)
        written += len(s)
        i += 1
PY
echo "== $(du -h "$work/chat.jsonl" | cut -f1) of chat jsonl ($(wc -l < "$work/chat.jsonl") conversations); $(nproc) cores; $(uptime | sed 's/.*load/load/')"
for round in $(seq "$rounds"); do
  for keep in true false; do
    cmd="build/ds plan examples/sft.json data.path=$work/chat.jsonl data.seq_len=512 data.tokens_in_memory=$keep --show-sample 0"
    /usr/bin/time -f "%M KiB peak resident, %e s" -o "$work/time" $cmd > "$work/out" 2>&1 || { cat "$work/out"; exit 1; }
    echo "round $round, data.tokens_in_memory=$keep: $(cat "$work/time")   ($cmd)"
  done
done
