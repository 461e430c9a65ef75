"""zerort's safetensors against the `safetensors` package: files zerort writes load with
safetensors.numpy.load_file (BF16, which numpy lacks, decoded by hand from the raw bytes) and
hold exactly the masters zerort dumped; files the package writes (F64, F32, F16, an integer
buffer; one file and a sharded set with its index) import into zerort as the values numpy
converts them to; and the same through name maps (Hugging Face's names, a tied head and a
rotary buffer ignored).

usage: hf_check.py ST_TOOL TMPDIR
"""
import json
import os
import struct
import subprocess
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

TOOL, TMP = sys.argv[1], sys.argv[2]
SHAPES = {"emb": (7, 3), "w": (3, 4), "b": (4,), "h.0.g": (5,)}
failures = []


def check(ok, what):
    print(("ok  " if ok else "FAIL") + " " + what)
    if not ok:
        failures.append(what)


def tool(*args):
    subprocess.run([TOOL, *args], check=True)


def read_dump(path):
    values, ignored = {}, []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if parts[0] == "ignored":
                ignored.append(parts[1])
            else:
                values[parts[0]] = np.array([float(x) for x in parts[1:]], dtype=np.float32)
    return values, ignored


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def bf16_round(a):
    """fp32 -> bf16 -> fp32, round to nearest even, in integer arithmetic (finite values)."""
    u = bits(a).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return (u.astype(np.uint32) << 16).view(np.float32)


