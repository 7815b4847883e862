#!/usr/bin/env bash
# Tokenizing speed (#51's target: at least 5 MB/s of text per core): GPT-2's vocab.json + merges.txt, and
# the same vocabulary as a tokenizer.json with Llama 3's split pattern and ignore_merges, over a text file.
# Usage: bench/bench_tokenizer.sh GPT2_DIR TEXT_FILE [ROUNDS]   (GPT2_DIR holds vocab.json and merges.txt)
# Needs the benchmarks built: cmake -S . -B build-bench -G Ninja -DDS_BUILD_BENCH=ON && ninja -C build-bench bench_tokenizer
set -euo pipefail
gpt2="$1" text="$2" rounds="${3:-3}"
bin="${DS_BENCH_BIN:-build-bench/bench_tokenizer}"
tok="$(mktemp -d)/tokenizer.json"
python3 - "$gpt2" "$tok" <<'PY'
import json, sys
gpt2, out = sys.argv[1], sys.argv[2]
vocab = json.load(open(gpt2 + "/vocab.json", encoding="utf-8"))
merges = [l.rstrip("\n") for l in open(gpt2 + "/merges.txt", encoding="utf-8") if l.strip() and not l.startswith("#version")]
pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
json.dump({"added_tokens": [], "normalizer": None,
           "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
               {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
               {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]},
           "post_processor": None, "decoder": {"type": "ByteLevel"},
           "model": {"type": "BPE", "ignore_merges": True, "vocab": vocab, "merges": merges}}, open(out, "w"))
PY
echo "== $bin $gpt2/vocab.json $gpt2/merges.txt $tok $text $rounds   ($(uptime | sed 's/.*load/load/'))"
"$bin" "$gpt2/vocab.json" "$gpt2/merges.txt" "$tok" "$text" "$rounds"
rm -rf "$(dirname "$tok")"
