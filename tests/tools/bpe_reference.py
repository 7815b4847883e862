#!/usr/bin/env python3
"""An independent byte-level BPE encoder for the tests: reads a Hugging Face tokenizer.json and encodes
a UTF-8 file with Python's own regular expression engine running the pre-tokenizer's pattern as the
file gives it (\\p{L}, \\p{N} and \\s spelled out as character classes from unicodedata and Unicode's
White_Space list), the added tokens split first (leftmost, longest), then the BPE merges by rank.
SentencePiece's BPE (byte fallback): each segment between added tokens has its spaces made '▁' and a '▁'
put before it as the normalizer or Metaspace says, its characters (or their <0xXX> bytes) merged one pair
at a time, the lowest rank first and the leftmost among equals.
Standard library only. Usage: bpe_reference.py tokenizer.json text.txt [--lines]  ->  the ids as a JSON
list (--lines: each line of the file encoded alone, a list of lists)."""
import json
import re
import sys
import unicodedata

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
WHITE_SPACE = [(0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
               (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000)]


def category_ranges(first):
    out, start = [], None
    for cp in range(0x110000):
        hit = unicodedata.category(chr(cp))[0] == first
        if hit and start is None:
            start = cp
        if not hit and start is not None:
            out.append((start, cp - 1))
            start = None
    return out


def class_body(ranges):
    return "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges)


def translate(pattern):
    bodies = {"L": class_body(category_ranges("L")), "N": class_body(category_ranges("N")), "s": class_body(WHITE_SPACE)}
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and pattern.startswith("\\p{", i):
            body = bodies[pattern[i + 3]]
            out.append(body if in_class else "[" + body + "]")
            i += 5
        elif c == "\\" and pattern[i + 1] in "sS":
            neg = pattern[i + 1] == "S"
            assert not (in_class and neg)
            out.append(bodies["s"] if in_class else ("[^" if neg else "[") + bodies["s"] + "]")
            i += 2
        elif c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
        else:
            if c == "[":
                in_class = True
            elif c == "]":
                in_class = False
            out.append(c)
            i += 1
    return re.compile("".join(out))


def byte_stand_ins():
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


SPACE = "\u2581"


def piece_rule(tok):
    """How a SentencePiece tokenizer.json puts a '▁' before a segment: always, unless, first, never."""
    pre, norm = tok.get("pre_tokenizer"), tok.get("normalizer")
    if pre and pre.get("type") == "Metaspace":
        scheme = pre.get("prepend_scheme") or ("always" if pre.get("add_prefix_space", True) else "never")
        return {"always": "unless", "first": "first", "never": "never"}[scheme]
    if norm and norm.get("type") == "Sequence" and norm["normalizers"][0]["type"] == "Prepend":
        return "always"
    return "never"


def piece_encoder(tok, ranks):
    vocab, rule = tok["model"]["vocab"], piece_rule(tok)

    def encode(segment, starts_text):
        there = segment == "" or segment[0] in (" ", SPACE)
        text = segment.replace(" ", SPACE)
        if rule == "always" or (rule == "unless" and not there) or (rule == "first" and starts_text and not there):
            text = SPACE + text
        parts = []
        for ch in text:
            if ch in vocab:
                parts.append(ch)
            else:
                parts.extend("<0x%02X>" % b for b in ch.encode("utf-8"))
        while True:
            best = None
            for k in range(len(parts) - 1):
                r = ranks.get((parts[k], parts[k + 1]))
                if r is not None and parts[k] + parts[k + 1] in vocab and (best is None or r < best[0]):
                    best = (r, k)
            if best is None:
                break
            k = best[1]
            parts[k:k + 2] = [parts[k] + parts[k + 1]]
        return [vocab[p] for p in parts]
    return encode


def main():
    tok = json.load(open(sys.argv[1], encoding="utf-8"))
    raw = open(sys.argv[2], "rb").read().decode("utf-8", errors="replace")
    texts = raw.split("\n") if "--lines" in sys.argv else [raw]
    model = tok["model"]
    vocab = model["vocab"]
    ranks = {}
    for r, m in enumerate(model["merges"]):
        pair = tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
        ranks[pair] = r  # a repeated pair: the last rank, as Hugging Face's tokenizers read it
    pre = tok["pre_tokenizer"]
    piece = model.get("byte_fallback") or (pre and pre.get("type") == "Metaspace")
    if not piece:
        pattern = pre["pretokenizers"][0]["pattern"]["Regex"] if pre["type"] == "Sequence" else GPT2_PATTERN
        splitter = translate(pattern)
        stand_in = byte_stand_ins()
    else:
        piece_encode = piece_encoder(tok, ranks)
    added = sorted(tok.get("added_tokens", []), key=lambda a: -len(a["content"]))
    added_re = re.compile("|".join(re.escape(a["content"]) for a in added)) if added else None
    added_id = {a["content"]: a["id"] for a in added}
    strips = {a["content"]: (a.get("lstrip", False), a.get("rstrip", False)) for a in added}
    ignore_merges = model.get("ignore_merges", False)

    def bpe(word):
        parts = [stand_in[b] for b in word.encode("utf-8")]
        if ignore_merges and "".join(parts) in vocab:
            return [vocab["".join(parts)]]
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda k: ranks.get((parts[k], parts[k + 1]), 1 << 60))
            pair = (parts[best], parts[best + 1])
            if pair not in ranks:
                break
            merged, k = [], 0
            while k < len(parts):
                if k + 1 < len(parts) and (parts[k], parts[k + 1]) == pair:
                    merged.append(parts[k] + parts[k + 1])
                    k += 2
                else:
                    merged.append(parts[k])
                    k += 1
            parts = merged
        return [vocab[p] for p in parts]

    def encode(text):
        ids = []

        def plain(chunk, starts_text):
            if not chunk:
                return
            if piece:
                ids.extend(piece_encode(chunk, starts_text))
                return
            for m in splitter.finditer(chunk):
                ids.extend(bpe(m.group(0)))

        at = 0
        if added_re:
            for m in added_re.finditer(text):
                if m.start() < at:  # inside whitespace an earlier token took
                    continue
                start, end = m.start(), m.end()
                if strips[m.group(0)][0]:  # lstrip: the whitespace before it, back to the last token
                    while start > at and text[start - 1].isspace() and text[start - 1] not in "\x1c\x1d\x1e\x1f":
                        start -= 1
                if strips[m.group(0)][1]:  # rstrip: the whitespace after it
                    while end < len(text) and text[end].isspace() and text[end] not in "\x1c\x1d\x1e\x1f":
                        end += 1
                plain(text[at:start], at == 0)
                ids.append(added_id[m.group(0)])
                at = end
        plain(text[at:], at == 0)
        return ids

    out = [encode(t) for t in texts]
    json.dump(out if "--lines" in sys.argv else out[0], sys.stdout)


main()
