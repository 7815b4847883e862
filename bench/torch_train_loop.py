"""The training loop both PyTorch references in bench/ time: AdamW (lr 3e-4, weight decay 0.1) on an
fp32 master copy when the model runs in bf16 (ds's algorithm), clipping at 1.0, random tokens.
Returns the median tokens/s of the timed steps (step 0 warms up)."""
import statistics
import time

import torch


def median_tokens_per_s(loss_fn, params, dtype, vocab, batch, seq, steps):
    master = [p.detach().float().clone().requires_grad_(True) for p in params] if dtype != torch.float32 else params
    opt = torch.optim.AdamW(master, lr=3e-4, weight_decay=0.1)
    rates = []
    for step in range(steps + 1):
        idx, tgt = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
        t0 = time.perf_counter()
        for p in params:
            p.grad = None
        loss_fn(idx, tgt).backward()
        if dtype != torch.float32:
            for m, p in zip(master, params):
                m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(master, 1.0)
        opt.step()
        if dtype != torch.float32:
            with torch.no_grad():
                for m, p in zip(master, params):
                    p.copy_(m)
        if step > 0:
            rates.append(batch * seq / (time.perf_counter() - t0))
    return statistics.median(rates)
