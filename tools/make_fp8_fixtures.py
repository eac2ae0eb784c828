#!/usr/bin/env python3
"""make_fp8_fixtures.py - FP8 (e4m3) checkpoints of a tiny float model, for test_fp8.

Reads a float safetensors fixture (tests/fixtures/models/<name>: config.json, model.safetensors
in F32 or BF16), quantizes its decoder Linears (q/k/v/o_proj, gate/up/down_proj) to FP8 e4m3
with numpy and writes, for each variant, two checkpoints:

  OUT/<variant>/      config.json with the variant's quantization_config, model.safetensors
                      with <module>.weight as F8_E4M3 codes and its scales as the format
                      names them (weight_scale / weight_scale_inv, input_scale when static)
  OUT/<variant>_ref/  the same model with every Linear's dequantized weights as plain F32
                      <module>.weight (the exact f32 values f32(e4m3(q) * s)), no
                      quantization_config

Variants (SRC's Linears; "ignored" modules stay in the source's float dtype):
  ct_tensor     compressed-tensors float-quantized, per-tensor F32 weight_scale [1], static
                per-tensor input_scale; ignore: lm_head, model.layers.1.mlp.down_proj
  ct_channel    compressed-tensors, per-channel BF16 weight_scale [N, 1], dynamic per-token
                activations; ignore: lm_head and "re:" patterns for layer 0's up_proj (so the
                fused gate/up mixes FP8 and float: Kiln dequantizes it at load)
  block         quant_method fp8, weight_block_size [128, 128], F32 weight_scale_inv
                [ceil(N / 128), ceil(K / 128)], dynamic activations
  block_small   the same with blocks of [16, 48] (partial blocks along K)
  fly           no checkpoint: OUT/fly_ref only, the dequantized weights [model]
                quantization = fp8 makes at load (s = f32(absmax_row) / 448 in f32, codes
                RNE(w / s) in f32, saturating), for the test to compare Kiln against
  bad_e5m2, bad_noscale, bad_scale_shape, bad_nan, bad_ignored, bad_static: ct_channel /
                ct_tensor with one defect each (an F8_E5M2 weight, a missing weight_scale, a
                scale of shape [1, N], a NaN code, an FP8 weight in an ignored module, a
                missing input_scale), for the refusals (no _ref)

The e4m3 encoding (OCP E4M3FN: bias 7, subnormals, max 448, no infinities, round to nearest
even, saturating) is written here from the format description, independently of Kiln's C
code. Deterministic. Usage:
  make_fp8_fixtures.py SRC_DIR OUT_DIR [VARIANT ...]
"""
import json
import os
import struct
import sys

import numpy as np

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VARIANTS = ("ct_tensor", "ct_channel", "block", "block_small", "fly", "bad_e5m2", "bad_noscale",
            "bad_scale_shape", "bad_nan", "bad_ignored", "bad_static")


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """Round to nearest even (finite inputs)."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = data[base + b : base + e]
        if info["dtype"] == "F32":
            arr = np.frombuffer(raw, "<f4").astype(np.float32)
        elif info["dtype"] == "BF16":
            arr = bf16_to_f32(np.frombuffer(raw, "<u2"))
        else:
            raise SystemExit(f"{path}: {name}: dtype {info['dtype']} not handled here")
        out[name] = (arr.reshape(info["shape"]), info["dtype"])
    return out


def write_safetensors(path, tensors):
    """tensors: name -> (array, safetensors dtype); F8_* arrays are uint8 codes, BF16 uint16."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a, dt = tensors[name]
        a = np.ascontiguousarray(a)
        if dt == "F32":
            raw = a.astype("<f4").tobytes()
        elif dt == "BF16":
            raw = (a if a.dtype == np.uint16 else f32_to_bf16(a)).astype("<u2").tobytes()
        else:  # F8_E4M3, F8_E5M2
            raw = a.astype(np.uint8).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def e4m3_encode(x):
    """f32 array -> uint8 E4M3FN codes, round to nearest even, |x| >= 448 saturating."""
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    sign = np.where(np.signbit(x), 0x80, 0).astype(np.int64)
    e = np.frexp(np.where(a > 0, a, 1.0))[1] - 1.0  # a in [2^e, 2^(e+1)), exactly
    e = np.clip(e, -6, 8)  # below 2^-6: the subnormal quantum 2^-9
    quantum = np.exp2(e - 3)
    v = np.round(a / quantum) * quantum  # exact division by a power of two; half to even
    v = np.minimum(v, 448.0)
    # The code of v (a representable value).
    codes = np.zeros(x.shape, np.int64)
    sub = v < 2.0**-6
    codes[sub] = (v[sub] / 2.0**-9).astype(np.int64)
    nv = v[~sub]
    ne = np.frexp(nv)[1] - 1.0
    m = (nv / np.exp2(ne) - 1.0) * 8.0
    codes[~sub] = ((ne.astype(np.int64) + 7) << 3) | m.astype(np.int64)
    return (codes | sign).astype(np.uint8)


def e4m3_value(q):
    """uint8 codes (no NaN) -> float64 values, from the definition."""
    q = q.astype(np.int64)
    e, m = (q >> 3) & 15, q & 7
    v = np.where(e > 0, np.exp2(e - 7.0) * (1.0 + m / 8.0), np.exp2(-6.0) * (m / 8.0))
    return np.where(q & 0x80, -v, v)


def dequant(codes, s_rows):
    """codes [N, K], s_rows [N, K] float32 scales -> the f32 product, rounded once."""
    return (e4m3_value(codes) * s_rows.astype(np.float64)).astype(np.float32)


