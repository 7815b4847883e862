#!/usr/bin/env python3
"""An independent reader of an exported Hugging Face GPT-2, Llama, Mistral, Qwen2, Qwen3, Phi-3 or Gemma 2 directory: parses
model.safetensors with the json and struct modules only, runs a plain forward written against Hugging Face's
tensor names and layouts (GPT-2: Conv1D weights [in, out], gelu_new, the head tied to wte; Llama and its
kin: nn.Linear [out, in] with any biases the file holds, RMSNorm, Qwen3's RMSNorm over each head's q and k,
rotary embeddings rotating halves, head_dim as config.json gives it, grouped-query attention within the
sliding window where one acts, SwiGLU, lm_head or the tied embedding), and prints the mean cross-entropy of
predicting tokens[1:] from tokens[:-1].

    python3 tests/tools/hf_lm_loss.py HF_DIR TOKEN_FILE(uint16) [PEFT_ADAPTER_DIR]
With a PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors, as PEFT documents them)
the adapter is merged first, as PEFT's merge does: W += (lora_alpha / r) B A, transposed for a fan_in_fan_out
(Conv1D) base. Pure Python, so only for tiny models (a test's tiny model on 16 tokens takes a second)."""
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


def cross_entropy(x, head, targets, cap=None):  # x [T][C], head [V][C]: logits = x @ head^T (capped as cap tanh(z / cap))
    total = 0.0
    for t, row in enumerate(x):
        logits = [sum(a * b for a, b in zip(row, h)) for h in head]
        if cap:
            logits = [cap * math.tanh(v / cap) for v in logits]
        m = max(logits)
        lse = m + math.log(sum(math.exp(v - m) for v in logits))
        total += lse - logits[targets[t]]
    return total / len(x)


def attention(q_rows, k_rows, v_rows, H, KV, D, window=None, scalar=None, cap=None):  # causal; query head h reads kv head h // (H // KV)
    T = len(q_rows)
    scale = 1.0 / math.sqrt(scalar or D)
    capped = (lambda s: cap * math.tanh(s / cap)) if cap else (lambda s: s)
    out = [[0.0] * (H * D) for _ in range(T)]
    for head in range(H):
        kv = head // (H // KV)
        q = [row[head * D:(head + 1) * D] for row in q_rows]
        k = [row[kv * D:(kv + 1) * D] for row in k_rows]
        v = [row[kv * D:(kv + 1) * D] for row in v_rows]
        for t in range(T):
            first = 0 if window is None else max(0, t - window + 1)  # the last `window` positions, t among them
            seen = range(first, t + 1)
            scores = [capped(sum(q[t][d] * k[s][d] for d in range(D)) * scale) for s in seen]
            m = max(scores)
            e = [math.exp(sc - m) for sc in scores]
            z = sum(e)
            for d in range(D):
                out[t][head * D + d] = sum(e[i] * v[s][d] for i, s in enumerate(seen)) / z
    return out


def nn_linear(x, w):  # nn.Linear: x [T][in] @ w[out][in]^T
    return [[sum(a * b for a, b in zip(row, wr)) for wr in w] for row in x]


def rms_norm(x, g, eps, plus_one=False):  # Gemma's scales by 1 + g
    out = []
    for row in x:
        inv = 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + eps)
        out.append([v * inv * (g[i] + 1.0 if plus_one else g[i]) for i, v in enumerate(row)])
    return out