def raw_bf16(path):
    """Each tensor of a BF16 file, decoded from the bytes the header's offsets name."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        u = np.frombuffer(data[8 + n + b : 8 + n + e], dtype="<u2").astype(np.uint32) << 16
        out[name] = u.view(np.float32).reshape(t["shape"])
    return out


def zerort_writes():
    f32, bf16 = os.path.join(TMP, "zr32.safetensors"), os.path.join(TMP, "zr16.safetensors")
    dump = os.path.join(TMP, "zr.dump")
    tool("write", f32, "fp32", "0", dump)
    tool("write", bf16, "bf16", "0", dump)
    want, _ = read_dump(dump)
    got = load_file(f32)
    check(sorted(got) == sorted(SHAPES), "load_file finds every tensor of the fp32 file")
    for name, shape in SHAPES.items():
        a = got[name]
        check(a.dtype == np.float32 and a.shape == shape, f"{name}: float32 {shape}")
        check(np.array_equal(bits(a.ravel()), bits(want[name])), f"{name}: fp32 bits as dumped")
    with safe_open(f32, framework="np") as f:
        check(f.metadata() == {"format": "pt"}, 'metadata is {"format": "pt"}')
    again = os.path.join(TMP, "again.safetensors")
    save_file(got, again, metadata={"format": "pt"})
    with open(f32, "rb") as a, open(again, "rb") as b:
        check(a.read() == b.read(), "save_file of what load_file read gives zerort's bytes")
    with safe_open(bf16, framework="np") as f:
        for name, shape in SHAPES.items():
            s = f.get_slice(name)
            check(s.get_dtype() == "BF16" and tuple(s.get_shape()) == shape, f"{name}: BF16 {shape}")
    raw = raw_bf16(bf16)
    for name in SHAPES:
        check(np.array_equal(bits(raw[name].ravel()), bits(bf16_round(want[name]))),
              f"{name}: bf16 values are the dumped masters rounded to nearest even")
    sharded = os.path.join(TMP, "zr_sharded")
    tool("write", sharded, "fp32", "64", dump)
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        index = json.load(f)
    total = sum(int(np.prod(s)) * 4 for s in SHAPES.values())
    check(index["metadata"]["total_size"] == total, f"index total_size {total}")
    merged = {}
    for file in sorted(set(index["weight_map"].values())):
        for name, a in load_file(os.path.join(sharded, file)).items():
            check(index["weight_map"][name] == file, f"{name} is in {file}, as the index says")
            merged[name] = a
    check(sorted(merged) == sorted(SHAPES), "the shards hold every tensor once")
    for name in SHAPES:
        check(np.array_equal(bits(merged[name].ravel()), bits(want[name])), f"shard {name} bits")


def package_writes():
    rng = np.random.default_rng(27)
    tensors = {
        "emb": rng.standard_normal(SHAPES["emb"]).astype(np.float64),
        "w": rng.standard_normal(SHAPES["w"]).astype(np.float32),
        "b": rng.standard_normal(SHAPES["b"]).astype(np.float16),
        "h.0.g": (rng.standard_normal(SHAPES["h.0.g"]) * 1e-6).astype(np.float32),
        "attn.bias": np.arange(6, dtype=np.int64),
    }
    want = {k: v.astype(np.float32).ravel() for k, v in tensors.items() if k in SHAPES}
    one = os.path.join(TMP, "hf.safetensors")
    save_file(tensors, one)
    shard_dir = os.path.join(TMP, "hf_sharded")
    os.makedirs(shard_dir, exist_ok=True)
    files = {"a.safetensors": ["emb", "attn.bias"], "b.safetensors": ["w", "b", "h.0.g"]}
    for file, names in files.items():
        save_file({n: tensors[n] for n in names}, os.path.join(shard_dir, file))
    with open(os.path.join(shard_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0},
                   "weight_map": {n: file for file, names in files.items() for n in names}}, f)
    for label, path in (("one file", one), ("sharded set", shard_dir)):
        dump = os.path.join(TMP, "hf.dump")
        tool("read", path, dump)
        got, ignored = read_dump(dump)
        check(ignored == ["attn.bias"], f"{label}: the int64 buffer is ignored and listed")
        for name in SHAPES:
            check(np.array_equal(bits(got[name]), bits(want[name])),
                  f"{label}: {name} ({tensors[name].dtype}) imports as numpy's float32")


# Hugging Face's names for the tool's parameters, and the rules both ways (checkpoint/weights.h).
HF_NAMES = {"emb": "model.embed_tokens.weight", "w": "model.layers.0.mlp.weight",
            "b": "model.layers.0.mlp.bias", "h.0.g": "model.layers.0.norm.weight"}
IN_MAP = r"""# file -> parameter
exact  model.embed_tokens.weight  emb
regex  model\.layers\.0\.mlp\.(w|b)\w*  $1
glob   model.layers.*.norm.weight  h.*.g
ignore lm_head.weight
ignore *.inv_freq
"""
OUT_MAP = r"""# parameter -> file
exact emb model.embed_tokens.weight
exact w   model.layers.0.mlp.weight
exact b   model.layers.0.mlp.bias
glob  h.*.g  model.layers.*.norm.weight
"""


def name_maps():
    in_map, out_map = os.path.join(TMP, "in.map"), os.path.join(TMP, "out.map")
    for path, text in ((in_map, IN_MAP), (out_map, OUT_MAP)):
        with open(path, "w") as f:
            f.write(text)
    # The package writes HF-named tensors, a tied head and a rotary buffer; zerort imports them
    # through the map.
    rng = np.random.default_rng(31)
    hf = {HF_NAMES[k]: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    extra = dict(hf)
    extra["lm_head.weight"] = hf["model.embed_tokens.weight"].copy()
    extra["model.layers.0.rotary_emb.inv_freq"] = np.arange(4, dtype=np.float32)
    named = os.path.join(TMP, "hf_named.safetensors")
    save_file(extra, named)
    dump = os.path.join(TMP, "mapped.dump")
    tool("read", named, dump, in_map)
    got, ignored = read_dump(dump)
    check(ignored == ["lm_head.weight", "model.layers.0.rotary_emb.inv_freq"],
          "mapped import: the tied head and the inv_freq buffer are ignored and listed")
    for name in SHAPES:
        check(np.array_equal(bits(got[name]), bits(hf[HF_NAMES[name]].ravel())),
              f"mapped import: {HF_NAMES[name]} loads into {name}")
    # zerort exports through the inverse map: the package's own file of the same tensors under
    # the same names holds the same bytes.
    out, wdump = os.path.join(TMP, "zr_named.safetensors"), os.path.join(TMP, "w.dump")
    tool("write", out, "fp32", "0", wdump, out_map)
    back = load_file(out)
    check(sorted(back) == sorted(HF_NAMES.values()), "mapped export: the file holds HF's names")
    wrote, _ = read_dump(wdump)
    for k, hf_name in HF_NAMES.items():
        check(back[hf_name].shape == SHAPES[k] and
              np.array_equal(bits(back[hf_name].ravel()), bits(wrote[k])),
              f"mapped export: {hf_name} holds {k}'s masters")
    again = os.path.join(TMP, "again_named.safetensors")
    save_file({HF_NAMES[k]: wrote[k].reshape(SHAPES[k]) for k in SHAPES}, again,
              metadata={"format": "pt"})
    with open(out, "rb") as a, open(again, "rb") as b:
        check(a.read() == b.read(),
              "mapped export: save_file of the same tensors under HF's names gives zerort's bytes")


zerort_writes()
package_writes()
name_maps()
print(f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
