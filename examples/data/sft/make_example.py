#!/usr/bin/env python3
"""Writes the files of examples/sft.json (committed, so the example needs no Python): chat.jsonl, 1,200
short conversations in which the assistant answers sums and differences of small numbers, and a small
Hugging Face tokenizer for them: tokenizer.json (byte-level BPE, Qwen 2's split pattern, 200 merges learned
from the conversations, ChatML's special tokens) and tokenizer_config.json (EOS, the ChatML chat template).
Deterministic: python3 examples/data/sft/make_example.py writes the same bytes every time."""
import json
import os
import random
import re
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
            "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def conversations(rng):
    out = []
    for _ in range(1200):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        if rng.random() < 0.5:
            q, ans = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
        else:
            a, b = max(a, b), min(a, b)
            q, ans = f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}."
        turns = [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
        if rng.random() < 0.25:
            turns.insert(0, {"role": "system", "content": "Answer with one sentence."})
        out.append({"messages": turns})
    return out


def stand_ins():
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, extra = [], 0
    for b in range(256):
        table.append(chr(b) if b in printable else chr(256 + extra))
        extra += b not in printable
    return table


def learn_merges(texts, count):
    table = stand_ins()
    # Words as the split pattern would cut them, roughly (ASCII data: letters, digits one by one, the rest).
    words = Counter()
    for t in texts:
        for w in re.findall(r" ?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+|\s+", t):
            words[tuple(table[b] for b in w.encode())] += 1
    merges = []
    for _ in range(count):
        pairs = Counter()
        for w, n in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += n
        if not pairs:
            break
        best = max(sorted(pairs), key=lambda p: pairs[p])
        merges.append(best)
        merged = Counter()
        for w, n in words.items():
            out, k = [], 0
            while k < len(w):
                if k + 1 < len(w) and (w[k], w[k + 1]) == best:
                    out.append(w[k] + w[k + 1])
                    k += 2
                else:
                    out.append(w[k])
                    k += 1
            merged[tuple(out)] += n
        words = merged
    return table, merges


def main():
    rng = random.Random(7)
    convs = conversations(rng)
    with open(os.path.join(HERE, "chat.jsonl"), "w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps(c) + "\n")
    texts = [m["content"] for c in convs for m in c["messages"]]
    table, merges = learn_merges(texts, 200)
    vocab = {s: i for i, s in enumerate(table)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    added = [{"id": len(vocab) + k, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for k, s in enumerate(SPECIALS)]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]}}
    with open(os.path.join(HERE, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False, indent=1)
        f.write("\n")
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "model_max_length": 128, "tokenizer_class": "Qwen2Tokenizer", "chat_template": TEMPLATE}
    with open(os.path.join(HERE, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
        f.write("\n")


main()
