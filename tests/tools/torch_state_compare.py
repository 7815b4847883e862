#!/usr/bin/env python3
"""An independent check of a consolidation: reads a torch.save state dict (pytorch_model.bin, such as
DeepSpeed's zero_to_fp32.py writes) with Python's own zipfile and pickle modules, torch absent (the few torch
globals a state dict names are stood in for by small functions here), reads a .safetensors file with the json
and struct modules, and compares every tensor byte for byte (both fp32).

    python3 tests/tools/torch_state_compare.py STATE_DICT.bin[:KEY] EXPORT.safetensors [ALIAS=SOURCE ...]

STATE_DICT.bin:KEY takes the state dict under KEY of the file's top-level dict (a DeepSpeed model-states
file's `module`); a STATE_DICT ending in .safetensors is read as one (an expected consolidation).

ALIAS=SOURCE: a tied tensor the export writes once (lm_head.weight=transformer.wte.weight): the state dict's
ALIAS is compared with the export's SOURCE. Prints one line per tensor and exits 1 on any difference, on a
tensor only one side holds, or on a shape that differs."""
import collections
import json
import pickle
import struct
import sys
import zipfile


class Storage:
    def __init__(self, data, itemsize):
        self.data, self.itemsize = data, itemsize


def rebuild_tensor(storage, offset, size, stride, *_):
    # A contiguous view: the bytes of numel elements from offset (a state dict's tensors are).
    numel = 1
    for d in size:
        numel *= d
    expect = 1
    for d, s in zip(reversed(size), reversed(stride)):
        assert d == 1 or s == expect, "a strided tensor"
        expect *= d
    b = storage.data[offset * storage.itemsize:(offset + numel) * storage.itemsize]
    return (tuple(size), b)


def read_state_dict(path):
    z = zipfile.ZipFile(path)
    pkl = [n for n in z.namelist() if n.endswith("data.pkl")]
    assert len(pkl) == 1, "not a torch.save zip"
    record = pkl[0][: -len("data.pkl")]

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                return rebuild_tensor
            if (module, name) == ("collections", "OrderedDict"):
                return collections.OrderedDict
            if module == "torch" and name == "FloatStorage":
                return "F32"
            if (module, name) == ("torch", "Size"):
                return tuple
            if (module, name) in (("__builtin__", "set"), ("builtins", "set")):
                return set
            raise pickle.UnpicklingError(f"{module}.{name} is not part of an fp32 state dict")

        def persistent_load(self, pid):
            kind, dtype, key, _location, _numel = pid
            assert kind == "storage" and dtype == "F32"
            return Storage(z.read(record + "data/" + key), 4)

    return Unpickler(z.open(pkl[0])).load()


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", f"{name}: this check takes F32 exports"
        a, b = t["data_offsets"]
        out[name] = (tuple(t["shape"]), data[8 + n + a:8 + n + b])
    return out


def main():
    path, _, key = sys.argv[1].partition(".pt:") if ".pt:" in sys.argv[1] else (sys.argv[1], "", "")
    state = read_safetensors(path) if path.endswith(".safetensors") else read_state_dict(path + ".pt" if key else path)
    if key:
        state = {k: v for k, v in state[key].items() if isinstance(v, tuple)}
    export = read_safetensors(sys.argv[2])
    tied = dict(a.split("=", 1) for a in sys.argv[3:])
    bad = 0
    for name, (shape, b) in state.items():
        theirs = export.get(tied.get(name, name))
        if theirs is None:
            print(f"MISSING {name}")
            bad += 1
        elif theirs[0] != shape or theirs[1] != b:
            print(f"DIFFERS {name} {shape} vs {theirs[0]}")
            bad += 1
        else:
            print(f"equal {name} {shape}")
    for name in export:
        if name not in state:
            print(f"EXTRA {name}")
            bad += 1
    print(f"{len(state)} tensors, {bad} differ")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