def quant_tensor(w):
    s = np.float32(np.abs(w).max()) / np.float32(448.0)
    s = np.float32(s if s > 0 else 1.0)
    q = e4m3_encode((w / s).astype(np.float32))
    return q, np.array([s], np.float32), dequant(q, np.full(w.shape, s, np.float32))


def quant_channel(w):
    """Per-row scales, as [N, 1]; s in f32 (the BF16 checkpoint stores them rounded first)."""
    amax = np.abs(w).max(axis=1).astype(np.float32)
    s = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    return s


def quant_rows(w, s):
    q = e4m3_encode((w / s[:, None]).astype(np.float32))
    return q, dequant(q, np.repeat(s[:, None], w.shape[1], axis=1))


def quant_block(w, bn, bk):
    n, k = w.shape
    rb, cb = -(-n // bn), -(-k // bk)
    s = np.zeros((rb, cb), np.float32)
    for i in range(rb):
        for j in range(cb):
            amax = np.float32(np.abs(w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]).max())
            s[i, j] = amax / np.float32(448.0) if amax > 0 else np.float32(1.0)
    full = np.repeat(np.repeat(s, bn, axis=0), bk, axis=1)[:n, :k]
    q = e4m3_encode((w / full).astype(np.float32))
    return q, s, dequant(q, full)


def is_linear(tname):
    return tname.endswith(".weight") and tname[: -len(".weight")].rsplit(".", 1)[-1] in LINEARS


def make_variant(src_dir, out_dir, name):
    src = read_safetensors(os.path.join(src_dir, "model.safetensors"))
    with open(os.path.join(src_dir, "config.json")) as f:
        config = json.load(f)
    base = {"ct_tensor": "ct_tensor", "bad_static": "ct_tensor", "block": "block",
            "block_small": "block", "fly": "fly"}.get(name, "ct_channel")
    static = base == "ct_tensor"
    ignore = ["lm_head"]
    if base == "ct_tensor":
        ignore.append("model.layers.1.mlp.down_proj")
    elif base == "ct_channel":
        ignore += [r"re:model\.layers\.0\.mlp\.up_", r"re:.*\.nonexistent$"]
    bn, bk = (16, 48) if name == "block_small" else (128, 128)
    quant, ref = {}, {}
    for tname, (w, dt) in src.items():
        mod = tname[: -len(".weight")]
        ignored = mod in ignore or (base == "ct_channel" and mod == "model.layers.0.mlp.up_proj")
        if not is_linear(tname) or (ignored and name != "bad_ignored"):
            quant[tname] = (w, dt)
            ref[tname] = (w, "F32")
            continue
        if base == "ct_tensor":
            q, s, d = quant_tensor(w)
            quant[mod + ".weight_scale"] = (s, "F32")
            quant[mod + ".input_scale"] = (np.array([0.02], np.float32), "F32")
        elif base == "ct_channel":
            s = quant_channel(w)
            s16 = f32_to_bf16(s)  # stored BF16: quantize with the stored value
            s = bf16_to_f32(s16)
            q, d = quant_rows(w, s)
            quant[mod + ".weight_scale"] = (s16.reshape(-1, 1), "BF16")
        elif base == "block":
            q, s, d = quant_block(w, bn, bk)
            quant[mod + ".weight_scale_inv"] = (s, "F32")
        else:  # fly: what [model] quantization = fp8 computes from the source
            s = quant_channel(w)
            q, d = quant_rows(w, s)
        quant[tname] = (q, "F8_E4M3")
        ref[tname] = (d, "F32")
    first = "model.layers.0.self_attn.q_proj"
    if name == "bad_e5m2":
        quant[first + ".weight"] = (quant[first + ".weight"][0], "F8_E5M2")
    elif name == "bad_noscale":
        del quant[first + ".weight_scale"]
    elif name == "bad_scale_shape":
        s, dt = quant[first + ".weight_scale"]
        quant[first + ".weight_scale"] = (s.reshape(1, -1), dt)
    elif name == "bad_nan":
        q = quant[first + ".weight"][0].copy()
        q[1, 2] = 0x7F
        quant[first + ".weight"] = (q, "F8_E4M3")
    elif name == "bad_static":
        del quant[first + ".input_scale"]
    if base == "block":
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [bn, bk], "modules_to_not_convert": None}
    else:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": "tensor" if static else "channel", "group_size": None,
                   "block_structure": None, "actorder": None, "observer": "minmax",
                   "observer_kwargs": {}}
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
                "strategy": "tensor" if static else "token", "group_size": None,
                "block_structure": None, "actorder": None, "observer": None,
                "observer_kwargs": {}}
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "quantization_status": "compressed", "global_compression_ratio": 1.5,
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                            "input_activations": acts,
                                            "output_activations": None}},
              "ignore": ignore, "kv_cache_scheme": None}
    outs = []
    if name != "fly":
        outs.append((name, quant, dict(config, quantization_config=qc)))
    if not name.startswith("bad_"):
        outs.append((name + "_ref", ref, dict(config, dtype="float32")))
    for sub, t, cfg in outs:
        d = os.path.join(out_dir, sub)
        os.makedirs(d, exist_ok=True)
        write_safetensors(os.path.join(d, "model.safetensors"), t)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    for n in sys.argv[3:] or VARIANTS:
        make_variant(sys.argv[1], sys.argv[2], n)


if __name__ == "__main__":
    main()
