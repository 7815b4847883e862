"""The median of a ds run's steps after its first two (metrics.jsonl): tokens/s, step time, and MFU by
nanoGPT's formula (6 N + 12 L C T FLOPs a token) when the model's shape and the card's peak are given,
so ds's line reads like bench/pytorch_gpt2_cuda.py's.

usage: metrics_median.py NAME METRICS_JSONL [PARAMS LAYERS WIDTH SEQ PEAK_TFLOPS]
"""
import json
import statistics
import sys


def main():
    name, path = sys.argv[1], sys.argv[2]
    with open(path) as f:
        steps = [json.loads(line) for line in f if line.strip()][2:]
    if not steps:
        sys.exit(f"{name}: {path} has no steps after the first two")
    step_s = statistics.median(s["step_s"] for s in steps)
    tokens_s = statistics.median(s["tokens_per_s"] for s in steps)
    line = f"{name}: median {tokens_s:,.0f} tokens/s, step {step_s * 1e3:.1f} ms over {len(steps)} steps"
    if len(sys.argv) >= 8:
        n, layers, width, seq, peak = (float(a) for a in sys.argv[3:8])
        flops_per_token = 6 * n + 12 * layers * width * seq
        line += f", MFU {tokens_s * flops_per_token / (peak * 1e12):.3f}"
    print(line)


if __name__ == "__main__":
    main()
