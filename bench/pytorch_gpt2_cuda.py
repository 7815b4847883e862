"""PyTorch reference on a CUDA GPU for bench_cuda_train.sh: GPT-2 (Hugging Face's architecture, tied head)
trained with fused AdamW, bf16 autocast over fp32 weights (nanoGPT's recipe), SDPA attention. Prints the
median tokens/s of the timed steps, MFU by nanoGPT's formula against PEAK TFLOP/s, and the peak memory
LibTorch's allocator reached.

usage: pytorch_gpt2_cuda.py LAYERS WIDTH HEADS VOCAB BATCH SEQ STEPS PEAK_TFLOPS [compile]
"""
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

L, C, NH, V, B, T, steps = (int(a) for a in sys.argv[1:8])
peak = float(sys.argv[8]) * 1e12
compiled = len(sys.argv) > 9 and sys.argv[9] == "compile"
torch.manual_seed(1)
dev = "cuda"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fcp = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        q, k, v = self.attn(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fcp(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.lnf = nn.LayerNorm(C)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, V), targets.view(-1))


model = GPT().to(dev)
n_params = sum(p.numel() for p in model.parameters())
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
step_fn = torch.compile(model) if compiled else model
x = torch.randint(0, V, (B, T), device=dev)
y = torch.randint(0, V, (B, T), device=dev)
times = []
for i in range(steps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = step_fn(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
timed = times[min(5, steps // 2):]
tps = B * T / statistics.median(timed)
flops_per_token = 6 * n_params + 12 * L * C * T  # nanoGPT's estimate
print(f"pytorch {'compiled' if compiled else 'eager'}: {tps:,.0f} tokens/s, MFU {tps * flops_per_token / peak:.3f}, "
      f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, params {n_params / 1e6:.1f} M, loss {loss.item():.3f}")
