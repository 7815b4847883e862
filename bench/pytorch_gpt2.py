"""PyTorch eager reference for bench_train.sh: GPT-2 (Hugging Face's architecture, Conv1D weights
[in, out], tied head) trained with AdamW, fp32 or bf16 with an fp32 master copy (the same algorithm
ds runs). Prints the median tokens/s of the timed steps.

usage: pytorch_gpt2.py LAYERS WIDTH HEADS VOCAB BATCH SEQ PRECISION(fp32|bf16) STEPS THREADS
"""
import math
import sys

import torch
import torch.nn.functional as F

from torch_train_loop import median_tokens_per_s

L, C, NH, V, B, T = (int(a) for a in sys.argv[1:7])
precision, steps, threads = sys.argv[7], int(sys.argv[8]), int(sys.argv[9])
torch.set_num_threads(threads)
torch.manual_seed(1)
dtype = torch.bfloat16 if precision == "bf16" else torch.float32


def param(*shape, std=0.02, fill=None):
    t = torch.empty(*shape)
    if fill is None:
        t.normal_(0, std)
    else:
        t.fill_(fill)
    return t.to(dtype).requires_grad_(True)


wte, wpe = param(V, C), param(1024, C)
blocks = []
for _ in range(L):
    blocks.append(dict(ln1_w=param(C, fill=1.0), ln1_b=param(C, fill=0.0), attn_w=param(C, 3 * C), attn_b=param(3 * C, fill=0.0),
                       proj_w=param(C, C, std=0.02 / math.sqrt(2 * L)), proj_b=param(C, fill=0.0), ln2_w=param(C, fill=1.0),
                       ln2_b=param(C, fill=0.0), fc_w=param(C, 4 * C), fc_b=param(4 * C, fill=0.0),
                       fcp_w=param(4 * C, C, std=0.02 / math.sqrt(2 * L)), fcp_b=param(C, fill=0.0)))
lnf_w, lnf_b = param(C, fill=1.0), param(C, fill=0.0)
params = [wte, wpe] + [p for b in blocks for p in b.values()] + [lnf_w, lnf_b]
mask = torch.ones(T, T, dtype=torch.bool).triu(1)


def loss_fn(idx, tgt):
    x = F.embedding(idx, wte) + wpe[:T]
    D = C // NH
    for b in blocks:
        h = F.layer_norm(x, (C,), b["ln1_w"], b["ln1_b"])
        qkv = torch.addmm(b["attn_b"], h.view(B * T, C), b["attn_w"]).view(B, T, 3, NH, D).permute(2, 0, 3, 1, 4)
        att = (qkv[0] @ qkv[1].transpose(-2, -1)) * (1.0 / math.sqrt(D))
        att = torch.softmax(att.masked_fill(mask, float("-inf")), -1)
        y = (att @ qkv[2]).transpose(1, 2).reshape(B * T, C)
        x = x + torch.addmm(b["proj_b"], y, b["proj_w"]).view(B, T, C)
        h = F.layer_norm(x, (C,), b["ln2_w"], b["ln2_b"])
        f = F.gelu(torch.addmm(b["fc_b"], h.view(B * T, C), b["fc_w"]), approximate="tanh")
        x = x + torch.addmm(b["fcp_b"], f, b["fcp_w"]).view(B, T, C)
    x = F.layer_norm(x, (C,), lnf_w, lnf_b)
    return F.cross_entropy((x.view(B * T, C) @ wte.t()).float(), tgt.view(-1))


print(f"{median_tokens_per_s(loss_fn, params, dtype, V, B, T, steps):.1f}")
