"""Matmul rate of this machine, for bench_train.sh's MFU columns, in the given precision.

usage: matmul_peak.py PRECISION(fp32|bf16) THREADS                 prints TFLOP/s at 512x768 @ 768x3072
       matmul_peak.py PRECISION THREADS PLAN_JSON TOKENS           prints TFLOP/s at the model's own shapes

The first form times one product, the MLP's shape of GPT-2 124M at B=4, T=128. The second reads the
model's weights from `ds plan --json` and times TOKENS x in @ in x out for every distinct matmul
weight (the output head included, tied or not), then weights each shape's rate by the FLOPs a step
spends in it: the rate the model's matmuls would reach if nothing else ran. Each rate is the best of
3-30 products (as many as fit in a second). ds profile's "matmul peak" weights the same shapes but
takes each one's mean rate, so its figure is a little lower.

In fp32 each shape is also timed through oneDNN's sgemm where libdnnl.so.2 loads (ds runs its layers'
fp32 products there; PyTorch's own fp32 mm is OpenBLAS's on Debian), and the faster library counts.
"""
import ctypes
import json
import sys
import time

import torch


def onednn_sgemm():
    """oneDNN's row-major C = alpha A B + beta C, or None where the library is not installed."""
    try:
        f = ctypes.CDLL("libdnnl.so.2").dnnl_sgemm
    except (OSError, AttributeError):
        return None
    i64, flt, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_char, ctypes.c_char, i64, i64, i64, flt, ptr, i64, ptr, i64, flt, ptr, i64]
    return f


def best_seconds(m, k, n, dtype, budget_s=1.0, min_reps=3):
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    products = [lambda: torch.mm(a, b, out=out)]
    sgemm = onednn_sgemm() if dtype == torch.float32 else None
    if sgemm:
        products.append(lambda: sgemm(b"N", b"N", m, n, k, 1.0, a.data_ptr(), k, b.data_ptr(), n, 0.0, out.data_ptr(), n))
    best = float("inf")
    for product in products:
        product()  # warm: first-call allocation and kernel choice
        reps, start = 0, time.perf_counter()
        while reps < min_reps or (time.perf_counter() - start < budget_s and reps < 30):
            t0 = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - t0)
            reps += 1
    return best


def model_shapes(plan):
    """(in, out) -> how many such weights: every 2-D weight but the embedding tables, plus a tied head."""
    model = plan["model"]
    shapes = {}
    for p in plan["layout"]["params"]:
        name, shape = p["name"], p["shape"]
        if len(shape) != 2 or any(e in name for e in ("wte", "wpe", "embed_tokens")):  # the plan's embedding tables
            continue
        # GPT-2's blocks keep Conv1D weights as (in, out); Llama's and any lm_head are (out, in).
        conv1d = model["arch"] == "gpt2" and not name.startswith("lm_head")
        key = (shape[0], shape[1]) if conv1d else (shape[1], shape[0])
        shapes[key] = shapes.get(key, 0) + 1
    if model["tie_word_embeddings"]:
        key = (model["hidden_size"], model["vocab_size"])
        shapes[key] = shapes.get(key, 0) + 1
    return shapes


dtype = torch.bfloat16 if sys.argv[1] == "bf16" else torch.float32
torch.set_num_threads(int(sys.argv[2]))
if len(sys.argv) == 3:
    print(f"{2 * 512 * 768 * 3072 / best_seconds(512, 768, 3072, dtype) / 1e12:.3f}")
else:
    plan, tokens = json.load(open(sys.argv[3])), int(sys.argv[4])
    flops = seconds = 0.0
    for (k, n), count in sorted(model_shapes(plan).items()):
        flops += count * 2.0 * tokens * k * n
        seconds += count * best_seconds(tokens, k, n, dtype)
    print(f"{flops / seconds / 1e12:.3f}")
