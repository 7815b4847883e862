#!/usr/bin/env python3
"""Grouped-query attention on the GPU, two ways, at TinyLlama's shape (32 query heads, 4 k/v heads, head dim 64),
bf16, causal, forward and backward: k and v repeated to the query heads first (what ds does today, then LibTorch's
scaled_dot_product_attention picks its backend), against k and v passed as they are with enable_gqa=True (PyTorch
2.5+). Prints, for each, the time a call pair takes (CUDA events, median of the rounds, interleaved), the backend
PyTorch says it can use, and the profiler's attention kernels: the question is whether the unrepeated call keeps
cuDNN's kernels (which ds's H200 runs pick) or falls to flash's, and which is faster with the repeat's copies and its
gradient's reductions counted. Run by scripts/device-check.sh's bench stage; needs a CUDA GPU.

    python3 bench/probe_sdpa_gqa.py [BATCH=8] [SEQ=1024] [ROUNDS=7]
"""
import sys

import torch
import torch.nn.functional as F


def main():
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    seq = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    heads, kv_heads, dim = 32, 4, 64
    print(f"command: {' '.join(sys.argv)}")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    if not torch.cuda.is_available():
        print("probe_sdpa_gqa: no CUDA device")
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}; shape: batch {batch}, {seq} tokens, {heads} query heads, "
          f"{kv_heads} k/v heads, head dim {dim}, bf16, causal")
    gen = torch.Generator(device="cuda").manual_seed(1)
    opts = dict(device="cuda", dtype=torch.bfloat16)
    q0 = torch.randn(batch, heads, seq, dim, generator=gen, **opts)
    k0 = torch.randn(batch, kv_heads, seq, dim, generator=gen, **opts)
    v0 = torch.randn(batch, kv_heads, seq, dim, generator=gen, **opts)
    dy = torch.randn(batch, heads, seq, dim, generator=gen, **opts)
    group = heads // kv_heads

    def repeated():
        q, k, v = (t.detach().requires_grad_() for t in (q0, k0, v0))
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                                           is_causal=True)
        y.backward(dy)
        return y, k.grad

    def grouped():
        q, k, v = (t.detach().requires_grad_() for t in (q0, k0, v0))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y.backward(dy)
        return y, k.grad

    forms = {"repeated": repeated}
    try:
        grouped()
        forms["enable_gqa"] = grouped
    except (TypeError, RuntimeError) as e:  # before 2.5, or no backend for it
        print(f"enable_gqa: not run ({type(e).__name__}: {str(e).splitlines()[0]})")

    # Which backends PyTorch admits for each call (its own predicates; the names vary by version).
    try:
        from torch.backends.cuda import SDPAParams
        for name, kv in (("repeated", (k0.repeat_interleave(group, dim=1), v0.repeat_interleave(group, dim=1), False)),
                         ("enable_gqa", (k0, v0, True))):
            try:
                params = SDPAParams(q0, kv[0], kv[1], None, 0.0, True, kv[2])
            except TypeError:
                params = SDPAParams(q0, kv[0], kv[1], None, 0.0, True)
            admits = []
            for backend in ("cudnn", "flash", "efficient"):
                check = getattr(torch.backends.cuda, f"can_use_{backend}_attention", None)
                if check is not None and check(params, False):
                    admits.append(backend)
            print(f"{name}: backends admitted: {', '.join(admits) or 'math only'}")
    except Exception as e:  # noqa: BLE001 (a probe: say what failed and go on)
        print(f"backend predicates not available ({type(e).__name__}: {e})")

    if "enable_gqa" in forms:
        y_r, dk_r = repeated()
        y_g, dk_g = grouped()
        print(f"enable_gqa against repeated: output max |diff| {(y_r - y_g).abs().max().item():.3g}, "
              f"k's gradient max |diff| {(dk_r - dk_g).abs().max().item():.3g}")

    for fn in forms.values():  # warm up (cuDNN builds its graphs on first use)
        fn()
    torch.cuda.synchronize()
    times = {name: [] for name in forms}
    for r in range(rounds):
        order = list(forms.items()) if r % 2 == 0 else list(reversed(forms.items()))
        for name, fn in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    for name, t in times.items():
        t = sorted(t)
        print(f"{name}: forward + backward {t[len(t) // 2]:.3f} ms (median of {rounds}; {t[0]:.3f}-{t[-1]:.3f})")

    # The kernels each form runs, by GPU time (one call each, after the warm-up).
    def gpu_us(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0

    try:
        from torch.profiler import ProfilerActivity, profile
        for name, fn in forms.items():
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            rows = sorted((e for e in prof.key_averages() if gpu_us(e) > 0), key=lambda e: -gpu_us(e))
            print(f"{name}: kernels by GPU time")
            for e in rows[:6]:
                print(f"  {gpu_us(e):9.1f} us  x{e.count:<3d} {e.key[:110]}")
    except Exception as e:  # noqa: BLE001 (the times above stand without the list)
        print(f"kernel list not available ({type(e).__name__}: {e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