def rope_frequencies(config, D, T):
    """Hugging Face's rope_scaling (modeling_rope_utils), written out: the inverse frequencies and the factor
    cos and sin are scaled by."""
    theta, scaling = config["rope_theta"], config.get("rope_scaling")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    context = config["max_position_embeddings"]
    if kind == "dynamic" and T > context:
        f = scaling["factor"]
        theta = theta * ((f * T / context) - (f - 1)) ** (D / (D - 2))
    inv = [theta ** (-2.0 * j / D) for j in range(D // 2)]
    scale = 1.0
    if kind == "linear":
        inv = [v / scaling["factor"] for v in inv]
    elif kind == "llama3":
        f, lo, hi, old = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["original_max_position_embeddings"]
        out = []
        for v in inv:
            wavelen = 2 * math.pi / v
            if wavelen < old / hi:
                out.append(v)
            elif wavelen > old / lo:
                out.append(v / f)
            else:
                smooth = (old / wavelen - lo) / (hi - lo)
                out.append((1 - smooth) * v / f + smooth * v)
        inv = out
    elif kind in ("longrope", "su"):  # the short factors within the original context, the long ones past it
        original = scaling.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
        ext = scaling["long_factor"] if T > original else scaling["short_factor"]
        inv = [v / e for v, e in zip(inv, ext)]
        stretch = context / original
        scale = scaling.get("attention_factor") or (1.0 if stretch <= 1 else math.sqrt(1 + math.log(stretch) / math.log(original)))
    elif kind == "yarn":
        f = scaling["factor"]
        scale = scaling.get("attention_factor") or 0.1 * math.log(f) + 1.0
        fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
        dim_of = lambda rot: D * math.log(context / (rot * 2 * math.pi)) / (2 * math.log(theta))
        low, high = max(math.floor(dim_of(fast)), 0), min(math.ceil(dim_of(slow)), D - 1)
        if low == high:
            high += 0.001
        ramp = [min(max((j - low) / (high - low), 0.0), 1.0) for j in range(D // 2)]
        inv = [v / f * r + v * (1 - r) for v, r in zip(inv, ramp)]
    return inv, scale


def rope(rows, heads, D, inv, scale):  # rotate_half: the first and last D/2 of each head pair up
    out = []
    for t, row in enumerate(rows):
        r = list(row)
        for h in range(heads):
            for j in range(D // 2):
                angle = t * inv[j]
                c, s = math.cos(angle) * scale, math.sin(angle) * scale
                a, b = row[h * D + j], row[h * D + j + D // 2]
                r[h * D + j] = a * c - b * s
                r[h * D + j + D // 2] = b * c + a * s
        out.append(r)
    return out


def llama_loss(config, W, inputs, targets):
    gemma = config["model_type"] in ("gemma", "gemma2")  # (1 + w) norms, a scaled embedding, GeGLU
    gemma2 = config["model_type"] == "gemma2"  # and Gemma 2's sandwich norms, caps, query scalar, windows
    C, H = config["hidden_size"], config["num_attention_heads"]
    KV = config.get("num_key_value_heads", H)
    D, eps = config.get("head_dim") or C // H, config["rms_norm_eps"]
    window = config.get("sliding_window")
    if config["model_type"] in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
        window = None
    # Gemma2Config's defaults where a key is left out (null turns a cap off)
    scalar = config.get("query_pre_attn_scalar", 256) if gemma2 else None
    attn_cap = config.get("attn_logit_softcapping", 50.0) if gemma2 else None
    final_cap = config.get("final_logit_softcapping", 30.0) if gemma2 else None
    norm = lambda rows, g: rms_norm(rows, g, eps, gemma)
    inv, scale = rope_frequencies(config, D, len(inputs))
    embed = matrix(W["model.embed_tokens.weight"])
    x = [list(embed[tok]) for tok in inputs]
    if gemma:  # times sqrt(width), rounded to fp32 as the normalizer is
        normalizer = struct.unpack("<f", struct.pack("<f", math.sqrt(C)))[0]
        x = [[v * normalizer for v in row] for row in x]
    for l in range(config["num_hidden_layers"]):
        p = f"model.layers.{l}."

        def proj(rows, name):  # nn.Linear, with its bias when the file has one
            y = nn_linear(rows, matrix(W[p + name + ".weight"]))
            if p + name + ".bias" in W:
                b = W[p + name + ".bias"][1]
                y = [[v + b[i] for i, v in enumerate(row)] for row in y]
            return y

        def per_head_norm(rows, heads, name):  # Qwen3: RMSNorm over each head's D values
            if p + name + ".weight" not in W:
                return rows
            g = W[p + name + ".weight"][1]
            return [sum((rms_norm([row[h * D:(h + 1) * D]], g, eps)[0] for h in range(heads)), []) for row in rows]

        h = norm(x, W[p + "input_layernorm.weight"][1])
        if p + "self_attn.qkv_proj.weight" in W:  # Phi-3: q | k | v along the output
            qkv = proj(h, "self_attn.qkv_proj")
            q, k, v = [r[:H * D] for r in qkv], [r[H * D:(H + KV) * D] for r in qkv], [r[(H + KV) * D:] for r in qkv]
        else:
            q, k, v = proj(h, "self_attn.q_proj"), proj(h, "self_attn.k_proj"), proj(h, "self_attn.v_proj")
        q = rope(per_head_norm(q, H, "self_attn.q_norm"), H, D, inv, scale)
        k = rope(per_head_norm(k, KV, "self_attn.k_norm"), KV, D, inv, scale)
        layer_window = window if not gemma2 or l % 2 == 0 else None  # Gemma 2 slides on the even layers
        o = proj(attention(q, k, v, H, KV, D, layer_window, scalar, attn_cap), "self_attn.o_proj")
        if gemma2:  # the sandwich: each sub-layer's output normalised before the residual add
            o = norm(o, W[p + "post_attention_layernorm.weight"][1])
        x = [[a + b for a, b in zip(r1, r2)] for r1, r2 in zip(x, o)]
        h = norm(x, W[p + ("pre_feedforward_layernorm.weight" if gemma2 else "post_attention_layernorm.weight")][1])
        if p + "mlp.gate_up_proj.weight" in W:  # Phi-3: the first half gates, the second goes up
            both = proj(h, "mlp.gate_up_proj")
            half = len(both[0]) // 2
            gate, up = [r[:half] for r in both], [r[half:] for r in both]
        else:
            gate, up = proj(h, "mlp.gate_proj"), proj(h, "mlp.up_proj")
        if gemma:
            act = [[gelu_new(g) * u for g, u in zip(gr, ur)] for gr, ur in zip(gate, up)]
        else:
            act = [[g / (1.0 + math.exp(-g)) * u for g, u in zip(gr, ur)] for gr, ur in zip(gate, up)]
        f = proj(act, "mlp.down_proj")
        if gemma2:
            f = norm(f, W[p + "post_feedforward_layernorm.weight"][1])
        x = [[a + b for a, b in zip(r1, r2)] for r1, r2 in zip(x, f)]
    x = norm(x, W["model.norm.weight"][1])
    head = matrix(W["lm_head.weight"]) if "lm_head.weight" in W else embed
    return cross_entropy(x, head, targets, final_cap)


def merge_adapter(W, adapter_dir):
    config = json.load(open(f"{adapter_dir}/adapter_config.json"))
    assert config["peft_type"] == "LORA" and config["bias"] == "none" and not config.get("use_rslora", False)
    scale = config["lora_alpha"] / config["r"]
    A = read_safetensors(f"{adapter_dir}/adapter_model.safetensors")
    prefix, suffix = "base_model.model.", ".lora_A.weight"
    merged = 0
    for name, a in A.items():
        if not name.endswith(suffix):
            continue
        stem = name[len(prefix):-len(suffix)]
        a = matrix(a)  # [r][in]
        b = matrix(A[prefix + stem + ".lora_B.weight"])  # [out][r]
        key = stem + ".weight"
        if key not in W and key.startswith("transformer."):
            key = key[len("transformer."):]
        shape, flat = W[key]
        rows, cols = shape
        for o in range(len(b)):
            for i in range(len(a[0])):
                d = scale * sum(b[o][k] * a[k][i] for k in range(len(a)))
                at = i * cols + o if config["fan_in_fan_out"] else o * cols + i
                flat[at] += d
        merged += 1
    assert merged > 0, "no lora_A tensors in the adapter"


def main():
    hf_dir, token_file = sys.argv[1], sys.argv[2]
    config = json.load(open(f"{hf_dir}/config.json"))
    W = read_safetensors(f"{hf_dir}/model.safetensors")
    if len(sys.argv) > 3:
        merge_adapter(W, sys.argv[3])
    raw = open(token_file, "rb").read()
    tokens = list(struct.unpack(f"<{len(raw) // 2}H", raw))
    inputs, targets = tokens[:-1], tokens[1:]
    if config["model_type"] in ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2"):
        print(f"{llama_loss(config, W, inputs, targets):.9f}")
        return
    assert config["model_type"] == "gpt2"
    P = lambda name: W.get("transformer." + name, W.get(name))
    C, H = config["n_embd"], config["n_head"]
    D, eps = C // H, config["layer_norm_epsilon"]
    wte, wpe = matrix(P("wte.weight")), matrix(P("wpe.weight"))
    x = [[wte[tok][c] + wpe[t][c] for c in range(C)] for t, tok in enumerate(inputs)]
    for l in range(config["n_layer"]):
        p = f"h.{l}."
        h = layer_norm(x, P(p + "ln_1.weight")[1], P(p + "ln_1.bias")[1], eps)
        qkv = linear(h, matrix(P(p + "attn.c_attn.weight")), P(p + "attn.c_attn.bias")[1])
        att = attention([r[:C] for r in qkv], [r[C:2 * C] for r in qkv], [r[2 * C:] for r in qkv], H, H, D)
        proj = linear(att, matrix(P(p + "attn.c_proj.weight")), P(p + "attn.c_proj.bias")[1])
        x = [[a + b for a, b in zip(r1, r2)] for r1, r2 in zip(x, proj)]
        h = layer_norm(x, P(p + "ln_2.weight")[1], P(p + "ln_2.bias")[1], eps)
        f = linear(h, matrix(P(p + "mlp.c_fc.weight")), P(p + "mlp.c_fc.bias")[1])
        f = [[gelu_new(v) for v in row] for row in f]
        f = linear(f, matrix(P(p + "mlp.c_proj.weight")), P(p + "mlp.c_proj.bias")[1])
        x = [[a + b for a, b in zip(r1, r2)] for r1, r2 in zip(x, f)]
    x = layer_norm(x, P("ln_f.weight")[1], P("ln_f.bias")[1], eps)
    print(f"{cross_entropy(x, wte, targets):.9f}")  # the head is tied to wte


if __name__ == "__main__":
    main()
