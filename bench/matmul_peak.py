"""Matmul rate of this machine at GPT-2 training shapes, for bench_train.sh's MFU column: the best
of a few 512x768 @ 768x3072 products (the MLP's shape at B=4, T=128) in the given precision.

usage: matmul_peak.py PRECISION(fp32|bf16) THREADS      prints TFLOP/s
"""
import sys
import time

import torch

dtype = torch.bfloat16 if sys.argv[1] == "bf16" else torch.float32
torch.set_num_threads(int(sys.argv[2]))
a, b = torch.randn(512, 768).to(dtype), torch.randn(768, 3072).to(dtype)
out = torch.empty(512, 3072, dtype=dtype)
best = float("inf")
for _ in range(30):
    t0 = time.perf_counter()
    torch.mm(a, b, out=out)
    best = min(best, time.perf_counter() - t0)
print(f"{2 * 512 * 768 * 3072 / best / 1e12:.3f}")
