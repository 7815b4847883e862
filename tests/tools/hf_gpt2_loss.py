#!/usr/bin/env python3
"""An independent reader of an exported Hugging Face GPT-2 directory: parses model.safetensors with the
json and struct modules only, runs a plain GPT-2 forward written against Hugging Face's tensor names and
layouts (Conv1D weights [in, out], gelu_new, the head tied to wte), and prints the mean cross-entropy of
predicting tokens[1:] from tokens[:-1].

    python3 tests/tools/hf_gpt2_loss.py HF_DIR TOKEN_FILE(uint16)
Pure Python, so only for tiny models (a test's gpt2-tiny on 16 tokens takes a second)."""
import json
import math
import struct
import sys


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    base = 8 + n
    tensors = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", f"{name}: this reader takes F32 exports"
        begin, end = t["data_offsets"]
        count = (end - begin) // 4
        flat = list(struct.unpack_from(f"<{count}f", data, base + begin))
        tensors[name] = (t["shape"], flat)
    return tensors


def matrix(t):  # row-major [rows][cols]
    shape, flat = t
    rows, cols = shape
    return [flat[r * cols:(r + 1) * cols] for r in range(rows)]


def linear(x, w, b):  # Conv1D: x [T][in] @ w [in][out] + b
    out_dim = len(w[0])
    y = []
    for row in x:
        acc = list(b)
        for i, xi in enumerate(row):
            if xi != 0.0:
                wi = w[i]
                for j in range(out_dim):
                    acc[j] += xi * wi[j]
        y.append(acc)
    return y


def layer_norm(x, g, b, eps):
    out = []
    for row in x:
        mean = sum(row) / len(row)
        var = sum((v - mean) ** 2 for v in row) / len(row)
        inv = 1.0 / math.sqrt(var + eps)
        out.append([(v - mean) * inv * g[i] + b[i] for i, v in enumerate(row)])
    return out


def gelu_new(v):
    return 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))


def main():
    hf_dir, token_file = sys.argv[1], sys.argv[2]
    config = json.load(open(f"{hf_dir}/config.json"))
    assert config["model_type"] == "gpt2"
    W = read_safetensors(f"{hf_dir}/model.safetensors")
    P = lambda name: W.get("transformer." + name, W.get(name))
    raw = open(token_file, "rb").read()
    tokens = list(struct.unpack(f"<{len(raw) // 2}H", raw))
    inputs, targets = tokens[:-1], tokens[1:]
    T, C, H = len(inputs), config["n_embd"], config["n_head"]
    D, eps = C // H, config["layer_norm_epsilon"]
    wte, wpe = matrix(P("wte.weight")), matrix(P("wpe.weight"))
    x = [[wte[tok][c] + wpe[t][c] for c in range(C)] for t, tok in enumerate(inputs)]
    for l in range(config["n_layer"]):
        p = f"h.{l}."
        h = layer_norm(x, P(p + "ln_1.weight")[1], P(p + "ln_1.bias")[1], eps)
        qkv = linear(h, matrix(P(p + "attn.c_attn.weight")), P(p + "attn.c_attn.bias")[1])
        att = [[0.0] * C for _ in range(T)]
        for head in range(H):
            q = [row[head * D:(head + 1) * D] for row in qkv]
            k = [row[C + head * D:C + (head + 1) * D] for row in qkv]
            v = [row[2 * C + head * D:2 * C + (head + 1) * D] for row in qkv]
            for t in range(T):
                scores = [sum(q[t][d] * k[s][d] for d in range(D)) / math.sqrt(D) for s in range(t + 1)]
                m = max(scores)
                e = [math.exp(sc - m) for sc in scores]
                z = sum(e)
                for d in range(D):
                    att[t][head * D + d] = sum(e[s] * v[s][d] for s in range(t + 1)) / z
        proj = linear(att, matrix(P(p + "attn.c_proj.weight")), P(p + "attn.c_proj.bias")[1])
        x = [[a + b for a, b in zip(r1, r2)] for r1, r2 in zip(x, proj)]
        h = layer_norm(x, P(p + "ln_2.weight")[1], P(p + "ln_2.bias")[1], eps)
        f = linear(h, matrix(P(p + "mlp.c_fc.weight")), P(p + "mlp.c_fc.bias")[1])
        f = [[gelu_new(v) for v in row] for row in f]
        f = linear(f, matrix(P(p + "mlp.c_proj.weight")), P(p + "mlp.c_proj.bias")[1])
        x = [[a + b for a, b in zip(r1, r2)] for r1, r2 in zip(x, f)]
    x = layer_norm(x, P("ln_f.weight")[1], P("ln_f.bias")[1], eps)
    total = 0.0
    for t in range(T):  # the head is tied: logits = x @ wte^T
        logits = [sum(x[t][c] * row[c] for c in range(C)) for row in wte]
        m = max(logits)
        lse = m + math.log(sum(math.exp(v - m) for v in logits))
        total += lse - logits[targets[t]]
    print(f"{total / T:.9f}")


if __name__ == "__main__":
    main()
