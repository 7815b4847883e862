"""PyTorch eager reference for bench_train.sh: a Llama in Hugging Face's layout (nn.Linear weights
[out, in], RMSNorm with its statistic in fp32, rotary embeddings rotating halves, grouped-query
attention by repeating key/value heads, SwiGLU MLP, an untied lm_head), trained with AdamW, fp32 or
bf16 with an fp32 master copy (the same algorithm ds runs). Prints the median tokens/s of the timed steps.

usage: pytorch_llama.py LAYERS WIDTH HEADS KV_HEADS INTERMEDIATE VOCAB BATCH SEQ PRECISION(fp32|bf16) STEPS THREADS
"""
import sys

import torch
import torch.nn.functional as F

from torch_train_loop import median_tokens_per_s

L, C, NH, NKV, I, V, B, T = (int(a) for a in sys.argv[1:9])
precision, steps, threads = sys.argv[9], int(sys.argv[10]), int(sys.argv[11])
torch.set_num_threads(threads)
torch.manual_seed(1)
dtype = torch.bfloat16 if precision == "bf16" else torch.float32
D, group = C // NH, NH // NKV


def param(*shape, fill=None):
    t = torch.empty(*shape)
    t.normal_(0, 0.02) if fill is None else t.fill_(fill)
    return t.to(dtype).requires_grad_(True)


embed, norm, head = param(V, C), param(C, fill=1.0), param(V, C)
blocks = [dict(norm_in=param(C, fill=1.0), q=param(NH * D, C), k=param(NKV * D, C), v=param(NKV * D, C), o=param(C, NH * D),
               norm_post=param(C, fill=1.0), gate=param(I, C), up=param(I, C), down=param(C, I)) for _ in range(L)]
params = [embed] + [p for b in blocks for p in b.values()] + [norm, head]
mask = torch.ones(T, T, dtype=torch.bool).triu(1)
inv_freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
angles = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)


def rms_norm(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def rotate_half(x):
    return torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)


def loss_fn(idx, tgt):
    x = F.embedding(idx, embed)
    for b in blocks:
        h = rms_norm(x, b["norm_in"])
        q = F.linear(h, b["q"]).view(B, T, NH, D).transpose(1, 2)
        k = F.linear(h, b["k"]).view(B, T, NKV, D).transpose(1, 2)
        v = F.linear(h, b["v"]).view(B, T, NKV, D).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        att = torch.softmax(((q @ k.transpose(-2, -1)) * D ** -0.5).masked_fill(mask, float("-inf")), -1)
        x = x + F.linear((att @ v).transpose(1, 2).reshape(B, T, C), b["o"])
        h = rms_norm(x, b["norm_post"])
        x = x + F.linear(F.silu(F.linear(h, b["gate"])) * F.linear(h, b["up"]), b["down"])
    x = rms_norm(x, norm)
    return F.cross_entropy(F.linear(x.view(B * T, C), head).float(), tgt.view(-1))


print(f"{median_tokens_per_s(loss_fn, params, dtype, V, B, T, steps):.1f}")
