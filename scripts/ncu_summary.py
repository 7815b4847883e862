"""Sums an Nsight Compute raw CSV (ncu --csv --page raw --metrics gpu__time_duration.sum) by kernel: the
kernels that take the GPU's time, largest first, with each one's share, and the same by kind (matrix
products, attention, elementwise, reductions, copies, ds's own kernels). Where the window holds two ends
of the optimizer's kernels, one whole training step between them is summed instead of the window: its
kernel count and GPU time are the step's.

usage: ncu_summary.py NCU_CSV [TOP]
"""
import collections
import csv
import re
import sys

KINDS = [  # first match wins
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|splitK", re.I)),
    ("ds kernels", re.compile(r"\bds::")),
    ("softmax / loss", re.compile(r"softmax|log_softmax|nll|cross_entropy", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("reduce", re.compile(r"reduce", re.I)),
    ("copy / cast", re.compile(r"copy|cast|fill|memset|cat_|index|gather|scatter|embedding", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled", re.I)),
]
OPTIMIZER = re.compile(r"adam_kernel|sgd_kernel|lamb_(moments|apply)_kernel")
SCALE_TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def kind_of(name):
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def read_kernels(path):
    """[(name, microseconds)] in launch order."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages are not quoted
    rows = list(csv.reader(lines))
    header = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    name_col, time_col = rows[header].index("Kernel Name"), rows[header].index("gpu__time_duration.sum")
    unit, out = "nsecond", []
    for r in rows[header + 1:]:
        if len(r) <= time_col:
            continue
        try:
            value = float(r[time_col].replace(",", ""))
        except ValueError:
            unit = r[time_col] or unit  # the units row
            continue
        out.append((r[name_col], value * SCALE_TO_US.get(unit, 1e-3)))
    return out


def one_step(kernels):
    """The kernels after one run of optimizer launches up to the end of the next, or None."""
    ends, inside = [], False
    for i, (name, _) in enumerate(kernels):
        hit = bool(OPTIMIZER.search(name))
        if inside and not hit:
            ends.append(i)
        inside = hit
    return kernels[ends[0]:ends[1]] if len(ends) >= 2 else None


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    kernels = read_kernels(path)
    step = one_step(kernels)
    chosen = step if step else kernels
    by_name, count, by_kind = collections.Counter(), collections.Counter(), collections.Counter()
    for name, us in chosen:
        short = re.sub(r"\s+", " ", name)[:110]
        by_name[short] += us
        count[short] += 1
        by_kind[kind_of(name)] += us
    total = sum(by_name.values())
    if not total:
        sys.exit(f"{path}: no kernel times found")
    what = "one training step" if step else f"the window ({len(kernels)} kernels; no whole step in it)"
    print(f"{what}: {len(chosen)} kernels, {total / 1e3:.2f} ms of GPU time (each kernel timed alone)")
    print("\nby kind:")
    for kind, us in by_kind.most_common():
        print(f"  {kind:16s} {us / 1e3:9.2f} ms  {100 * us / total:5.1f}%")
    print(f"\ntop {top} kernels (ms, share, launches, mean us):")
    for name, us in by_name.most_common(top):
        print(f"  {us / 1e3:8.2f} {100 * us / total:5.1f}% {count[name]:6d} {us / count[name]:8.1f}  {name}")


if __name__ == "__main__":
    main()
