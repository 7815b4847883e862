#!/usr/bin/env python3
"""Writes a checkpoint folder in DeepSpeed's layout, as engine.save_checkpoint lays it out, for the cases the
real DeepSpeed checkpoints of the tests do not cover (ZeRO-1, three ranks with padding, bf16 and fp16 module
weights, frozen and tied parameters). Python's standard library only: torch.save's zip container (zipfile,
members STORED under "<stem>/") and its pickle (pickle, protocol 2), with small stand-ins registered under
torch's and collections' names so the pickle names the same globals torch.save writes. The layout follows
DeepSpeed's documented partitioning (stage_1_and_2.py, partition_parameters.py, zero_to_fp32.py):

  stages 1-2: each parameter group flattened in order, padded with zeros at the end to a multiple of
              2 x world, cut in `world` equal slices; rank r saves its slice without the padding it holds;
  stage 3:    each parameter cut in ceil(n / world) elements per rank, the last rank's tail padded (with a
              huge value here, as DeepSpeed does not zero it: a reader must skip it); each rank's slices
              back to back, in two sub-groups;
  stage 0:    the module holds the weights; with bf16, bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt
              holds the fp32 master as stage 1 lays it out.

Frozen parameters (stages 2-3) go to frozen_param_shapes / frozen_param_fragments (stage 2: whole; stage 3: a
padded slice per rank), a tied one to shared_params. Beside the folder it writes what a consolidation must
give, computed here from the values it wrote: expected_master.safetensors (the fp32 master; frozen
parameters as their module dtype's values) and expected_module.safetensors (the module's weights, widened).

    python3 tests/tools/write_deepspeed_checkpoint.py OUT --stage S --world W --dtype fp32|bf16|fp16 [--frozen] [--tied]
    python3 tests/tools/write_deepspeed_checkpoint.py OUT --big    (bench/bench_deepspeed_convert.sh)

--big writes a TinyLlama-shaped model (1.1B parameters: vocab 32000, hidden 2048, 22 layers, 4 kv heads,
intermediate 5632) at ZeRO-2 on --world ranks (default 2; 1 makes a 4.4 GB optimizer file, past ZIP64's
4 GiB) in bf16, its storages streamed in 64 MiB chunks of a repeated
value (no expected files): a checkpoint of real size, for measuring a reader's memory.
"""
import argparse
import collections
import io
import json
import os
import pickle
import struct
import sys
import types
import zipfile

# --- stand-ins under torch's names, so the pickle says GLOBAL torch._utils _rebuild_tensor_v2 etc. ---
torch = types.ModuleType("torch")
torch_utils = types.ModuleType("torch._utils")


def _rebuild_tensor_v2(*args):
    raise RuntimeError("never called: this writer only pickles")


_rebuild_tensor_v2.__module__ = "torch._utils"
torch_utils._rebuild_tensor_v2 = _rebuild_tensor_v2
for cls_name in ("FloatStorage", "BFloat16Storage", "HalfStorage"):
    setattr(torch, cls_name, type(cls_name, (), {"__module__": "torch"}))
torch._utils = torch_utils
sys.modules["torch"] = torch
sys.modules["torch._utils"] = torch_utils
Size = type("Size", (tuple,), {"__module__": "torch", "__reduce__": lambda self: (Size, (tuple(self),))})
torch.Size = Size

STORAGE = {"fp32": ("FloatStorage", 4), "bf16": ("BFloat16Storage", 2), "fp16": ("HalfStorage", 2)}


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def bf16_bits(x):  # round to nearest even
    b = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def encode(values, dtype):
    if dtype == "fp32":
        return struct.pack("<%df" % len(values), *values)
    if dtype == "bf16":
        return struct.pack("<%dH" % len(values), *[bf16_bits(v) for v in values])
    return struct.pack("<%de" % len(values), *values)


def decode(data, dtype):
    if dtype == "fp32":
        return list(struct.unpack("<%df" % (len(data) // 4), data))
    if dtype == "bf16":
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in struct.unpack("<%dH" % (len(data) // 2), data)]
    return list(struct.unpack("<%de" % (len(data) // 2), data))


class Storage:
    def __init__(self, key, dtype, data, numel=None):
        self.key, self.dtype, self.data = key, dtype, data
        self.numel = numel if numel is not None else len(data) // STORAGE[dtype][1]


class Tensor:
    """A contiguous tensor over a whole storage, pickled as torch.save pickles one."""

    def __init__(self, storage, shape):
        self.storage, self.shape = storage, tuple(shape)

    def __reduce__(self):
        stride, acc = [], 1
        for d in reversed(self.shape):
            stride.insert(0, acc)
            acc *= d
        return (_rebuild_tensor_v2, (self.storage, 0, self.shape, tuple(stride), False, collections.OrderedDict()))


class TorchSaver:
    def __init__(self):
        self.storages = []

    def tensor(self, values, dtype, shape):
        s = Storage(str(len(self.storages)), dtype, encode(values, dtype))
        self.storages.append(s)
        return Tensor(s, shape)

    def big(self, numel, dtype, shape):
        """A tensor of `numel` copies of one value, never held in memory."""
        s = Storage(str(len(self.storages)), dtype, encode([0.5] * (4 // STORAGE[dtype][1]), dtype), numel)
        self.storages.append(s)
        return Tensor(s, shape)

    def save(self, obj, path):
        stem = os.path.splitext(os.path.basename(path))[0]
        buf = io.BytesIO()
        saver = self

        class P(pickle.Pickler):
            def persistent_id(self, o):
                if isinstance(o, Storage):
                    name, width = STORAGE[o.dtype]
                    return ("storage", getattr(torch, name), o.key, "cpu", o.numel)
                return None

        P(buf, protocol=2).dump(obj)
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
            z.writestr(stem + "/data.pkl", buf.getvalue())
            for s in saver.storages:
                width = STORAGE[s.dtype][1]
                if len(s.data) == s.numel * width:
                    z.writestr(stem + "/data/" + s.key, s.data)
                    continue
                # A large storage: a repeated 4-byte value, streamed (ZIP64 sizes and offsets where needed).
                with z.open(stem + "/data/" + s.key, "w", force_zip64=True) as f:
                    left, chunk = s.numel * width, s.data * ((64 << 20) // len(s.data))
                    while left > 0:
                        f.write(chunk[:left])
                        left -= min(left, len(chunk))
            z.writestr(stem + "/version", "3\n")


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name, (shape, values) in tensors.items():
        data = struct.pack("<%df" % len(values), *values)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def write_big(out, W):
    V, H, L, KV, I, heads = 32000, 2048, 22, 4, 5632, 32
    kv = H // heads * KV
    shapes = [("model.embed_tokens.weight", (V, H))]
    for i in range(L):
        p = "model.layers.%d." % i
        shapes += [(p + "self_attn.q_proj.weight", (H, H)), (p + "self_attn.k_proj.weight", (kv, H)), (p + "self_attn.v_proj.weight", (kv, H)),
                   (p + "self_attn.o_proj.weight", (H, H)), (p + "mlp.gate_proj.weight", (I, H)), (p + "mlp.up_proj.weight", (I, H)),
                   (p + "mlp.down_proj.weight", (H, I)), (p + "input_layernorm.weight", (H,)), (p + "post_attention_layernorm.weight", (H,))]
    shapes += [("model.norm.weight", (H,)), ("lm_head.weight", (V, H))]
    numel = {n: (s[0] * s[1] if len(s) == 2 else s[0]) for n, s in shapes}
    groups = [[n for n, s in shapes if len(s) == 2], [n for n, s in shapes if len(s) == 1]]
    d = os.path.join(out, "global_step1")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(out, "latest"), "w") as f:
        f.write("global_step1")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    s = TorchSaver()
    s.save({"module": collections.OrderedDict((n, s.big(numel[n], "bf16", sh)) for n, sh in shapes), "buffer_names": [],
            "optimizer": None, "param_shapes": [collections.OrderedDict((n, Size(dict(shapes)[n])) for n in g) for g in groups],
            "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None, "global_steps": 1, "global_samples": 2,
            "skipped_steps": 0, "dp_world_size": W, "mp_world_size": 1, "ds_config": config, "ds_version": "0.14.4"},
           os.path.join(d, "mp_rank_00_model_states.pt"))
    for r in range(W):
        s = TorchSaver()
        parts = []
        for g in groups:
            total = sum(numel[n] for n in g)
            p = (total + (-total % (2 * W))) // W
            kept = max(0, min(p, total - r * p))
            parts.append(s.big(kept, "fp32", (kept,)))
        osd = {"zero_stage": 2, "loss_scaler": None, "single_partition_of_fp32_groups": parts, "partition_count": [W, W],
               "base_optimizer_state": {"state": {}, "param_groups": []}}
        s.save({"optimizer_state_dict": osd, "ds_config": config}, os.path.join(d, "zero_pp_rank_%d_mp_rank_00_optim_states.pt" % r))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--stage", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--frozen", action="store_true")
    ap.add_argument("--tied", action="store_true")
    a = ap.parse_args()
    if a.big:
        return write_big(a.out, a.world or 2)
    if a.stage is None or a.world is None or a.dtype is None:
        ap.error("--stage, --world and --dtype are required (or --big)")
    W, stage, dtype = a.world, a.stage, a.dtype
    # Odd sizes, so the groups and parameters need padding at three ranks.
    # A one-layer Llama (hidden 8, 2 heads of 4, one kv head, intermediate 5, vocab 13): sizes that need
    # padding at three ranks; config.json beside the checkpoint describes it, as the Trainer saves one.
    L = "model.layers.0."
    shapes = collections.OrderedDict([
        ("model.embed_tokens.weight", (13, 8)), (L + "self_attn.q_proj.weight", (8, 8)), (L + "self_attn.k_proj.weight", (4, 8)),
        (L + "self_attn.v_proj.weight", (4, 8)), (L + "self_attn.o_proj.weight", (8, 8)), (L + "mlp.gate_proj.weight", (5, 8)),
        (L + "mlp.up_proj.weight", (5, 8)), (L + "mlp.down_proj.weight", (8, 5)), (L + "input_layernorm.weight", (8,)),
        (L + "post_attention_layernorm.weight", (8,)), ("model.norm.weight", (8,)), ("lm_head.weight", (13, 8))])
    frozen = ["model.layers.0.mlp.up_proj.weight"] if a.frozen else []
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if a.tied else {}
    numel = {n: (s[0] * s[1] if len(s) == 2 else s[0]) for n, s in shapes.items()}
    # The fp32 master values: a fixed sequence; the module's are their rounding to the training dtype.
    master, seed = {}, 12345
    for n in shapes:
        vals = []
        for _ in range(numel[n]):
            seed = (seed * 1103515245 + 12345) % (1 << 31)
            vals.append(f32((seed / (1 << 31) - 0.5) * 0.2))
        master[n] = vals
    module = {n: decode(encode(v, dtype), dtype) for n, v in master.items()}
    trainable = [n for n in shapes if n not in frozen and n not in tied]
    groups = [[n for n in trainable if len(shapes[n]) == 2], [n for n in trainable if len(shapes[n]) == 1]]
    tag = "global_step7"
    d = os.path.join(a.out, tag)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(a.out, "latest"), "w") as f:
        f.write(tag)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": stage},
              "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}

    def model_states(saver, rank):
        mod = collections.OrderedDict()
        for n in shapes:
            if stage == 3 and n not in frozen:
                mod[n] = saver.tensor([], dtype, (0,))  # ZeRO-3's placeholders
            else:
                src = tied.get(n, n)
                mod[n] = saver.tensor(module[src], dtype, shapes[n])
        state = {"module": mod, "buffer_names": [], "optimizer": None,
                 "param_shapes": [collections.OrderedDict((n, Size(shapes[n])) for n in g) for g in groups] if stage or dtype == "bf16" else None,
                 "frozen_param_shapes": collections.OrderedDict((n, Size(shapes[n])) for n in frozen) if stage >= 2 and frozen else None,
                 "shared_params": dict(tied), "frozen_param_fragments": None, "lr_scheduler": None, "global_steps": 7,
                 "global_samples": 7 * 2 * W, "skipped_steps": 0, "dp_world_size": W, "mp_world_size": 1, "ds_config": config,
                 "ds_version": "0.14.4"}
        if stage >= 2 and frozen:
            frags = {}
            for n in frozen:
                if stage == 2:
                    frags[n] = saver.tensor(module[n], dtype, shapes[n])
                else:
                    p = -(-numel[n] // W)
                    part = (module[n] + [0.0] * (p * W - numel[n]))[rank * p:(rank + 1) * p]
                    frags[n] = saver.tensor(part, dtype, (p,))
            state["frozen_param_fragments"] = frags
        if stage == 0 and dtype != "bf16":
            state["optimizer"] = {"state": {}, "param_groups": []}
        return state

    if stage == 3:
        for r in range(W):
            s = TorchSaver()
            s.save(model_states(s, r), os.path.join(d, "zero_pp_rank_%d_mp_rank_00_model_states.pt" % r))
    else:
        s = TorchSaver()
        s.save(model_states(s, 0), os.path.join(d, "mp_rank_00_model_states.pt"))

    if stage in (1, 2) or (stage == 0 and dtype == "bf16"):
        prefix = "bf16_" if stage == 0 else ""
        for r in range(W):
            s = TorchSaver()
            parts, paddings, full = [], [], []
            for g in groups:
                flat = [v for n in g for v in master[n]]
                padded = len(flat) + (-len(flat) % (2 * W))
                p = padded // W
                lo, hi = r * p, (r + 1) * p
                kept = flat[lo:min(hi, len(flat))]
                paddings.append(p - len(kept))
                full.append(p)
                parts.append(s.tensor(kept, "fp32", (len(kept),)))
            # Adam's moments: one flat tensor per group, the rank's whole slice with its padding (the fp32 slice
            # is saved without it).
            state = {g: {"step": 7, "exp_avg": s.tensor([0.0] * n, "fp32", (n,)), "exp_avg_sq": s.tensor([0.0] * n, "fp32", (n,))}
                     for g, n in enumerate(full)}
            osd = {"loss_scaler": None, "dynamic_loss_scale": dtype == "fp16", "overflow": False, "clip_grad": 1.0,
                   "base_optimizer_state": {"state": state, "param_groups": []},
                   "single_partition_of_fp32_groups": parts, "group_paddings": paddings, "partition_count": [W] * len(groups),
                   "ds_version": "0.14.4"}
            if stage:
                osd["zero_stage"] = stage
            s.save({"optimizer_state_dict": osd, "ds_config": config, "ds_version": "0.14.4"},
                   os.path.join(d, prefix + "zero_pp_rank_%d_mp_rank_00_optim_states.pt" % r))
    elif stage == 3:
        names = [n for g in groups for n in g]
        for r in range(W):
            s = TorchSaver()
            flat = []
            for n in names:
                p = -(-numel[n] // W)
                flat += (master[n] + [1e30] * (p * W - numel[n]))[r * p:(r + 1) * p]
            cut = -(-numel[names[0]] // W)  # two sub-groups: the first parameter, then the rest
            subs = [s.tensor(flat[:cut], "fp32", (cut,)), s.tensor(flat[cut:], "fp32", (len(flat) - cut,))]
            osd = {"zero_stage": 3, "loss_scaler": None, "dynamic_loss_scale": False, "overflow": False, "partition_count": W,
                   "optimizer_state_dict": {"state": {k: {"step": 7, "exp_avg": s.tensor([0.0] * t.shape[0], "fp32", t.shape),
                                                          "exp_avg_sq": s.tensor([0.0] * t.shape[0], "fp32", t.shape)}
                                                      for k, t in enumerate(subs)}, "param_groups": []},
                   "fp32_flat_groups": subs}
            s.save({"optimizer_state_dict": osd, "ds_config": config, "ds_version": "0.14.4"},
                   os.path.join(d, "zero_pp_rank_%d_mp_rank_00_optim_states.pt" % r))

    has_master = stage > 0 or dtype == "bf16"
    exported = [n for n in shapes if n not in tied]
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "intermediate_size": 5,
                   "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": 13,
                   "max_position_embeddings": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": a.tied,
                   "hidden_act": "silu", "torch_dtype": "float32"}, f, indent=1)
    write_safetensors(os.path.join(a.out, "expected_master.safetensors"),
                      collections.OrderedDict((n, (shapes[n], master[n] if has_master and n not in frozen else module[n])) for n in exported))
    write_safetensors(os.path.join(a.out, "expected_module.safetensors"),
                      collections.OrderedDict((n, (shapes[n], module[n])) for n in exported))


if __name__ == "__main__":
    main()
